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
``Gather`` of a tensor at constant negative indices
    TVM normalises them at run time from the tensor's shape; here, when the axis is
    static, at import (Falcon's fused qkv: K and V at -2 and -1).
``Expand`` of a symbolic shape to a constant one
    TVM's converter reads every input dimension as an integer when the target shape is a
    constant (GPT-J expands ``position_ids[..., None]`` by ``ones(3)``). The fix applies
    ONNX's broadcasting rule to the symbolic dimensions.
``Slice`` with a symbolic bound
    TVM then slices with ``assume_inbound`` and takes constant bounds as they are, so a
    constant end of ``INT64_MAX`` ("to the end") or a negative one gives a wrong length
    (MPT's ALiBi table). The fix normalises constant bounds as ONNX defines them first.
``Tile`` by a shape
    Repeats computed from ``Shape`` dims (GPT-J's and Cohere's rotary tables, repeated
    over the batch) arrive as a ``ShapeExpr``, which TVM's converter refuses. The fix
    tiles by reshape and ``broadcast_to``, keeping symbolic sizes. (TVM refuses a shape
    input to Tile before any converter runs; the importer hands such repeats over as
    ``shape_to_tensor`` of the shape, seen through here.)

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
    if isinstance(data, relax.Expr) and isinstance(data.ty, relax.TensorType):
        return _gather_at_constant_indices(data, indices, attrs, fallback)
    if not isinstance(data, relax.Expr) or not isinstance(data.ty, relax.ShapeType):
        return fallback()
    # the dims: of a shape literal, or of a shape value whose type knows them (Falcon
    # gathers its fused qkv's head count from Shape(reshape(qkv)) with a scalar index)
    known = data.values if isinstance(data, relax.ShapeExpr) else getattr(data.ty, "values", None)
    if known is not None and isinstance(indices, tvm.ir.GenericConst):
        index = indices.value.numpy()
        dims = list(known)
        picked = np.take(np.arange(len(dims)), index)
        scalar_ok = not isinstance(data, relax.ShapeExpr)   # TVM's own converter does that
        if (index.ndim > 0 or scalar_ok) and all(isinstance(dims[i], tvm.tirx.IntImm)
                                                 for i in np.ravel(picked)):
            values = np.vectorize(lambda i: int(dims[i]), otypes=[np.int64])(picked)
            return relax.const(np.asarray(values, np.int64), "int64")
    if isinstance(data, relax.ShapeExpr):
        return fallback()
    axis = int(attrs.get("axis", 0))
    tensor = bb.normalize(relax.op.shape_to_tensor(data))
    if isinstance(indices, tvm.ir.GenericConst):
        index = indices.value.numpy()
        index = np.where(index < 0, index + data.ty.ndim, index)
        indices = relax.const(index.astype(np.int64), "int64")
    return relax.op.take(tensor, indices, axis=axis)


def convert_tile(bb, inputs, attrs, params, fallback):
    """``Tile`` by constant repeats or by a shape (``Concat`` of ``Shape`` dims, e.g. the
    batch size) -> reshape, ``broadcast_to`` and reshape, keeping the symbolic sizes.

    TVM's converter takes constant repeats (as a TE ``tile`` kernel, opaque to the passes
    that follow) or a 1-D tensor of them, not a ``ShapeExpr`` (GPT-J's and Cohere's
    rotary tables repeat over ``Shape(position_ids)[0]``). Tiling
    ``x`` of shape ``(d0, .., dn)`` by ``(r0, .., rn)`` equals reshaping it to
    ``(1, d0, .., 1, dn)``, broadcasting to ``(r0, d0, .., rn, dn)`` and merging each pair.
    """
    del attrs
    data = inputs[0]
    repeats = onnx_frontend.get_constant(inputs[1], params)
    if isinstance(repeats, relax.Call) and repeats.op == tvm.ir.Op.get("relax.shape_to_tensor"):
        repeats = repeats.args[0]  # a shape only Tile reads (EdgeONNXImporter._construct_nodes)
    if isinstance(repeats, tvm.ir.GenericConst):
        reps = [tvm.tirx.IntImm("int64", int(r)) for r in repeats.value.numpy().reshape(-1)]
    elif isinstance(repeats, relax.ShapeExpr):
        reps = list(repeats.values)
    else:
        return fallback()
    shape = data.ty.shape if isinstance(data, relax.Expr) and isinstance(
        data.ty, relax.TensorType) else None
    if not isinstance(shape, relax.ShapeExpr):
        return fallback()
    dims = list(shape.values)
    # ONNX requires len(repeats) == rank; be lenient the way numpy is.
    dims = [tvm.tirx.IntImm("int64", 1)] * (len(reps) - len(dims)) + dims
    reps = [tvm.tirx.IntImm("int64", 1)] * (len(dims) - len(reps)) + reps
    pairs_one = [value for dim in dims for value in (1, dim)]
    pairs = [value for rep, dim in zip(reps, dims) for value in (rep, dim)]
    merged = [rep * dim for rep, dim in zip(reps, dims)]
    out = bb.normalize(relax.op.reshape(data, pairs_one))
    out = bb.normalize(relax.op.broadcast_to(out, pairs))
    return relax.op.reshape(out, merged)


def convert_expand(bb, inputs, attrs, params, fallback):
    """``Expand`` of a tensor with symbolic dimensions to a constant shape -> ``broadcast_to``
    by ONNX's rule (right-aligned; a target 1 keeps the input's dimension).

    TVM's converter reads every input dimension as an integer there (GPT-J expands
    ``position_ids[..., None]`` by ``ones(3)``)."""
    del bb, attrs
    data = inputs[0]
    shape = onnx_frontend.get_constant(inputs[1], params)
    if not isinstance(shape, tvm.ir.GenericConst) or not isinstance(data, relax.Expr):
        return fallback()
    data_shape = data.ty.shape if isinstance(data.ty, relax.TensorType) else None
    if not isinstance(data_shape, relax.ShapeExpr):
        return fallback()
    dims = list(data_shape.values)
    if all(isinstance(dim, tvm.tirx.IntImm) for dim in dims):
        return fallback()
    target = [int(value) for value in shape.value.numpy().reshape(-1)]
    one = tvm.tirx.IntImm("int64", 1)
    dims = [one] * (len(target) - len(dims)) + dims
    target = [1] * (len(dims) - len(target)) + target
    out = []
    for dim, size in zip(dims, target):
        if size == 1 or (isinstance(dim, tvm.tirx.IntImm) and int(dim) == size):
            out.append(dim)
        elif isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1:
            out.append(tvm.tirx.IntImm("int64", size))
        else:
            raise ValueError(
                f"Expand: cannot broadcast shape {list(data_shape.values)} to {target}"
            )
    if len(out) == len(data_shape.values) and all(
        a.same_as(b) for a, b in zip(out, data_shape.values)
    ):
        return data
    return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def convert_slice(bb, inputs, attrs, params, fallback):
    """``Slice`` with a symbolic bound: constant bounds are first normalised the way ONNX
    defines them (a negative index counts from the end, an index past the end is the end),
    then TVM's converter runs.

    With any symbolic bound TVM slices with ``assume_inbound``, taking the constants as
    they are: MPT's ALiBi table ``alibi[:, :, 256 - kv_len : INT64_MAX]`` came out
    ``INT64_MAX - 256 + kv_len`` long and its sum with the scores lost its shape."""
    del bb, attrs
    data = inputs[0]
    starts, ends = (onnx_frontend.get_constant(inputs[i], params) for i in (1, 2))
    axes, steps = (onnx_frontend.get_constant(inputs[i], params) for i in (3, 4))
    shape = data.ty.shape if isinstance(data, relax.Expr) and isinstance(
        data.ty, relax.TensorType) else None
    bounds = (starts, ends)
    symbolic = any(isinstance(b, relax.ShapeExpr) or tvm.ir.is_prim_expr(b) for b in bounds)
    if not symbolic or not isinstance(shape, relax.ShapeExpr):
        return fallback()
    if steps is not None and not (isinstance(steps, tvm.ir.GenericConst)
                                  and (steps.value.numpy() > 0).all()):
        return fallback()
    dims = list(shape.values)
    count = len(bounds[0].values) if isinstance(bounds[0], relax.ShapeExpr) else (
        bounds[0].value.numpy().size if isinstance(bounds[0], tvm.ir.GenericConst) else 1)
    if axes is None:
        axis_list = list(range(count))
    elif isinstance(axes, tvm.ir.GenericConst):
        axis_list = [int(a) % len(dims) for a in axes.value.numpy().reshape(-1)]
    else:
        return fallback()
    for index in (1, 2):
        bound = onnx_frontend.get_constant(inputs[index], params)
        if isinstance(bound, tvm.ir.GenericConst):
            values = bound.value.numpy().reshape(-1).tolist()
            inputs[index] = _onnx_slice_bounds(values, [dims[axis] for axis in axis_list])
    return fallback()


def _onnx_slice_bounds(values, dims):
    """Constant Slice bounds (positive step) as ONNX defines them: negative counts from the
    end, past the end is the end. A constant when every dimension is static, else a shape."""
    out = []
    for value, dim in zip(values, dims):
        if isinstance(dim, tvm.tirx.IntImm):
            size = int(dim)
            clamped = max(0, min(value + size if value < 0 else value, size))
            out.append(tvm.tirx.IntImm("int64", clamped))
        elif value >= (1 << 31):  # "to the end" of a symbolic dimension
            out.append(dim)
        elif value < 0:
            out.append(dim + value)
        else:
            out.append(tvm.tirx.IntImm("int64", value))
    if all(isinstance(value, tvm.tirx.IntImm) for value in out):
        return relax.const(np.asarray([int(v) for v in out], np.int64), "int64")
    return relax.ShapeExpr(out)


def _gather_at_constant_indices(data, indices, attrs, fallback):
    """``Gather`` of a tensor at constant indices along a static axis -> ``take`` at the
    indices made non-negative here. TVM's converter normalises negative indices at run
    time (``where(i < 0, i + Shape(x)[axis], i)``): Falcon picks K and V from its fused
    qkv at -2 and -1, and that run-time index turned a head split into a gather."""
    shape = data.ty.shape
    if not isinstance(indices, tvm.ir.GenericConst) or not isinstance(shape, relax.ShapeExpr):
        return fallback()
    axis = int(attrs.get("axis", 0)) % len(shape.values)
    dim = shape.values[axis]
    index = indices.value.numpy()
    if not isinstance(dim, tvm.tirx.IntImm) or index.dtype.kind not in "iu":
        return fallback()
    size = int(dim)
    if ((index < -size) | (index >= size)).any():
        return fallback()
    index = np.where(index < 0, index + size, index).astype(np.int64)
    return relax.op.take(data, relax.const(index, "int64"), axis=axis)


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
    "Tile": convert_tile,
    "Expand": convert_expand,
    "Slice": convert_slice,
}
