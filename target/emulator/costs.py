"""What each command costs: cycles on its unit, bursts on the DRAM bus, bytes in the TCM.

Every formula of the timing model that depends on one command alone is here (the shared
DRAM bus and the clock are the simulation's, ``device.py`` and ``power.py``):

* MMA: ``mma_issue_cycles + ceil(tiles * tm * tn * tk / macs_per_cycle[kind])`` with the
  operands padded to whole native tiles ``(tm, tn, tk)``; a W4A16 MMA dequantises its
  ``N * K`` weights on the fly, overlapped with the MACs, so its MAC term is
  ``max(MAC cycles, ceil(N * K / w4a16_dequant_weights_per_cycle))``.
* Vector op: ``rows * ceil(cols / vector_lanes) * vector_op_cycles[op]``: each row of the
  larger operand takes whole passes of the lanes (a (576, 1) column op is 576 passes).
  ``rope_pairs`` costs what ``rope`` costs: the same multiply-adds per lane, with the
  partner lane taken from the neighbouring element instead of the other half of the row;
  both are one fixed lane permutation, a single-cycle op on vector units (HVX ``vdeal``,
  NEON ``vrev64``/``vtrn``), so the preset keys one cost for both. ``alibi`` costs the
  three elementary passes it is made of, at the preset's own per-op costs: the key
  ramp minus the origin (``sub``), times the row's slope (``mul``), plus the score
  (``add``); no fused multiply-add is assumed. ``exp_sub`` (``exp((x - y) * imm)``, the
  softmax's shift and exponent in one command) costs a ``sub`` and an ``exp`` pass: the
  same instructions; what it saves is the difference's round trip through the TCM (a
  vector unit keeps it in its registers, as HVX or NEON code does between two
  instructions), so the TCM is charged its sources and result only.
* Host op: ``host_switch_cycles + ceil(flops / host_flops_per_cycle)``, on the CPU's clock.
* DMA: ``dma_setup_cycles`` on its channel, then its bursts on the shared bus: every
  contiguous run of bytes (the whole window if its rows are adjacent in DRAM, else each
  row) moves as whole ``dram_burst_bytes`` bursts, from the burst its first byte is in to
  the burst its last byte is in.
* TCM traffic of an MMA: the matrix unit holds one native tile of each operand, so an MMA
  of ``mt x nt x kt`` native tiles reads its ``a`` once per column of tiles (``nt``
  times) and its ``b`` (with a W4A16 MMA's packed weights, scales and zero points) once
  per row of tiles (``mt`` times); it keeps each output tile in its fp32 accumulators
  over the K tiles and writes ``out`` once (reads it once more when it accumulates). A
  vector op reads its sources and writes its destination once.
"""
from __future__ import annotations

import numpy as np

from ..isa import ITEMSIZE, DmaLoad, HostOp, Mma, TcmRef, Vector


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def mma_shape_cycles(m: int, n: int, k: int, kind: str, spec) -> int:
    """Cycles of an MMA of shape ``(m, n, k)`` and ``kind`` (also what the tuner's cost
    model charges, without lowering)."""
    tm, tn, tk = spec.mma_tile
    tiles = _cdiv(m, tm) * _cdiv(n, tn) * _cdiv(k, tk)
    macs = _cdiv(tiles * tm * tn * tk, spec.mma_macs_per_cycle[kind])
    if kind == "w4a16":
        macs = max(macs, _cdiv(n * k, spec.w4a16_dequant_weights_per_cycle))
    return spec.mma_issue_cycles + macs


def mma_cycles(cmd: Mma, spec) -> int:
    return mma_shape_cycles(*cmd.mnk, cmd.kind, spec)


def vector_shape_cycles(op: str, rows: int, cols: int, spec) -> int:
    """Cycles of vector op ``op`` over an operand of ``rows`` x ``cols``."""
    passes = rows * _cdiv(cols, spec.vector_lanes)
    return passes * sum(spec.vector_op_cycles[o] for o in _COSTED_AS.get(op, (op,)))


