"""The two vocab-sized ops: the token-embedding gather and the LM head.

Embedding: ``out[i, :] = E[ids[i], :]`` with the token ids as runtime parameters (the host
sets them per call: one static program serves every prompt). Each row is one DMA from the
table into a TCM tile of ``tile_m`` rows at an offset that depends on ``ids.<i>``; the tile
is stored with one DMA. Knobs: ``tile_m`` (rows per stored tile), ``slots_out`` (TCM
copies of the tile: 2 = the next tile gathers while this one stores), ``dma_split``.

LM head: the last GEMV/GEMM against the vocab, ``gemm.schedule_matmul`` on
``workloads.gemm_w4a16`` (a quantised head) or ``gemm_fp16(..., "nk")`` (an fp16 head,
e.g. tied to the embedding table, which is (vocab, hidden)); :func:`lm_head` builds the
workload, :func:`schedule_lm_head` applies the GEMM template (knobs: ``gemm.KNOBS``).
"""
from __future__ import annotations

from . import workloads
from .common import TCM, annotate_op, knob, tile_candidates
from .gemm import KNOBS as LM_HEAD_KNOBS
from .gemm import schedule_matmul

KNOBS = ("tile_m", "slots_out", "dma_split")
ROW_TILES = (1, 2, 4, 8, 16, 32, 64, 128)


def schedule_embedding(sch, *, tile_m=None, slots_out=None, dma_split=None):
    """Schedule ``workloads.embedding`` in place (lower it with ``runtime=["ids"]``)."""
    blk = sch.get_sblock("out")
    i, _ = sch.get_loops(blk)
    tm = knob(sch, tile_m, tile_candidates(int(sch.get(i).extent), ROW_TILES), "tile_m")
    so = knob(sch, slots_out, [1, 2], "slots_out")
    sch.annotate(sch.get_sblock("root"), "npu.dma_split",
                 knob(sch, dma_split, [0, 1], "dma_split"))
    store = sch.cache_write(blk, 0, TCM)        # gather rows into a TCM tile, store the tile
    i0, _ = sch.split(i, [None, tm])
    sch.reverse_compute_at(store, i0)
    # one DMA per row: the row's DRAM offset is the runtime parameter ids.<i>
    annotate_op(sch, sch.get_loops(blk)[-1], "dma", slots=so)
    annotate_op(sch, sch.get_loops(store)[1], "dma")
    return sch


def lm_head(m: int, vocab: int, hidden: int, quant: str = "w4a16", group: int = 32):
    """The LM head workload: logits (m, vocab) = x (m, hidden) @ W^T; W (vocab, hidden)."""
    if quant == "w4a16":
        return workloads.gemm_w4a16(m, vocab, hidden, group)
    if quant == "fp16":
        return workloads.gemm_fp16(m, vocab, hidden, "nk")
    raise ValueError(f"lm_head: unknown quantisation {quant!r} (w4a16 or fp16)")


def schedule_lm_head(sch, *, group: int = 0, **knobs):
    """Schedule an :func:`lm_head` workload with the GEMM template (``knobs``: gemm.KNOBS;
    ``group``: the W4A16 group size, 0 for fp16)."""
    return schedule_matmul(sch, group=group, **knobs)


__all__ = ["KNOBS", "LM_HEAD_KNOBS", "lm_head", "schedule_embedding", "schedule_lm_head"]
