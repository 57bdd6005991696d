"""New K and V stored into the KV pages by the kernels that make them (edgetvm/build/kv_pages.py):
the relocated store windows against a numpy loop over the cache's definition, and which
appends are folded."""
import dataclasses

import numpy as np
import pytest

from edgetvm.build.graph import Op, PhaseGraph, Tensor
from edgetvm.build.kv_pages import KV_PAGES, fold_kv_appends, relocate_paged, token_rows
from edgetvm.build.views import View
from edgetvm.target.isa import DmaStore, DramRef, TcmRef, as_affine, holds
from edgetvm.tir_schedules.kv_cache import KVCacheLayout

HK, D, PT = 2, 8, 4                  # KV heads, head size, tokens per page
LAYOUT = KVCacheLayout(HK, D, num_pages=12, page_tokens=PT)


def _graph(rows, interleaved, q_cols, phase="prefill"):
    """One layer's fused projection output ``qkv`` (rows, q_cols + 2 * HK * D) and its KV
    append: K and V as [K | V] after the Q columns, or per head [K_h | V_h] interleaved
    (GPT-NeoX's layout); a producer and an attention reading the Q columns."""
    width = q_cols + 2 * HK * D
    t = {"qkv": Tensor("qkv", (rows, width)), "x": Tensor("x", (rows, 4))}
    whole = View.whole("qkv", (rows, width))
    if interleaved:
        heads = whole.slice(1, q_cols, width).reshape((rows, HK, 2, D))
        k, v = heads.slice(2, 0, 1), heads.slice(2, 1, 2)            # (rows, HK, 1, D)
    else:
        k = whole.slice(1, q_cols, q_cols + HK * D).reshape((rows, HK, 1, D))
        v = whole.slice(1, q_cols + HK * D, width).reshape((rows, HK, 1, D))
    ops = [Op("stage", "proj", {"x": View.whole("x", (rows, 4))}, {"y": whole}),
           Op("kv_append", "L0.kv_append", {"k_new": k, "v_new": v}, {}, layer=0)]
    if q_cols:
        ops.append(Op("attention", "L0.attention", {"q": whole.slice(1, 0, q_cols)}, {},
                      layer=0))
    return PhaseGraph(phase, rows, 3, ops, t, "logits", "last", HK, D, 1)


def _store(cache, arena, graph, window, table, slots=None, n_new=None):
    """Apply the relocated pieces of storing ``window`` (rows, cols, row0, col0, one long
    row or not) of the producer's output, whose value at (r, c) is ``r * 1000 + c``:
    ``table`` the chunk's pages (whole-page prefill), or ``slots`` each token's (page,
    row) and ``n_new`` the real tokens (a step of per-token slots)."""
    rows_w, cols_w, r0, c0, flat = window
    t = graph.tensors["qkv"]
    width = t.shape[1]
    data = np.arange(graph.rows)[:, None] * 1000.0 + np.arange(width)[None, :]
    if flat:                                     # whole rows as one long row
        ref = DramRef("y", (1, rows_w * width), rows_w * width, r0 * width)
        tcm = TcmRef(0, (1, rows_w * width), "float16")
        src = data[r0:r0 + rows_w].reshape(1, -1)
    else:
        ref = DramRef("y", (rows_w, cols_w), width, r0 * width + c0)
        tcm = TcmRef(0, (rows_w, cols_w), "float16")
        src = data[r0:r0 + rows_w, c0:c0 + cols_w]
    cmd = token_rows(DmaStore(src=tcm, dst=ref), width)
    ref = cmd.dst
    src = src.reshape(ref.shape)

    def arena_pieces(w):                         # the arena: the tensor itself, contiguous
        return [(DramRef("arena", w.shape, w.row_stride, w.offset), 0, w.shape[0], 0,
                 w.shape[1])]
    params = {f"dst_page.{i}": table[i] for i in range(len(table))}
    for i, (page, row) in enumerate(slots or ()):
        params.update({f"slot_page.{i}": page, f"slot_offset.{i}": row})
    if n_new is not None:
        params["n_new"] = n_new
    pieces = relocate_paged(ref, View.whole("qkv", t.shape), t.pages,
                            None if t.kind == KV_PAGES else arena_pieces)
    for dram, pr0, n, pc0, m, when in pieces:
        if not holds(when, params):
            continue
        block = src[pr0:pr0 + n, pc0:pc0 + m]
        off = as_affine(dram.offset).eval(params)
        flat_dst = {"arena": arena}.get(dram.tensor, cache.get(dram.tensor))
        for i in range(n):
            flat_dst[off + i * dram.row_stride: off + i * dram.row_stride + m] = block[i]
    return len(pieces)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("q_cols", [0, 24])
