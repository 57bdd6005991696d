"""AnnotateRoPE: rotary position embedding (rotate-half form, full or partial) on query and
key heads."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_tuple, wildcard

from ._fusion import RegionPattern, call, fuse_regions, head_split, static_shape


def _rotate_half(upper, lower):
    """``concat(-x[..., d/2:], x[..., :d/2])`` (``upper``, ``lower``: the two slices)."""
    return call("relax.concat", is_tuple([call("relax.negative", upper), lower]))


def _rotate_pairs(odd, even):
    """``stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)``, as exporters spell
    ``torch.stack``: each slice unsqueezed at the end, concatenated, reshaped back.
    Returns the named sub-patterns and the reshape."""
    lifted = [call("relax.expand_dims", call("relax.negative", odd)),
              call("relax.expand_dims", even)]
    stacked = call("relax.concat", is_tuple(lifted))
    rotated = call("relax.reshape", stacked)
    return {"odd": odd, "even": even, "lift_odd": lifted[0], "lift_even": lifted[1],
            "stacked": stacked, "rotated": rotated}, rotated


def _rotation(x, cos, sin, rotated):
    """``x * cos + rotated * sin``."""
    return call("relax.add", call("relax.multiply", x, cos),
                call("relax.multiply", rotated, sin))


def _halves_ok(m, rotary_dim) -> bool:
    """rotate_half's slices are ``x[..., d/2:]`` and ``x[..., :d/2]`` (a slice of other
    bounds is a different function)."""
    half = rotary_dim // 2
    upper, lower = _last_axis_slice(m["upper"]), _last_axis_slice(m["lower"])
    return upper[0] == half and upper[1] >= rotary_dim and lower == (0, half)


def _pairs_ok(m, rotary_dim) -> bool:
    """rotate_pairs' slices are ``x[..., 1::2]`` and ``x[..., 0::2]`` of all ``rotary_dim``
    columns, each unsqueezed as a new last axis, concatenated on it (odd first, negated)
    and reshaped back to ``x``'s shape."""
    odd, even = _last_axis_slice(m["odd"], 2), _last_axis_slice(m["even"], 2)
    if odd[0] != 1 or odd[1] < rotary_dim or even[0] != 0 or even[1] < rotary_dim - 1:
        return False
    stacked = m["stacked"]
    ndim = len(static_shape(m["odd"]))
    axis = int(stacked.attrs.axis)
    for piece in (m["lift_odd"], m["lift_even"]):
        if [int(a) % (ndim + 1) for a in piece.attrs.axis] != [ndim]:
            return False
    return axis % (ndim + 1) == ndim and \
        static_shape(m["rotated"]) == static_shape(m["x"])


def _last_axis_slice(expr, step: int = 1) -> tuple:
    """(begin, end) of a ``strided_slice`` on the last axis with stride ``step``;
    ValueError for any other slice."""
    args = expr.args    # 0.27: axes, begin, end and strides are tuple arguments
    axes, begin, end = ([int(v) for v in a.fields] for a in args[1:4])
    strides = [int(v) for v in args[4].fields] if len(args) > 4 else []
    ndim = len(static_shape(args[0]))
    allowed = ([step], []) if step == 1 else ([step],)      # no strides: unit stride
    if len(axes) != 1 or axes[0] % ndim != ndim - 1 or strides not in allowed:
        raise ValueError("not a last-axis slice")
    return begin[0], end[0]


def _heads_axis(out_shape, cos) -> int:
    """The axis of the rotated (b, ., ., d) tensor that indexes heads: 1 when heads come
    before tokens (b, h, s, d), 2 in token-major exports (GPT-J: (b, s, h, d), rotated
    before the heads move). cos is shared by every head, so it is 1 on that axis and the
    token count on the other; when the two cannot be told apart (one head, one token)
    the layouts address the same memory and either is right."""
    cs = static_shape(cos)
    cs = (1,) * (4 - len(cs)) + cs
    for axis, other in ((1, 2), (2, 1)):
        if cs[axis] == 1 and cs[other] != 1:
            return axis
    for axis, other in ((1, 2), (2, 1)):
        if out_shape[axis] == 1 and out_shape[other] != 1:
            return other
    if cs[1] == cs[2] == 1 and out_shape[1] == out_shape[2] == 1:
        return 1
    raise ValueError("cannot tell the heads axis of the rotation")


