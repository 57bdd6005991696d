"""Event insertion: which ops must wait for which, so that the program is race-free.

Units run their own commands in order, so only cross-unit conflicts need events: a
read after a write (RAW), a write after a read (WAR: the slot a DMA refills must be
drained first, the heart of double buffering), a write after a write. Each op waits on
the latest conflicting op of every other unit, unless it already knows that op finished
(vector clocks: what an op's waits imply transitively), so the stream carries few events.
TCM conflicts are computed per (buffer, slot) in footprint-relative coordinates, since
every instance that rotates into a slot reuses the same bytes.
"""
from __future__ import annotations

from ..isa import Affine
from .tcm_alloc import locate


def _accesses(op, kinds, tcm):
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


def _overlap(lo1, hi1, lo2, hi2) -> bool:
    for a, b, c, d in zip(lo1, hi1, lo2, hi2):
        if any(isinstance(x, Affine) for x in (a, b, c, d)):
            continue        # runtime-parameter coordinates: assume they may overlap
        if not (a < d and c < b):
            return False
    return True


def insert_events(ops, units: dict, kinds: dict, tcm: dict):
    """Returns (waits, signals): op index -> list of event ids."""
    names = sorted(set(units.values()))
    known = {u: {v: -1 for v in names} for u in names}
    done_known: dict = {}
    history: dict = {}
    waits = {op.index: [] for op in ops}
    signals = {op.index: [] for op in ops}
    n_events = 0
    for count, op in enumerate(ops):
        u = units[op.index]
        acc = _accesses(op, kinds, tcm)
        need: dict = {}
        for key, lo, hi, write in acc:
            for p, pu, plo, phi, pw in history.get(key, ()):
                if pu != u and (write or pw) and _overlap(lo, hi, plo, phi):
                    if p > need.get(pu, -1):
                        need[pu] = p
        k = dict(known[u])
        for pu, p in sorted(need.items(), key=lambda x: -x[1]):
            if k[pu] >= p:
                continue
            signals[p].append(n_events)
            waits[op.index].append(n_events)
            n_events += 1
            for v, x in done_known[p].items():
                if x > k[v]:
                    k[v] = x
        k[u] = op.index
        known[u] = k
        done_known[op.index] = k
        for key, lo, hi, write in acc:
            history.setdefault(key, []).append((op.index, u, lo, hi, write))
        if count % 64 == 63:
            floor = {v: min(known[w][v] for w in names) for v in names}
            for key, lst in history.items():
                lst[:] = [h for h in lst if h[0] > floor[h[1]]]
    return waits, signals
