"""Attention templates over the paged KV cache: decode (one query token) and flash-style
prefill (causal, whole prompt or one chunk at a runtime position).

Both are one loop structure, written with explicit tile loops (:class:`TileKernel`):

    for kv head h:                      # grouped-query: its G = Hq / Hkv query heads
      [for q tile qi:]                  # prefill only
        load Q (all G heads) once
        for kv tile t:                  # K/V tiles streamed through `slots_kv` TCM copies
          load K, V tile of head h, one DMA per page (page_table.<i> runtime offsets)
          for each group of query rows (decode: the G heads; prefill: one head's q tile):
            S  = Q @ K^T                           (matrix, fp32)
          for each group of query rows:
            Sm = mask(S)                           (valid length / causal band; prefill:
                                                    in place, diagonal tiles only)
            t == 0:  m = rowmax(Sm); P = exp((Sm - m) * scale); l = rowsum(P); O = P @ V
            t > 0 :  mt = rowmax(Sm); mn = max(m, mt); c = exp((m - mn) * scale); m = mn
                     O = O * c; P = exp((Sm - mn) * scale); l = l * c + rowsum(P);
                     O += P @ V                    (the MMA accumulates into O)
        out = O * (1 / l) (fp16), store

Every group's QK^T is queued before the first softmax: each unit runs its commands in
program order, so a QK^T queued behind the previous group's P @ V (which waits for that
group's softmax) left the vector unit idle once per group. The vector unit is what
bounds prefill (a score costs a mask, a max, a subtraction and an exp: 8 cycles per 64
lanes, against 2 cycles of MMAs per 64 scores), so the template gives it nothing the
matrix unit can do: prefill's row sums are ``P @ ones`` on the matrix unit (an (M, 1)
MMA, padded to the array's width: as many cycles as P @ V; the ones are a template
constant), the rescaled output is accumulated by the P @ V MMA itself rather than added
by a vector pass, and the output is normalised by one multiply with ``1 / l`` (as
``rsqrt(l)**2``: the vector unit has no reciprocal, and ``div`` costs four passes).
SmolLM2 shapes at 512 rows, default knobs: 318 k -> 266 k cycles, the vector unit busy
265 k -> 194 k (the best knobs of ``benchmarks/kernels.py``: 317,846 -> 265,000). Where
the row sums run is a knob (``rowsum_mma``, below). Decode keeps its row sums on the
vector unit (3 rows per head: a reduction costs 6 cycles a tile, an MMA 48), and is bound
by its KV bytes anyway.

Prefill also keeps the vector unit from waiting on the matrix unit between KV tiles. With
``slots_s=2`` it is software-pipelined: iteration ``u`` of the KV loop loads K and queues
the QK^T of tile ``u`` (into one of two explicit score slots, ``tile % 2``), then loads V
and runs the softmax and P @ V of tile ``u - 1``; so the matrix unit computes the next
tile's scores while the vector unit works on this tile's, where before each tile's
softmax waited for its QK^T, queued behind the previous tile's P @ V. And it masks only the
tiles a mask changes, in place (no ``S_masked`` copy): whole-prompt, the tiles the causal
diagonal crosses (a compile-time condition); chunked, the tiles whose last key is past the
q tile's first row (``pos``) or past ``valid_len``, by runtime predicates on those
parameters (a command's ``when`` may hold several: ``isa.Command``). The mask is one of a
score's four vector passes (mask, max, subtract, exp: 8 of 64-lane cycles). SmolLM2 shapes,
chunked prefill at 512 rows, tile_q = tile_kv = 128: 280,084 -> 274,552 cycles with the
masks on the diagonal only (vector busy 201,744 -> 187,920), -> 250,008 pipelined.

Prefill can instead take two passes over a q tile's KV tiles (knob ``two_pass``), where
the TCM holds the q tile's scores over the whole cache (``S``: the tile's rows x the
cache's positions, fp32, for each head of the group: 393 KB for SmolLM2 at ``tile_q`` 64
and 512 positions):

    pass 1, for kv tile t:  load K; S[:, t] = Q @ K^T; mask; m = max(m, rowmax(S[:, t]))
    pass 2, for kv tile t:  load V; P = exp((S[:, t] - m) * scale)     (one ``exp_sub``)
                            l (+)= rowsum(P); O (+)= P @ V
    out = O * (1 / l)

With the row's final max known before any exponent, nothing is rescaled: no correction
exponent, no ``O * c`` pass over the output per tile (its TCM read and write), no
``l * c``, and the shift and the exponent are one vector command (``exp_sub``: the
difference stays in the vector registers, the TCM sees the scores and P only). P has two
slots, so the exponents of tile t + 1 run while the MMAs of tile t read P. K and V stay in
the TCM for every q tile of the head (one instance per KV head): a KV tile is loaded once,
by the first q tile it is live for (whole prompt: a compile-time condition; chunked: a
runtime predicate on ``pos``), where the one-pass loop loads it again for every q tile. K
loads in the first pass and V in the second, each on every DMA channel. SmolLM2's
prefill-512 attention (``tile_q`` = ``tile_kv`` = 64, list-scheduled, ``performance``):
229.5 k -> 177.3 k cycles, 542 -> 425 uJ (TCM 243 -> 182 uJ, DRAM 94 -> 50 uJ). It needs
the scores, K and V of the whole cache in the TCM, so at long capacities the one-pass
loop above is the one that fits; the default takes two passes where they (two slots
each) take at most a quarter of the TCM.

Decode swaps the two outer loops: ``for kv tile t`` outside, ``for kv head h`` inside, so
a tile's pages are loaded for all KV heads at once, one DMA per page for every head (a
page holds its heads' blocks back to back: one contiguous read, landing in each head's
rows of the tile). Decode is bound by those KV bytes, and each DMA pays a set-up on its
channel: SmolLM2's 2 KB per-head page blocks cost the kernel 1.13x its bytes at KV 1024,
6 KB transfers 1.03x (default knobs). Prefill is bound by the vector unit's softmax
(above), not by its KV bytes, and keeps the per-head order.

The softmax scale is folded into the exponent (``exp(x * imm)``; the max of unscaled
scores is the max of scaled ones since scale > 0). The first KV tile initialises the
running max / sum / output instead of filling them with -inf / 0 (the NPU has no fill
op), which is safe because tile 0 always holds a visible key (key 0 is visible to every
query). K and V tiles are loaded once per KV head and used by all its query heads.

Runtime lengths: every op of KV tile ``t`` carries a predicate so one static program
serves any length up to its capacity: decode predicates on ``valid_len - t0 > 0`` (a live
tile's pages are loaded whole: its MMAs must not read TCM rows no DMA wrote, and unused
page-table entries point at a real page); chunked prefill on
``pos + q_end - t0 > 0`` (KV tiles above the chunk's causal diagonal for this q tile
are not loaded nor computed). Whole-prompt prefill (static length) does not emit those
tiles at all. The masks use ``npu.mask_len`` (keys >= valid_len) and ``npu.mask_pos``
(key > pos + query row).

Sliding windows (``window``: keys ``window`` or more positions behind the query hidden;
Mistral, Qwen2, Gemma-2's and Gemma-3's local layers): the masks also take
``npu.mask_window``, the window's lower edge, which hides keys at fp32's lowest finite
value rather than -inf (``isa.py``), on the tiles that edge crosses. A KV tile wholly
behind the window of every query it serves (the q tile's first row; decode's query at
``valid_len - 1``) is neither loaded nor computed, by one more predicate (decode, chunked)
or a compile-time condition (whole prompt); tile 0 always runs, since it starts every
row's online softmax (the first branch initialises the running max, sum and output). A
row whose keys in tile 0 are all behind its window starts from finite scores there, and
the first tile it sees rescales them by ``exp(about -3e38) = 0``.

Knobs: decode ``tile_kv`` (tokens per KV tile: a multiple or divisor of the page),
``slots_kv`` (1/2: double-buffered K/V tiles), ``slots_s`` (copies of a KV tile's score
tiles: 2 lets the next tile's QK^T write while this tile's are read; in decode, whose QK^T
of a tile are queued behind the previous tile's P @ V, the measured times of 1 and 2 were
equal at SmolLM2's shapes; in prefill 2 is the software pipeline above, 1 the plain loop
in less TCM); prefill adds ``tile_q`` and
``rowsum_mma`` (1: the row sums on the matrix unit; 0: on the vector unit, fewer cycles of
the 900 mW matrix unit for more of the 250 mW vector unit: under a binding power budget
the slower kernel may be the faster step) and ``two_pass`` (above; 0, and a knob set from
before it: the online softmax). Both take ``list_schedule`` (1: the lowering
reorders each unit's ops for overlap within their dependencies, ``target/lowering/
reorder.py``; 0, and a knob set from before it: the loop nest's order). The phase
programs' kernels plan that order for the bucket's worst case (``lower_primfunc``'s
``plan_params``: the chunk at the end of the KV capacity), where the KV tiles above each q
tile's diagonal are predicated off and cost the plan nothing; planned as if they ran, the
order was slower than the loop nest's on long chunks (the bundled example's prefill 512 at
KV 1024: 2.10 M cycles against 2.04 M; planned, 2.00 M).

Layouts: decode ``q, out (Hq, D)``; prefill ``q, out (C, Hq, D)`` token-major (the
projection's layout); inside, Q is re-laid out head-major in TCM by one vector copy per
head (an MMA operand must be a 2-D tile and a DMA cannot permute axes).
"""
from __future__ import annotations