def rope_patterns() -> list[RegionPattern]:
    """``x * cos + rot(x) * sin``, ``x`` including its head split, and the partial form
    ``concat(rotate(x[..., :r]), x[..., r:])`` (GPT-NeoX/Pythia, Phi-2, GPT-J: only the
    first ``r`` of each head's ``d`` dimensions rotate), for both rotations: ``rot`` is
    ``rotate_half`` (Llama and most others) or ``rotate_pairs`` (GPT-J, Cohere, CodeGen:
    neighbouring columns form the pairs).

    The heads may come before the tokens, (b, h, s, d), or after them, (b, s, h, d), when
    the exporter rotates before moving the heads (GPT-J); the ``heads_axis`` attribute
    says which.

    cos/sin are inputs of the region: whether the exporter computes them from the position
    ids or folded them to constants, that table is computed once per call and shared by
    every layer, so it stays outside (on the host, like the other index arithmetic).
    """
    patterns = []
    for style in ("rotate_pairs", "rotate_half"):
        for partial_form in (True, False):
            patterns.append(_rope_pattern(style, partial_form))
    return patterns


def _rope_pattern(style: str, partial_form: bool) -> RegionPattern:
    cos, sin = wildcard(), wildcard()
    heads = wildcard()
    if partial_form:
        x, pass_part = call("relax.strided_slice", heads), call("relax.strided_slice", heads)
    else:
        x = head_split(wildcard())
    a, b = call("relax.strided_slice", x), call("relax.strided_slice", x)
    if style == "rotate_half":
        rotated = _rotate_half(a, b)
        names = {"upper": a, "lower": b}
    else:
        names, rotated = _rotate_pairs(a, b)
    root = _rotation(x, cos, sin, rotated)
    if partial_form:
        root = call("relax.concat", is_tuple([root, pass_part]))
    annotations = {"root": root, "x": x, "cos": cos, **names}
    if partial_form:
        annotations.update({"heads": heads, "pass_part": pass_part})

    def rotation_ok(m, rotary_dim):
        return _halves_ok(m, rotary_dim) if style == "rotate_half" else \
            _pairs_ok(m, rotary_dim)

    def check(m, ctx):
        shape = static_shape(ctx.matched_expr)
        if len(shape) != 4 or not isinstance(shape[-1], int):
            return False
        _heads_axis(shape, m["cos"])
        if not partial_form:
            return shape[-1] % 2 == 0 and rotation_ok(m, shape[-1])
        if len(static_shape(m["heads"])) != 4:
            return False
        rotary = static_shape(m["x"])[-1]
        if not rotation_ok(m, rotary):
            return False
        rot_begin, rot_end = _last_axis_slice(m["x"])
        pass_begin, pass_end = _last_axis_slice(m["pass_part"])
        return (rot_begin == 0 and pass_begin == rot_end and pass_end >= shape[-1]
                and rot_end % 2 == 0 and int(ctx.matched_expr.attrs.axis) in (-1, 3))

    def attrs(m):
        shape = static_shape(m["root"])
        axis = _heads_axis(shape, m["cos"])
        return {
            "num_heads": shape[axis],
            "seq_len": shape[3 - axis],
            "head_dim": shape[-1],
            "rotary_dim": static_shape(m["x"])[-1],
            "style": style,
            "heads_axis": axis,
        }

    return RegionPattern("rope", root, annotations, check, attrs)


@tvm.transform.module_pass(opt_level=0, name="AnnotateRoPE")
class AnnotateRoPE:
    """Group rotary embeddings into ``edgetvm.rope`` composites, one per projected tensor
    (query and key separately: a 2-layer model has 4 RoPE regions).

    The rotate-half spelling costs two slices, a negate and a concat per tensor (the
    pairwise one two more unsqueezes and a reshape); on the NPU it is one vector kernel
    that reads the (seq, rotary_dim) cos/sin rows once per tile. Attributes:
    ``num_heads``, ``seq_len``, ``head_dim``, ``rotary_dim`` (``< head_dim`` for partial
    rotary), ``style`` (``rotate_half`` or ``rotate_pairs``), ``heads_axis`` (1: the
    region's output is (b, h, s, d); 2: (b, s, h, d)).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, rope_patterns())
