"""PerHeadLayerNorm: a LayerNorm per head (split, one norm per head's slice, concat) becomes
one LayerNorm with a gain (and bias) per head. The reference is numpy's LayerNorm of each
head's slice with that head's own gain and bias, written here from the definition; the
module before and after the pass runs on TVM's CPU backend."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from edgetvm.relax_passes import PerHeadLayerNorm

B, S, H, D = 1, 5, 3, 8
EPS = 1e-5


def _per_head_norm(heads_first: bool, gains, biases, eps=(EPS,) * H, width=1,
                   sections_as_count=False):
    """``concat([layer_norm(split(y)[h], g_h, b_h)], axis)`` with ``y`` the input token-major
    ``x (B, S, H, D)``, or its heads moved first (``permute_dims [0, 2, 1, 3]``)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((B, S, H, D), "float32"))
    axis = 1 if heads_first else 2
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) if heads_first else x
            sections = H // width if sections_as_count else list(range(width, H, width))
            pieces = bb.emit(relax.op.split(y, sections, axis=axis))
            normed = [bb.emit(relax.op.nn.layer_norm(
                bb.emit(relax.TupleGetItem(pieces, i)), relax.const(gains[i]),
                relax.const(biases[i]), axes=[-1], epsilon=eps[i]))
                for i in range(H // width)]
            out = bb.emit_output(relax.op.concat(normed, axis=axis))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _ops(mod):
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


@pytest.mark.parametrize("heads_first, sections_as_count", [(True, False), (False, False),
                                                            (True, True)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_per_head_norm_becomes_one_norm_with_the_same_result(heads_first, sections_as_count,
                                                             with_bias):
    rng = np.random.default_rng(0)
    gains = rng.normal(1.0, 0.3, (H, D)).astype(np.float32)
    biases = (rng.normal(0.0, 0.3, (H, D)) if with_bias else np.zeros((H, D))) \
        .astype(np.float32)
    x = rng.normal(0.5, 2.0, (B, S, H, D)).astype(np.float32)
    mod = _per_head_norm(heads_first, gains, biases, sections_as_count=sections_as_count)
    new = PerHeadLayerNorm()(mod)
    ops = _ops(new)
    assert "relax.split" not in ops and "relax.concat" not in ops
    assert ops.count("relax.nn.layer_norm") == 1
    assert ("relax.add" in ops) == with_bias            # a zero bias is left out
    mean = x.mean(-1, keepdims=True)
    want = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * gains + \
        biases
    if heads_first:
        want = want.transpose(0, 2, 1, 3)
    np.testing.assert_allclose(_run(new, x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_run(mod, x), want, rtol=1e-5, atol=1e-5)


def test_norms_that_are_not_one_per_head_alike_are_left_alone():
    rng = np.random.default_rng(1)
    gains = rng.normal(1.0, 0.3, (H, D)).astype(np.float32)
    zeros = np.zeros((H, D), np.float32)
    other_eps = _per_head_norm(True, gains, zeros, eps=(EPS, EPS, 1e-3))
    assert "relax.split" in _ops(PerHeadLayerNorm()(other_eps))
