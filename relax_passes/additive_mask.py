"""AdditiveAttentionMask: a masked fill before the softmax as an added mask."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard

from ._fusion import dtype_of, rewrite_main_functions, scalar_value, static_shape


#: a fill at most this low hides a key from the softmax (what the causal-mask check asks)
HIDDEN = -1e4


def _dims(expr) -> list | None:
    """The dims of ``expr``'s tensor type (ints or symbolic expressions), or None."""
    shape = getattr(expr.ty, "shape", None)
    values = getattr(shape, "values", None)
    return list(values) if values is not None else None


@tvm.transform.module_pass(opt_level=0, name="AdditiveAttentionMask")
class AdditiveAttentionMask:
    """Rewrite ``softmax(where(c, fill, scores + bias))`` to
    ``softmax(scores + where(c, fill, bias))`` (and ``where(c, fill, scores)`` to
    ``scores + where(c, fill, 0)``; either operand order of the fill), where ``scores`` is
    a matmul, optionally scaled by a constant, and ``fill`` a constant <= -1e4.

    MPT spells its attention as a masked fill over scores plus its ALiBi bias
    (``masked_fill(q @ k^T * s + alibi, ~causal, finfo.min)``); the attention pattern
    (and the NPU kernel) take ``scores + mask``. The two agree wherever the softmax can
    tell: a visible key gets the same value, a hidden one ``fill + scores`` instead of
    ``fill``, and both weigh 0 after the softmax (``exp`` of -1e4 below the row's
    maximum underflows). The added mask depends on the positions alone, so the build
    evaluates it like any mask, and the bias it carries is checked there.

    BLOOM adds its ALiBi bias to (batch * heads, seq, keys) scores, splits the heads out
    and adds the causal mask: ``reshape(scores + bias) + mask`` becomes ``reshape(scores)
    + (reshape(bias) + mask)``: a reshape moves no element, and the sum is the same up
    to fp32 rounding (exactly the same where the mask is 0; where it hides a key, both
    are the fill, which the softmax drops).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        raw = is_op("relax.matmul")(wildcard(), wildcard())
        scores = raw | is_op("relax.multiply")(raw, is_const()) | \
            is_op("relax.divide")(raw, is_const())
        bias, cond, fill = wildcard(), wildcard(), is_const()
        summed = is_op("relax.add")(scores, bias) | is_op("relax.add")(bias, scores)
        value = summed | scores
        hides = is_op("relax.where")(cond, fill, value)       # where(c, fill, x): c hides
        shows = is_op("relax.where")(cond, value, fill)
        pattern = is_op("relax.nn.softmax")(hides | shows)

        def rewrite(expr, m):
            f = m[fill]
            if len(static_shape(f)) or scalar_value(f) > HIDDEN:
                return expr
            s = m[scores]
            b = m[bias] if bias in m else relax.const(0.0, dtype_of(s))
            if dtype_of(b) != dtype_of(s):
                return expr
            mask = relax.op.where(m[cond], f, b) if hides in m else \
                relax.op.where(m[cond], b, f)
            return relax.op.nn.softmax(relax.op.add(s, mask), axis=int(expr.attrs.axis))

        # BLOOM adds its bias to (batch * heads)-row 3-D scores, then splits the heads
        # and adds the causal mask: the bias, split alike, joins the mask
        bias3, mask4 = wildcard(), wildcard()
        split = is_op("relax.reshape")(is_op("relax.add")(scores, bias3), wildcard())
        hoisted = is_op("relax.add")(split, mask4)

        def hoist(expr, m):
            s3, b3 = m[scores], m[bias3]
            shape = m[split].ty.shape
            bs, ss = _dims(b3), _dims(s3)
            if shape is None or bs is None or ss is None or len(bs) != 3 or len(ss) != 3 \
                    or len(shape.values) != 4 or dtype_of(b3) != dtype_of(s3):
                return expr
            b, h, _, t = shape.values
            ana = tvm.sym.Analyzer()
            if not (ana.can_prove_equal(bs[0], ss[0]) and ana.can_prove_equal(bs[2], ss[2])
                    and ana.can_prove_equal(b * h, ss[0])):
                return expr
            b4 = relax.op.reshape(b3, relax.ShapeExpr([b, h, bs[1], t]))
            return relax.op.add(relax.op.reshape(s3, shape),
                                relax.op.add(b4, m[mask4]))

        # GPT-Neo fills the hidden scores, then adds the padding mask:
        # softmax(where(c, scores, fill) + mask) -> softmax(scores + (where(c, 0, fill) + mask))
        cond2, fill2, mask2 = wildcard(), is_const(), wildcard()
        filled = is_op("relax.where")(cond2, scores, fill2)
        then_added = is_op("relax.nn.softmax")(is_op("relax.add")(filled, mask2))

        def fill_then_add(expr, m):
            f, s, mk = m[fill2], m[scores], m[mask2]
            if len(static_shape(f)) or scalar_value(f) > HIDDEN or \
                    dtype_of(mk) != dtype_of(s) or dtype_of(f) != dtype_of(s):
                return expr
            zero = relax.const(0.0, dtype_of(s))
            mask = relax.op.add(relax.op.where(m[cond2], zero, f), mk)
            return relax.op.nn.softmax(relax.op.add(s, mask), axis=int(expr.attrs.axis))

        return rewrite_main_functions(mod, [(hoisted, hoist), (then_added, fill_then_add),
                                            (pattern, rewrite)])
