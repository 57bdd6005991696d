"""Power model: windowed average power and DVFS throttling, against hand formulas.

The program: one DMA (D cycles on dma0), then ``n_mma`` back-to-back MMAs (C cycles each)
that start S cycles after it, so the busy intervals are known exactly:
dma0 ``[0, D)``, matrix ``[D + S, D + S + n_mma * C)``, end of program ``T = D + S + n_mma * C``.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, Mma
from edgetvm.target.spec import PowerProfile

WINDOW = 256


def build(spec, n_mma=4):
    b = ProgramBuilder("power", spec)
    b.tensor("w", (64, 64), "float16", "const", np.ones((64, 64)))
    a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), b.tcm((64, 64), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=w, src=b.dram("w"), signal=(e,)))
    for k in range(n_mma):
        b.emit(Mma(out=out, a=a, b=w, wait=(e,) if k == 0 else ()))
    return b.build()


def timeline(spec, n_mma=4):
    d = spec.dma_setup_cycles + math.ceil(64 * 64 * 2 / spec.dram_bytes_per_cycle)
    tm, tn, tk = spec.mma_tile
    c = (64 // tm) * tm * tn * tk // spec.mma_macs_per_cycle["fp16"]
    s = spec.event_sync_cycles
    return d, s, c, d + s + n_mma * c


def overlap(a0, a1, b0, b1):
    return max(0, min(a1, b1) - max(a0, b0))


def hand_demand(spec, n_mma=4):
    """Per-window demand: static + unit power * busy fraction of the window."""
    d, s, c, total = timeline(spec, n_mma)
    w = spec.power_window_cycles
    windows = [(k * w, min((k + 1) * w, total)) for k in range(math.ceil(total / w))]
    demand = [spec.power_static_mw
              + spec.power_unit_mw["dma"] * overlap(0, d, w0, w1) / (w1 - w0)
              + spec.power_unit_mw["matrix"] * overlap(d + s, total, w0, w1) / (w1 - w0)
              for w0, w1 in windows]
    return windows, demand, total


def with_profile(spec, budget_mw, exponent):
    p = PowerProfile("test", budget_mw, exponent)
    return spec.replace(power_window_cycles=WINDOW, power_profiles={"test": p},
                        default_profile="test")


def test_windowed_average_power(spec):
    s = spec.replace(power_window_cycles=WINDOW)
    r = Emulator(s).run(build(s))
    windows, demand, total = hand_demand(s)
    d, sync, c, _ = timeline(s)
    assert (d, sync, c, total) == (320, 8, 128, 840)
    assert [w1 - w0 for w0, w1 in windows] == [256, 256, 256, 72]
    # window 0: dma0 busy all of it; window 1: 64 cycles of DMA, 184 of matrix; then matrix
    assert demand[0] == pytest.approx(150 + 120)
    assert demand[1] == pytest.approx(150 + 120 * 64 / 256 + 900 * 184 / 256)
    assert demand[2] == demand[3] == pytest.approx(150 + 900)
    c_ = r.counters
    assert c_.total_cycles == total and c_.throttled_cycles == 0
    np.testing.assert_allclose(r.power_mw, demand, rtol=1e-12)
    np.testing.assert_allclose(r.power_window_starts, [w0 for w0, _ in windows])
    energy = sum(p * (w1 - w0) for p, (w0, w1) in zip(demand, windows))   # mW * cycles
    assert c_.energy_uj == pytest.approx(energy / s.clock_mhz * 1e-3)
    assert c_.avg_power_mw == pytest.approx(energy / total)
    assert c_.peak_power_mw == c_.peak_power_demand_mw == pytest.approx(max(demand))


def test_two_busy_dma_channels_each_draw_power(spec):
    s = spec.replace(power_window_cycles=10_000)
    b = ProgramBuilder("two_dma", s)
    b.tensor("x", (64, 64), "float16", "const", np.ones((64, 64)))
    for ch in (0, 1):
        b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), channel=ch))
    c = Emulator(s).run(b.build()).counters
    setup, bus = s.dma_setup_cycles, 64 * 64 * 2 // s.dram_bytes_per_cycle
    total = setup + 2 * bus
    busy = (setup + bus) + (setup + 2 * bus)    # dma1 is busy while it waits for the bus
    assert c.total_cycles == total
    assert c.peak_power_demand_mw == pytest.approx(s.power_static_mw
                                                   + s.power_unit_mw["dma"] * busy / total)


def test_throttling_with_linear_dvfs(spec):
    """dvfs_exponent 1: a window of demand P > budget lasts (P - static) / (budget - static)
    times longer and draws exactly the budget."""
    budget = 700.0
    s = with_profile(spec, budget, 1.0)
    r = Emulator(s).run(build(s), trace=True)
    windows, demand, total = hand_demand(s)
    static = s.power_static_mw
    durations = [(w1 - w0) * ((p - static) / (budget - static) if p > budget else 1.0)
                 for p, (w0, w1) in zip(demand, windows)]
    # windows 1-3 are over budget (826.9 and 1050 mW), window 0 (270 mW) is not
    assert [p > budget for p in demand] == [False, True, True, True]
    stretched = 256 + 256 * (demand[1] - 150) / 550 + (256 + 72) * 900 / 550
    assert sum(durations) == pytest.approx(stretched)
    c = r.counters
    assert c.total_cycles == math.ceil(sum(durations))
    assert c.unthrottled_cycles == total
    assert c.throttled_cycles == c.total_cycles - total > 0
    assert c.peak_power_mw == pytest.approx(budget) and c.peak_power_mw <= budget
    assert c.peak_power_demand_mw == pytest.approx(150 + 900)
    power = [min(p, budget) for p in demand]
    energy = sum(p * t for p, t in zip(power, durations))
    assert c.energy_uj == pytest.approx(energy / s.clock_mhz * 1e-3)
    np.testing.assert_allclose(r.power_mw, power)
    # the trace is on the stretched timeline: the last MMA ends at the stretched end
    assert max(e.end for e in r.trace) == pytest.approx(sum(durations))
    # the DMA ends 64 cycles into window 1, which runs (P1 - static) / (budget - static) slower
    assert r.trace[0].end == pytest.approx(256 + 64 * (demand[1] - static) / (budget - static))


def test_throttling_under_the_low_battery_profile(spec):
    s = spec.replace(power_window_cycles=WINDOW)
    emu = Emulator(s, profile="low-battery")
    prof = s.power_profiles["low-battery"]
    assert (prof.budget_mw, prof.dvfs_exponent) == (700, 3.0)
    c = emu.run(build(s)).counters
    windows, demand, total = hand_demand(s)
    static = s.power_static_mw
    scale = [((prof.budget_mw - static) / (p - static)) ** (1 / 3) if p > prof.budget_mw else 1
             for p in demand]
    durations = [(w1 - w0) / k for k, (w0, w1) in zip(scale, windows)]
    assert c.profile == "low-battery"
    assert c.total_cycles == math.ceil(sum(durations))
    assert c.throttled_cycles == c.total_cycles - total > 0
    assert c.peak_power_mw == pytest.approx(prof.budget_mw) and c.peak_power_mw <= prof.budget_mw
    assert c.peak_power_demand_mw == pytest.approx(static + s.power_unit_mw["matrix"])
    energy = sum(min(p, prof.budget_mw) * t for p, t in zip(demand, durations))
    assert c.energy_uj == pytest.approx(energy / s.clock_mhz * 1e-3)
    # the cube root: throttling costs less time than with linear DVFS
    linear = Emulator(with_profile(spec, prof.budget_mw, 1.0)).run(build(s)).counters
    assert total < c.total_cycles < linear.total_cycles


def test_performance_profile_does_not_throttle(spec):
    s = spec.replace(power_window_cycles=WINDOW)
    c = Emulator(s, profile="performance").run(build(s)).counters
    _, demand, total = hand_demand(s)
    assert max(demand) < s.power_profiles["performance"].budget_mw
    assert c.total_cycles == c.unthrottled_cycles == total
    assert c.throttled_cycles == 0
    assert c.peak_power_mw == c.peak_power_demand_mw == pytest.approx(max(demand))


def test_balanced_profile_throttles_only_long_matrix_windows(spec):
    # default 10 000-cycle window: a 100-MMA run is mostly matrix-busy
    c = Emulator(spec, profile="balanced").run(build(spec, n_mma=100)).counters
    windows, demand, total = hand_demand(spec, n_mma=100)
    budget = spec.power_profiles["balanced"].budget_mw
    assert len(windows) == 2 and max(demand) < budget   # 1050 mW < 1200 mW
    assert c.throttled_cycles == 0 and c.total_cycles == total
