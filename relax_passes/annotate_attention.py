"""AnnotateAttention: scaled dot-product attention with grouped-query K/V repeat."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_const, wildcard

from ._fusion import RegionPattern, call, fuse_regions, head_split, scalar_value, static_shape
from .additive_mask import HIDDEN


def _repeat_kv(t):
    """Grouped-query repeat ``reshape(broadcast_to(expand_dims(t)))`` or no repeat;
    (pattern, its ``expand_dims`` and ``broadcast_to`` for :func:`_repeats_each_kv_head`)."""
    expand = call("relax.expand_dims", t)
    bcast = call("relax.broadcast_to", expand)
    return call("relax.reshape", bcast) | t, expand, bcast


def _repeats_each_kv_head(expand, bcast) -> bool:
    """Does the repeat give query head ``h`` KV head ``h // G`` (the kernel's grouping)?
    It does when the new axis follows the KV heads' axis, ``(b, kv, G, s, d)`` (HF's
    ``repeat_kv``); the same ops with the new axis before it, ``(b, G, kv, s, d)``, tile
    the KV heads (query head ``h`` -> ``h % kv``), another model."""
    src = static_shape(expand.args[0])
    out = static_shape(bcast)
    axes = [int(a) for a in expand.attrs.axis]
    if len(src) != 4 or len(out) != 5 or len(axes) != 1:
        return False
    return axes[0] % 5 == 2 and out[1] == src[1] and out[3:] == src[2:]


def _is_fill(expr) -> bool:
    """A scalar constant at or below :data:`~.additive_mask.HIDDEN` (a hidden score)."""
    try:
        return scalar_value(expr) <= HIDDEN
    except ValueError:
        return False


def attention_patterns() -> list[RegionPattern]:
    """``softmax(scale * q @ k^T + mask) @ v`` followed by the head merge.

    Scale spellings: ``(q @ k^T) * s``, ``(q @ k^T) / s`` and ``(q * sqrt(s)) @
    (k^T * sqrt(s))`` (what torch's SDPA export emits), the mask added after the scaling
    or before it (CodeGen: ``(q @ k^T + mask) / s``, a causal mask scaled is causal).
    Gemma-2's soft-capped scores ``cap * tanh(s * q @ k^T)`` before the mask (``cap > 0``,
    ``s > 0``: attribute ``softcap``, and ``scale`` is then ``s``). ``where(isnan(p), 0,
    p)`` after the softmax (fully masked rows) belongs to the region, and so do the head
    split of ``v`` and the head merge (transpose + reshape back to (batch, seq, hidden)).
    """
    q, k, v, mask = wildcard(), wildcard(), wildcard(), wildcard()
    s_mul, s_div, s_q, s_k = is_const(), is_const(), is_const(), is_const()
    repeated, k_expand, k_bcast = _repeat_kv(k)
    # torch's dynamo exporter transposes K as a 3-D (batch * heads, seq, d) tensor
    k_t = call("relax.permute_dims", repeated) | call("relax.reshape", call(
        "relax.permute_dims", call("relax.reshape", repeated)))
    raw = call("relax.matmul", q, k_t)
    scores = (
        call("relax.multiply", raw, s_mul)
        | call("relax.divide", raw, s_div)
        | call("relax.matmul", call("relax.multiply", q, s_q), call("relax.multiply", k_t, s_k))
    )
    # BLOOM: the matmuls on (batch * heads)-row 3-D tensors between reshapes (its bias,
    # added to the 3-D scores, is moved into the mask first: AdditiveAttentionMask)
    raw3 = call("relax.matmul", call("relax.reshape", q),
                call("relax.permute_dims", call("relax.reshape", repeated)))
    scores = call("relax.reshape", call("relax.multiply", raw3, s_mul)
                  | call("relax.divide", raw3, s_div)) | scores
    masked = call("relax.add", scores, mask)
    # CodeGen masks before it scales: (q @ k^T + mask) / s, the mask still 0 or <= -1e4
    pre_masked = call("relax.add", raw, mask)
    masked_scaled = call("relax.multiply", pre_masked, s_mul) | \
        call("relax.divide", pre_masked, s_div)
    # Gemma-2 soft-caps the scores before the mask: cap * tanh(scores / cap), the 1 / cap
    # often folded into the scale (a multiply of q @ k^T by scale / cap)
    c_in, c_in_div, c_out = is_const(), is_const(), is_const()
    uncapped = scores | raw
    capped = call("relax.multiply", call("relax.tanh", call(
        "relax.multiply", uncapped, c_in) | call("relax.divide", uncapped, c_in_div)
        | uncapped), c_out)
    # GPT-Neo does not scale at all: the mask added to q @ k^T itself (scale 1)
    logits = masked | masked_scaled | scores | call("relax.add", raw, mask) | \
        call("relax.add", capped, mask) | capped
    # the masked scores clamped from below by maximum(x, fill) with fill <= -1e4 (a no-op
    # after the softmax: what it raises weighs 0 either way): OpenLLaMA; XGLM (q scaled
    # before its projection's head split) clamps BLOOM's (batch * heads)-row scores
    # reshaped back to 4-D for the mask, and takes the softmax in 3-D
    clamp = is_const()
    clamped = call("relax.maximum",
                   logits | call("relax.add", call("relax.reshape", raw3), mask), clamp)
    probs = call("relax.nn.softmax", logits | clamped | call("relax.reshape", clamped))
    probs = call("relax.where", call("relax.isnan", probs), is_const(), probs) | probs
    v_rep, v_expand, v_bcast = _repeat_kv(head_split(v))
    out = call("relax.reshape", call("relax.matmul", call("relax.reshape", probs) | probs,
                                     call("relax.reshape", v_rep))) | \
        call("relax.matmul", probs, v_rep)
    merged_t = call("relax.reshape", call("relax.permute_dims", out))
    merged = call("relax.reshape", out)
    annotations = {
        "q": q, "k": k, "v": v, "mask": mask, "out": out,
        "s_mul": s_mul, "s_div": s_div, "s_q": s_q, "s_k": s_k, "reshaped": merged,
        "pre_masked": pre_masked, "k_expand": k_expand, "k_bcast": k_bcast,
        "v_expand": v_expand, "v_bcast": v_bcast, "clamp": clamp,
        "c_in": c_in, "c_in_div": c_in_div, "c_out": c_out,
    }

    def cap_scale(m) -> float:
        """What the scores are multiplied by inside the soft-cap's tanh."""
        return scalar_value(m["c_in"]) if "c_in" in m else \
            1.0 / scalar_value(m["c_in_div"]) if "c_in_div" in m else 1.0

    def check(m, _ctx):
        return len(static_shape(m["q"])) == 4 and len(static_shape(m["k"])) == 4 and \
            all(_repeats_each_kv_head(m[f"{n}_expand"], m[f"{n}_bcast"]) for n in "kv"
                if f"{n}_bcast" in m) and \
            ("clamp" not in m or _is_fill(m["clamp"])) and \
            ("c_out" not in m or (scalar_value(m["c_out"]) > 0 and cap_scale(m) > 0))

    def attrs(m, merges_heads):
        _, heads, q_len, head_dim = static_shape(m["q"])
        if "reshaped" in m:
            # a reshape with no transpose merges (batch, heads, seq, d) into (batch, seq,
            # heads * d) only where one of heads and seq is 1 (a decode-only export folded
            # to one token); Falcon's reshape to (batch, heads, seq, d) keeps the heads
            shape = static_shape(m["reshaped"])
            merges_heads = len(shape) in (2, 3) and (q_len == 1 or heads == 1)
        _, kv_heads, kv_len, _ = static_shape(m["k"])
        if "s_mul" in m:
            scale = scalar_value(m["s_mul"])
        elif "s_div" in m:
            scale = 1.0 / scalar_value(m["s_div"])
        elif "s_q" in m:
            scale = scalar_value(m["s_q"]) * scalar_value(m["s_k"])
        else:
            scale = 1.0
        # a mask added before the scaling is scaled with the scores
        extra = {"mask_scale": scale} if "pre_masked" in m else {}
        if "c_out" in m:
            # soft-capped: ``scale`` is the tanh's, the softmax takes the capped scores as
            # they are
            scale *= cap_scale(m)
            extra["softcap"] = scalar_value(m["c_out"])
        return {
            **extra,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "gqa_group": heads // kv_heads if isinstance(heads, int) and isinstance(kv_heads, int) else "?",
            "head_dim": head_dim,
            "q_len": q_len,
            "kv_len": kv_len,
            "scale": scale,
            "has_mask": "mask" in m,
            "merges_heads": merges_heads,
        }

    return [
        RegionPattern(
            "attention", root, annotations, check, lambda m, merges=merges: attrs(m, merges)
        )
        for root, merges in ((merged_t, True), (merged, True), (out, False))
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateAttention")
class AnnotateAttention:
    """Group attention cores into ``edgetvm.attention`` composites.

    Region: K/V group repeat (GQA), K transpose, QK^T, scale, mask add, softmax, PV and
    the head merge. q/k/v come from the RoPE / KV-append / projection regions. On the NPU
    this is one flash-style kernel that never writes the score matrix to DRAM and reads
    each KV head once per group instead of materialising the repeat. Attributes:
    ``num_heads``, ``num_kv_heads``, ``gqa_group``, ``head_dim``, ``q_len``, ``kv_len``,
    ``scale``, ``has_mask``, ``merges_heads``, for a mask added before the scaling
    ``mask_scale`` (what the mask is multiplied by) and, for soft-capped scores, ``softcap``
    (the cap; ``scale`` is then what the scores are multiplied by inside the tanh).
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, attention_patterns())
