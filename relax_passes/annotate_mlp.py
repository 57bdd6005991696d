"""AnnotateMLP: the transformer feed-forward block (SwiGLU or GELU)."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, static_shape
from ._projection import call_tir_ok, projection, projection_attrs, projection_variants, weight_is_2d


def _gelu(u):
    """GELU as an op or in the two decomposed spellings of torch exports."""
    erf_form = call(
        "relax.multiply",
        call("relax.multiply", u, call("relax.add", call("relax.erf", call("relax.divide", u, is_const())), is_const())),
        is_const(),
    )
    cubic = call("relax.multiply", is_const(), call("relax.power", u, is_const()))
    inner = call("relax.multiply", is_const(), call("relax.add", u, cubic))
    tanh_form = call(
        "relax.multiply",
        call("relax.multiply", is_const(), u),
        call("relax.add", is_const(), call("relax.tanh", inner)),
    )
    return call("relax.nn.gelu", u) | call("relax.nn.gelu_tanh", u) | erf_form | tanh_form


def mlp_patterns(mod: tvm.IRModule) -> list[RegionPattern]:
    """``down(silu(gate(x)) * up(x))`` and ``down(gelu(up(x)))``, projections plain,
    with bias or W4A16 (see ``_projection``)."""
    x = wildcard()
    gate, gate_ann = projection(x, "gate_")
    up, up_ann = projection(x, "up_")
    silu = call("relax.multiply", gate, call("relax.sigmoid", gate)) | call("relax.nn.silu", gate)
    swiglu_hidden = call("relax.multiply", silu, up)
    gelu_hidden = _gelu(up)

    def check(m, ctx):
        return call_tir_ok(mod, ctx) and weight_is_2d(ctx)

    def attrs(m, gated):
        values = {
            "activation": "silu" if gated else "gelu",
            "gated": gated,
            "hidden_size": static_shape(m["x"])[-1],
            "intermediate_size": projection_attrs(mod, m, "up_")["up_out_features"],
            "num_linears": 3 if gated else 2,
        }
        for name in (("gate_", "up_", "down_") if gated else ("up_", "down_")):
            values.update(projection_attrs(mod, m, name))
        return values

    patterns = []
    for gated, hidden in ((True, swiglu_hidden), (False, gelu_hidden)):
        downs, down_ann = projection_variants(hidden, "down_")
        annotations = {"x": x, **up_ann, **down_ann, **(gate_ann if gated else {})}
        patterns += [
            RegionPattern("mlp", down, annotations, check, lambda m, gated=gated: attrs(m, gated))
            for down in downs
        ]
    return patterns


@tvm.transform.module_pass(opt_level=0, name="AnnotateMLP")
class AnnotateMLP:
    """Group feed-forward blocks (gate/up/down projections and the activation) into
    ``edgetvm.mlp`` composites.

    The whole block is one region so the NPU can keep the (seq, intermediate) activation
    in TCM between the up and down projections; the projections inside are counted as
    linears too (``num_linears``). Attributes: ``activation``, ``gated``,
    ``hidden_size``, ``intermediate_size``, ``num_linears`` and per projection
    (``gate_``/``up_``/``down_`` prefixes) ``in_features``, ``out_features``, ``bias``,
    ``weight_format``, ``group_size`` (W4A16).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, mlp_patterns(mod))
