"""AnnotateRMSNorm: root-mean-square normalisation as exported by Llama-family models."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, scalar_value, static_shape


def _inverse_rms(x):
    """``1 / sqrt(mean(x^2) + eps)`` in the spellings the ONNX exporters produce."""
    two, one = is_const(), is_const()
    square = call("relax.power", x, two) | call("relax.multiply", x, x)
    eps = is_const()
    var_eps = call("relax.add", call("relax.mean", square), eps)
    root = call("relax.sqrt", var_eps)
    inv = call("relax.divide", one, root) | call("relax.rsqrt", var_eps)
    return inv, root, eps, two, one


def rms_norm_patterns() -> list[RegionPattern]:
    """x * rsqrt(mean(x^2, -1) + eps) [* weight]; the weight multiply is absent when the
    exporter folded a weight of ones away (the fixed-shape folds do)."""
    x, weight = wildcard(), is_const()
    inv, root, eps, two, one = _inverse_rms(x)
    normed = call("relax.multiply", x, inv) | call("relax.divide", x, root)
    weighted = call("relax.multiply", call("relax.astype", normed) | normed, weight)
    annotations = {"x": x, "eps": eps, "weight": weight, "two": two, "one": one}

    def check(m, _ctx):
        hidden = static_shape(m["x"])[-1]
        mean = _find_mean(_ctx)
        axes = [int(a) for a in mean.attrs.axis]
        ndim = len(static_shape(m["x"]))
        if axes not in ([-1], [ndim - 1]):
            return False
        # x^2 and 1 / sqrt: another exponent or numerator is another function
        if ("two" in m and scalar_value(m["two"]) != 2.0) or \
                ("one" in m and scalar_value(m["one"]) != 1.0):
            return False
        # a weight per row group ((heads, d)) is not the row kernel's: it stays outside
        return "weight" not in m or int(np.prod(static_shape(m["weight"]))) in (1, hidden)

    def attrs(m):
        return {
            "hidden_size": static_shape(m["x"])[-1],
            "eps": scalar_value(m["eps"]),
            "has_weight": "weight" in m,
        }

    return [
        RegionPattern("rms_norm", weighted, annotations, check, attrs),
        RegionPattern("rms_norm", normed, annotations, check, attrs),
    ]


def _find_mean(ctx):
    for value in ctx.matched_bindings.values():
        if getattr(value, "op", None) == tvm.ir.Op.get("relax.mean"):
            return value
    raise ValueError("no mean in match")


@tvm.transform.module_pass(opt_level=0, name="AnnotateRMSNorm")
class AnnotateRMSNorm:
    """Group RMSNorm chains (pow, mean, add eps, sqrt, reciprocal, mul [, mul weight]) into
    ``edgetvm.rms_norm`` composites.

    ONNX opsets below 23 have no RMSNormalization op, so exporters emit six to seven
    elementwise/reduction ops; the NPU runs them as one vector-unit kernel over a row held
    in TCM. Attributes: ``hidden_size``, ``eps``, ``has_weight``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, rms_norm_patterns())
