"""PerHeadLayerNorm: a LayerNorm per attention head, one op with a gain per head."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import is_op, wildcard

from ._fusion import bindings_of, const_array, rewrite_main_functions, static_shape


@tvm.transform.module_pass(opt_level=0, name="PerHeadLayerNorm")
class PerHeadLayerNorm:
    """Rewrite a LayerNorm per head, applied to each head's slice and concatenated back,

        ``concat([layer_norm(split(y, H, axis=a)[h], g_h, b_h) for h in range(H)], axis=a)``

    (StableLM's ``qk_layernorm``: a ModuleList of LayerNorms over the heads' slices of q
    and k) into one LayerNorm over the head dimension whose gain and bias are the heads'
    stacked, ``(H, d)``: ``layer_norm(y, 1, 0) * G + B``. That is Cohere's per-head q/k
    norm, which the NPU runs as a LayerNorm row kernel and a ``mul_vec`` stage; the
    split-and-concat form was host code (and refused by the phase programs, naming the
    concat). The gain is over the trailing axes ``(heads, d)``, so the heads must be axis
    ``-2``: where ``y`` is ``permute_dims(x, [0, 2, 1, 3])`` of a token-major ``x`` (the
    heads moved before the tokens, as StableLM does before its norms), the norm is taken
    on ``x`` and the permutation after it (a LayerNorm over ``d`` commutes with it). A zero
    ``B`` (StableLM's norms have no bias) is left out. Anything else (slices of several
    heads, norms with other axes or epsilons, non-constant gains) is left as it is.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        concat = is_op("relax.concat")(wildcard())
        return rewrite_main_functions(mod, [(concat, _rewrite_in(mod))])


def _rewrite_in(mod):
    """The ``rewrite_call`` callback for the concats of ``mod``'s functions."""
    bound: dict = {}
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            bound.update(bindings_of(func))

    def rewrite(expr, _matches):
        try:
            new = _per_head_norm(expr, bound)
        except (ValueError, TypeError, KeyError, AttributeError):
            return expr                      # a shape or attribute it did not expect
        return expr if new is None else new
    return rewrite


def _call_of(expr, bound, name):
    value = bound.get(expr, expr)
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
            value.op.name == name:
        return value
    return None


def _per_head_norm(concat, bound):
    """The rewritten expression for ``concat``, or None if it is not a per-head norm."""
    parts = concat.args[0]
    if not isinstance(parts, relax.Tuple) or len(parts.fields) < 2:
        return None
    axis = int(concat.attrs.axis)
    norms = [_call_of(p, bound, "relax.nn.layer_norm") for p in parts.fields]
    if any(n is None for n in norms):
        return None
    first = norms[0].attrs
    if any([int(a) for a in n.attrs.axes] != [-1] or
           float(n.attrs.epsilon) != float(first.epsilon) or
           not n.attrs.center or not n.attrs.scale for n in norms):
        return None
    items = [bound.get(n.args[0], n.args[0]) for n in norms]
    if not all(isinstance(t, relax.TupleGetItem) for t in items) or \
            [t.index for t in items] != list(range(len(items))):
        return None
    split = _call_of(items[0].tuple_value, bound, "relax.split")
    if split is None or any(not t.tuple_value.same_as(items[0].tuple_value) for t in items):
        return None
    y = split.args[0]
    shape = static_shape(y)
    heads = len(items)
    ndim = len(shape)
    sections = split.attrs.indices_or_sections          # H equal sections, or the indices
    one_per_head = int(sections) == heads if isinstance(sections, (int, tvm.tirx.IntImm)) \
        else [int(i) for i in sections] == list(range(1, heads))
    if int(split.attrs.axis) % ndim != axis % ndim or shape[axis] != heads or \
            not one_per_head:
        return None
    d = shape[-1]
    gain = np.stack([const_array(n.args[1]).reshape(-1) for n in norms])
    bias = np.stack([const_array(n.args[2]).reshape(-1) for n in norms])
    if gain.shape != (heads, d) or bias.shape != (heads, d):
        return None
    x, permute = y, None
    if axis % ndim != ndim - 2:
        # the heads before the tokens: take the norm where they are axis -2
        perm = _call_of(y, bound, "relax.permute_dims")
        if perm is None or ndim != 4 or axis % ndim != 1 or \
                [int(a) for a in perm.attrs.axes] != [0, 2, 1, 3]:
            return None
        x, permute = perm.args[0], [0, 2, 1, 3]
    dtype = str(x.ty.dtype)
    out = relax.op.nn.layer_norm(x, relax.const(np.ones(d, dtype)),
                                 relax.const(np.zeros(d, dtype)), axes=[-1],
                                 epsilon=float(first.epsilon))
    out = relax.op.multiply(out, relax.const(gain.astype(dtype)))
    if np.any(bias):
        out = relax.op.add(out, relax.const(bias.astype(dtype)))
    return out if permute is None else relax.op.permute_dims(out, permute)
