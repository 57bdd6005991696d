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

    @property
    def end(self) -> int:
        return self.offset + (self.rows - 1) * self.stride + self.width

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
    dense = outer.rows == 1 or outer.stride == outer.width
    return dense and outer.space == inner.space and outer.offset <= inner.offset \
        and inner.end <= outer.end


@dataclass
class _Access:
    region: Region
    unit: int
    seq: int
    index: int
    write: bool


class HazardChecker:
    """Vector clocks per unit plus a shadow list of recent accesses per address space."""

    def __init__(self, units):
        self.units = list(units)
        self.uidx = {u: i for i, u in enumerate(self.units)}
        n = len(self.units)
        self.clock = {u: (0,) * n for u in self.units}
        self.seq = [0] * n
        self.accesses: dict[str, list] = {}
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

    def barrier(self) -> None:
        """Launch / End: every unit waits for every other, so nothing before can race."""
        vc = tuple(max(c[i] for c in self.clock.values()) for i in range(len(self.units)))
        for u in self.units:
            self.clock[u] = vc
        self.accesses.clear()

    def check(self, index: int, unit: str, vc: tuple, reads, writes, names) -> None:
        u = self.uidx[unit]
        for r in reads:
            for acc in self.accesses.get(r.space, ()):
                if acc.write and vc[acc.unit] < acc.seq and overlaps(r, acc.region):
                    raise InvalidProgramError(
                        f"race: {names[index]} reads {r.describe()} written by command "
                        f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) without "
                        f"waiting on an event that command signals", index)
        for w in writes:
            for acc in self.accesses.get(w.space, ()):
                if vc[acc.unit] < acc.seq and overlaps(w, acc.region):
                    what = "writes" if acc.write else "still reads"
                    raise InvalidProgramError(
                        f"race: {names[index]} overwrites {w.describe()} that command "
                        f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) {what} "
                        f"without an event ordering the two", index)
        seq = vc[u]
        for w in writes:
            lst = self.accesses.setdefault(w.space, [])
            lst[:] = [a for a in lst if not (vc[a.unit] >= a.seq and contains(w, a.region))]
            lst.append(_Access(w, u, seq, index, True))
        for r in reads:
            self.accesses.setdefault(r.space, []).append(_Access(r, u, seq, index, False))
        self._since_prune += 1
        if self._since_prune >= 64:
            self._prune()

    def _prune(self) -> None:
        # An access every unit's clock already covers can never race again.
        self._since_prune = 0
        floor = [min(c[i] for c in self.clock.values()) for i in range(len(self.units))]
        for space, lst in self.accesses.items():
            lst[:] = [a for a in lst if floor[a.unit] < a.seq]
