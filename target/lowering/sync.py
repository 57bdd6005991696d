"""Event insertion: which ops must wait for which, so that the program is race-free.

Units run their own commands in order, so only cross-unit conflicts need events: a
read after a write (RAW), a write after a read (WAR: the slot a DMA refills must be
drained first, the heart of double buffering), a write after a write. Each op waits on
the latest conflicting op of every other unit, unless it already knows that op finished
(vector clocks: what an op's waits imply transitively), so the stream carries few events.
TCM conflicts are computed per (buffer, slot) in footprint-relative coordinates, since
every instance that rotates into a slot reuses the same bytes. Buffers whose lifetimes do
not overlap may share bytes (``tcm_alloc``): an access of the later one is also ordered
after the last accesses, per unit, of the earlier one's overlapping slots.
"""
from __future__ import annotations

from ..isa import Affine
from .tcm_alloc import locate


def accesses(op, kinds, tcm):
    """(key, lo, hi, write) of each access of ``op``: key ``("tcm", buffer, slot)`` with
    footprint-relative coordinates, or ``("dram", tensor)``."""
    out = []
    for write, boxes in ((False, op.reads), (True, op.writes)):
        for box in boxes:
            if box.empty:
                continue
            tb = tcm.get(box.buffer)
            if tb is not None:
                _, rel, slot = locate(tb, op.index, box)
                hi = tuple(r + e for r, e in zip(rel, box.extents))
                out.append((("tcm", box.buffer.name, slot), rel, hi, write))
            else:
                out.append((("dram", box.buffer.name), box.lo, box.hi, write))
    return out


def overlap(lo1, hi1, lo2, hi2) -> bool:
    """Whether two boxes may overlap (runtime coordinates: assume they do)."""
    for a, b, c, d in zip(lo1, hi1, lo2, hi2):
        if any(isinstance(x, Affine) for x in (a, b, c, d)):
            continue        # runtime-parameter coordinates: assume they may overlap
        if not (a < d and c < b):
            return False
    return True


def _slot_range(tb, slot) -> tuple:
    base = tb.offset + slot * tb.slot_stride
    return base, base + tb.slot_bytes


def earlier_sharers(tcm: dict) -> dict:
    """(buffer, slot) -> the (buffer, slot)s of buffers dead before it that share its bytes."""
    ranges = {(b.name, s): _slot_range(b, s) for b in tcm.values() for s in range(b.slots)}
    out: dict = {}
    for b in tcm.values():
        for s in range(b.slots):
            lo, hi = ranges[(b.name, s)]
            out[(b.name, s)] = [(a.name, t) for a in tcm.values() if a.last_op < b.first_op
                                for t in range(a.slots)
                                if ranges[(a.name, t)][0] < hi and lo < ranges[(a.name, t)][1]]
    return out


def insert_events(ops, units: dict, kinds: dict, tcm: dict):
    """Returns (waits, signals): op index -> list of event ids. ``ops`` is in program
    order, which need not be index order (``reorder.list_schedule``): the clocks count
    positions in the list."""
    sharers = earlier_sharers(tcm)
    last_use: dict = {}     # (buffer, slot) -> {unit: (last access op, last write op)}
    names = sorted(set(units.values()))
    known = {u: {v: -1 for v in names} for u in names}
    done_known: dict = {}
    history: dict = {}
    waits = {op.index: [] for op in ops}
    signals = {op.index: [] for op in ops}
    n_events = 0
    index_at = [op.index for op in ops]      # position in the program -> op index
    for count, op in enumerate(ops):
        u = units[op.index]
        acc = accesses(op, kinds, tcm)
        need: dict = {}
        for key, lo, hi, write in acc:
            for p, pu, plo, phi, pw in history.get(key, ()):
                if pu != u and (write or pw) and overlap(lo, hi, plo, phi):
                    if p > need.get(pu, -1):
                        need[pu] = p
        slots = [(key[1], key[2], write) for key, _, _, write in acc if key[0] == "tcm"]
        for name, slot, write in slots:
            for prev in sharers.get((name, slot), ()):
                for pu, (p_any, p_write) in last_use.get(prev, {}).items():
                    p = p_any if write else p_write
                    if pu != u and p > need.get(pu, -1):
                        need[pu] = p
        k = dict(known[u])
        for pu, p in sorted(need.items(), key=lambda x: -x[1]):
            if k[pu] >= p:
                continue
            signals[index_at[p]].append(n_events)
            waits[op.index].append(n_events)
            n_events += 1
            for v, x in done_known[p].items():
                if x > k[v]:
                    k[v] = x
        k[u] = count
        known[u] = k
        done_known[count] = k
        for key, lo, hi, write in acc:
            history.setdefault(key, []).append((count, u, lo, hi, write))
        for name, slot, write in slots:
            use = last_use.setdefault((name, slot), {})
            use[u] = (count, count if write else use.get(u, (-1, -1))[1])
        if count % 64 == 63:
            floor = {v: min(known[w][v] for w in names) for v in names}
            for key, lst in history.items():
                lst[:] = [h for h in lst if h[0] > floor[h[1]]]
    return waits, signals
