"""AnnotateLMHead: the final projection onto the vocabulary."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import wildcard

from ._fusion import RegionPattern, fuse_regions, static_shape
from ._projection import call_tir_ok, projection_attrs, projection_variants, weight_is_2d


def _vocab_sizes(mod: tvm.IRModule) -> set[int]:
    sizes = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs is not None:
            if str(func.attrs.get("Composite", "")) == "edgetvm.embedding":
                sizes.add(int(func.attrs["edgetvm.vocab_size"]))
    return sizes


def lm_head_patterns(mod: tvm.IRModule) -> list[RegionPattern]:
    """A projection whose result is a graph output (it leaves the dataflow block itself
    or through the output tuple: the logits) and whose width is the vocabulary size of
    the model's embedding region."""
    vocab = _vocab_sizes(mod)

    def check(m, ctx):
        var = ctx.value_to_bound_var[ctx.matched_expr]
        users = ctx.var_usages.get(var, [])
        is_output = not isinstance(var, relax.DataflowVar) or any(
            not isinstance(user, relax.DataflowVar) for user in users
        )
        return (
            is_output
            and static_shape(ctx.matched_expr)[-1] in vocab
            and call_tir_ok(mod, ctx)
            and weight_is_2d(ctx)
        )

    def attrs(m):
        values = projection_attrs(mod, m)
        values["vocab_size"] = values["out_features"]
        return values

    x = wildcard()
    variants, annotations = projection_variants(x)
    return [
        RegionPattern("lm_head", pattern, {"x": x, **annotations}, check, attrs)
        for pattern in variants
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateLMHead")
class AnnotateLMHead:
    """Mark the vocabulary projection as an ``edgetvm.lm_head`` composite.

    It is the largest GEMV of a decode step and the only projection whose output goes
    back to the host; the NPU pipeline can tile it over the vocabulary and fuse the
    sampling argmax. Needs ``AnnotateEmbedding`` first (the vocabulary size comes from the
    embedding region). Attributes: ``vocab_size``, ``in_features``, ``out_features``,
    ``bias``, ``weight_format``, ``group_size`` (W4A16).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, lm_head_patterns(mod))
