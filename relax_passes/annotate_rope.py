"""AnnotateRoPE: rotary position embedding (rotate-half form, full or partial) on query and
key heads."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_tuple, wildcard

from ._fusion import RegionPattern, call, fuse_regions, head_split, static_shape


def _rotate_half(x, upper, lower):
    """``concat(-x[..., d/2:], x[..., :d/2])`` (``upper``, ``lower``: the two slices)."""
    return call("relax.concat", is_tuple([call("relax.negative", upper), lower]))


def _rotation(x, cos, sin, upper, lower):
    """``x * cos + rotate_half(x) * sin``."""
    return call("relax.add", call("relax.multiply", x, cos),
                call("relax.multiply", _rotate_half(x, upper, lower), sin))


def _halves_ok(m, rotary_dim) -> bool:
    """rotate_half's slices are ``x[..., d/2:]`` and ``x[..., :d/2]`` (an interleaved or
    otherwise sliced rotation is a different function)."""
    half = rotary_dim // 2
    upper, lower = _last_axis_slice(m["upper"]), _last_axis_slice(m["lower"])
    return upper[0] == half and upper[1] >= rotary_dim and lower == (0, half)


def _last_axis_slice(expr) -> tuple:
    """(begin, end) of a ``strided_slice`` on the last axis with unit stride; ValueError
    for any other slice."""
    args = expr.args    # 0.27: axes, begin, end and strides are tuple arguments
    axes, begin, end = ([int(v) for v in a.fields] for a in args[1:4])
    strides = [int(v) for v in args[4].fields] if len(args) > 4 else [1]
    ndim = len(static_shape(args[0]))
    if len(axes) != 1 or axes[0] % ndim != ndim - 1 or strides not in ([1], []):
        raise ValueError("not a last-axis slice")
    return begin[0], end[0]


def rope_patterns() -> list[RegionPattern]:
    """``x * cos + rotate_half(x) * sin``, ``x`` including its head split, and the partial
    form ``concat(rotate(x[..., :r]), x[..., r:])`` (GPT-NeoX/Pythia, Phi-2: only the first
    ``r`` of each head's ``d`` dimensions rotate).

    cos/sin are inputs of the region: whether the exporter computes them from the position
    ids or folded them to constants, that table is computed once per call and shared by
    every layer, so it stays outside (on the host, like the other index arithmetic).
    """
    cos, sin = wildcard(), wildcard()
    x = head_split(wildcard())
    full_upper, full_lower = call("relax.strided_slice", x), call("relax.strided_slice", x)
    full = _rotation(x, cos, sin, full_upper, full_lower)
    heads = wildcard()
    rot_part, pass_part = call("relax.strided_slice", heads), call("relax.strided_slice", heads)
    upper, lower = call("relax.strided_slice", rot_part), call("relax.strided_slice", rot_part)
    partial = call("relax.concat", is_tuple([_rotation(rot_part, cos, sin, upper, lower),
                                            pass_part]))

    def check_full(m, ctx):
        shape = static_shape(ctx.matched_expr)
        return (len(shape) == 4 and isinstance(shape[-1], int) and shape[-1] % 2 == 0
                and _halves_ok(m, shape[-1]))

    def check_partial(m, ctx):
        shape = static_shape(ctx.matched_expr)
        if len(shape) != 4 or len(static_shape(m["heads"])) != 4:
            return False
        if not _halves_ok(m, static_shape(m["rot_part"])[-1]):
            return False
        rot_begin, rot_end = _last_axis_slice(m["rot_part"])
        pass_begin, pass_end = _last_axis_slice(m["pass_part"])
        d = static_shape(m["heads"])[-1]
        return (rot_begin == 0 and pass_begin == rot_end and pass_end >= d
                and rot_end % 2 == 0 and int(ctx.matched_expr.attrs.axis) in (-1, 3))

    def attrs(m, partial_form):
        _, heads_n, seq, head_dim = static_shape(m["root"])
        rotary = static_shape(m["rot_part"])[-1] if partial_form else head_dim
        return {
            "num_heads": heads_n,
            "seq_len": seq,
            "head_dim": head_dim,
            "rotary_dim": rotary,
            "style": "rotate_half",
        }

    return [
        RegionPattern("rope", partial, {"root": partial, "heads": heads, "rot_part": rot_part,
                                        "pass_part": pass_part, "upper": upper,
                                        "lower": lower}, check_partial,
                      lambda m: attrs(m, True)),
        RegionPattern("rope", full, {"root": full, "upper": full_upper, "lower": full_lower},
                      check_full, lambda m: attrs(m, False)),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateRoPE")
class AnnotateRoPE:
    """Group rotary embeddings into ``edgetvm.rope`` composites, one per projected tensor
    (query and key separately: a 2-layer model has 4 RoPE regions).

    The rotate-half spelling costs two slices, a negate and a concat per tensor; on the
    NPU it is one vector kernel that reads the (seq, rotary_dim) cos/sin rows once per
    tile. Attributes: ``num_heads``, ``seq_len``, ``head_dim``, ``rotary_dim`` (``<
    head_dim`` for partial rotary), ``style``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, rope_patterns())
