"""AnnotateAttentionMask: the additive attention bias built from the boolean mask."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, is_float, static_shape


def attention_mask_patterns() -> list[RegionPattern]:
    """``where(causal & padding, 0, finfo.min)`` (or ``where(mask, 0, min)``): boolean
    mask to additive float bias. The boolean logic before it (reshape, gather, and) is
    index glue and stays outside."""
    keep = wildcard()
    combined = call("relax.logical_and", is_const(), keep)
    with_causal = call("relax.where", combined, is_const(), is_const())
    plain = call("relax.where", keep, is_const(), is_const())

    def check(m, ctx):
        return is_float(ctx.matched_expr) and len(static_shape(ctx.matched_expr)) == 4

    def attrs(m):
        shape = static_shape(m["root"])
        return {"q_len": shape[-2], "kv_len": shape[-1], "causal_const": "causal" in m}

    return [
        RegionPattern(
            "attention_mask", with_causal, {"root": with_causal, "causal": combined}, check, attrs
        ),
        RegionPattern("attention_mask", plain, {"root": plain}, check, attrs),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateAttentionMask")
class AnnotateAttentionMask:
    """Group the construction of the additive attention bias into an
    ``edgetvm.attention_mask`` composite.

    The bias is computed once per call and shared by every layer's attention, so it is
    its own region (a shared value can belong to one region only). On the NPU it becomes
    the mask operand of the attention kernel, or disappears when the kernel generates the
    causal mask from the runtime position. Attributes: ``q_len``, ``kv_len``,
    ``causal_const``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, attention_mask_patterns())
