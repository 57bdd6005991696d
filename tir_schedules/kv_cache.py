"""The paged KV cache: its DRAM layout and the append kernel that writes new tokens into it.

Layout
------
K and V are two DRAM ``state`` tensors (they persist on the device across calls), each

    ``K_cache, V_cache : (num_pages, kv_heads, page_tokens, head_dim) float16``

* **pages of ``page_tokens`` tokens** (a per-model constant, :data:`PAGE_TOKENS`): a
  sequence owns a list of pages, the *page table*, so sequences grow without moving data
  and one static program serves every length: the page table entries are runtime
  parameters (``page_table.<i>`` = the cache page of the sequence's tokens
  ``[i * P, (i + 1) * P)``), which the lowering turns into affine DRAM offsets;
* **head-grouped inside a page**: the ``page_tokens x head_dim`` tokens of one KV head are
  one contiguous block (``P * D * 2`` bytes, 2 KB for P = 16, D = 64), so an attention
  kernel loads a K or V tile of one head with one DMA per page, with no stride gaps and
  no bytes of the other heads, and a whole page of every head (decode) is one contiguous
  read too; grouped-query heads then reuse that tile from TCM. A token-major page
  ``(P, kv_heads, D)`` would need ``kv_heads`` times more, smaller DMAs per tile of one
  head (or load heads the kernel is not working on).

The valid length (tokens in the cache, including the ones just appended) is a runtime
parameter of the attention kernels (``valid_len``); tokens past it are never read (their
DMAs are predicated off or clipped by a runtime repeat count) and masked to -inf.

Append
------
:func:`kv_append` writes the K/V of ``tokens`` new tokens (1 for decode, a chunk of C for
chunked prefill) into the cache: token ``i`` goes to page ``slot_page[i]`` at row
``slot_offset[i]`` (runtime parameters ``slot_page.<i>`` / ``slot_offset.<i>``, set by the
host from the page table and the position), one DMA store per token, KV head and
cache. ``n_new`` (runtime) stores only the first ``n_new`` tokens of a partly filled
chunk. The DRAM bytes written are ``2 * n_new * kv_heads * head_dim * 2``: they do
not depend on how many tokens the cache already holds (the past is never touched).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .common import TileKernel, apply_annotations, new_schedule

#: tokens per KV page for the example models (a power of two: page and offset of a
#: position are a shift and a mask for the host)
PAGE_TOKENS = 16


@dataclass(frozen=True)
class KVCacheLayout:
    """Shape of the paged cache of one layer (``num_pages`` pages of ``page_tokens``)."""

    kv_heads: int
    head_dim: int
    num_pages: int
    page_tokens: int = PAGE_TOKENS

    @property
    def shape(self) -> tuple:
        return (self.num_pages, self.kv_heads, self.page_tokens, self.head_dim)

    def page_table_params(self, page_table, max_pages: int) -> dict:
        """Runtime parameters ``page_table.<i>`` (unused entries set to page 0)."""
        pages = list(page_table)[:max_pages]
        return {f"page_table.{i}": int(pages[i]) if i < len(pages) else 0
                for i in range(max_pages)}

    def slot_params(self, page_table, pos: int, tokens: int, n_new: int | None = None) -> dict:
        """Runtime parameters of :func:`kv_append` for tokens at ``pos .. pos + tokens``."""
        n_new = tokens if n_new is None else n_new
        params = {"n_new": int(n_new)}
        for i in range(tokens):
            p = pos + min(i, n_new - 1) if n_new else pos
            params[f"slot_page.{i}"] = int(page_table[p // self.page_tokens])
            params[f"slot_offset.{i}"] = p % self.page_tokens
        return params


def append_reference(cache: np.ndarray, new: np.ndarray, page_table, pos: int) -> np.ndarray:
    """numpy: ``cache`` with ``new`` (n, kv_heads, D) written at positions ``pos ..``."""
    out = cache.copy()
    p_tokens = cache.shape[2]
    for i in range(new.shape[0]):
        p = pos + i
        out[page_table[p // p_tokens], :, p % p_tokens, :] = new[i]
    return out


def gather_reference(cache: np.ndarray, page_table, length: int) -> np.ndarray:
    """numpy: the first ``length`` tokens of a paged cache as (kv_heads, length, D)."""
    p_tokens = cache.shape[2]
    pages = [cache[page_table[i]] for i in range(-(-length // p_tokens))]
    return np.concatenate(pages, axis=1)[:, :length]


def _stage_new_tokens(kb, src: dict, c: int, hk: int, d: int) -> dict:
    """DMA the new tokens' K and V ``(c, hk, 1, d)`` into TCM staging tiles (one each)."""
    stage = {kv: kb.tcm(f"{kv}_stage", (c, hk, 1, d), "float16") for kv in ("k", "v")}
    for kv in ("k", "v"):
        kb.op(f"{kv}_load", "dma", (c, hk, d),
              lambda lv: [("S", (0, c), lv[0]), ("S", (0, hk), lv[1]), ("S", (0, d), lv[2])],
              lambda iv, kv=kv: (stage[kv], (iv[0], iv[1], 0, iv[2]),
                                 src[kv][iv[0], iv[1], 0, iv[2]],
                                 [src[kv][iv[0], iv[1], 0, iv[2]]], None))
    return stage


