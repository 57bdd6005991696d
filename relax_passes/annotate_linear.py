"""AnnotateLinear: every remaining weight projection (q/k/v/o, plain MLP layers)."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import wildcard

from ._fusion import RegionPattern, fuse_regions
from ._projection import call_tir_ok, projection_attrs, projection_variants, weight_is_2d


def linear_patterns(mod: tvm.IRModule) -> list[RegionPattern]:
    """``x @ W (+ b)`` with a constant 2-D weight, or a W4A16 call_tir with the
    front end's reshapes around it."""
    x = wildcard()

    def check(m, ctx):
        return call_tir_ok(mod, ctx) and weight_is_2d(ctx)

    variants, annotations = projection_variants(x)
    return [
        RegionPattern("linear", pattern, {"x": x, **annotations}, check,
                      lambda m: projection_attrs(mod, m))
        for pattern in variants
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateLinear")
class AnnotateLinear:
    """Group weight projections into ``edgetvm.linear`` composites.

    Runs after the MLP and lm_head passes, so what it finds are the attention
    projections and the layers of architectures it has no block pattern for. These are
    the GEMM/GEMV workloads of the matrix unit; the weight format decides whether the
    W4A16 packing pass applies. Attributes: ``in_features``, ``out_features``, ``bias``,
    ``weight_format``, ``group_size`` (W4A16).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, linear_patterns(mod))
