"""Power model: activity-weighted power per window, and DVFS throttling to a budget.

Demand: in every window of ``spec.power_window_cycles`` cycles (tumbling windows from
cycle 0; the last one may be shorter), the average power is

    P = power_static_mw + sum over units of power_unit_mw[unit] * busy_cycles_in_window / window

(each busy DMA channel draws ``power_unit_mw["dma"]``). Throttling (the profile's rule, see
:class:`~edgetvm.target.spec.PowerProfile`): a window with ``P > budget`` runs at clock scale
``s = ((budget - static) / (P - static)) ** (1 / dvfs_exponent)``, so it lasts ``1 / s``
times longer and draws exactly the budget. The emulator first schedules at full clock, then
stretches each window; total cycles, the trace and the energy use the stretched timeline.
Deterministic by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PowerReport:
    window_cycles: int
    demand_mw: np.ndarray        # per window, at full clock
    power_mw: np.ndarray         # per window, after throttling
    duration_cycles: np.ndarray  # per window, after throttling
    boundaries: np.ndarray       # window starts at full clock, plus the end

    @property
    def total_cycles(self) -> float:
        return float(self.duration_cycles.sum())

    def stretch(self, t):
        """Map full-clock cycle(s) ``t`` onto the throttled timeline."""
        stretched = np.concatenate([[0.0], np.cumsum(self.duration_cycles)])
        return np.interp(t, self.boundaries, stretched)


def busy_in_windows(starts: np.ndarray, ends: np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Busy cycles of non-overlapping, sorted intervals inside each [b_k, b_k+1)."""
    if len(starts) == 0:
        return np.zeros(len(boundaries) - 1)
    dur = ends - starts
    prefix = np.concatenate([[0.0], np.cumsum(dur)])
    # cumulative busy time up to each boundary b: full intervals ending <= b, plus the
    # running part of the interval that contains b
    done = np.searchsorted(ends, boundaries, side="right")
    cum = prefix[done]
    nxt = np.minimum(done, len(starts) - 1)
    running = (done < len(starts)) & (starts[nxt] < boundaries)
    cum = cum + np.where(running, boundaries - starts[nxt], 0.0)
    return np.diff(cum)


def power_report(spec, profile, intervals: dict, total_cycles: int) -> PowerReport:
    """``intervals``: unit name -> (starts, ends) arrays of busy time at full clock."""
    w = spec.power_window_cycles
    n = max(1, -(-int(total_cycles) // w))
    boundaries = np.minimum(np.arange(n + 1, dtype=np.float64) * w, max(total_cycles, 1))
    lengths = np.diff(boundaries)
    energy = np.full(n, float(spec.power_static_mw)) * lengths   # mW * cycles
    for unit, (starts, ends) in intervals.items():
        kind = "dma" if unit.startswith("dma") else unit
        energy += spec.power_unit_mw[kind] * busy_in_windows(starts, ends, boundaries)
    demand = energy / np.maximum(lengths, 1e-12)
    static = float(spec.power_static_mw)
    over = demand > profile.budget_mw
    scale = np.ones(n)
    scale[over] = ((profile.budget_mw - static) / (demand[over] - static)) \
        ** (1.0 / profile.dvfs_exponent)
    power = np.where(over, float(profile.budget_mw), demand)
    return PowerReport(w, demand, power, lengths / scale, boundaries)
