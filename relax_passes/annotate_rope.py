"""AnnotateRoPE: rotary position embedding (rotate-half form) on query and key heads."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, is_tuple, wildcard

from ._fusion import RegionPattern, call, fuse_regions, head_split, static_shape


def _rotate_half(x):
    """``concat(-x[..., d/2:], x[..., :d/2])``."""
    upper = call("relax.strided_slice", x)
    lower = call("relax.strided_slice", x)
    return call("relax.concat", is_tuple([call("relax.negative", upper), lower]))


def _cos_sin_from_positions():
    """cos/sin tables computed from position ids: ``f = inv_freq @ float(pos)`` (or
    ``float(pos) * inv_freq``, the legacy exporter),
    ``emb = concat(f, f)``, ``cos(emb)`` / ``sin(emb)`` (times ``attention_scaling`` in
    newer transformers exports), unsqueezed on the head axis."""
    positions = wildcard()
    pos_float = call("relax.astype", call("relax.expand_dims", positions) | positions)
    inv_freq = call("relax.broadcast_to", is_const()) | is_const()
    freqs = call("relax.permute_dims", call("relax.matmul", inv_freq, pos_float)) | call(
        "relax.multiply", pos_float, is_const()
    )
    emb = call("relax.concat", is_tuple([freqs, freqs]))

    def table(fn):  # optionally times attention_scaling (1.0 for plain RoPE)
        raw = call(fn, emb)
        return call("relax.expand_dims", call("relax.multiply", raw, is_const()) | raw)

    cos, sin = table("relax.cos"), table("relax.sin")
    return cos, sin, positions


def rope_patterns() -> list[RegionPattern]:
    """``x * cos + rotate_half(x) * sin``, ``x`` including its head split.

    When cos/sin are computed from position ids (the decode graphs), the first RoPE
    region in program order also computes the tables and exports them to the other
    RoPE regions (a shared value can belong to one region only); when the exporter
    folded them to constants (fixed-length prefill) every region takes them as inputs.
    """
    projected = wildcard()
    x = head_split(projected)
    cos_pos, sin_pos, positions = _cos_sin_from_positions()
    cos, sin = wildcard(), wildcard()

    def rope(c, s):
        return call("relax.add", 
            call("relax.multiply", x, c), call("relax.multiply", _rotate_half(x), s)
        )

    claimed = []

    def check(m, ctx):
        shape = static_shape(ctx.matched_expr)
        if len(shape) != 4 or (isinstance(shape[-1], int) and shape[-1] % 2):
            return False
        if "positions" in m:
            # FuseOpsByPattern lets a later match steal nodes shared with an earlier group
            # (leaving the earlier group reading undefined vars), so exactly one region
            # may claim the shared cos/sin computation: the first in program order.
            if claimed:
                return False
            claimed.append(ctx.matched_expr)
        return True

    def attrs(m):
        _, heads, seq, head_dim = static_shape(m["root"])
        return {
            "num_heads": heads,
            "seq_len": seq,
            "head_dim": head_dim,
            "rotary_dim": head_dim,
            "style": "rotate_half",
            "computes_cos_sin": "positions" in m,
        }

    return [
        RegionPattern("rope", root, {"root": root, "positions": positions}, check, attrs)
        for root in (rope(cos_pos, sin_pos), rope(cos, sin))
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateRoPE")
class AnnotateRoPE:
    """Group rotary embeddings into ``edgetvm.rope`` composites, one per projected tensor
    (query and key separately: a 2-layer model has 4 RoPE regions).

    The rotate-half spelling costs two slices, a negate and a concat per tensor; on the
    NPU it is one vector kernel that reads the (seq, head_dim) cos/sin tables once per
    tile. Attributes: ``num_heads``, ``seq_len``, ``head_dim``, ``rotary_dim``, ``style``,
    ``computes_cos_sin``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, rope_patterns())