import contextlib
import math

from tvm import tirx

from .common import TileKernel, apply_annotations, knob, new_schedule
from .kv_cache import KVCacheLayout

#: knobs added after logs were written, and the value a knob set without one lowers with
#: (as it was lowered before the knob existed): a log's old records replay unchanged
KNOBS_SINCE = {"list_schedule": 0, "two_pass": 0}
DECODE_KNOBS = ("tile_kv", "slots_kv", "slots_s", "list_schedule")
PREFILL_KNOBS = ("tile_q", "tile_kv", "slots_kv", "slots_s", "rowsum_mma", "list_schedule",
                 "two_pass")

#: the templates' revisions, part of their kernels' structural keys: bumped when the
#: program lowered for given knobs changes, so a tuning log's records of an earlier revision
#: (whose cycles no longer hold) are not replayed. 2: QK^T of every head before the
#: softmaxes, O rescaled in place and accumulated by the P @ V MMA, prefill row sums on the
#: matrix unit, the output normalised by a reciprocal. Prefill 3: masks in place on the
#: tiles they change only; ``slots_s=2`` software-pipelined. Prefill 4: with
#: ``list_schedule=1`` the order is planned for the bucket's worst-case position, where the
#: tiles above a chunk's causal diagonal are predicated off (``lower_primfunc``'s
#: ``plan_params``); before, the plan charged them as running.
DECODE_REVISION = 2
PREFILL_REVISION = 4        # (``two_pass`` is a knob: without it a program is as it was)

#: lower_primfunc keyword arguments of the attention kernels
ATTENTION_LOWERING = {"runtime": ["page_table"], "state": ["K_cache", "V_cache"]}

_NEG_INF = float("-inf")
_ANY = (-(1 << 20), 1 << 20)        # the domain of an iter var bound to a loop value
_BIG = 1 << 19                      # more than any length or position


def _behind_window(start, tile: int, window: int, query):
    """A predicate value (``coef = -1`` on the query's runtime parameter): the KV tile at
    ``start`` runs iff its last key is within ``window`` of ``query + parameter`` (some
    key of it is not behind the window), and tile 0 always (it starts every row's online
    softmax: ``step``'s first branch)."""
    first = 1 - tirx.min(tirx.IntImm("int32", 0) + start, 1)      # 1 for tile 0, else 0
    return query - (start + tile + window - 1) - _BIG * first


def two_pass_bytes(tile_q: int, capacity: int, group: int, head_dim: int, *,
                   slots_kv: int = 2, slots_s: int = 2) -> int:
    """TCM bytes the two-pass prefill holds over a cache of ``capacity`` tokens:
    ``slots_s`` copies of a q tile's fp32 scores for the ``group`` query heads of a KV
    head, ``slots_kv`` copies of that KV head's K and V (fp16)."""
    return (slots_s * group * tile_q * 4 + slots_kv * 2 * head_dim * 2) * capacity


def kv_tile_candidates(page_tokens: int, capacity: int) -> list:
    """KV tile sizes: divisors of the page (>= 16 tokens) and multiples of it."""
    c = [t for t in (16, 32) if t < page_tokens and page_tokens % t == 0]
    c += [page_tokens * k for k in (1, 2, 4, 8, 16) if page_tokens * k <= max(capacity, 1)]
    return c or [page_tokens]


def _f32(x):
    return tirx.Cast("float32", x)


