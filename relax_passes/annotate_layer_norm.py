"""AnnotateLayerNorm: layer normalisation (GPT-2, BERT-style models)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, scalar_value, static_shape
from .annotate_rms_norm import _inverse_rms


def layer_norm_patterns() -> list[RegionPattern]:
    """``R.nn.layer_norm`` (ONNX LayerNormalization) and its decomposed spelling
    ``(x - mean) / sqrt(var + eps) [* gamma] [+ beta]`` of older exports, the reciprocal
    spelled as RMSNorm's are (Cohere: ``(x - mean) * rsqrt(var + eps) * gamma``)."""
    x, gamma, beta = wildcard(), is_const(), is_const()
    fused = call("relax.nn.layer_norm", x, wildcard(), wildcard())
    centred = call("relax.subtract", x, call("relax.mean", x))
    inv, root, eps, two, one = _inverse_rms(centred)
    normed = call("relax.divide", centred, root) | call("relax.multiply", centred, inv)
    scaled = call("relax.multiply", normed, gamma)
    affine = call("relax.add", scaled, beta)
    annotations = {"x": x, "eps": eps, "two": two, "one": one}

    def fused_attrs(m):
        call = m["root"]
        return {
            "hidden_size": static_shape(m["x"])[-1],
            "eps": float(call.attrs.epsilon),
            "has_weight": True,
        }

    def check(m, ctx):
        ndim = len(static_shape(m["x"]))
        hidden = static_shape(m["x"])[-1]
        # a gain or bias per row group (Cohere's q/k norms: one gain per head, (heads, d))
        # is not the row kernel's: the norm is the region, the multiply stays outside
        for key in ("gamma", "beta"):
            if key in m and int(np.prod(static_shape(m[key]))) not in (1, hidden):
                return False
        for value in ctx.matched_bindings.values():
            if getattr(value, "op", None) == tvm.ir.Op.get("relax.mean") and \
                    [int(a) % ndim for a in value.attrs.axis] != [ndim - 1]:
                return False
        # (x - mean)^2 and 1 / sqrt: another exponent or numerator is another function
        return ("two" not in m or scalar_value(m["two"]) == 2.0) and \
            ("one" not in m or scalar_value(m["one"]) == 1.0)

    def decomposed_attrs(m):
        return {
            "hidden_size": static_shape(m["x"])[-1],
            "eps": scalar_value(m["eps"]),
            "has_weight": "gamma" in m,
            "has_bias": "beta" in m,
        }

    return [
        RegionPattern("layer_norm", fused, {"x": x, "root": fused}, None, fused_attrs),
        RegionPattern("layer_norm", affine, {**annotations, "gamma": gamma, "beta": beta}, check,
                      decomposed_attrs),
        RegionPattern("layer_norm", scaled, {**annotations, "gamma": gamma}, check,
                      decomposed_attrs),
        RegionPattern("layer_norm", normed, annotations, check, decomposed_attrs),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateLayerNorm")
class AnnotateLayerNorm:
    """Group layer normalisations into ``edgetvm.layer_norm`` composites.

    Like RMSNorm this is a row-wise vector-unit kernel on the NPU; recognising both the
    ONNX op and the decomposed form keeps older GPT-2 style exports on that path.
    Attributes: ``hidden_size``, ``eps``, ``has_weight``, ``has_bias``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, layer_norm_patterns())
