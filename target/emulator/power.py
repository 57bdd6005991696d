"""Power model: what the NPU draws from moment to moment, the governor that throttles it,
and the windowed figures reported.

Power drawn at time ``t`` (mW, piecewise constant between simulation events):

    P(t) = power_static_mw
         + sum over busy compute units u of power_unit_mw[u] * s(t) ** dvfs_exponent
         + dram_pj_per_byte * (bytes the DRAM bus moves per cycle at t) * clock_mhz / 1000
         + (TCM pJ per byte * bytes each busy command reads or writes in the TCM, spread
            over its work) * clock_mhz / 1000

(the host CPU is not throttled: its power does not scale). ``s(t)`` is the NPU clock
scale the governor sets. The DRAM term is the bus at full rate whenever any transfer
moves bytes; a DMA channel that sets up or waits for the bus draws nothing beyond static.

Governor (DVFS): at every multiple of ``dvfs_interval_cycles`` it takes the averages over
the last ``power_window_cycles`` of the total power ``P_w``, of the part of it that follows
the NPU clock (``C_w``), and of that part at nominal clock: the compute units' power
``N_w`` (their ``power_unit_mw`` times their busy share of the window) and the TCM power
of the NPU's compute commands ``T_w``. It sets for the next interval the largest ``s`` in
``[MIN_SCALE, 1]`` with

    (P_w - C_w) + N_w * s ** dvfs_exponent + T_w * s <= budget_mw

(``MIN_SCALE`` when none meets it): a unit's power goes as ``s ** dvfs_exponent`` (clock
and voltage), the TCM traffic of the commands it runs as ``s`` (their bytes per cycle
follow their progress, at a fixed energy per byte), and the rest (static, DRAM, the TCM
writes and reads of DMA transfers, which move at the bus's rate, the host) does not
follow the clock. Time before a timeline starts counts as idle (static power only). A
budget below the part that does not scale cannot be met: the governor holds
``MIN_SCALE`` and the windows stay over budget.

Until emulator model 4 the governor counted the compute commands' TCM power with the part
that does not scale. TCM power is about as large as the matrix unit's in a GEMM (an MMA
reads its ``b`` once per 16-row native tile of ``a``: about 0.16 B per MAC), so the clock
it set overshot in both directions: throttled, the TCM term shrank and the next interval ran too
fast; fast, it came back and the next ran too slow. The windows swung around the budget
(under ``low-battery``, 271 / 1,328 mW, alternately, for a stream of MMAs that a steady
clock of 0.47 holds at 700 mW).

Reported: the peak of the sliding ``power_window_cycles`` average over the run, the same
at nominal clock (``peak_power_demand_mw``), average power, energy and its parts, and a
power trace of one average per DVFS interval.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

#: the lowest clock scale the governor sets
MIN_SCALE = 0.125


class PowerLog:
    """Cumulative energies at the simulation's breakpoints (mW x cycles).

    Channels: ``total`` (everything drawn), ``units`` (compute units at their actual
    scale), ``nominal`` (the compute units at nominal clock, for the governor and the
    demand figure), ``clocked_tcm`` and ``clocked_tcm_nominal`` (the TCM power of the
    NPU's compute commands, which follows the clock, at its actual and at nominal clock),
    and per-source parts for the energy breakdown."""

    PARTS = ("static", "units", "dram", "tcm", "host")

    def __init__(self, static_mw: float, t0: float = 0.0):
        self.static_mw = static_mw
        self.t = [t0]
        self.total = [0.0]
        self.units = [0.0]
        self.nominal = [0.0]
        self.clocked_tcm = [0.0]
        self.clocked_tcm_nominal = [0.0]
        self.parts = {k: 0.0 for k in self.PARTS}

    @property
    def end(self) -> float:
        return self.t[-1]

    def add(self, t1: float, parts: dict, nominal_mw: float, clocked_tcm_mw: float = 0.0,
            clocked_tcm_nominal_mw: float = 0.0) -> None:
        """Append the segment [end, t1) during which the draw is constant (``parts``,
        whose ``tcm`` includes ``clocked_tcm_mw``)."""
        dt = t1 - self.t[-1]
        if dt <= 0:
            return
        total = sum(parts.values())
        self.t.append(t1)
        self.total.append(self.total[-1] + total * dt)
        self.units.append(self.units[-1] + parts["units"] * dt)
        self.nominal.append(self.nominal[-1] + nominal_mw * dt)
        self.clocked_tcm.append(self.clocked_tcm[-1] + clocked_tcm_mw * dt)
        self.clocked_tcm_nominal.append(self.clocked_tcm_nominal[-1] +
                                        clocked_tcm_nominal_mw * dt)
        for k, v in parts.items():
            self.parts[k] += v * dt

    def _at(self, series, t: float) -> float:
        """Cumulative value of ``series`` at time ``t`` (static power before the start)."""
        if t <= self.t[0]:
            return (t - self.t[0]) * (self.static_mw if series is self.total else 0.0)
        k = bisect_right(self.t, t) - 1
        if k >= len(self.t) - 1:
            return series[-1]
        t0, t1 = self.t[k], self.t[k + 1]
        return series[k] + (series[k + 1] - series[k]) * (t - t0) / (t1 - t0)

    def window(self, t: float, w: float) -> tuple:
        """Averages over [t - w, t) of (total, units, nominal units, clocked TCM, clocked
        TCM at nominal clock) power."""
        return tuple((self._at(s, t) - self._at(s, t - w)) / w
                     for s in (self.total, self.units, self.nominal, self.clocked_tcm,
                               self.clocked_tcm_nominal))

    def _arrays(self, w: float) -> tuple:
        """Breakpoints and cumulative series as arrays, extended one window before the
        start with idle (static) power, for ``np.interp``: (t, total, the power that
        follows the clock, the same at nominal clock)."""
        t = np.asarray(self.t)
        t = np.concatenate([[t[0] - w], t])
        total = np.concatenate([[-w * self.static_mw], self.total])
        clocked = np.concatenate([[0.0], np.add(self.units, self.clocked_tcm)])
        nominal = np.concatenate([[0.0], np.add(self.nominal, self.clocked_tcm_nominal)])
        return t, total, clocked, nominal

    def peaks(self, start: float, end: float, w: float) -> tuple:
        """(peak total, peak demand at nominal clock) of the sliding window average over
        windows ending in [start, end]: the maxima of a moving average of a piecewise
        constant signal are at window ends on breakpoints or a window after them."""
        if end <= start:
            return self.static_mw, self.static_mw
        t, total, clocked, nominal = self._arrays(w)
        ends = np.concatenate([t, t + w, [start, end]])
        ends = ends[(ends >= start) & (ends <= end)]
        lo = np.maximum(ends - w, t[0])
        win = {}
        for name, series in (("total", total), ("clocked", clocked), ("nominal", nominal)):
            win[name] = np.interp(ends, t, series) - np.interp(lo, t, series)
        demand = win["total"] - win["clocked"] + win["nominal"]
        return float(win["total"].max()) / w, float(demand.max()) / w

    def energy(self, start: float, end: float) -> float:
        return self._at(self.total, end) - self._at(self.total, start)

    def trace(self, start: float, end: float, step: float) -> tuple:
        """(start times, average power) per ``step`` from ``start`` to ``end``."""
        if end <= start:
            return np.zeros(0), np.zeros(0)
        edges = np.arange(start, end, step)
        # arange may end a rounding error short of ``end`` (0.1 * 3 by 0.1): that edge would
        # make an empty last interval, its power 0 / 0
        edges = np.append(edges[edges < end - 1e-6 * step], end)
        t, total, _, _ = self._arrays(step)
        cum = np.interp(edges, t, total)
        return edges[:-1], np.diff(cum) / np.diff(edges)


def governor_scale(log: PowerLog, t: float, spec, profile) -> float:
    """The clock scale for the DVFS interval starting at ``t`` (module docstring)."""
    total, units, nominal, tcm, tcm_nominal = log.window(t, spec.power_window_cycles)
    if nominal <= 0 and tcm_nominal <= 0:
        return 1.0
    room = profile.budget_mw - (total - units - tcm)
    e = profile.dvfs_exponent

    def drawn(s: float) -> float:       # what follows the clock, at scale s
        return nominal * s ** e + tcm_nominal * s

    if drawn(1.0) <= room:
        return 1.0
    if room <= 0 or drawn(MIN_SCALE) >= room:
        return MIN_SCALE
    if e == 1.0:
        return float(room / (nominal + tcm_nominal))
    return largest_scale(lambda s: drawn(s) <= room)     # drawn() increases with s


def largest_scale(fits, tol: float = 1e-9) -> float:
    """The largest clock scale ``s`` in ``[MIN_SCALE, 1]`` with ``fits(s)``, to ``tol``, for
    a ``fits`` that holds below some scale and not above it (a draw that grows with the
    clock against a budget); ``MIN_SCALE`` when none fits."""
    if fits(1.0):
        return 1.0
    lo, hi = MIN_SCALE, 1.0
    if not fits(lo):
        return MIN_SCALE
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return float(lo)
