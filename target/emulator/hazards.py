"""Race detection: every TCM/DRAM access must be ordered after the accesses it conflicts with.

Happens-before is what the ISA guarantees, nothing more: commands on one unit are ordered
by program order, and a command that consumed a signal is ordered after the signalling
command (and everything before it). Each unit keeps a vector clock; a conflicting access
pair (read-after-write, write-after-read, write-after-write on overlapping bytes) whose
earlier access is not in the later command's clock is a race, reported with both command
indices. Timing never hides a race: a program that happens to run in the right order only
because of how long a DMA took is still refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgetvm.errors import InvalidProgramError


@dataclass(frozen=True)
class Region:
    """Bytes ``offset + r * stride + [0, width)`` for ``r < rows`` in one address space."""

    space: str
    offset: int
    rows: int
    width: int
    stride: int

    @cached_property     # hot in the race checks; frozen, so computed once
    def end(self) -> int:
        return self.offset + (self.rows - 1) * self.stride + self.width

    @cached_property
    def dense(self) -> bool:
        return self.rows == 1 or self.stride == self.width

    def describe(self) -> str:
        where = "TCM" if self.space == "tcm" else f"DRAM tensor {self.space[5:]!r}"
        return f"{where} bytes [{self.offset}, {self.end})"


def overlaps(a: Region, b: Region) -> bool:
    if a.space != b.space or a.end <= b.offset or b.end <= a.offset:
        return False
    a_dense = a.rows == 1 or a.stride == a.width
    b_dense = b.rows == 1 or b.stride == b.width
    if a_dense and b_dense:
        return True
    if b_dense:
        a, b = b, a
    # b is strided: for each row interval of a, is there a row k of b that intersects it?
    starts = a.offset + np.arange(a.rows, dtype=np.int64) * a.stride if not a_dense \
        else np.array([a.offset], dtype=np.int64)
    width = a.width if not a_dense else a.end - a.offset
    kmin = np.floor_divide(starts - b.width - b.offset, b.stride) + 1
    kmax = -np.floor_divide(-(starts + width - b.offset), b.stride) - 1
    kmin = np.maximum(kmin, 0)
    kmax = np.minimum(kmax, b.rows - 1)
    return bool(np.any(kmin <= kmax))


def contains(outer: Region, inner: Region) -> bool:
    return outer.dense and outer.space == inner.space and outer.offset <= inner.offset \
        and inner.end <= outer.end


@dataclass
class _Access:
    region: Region
    unit: int
    seq: int
    index: int
    write: bool


class HazardChecker:
    """Vector clocks per unit plus a shadow table of recent accesses per address space.

    The table of a space maps ``(unit, write, region)`` to the latest such access: a newer
    access of the same region by the same unit subsumes the older one (anything that races
    the older one races the newer one). Accesses every unit that still has commands to
    issue has already ordered itself after are dropped (:meth:`retire`, :meth:`_prune`).
    """

    def __init__(self, units):
        self.units = list(units)
        self.uidx = {u: i for i, u in enumerate(self.units)}
        n = len(self.units)
        self.clock = {u: (0,) * n for u in self.units}
        self.seq = [0] * n
        self.accesses: dict[str, dict] = {}
        self.retired: set = set()
        self._since_prune = 0

    def begin(self, unit: str, joined: list) -> tuple:
        """Clock of the next command on ``unit`` after consuming signals with clocks ``joined``."""
        vc = self.clock[unit]
        for other in joined:
            vc = tuple(map(max, vc, other))
        i = self.uidx[unit]
        self.seq[i] += 1
        vc = vc[:i] + (self.seq[i],) + vc[i + 1:]
        self.clock[unit] = vc
        return vc

    def retire(self, unit: str) -> None:
        """``unit`` issues no more commands before the next barrier: its clock no longer
        holds accesses alive."""
        self.retired.add(unit)

    def barrier(self) -> None:
        """Launch / End: every unit waits for every other, so nothing before can race."""
        vc = tuple(max(c[i] for c in self.clock.values()) for i in range(len(self.units)))
        for u in self.units:
            self.clock[u] = vc
        self.accesses.clear()
        self.retired.clear()

    def check(self, index: int, unit: str, vc: tuple, reads, writes, names) -> None:
        u = self.uidx[unit]
        for r in reads:
            table = self.accesses.get(r.space)
            if not table:
                continue
            lo, hi = r.offset, r.end
            for acc in table.values():
                g = acc.region
                if acc.write and vc[acc.unit] < acc.seq and g.offset < hi and lo < g.end \
                        and overlaps(r, g):
                    raise InvalidProgramError(
                        f"race: {names[index]} reads {r.describe()} written by command "
                        f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) without "
                        f"waiting on an event that command signals", index)
        for w in writes:
            table = self.accesses.get(w.space)
            if not table:
                continue
            lo, hi = w.offset, w.end
            for acc in table.values():
                g = acc.region
                if vc[acc.unit] < acc.seq and g.offset < hi and lo < g.end and overlaps(w, g):
                    what = "writes" if acc.write else "still reads"
                    raise InvalidProgramError(
                        f"race: {names[index]} overwrites {w.describe()} that command "
                        f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) {what} "
                        f"without an event ordering the two", index)
        seq = vc[u]
        for w in writes:
            table = self.accesses.setdefault(w.space, {})
            if w.dense and table:
                # accesses ordered before this write and inside it can never race again
                lo, hi = w.offset, w.end
                dead = [k for k, a in table.items() if lo <= a.region.offset
                        and a.region.end <= hi and vc[a.unit] >= a.seq]
                for k in dead:
                    del table[k]
            key = (u, True, w)
            table.pop(key, None)
            table[key] = _Access(w, u, seq, index, True)
        for r in reads:
            table = self.accesses.setdefault(r.space, {})
            key = (u, False, r)
            table.pop(key, None)
            table[key] = _Access(r, u, seq, index, False)
        self._since_prune += 1
        if self._since_prune >= 64:
            self._prune()

    def _prune(self) -> None:
        # An access every unit that can still issue has ordered itself after can never race
        # again: such a unit's future clocks are at least its current one.
        self._since_prune = 0
        live = [c for u, c in self.clock.items() if u not in self.retired]
        if not live:
            self.accesses.clear()
            return
        floor = [min(c[i] for c in live) for i in range(len(self.units))]
        for table in self.accesses.values():
            dead = [k for k, a in table.items() if floor[a.unit] >= a.seq]
            for k in dead:
                del table[k]
