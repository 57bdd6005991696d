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

from bisect import bisect_right
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from edgetvm.errors import InvalidProgramError

from ..isa import ITEMSIZE


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
        """No gaps between rows (rows closer than their width, e.g. a row stride of 0, overlap)."""
        return self.rows == 1 or self.stride <= self.width

    def describe(self) -> str:
        where = "TCM" if self.space == "tcm" else f"DRAM tensor {self.space[5:]!r}"
        return f"{where} bytes [{self.offset}, {self.end})"


def tcm_region(ref, rows: int | None = None) -> Region:
    """The bytes a TCM operand (a ``TcmRef``; its first ``rows`` rows) covers."""
    isz = ITEMSIZE[ref.dtype]
    return Region("tcm", ref.offset, ref.shape[0] if rows is None else rows,
                  ref.shape[1] * isz, ref.stride * isz)


def overlaps(a: Region, b: Region) -> bool:
    if a.space != b.space or a.end <= b.offset or b.end <= a.offset:
        return False
    a_dense, b_dense = a.dense, b.dense
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
    """Vector clocks per unit plus a shadow log of accesses per address space and unit.

    A unit's log is in issue order, so its ``seq`` numbers increase: the accesses of unit
    ``w`` that a command with clock ``vc`` is *not* ordered after are exactly the suffix
    with ``seq > vc[w]`` (found by bisection), and only those are compared. Accesses of the
    command's own unit are ordered by program order. Log prefixes that every unit that can
    still issue commands has ordered itself after are dropped (:meth:`retire`,
    :meth:`_prune`).
    """

    def __init__(self, units):
        self.units = list(units)
        self.uidx = {u: i for i, u in enumerate(self.units)}
        n = len(self.units)
        self.clock = {u: (0,) * n for u in self.units}
        self.seq = [0] * n
        self.accesses: dict[str, dict] = {}   # space -> unit index -> ([seq], [_Access])
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
        keeps accesses alive."""
        self.retired.add(unit)

    def barrier(self) -> None:
        """Launch / End: every unit waits for every other, so nothing before can race."""
        vc = tuple(max(c[i] for c in self.clock.values()) for i in range(len(self.units)))
        for u in self.units:
            self.clock[u] = vc
        self.accesses.clear()
        self.retired.clear()

    def _conflict(self, region: Region, u: int, vc: tuple, writes_only: bool):
        """The latest (in program order) unordered access of another unit overlapping
        ``region`` (only writes if ``writes_only``), or None."""
        table = self.accesses.get(region.space)
        if not table:
            return None
        lo, hi = region.offset, region.end
        found = None
        for w, (seqs, log) in table.items():
            if w == u:
                continue
            for k in range(bisect_right(seqs, vc[w]), len(log)):
                acc = log[k]
                g = acc.region
                if (acc.write or not writes_only) and g.offset < hi and lo < g.end \
                        and overlaps(region, g) and (found is None or acc.index > found.index):
                    found = acc
        return found

    def check(self, index: int, unit: str, vc: tuple, reads, writes, names) -> None:
        u = self.uidx[unit]
        for r in reads:
            acc = self._conflict(r, u, vc, True)
            if acc is not None:
                raise InvalidProgramError(
                    f"race: {names[index]} reads {r.describe()} written by command "
                    f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) without "
                    f"waiting on an event that command signals", index)
        for w in writes:
            acc = self._conflict(w, u, vc, False)
            if acc is not None:
                what = "writes" if acc.write else "still reads"
                raise InvalidProgramError(
                    f"race: {names[index]} overwrites {w.describe()} that command "
                    f"{acc.index} ({names[acc.index]} on {self.units[acc.unit]}) {what} "
                    f"without an event ordering the two", index)
        seq = vc[u]
        for regions, write in ((writes, True), (reads, False)):
            for g in regions:
                seqs, log = self.accesses.setdefault(g.space, {}).setdefault(u, ([], []))
                seqs.append(seq)
                log.append(_Access(g, u, seq, index, write))
        self._since_prune += 1
        if self._since_prune >= 64:
            self._prune()

    def _prune(self) -> None:
        # Accesses every unit that can still issue has ordered itself after can never race
        # again: such a unit's future clocks are at least its current one.
        self._since_prune = 0
        live = [c for u, c in self.clock.items() if u not in self.retired]
        if not live:
            self.accesses.clear()
            return
        floor = [min(c[i] for c in live) for i in range(len(self.units))]
        for table in self.accesses.values():
            for w, (seqs, log) in table.items():
                k = bisect_right(seqs, floor[w])
                if k:
                    del seqs[:k], log[:k]


class TcmInit:
    """Which TCM bytes a kernel wrote before reading them.

    A ``Launch`` starts a kernel: whatever earlier kernels left in the TCM is stale for
    it (unless the launch declares ``keep_tcm``), and a read of bytes that nothing wrote
    since the launch is refused with the command index (a tile of which a DMA moved only the valid rows, then an MMA over the
    whole tile, reads the rows an earlier kernel left there). A program without launches
    (one kernel) starts from the zeroed TCM the emulator gives every run, so this check
    begins at the first launch. Bytes carry the epoch of their last write and a launch
    starts a new epoch, so nothing is cleared per kernel.
    """

    def __init__(self, nbytes: int):
        self.epoch_of = np.zeros(nbytes, dtype=np.uint16)
        self.epoch = 0
        self.active = False

    def start_run(self) -> None:
        self.active = False
        self._next()

    def launch(self, carry=()) -> None:
        """A new kernel; bytes of the ``carry`` regions written by the previous one (a
        prefetch for this kernel) stay readable."""
        old = self.epoch
        self.active = True
        self._next()
        for r in carry:
            view = self._bytes(r)
            view[view == old] = self.epoch

    def _next(self) -> None:
        self.epoch += 1
        if self.epoch == np.iinfo(np.uint16).max:
            self.epoch_of[:] = 0
            self.epoch = 1

    def _bytes(self, r: Region):
        a = self.epoch_of
        return np.lib.stride_tricks.as_strided(a[r.offset:], (r.rows, r.width),
                                               (r.stride * a.itemsize, a.itemsize),
                                               writeable=True)

    def write(self, regions) -> None:
        for r in regions:
            self._bytes(r)[...] = self.epoch

    def check(self, index: int, regions, names) -> None:
        if not self.active:
            return
        for r in regions:
            stale = self._bytes(r) != self.epoch
            if stale.any():
                row, col = (int(v[0]) for v in np.nonzero(stale))
                byte = r.offset + row * r.stride + col
                raise InvalidProgramError(
                    f"{names[index]} reads TCM byte {byte} (of {r.describe()}) that nothing "
                    f"wrote since its kernel was launched: stale data of an earlier kernel",
                    index)