def _schedule(kb, spec):
    """The kernel's schedule with its op annotations (DMA channel hints dropped on a
    single-channel NPU)."""
    sch = new_schedule(kb.func())
    ops = kb.ops
    if spec is not None and spec.dma_channels < 2:
        ops = [(b, dep, {k: v for k, v in a.items() if k != "npu.channel"}) for b, dep, a in ops]
    apply_annotations(sch, ops)
    return sch


def kv_append(layout: KVCacheLayout, tokens: int):
    """The append kernel as a :class:`TileKernel` (PrimFunc + its NPU ops).

    Parameters: ``k_new, v_new (tokens, kv_heads, 1, head_dim)`` float16 (a free reshape of
    the projection's ``(tokens, kv_heads * head_dim)``: the unit axis lines the staging
    tile up with the cache's page-row axis so a store is one 2-D DMA), the runtime
    buffers ``slot_page, slot_offset (tokens,)``, the scalar ``n_new``, and the two cache
    tensors (``state``).
    """
    hk, d, c = layout.kv_heads, layout.head_dim, tokens
    with TileKernel(f"kv_append_{c}") as kb:
        k_new = kb.buffer("k_new", (c, hk, 1, d), "float16")
        v_new = kb.buffer("v_new", (c, hk, 1, d), "float16")
        slot_page = kb.buffer("slot_page", (c,), "int32")
        slot_offset = kb.buffer("slot_offset", (c,), "int32")
        kb.scalar("n_new")
        k_cache = kb.buffer("K_cache", layout.shape, "float16")
        v_cache = kb.buffer("V_cache", layout.shape, "float16")
        kb.begin_body()
        stage = _stage_new_tokens(kb, {"k": k_new, "v": v_new}, c, hk, d)
        dst = {"k": k_cache, "v": v_cache}
        # one store per (token, head): the runtime repeat count ``n_new - i`` then counts
        # tokens (a store of all heads of a token would clip heads instead)
        with kb.loop(c, "i") as i:
            with kb.loop(hk, "h") as h:
                for kv, ch in (("k", 0), ("v", 1)):
                    def body(iv, kv=kv):
                        page = slot_page[iv[0]]
                        off = slot_offset[iv[0]]
                        return (dst[kv], (page, iv[1], off, iv[2]),
                                stage[kv][iv[0], iv[1], 0, iv[2]],
                                [stage[kv][iv[0], iv[1], 0, iv[2]]], None)
                    kb.op(f"{kv}_store", "dma", (d,),
                          lambda lv: [("S", (0, c), i), ("S", (0, hk), h),
                                      ("S", (0, d), lv[0])],
                          body, ann={"npu.valid_len": "n_new", "npu.valid_axis": 0,
                                     "npu.channel": ch})
    return kb


def schedule_kv_append(layout: KVCacheLayout, tokens: int, spec=None):
    """The scheduled append kernel (``s_tir.Schedule``); lower with
    ``runtime=["slot_page", "slot_offset"], state=["K_cache", "V_cache"]``."""
    return _schedule(kv_append(layout, tokens), spec)


KV_APPEND_LOWERING = {"runtime": ["slot_page", "slot_offset"], "state": ["K_cache", "V_cache"]}


def kv_append_pages(layout: KVCacheLayout, pages: int):
    """The prefill append: ``pages * page_tokens`` new tokens starting at a page boundary
    are written as WHOLE pages, one DMA per (page, KV head) of ``page_tokens x head_dim``
    contiguous bytes (the decode kernels' per-head page block), from the token-major
    staging tile read with a row stride. Page ``i`` of the chunk goes to cache page
    ``dst_page.<i>`` (runtime). Rows past the prompt in the last page are written too
    (padding): they lie beyond the valid length, which attention never reads, and the
    next append overwrites them.
    """
    hk, d, pt = layout.kv_heads, layout.head_dim, layout.page_tokens
    c = pages * pt
    with TileKernel(f"kv_append_pages_{pages}") as kb:
        k_new = kb.buffer("k_new", (c, hk, 1, d), "float16")
        v_new = kb.buffer("v_new", (c, hk, 1, d), "float16")
        dst_page = kb.buffer("dst_page", (pages,), "int32")
        k_cache = kb.buffer("K_cache", layout.shape, "float16")
        v_cache = kb.buffer("V_cache", layout.shape, "float16")
        kb.begin_body()
        stage = _stage_new_tokens(kb, {"k": k_new, "v": v_new}, c, hk, d)
        dst = {"k": k_cache, "v": v_cache}
        with kb.loop(pages, "p") as p:
            with kb.loop(hk, "h") as h:
                for kv, ch in (("k", 0), ("v", 1)):
                    def body(iv, kv=kv):
                        return (dst[kv], (dst_page[iv[0]], iv[1], iv[2], iv[3]),
                                stage[kv][iv[0] * pt + iv[2], iv[1], 0, iv[3]],
                                [stage[kv][iv[0] * pt + iv[2], iv[1], 0, iv[3]]], None)
                    kb.op(f"{kv}_store", "dma", (pt, d),
                          lambda lv: [("S", (0, pages), p), ("S", (0, hk), h),
                                      ("S", (0, pt), lv[0]), ("S", (0, d), lv[1])],
                          body, ann={"npu.channel": ch})
    return kb


def schedule_kv_append_pages(layout: KVCacheLayout, pages: int, spec=None):
    """The scheduled page-burst append; lower with ``**KV_APPEND_PAGES_LOWERING``."""
    return _schedule(kv_append_pages(layout, pages), spec)


KV_APPEND_PAGES_LOWERING = {"runtime": ["dst_page"], "state": ["K_cache", "V_cache"]}
