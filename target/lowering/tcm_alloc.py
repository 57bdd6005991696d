"""TCM allocation: compact every TCM buffer to its per-instance footprint, give it
``slots`` copies, and place buffers by lifetime (buffers never live at once share bytes),
or, asked for (``fresh``), each in bytes of its own while the TCM has room.

An *instance* of a TCM buffer is one iteration of the innermost loop that encloses all of
its accesses (the loop it is allocated in after TVM's ``CompactBufferAllocation``); its
footprint is the box its accesses cover in that iteration. Consecutive instances rotate
through the slots, which is what double buffering is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from edgetvm.errors import CandidateRejected


@dataclass
class TcmBuffer:
    buffer: object
    name: str
    dtype: str
    itemsize: int
    footprint: tuple = ()
    slots: int = 1
    first_op: int = 0
    last_op: int = 0
    instance_base: dict = field(default_factory=dict)   # instance key -> lo per dim
    op_instance: dict = field(default_factory=dict)     # op index -> instance number
    offset: int = 0
    slot_stride: int = 0

    @property
    def slot_bytes(self) -> int:
        return math.prod(int(e) for e in self.footprint) * self.itemsize

    def strides(self) -> tuple:
        return row_major_strides(self.footprint)


def row_major_strides(shape) -> tuple:
    """Element strides of a dense row-major array of ``shape``."""
    st, acc = [], 1
    for e in reversed(shape):
        st.append(acc)
        acc *= e
    return tuple(reversed(st))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_tcm(ops, tcm_kinds: dict, spec, fresh: bool = False,
             instance_depth: dict | None = None) -> tuple[dict, int]:
    """Footprints, slots and offsets of every TCM buffer; returns (buffers, total bytes).
    ``fresh``: each buffer in bytes no other buffer uses while they all fit the TCM (else
    as without it), see :func:`_place`. ``instance_depth``: buffer name -> at most this many
    enclosing loops delimit an instance (a buffer with an explicit slot axis, indexed by
    ``tile % 2``, is one instance over its whole tile loop: per iteration, the last one,
    touching one slot only, would get another base)."""
    uses: dict = {}
    for op in ops:
        for box in op.reads + op.writes:
            if tcm_kinds.get(box.buffer) == "tcm":
                uses.setdefault(box.buffer, []).append((op, box))
    plans = {}
    for buf, lst in uses.items():
        paths = [[uid for uid, _ in op.path] for op, _ in lst]
        depth = 0
        while all(len(p) > depth for p in paths) and len({p[depth] for p in paths}) == 1:
            depth += 1
        depth = min(depth, (instance_depth or {}).get(buf.name, depth))
        tb = TcmBuffer(buf, buf.name, str(buf.dtype), np.dtype(str(buf.dtype)).itemsize)
        tb.first_op = min(op.index for op, _ in lst)
        tb.last_op = max(op.index for op, _ in lst)
        tb.slots = max([op.attrs.get("slots", 1) for op, b in lst if b in op.writes] or [1])
        lo_of, hi_of, order = {}, {}, {}
        for op, box in lst:
            key = tuple(v for _, v in op.path[:depth])
            order.setdefault(key, len(order))
            tb.op_instance[op.index] = order[key]
            lo = lo_of.get(key)
            lo_of[key] = box.lo if lo is None else tuple(map(min, lo, box.lo))
            hi = hi_of.get(key)
            hi_of[key] = box.hi if hi is None else tuple(map(max, hi, box.hi))
        tb.instance_base = {order[k]: lo_of[k] for k in order}
        tb.footprint = tuple(max(hi_of[k][d] - lo_of[k][d] for k in order)
                             for d in range(len(buf.shape)))
        plans[buf] = tb
    bufs = list(plans.values())
    total = _place(bufs, spec.tcm_alignment, fresh_within=spec.tcm_bytes if fresh else 0)
    if fresh and total > spec.tcm_bytes:
        total = _place(bufs, spec.tcm_alignment)
    if total > spec.tcm_bytes:
        detail = ", ".join(f"{t.name} {t.footprint}x{t.slots} slot(s) = "
                           f"{t.slot_bytes * t.slots} B"
                           for t in sorted(plans.values(), key=lambda t: -t.slot_bytes * t.slots))
        raise CandidateRejected(f"TCM overflow: the live TCM buffers need {total} bytes, "
                                f"{spec.name} has {spec.tcm_bytes} ({detail})")
    return plans, total


def _place(bufs, alignment, fresh_within: int = 0) -> int:
    """Greedy by size: the lowest offset not overlapping a placed buffer live at once.

    ``fresh_within``: first the lowest offset not overlapping any placed buffer, live or
    not, while that ends within ``fresh_within`` bytes. Sharing bytes with a dead buffer
    orders the new buffer's first write after the old one's last read: a stage's first
    weight tile could not be prefetched while the previous stage's epilogue still read
    the bytes it was given (a prefill MLP's silu), and the matrix unit idled."""
    placed = []
    top = 0

    def lowest(size, others):
        off = 0
        for a, b in sorted(others):
            if off + size <= a:
                break
            off = max(off, _align(b, alignment))
        return off

    for t in sorted(bufs, key=lambda t: (-t.slot_bytes * t.slots, t.first_op)):
        size = _align(t.slot_bytes, alignment) * t.slots
        spans = [(p, (p.offset, p.offset + _align(p.slot_bytes, alignment) * p.slots))
                 for p in placed]
        off = lowest(size, [s for _, s in spans]) if fresh_within else None
        if off is None or off + size > fresh_within:
            off = lowest(size, [s for p, s in spans
                                if not (p.last_op < t.first_op or t.last_op < p.first_op)])
        t.offset = off
        t.slot_stride = _align(t.slot_bytes, alignment)
        placed.append(t)
        top = max(top, off + size)
    return top


def locate(tb: TcmBuffer, op_index: int, box) -> tuple:
    """(byte offset of the box's first element, footprint-relative lo, slot) of an access."""
    inst = tb.op_instance[op_index]
    slot = inst % tb.slots
    rel = tuple(l - b for l, b in zip(box.lo, tb.instance_base[inst]))
    elem = sum(r * s for r, s in zip(rel, tb.strides()))
    return tb.offset + slot * tb.slot_stride + elem * tb.itemsize, rel, slot
