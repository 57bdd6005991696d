"""AdditiveAttentionMask: a masked fill before a softmax becomes an added mask, with the
same softmax output (run by TVM on the CPU before and after), and only where that holds."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from edgetvm.relax_passes.additive_mask import AdditiveAttentionMask

B, H, S, T, D = 1, 3, 4, 6, 8


def _attention(fill: float, fill_first: bool, with_bias: bool) -> tvm.IRModule:
    """softmax(where(hidden, fill, q @ k^T * 0.3 [+ bias])) (or where(visible, x, fill))."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B, H, S, D), "float32"))
    k = relax.Var("k", relax.TensorType((B, H, D, T), "float32"))
    cond = relax.Var("cond", relax.TensorType((B, 1, S, T), "bool"))
    bias = relax.Var("bias", relax.TensorType((H, 1, T), "float32"))
    with bb.function("main", [q, k, cond, bias]):
        with bb.dataflow():
            x = bb.emit(relax.op.multiply(relax.op.matmul(q, k), relax.const(0.3, "float32")))
            if with_bias:
                x = bb.emit(relax.op.add(x, bias))
            f = relax.const(fill, "float32")
            w = relax.op.where(cond, f, x) if fill_first else relax.op.where(cond, x, f)
            out = bb.emit_output(relax.op.nn.softmax(bb.emit(w), axis=-1))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in args]).numpy()


def _softmax_input(mod):
    binds = {b.var: b.value for blk in mod["main"].body.blocks for b in blk.bindings}
    sm = next(v for v in binds.values() if isinstance(v, relax.Call) and
              getattr(v.op, "name", "") == "relax.nn.softmax")
    x = sm.args[0]
    return binds.get(x, x)


@pytest.mark.parametrize("fill_first", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
def test_masked_fill_becomes_an_added_mask_with_the_same_softmax(fill_first, with_bias):
    rng = np.random.default_rng(0)
    causal = np.arange(T)[None, :] <= (T - S + np.arange(S))[:, None]
    hide = ~causal if fill_first else causal      # where(c, fill, x): c hides the key
    args = [rng.standard_normal((B, H, S, D)).astype(np.float32),
            rng.standard_normal((B, H, D, T)).astype(np.float32),
            np.broadcast_to(hide, (B, 1, S, T)).copy(),
            (-0.5 * np.arange(T)[::-1] * np.array([1, 0.5, 0.25])[:, None])
            .reshape(H, 1, T).astype(np.float32)]
    mod = _attention(-3.4e38, fill_first, with_bias)
    new = AdditiveAttentionMask()(mod)
    x = _softmax_input(new)
    assert x.op.name == "relax.add"               # scores + where(...): the pattern's form
    np.testing.assert_allclose(_run(new, args), _run(mod, args), rtol=1e-6, atol=1e-7)


def test_a_weak_fill_is_left_alone():
    # filled with -1, a hidden key still weighs in the softmax: scores + where(c, -1, 0)
    # would change the answer, so the masked fill stays
    mod = _attention(-1.0, True, True)
    assert _softmax_input(AdditiveAttentionMask()(mod)).op.name == "relax.where"


def test_a_bias_on_3d_scores_joins_the_mask():
    """BLOOM: softmax(reshape(q3 @ k3 * s + bias3, (b, h, s, t)) + mask): the bias, split
    into heads alike, moves into the mask; the softmax is unchanged."""
    B2 = 2                            # two sequences: a bias split into the wrong heads shows
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((B2 * H, S, D), "float32"))
    k = relax.Var("k", relax.TensorType((B2 * H, D, T), "float32"))
    bias = relax.Var("bias", relax.TensorType((B2 * H, 1, T), "float32"))
    mask = relax.Var("mask", relax.TensorType((B2, 1, S, T), "float32"))
    with bb.function("main", [q, k, bias, mask]):
        with bb.dataflow():
            x = bb.emit(relax.op.multiply(relax.op.matmul(q, k), relax.const(0.25, "float32")))
            x = bb.emit(relax.op.reshape(bb.emit(relax.op.add(x, bias)), (B2, H, S, T)))
            out = bb.emit_output(relax.op.nn.softmax(bb.emit(relax.op.add(x, mask)), axis=-1))
        bb.emit_func_output(out)
    mod = bb.get()
    rng = np.random.default_rng(1)
    causal = np.arange(T)[None, :] <= (T - S + np.arange(S))[:, None]
    args = [rng.standard_normal((B2 * H, S, D)).astype(np.float32),
            rng.standard_normal((B2 * H, D, T)).astype(np.float32),
            (np.arange(B2 * H)[:, None, None] * 0.3 * np.arange(T)).astype(np.float32),
            np.broadcast_to(np.where(causal, 0.0, -3.4e38).astype(np.float32),
                            (B2, 1, S, T)).copy()]
    new = AdditiveAttentionMask()(mod)
    x = _softmax_input(new)
    binds = {b.var: b.value for blk in new["main"].body.blocks for b in blk.bindings}
    scores, added = (binds.get(a, a) for a in x.args)
    assert scores.op.name == "relax.reshape" and added.op.name == "relax.add"
    np.testing.assert_allclose(_run(new, args), _run(mod, args), rtol=1e-6, atol=1e-7)
