"""FoldScalarScalings: two scalings in a row by constant scalars become one multiply, with
the same result (numpy from the definition), and nothing else is touched."""
from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from edgetvm.relax_passes import FoldScalarScalings


def _chain(ops, consts):
    """``x`` scaled by each ``op`` ("multiply" / "divide") with each constant in turn."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3, 4), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for op, c in zip(ops, consts):
                y = bb.emit(getattr(relax.op, op)(y, relax.const(np.asarray(c, np.float32))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod):
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _run(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


@pytest.mark.parametrize("ops", [("divide", "divide"), ("multiply", "divide"),
                                 ("divide", "multiply"), ("multiply", "multiply")])
def test_two_scalar_scalings_become_one_multiply(ops):
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    consts = (4.0, 3.0)
    want = x
    for op, c in zip(ops, consts):
        want = want * c if op == "multiply" else want / c
    new = FoldScalarScalings()(_chain(ops, consts))
    assert _calls(new) == ["relax.multiply"]
    np.testing.assert_allclose(_run(new, x), want, rtol=1e-6)


def test_a_gain_per_channel_is_not_folded():
    gain = np.arange(1, 5, dtype=np.float32)
    mod = _chain(("divide", "multiply"), (4.0, gain))
    assert _calls(FoldScalarScalings()(mod)) == ["relax.divide", "relax.multiply"]
