"""FLOP counts of Relax calls, the measure behind the recognition coverage.

- ``matmul`` and W4A16 linears: ``2 * M * N * K`` (batch dimensions folded into M);
- every other op producing a floating-point tensor (elementwise math, reductions,
  softmax, select): one FLOP per element of its largest tensor operand or result;
- data movement (reshape, transpose, slice, concat, broadcast, gather, cast, ...) and
  ops whose result is not floating point (index, shape and boolean-mask arithmetic):
  0 FLOPs. They are reported as glue ops, not hidden.

Symbolic dimensions are evaluated with ``dims`` (name -> value), default 1.
"""

from __future__ import annotations

import math


import tvm
from tvm import relax

from ._fusion import dtype_of

GLUE_OPS = frozenset(
    "relax." + name
    for name in (
        "reshape permute_dims expand_dims squeeze broadcast_to strided_slice dynamic_strided_slice"
        " concat split take flatten astype shape_of shape_to_tensor tensor_to_shape zeros ones"
        " full zeros_like ones_like full_like arange repeat tile gather_elements gather_nd"
        " scatter_elements scatter_nd flip collapse_sum_like collapse_sum_to layout_transform"
        " reshape_like wrap_param"
    ).split()
)

_CALL_TIR = "relax.call_tir"


def _dim_values(expr, dims: dict) -> list[int]:
    """Dimensions of a tensor expression, symbolic ones evaluated with ``dims``; a tensor
    whose shape is lost (only its rank is known) counts 1 per dimension."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        return []
    if ty.shape is None or getattr(ty.shape, "values", None) is None:
        return [1] * ty.ndim
    values = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            analyzer = tvm.sym.Analyzer()
            for var in tvm.tirx.analysis.undefined_vars(d):
                value = int(dims.get(var.name, 1))
                analyzer.bind(var, tvm.tirx.IntImm(str(var.ty.dtype), value))
            d = analyzer.simplify(d)
        values.append(int(d))
    return values


def _numel(expr, dims: dict) -> int:
    return math.prod(_dim_values(expr, dims))


def _tensor_numels(expr, dims: dict) -> list[int]:
    if isinstance(expr, relax.Tuple):
        return [n for f in expr.fields for n in _tensor_numels(f, dims)]
    if not isinstance(expr.ty, relax.TensorType) or expr.ty.ndim < 0:
        return []
    return [_numel(expr, dims)]


def _matmul_flops(lhs, out, dims: dict, rhs=None) -> int:
    k = _dim_values(lhs, dims)[-1]
    if k == 1 and rhs is not None and (lhs.ty.shape is None):
        k = _dim_values(rhs, dims)[-2]  # lhs shape lost: K from the weight / key side
    return 2 * _numel(out, dims) * k


def op_flops(mod: tvm.IRModule, call: relax.Call, dims: dict | None = None) -> int:
    """FLOPs of one Relax call to an op or call_tir (see the module docstring)."""
    dims = dims or {}
    name = call.op.name if isinstance(call.op, tvm.ir.Op) else ""
    if name == "relax.matmul":
        return _matmul_flops(call.args[0], call, dims, call.args[1])
    if name == _CALL_TIR:
        func = mod[call.args[0]]
        if func.attrs is not None and "edgetvm.op" in func.attrs:
            if str(func.attrs["edgetvm.op"]).startswith("linear"):
                return _matmul_flops(call.args[1].fields[0], call, dims)
        return max(_tensor_numels(call, dims) or [0])
    if is_glue(call):
        return 0
    sizes = _tensor_numels(call, dims)
    for arg in call.args:
        sizes += _tensor_numels(arg, dims)
    return max(sizes or [0])


def function_flops(mod: tvm.IRModule, func: relax.Function, dims: dict | None = None) -> int:
    """Sum of ``op_flops`` over every call in ``func`` (a composite's body)."""
    total = 0

    def visit(expr):
        nonlocal total
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            total += op_flops(mod, expr, dims)

    relax.analysis.post_order_visit(func.body, visit)
    return total


def is_glue(call: relax.Call) -> bool:
    """True for calls that move or index data rather than compute (0 FLOPs by definition)."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name in ("relax.matmul", _CALL_TIR):
        return False
    return call.op.name in GLUE_OPS or not dtype_of(call).startswith(("float", "bfloat"))


__all__ = ["GLUE_OPS", "op_flops", "function_flops", "is_glue"]