class _Attention:
    """Emits the online-softmax attention loop nest (see the module docstring)."""

    def __init__(self, kb, layout, q_heads, scale, tile_kv, slots_kv, slots_s, channels,
                 ahead=False, alibi=None, softcap=None, window=None):
        self.kb, self.lay = kb, layout
        self.hq, self.hk, self.d = q_heads, layout.kv_heads, layout.head_dim
        if q_heads % layout.kv_heads:
            raise ValueError(f"{q_heads} query heads do not group over {layout.kv_heads}")
        self.g = q_heads // layout.kv_heads
        self.scale = float(scale if scale is not None else 1.0 / math.sqrt(self.d))
        # soft-capped scores (Gemma-2), ``softcap * tanh(scale * s)``: computed in place on
        # the scores, which then go into the softmax unscaled
        self.softcap, self.cap_scale = None, None
        if softcap is not None:
            if not (softcap > 0 and self.scale > 0):
                raise ValueError(f"soft-cap {softcap} at scale {self.scale}: both must be > 0")
            if alibi is not None:
                raise ValueError("soft-capped scores with ALiBi's bias are not supported")
            self.softcap, self.cap_scale, self.scale = float(softcap), self.scale, 1.0
        # a sliding window: keys ``window`` or more positions behind the query are hidden
        # (the mask's ``npu.mask_window``; isa.py: at fp32's lowest finite value)
        if window is not None and (int(window) < 1 or alibi is not None):
            raise ValueError(f"sliding window {window}: must be >= 1, and not with ALiBi")
        self.window = None if window is None else int(window)
        p = layout.page_tokens
        if not (tile_kv % p == 0 or p % tile_kv == 0):
            raise ValueError(f"tile_kv={tile_kv} must divide or be a multiple of the page ({p})")
        self.tt = tile_kv
        self.rt = min(tile_kv, p)                 # rows of one page DMA
        self.ppt = max(1, tile_kv // p)           # page DMAs per tile
        self.slots_kv, self.slots_s = slots_kv, slots_s
        # prefill with two score slots: the QK^T of KV tile t + 1 runs while the softmax of
        # tile t does (software pipelining); S gets an explicit slot axis (tile % 2)
        self.ahead = ahead
        self.ones = None                          # prefill: row sums on the matrix unit
        self.v_channel = channels - 1 if channels > 1 else None
        self.k_channel = 0 if channels > 1 else None
        # ALiBi: the annotations that place the bias's origin (see declare_slopes)
        self.alibi = alibi
        self.slopes_t = None

    def mask_ann(self, ann: dict) -> dict:
        """The masks' annotations ``ann`` and, with a sliding window, its width."""
        return ann if self.window is None else {**ann, "npu.mask_window": self.window}

    # -- pieces ---------------------------------------------------------------------------
    def declare_kv(self, cap, resident: bool = False):
        """``resident``: one instance per KV head (the first iterated loop) holds every KV
        tile of the head, kept across query tiles, instead of one per KV tile."""
        kb = self.kb
        self.cap = cap
        # 4-D like the cache, with a unit page axis: a page DMA then pairs the cache's
        # (page, head, row, col) axes with the tile's one to one, and a tile of several
        # pages is still one 2-D MMA operand (tokens x head_dim)
        inst = 1 if resident else None
        self.kt = kb.tcm("K_tile", (1, self.hk, cap, self.d), "float16", instance_loops=inst)
        self.vt = kb.tcm("V_tile", (1, self.hk, cap, self.d), "float16", instance_loops=inst)

    def s_at(self, lead, j, t):
        """S's element of query row ``lead`` and key ``j`` (global), KV tile ``t``."""
        if self.ahead:
            return (tirx.floormod(t, 2), *lead, j - t * self.tt)
        return (*lead, j)

    def load_kv(self, h, t, klen, valid, which="KV", unless=None):
        """The K and V tile ``t``: one DMA per page of the tile, of KV head ``h``, or of
        every KV head when ``h`` is None (a page holds its heads' blocks back to back, so
        that is still one contiguous DRAM read, landing in each head's rows of the tile:
        ``kv_heads`` times fewer, larger transfers, each paying one set-up). ``which``: "K",
        "V" or both. ``unless``: ``(parameter, value)``: the load runs only where the tile
        starts at ``parameter + value`` or later (a runtime predicate): a resident tile
        that an earlier query tile, whose rows end there, loaded already is skipped."""
        kb, lay, d = self.kb, self.lay, self.d
        p, rt, tt = lay.page_tokens, self.rt, self.tt
        with kb.loop(self.ppt, "pg") as pg:
            for name, cache, tile, slots, ch in (("K_load", self.k_cache, self.kt,
                                                   self.slots_kv, self.k_channel),
                                                  ("V_load", self.v_cache, self.vt,
                                                   self.slots_kv, self.v_channel)):
                if name[0] not in which:
                    continue
                def iters(lv, pg=pg):
                    # the tile's predicate, not the page's: every page of a live tile is
                    # loaded whole, so the MMAs never read TCM rows no DMA wrote (the
                    # rows past the valid length are masked, but 0 * stale NaN is NaN)
                    row0 = t * tt + pg * rt
                    head = [("S", (0, self.hk), lv[-3])] if h is None else []
                    new = [] if unless is None else [("S", _ANY, unless[1] - t * tt - 1)]
                    return valid.iters(t * tt) + new + head + [
                        ("S", (0, self.cap), row0 + lv[-2]), ("S", (0, d), lv[-1])]

                def body(iv, cache=cache, tile=tile):
                    hh = iv[-3] if h is None else h
                    tok, dd = iv[-2], iv[-1]
                    src = cache[self.page_table[tok // p], hh, tok % p, dd]
                    return tile, (0, hh, tok, dd), src, [src], None
                # -param - (value - start - 1) > 0: the tile starts at param + value or later
                pred = None if unless is None else \
                    f"{unless[0]}:-1:{len(valid.iters(t * tt))}"
                kb.op(name, "dma", ((self.hk,) if h is None else ()) + (rt, d), iters, body,
                      where=lambda lv, pg=pg: t * tt + pg * rt + lv[-2] < klen,
                      ann={"npu.slots": slots, "npu.channel": ch, **valid.ann,
                           **({"npu.valid_whole": 1} if valid.ann else {}),
                           "npu.predicates": valid.tags(pred)})

    def step(self, h, t, rows, row_base, row_ok, ri, klen, valid, mask_ann, part,
             masks=None):
        """One KV tile for one group of query rows (``ri(row) -> leading indices``):
        ``part`` "qk" emits its S = Q @ K^T, "softmax" the rest. ``masks``: None masks
        every tile into ``S_masked``; else ``masks(c0)`` lists the in-place masks of the
        tile at key ``c0``, each ``(compile-time condition or None, [(runtime parameter,
        coefficient, value)])``: emitted under the condition, run iff every
        ``coefficient * parameter - value > 0`` (and the tile is live)."""
        kb, d, tt, sc = self.kb, self.d, self.tt, self.scale
        c0 = t * tt
        S, Sm, S2, P = self.S, self.Sm, self.S2, self.P
        m, mt, mn, dm, cr, l, ls, O = (self.m, self.mt, self.mn, self.dm, self.corr,
                                       self.l, self.ls, self.O)
        va = valid.ann
        rdom = (0, self.rows_total)

        def rk(lv):        # (row, key) iteration
            return valid.iters(c0) + [("S", rdom, row_base + lv[0]),
                                      ("S", (0, self.cap), c0 + lv[1])]

        def rk_where(lv):
            return tirx.all(row_ok(lv[0]), c0 + lv[1] < klen)

        def rred(lv):      # (row, reduced key)
            return valid.iters(c0) + [("S", rdom, row_base + lv[0]),
                                      ("R", (0, self.cap), c0 + lv[1])]

        def r_only(lv):
            return valid.iters(c0) + [("S", rdom, row_base + lv[0])]

        def rd(lv):
            return valid.iters(c0) + [("S", rdom, row_base + lv[0]), ("S", (0, d), lv[1])]

        def rd_where(lv):
            return row_ok(lv[0])

        def at(buf, i, j=None):
            """``buf``'s element of row ``i`` (and key or column ``j``)."""
            if buf is S and self.ahead:
                return self.s_at(ri(i), j, t)
            return (*ri(i), j) if j is not None and len(buf.shape) == len(ri(i)) + 1 \
                else ri(i)
        tile_at = at       # (``reduce`` has an ``at`` of its own)

        def elementwise(name, op, dst, value_fn, srcs, extents, iters, where, ann=va, dt=None):
            def body(iv):
                i = iv[-2] if len(extents) == 2 else iv[-1]
                j = iv[-1] if len(extents) == 2 else None
                loads = [s[at(s, i, j)] for s in srcs]
                return dst, at(dst, i, j), value_fn(*loads), loads, None
            kb.op(name, op, extents, iters, body, where=where, ann=ann)

        def reduce(name, op, dst, src, init, combine, at=ri):
            def body(iv):
                i, j = iv[-2], iv[-1]
                x = src[tile_at(src, i, j)]
                return dst, at(i), combine(dst[at(i)], _f32(x)), [x], tirx.const(init, "float32")
            kb.op(name, op, (rows, tt), rred, body, where=rk_where, ann=va)

        def li(i):         # the running sum l is (..., rows, 1): an MMA's (M, 1) output
            return (*ri(i), 0)

        def l_update(name, op, fn, src):
            """l = fn(l, src) in place, over the rows (one flat pass)."""
            def body(iv):
                i = iv[-1]
                x, y = l[li(i)], src[ri(i)]
                return l, li(i), fn(x, y), [x, y], None
            kb.op(name, op, (rows,), r_only, body, where=lambda lv: row_ok(lv[0]), ann=va)

        def rowsum(name):
            """l (+)= rowsum(P): on the matrix unit (P @ a column of ones, accumulating
            into l from the second tile) when the template has the ones, else a vector
            reduction (added to l by a second pass)."""
            if self.ones is not None:
                self._p_mma(name, l, lambda i, n: li(i), lambda j, n: self.ones_t[j, n], 1,
                            c0, rows, rk_where, ri, row_base, rdom, valid)
            elif name == "rowsum0":
                reduce(name, "vector:reduce_sum", l, P, 0.0, lambda a, b: a + b, at=li)
            else:
                reduce(name, "vector:reduce_sum", ls, P, 0.0, lambda a, b: a + b)
                l_update("lacc", "vector:add", lambda x, y: x + y, ls)

        def pv(name):      # O (+)= P @ V
            self._p_mma(name, O, lambda i, dd: (*ri(i), dd), lambda j, dd: self.vt[0, h, j, dd],
                        d, c0, rows, rk_where, ri, row_base, rdom, valid)

        if part == "qk":
            self._qk(h, t, rows, ri, rk, rk_where, va)
            return
        if part in ("softmax", "max"):     # the masks (and ALiBi) in place, once a tile
            if self.softcap is not None:
                # cap * tanh(k s) = cap - 2 cap / (exp(2 k s) + 1), and the softmax drops the
                # constant cap: S <- -2 cap * rsqrt(exp(2 k s) + 1) ** 2 (the vector unit has
                # no tanh and no reciprocal; exp overflows to inf for large scores, where
                # the rsqrt gives 0: the cap itself)
                f32 = lambda c: tirx.const(c, "float32")    # noqa: E731
                k2, c2 = f32(2 * self.cap_scale), f32(-2 * self.softcap)
                for name, op, fn in (
                        ("cap_exp", "vector:exp", lambda x: tirx.exp(x * k2)),
                        ("cap_rsqrt", "vector:rsqrt", lambda x: tirx.rsqrt(x + f32(1.0))),
                        ("cap_square", "vector:mul", lambda x: x * x),
                        ("cap_scale", "vector:mul", lambda x: x * c2)):
                    elementwise(name, op, S, fn, [S], (rows, tt), rk, rk_where)
            if masks is None:
                elementwise("mask", "vector:mask", Sm, lambda x: x, [S], (rows, tt), rk,
                            rk_where, ann={**va, **mask_ann})
            for cond, preds in masks(c0) if masks is not None else ():
                nv = len(valid.iters(c0))
                tag = ",".join(f"{n}:{k}:{nv + a}" for a, (n, k, _) in enumerate(preds))
                with (kb.when(cond) if cond is not None else contextlib.nullcontext()):
                    elementwise("mask", "vector:mask", S, lambda x: x, [S], (rows, tt),
                                lambda lv, preds=preds: valid.iters(c0) + [
                                    ("S", _ANY, v) for _, _, v in preds] + rk(lv)[nv:],
                                rk_where, ann={**va, **mask_ann,
                                               "npu.predicates": valid.tags(tag)})
            if self.slopes_t is not None:
                # ALiBi on every live tile, in place, after the masks (-inf + bias is -inf):
                # S += slope[head] * (key - query). The expression here is the key alone; the
                # command's origin (the query's position, lower.py) shifts each row by a
                # constant, which the softmax cancels
                def bias(iv):
                    i, j = iv[-2], iv[-1]
                    x, sl = Sm[at(Sm, i, j)], self.slopes_t[ri(i)[0], 0]
                    return Sm, at(Sm, i, j), x + sl * _f32(j), [x, sl], None
                kb.op("alibi", "vector:alibi", (rows, tt), rk, bias, where=rk_where,
                      ann={**va, **self.alibi})
        if part == "max":          # two passes, the first: the row max over every tile
            with kb.when(t == 0):
                reduce("rowmax0", "vector:reduce_max", m, Sm, _NEG_INF, tirx.Max)
            with kb.when(t > 0):
                reduce("rowmax", "vector:reduce_max", mt, Sm, _NEG_INF, tirx.Max)
                elementwise("max", "vector:max", m, tirx.Max, [m, mt], (rows,), r_only,
                            lambda lv: row_ok(lv[0]))
            return
        if part == "exp":          # the second: P = exp(S - m) with the final max m, the
            # shift and the exponent in one command (``exp_sub``: no S - m tile in the TCM)
            elementwise("exp", "vector:exp_sub", P,
                        lambda x, y: tirx.Cast("float16",
                                               tirx.exp((x - y) * tirx.const(sc, "float32"))),
                        [Sm, m], (rows, tt), rk, rk_where,
                        ann={**va, "npu.slots": 2})   # tile t + 1's P while t's MMAs read
            with kb.when(t == 0):
                rowsum("rowsum0")
                pv("PV0")
            with kb.when(t > 0):
                rowsum("rowsum")
                pv("PV")
            return
        first = kb.when(t == 0)
        with first:
            reduce("rowmax0", "vector:reduce_max", m, Sm, _NEG_INF, tirx.Max)
            elementwise("sub0", "vector:sub", S2, lambda x, y: x - y, [Sm, m], (rows, tt),
                        rk, rk_where)
            elementwise("exp0", "vector:exp", P,
                        lambda x: tirx.Cast("float16", tirx.exp(x * tirx.const(sc, "float32"))),
                        [S2], (rows, tt), rk, rk_where)
            rowsum("rowsum0")
            pv("PV0")
        with kb.when(t > 0):
            reduce("rowmax", "vector:reduce_max", mt, Sm, _NEG_INF, tirx.Max)
            row1 = (rows,)
            elementwise("max", "vector:max", mn, tirx.Max, [m, mt], row1, r_only,
                        lambda lv: row_ok(lv[0]))
            elementwise("dmax", "vector:sub", dm, lambda x, y: x - y, [m, mn], row1, r_only,
                        lambda lv: row_ok(lv[0]))
            elementwise("corr", "vector:exp", cr,
                        lambda x: tirx.exp(x * tirx.const(sc, "float32")), [dm], row1, r_only,
                        lambda lv: row_ok(lv[0]))
            elementwise("mcopy", "vector:copy", m, lambda x: x, [mn], row1, r_only,
                        lambda lv: row_ok(lv[0]))
            # O = O * c in place, then the MMA accumulates P @ V into it: no separate PV
            # tile and no vector add of it (a pass over (rows, d) per KV tile). Scaled
            # before P is computed, so the MMA can start as soon as P is ready.
            elementwise("oscale", "vector:mul", O, lambda x, y: x * y, [O, cr], (rows, d),
                        rd, rd_where)
            elementwise("sub", "vector:sub", S2, lambda x, y: x - y, [Sm, mn], (rows, tt),
                        rk, rk_where)
            elementwise("exp", "vector:exp", P,
                        lambda x: tirx.Cast("float16", tirx.exp(x * tirx.const(sc, "float32"))),
                        [S2], (rows, tt), rk, rk_where)
            l_update("lscale", "vector:mul", lambda x, y: x * y, cr)       # l = l * c
            rowsum("rowsum")
            pv("PV")

    def _qk(self, h, t, rows, ri, rk, rk_where, va):
        """S = Q @ K^T for one group of query rows."""
        kb, d, tt, S = self.kb, self.d, self.tt, self.S

        def qk(iv):
            i, j, k = iv[-3], iv[-2], iv[-1]
            a, b = self.Q[(*ri(i), k)], self.kt[0, h, j, k]
            at = self.s_at(ri(i), j, t)
            return S, at, S[at] + _f32(a) * _f32(b), [a, b], tirx.const(0.0, "float32")

        kb.op("QK", "mma", (rows, tt, d),
              lambda lv: rk(lv) + [("R", (0, d), lv[2])], qk, where=rk_where,
              ann={"npu.slots": None if self.ahead else self.slots_s, **va})

    def _p_mma(self, name, out, at, b_of, cols, c0, rows, rk_where, ri, row_base, rdom,
               valid):
        """``out[at(row)] (+)= P @ B`` over the tile, ``B[key, col] = b_of(key, col)``
        (``cols`` columns): the reduction runs over the global key index, so the MMA
        initialises ``out`` on the first tile and accumulates into it after. P @ V, and
        prefill's row sums as P @ ones (an (M, 1) MMA costs as much as P @ V: the array
        pads N to its native width; the matrix unit is what the softmax leaves idle)."""
        def iters(lv):
            return valid.iters(c0) + [("S", rdom, row_base + lv[0]), ("S", (0, cols), lv[1]),
                                      ("R", (0, self.cap), c0 + lv[2])]

        def body(iv):
            i, n, j = iv[-3], iv[-2], iv[-1]
            a, b = self.P[(*ri(i), j)], b_of(j, n)
            return out, at(i, n), out[at(i, n)] + _f32(a) * _f32(b), [a, b], \
                tirx.const(0.0, "float32")
        self.kb.op(name, "mma", (rows, cols, self.tt), iters, body,
                   where=lambda lv: rk_where([lv[0], lv[2]]), ann=valid.ann)

    def keep_running_max(self, name, rows, iters, ri, where=None):
        """Copy the final running max out of the KV loop (it is also the softmax's
        log-sum-exp offset). Lowering workaround: tcm_alloc takes a TCM buffer's instance
        to be one iteration of the innermost loop around all its accesses, so a running
        state touched only inside the KV-tile loop would get a fresh instance per tile
        (and per query head of the group); one access after the loop keeps it resident."""
        self.kb.op(name, "vector:copy", (rows,), iters,
                   lambda iv: (self.m_final, ri(iv[0]), self.m[ri(iv[0])],
                               [self.m[ri(iv[0])]], None), where=where)

    def normalize(self, rows, row_iters, rd_iters, ri, out, where=None):
        """``out = O / l`` as ``O * (1 / l)``: the reciprocal once per row (``rsqrt(l)``
        squared: the vector unit has no reciprocal, and a (rows, d) ``div`` costs four
        times a ``mul``), then one multiply pass. ``l >= 1`` (the row's max scores 1)."""
        kb, r, r2 = self.kb, self.rinv, self.rinv2
        kb.op("rsqrt_l", "vector:rsqrt", (rows,), row_iters,
              lambda iv: (r, ri(iv[0]),
                          tirx.rsqrt(self.l[(*ri(iv[0]), 0)] + tirx.const(0.0, "float32")),
                          [self.l[(*ri(iv[0]), 0)]], None), where=where)
        kb.op("inv_l", "vector:mul", (rows,), row_iters,
              lambda iv: (r2, ri(iv[0]), r[ri(iv[0])] * r[ri(iv[0])], [r[ri(iv[0])]], None),
              where=where)

        def body(iv):
            i, dd = iv[0], iv[1]
            dst, idx = out(i, dd)
            o, inv = self.O[(*ri(i), dd)], r2[ri(i)]
            return dst, idx, tirx.Cast("float16", o * inv), [o, inv], None
        kb.op("normalize", "vector:mul", (rows, self.d), rd_iters, body, where=where)

    def declare_slopes(self, slopes):
        """ALiBi's slopes (``(Hq, 1)`` float32, one per query head, in units of the unscaled
        scores: the model's slope over the softmax scale) into TCM, once."""
        kb, hq = self.kb, self.hq
        self.slopes_t = kb.tcm("slopes_t", (hq, 1), "float32")
        kb.op("slopes_load", "dma", (hq, 1),
              lambda lv: [("S", (0, hq), lv[0]), ("S", (0, 1), lv[1])],
              lambda iv: (self.slopes_t, (iv[0], iv[1]), slopes[iv[0], iv[1]],
                          [slopes[iv[0], iv[1]]], None))

    def declare_ones(self, cap):
        """A column of ones (a template constant) in TCM, for the row sums' MMAs."""
        kb = self.kb
        self.ones_t = kb.tcm("ones_t", (cap, 1), "float16")
        kb.op("ones_load", "dma", (cap, 1),
              lambda lv: [("S", (0, cap), lv[0]), ("S", (0, 1), lv[1])],
              lambda iv: (self.ones_t, (iv[0], iv[1]), self.ones[iv[0], iv[1]],
                          [self.ones[iv[0], iv[1]]], None))

    def declare_state(self, lead, tt_cap, mask_in_place=False, outer_loops=None):
        """Per-row running state and per-tile scratch, with leading dims ``lead``;
        ``mask_in_place``: the masks write S itself (no ``S_masked``). Pipelined
        (``ahead``), S has a slot axis (tile % 2) and its instance is the ``outer_loops``
        loops around the KV loop: the tiles alternate between its slots."""
        kb = self.kb
        if self.ahead:
            self.S = kb.tcm("S", (2, *lead, self.tt), "float32", instance_loops=outer_loops)
        else:
            self.S = kb.tcm("S", (*lead, tt_cap), "float32")
        self.Sm = self.S if mask_in_place else kb.tcm("S_masked", (*lead, tt_cap), "float32")
        self.S2 = kb.tcm("S_shifted", (*lead, tt_cap), "float32")
        self.P = kb.tcm("P", (*lead, tt_cap), "float16")
        for name in ("m", "mt", "mn", "dm", "corr", "ls", "m_final", "rinv", "rinv2"):
            setattr(self, name, kb.tcm(f"row_{name}", lead, "float32"))
        self.l = kb.tcm("row_l", (*lead, 1), "float32")
        self.O = kb.tcm("O", (*lead, self.d), "float32")


class _Validity:
    """Predicate of a KV tile's ops: ``param - (tile_start - offset) > 0`` (or none), and
    ``extra`` ones, ``coef * param - value(tile_start) > 0`` each (``npu.predicates``)."""

    def __init__(self, param=None, offset=0, extra=()):
        self.param, self.offset, self.extra = param, offset, tuple(extra)

    def also(self, param: str, coef: int, value) -> "_Validity":
        """This validity and ``coef * param - value(tile_start) > 0``."""
        return _Validity(self.param, self.offset, self.extra + ((param, coef, value),))

    def iters(self, start):
        if self.param is None:
            return []
        return [("S", _ANY, start - self.offset)] + \
            [("S", _ANY, value(start)) for _, _, value in self.extra]

    @property
    def ann(self):
        if self.param is None:
            return {}
        return {"npu.valid_len": self.param, "npu.valid_axis": 0,
                **({"npu.predicates": self.tags()} if self.extra else {})}

    def tags(self, more: str | None = None) -> str | None:
        """The ``npu.predicates`` of the extra predicates (their values follow the valid
        length's among the iters), with ``more`` after them."""
        out = [f"{p}:{c}:{1 + k}" for k, (p, c, _) in enumerate(self.extra)] + \
            ([more] if more else [])
        return ",".join(out) or None


def decode_attention(layout: KVCacheLayout, q_heads: int, max_pages: int, *, tile_kv: int,
                     slots_kv: int = 2, slots_s: int = 1, scale=None, channels: int = 2,
                     alibi: bool = False, softcap: float | None = None,
                     window: int | None = None):
    """Decode attention as a :class:`TileKernel`: ``q (Hq, D)`` attends to the first
    ``valid_len`` (runtime) tokens of the paged cache through ``page_table (max_pages,)``.
    ``alibi``: the scores get ``slopes[head] * (key - query)`` (input ``slopes (Hq, 1)``
    float32, over the softmax scale; the query is at ``valid_len - 1``). ``softcap``: the
    scores are ``softcap * tanh(scale * q @ k^T)`` (Gemma-2), softmax-ed unscaled.
    ``window``: a sliding window, keys ``window`` or more positions behind the query
    hidden (every tile's mask hides them)."""
    d = layout.head_dim
    cap = max_pages * layout.page_tokens
    with TileKernel("decode_attention") as kb:
        a = _Attention(kb, layout, q_heads, scale, tile_kv, slots_kv, slots_s, channels,
                       alibi={"npu.alibi_query": "valid_len", "npu.alibi_offset": -1,
                              "npu.alibi_rows": 0} if alibi else None, softcap=softcap,
                       window=window)
        hq, g, hk = a.hq, a.g, a.hk
        q = kb.buffer("q", (hq, d), "float16")
        a.k_cache = kb.buffer("K_cache", layout.shape, "float16")
        a.v_cache = kb.buffer("V_cache", layout.shape, "float16")
        a.page_table = kb.buffer("page_table", (max_pages,), "int32")
        kb.scalar("valid_len")
        slopes = kb.buffer("slopes", (hq, 1), "float32") if alibi else None
        out = kb.buffer("out", (hq, d), "float16")
        kb.begin_body()
        if alibi:
            a.declare_slopes(slopes)
        a.Q = kb.tcm("Q", (hq, d), "float16")
        a.declare_kv(cap)
        a.declare_state((hq,), cap)
        o16 = kb.tcm("O16", (hq, d), "float16")
        a.rows_total = g
        valid = _Validity("valid_len", 0)
        if a.window is not None:
            # tiles wholly behind the window (of the query at valid_len - 1) are not loaded
            # nor computed
            valid = valid.also("valid_len", -1, lambda start: _behind_window(
                start, a.tt, a.window, -1))
        n_tiles = -(-cap // a.tt)
        qd = lambda lv: [("S", (0, hq), lv[0]), ("S", (0, d), lv[1])]  # noqa: E731
        kb.op("Q_load", "dma", (hq, d), qd,
              lambda iv: (a.Q, (iv[0], iv[1]), q[iv[0], iv[1]], [q[iv[0], iv[1]]], None))
        # KV tiles outside, heads inside: a tile's pages are loaded for every KV head at
        # once (one DMA per page), then each head's query group takes its softmax step
        with kb.loop(n_tiles, "t") as t:
            a.load_kv(None, t, cap, valid)
            # every head's QK^T first, then the softmaxes: the matrix unit's queue is in
            # program order, so a QK^T queued behind the previous head's P @ V (which waits
            # for that head's softmax) would leave the vector unit idle at every head
            for part in ("qk", "softmax"):
                with kb.loop(hk, "h") as h:
                    a.step(h, t, g, 0, lambda r: tirx.const(True, "bool"),
                           lambda i, h=h: (h * g + i,), cap, valid,
                           a.mask_ann({"npu.mask_len": "valid_len"}), part)
        a.keep_running_max("m_final", hq, lambda lv: [("S", (0, hq), lv[0])], lambda i: (i,))
        a.normalize(hq, lambda lv: [("S", (0, hq), lv[0])], qd, lambda i: (i,),
                    lambda i, dd: (o16, (i, dd)))
        kb.op("O_store", "dma", (hq, d), qd,
              lambda iv: (out, (iv[0], iv[1]), o16[iv[0], iv[1]], [o16[iv[0], iv[1]]], None))
    return kb


def prefill_attention(layout: KVCacheLayout, q_heads: int, tokens: int, *, tile_q: int,
                      tile_kv: int, slots_kv: int = 2, slots_s: int = 1, rowsum_mma: int = 1,
                      chunked: bool = False, max_pages: int | None = None, scale=None,
                      channels: int = 2, alibi: bool = False, two_pass: int = 0,
                      softcap: float | None = None, window: int | None = None):
    """Causal prefill attention as a :class:`TileKernel`.

    ``q, out (tokens, Hq, D)``. Whole prompt (``chunked=False``): the keys are the first
    ``tokens`` tokens of the cache, KV tiles above the diagonal are not emitted.
    ``chunked=True``: the queries are positions ``pos .. pos + tokens`` (runtime ``pos``),
    the keys the first ``valid_len`` (runtime) tokens of a cache of ``max_pages`` pages.
    ``alibi``: as in :func:`decode_attention` (the queries at ``pos`` + their row);
    ``softcap`` and ``window`` too (the window's mask runs on the tiles whose first key is
    behind the q tile's last query's window).
    """
    d, p = layout.head_dim, layout.page_tokens
    c = tokens
    if max_pages is None:
        max_pages = -(-c // p)
    cap = max_pages * p
    with TileKernel("prefill_attention") as kb:
        a = _Attention(kb, layout, q_heads, scale, tile_kv, slots_kv, slots_s, channels,
                       ahead=slots_s == 2 and not two_pass,
                       alibi={"npu.alibi_query": "pos" if chunked else "",
                              "npu.alibi_offset": 0, "npu.alibi_rows": 1} if alibi else None,
                       softcap=softcap, window=window)
        hq, g, hk = a.hq, a.g, a.hk
        if two_pass:          # K and V load in passes of their own: each on every channel
            a.k_channel = a.v_channel = None
        tq = min(tile_q, c)
        q = kb.buffer("q", (c, hq, d), "float16")
        a.k_cache = kb.buffer("K_cache", layout.shape, "float16")
        a.v_cache = kb.buffer("V_cache", layout.shape, "float16")
        a.page_table = kb.buffer("page_table", (max_pages,), "int32")
        if chunked:
            kb.scalar("pos")
            kb.scalar("valid_len")
        if rowsum_mma:
            a.ones = kb.const("ones", (cap, 1), "float16", 1.0)
        slopes = kb.buffer("slopes", (hq, 1), "float32") if alibi else None
        out = kb.buffer("out", (c, hq, d), "float16")
        kb.begin_body()
        if alibi:
            a.declare_slopes(slopes)
        q_raw = kb.tcm("Q_raw", (c, hq, d), "float16")
        a.Q = kb.tcm("Q", (hq, c, d), "float16")
        kv_len = cap if chunked else c
        a.declare_kv(cap, resident=bool(two_pass))
        if rowsum_mma:
            a.declare_ones(cap)
        a.declare_state((hq, c), cap, mask_in_place=True, outer_loops=2)    # h, qi
        o16 = kb.tcm("O16", (c, hq, d), "float16")
        a.rows_total = c
        n_qt = -(-c // tq)
        with kb.loop(hk, "h") as h, kb.loop(n_qt, "qi") as qi:
            q0 = qi * tq
            q_end = tirx.min(q0 + tq, c)

            def row_ok(r):
                return q0 + r < c
            tgd = lambda lv: [("S", (0, c), q0 + lv[0]), ("S", (0, g), lv[1]),  # noqa: E731
                              ("S", (0, d), lv[2])]
            kb.op("Q_load", "dma", (tq, g, d), tgd,
                  lambda iv: (q_raw, (iv[0], h * g + iv[1], iv[2]),
                              q[iv[0], h * g + iv[1], iv[2]],
                              [q[iv[0], h * g + iv[1], iv[2]]], None),
                  where=lambda lv: row_ok(lv[0]))
            tt = a.tt
            # a tile is masked only where a mask changes it: the causal one where the last
            # key is past the q tile's first row, the length one where it is past valid_len
            if chunked:
                valid = _Validity("pos", q_end)       # tile start < pos + q_end
                if a.window is not None:   # and not behind the q tile's first row's window
                    valid = valid.also("pos", -1, lambda start, q0=q0: _behind_window(
                        start, tt, a.window, q0))
                n_kt = -(-cap // tt)
                mask_ann = a.mask_ann({"npu.mask_len": "valid_len", "npu.mask_pos": "pos"})

                def masks(c0):
                    w = a.window
                    return [(None, [("pos", -1, q0 + 1 - tt - c0)]),   # c0+tt-1 > pos+q0
                            (None, [("valid_len", -1, -(c0 + tt))])] + \
                        ([(None, [("pos", 1, c0 + w - q0 - tq)])]     # pos+q0+tq-w > c0
                         if w is not None else [])
            else:
                valid = _Validity()
                n_kt = tirx.floordiv(q_end + tt - 1, tt)   # no tile above the diagonal
                mask_ann = a.mask_ann({"npu.mask_pos": ""})

                def masks(c0):
                    if a.window is None:
                        return [(c0 + tt - 1 > q0, [])]
                    # the causal diagonal or the window's lower edge crosses the tile
                    return [(tirx.Or(c0 + tt - 1 > q0, c0 < q0 + tq - a.window), [])]
            with kb.loop(g, "e") as e:
                kb.op("Q_head", "vector:copy", (tq, d),
                      lambda lv: [("S", (0, c), q0 + lv[0]), ("S", (0, d), lv[1])],
                      lambda iv: (a.Q, (h * g + e, iv[0], iv[1]), q_raw[iv[0], h * g + e, iv[1]],
                                  [q_raw[iv[0], h * g + e, iv[1]]], None),
                      where=lambda lv: row_ok(lv[0]))
            def live(t):
                """Whole prompt, with a window: a tile wholly behind the q tile's first
                row's window is neither loaded per q tile nor computed, tile 0 always is:
                ``_behind_window``'s predicate at position 0, a compile-time condition.
                (Chunked: ``valid``'s runtime predicate.)"""
                if a.window is None or chunked:
                    return contextlib.nullcontext()
                return kb.when(_behind_window(t * tt, tt, a.window, q0) < 0)

            def part(t, name):      # as in decode: the QK^T of every head first
                with live(t), kb.loop(g, "e") as e:
                    a.step(h, t, tq, q0, row_ok, lambda i, e=e: (h * g + e, i), kv_len,
                           valid, mask_ann, name, masks)
            if two_pass:
                # every live tile's scores stay in the TCM (S holds the q tile's rows over
                # the whole cache): the first pass takes the row max over them, the
                # second exponentiates with it and sums, so nothing is ever rescaled. K
                # and V stay too, for every q tile of the head: a tile is loaded by the
                # first q tile it is live for (whose rows end past its first key)
                def load(t, which):
                    if not chunked:
                        with kb.when(t * tt >= q0):
                            a.load_kv(h, t, kv_len, valid, which)
                        return
                    with kb.when(qi == 0):
                        a.load_kv(h, t, kv_len, valid, which)
                    with kb.when(qi > 0):
                        a.load_kv(h, t, kv_len, valid, which, unless=("pos", q0))
                with kb.loop(n_kt, "t") as t:
                    load(t, "K")
                    part(t, "qk")
                    part(t, "max")
                with kb.loop(n_kt, "t") as t:
                    load(t, "V")
                    part(t, "exp")
            elif a.ahead:
                # software-pipelined: iteration u loads K and runs the QK^T of tile u, then
                # the softmax and P @ V of tile u - 1, whose scores are in the other slot
                with kb.loop(n_kt + 1, "u") as u:
                    with kb.when(u < n_kt):
                        with live(u):
                            a.load_kv(h, u, kv_len, valid, "K")
                        part(u, "qk")
                    with kb.when(u > 0):
                        with live(u - 1):
                            a.load_kv(h, u - 1, kv_len, valid, "V")
                        part(u - 1, "softmax")
            else:
                with kb.loop(n_kt, "t") as t:
                    with live(t):
                        a.load_kv(h, t, kv_len, valid)
                    part(t, "qk")
                    part(t, "softmax")
            with kb.loop(g, "e") as e:
                a.keep_running_max("m_final", tq, lambda lv: [("S", (0, c), q0 + lv[0])],
                                   lambda i, e=e: (h * g + e, i), where=lambda lv: row_ok(lv[0]))
                a.normalize(tq, lambda lv: [("S", (0, c), q0 + lv[0])],
                            lambda lv: [("S", (0, c), q0 + lv[0]), ("S", (0, d), lv[1])],
                            lambda i, e=e: (h * g + e, i),
                            lambda i, dd, e=e: (o16, (i, h * g + e, dd)),
                            where=lambda lv: row_ok(lv[0]))
            kb.op("O_store", "dma", (tq, g, d), tgd,
                  lambda iv: (out, (iv[0], h * g + iv[1], iv[2]),
                              o16[iv[0], h * g + iv[1], iv[2]],
                              [o16[iv[0], h * g + iv[1], iv[2]]], None),
                  where=lambda lv: row_ok(lv[0]))
    return kb


def _schedule(kb, knobs, list_schedule: int = 0):
    sch = new_schedule(kb.func())
    for name, value in knobs:
        knob(sch, value, [value], name)        # recorded in the trace: replay re-applies it
    apply_annotations(sch, kb.ops)
    if list_schedule:
        sch.annotate(sch.get_sblock("root"), "npu.list_schedule", 1)
    return sch


def schedule_decode_attention(layout: KVCacheLayout, q_heads: int, max_pages: int, spec, *,
                              tile_kv: int, slots_kv: int = 2, slots_s: int = 1, scale=None,
                              alibi: bool = False, list_schedule: int = 0,
                              softcap: float | None = None, window: int | None = None):
    """The scheduled decode attention kernel; lower with ``**ATTENTION_LOWERING``."""
    kb = decode_attention(layout, q_heads, max_pages, tile_kv=tile_kv, slots_kv=slots_kv,
                          slots_s=slots_s, scale=scale, channels=spec.dma_channels,
                          alibi=alibi, softcap=softcap, window=window)
    return _schedule(kb, (("tile_kv", tile_kv), ("slots_kv", slots_kv), ("slots_s", slots_s),
                          ("list_schedule", list_schedule)), list_schedule)


def schedule_prefill_attention(layout: KVCacheLayout, q_heads: int, tokens: int, spec, *,
                               tile_q: int, tile_kv: int, slots_kv: int = 2, slots_s: int = 1,
                               rowsum_mma: int = 1, chunked: bool = False,
                               max_pages: int | None = None, scale=None,
                               alibi: bool = False, list_schedule: int = 0,
                               two_pass: int = 0, softcap: float | None = None,
                               window: int | None = None):
    """The scheduled prefill attention kernel; lower with ``**ATTENTION_LOWERING``."""
    kb = prefill_attention(layout, q_heads, tokens, tile_q=tile_q, tile_kv=tile_kv,
                           slots_kv=slots_kv, slots_s=slots_s, rowsum_mma=rowsum_mma,
                           chunked=chunked, max_pages=max_pages, scale=scale,
                           channels=spec.dma_channels, alibi=alibi, two_pass=two_pass,
                           softcap=softcap, window=window)
    knobs = (("tile_q", tile_q), ("tile_kv", tile_kv), ("slots_kv", slots_kv),
             ("slots_s", slots_s), ("rowsum_mma", rowsum_mma), ("list_schedule", list_schedule))
    # a knob set from before ``two_pass`` keeps its trace (and structural key) as it was
    return _schedule(kb, knobs + ((("two_pass", two_pass),) if two_pass else ()), list_schedule)
