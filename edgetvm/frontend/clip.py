"""``Clip``, ``Max`` and ``Min`` as Relax's ``maximum`` / ``minimum`` ops.

TVM 0.27's converter emits ``Clip`` as two ``call_tir`` of TOPI's ``maximum`` and
``minimum`` PrimFuncs: opaque to every pattern and to the phase programs' extractor, which
refused OLMo's ``clip_qkv`` (``cannot interpret GlobalVar maximum``). As Relax ops they are
elementwise ops like any other (on the compiled path a host op between two kernels).
Bounds keep ONNX's meaning: a missing bound, or a NaN one (onnxruntime treats it as
unbounded), clips nothing on that side.

TVM's ``Max`` / ``Min`` converter broadcasts every input to the common shape, stacks them
and reduces the new axis: XGLM's clamp of its scores, ``Max(scores, finfo.min)``, became a
stacked copy of the score tensor with a broadcast constant, which no pattern spells and
the attention could not own (its constant's broadcast is one binding for every layer).
Folded pairwise with ``maximum`` / ``minimum`` (ONNX's multidirectional broadcasting is
theirs) it is one elementwise op; constant inputs and shape values keep TVM's converter.
"""
from __future__ import annotations

import functools

import numpy as np
import tvm
from tvm import relax

Constant = tvm.ir.expr.Constant       # relax's constant node (TVM 0.27 moved it to ir)


def _bound(bb, value, dtype, lower: bool):
    """The bound as an expression of ``dtype``, or None where it clips nothing."""
    if value is None:
        return None
    if isinstance(value, Constant):
        v = value.value.numpy()
        if v.size == 1 and np.isnan(v.reshape(())):
            return None
        return relax.const(v.astype(dtype), dtype)
    if str(value.ty.dtype) != dtype:
        value = bb.emit(relax.op.astype(value, dtype))
    inf = -np.inf if lower else np.inf
    return bb.emit(relax.op.where(relax.op.isnan(value), relax.const(inf, dtype), value))


def convert_clip(bb, inputs, attrs, _graph, fallback):
    """``Clip(x, min, max)`` (opset 11+: bounds as inputs; opset 6: attributes)."""
    x = inputs[0]
    dtype = str(x.ty.dtype)
    if "min" in attrs or "max" in attrs:                       # opset 6 attributes
        lo = relax.const(float(attrs.get("min", -np.inf)), dtype)
        hi = relax.const(float(attrs.get("max", np.inf)), dtype)
    else:
        lo = _bound(bb, inputs[1] if len(inputs) > 1 else None, dtype, True)
        hi = _bound(bb, inputs[2] if len(inputs) > 2 else None, dtype, False)
    if lo is None and hi is None:
        return x
    if lo is None:
        return relax.op.minimum(x, hi)     # the last call unbound: the importer names its node
    out = relax.op.maximum(x, lo)
    return out if hi is None else relax.op.minimum(bb.emit(out), hi)


def _min_max(binary):
    def convert(bb, inputs, _attrs, _graph, fallback):
        tensors = all(isinstance(getattr(i, "ty", None), relax.TensorType) for i in inputs)
        if len(inputs) < 2 or not tensors or all(isinstance(i, Constant) for i in inputs):
            return fallback()
        *first, last = inputs
        acc = functools.reduce(lambda a, b: bb.emit(binary(a, b)), first[1:], first[0])
        return binary(acc, last)      # the last call unbound: the importer names its node
    return convert


convert_max = _min_max(relax.op.maximum)
convert_min = _min_max(relax.op.minimum)
