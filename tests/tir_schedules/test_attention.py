"""Attention and KV-append templates: lowered with lower_primfunc, run on the emulator,
compared with numpy (fp16 data, fp32 softmax)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from edgetvm.errors import InvalidProgramError
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, Mma, Vector
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.attention import (ATTENTION_LOWERING, schedule_decode_attention,
                                             schedule_prefill_attention)
from edgetvm.tir_schedules.kv_cache import (KV_APPEND_LOWERING, KVCacheLayout,
                                            append_reference, gather_reference,
                                            schedule_kv_append)

SMOLLM2 = (9, 3, 64)        # query heads, kv heads, head_dim
TINY_LLAMA = (8, 4, 32)
P = 16


@pytest.fixture(scope="module")
def spec():
    return load_spec("edge-npu-16mb")


def _cache(layout, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(layout.shape).astype(np.float16)
    v = rng.standard_normal(layout.shape).astype(np.float16)
    pages = [int(x) for x in rng.permutation(layout.num_pages)]
    return k, v, pages


def _attention_ref(q, k, v, pos, group, slopes=None, scale=None, softcap=None, window=None):
    """q (C, Hq, D); k, v (Hkv, L, D); query c sees keys <= pos + c. ``slopes`` (Hq,):
    ALiBi, the scaled score of key j for the query at i gets ``slopes[h] * (j - i)``.
    ``softcap``: the scores are ``softcap * tanh(scale * q @ k^T)`` (Gemma-2). ``window``:
    keys ``window`` or more positions behind the query are hidden too."""
    c, hq, d = q.shape
    length = k.shape[1]
    out = np.zeros((c, hq, d), np.float32)
    distance = np.arange(length)[None, :] - (pos + np.arange(c)[:, None])
    visible = distance <= 0
    if window is not None:
        visible &= distance > -window
    scale = 1 / np.sqrt(d) if scale is None else scale
    for h in range(hq):
        s = q[:, h].astype(np.float32) @ k[h // group].astype(np.float32).T * scale
        if softcap is not None:
            s = softcap * np.tanh(s)
        if slopes is not None:
            s = s + slopes[h] * distance
        s = np.where(visible, s, -np.inf)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (w / w.sum(axis=1, keepdims=True)) @ v[h // group].astype(np.float32)
    return out


def _close(got, ref):
    # fp16 output of fp32 softmax: measured errors <= 1e-3
    np.testing.assert_allclose(got.astype(np.float32), ref, rtol=3e-3, atol=3e-3)


# -- KV append ----------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,n_new", [(1, 1), (5, 4)])
def test_kv_append_writes_only_new_tokens(spec, tokens, n_new):
    lay = KVCacheLayout(kv_heads=3, head_dim=64, num_pages=40)
    sch = schedule_kv_append(lay, tokens, spec)
    prog = lower_primfunc(sch.mod["main"], spec, "kv_append", **KV_APPEND_LOWERING)
    k0, v0, pages = _cache(lay)
    rng = np.random.default_rng(1)
    kn = rng.standard_normal((tokens, 3, 1, 64)).astype(np.float16)
    vn = rng.standard_normal((tokens, 3, 1, 64)).astype(np.float16)
    written = []
    for pos in (14, 600):                  # short and long past: same bytes written
        emu = Emulator(spec)
        r = emu.run(prog, {"K_cache": k0, "V_cache": v0, "k_new": kn, "v_new": vn},
                    params=lay.slot_params(pages, pos, tokens, n_new))
        np.testing.assert_array_equal(emu.state["K_cache"],
                                      append_reference(k0, kn[:n_new, :, 0], pages, pos))
        np.testing.assert_array_equal(emu.state["V_cache"],
                                      append_reference(v0, vn[:n_new, :, 0], pages, pos))
        written.append(r.counters.dram_write_bytes)
    assert written[0] == written[1] == 2 * n_new * 3 * 64 * 2


# -- decode -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,max_pages,tile_kv,slots_kv,lengths", [
    (SMOLLM2, 8, 32, 2, (77, 128)),        # two pages per tile, double-buffered
    (SMOLLM2, 4, 64, 1, (5, 61)),          # one tile = the whole capacity
    (TINY_LLAMA, 6, 16, 2, (96, 33)),      # one page per tile
])
def test_decode_attention(spec, shape, max_pages, tile_kv, slots_kv, lengths):
    hq, hk, d = shape
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=max_pages + 3, page_tokens=P)
    sch = schedule_decode_attention(lay, hq, max_pages, spec, tile_kv=tile_kv,
                                    slots_kv=slots_kv, slots_s=2)
    prog = lower_primfunc(sch.mod["main"], spec, "decode_attention", outputs=["out"],
                          **ATTENTION_LOWERING)
    # one K and one V DMA per page, each for every KV head (not one per head): the
    # DMA set-ups of 2 KB per-head transfers cost the kernel 13 % over its bytes
    loads = [c for c in prog.commands if isinstance(c, DmaLoad)]
    assert len(loads) == 1 + 2 * max_pages
    k, v, pages = _cache(lay)
    pages = pages[:max_pages]
    q = np.random.default_rng(2).standard_normal((hq, d)).astype(np.float16)
    emu = Emulator(spec)
    reads = []
    for length in lengths:                 # one static program, two valid lengths
        params = {**lay.page_table_params(pages, max_pages), "valid_len": length}
        r = emu.run(prog, {"K_cache": k, "V_cache": v, "q": q}, params=params)
        ref = _attention_ref(q[None], gather_reference(k, pages, length),
                             gather_reference(v, pages, length), length - 1, hq // hk)[0]
        _close(r.outputs["out"], ref)
        reads.append(r.counters.dram_read_bytes)
        # K/V bytes read grow with the valid length in whole KV tiles (a live tile's pages
        # are loaded whole), not with the capacity
        tokens = -(-length // tile_kv) * tile_kv
        assert r.counters.dram_read_bytes == 2 * hq * d + 2 * hk * tokens * d * 2
    tiles = [-(-n // tile_kv) for n in lengths]
    assert (reads[0] != reads[1]) == (tiles[0] != tiles[1])


def test_append_then_decode_shares_the_cache_state(spec):
    hq, hk, d = TINY_LLAMA
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=6, page_tokens=P)
    append = lower_primfunc(schedule_kv_append(lay, 1, spec).mod["main"], spec, "append",
                            **KV_APPEND_LOWERING)
    decode = lower_primfunc(schedule_decode_attention(lay, hq, 4, spec, tile_kv=32).mod["main"],
                            spec, "decode", outputs=["out"], **ATTENTION_LOWERING)
    k, v, pages = _cache(lay)
    pages = pages[:4]
    rng = np.random.default_rng(3)
    kn, vn = (rng.standard_normal((1, hk, 1, d)).astype(np.float16) for _ in range(2))
    q = rng.standard_normal((hq, d)).astype(np.float16)
    emu = Emulator(spec)
    pos = 40
    emu.run(append, {"K_cache": k, "V_cache": v, "k_new": kn, "v_new": vn},
            params=lay.slot_params(pages, pos, 1))
    r = emu.run(decode, {"q": q},
                params={**lay.page_table_params(pages, 4), "valid_len": pos + 1})
    k2 = append_reference(k, kn[:, :, 0], pages, pos)
    v2 = append_reference(v, vn[:, :, 0], pages, pos)
    ref = _attention_ref(q[None], gather_reference(k2, pages, pos + 1),
                         gather_reference(v2, pages, pos + 1), pos, hq // hk)[0]
    _close(r.outputs["out"], ref)


# -- prefill ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,tokens,tile_q,tile_kv,rowsum_mma,slots_s", [
    (SMOLLM2, 100, 32, 32, 1, 2),          # non-divisible length
    (SMOLLM2, 100, 32, 32, 1, 1),          # not pipelined
    (SMOLLM2, 100, 32, 32, 0, 2),          # the row sums on the vector unit
    (SMOLLM2, 48, 48, 48, 1, 2),           # tiles = the whole length
    (TINY_LLAMA, 77, 32, 16, 1, 2),
    (TINY_LLAMA, 77, 16, 32, 1, 2),        # KV tiles larger than q tiles
    (TINY_LLAMA, 65, 48, 32, 1, 2),        # a last KV tile of one key, met by 17 rows
])
def test_prefill_attention_causal(spec, shape, tokens, tile_q, tile_kv, rowsum_mma, slots_s):
    hq, hk, d = shape
    max_pages = -(-tokens // P)
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=max_pages + 2, page_tokens=P)
    sch = schedule_prefill_attention(lay, hq, tokens, spec, tile_q=tile_q, tile_kv=tile_kv,
                                     slots_kv=2, slots_s=slots_s, rowsum_mma=rowsum_mma)
    prog = lower_primfunc(sch.mod["main"], spec, "prefill_attention", outputs=["out"],
                          **ATTENTION_LOWERING)
    k, v, pages = _cache(lay)
    pages = pages[:max_pages]
    q = np.random.default_rng(4).standard_normal((tokens, hq, d)).astype(np.float16)
    r = Emulator(spec).run(prog, {"K_cache": k, "V_cache": v, "q": q},
                           params=lay.page_table_params(pages, max_pages))
    ref = _attention_ref(q, gather_reference(k, pages, tokens),
                         gather_reference(v, pages, tokens), 0, hq // hk)
    _close(r.outputs["out"], ref)
    # tiles strictly above the diagonal are not emitted: QK^T MMAs per (kv head, q head)
    n_q = -(-tokens // tile_q)
    emitted = sum(-(-min(tokens, (i + 1) * tile_q) // tile_kv) for i in range(n_q))
    assert sum(isinstance(c, Mma) and c.transpose_b for c in prog.commands) == emitted * hq
    # the row sums: an (M, 1) MMA per tile and head, or a vector reduction
    _check_row_sums(prog, emitted * hq, rowsum_mma)
    # every head's QK^T of a KV tile is queued before the first softmax (the matrix unit's
    # queue is in program order); then per head its row sums and P @ V. Pipelined, the
    # QK^T of tile t + 1 are queued before the row sums and P @ V of tile t
    g = hq // hk
    seq = "".join("Q" if c.transpose_b else "r" if c.b.shape[1] == 1 else "V"
                  for c in prog.commands if isinstance(c, Mma))
    pv = f"({'rV' if rowsum_mma else 'V'}){{{g}}}"
    block = f"Q{{{g}}}(Q{{{g}}}{pv})*{pv}" if slots_s == 2 else f"Q{{{g}}}{pv}"
    assert re.fullmatch(f"({block})+", seq), seq[:40]
    if slots_s == 2 and n_q < emitted:      # some q tile has two KV tiles: it overlaps
        assert re.search(f"Q{{{2 * g}}}", seq)
    # masked in place, only where the causal diagonal crosses the tile (its last key is
    # past the q tile's first row): one mask per such tile and query head
    crossing = sum(t * tile_kv + tile_kv - 1 > i * tile_q for i in range(n_q)
                   for t in range(-(-min(tokens, (i + 1) * tile_q) // tile_kv)))
    assert 0 < crossing < emitted or emitted == n_q
    assert sum(isinstance(c, Vector) and c.op == "mask" for c in prog.commands) == \
        crossing * hq
    assert all(c.dst == c.srcs[0] for c in prog.commands
               if isinstance(c, Vector) and c.op == "mask")
    # the output is rescaled in place and accumulated by the MMA, normalised by a multiply:
    # no vector add or div over (rows, head_dim)
    assert not any(isinstance(c, Vector) and c.op in ("add", "div") and c.dst.shape[1] == d
                   for c in prog.commands)


def _check_row_sums(prog, tiles, rowsum_mma):
    """An (M, 1) row-sum MMA per KV tile and query head, or a vector reduction."""
    sums = sum(isinstance(c, Mma) and c.b.shape[1] == 1 for c in prog.commands)
    reductions = sum(isinstance(c, Vector) and c.op == "reduce_sum" for c in prog.commands)
    assert (sums, reductions) == ((tiles, 0) if rowsum_mma else (0, tiles))


def _prefill_program(spec, shape, tokens, max_pages, **kw):
    """A lowered prefill attention over a shuffled cache: (layout, program, K, V, pages)."""
    hq, hk, d = shape
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=max_pages + 2, page_tokens=P)
    sch = schedule_prefill_attention(lay, hq, tokens, spec, max_pages=max_pages, **kw)
    prog = lower_primfunc(sch.mod["main"], spec, "prefill_attention", outputs=["out"],
                          **ATTENTION_LOWERING)
    k, v, pages = _cache(lay)
    return lay, prog, k, v, pages[:max_pages]


@pytest.mark.parametrize("shape,chunk,max_pages,positions,rowsum_mma", [
    (SMOLLM2, 32, 8, (96, 5), 1),
    (SMOLLM2, 32, 8, (96, 5), 0),
    (TINY_LLAMA, 32, 6, (64, 17), 1),
    # pos + q0 at each residue next to a KV tile's end (tile_kv 32, q tiles at 0 and 16):
    # the causal mask's predicate must run the mask on a tile whose last key is one past
    # a q tile's first row (30, 14), and skip none it changes (an off-by-one survived
    # positions 96, 5, 64 and 17)
    (TINY_LLAMA, 32, 6, (0, 14, 15, 16, 30, 31, 33, 46), 1),
])
def test_chunked_prefill_attention(spec, shape, chunk, max_pages, positions, rowsum_mma):
    hq, hk, d = shape
    lay, prog, k, v, pages = _prefill_program(spec, shape, chunk, max_pages, tile_q=16,
                                              tile_kv=32, chunked=True, rowsum_mma=rowsum_mma)
    q = np.random.default_rng(5).standard_normal((chunk, hq, d)).astype(np.float16)
    emu = Emulator(spec)
    for pos in positions:                  # one static program, two chunk positions
        length = pos + chunk
        params = {**lay.page_table_params(pages, max_pages), "pos": pos, "valid_len": length}
        r = emu.run(prog, {"K_cache": k, "V_cache": v, "q": q}, params=params, trace=True)
        ref = _attention_ref(q, gather_reference(k, pages, length),
                             gather_reference(v, pages, length), pos, hq // hk)
        _close(r.outputs["out"], ref)
        # KV tiles wholly past a q tile's diagonal (its last row: pos + q0 + 15) are
        # skipped; masks run on the live tiles a mask changes only, by runtime predicates:
        # the causal one where the tile's last key is past the q tile's first row, the
        # length one where it is past valid_len (0, 1 or 2 mask commands per tile and head)
        live = masks = 0
        for q0 in range(0, chunk, 16):
            for c0 in range(0, max_pages * P, 32):
                if c0 < pos + q0 + 16:
                    live += 1
                    masks += (c0 + 31 > pos + q0) + (c0 + 32 > length)
        ran = [prog.commands[e.index] for e in r.trace]
        assert sum(isinstance(c, Mma) and c.transpose_b for c in ran) == live * hq
        assert sum(isinstance(c, Vector) and c.op == "mask" for c in ran) == masks * hq
    # every (q tile, KV tile) is in the static program, predicated at run time
    _check_row_sums(prog, hq * (chunk // 16) * (max_pages * P // 32), rowsum_mma)


@pytest.mark.parametrize(
    "shape,tokens,chunked,tile_q,tile_kv,rowsum_mma,positions,slots_kv,list_schedule", [
        (SMOLLM2, 100, False, 32, 32, 1, (0,), 2, 1),    # whole prompt, non-divisible length
        (SMOLLM2, 64, False, 16, 32, 0, (0,), 2, 1),     # the row sums on the vector unit
        (TINY_LLAMA, 65, False, 48, 32, 1, (0,), 2, 1),  # a last KV tile of one key
        # chunks at every position of a 96-token cache: a q tile's first row on a KV
        # tile's first key (pos + q0 = c0, the resident loads' boundary) and either side
        (TINY_LLAMA, 32, True, 16, 32, 1, range(0, 65), 2, 1),
        # q tiles larger than KV tiles, one K/V slot (the next head's loads wait for this
        # head's reads), the loop nest's order, the row sums on the vector unit
        (TINY_LLAMA, 32, True, 32, 16, 0, (0, 15, 16, 17, 47, 48, 49, 64), 1, 0),
    ])
def test_two_pass_prefill_attention(spec, shape, tokens, chunked, tile_q, tile_kv,
                                    rowsum_mma, positions, slots_kv, list_schedule):
    """``two_pass=1``: the first pass takes each row's max over every live KV tile, the
    second exponentiates with it (``exp_sub``) and sums: nothing is rescaled, and K and V
    are loaded once per head, kept for its later q tiles. The scores are large (a stale
    max, such as the first tile's, overflows P's fp16 into inf / NaN; softmax is
    shift-invariant, so small scores would hide it)."""
    hq, hk, d = shape
    max_pages = 6 if chunked else -(-tokens // P)
    lay, prog, k, v, pages = _prefill_program(
        spec, shape, tokens, max_pages, tile_q=tile_q, tile_kv=tile_kv, slots_kv=slots_kv,
        slots_s=2, rowsum_mma=rowsum_mma, chunked=chunked, two_pass=1,
        list_schedule=list_schedule)
    rng = np.random.default_rng(7)
    k = (k.astype(np.float32) * 6).astype(np.float16)
    ramp = np.linspace(0.2, 1.0, lay.page_tokens)[None, None, :, None]   # later keys larger
    k = (k.astype(np.float32) * ramp).astype(np.float16)
    q = (rng.standard_normal((tokens, hq, d)) * 6).astype(np.float16)
    emu = Emulator(spec)
    for pos in positions:
        length = pos + tokens
        params = lay.page_table_params(pages, max_pages)
        if chunked:
            params = {**params, "pos": pos, "valid_len": length}
        r = emu.run(prog, {"K_cache": k, "V_cache": v, "q": q}, params=params, trace=True)
        out = r.outputs["out"]
        # K and V stay in the TCM across the head's q tiles: each page of a live KV tile
        # is loaded once per KV head, by the first q tile it is live for
        live = -(-length // tile_kv)                    # KV tiles, each of whole pages
        loaded = min(live * tile_kv // P, max_pages)      # (but the cache's last)
        ran = [prog.commands[e.index] for e in r.trace]
        for cache in ("K_cache", "V_cache"):
            assert sum(isinstance(c, DmaLoad) and c.src.tensor == cache for c in ran) == \
                hk * loaded, (cache, pos)
        if chunked:       # masks once per live tile a mask changes, in the first pass only
            masks = sum((c0 + tile_kv - 1 > pos + q0) + (c0 + tile_kv > length)
                        for q0 in range(0, tokens, tile_q)
                        for c0 in range(0, max_pages * P, tile_kv) if c0 < pos + q0 + tile_q)
            assert sum(isinstance(c, Vector) and c.op == "mask" for c in ran) == masks * hq
        kk = gather_reference(k, pages, length)
        ref = _attention_ref(q, kk, gather_reference(v, pages, length), pos, hq // hk)
        scores = np.einsum("shd,hld->hsl", q.astype(np.float32),
                           np.repeat(kk.astype(np.float32), hq // hk, axis=0)) / np.sqrt(d)
        seen = np.arange(length)[None, :] <= pos + np.arange(tokens)[:, None]
        assert np.ptp(scores[:, seen]) > 40     # the visible scores exercise the max
        _close(out, ref)
    vec = [c for c in prog.commands if isinstance(c, Vector)]
    # P from the scores in one command per tile and head, no S - m tile; the output is
    # never rescaled in place (O * c): the only (rows, head_dim) multiply is the
    # normalisation into fp16
    assert sum(c.op == "exp_sub" for c in vec) == \
        sum(isinstance(c, Mma) and c.transpose_b for c in prog.commands)
    assert not any(c.op in ("sub", "exp") and c.dst.shape[1] == tile_kv for c in vec)
    assert not any(c.op == "mul" and c.dst == c.srcs[0] and c.dst.shape[1] == d for c in vec)
    assert all(c.dst.dtype == "float16" for c in vec
               if c.op == "mul" and c.dst.shape[1] == d and c.dst.shape[0] > 1)  # (not 1 / l)


def _variant(spec, kind, rng, cache_seed, lengths, positions, q_scale=1.0, **kw):
    """SmolLM2's attention lowered with ``kw`` as ``kind``: "decode" over a shuffled
    6-page cache (seed ``cache_seed``), "prefill" (80 tokens, whole prompt) or "chunked"
    (32 tokens, 6 pages); queries from ``rng`` times ``q_scale``. Returns ``(layout,
    program, K, V, pages, max_pages, q, runs)``, a run ``(query position, params, q fed)``
    for each decode valid length in ``lengths`` or chunk position in ``positions``."""
    hq, hk, d = SMOLLM2
    max_pages = 6
    if kind == "decode":
        lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=max_pages + 2, page_tokens=P)
        prog = lower_primfunc(schedule_decode_attention(lay, hq, max_pages, spec,
                                                        **kw).mod["main"], spec,
                              "decode_attention", outputs=["out"], **ATTENTION_LOWERING)
        k, v, pages = _cache(lay, seed=cache_seed)
        pages = pages[:max_pages]
        q = (rng.standard_normal((1, hq, d)) * q_scale).astype(np.float16)
        runs = [(length - 1, {"valid_len": length}, q[0]) for length in lengths]
    else:
        tokens = 32 if kind == "chunked" else 80
        max_pages = max_pages if kind == "chunked" else tokens // P
        lay, prog, k, v, pages = _prefill_program(spec, SMOLLM2, tokens, max_pages,
                                                  chunked=kind == "chunked", **kw)
        q = (rng.standard_normal((tokens, hq, d)) * q_scale).astype(np.float16)
        runs = [(pos, {"pos": pos, "valid_len": pos + tokens}, q) for pos in positions] \
            if kind == "chunked" else [(0, {}, q)]
    return lay, prog, k, v, pages, max_pages, q, runs


@pytest.mark.parametrize("kind,kw", [
    ("decode", dict(tile_kv=32, slots_s=1)),
    ("decode", dict(tile_kv=16, slots_s=2)),
    ("prefill", dict(tile_q=32, tile_kv=32, slots_s=2)),           # pipelined
    ("prefill", dict(tile_q=32, tile_kv=16, slots_s=1, rowsum_mma=0)),
    ("prefill", dict(tile_q=32, tile_kv=32, slots_s=2, two_pass=1, list_schedule=1)),
    ("chunked", dict(tile_q=16, tile_kv=32, slots_s=2)),
    ("chunked", dict(tile_q=16, tile_kv=32, slots_s=2, two_pass=1)),
])
def test_soft_capped_scores(spec, kind, kw):
    """Gemma-2's attention: scores ``cap * tanh(scale * q @ k^T)`` before the mask and the
    softmax, against numpy's ``tanh``. The scores reach far past the cap (``scale * q @
    k^T`` up to about 60: ``exp(2x)`` overflows fp32 there), and the cap (1.5) is small, so
    a score left uncapped, capped with the wrong sign or scale, or an overflow left as inf
    or NaN changes the output; the masked keys stay hidden (a cap applied after the mask
    would raise them to -cap)."""
    hq, hk, d = SMOLLM2
    scale, cap = 0.75, 1.5
    lay, prog, k, v, pages, max_pages, q, runs = _variant(
        spec, kind, np.random.default_rng(11), 4, (37, 96), (0, 19, 64), q_scale=6,
        scale=scale, softcap=cap, **kw)
    # capped once per tile of scores, on the vector unit: rsqrt(exp(2 scale s) + 1)
    caps = [c for c in prog.commands if isinstance(c, Vector) and c.op == "rsqrt"
            and c.imm == 1.0]
    assert len(caps) == sum(isinstance(c, Mma) and c.transpose_b for c in prog.commands)
    for pos, params, qin in runs:
        length = pos + len(q)
        r = Emulator(spec).run(prog, {"K_cache": k, "V_cache": v, "q": qin},
                               params={**lay.page_table_params(pages, max_pages), **params})
        kk = gather_reference(k, pages, length)
        raw = np.einsum("shd,hld->hsl", q.astype(np.float32),
                        np.repeat(kk.astype(np.float32), hq // hk, axis=0)) * scale
        assert np.abs(raw).max() > 44           # exp(2x) overflows fp32
        ref = _attention_ref(q, kk, gather_reference(v, pages, length), pos, hq // hk,
                             scale=scale, softcap=cap)
        got = r.outputs["out"].reshape(ref.shape)
        _close(got, ref)
        uncapped = _attention_ref(q, kk, gather_reference(v, pages, length), pos, hq // hk,
                                  scale=scale)
        assert np.abs(ref - uncapped).max() > 0.1      # the cap matters to this output


def test_soft_capped_scores_refuse_a_bad_cap(spec):
    lay = KVCacheLayout(kv_heads=3, head_dim=64, num_pages=6, page_tokens=P)
    with pytest.raises(ValueError, match="soft-cap"):
        schedule_decode_attention(lay, 9, 4, spec, tile_kv=32, softcap=-2.0)
    with pytest.raises(ValueError, match="ALiBi"):
        schedule_decode_attention(lay, 9, 4, spec, tile_kv=32, softcap=2.0, alibi=True)


@pytest.mark.parametrize("kind,window,kw", [
    ("decode", 20, dict(tile_kv=16, slots_s=1)),        # whole tiles behind the window
    ("decode", 30, dict(tile_kv=32, slots_s=2, softcap=1.5)),
    ("prefill", 24, dict(tile_q=32, tile_kv=16, slots_s=2)),
    ("prefill", 7, dict(tile_q=16, tile_kv=16, slots_s=1, rowsum_mma=0)),
    ("prefill", 18, dict(tile_q=16, tile_kv=16, slots_s=2, two_pass=1, list_schedule=1)),
    ("chunked", 24, dict(tile_q=16, tile_kv=16, slots_s=2)),
    ("chunked", 33, dict(tile_q=16, tile_kv=16, slots_s=2, two_pass=1, softcap=1.5)),
])
def test_sliding_window(spec, kind, window, kw):
    """Keys ``window`` or more positions behind the query hidden (Mistral, Qwen2, Gemma-2's
    and Gemma-3's local layers), against numpy at lengths past the window, where whole KV
    tiles, the first among them, are behind some rows' windows: a tile whose keys are all
    hidden from a row starts its online softmax (at fp32's lowest finite value, not -inf,
    so its weights are rescaled to 0 by the first tile the row sees, not NaN). A window
    mask skipped on a tile it crosses, off by one, or hiding keys to -inf (NaN) fails. The
    tiles wholly behind every row's window are neither loaded nor computed but tile 0,
    which starts each row's online softmax (counted in the trace; decode's DRAM bytes)."""
    hq, hk, d = SMOLLM2
    cap = kw.get("softcap")
    tt, tq = kw["tile_kv"], kw.get("tile_q", 1)
    # decode's last length: the tile after tile 0 ends at the window's first visible key;
    # chunk position 16 + 14 + window: tile 1's last key is the first q tile's first
    # visible key
    lay, prog, k, v, pages, max_pages, q, runs = _variant(
        spec, kind, np.random.default_rng(13), 5, (window - 3, 37, 96, 2 * tt - 1 + window),
        (0, 19, 64, 30 + window), window=window, **kw)
    masks = [c for c in prog.commands if isinstance(c, Vector) and c.op == "mask"]
    assert any(c.floor is not None or c.window_offset is not None for c in masks)
    for pos, params, qin in runs:
        length = pos + len(q)
        r = Emulator(spec).run(prog, {"K_cache": k, "V_cache": v, "q": qin},
                               params={**lay.page_table_params(pages, max_pages), **params},
                               trace=True)
        # the tiles wholly behind every row's window are not computed (tile 0 is: it
        # starts the online softmax); decode reads only the others' K and V
        ran = [prog.commands[e.index] for e in r.trace]
        if kind == "decode":
            live = [c0 for c0 in range(0, length, tt) if c0 == 0 or c0 + tt + window > length]
            assert r.counters.dram_read_bytes == 2 * hq * d + 2 * hk * len(live) * tt * d * 2
            assert sum(isinstance(c, Mma) and c.transpose_b for c in ran) == hk * len(live)
        else:
            rows = len(q)
            live = sum(1 for q0 in range(0, rows, tq) for c0 in range(0, length, tt)
                       if c0 < pos + min(q0 + tq, rows) and
                       (c0 == 0 or c0 + tt + window - 1 > pos + q0))
            assert sum(isinstance(c, Mma) and c.transpose_b for c in ran) == hq * live
            every = sum(1 for q0 in range(0, rows, tq) for c0 in range(0, length, tt)
                        if c0 < pos + min(q0 + tq, rows))
            assert live < every or pos + rows < 64      # some skipped (past 64 keys)
        kk, vv = gather_reference(k, pages, length), gather_reference(v, pages, length)
        ref = _attention_ref(q, kk, vv, pos, hq // hk, softcap=cap,
                             scale=0.125 if cap else None, window=window)
        got = r.outputs["out"].reshape(ref.shape)
        assert np.isfinite(got).all()
        _close(got, ref)
        if length > window + 16:        # the window hides keys that change this output
            full = _attention_ref(q, kk, vv, pos, hq // hk, softcap=cap,
                                  scale=0.125 if cap else None)
            assert np.abs(ref - full).max() > 0.05


# -- list scheduling ----------------------------------------------------------------------
def _no_sync(cmd):
    return repr(dataclasses.replace(cmd, wait=(), signal=()))


@pytest.mark.parametrize("chunked", [False, True])
def test_list_scheduled_prefill_attention_is_the_same_kernel_in_another_order(spec, chunked):
    """``list_schedule=1``: the same commands, each unit's queue reordered within the
    ops' byte dependencies (the score slots, the K/V tiles, the running max and sum per
    head): outputs equal to numpy and bit-identical to the loop nest's order, at two
    chunk positions (predicated tiles) when chunked."""
    shape, tokens, max_pages = SMOLLM2, 64, 8
    hq, hk, d = shape
    kw = dict(tile_q=16, tile_kv=32, slots_kv=2, slots_s=2, chunked=chunked)
    if not chunked:
        max_pages = tokens // P
    progs = {ls: _prefill_program(spec, shape, tokens, max_pages, list_schedule=ls, **kw)
             for ls in (0, 1)}
    lay, plain, k, v, pages = progs[0]
    listed = progs[1][1]
    assert sorted(map(_no_sync, listed.commands)) == sorted(map(_no_sync, plain.commands))
    assert list(map(_no_sync, listed.commands)) != list(map(_no_sync, plain.commands))
    q = np.random.default_rng(6).standard_normal((tokens, hq, d)).astype(np.float16)
    for pos in ((0, 32) if chunked else (0,)):
        length = pos + tokens
        params = lay.page_table_params(pages, max_pages)
        if chunked:
            params = {**params, "pos": pos, "valid_len": length}
        outs = [Emulator(spec).run(p, {"K_cache": k, "V_cache": v, "q": q},
                                   params=params).outputs["out"] for p in (plain, listed)]
        ref = _attention_ref(q, gather_reference(k, pages, length),
                             gather_reference(v, pages, length), pos, hq // hk)
        _close(outs[1], ref)
        np.testing.assert_array_equal(outs[1], outs[0])


def test_the_list_schedule_plans_for_the_position_it_is_given(spec):
    """``plan_params``: a chunked prefill attention list-scheduled for the bucket's worst
    case (a 64-row chunk at position 64 of a 128-token cache), where the KV tiles above
    each q tile's diagonal are predicated off, against the same order planned as if every
    tile ran and against the loop nest's order. Measured with the power budget lifted
    (at these sizes the governor's 10,000-cycle intervals decide more than the order):
    the planned order is the fastest (measured 21,764 cycles against 23,428 unplanned and
    26,514 in loop order), computes what numpy does, and at another position (0: more
    tiles predicated off) still the same outputs as the loop order."""
    from edgetvm.target.spec import spec_from_dict
    d = spec.to_dict()
    d["power_profiles"][d["default_profile"]]["budget_mw"] = 1e9
    unthrottled = spec_from_dict(d)
    hq, hk, d_head = SMOLLM2
    tokens, max_pages, pos = 64, 8, 64
    lay = KVCacheLayout(kv_heads=hk, head_dim=d_head, num_pages=max_pages + 2, page_tokens=P)
    k, v, pages = _cache(lay, seed=3)
    pages = pages[:max_pages]
    q = np.random.default_rng(8).standard_normal((tokens, hq, d_head)).astype(np.float16)
    progs = {}
    for name, ls, plan in (("loop", 0, None), ("unplanned", 1, None),
                           ("planned", 1, {"pos": pos, "valid_len": pos + tokens})):
        sch = schedule_prefill_attention(lay, hq, tokens, unthrottled, max_pages=max_pages,
                                         tile_q=32, tile_kv=32, slots_kv=2, slots_s=2,
                                         chunked=True, list_schedule=ls)
        progs[name] = lower_primfunc(sch.mod["main"], unthrottled, "prefill_attention",
                                     outputs=["out"], **ATTENTION_LOWERING, plan_params=plan)
    assert sorted(map(_no_sync, progs["planned"].commands)) == \
        sorted(map(_no_sync, progs["loop"].commands))
    for at in (pos, 0):
        params = {**lay.page_table_params(pages, max_pages), "pos": at,
                  "valid_len": at + tokens}
        runs = {n: Emulator(unthrottled).run(p, {"K_cache": k, "V_cache": v, "q": q},
                                             params=params) for n, p in progs.items()}
        ref = _attention_ref(q, gather_reference(k, pages, at + tokens),
                             gather_reference(v, pages, at + tokens), at, hq // hk)
        _close(runs["planned"].outputs["out"], ref)
        np.testing.assert_array_equal(runs["planned"].outputs["out"],
                                      runs["loop"].outputs["out"])
        if at == pos:
            cyc = {n: r.counters.total_cycles for n, r in runs.items()}
            assert cyc["planned"] < cyc["unplanned"] < cyc["loop"], cyc


def test_list_scheduled_decode_attention_matches(spec):
    hq, hk, d = SMOLLM2
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=8, page_tokens=P)
    k, v, pages = _cache(lay, seed=2)
    q = np.random.default_rng(7).standard_normal((hq, d)).astype(np.float16)
    length = 100
    outs = []
    for ls in (0, 1):
        sch = schedule_decode_attention(lay, hq, 8, spec, tile_kv=32, slots_kv=2, slots_s=2,
                                        list_schedule=ls)
        prog = lower_primfunc(sch.mod["main"], spec, "decode_attention", outputs=["out"],
                              **ATTENTION_LOWERING)
        params = {**lay.page_table_params(pages, 8), "valid_len": length}
        outs.append(Emulator(spec).run(prog, {"K_cache": k, "V_cache": v, "q": q},
                                       params=params).outputs["out"])
    ref = _attention_ref(q[None], gather_reference(k, pages, length),
                         gather_reference(v, pages, length), length - 1, hq // hk)[0]
    _close(outs[1], ref)
    np.testing.assert_array_equal(outs[1], outs[0])


# -- ALiBi --------------------------------------------------------------------------------
def _slopes(hq):
    """Press et al.'s slopes for ``hq`` heads (2^(-8 h / hq)), shuffled so a bias taken
    from the wrong head differs; steep enough that the bias decides which keys count."""
    m = 2.0 ** (-8.0 * np.arange(1, hq + 1) / hq)
    return np.random.default_rng(7).permutation(m * 8).astype(np.float32)


def _slope_feed(slopes, d):
    return (slopes * np.sqrt(d)).astype(np.float32)[:, None]   # in unscaled-score units


@pytest.mark.parametrize("shape,max_pages,tile_kv,lengths", [
    (TINY_LLAMA, 6, 16, (96, 33)),         # two query heads per KV head: a slope per row
    (SMOLLM2, 4, 32, (5, 61)),
])
def test_decode_attention_with_alibi(spec, shape, max_pages, tile_kv, lengths):
    hq, hk, d = shape
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=max_pages + 3, page_tokens=P)
    sch = schedule_decode_attention(lay, hq, max_pages, spec, tile_kv=tile_kv, alibi=True)
    prog = lower_primfunc(sch.mod["main"], spec, "decode_attention", outputs=["out"],
                          **ATTENTION_LOWERING)
    k, v, pages = _cache(lay)
    pages = pages[:max_pages]
    q = np.random.default_rng(2).standard_normal((hq, d)).astype(np.float16)
    slopes = _slopes(hq)
    emu = Emulator(spec)
    for length in lengths:
        params = {**lay.page_table_params(pages, max_pages), "valid_len": length}
        r = emu.run(prog, {"K_cache": k, "V_cache": v, "q": q,
                           "slopes": _slope_feed(slopes, d)}, params=params)
        kk, vv = gather_reference(k, pages, length), gather_reference(v, pages, length)
        ref = _attention_ref(q[None], kk, vv, length - 1, hq // hk, slopes)[0]
        _close(r.outputs["out"], ref)
        # the bias matters: without it the answer is another one
        plain = _attention_ref(q[None], kk, vv, length - 1, hq // hk)[0]
        assert np.abs(plain - ref).max() > 0.05
    # one bias per KV tile and KV head (over its group of query heads)
    n_tiles = max_pages * P // tile_kv
    assert sum(isinstance(c, Vector) and c.op == "alibi" for c in prog.commands) == \
        n_tiles * hk


@pytest.mark.parametrize("tokens,tile_q,chunked,positions", [
    (65, 32, False, (0,)),                 # the last q tile has one row
    (32, 16, True, (96, 5)),
])
def test_prefill_attention_with_alibi(spec, tokens, tile_q, chunked, positions):
    hq, hk, d = TINY_LLAMA
    max_pages = 8
    lay, prog, k, v, pages = _prefill_program(spec, TINY_LLAMA, tokens, max_pages,
                                              tile_q=tile_q, tile_kv=32, chunked=chunked,
                                              alibi=True)
    q = np.random.default_rng(4).standard_normal((tokens, hq, d)).astype(np.float16)
    slopes = _slopes(hq)
    emu = Emulator(spec)
    for pos in positions:
        length = pos + tokens
        params = lay.page_table_params(pages, max_pages if chunked else -(-tokens // P))
        if chunked:
            params.update(pos=pos, valid_len=length)
        r = emu.run(prog, {"K_cache": k, "V_cache": v, "q": q,
                           "slopes": _slope_feed(slopes, d)}, params=params)
        ref = _attention_ref(q, gather_reference(k, pages, length),
                             gather_reference(v, pages, length), pos, hq // hk, slopes)
        _close(r.outputs["out"], ref)


# -- the race check -----------------------------------------------------------------------
def test_double_buffered_attention_without_an_event_is_refused(spec):
    hq, hk, d = SMOLLM2
    lay = KVCacheLayout(kv_heads=hk, head_dim=d, num_pages=8, page_tokens=P)
    sch = schedule_decode_attention(lay, hq, 8, spec, tile_kv=32, slots_kv=2)
    prog = lower_primfunc(sch.mod["main"], spec, "decode_attention", outputs=["out"],
                          **ATTENTION_LOWERING)
    k, v, pages = _cache(lay)
    params = {**lay.page_table_params(pages, 8), "valid_len": 128}
    inputs = {"K_cache": k, "V_cache": v, "q": np.zeros((hq, d), np.float16)}
    Emulator(spec).run(prog, inputs, params=params)            # the real program is fine
    # the QK^T of the second K tile (its first KV head; one QK^T per KV head and tile):
    # drop its wait on the DMA that filled that tile (a DMA per page writes every head)
    cmds = prog.commands
    mmas = [i for i, c in enumerate(cmds) if isinstance(c, Mma) and c.transpose_b]
    i = mmas[hk]
    tile = cmds[i].b
    fill = [j for j in range(i) if isinstance(cmds[j], DmaLoad) and
            cmds[j].dst.offset < tile.end and tile.offset < cmds[j].dst.end]
    event = next(e for e in cmds[i].wait if any(e in cmds[j].signal for j in fill))
    broken = list(cmds)
    broken[i] = dataclasses.replace(cmds[i], wait=tuple(w for w in cmds[i].wait if w != event))
    bad = dataclasses.replace(prog, commands=broken, name="decode_attention_broken")
    with pytest.raises(InvalidProgramError, match="race"):
        Emulator(spec).run(bad, inputs, params=params)