def test_stored_windows_land_where_the_page_table_says(interleaved, q_cols):
    rows = 12                                    # three pages
    g = _graph(rows, interleaved, q_cols)
    assert fold_kv_appends(g, LAYOUT) == 1 and [op.kind for op in g.ops if
                                                 op.kind == "kv_append"] == []
    t = g.tensors["qkv"]
    assert t.kind == (KV_PAGES if q_cols == 0 else "activation")
    width = t.shape[1]
    table = [7, 2, 9]                            # the chunk's pages, in no order
    windows = [(rows, width, 0, 0, True), (5, width, 3, 0, False), (4, 11, 6, 5, False),
               (rows, 3, 0, width - 3, False), (1, width, 11, 0, False), (6, width, 0, 0, True)]
    for window in windows:
        cache = {"L0.K_cache": np.full(int(np.prod(LAYOUT.shape)), -1.0),
                 "L0.V_cache": np.full(int(np.prod(LAYOUT.shape)), -1.0)}
        arena = np.full(rows * width, -1.0)
        pieces = _store(cache, arena, g, window, table)
        # the reference: the cache's definition, cache[page, head, row, j], by a loop
        n, m, r0, c0, flat = window
        cols = range(width) if flat else range(c0, c0 + m)
        want = {k: np.full(LAYOUT.shape, -1.0) for k in cache}
        want_arena = np.full((rows, width), -1.0)
        for r in range(r0, r0 + n):
            for c in cols:
                value = r * 1000.0 + c
                if c < q_cols:
                    want_arena[r, c] = value
                    continue
                kv_col = c - q_cols
                if interleaved:
                    h, which, j = kv_col // (2 * D), kv_col // D % 2, kv_col % D
                else:
                    which, h, j = kv_col // (HK * D), kv_col // D % HK, kv_col % D
                cache_name = ("L0.K_cache", "L0.V_cache")[which]
                want[cache_name][table[r // PT], h, r % PT, j] = value
        for k in cache:
            np.testing.assert_array_equal(cache[k].reshape(LAYOUT.shape), want[k], (k, window))
        np.testing.assert_array_equal(arena.reshape(rows, width), want_arena, window)
        if window == (rows, width, 0, 0, True):
            # a page's tokens of one head are one DMA: pages x heads x {K, V} (+ the Q
            # columns, a DMA a row group)
            assert pieces == 3 * HK * 2 + (1 if q_cols else 0)


def test_a_one_token_step_stores_at_its_slot():
    g = _graph(1, True, 24, phase="decode")
    assert fold_kv_appends(g, LAYOUT) == 1
    cache = {"L0.K_cache": np.zeros(int(np.prod(LAYOUT.shape))),
             "L0.V_cache": np.zeros(int(np.prod(LAYOUT.shape)))}
    arena = np.zeros(g.tensors["qkv"].size)
    _store(cache, arena, g, (1, g.tensors["qkv"].shape[1], 0, 0, False), [], slots=[(5, 3)])
    k = cache["L0.K_cache"].reshape(LAYOUT.shape)
    v = cache["L0.V_cache"].reshape(LAYOUT.shape)
    for h in range(HK):
        np.testing.assert_array_equal(k[5, h, 3], 24 + h * 2 * D + np.arange(D))
        np.testing.assert_array_equal(v[5, h, 3], 24 + h * 2 * D + D + np.arange(D))
    assert np.count_nonzero(k) == np.count_nonzero(v) == HK * D    # nothing else written


@pytest.mark.parametrize("n_new", [6, 4, 1])
def test_a_chunk_that_is_not_whole_pages_stores_its_real_tokens_at_their_slots(n_new):
    """A 6-token chunk (not whole 4-token pages) at position 3: each token at its own
    (page, row), as the host sets them from the page table; a partly filled chunk's
    padding rows (whose slots are the last real token's) are not stored."""
    g = _graph(6, False, 24)
    assert fold_kv_appends(g, LAYOUT) == 1
    pages = [8, 1, 5]                            # the sequence's page table
    slots = [(pages[p // PT], p % PT) for p in (3 + min(i, n_new - 1) for i in range(6))]
    width = g.tensors["qkv"].shape[1]
    cache = {"L0.K_cache": np.full(int(np.prod(LAYOUT.shape)), -1.0),
             "L0.V_cache": np.full(int(np.prod(LAYOUT.shape)), -1.0)}
    _store(cache, np.zeros(6 * width), g, (6, width, 0, 0, True), [], slots=slots,
           n_new=n_new)
    want = {k: np.full(LAYOUT.shape, -1.0) for k in cache}
    for r in range(n_new):                      # the cache's definition, by a loop
        p = 3 + r
        for c in range(24, width):
            which, h, j = (c - 24) // (HK * D), (c - 24) // D % HK, (c - 24) % D
            want[("L0.K_cache", "L0.V_cache")[which]][pages[p // PT], h, p % PT, j] = \
                r * 1000.0 + c
    for k in cache:
        np.testing.assert_array_equal(cache[k].reshape(LAYOUT.shape), want[k], k)


def test_an_append_whose_values_another_op_reads_keeps_its_kernel():
    g = _graph(8, False, 24)
    k = g.ops[1].inputs["k_new"]
    g.ops.append(Op("host", "peek", {"x0": k.reshape((8, HK * D))}, {}))
    assert fold_kv_appends(g, LAYOUT) == 0
    assert [op.kind for op in g.ops].count("kv_append") == 1
    assert g.tensors["qkv"].pages is None
    # reading only the Q columns (the attention) does not keep it
    g = _graph(8, False, 24)
    assert fold_kv_appends(g, LAYOUT) == 1


def test_an_append_written_by_a_host_op_keeps_its_kernel():
    g = _graph(8, False, 0)
    g.ops[0] = dataclasses.replace(g.ops[0], kind="host")
    assert fold_kv_appends(g, LAYOUT) == 0
