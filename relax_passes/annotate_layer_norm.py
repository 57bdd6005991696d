"""AnnotateLayerNorm: layer normalisation (GPT-2, BERT-style models)."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, scalar_value, static_shape


def layer_norm_patterns() -> list[RegionPattern]:
    """``R.nn.layer_norm`` (ONNX LayerNormalization) and its decomposed spelling
    ``(x - mean) / sqrt(var + eps) * gamma + beta`` of older exports."""
    x, gamma, beta, eps = wildcard(), is_const(), is_const(), is_const()
    fused = call("relax.nn.layer_norm", x, wildcard(), wildcard())
    centred = call("relax.subtract", x, call("relax.mean", x))
    square = call("relax.power", centred, is_const()) | call("relax.multiply", centred, centred)
    root = call("relax.sqrt", call("relax.add", call("relax.mean", square), eps))
    normed = call("relax.divide", centred, root)
    affine = call("relax.add", call("relax.multiply", normed, gamma), beta)
    scaled = call("relax.multiply", normed, gamma)
    annotations = {"x": x, "eps": eps}

    def fused_attrs(m):
        call = m["root"]
        return {
            "hidden_size": static_shape(m["x"])[-1],
            "eps": float(call.attrs.epsilon),
            "has_weight": True,
        }

    def decomposed_attrs(m):
        return {
            "hidden_size": static_shape(m["x"])[-1],
            "eps": scalar_value(m["eps"]),
            "has_weight": "gamma" in m,
        }

    return [
        RegionPattern("layer_norm", fused, {"x": x, "root": fused}, None, fused_attrs),
        RegionPattern("layer_norm", affine, {**annotations, "gamma": gamma}, None, decomposed_attrs),
        RegionPattern("layer_norm", scaled, {**annotations, "gamma": gamma}, None, decomposed_attrs),
        RegionPattern("layer_norm", normed, annotations, None, decomposed_attrs),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateLayerNorm")
class AnnotateLayerNorm:
    """Group layer normalisations into ``edgetvm.layer_norm`` composites.

    Like RMSNorm this is a row-wise vector-unit kernel on the NPU; recognising both the
    ONNX op and the decomposed form keeps older GPT-2 style exports on that path.
    Attributes: ``hidden_size``, ``eps``, ``has_weight``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, layer_norm_patterns())
