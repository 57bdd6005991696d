"""Converter overrides that let dynamic-length LLM exports import with symbolic shapes.

TVM 0.27's Relax ONNX importer fails on every dynamic-sequence export (transformers /
optimum, notes/tvm-0.27.md). Two converters are at fault:

``Range``
    ``arange(0, seq)`` (positions, causal mask) and ``arange(past, past + seq)``
    (cache positions) get a *fresh* symbolic length ``range_len_0`` computed at run
    time, although start and limit are already known symbolic expressions. Nothing
    can prove ``range_len_0 == seq`` afterwards: broadcasting the rotary tables or the
    mask against ``(batch, heads, seq, ...)`` tensors loses the shape and a later
    ``Reshape(-1)`` / ``Shape`` fails. The fix emits ``arange(start, limit, delta)``
    with the symbolic expressions themselves, so the length is ``seq`` (or
    ``past + seq``) by construction.
``ConstantOfShape``
    With an empty shape tensor (a scalar result, used for the mask's fill value) it
    calls ``broadcast_to`` with a rank-0 target and fails. The fix returns the scalar.
``Gather`` on a shape
    ``Shape(x)[[-1]]`` (a 1-D index) is turned into a run-time ``take`` even when the
    dimensions it selects are static. Exports that split a fused projection in halves
    (Phi-3's ``gate_up``, GPT-NeoX's partial rotary) compute the Slice bounds from it,
    so the Slice becomes a ``dynamic_strided_slice`` whose result has no shape, and a
    later ``Shape`` of that result cannot be gathered from at all. The fix returns the
    selected static dimensions as a constant, so TVM folds the arithmetic on them and
    the Slice keeps its shape. A shape whose type is known only by rank (not a
    ``ShapeExpr``) is gathered from through ``shape_to_tensor`` instead of failing.

Each override has the signature ``(bb, inputs, attrs, params, fallback)`` and calls
``fallback()`` (TVM's own converter) for every case it does not fix.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend


def convert_range(bb, inputs, attrs, params, fallback):
    """``Range`` whose bounds are constants or symbolic shape expressions -> ``arange``.

    Only integer ranges with at least one symbolic bound are rewritten; constant ranges
    (TVM folds them) and ranges over run-time tensor values keep TVM's converter.
    The output length is ``ceildiv(limit - start, delta)`` as Relax's ``arange`` infers
    it, i.e. the range is assumed non-empty, which holds for position ids and masks
    (ONNX would clamp a negative count to 0; here it fails the run-time shape check).
    """
    del bb, attrs
    bounds = []
    for value in inputs[:3]:
        value = onnx_frontend.get_constant(value, params)
        scalar = _constant_scalar(value)
        if scalar is not None:
            bounds.append(scalar)
        elif tvm.ir.is_prim_expr(value) and "int" in str(value.ty):
            bounds.append(value)
        else:
            return fallback()
    if not any(tvm.ir.is_prim_expr(bound) for bound in bounds):
        return fallback()
    out_dtype = _range_dtype(inputs)
    if out_dtype is None or "int" not in out_dtype:
        return fallback()
    start, limit, delta = bounds
    return relax.op.arange(start, limit, delta, dtype=out_dtype)


def convert_constant_of_shape(bb, inputs, attrs, params, fallback):
    """``ConstantOfShape`` of an empty shape -> the scalar constant; else TVM's converter."""
    del bb
    shape = onnx_frontend.get_constant(inputs[0], params)
    if isinstance(shape, tvm.ir.GenericConst) and shape.value.numpy().size == 0:
        value = attrs.get("value")
        # ONNX default: a float32 zero.
        array = onnx_frontend.get_numpy(value) if value is not None else np.zeros(1, "float32")
        return relax.const(np.asarray(array).reshape(()), str(array.dtype))
    return fallback()


def convert_gather(bb, inputs, attrs, params, fallback):
    """``Gather`` from a shape at constant indices that select static dimensions -> a
    constant; from a shape known only by rank -> ``take`` on ``shape_to_tensor``."""
    del params
    data, indices = inputs[0], inputs[1]
    if not isinstance(data, relax.Expr) or not isinstance(data.ty, relax.ShapeType):
        return fallback()
    if isinstance(data, relax.ShapeExpr) and isinstance(indices, tvm.ir.GenericConst):
        index = indices.value.numpy()
        dims = list(data.values)
        picked = np.take(np.arange(len(dims)), index)
        if index.ndim > 0 and all(isinstance(dims[i], tvm.tirx.IntImm) for i in picked.flat):
            values = np.vectorize(lambda i: int(dims[i]), otypes=[np.int64])(picked)
            return relax.const(values.astype(np.int64), "int64")
    if isinstance(data, relax.ShapeExpr):
        return fallback()
    axis = int(attrs.get("axis", 0))
    tensor = bb.normalize(relax.op.shape_to_tensor(data))
    if isinstance(indices, tvm.ir.GenericConst):
        index = indices.value.numpy()
        index = np.where(index < 0, index + data.ty.ndim, index)
        indices = relax.const(index.astype(np.int64), "int64")
    return relax.op.take(tensor, indices, axis=axis)


def _constant_scalar(value):
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        if array.size == 1:
            return array.item()
    return None


def _range_dtype(inputs):
    """ONNX gives all three Range inputs one type; take it from any that carries it."""
    for value in inputs[:3]:
        if isinstance(value, relax.Expr) and isinstance(value.ty, relax.TensorType):
            return str(value.ty.dtype)
        if tvm.ir.is_prim_expr(value):
            return str(value.ty)
    return None


#: op_type -> override, consulted by the importer before TVM's converter map.
DYNAMIC_SHAPE_FIXES = {
    "Range": convert_range,
    "ConstantOfShape": convert_constant_of_shape,
    "Gather": convert_gather,
}