def vector_cycles(cmd: Vector, spec) -> int:
    return max(vector_shape_cycles(cmd.op, r, c, spec)
               for r, c in (cmd.dst.shape, cmd.srcs[0].shape))


#: ops charged the per-pass costs of other ops, summed (see the module docstring)
_COSTED_AS = {"rope_pairs": ("rope",), "alibi": ("sub", "mul", "add"),
              "exp_sub": ("sub", "exp")}


def command_cycles(cmd, spec) -> int:
    """Cycles a non-DMA command occupies its unit (0 for events and control)."""
    if isinstance(cmd, Mma):
        return mma_cycles(cmd, spec)
    if isinstance(cmd, Vector):
        return vector_cycles(cmd, spec)
    if isinstance(cmd, HostOp):
        return spec.host_switch_cycles + _cdiv(cmd.flops, max(1, int(spec.host_flops_per_cycle)))
    return 0


def dram_bursts(offset_bytes: int, rows: int, row_bytes: int, stride_bytes: int,
                burst: int) -> int:
    """Bursts a DMA of ``rows`` rows of ``row_bytes``, ``stride_bytes`` apart, moves."""
    if rows <= 0 or row_bytes <= 0:
        return 0
    if rows == 1 or stride_bytes == row_bytes:           # one contiguous run
        end = offset_bytes + rows * row_bytes
        return _cdiv(end, burst) - offset_bytes // burst
    if stride_bytes % burst == 0:                        # every row starts alike
        return rows * (_cdiv(offset_bytes % burst + row_bytes, burst))
    starts = offset_bytes + np.arange(rows, dtype=np.int64) * stride_bytes
    return int(np.sum(-(-(starts + row_bytes) // burst) - starts // burst))


def tcm_bytes(ref: TcmRef, rows: int | None = None) -> int:
    """Bytes an operand (its first ``rows`` rows) touches in the TCM."""
    r = ref.shape[0] if rows is None else rows
    return r * ref.shape[1] * ITEMSIZE[ref.dtype]


def mma_tcm_reads(cmd: Mma, spec) -> dict:
    """TCM bytes an MMA reads per operand: ``a``, ``b`` (packed weights), ``scales``
    (scales and zero points) and ``out`` (when it accumulates)."""
    m, n, _ = cmd.mnk
    tm, tn, _ = spec.mma_tile
    weights = [r for r in (cmd.scales, cmd.zeros) if r is not None]
    return {"a": tcm_bytes(cmd.a) * _cdiv(n, tn),
            "b": tcm_bytes(cmd.b) * _cdiv(m, tm),
            "scales": sum(map(tcm_bytes, weights)) * _cdiv(m, tm),
            "out": tcm_bytes(cmd.out) if cmd.accumulate else 0}


def tcm_traffic(cmd, spec) -> tuple:
    """(bytes read, bytes written) in the TCM by a compute command."""
    if isinstance(cmd, Mma):
        return sum(mma_tcm_reads(cmd, spec).values()), tcm_bytes(cmd.out)
    if isinstance(cmd, Vector):
        return sum(map(tcm_bytes, cmd.srcs)), tcm_bytes(cmd.dst)
    return 0, 0


def dma_bytes(cmd) -> int:
    """Bytes a DMA moves: its TCM side's (a load's destination, a store's source)."""
    return tcm_bytes(cmd.dst if isinstance(cmd, DmaLoad) else cmd.src)


def dma_estimate(cmd, spec) -> float:
    """A DMA's cycles as a scheduler or linker estimates them, never as the emulator
    charges them (bursts, a channel's share of the bus, contention): its set-up, then its
    bytes at the whole bus's rate."""
    return spec.dma_setup_cycles + dma_bytes(cmd) / spec.dram_bytes_per_cycle


def dma_tcm_traffic(cmd, rows: int) -> tuple:
    """(TCM bytes read, written) by a DMA of ``rows`` rows: a load writes the TCM, a store
    reads it."""
    if isinstance(cmd, DmaLoad):
        return 0, tcm_bytes(cmd.dst, rows)
    return tcm_bytes(cmd.src, rows), 0
