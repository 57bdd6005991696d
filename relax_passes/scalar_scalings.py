"""FoldScalarScalings: two consecutive scalings by constant scalars as one."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.relax.dpl import is_const, is_op, wildcard
from tvm import relax

from ._fusion import const_array, rewrite_main_functions

@tvm.transform.module_pass(opt_level=0, name="FoldScalarScalings")
class FoldScalarScalings:
    """Rewrite ``(x op1 a) op2 b``, each op a multiply or a divide by a constant scalar,
    into ``x * f`` with ``f = a^±1 * b^±1`` (in float64, then the tensor's dtype).

    GPT-2 with ``scale_attn_by_inverse_layer_idx`` divides its scores by ``sqrt(d)`` and
    then by the layer's index plus one; the attention pattern takes one scaling of the
    scores, so the two made the attention unrecognised (refused, compiled). One
    multiply is the same scores to a rounding. Only scalars fold (a per-channel gain
    stays), and only float tensors.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        x, a, b = wildcard(), is_const(), is_const()
        inner = is_op("relax.multiply")(x, a) | is_op("relax.divide")(x, a)
        outer = is_op("relax.multiply")(inner, b) | is_op("relax.divide")(inner, b)

        def rewrite(expr, matches):
            try:
                fa, fb = _factor(matches[a]), _factor(matches[b])
            except ValueError:
                return expr
            dtype = str(expr.ty.dtype)
            if not dtype.startswith("float"):
                return expr
            inner_call = matches[inner]
            fa = fa if inner_call.op.name == "relax.multiply" else 1.0 / fa
            fb = fb if expr.op.name == "relax.multiply" else 1.0 / fb
            return relax.op.multiply(matches[x], relax.const(np.array(fa * fb, dtype)))

        return rewrite_main_functions(mod, [(outer, rewrite)])


def _factor(expr) -> float:
    """A constant scalar's value (any rank of one element); ValueError otherwise."""
    value = const_array(expr)
    if value.size != 1 or value.dtype.kind != "f":
        raise ValueError("not a float scalar")
    v = float(value.reshape(()))
    if v == 0.0 or not np.isfinite(v):
        raise ValueError("not a finite non-zero scalar")
    return v
