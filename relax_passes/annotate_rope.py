"""AnnotateRoPE: rotary position embedding (rotate-half form) on query and key heads."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, is_op, is_tuple, wildcard

from ._fusion import RegionPattern, fuse_regions, static_shape


def _rotate_half(x):
    """``concat(-x[..., d/2:], x[..., :d/2])``."""
    upper = is_op("relax.strided_slice")(x)
    lower = is_op("relax.strided_slice")(x)
    return is_op("relax.concat")(is_tuple([is_op("relax.negative")(upper), lower]))


def _cos_sin_from_positions():
    """cos/sin tables computed from position ids: ``f = inv_freq @ float(pos)``,
    ``emb = concat(f, f)``, ``cos(emb)`` / ``sin(emb)``, unsqueezed on the head axis."""
    positions = wildcard()
    pos_float = is_op("relax.astype")(is_op("relax.expand_dims")(positions))
    freqs = is_op("relax.permute_dims")(is_op("relax.matmul")(is_const(), pos_float))
    emb = is_op("relax.concat")(is_tuple([freqs, freqs]))
    cos = is_op("relax.expand_dims")(is_op("relax.cos")(emb))
    sin = is_op("relax.expand_dims")(is_op("relax.sin")(emb))
    return cos, sin, positions


def rope_patterns() -> list[RegionPattern]:
    """``x * cos + rotate_half(x) * sin``.

    When cos/sin are computed from position ids (the decode graphs), the first RoPE
    region in program order also computes the tables and exports them to the other
    RoPE regions (a shared value can belong to one region only); when the exporter
    folded them to constants (fixed-length prefill) every region takes them as inputs.
    """
    x = wildcard()
    cos_pos, sin_pos, positions = _cos_sin_from_positions()
    cos, sin = wildcard(), wildcard()

    def rope(c, s):
        return is_op("relax.add")(
            is_op("relax.multiply")(x, c), is_op("relax.multiply")(_rotate_half(x), s)
        )

    def check(m, _ctx):
        shape = static_shape(m["x"])
        return len(shape) == 4 and shape[-1] % 2 == 0

    def attrs(m):
        _, heads, seq, head_dim = static_shape(m["x"])
        return {
            "num_heads": heads,
            "seq_len": seq,
            "head_dim": head_dim,
            "rotary_dim": head_dim,
            "style": "rotate_half",
            "computes_cos_sin": "positions" in m,
        }

    return [
        RegionPattern("rope", rope(cos_pos, sin_pos), {"x": x, "positions": positions}, check, attrs),
        RegionPattern("rope", rope(cos, sin), {"x": x}, check, attrs),
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
