"""GEMM (prefill linear) and GEMV (decode linear) templates, fp16 and W4A16.

Loop structure: ``i0, j0, k0 | i1, j1, k1`` with the A/X and B/W(/S/Z) tiles DMA'd into TCM
per ``k0`` step, the fp32 accumulator tile resident in TCM across ``k0``, cast to fp16 on
the vector unit and stored once per ``(i0, j0)``. Knobs (each a sampling instruction):

``tile_m, tile_n, tile_k``
    tile sizes (any size; edge tiles are clipped);
``slots_a, slots_b``
    TCM copies of the activation and weight tiles: 2 = double buffering (3 = one more
    tile in flight), set per operand so the weights can be double-buffered when two full
    tiles of everything do not fit;
``slots_c``
    copies of the accumulator and output tiles (2 lets the cast and store of tile j
    overlap the matmul of tile j+1);
``a_at``
    where the activation tile is loaded: 0 = per ``k0`` step, 1 = once per ``i0`` row block
    (whole K resident: GEMV reads x once);
``dma_split``
    1 keeps the last DMA channel for stores (prefetches never queue behind a store that
    waits for compute), 0 spreads loads over every channel (more setups hidden).
"""
from __future__ import annotations

from .common import TCM, annotate_op, knob, tile_candidates

#: knob names in sampling order (see ``search.knob_space``)
KNOBS = ("tile_m", "tile_n", "tile_k", "slots_a", "slots_b", "slots_c", "a_at", "dma_split")


def schedule_matmul(sch, *, tile_m=None, tile_n=None, tile_k=None, slots_a=None,
                    slots_b=None, slots_c=None, a_at=None, dma_split=None, group: int = 0):
    """Schedule a ``workloads.gemm_fp16`` / ``gemm_w4a16`` PrimFunc in place."""
    blk = sch.get_sblock("C")
    cast = sch.get_sblock("D")
    i, j, k = sch.get_loops(blk)
    m_ext, n_ext, k_ext = (int(sch.get(l).extent) for l in (i, j, k))
    k_cands = tile_candidates(k_ext)
    if group:
        k_cands = [c for c in k_cands if c % group == 0] or [k_ext]
    tm = knob(sch, tile_m, tile_candidates(m_ext), "tile_m")
    tn = knob(sch, tile_n, tile_candidates(n_ext), "tile_n")
    tk = knob(sch, tile_k, k_cands, "tile_k")
    sa = knob(sch, slots_a, [1, 2], "slots_a")
    sb = knob(sch, slots_b, [1, 2, 3], "slots_b")
    sc = knob(sch, slots_c, [1, 2], "slots_c")
    at = knob(sch, a_at, [0, 1], "a_at")
    split = knob(sch, dma_split, [0, 1], "dma_split")
    sch.annotate(sch.get_sblock("root"), "npu.dma_split", split)
    i0, i1 = sch.split(i, [None, tm])
    j0, j1 = sch.split(j, [None, tn])
    k0, k1 = sch.split(k, [None, tk])
    sch.reorder(i0, j0, k0, i1, j1, k1)
    sch.set_scope(blk, 0, TCM)                      # fp32 accumulator lives in TCM
    sch.reverse_compute_at(cast, j0)
    d_store = sch.cache_write(cast, 0, TCM)         # the cast now writes TCM; d_store copies out
    sch.reverse_compute_at(d_store, j0)
    n_in = len(sch.get(blk).reads)                  # A/X, then B, or S, W(, Z)
    a_load = sch.cache_read(blk, 0, TCM)
    a_resident = int(sch.get(at)) == 1
    sch.compute_at(a_load, i0 if a_resident else k0)
    b_loads = []
    for idx in range(1, n_in):
        ld = sch.cache_read(blk, idx, TCM)
        sch.compute_at(ld, k0)
        b_loads.append(ld)
    annotate_op(sch, sch.get_loops(a_load)[1 if a_resident else 3], "dma", slots=sa)
    for ld in b_loads:
        annotate_op(sch, sch.get_loops(ld)[3], "dma", slots=sb)
    annotate_op(sch, i1, "mma", slots=sc)     # the fp32 accumulator rotates like the output
    annotate_op(sch, sch.get_loops(cast)[2], "vector:cast", slots=sc)
    annotate_op(sch, sch.get_loops(d_store)[2], "dma")
    return sch
