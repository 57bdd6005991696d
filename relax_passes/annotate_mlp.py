"""AnnotateMLP: the transformer feed-forward block (SwiGLU, GeGLU or GELU)."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import wildcard

from ._activation import activation, activation_constants_ok, activation_name
from ._fusion import RegionPattern, call, fuse_regions, static_shape
from ._projection import (call_tir_ok, projection, projection_attrs, projection_variants,
                          weight_is_2d)


def mlp_patterns(mod: tvm.IRModule) -> list[RegionPattern]:
    """``down(act(gate(x)) * up(x))`` (act SiLU or GELU) and ``down(act(up(x)))``,
    projections plain, with bias or W4A16 (see ``_projection``), each optionally between
    the reshapes an exporter puts around a 2-D GEMM (GPT-2's Conv1D)."""
    x = wildcard()
    gate, gate_ann = projection(x, "gate_", reshaped=True)
    up, up_ann = projection(x, "up_", reshaped=True)
    gated_act, gated_ann = activation(gate)
    plain_act, plain_ann = activation(up)
    hidden = {True: call("relax.multiply", gated_act, up), False: plain_act}

    def check(m, ctx):
        return call_tir_ok(mod, ctx) and weight_is_2d(ctx) and activation_constants_ok(m)

    def attrs(m, gated):
        values = {
            "activation": activation_name(m),
            "gated": gated,
            "hidden_size": static_shape(m["x"])[-1],
            "intermediate_size": projection_attrs(mod, m, "up_")["up_out_features"],
            "num_linears": 3 if gated else 2,
        }
        for name in (("gate_", "up_", "down_") if gated else ("up_", "down_")):
            values.update(projection_attrs(mod, m, name))
        return values

    patterns = []
    for gated in (True, False):
        downs, down_ann = projection_variants(hidden[gated], "down_", reshaped_input=True)
        annotations = {"x": x, **up_ann, **down_ann,
                       **(dict(gate_ann, **gated_ann) if gated else plain_ann)}
        patterns += [RegionPattern("mlp", down, annotations, check,
                                   lambda m, gated=gated: attrs(m, gated)) for down in downs]
    return patterns


@tvm.transform.module_pass(opt_level=0, name="AnnotateMLP")
class AnnotateMLP:
    """Group feed-forward blocks (gate/up/down projections and the activation) into
    ``edgetvm.mlp`` composites.

    The whole block is one region so the NPU can keep the (seq, intermediate) activation
    in TCM between the up and down projections; the projections inside are counted as
    linears too (``num_linears``). Attributes: ``activation`` (``silu``, ``gelu``: erf
    form, ``gelu_tanh``, ``relu``, ``relu2``), ``gated``, ``hidden_size``, ``intermediate_size``,
    ``num_linears`` and per projection (``gate_``/``up_``/``down_`` prefixes)
    ``in_features``, ``out_features``, ``bias``, ``weight_format``, ``group_size``
    (W4A16).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, mlp_patterns(mod))
