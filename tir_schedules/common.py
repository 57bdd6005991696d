"""Helpers shared by the schedule templates: knobs as s_tir sampling instructions, and the
annotations the NPU lowering reads (``npu.op``, ``npu.slots``, ``npu.channel``)."""
from __future__ import annotations

TCM = "global.tcm"


def knob(sch, value, candidates, name: str):
    """A knob as a sampling instruction, so search can mutate it and replay can re-apply it.

    ``value`` fixes it (a one-candidate categorical keeps the trace uniform); ``None``
    samples uniformly from ``candidates``.
    """
    cands = [int(c) for c in candidates]
    if value is not None:
        cands = [int(value)]
    if not cands:
        raise ValueError(f"knob {name}: no candidate")
    return sch.sample_categorical(cands, [1.0 / len(cands)] * len(cands))


def tile_candidates(extent: int, sizes=(16, 32, 64, 128, 256, 512)) -> list:
    """Tile sizes worth trying for a loop: powers of two up to the extent, plus the extent."""
    c = [s for s in sizes if s < extent]
    return c + [extent]


def annotate_op(sch, loop, op: str, slots=None, channel=None):
    sch.annotate(loop, "npu.op", op)
    if slots is not None:
        sch.annotate(loop, "npu.slots", slots)
    if channel is not None:
        sch.annotate(loop, "npu.channel", channel)


def nest_root(sch, block, outer: int):
    """The first loop of ``block``'s own nest below its ``outer`` enclosing loops."""
    return sch.get_loops(block)[outer]
