"""Power model: energy per byte and per busy cycle, sliding-window power, the DVFS governor,
against formulas written here from the model's definition (``emulator/power.py``)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.emulator.power import MIN_SCALE
from edgetvm.target.isa import DmaLoad, HostOp, Mma, Vector
from edgetvm.target.spec import PowerProfile


def mma_stream(spec, n_mma, dma=True):
    """Optionally one 8 KiB DMA (const weights), then ``n_mma`` back-to-back 64x64x64 MMAs."""
    b = ProgramBuilder("power", spec)
    b.tensor("w", (64, 64), "float16", "const", np.ones((64, 64)))
    a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), b.tcm((64, 64), "float32")
    e = b.event()
    if dma:
        b.emit(DmaLoad(dst=w, src=b.dram("w"), signal=(e,)))
    for k in range(n_mma):
        b.emit(Mma(out=out, a=a, b=w, wait=(e,) if k == 0 and dma else ()))
    return b.build()


def power_profile(spec, budget_mw, exponent, window=1000, interval=1000, tcm=True):
    p = PowerProfile("test", budget_mw, exponent)
    changes = dict(power_window_cycles=window, dvfs_interval_cycles=interval,
                   power_profiles={"test": p}, default_profile="test")
    if not tcm:
        changes.update(tcm_read_pj_per_byte=0.0, tcm_write_pj_per_byte=0.0)
    return spec.replace(**changes)


def power_curve(spec, n_mma):
    """The power drawn per cycle (mW) by ``mma_stream`` at full clock, written out: the
    DMA sets up (static only), moves 8192 B (DRAM + TCM writes), then the MMAs (matrix
    unit + their TCM reads and writes)."""
    mhz = spec.clock_mhz / 1000
    setup, transfer = spec.dma_setup_cycles, 8192 // spec.dram_bytes_per_cycle
    c = spec.mma_issue_cycles + 4 * 16 * 64 * 64 // spec.mma_macs_per_cycle["fp16"]
    sync = spec.event_sync_cycles
    dma_mw = (spec.dram_bytes_per_cycle * spec.dram_pj_per_byte
              + 8192 * spec.tcm_write_pj_per_byte / transfer) * mhz
    # the native tile is (16, 64, 64): the MMA reads ``a`` once (one column of tiles) and
    # ``b`` once per row of tiles (4), and writes its fp32 ``out`` once
    mma_pj = (8192 + 4 * 8192) * spec.tcm_read_pj_per_byte + 16384 * spec.tcm_write_pj_per_byte
    mma_mw = spec.power_unit_mw["matrix"] + mma_pj / c * mhz
    curve = [spec.power_static_mw] * setup
    curve += [spec.power_static_mw + dma_mw] * transfer
    curve += [spec.power_static_mw] * sync
    curve += [spec.power_static_mw + mma_mw] * (n_mma * c)
    return np.asarray(curve), c


def sliding_peak(curve, static, window):
    """Max over every window end (cycle granularity) of the average over the last
    ``window`` cycles, idle (static) before the start."""
    padded = np.concatenate([np.full(window, static), curve])
    cum = np.concatenate([[0.0], np.cumsum(padded)])
    ends = np.arange(window, len(padded) + 1)
    return float(((cum[ends] - cum[ends - window]) / window).max())


def test_energy_and_power_without_throttling(spec):
    s = spec.replace(power_window_cycles=256)
    r = Emulator(s).run(mma_stream(s, 4))
    curve, c = power_curve(s, 4)
    cnt = r.counters
    assert (c, cnt.total_cycles) == (144, len(curve)) == (144, 64 + 256 + 8 + 4 * 144)
    energy = curve.sum()                                       # mW x cycles
    assert cnt.energy_uj == pytest.approx(energy / s.clock_mhz * 1e-3)
    assert cnt.avg_power_mw == pytest.approx(energy / len(curve))
    assert cnt.peak_power_mw == pytest.approx(sliding_peak(curve, s.power_static_mw, 256))
    assert cnt.peak_power_demand_mw == pytest.approx(cnt.peak_power_mw)
    assert cnt.throttled_cycles == 0 and cnt.min_clock_scale == 1.0
    # the parts: DRAM per byte moved, TCM per byte read / written, the unit per busy cycle
    by = cnt.energy_uj_by
    to_uj = 1e-6
    assert by["dram"] == pytest.approx(8192 * s.dram_pj_per_byte * to_uj)
    tcm_pj = 8192 * s.tcm_write_pj_per_byte + 4 * (40960 * s.tcm_read_pj_per_byte +
                                                   16384 * s.tcm_write_pj_per_byte)
    assert by["tcm"] == pytest.approx(tcm_pj * to_uj)
    assert by["units"] == pytest.approx(4 * c * s.power_unit_mw["matrix"] / s.clock_mhz * 1e-3)
    assert by["static"] == pytest.approx(len(curve) * s.power_static_mw / s.clock_mhz * 1e-3)
    assert (cnt.tcm_read_bytes, cnt.tcm_write_bytes) == (4 * 40960, 8192 + 4 * 16384)
    # the power trace: one average per DVFS interval, covering the run's energy
    starts, power = r.power_window_starts, r.power_mw
    assert starts[0] == 0
    widths = np.diff(np.append(starts, cnt.total_cycles))
    assert float((power * widths).sum()) == pytest.approx(energy)


def test_dram_energy_is_per_byte_not_per_waiting_channel(spec):
    # two 8 KiB loads on two channels sharing the bus, and the same loads on one channel:
    # the same bytes, the same DRAM energy; only static energy follows the time taken
    runs = []
    for channels in ((0, 1), (0, 0)):
        b = ProgramBuilder("loads", spec)
        b.tensor("x", (64, 64), "float16", "const", np.ones((64, 64)))
        for ch in channels:
            b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), channel=ch))
        runs.append(Emulator(spec).run(b.build()).counters)
    shared, serial = runs
    assert shared.total_cycles == 64 + 512 and serial.total_cycles == 2 * (64 + 256)
    for c in runs:
        assert c.energy_uj_by["dram"] == pytest.approx(16384 * spec.dram_pj_per_byte * 1e-6)
        assert c.energy_uj_by["tcm"] == pytest.approx(16384 * spec.tcm_write_pj_per_byte * 1e-6)
        assert c.energy_uj_by["units"] == 0


def test_governor_settles_on_the_budget_linear_dvfs(spec):
    # matrix work only, no TCM energy: 1050 mW at full clock. The governor first acts at
    # cycle 1000 (window [0, 1000): 1050 mW) and sets s = (600 - 150) / 900 = 0.5, which
    # holds the window at 600 mW: the remaining work runs at half speed
    s = power_profile(spec, 600, 1.0, tcm=False)
    c = Emulator(s).run(mma_stream(s, 50, dma=False)).counters
    work = 50 * 144
    assert c.total_cycles == 1000 + 2 * (work - 1000) == 13400
    assert c.throttled_cycles == 12400 and c.min_clock_scale == pytest.approx(0.5)
    assert c.peak_power_mw == pytest.approx(1050)              # before the governor reacted
    assert c.peak_power_demand_mw == pytest.approx(1050)
    energy = 150 * 13400 + 900 * 1000 + 450 * 12400
    assert c.energy_uj == pytest.approx(energy / s.clock_mhz * 1e-3)


def test_governor_with_cubic_dvfs_spends_less_time(spec):
    s = power_profile(spec, 600, 3.0, tcm=False)
    c = Emulator(s).run(mma_stream(s, 50, dma=False)).counters
    scale = (450 / 900) ** (1 / 3)
    assert c.min_clock_scale == pytest.approx(scale)
    assert c.total_cycles == int(np.ceil(1000 + (50 * 144 - 1000) / scale - 1e-9))
    linear = Emulator(power_profile(spec, 600, 1.0, tcm=False)).run(
        mma_stream(s, 50, dma=False)).counters
    assert 50 * 144 < c.total_cycles < linear.total_cycles


def test_a_short_burst_is_not_stretched(spec):
    # the governor acts at interval boundaries, not per command: one MMA in the first
    # interval runs at full clock whatever the budget
    s = power_profile(spec, 200, 1.0, window=10_000, interval=10_000)
    c = Emulator(s).run(mma_stream(s, 1, dma=False)).counters
    assert c.total_cycles == 144 and c.throttled_cycles == 0


def test_peak_power_does_not_depend_on_where_a_burst_starts(spec):
    # the same 1050 mW burst of 6 MMAs after idle gaps of different lengths (a vector op
    # drawing no power): the sliding window sees the burst whole wherever it starts
    s = power_profile(spec, 5000, 1.0, window=1000, interval=1000, tcm=False)
    s = s.replace(power_unit_mw={**s.power_unit_mw, "vector": 0.0})
    peaks = []
    for gap in (0, 300, 700):
        b = ProgramBuilder("burst", s)
        a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), \
            b.tcm((64, 64), "float32")
        wait = ()
        if gap:
            e = b.event()
            src, dst = b.tcm((gap, 1), "float32"), b.tcm((gap, 1), "float32")
            b.emit(Vector(op="copy", dst=dst, srcs=(src,), signal=(e,)))   # gap cycles
            wait = (e,)
        for k in range(6):
            b.emit(Mma(out=out, a=a, b=w, wait=wait if k == 0 else ()))
        c = Emulator(s).run(b.build()).counters
        assert c.total_cycles == gap + (s.event_sync_cycles if gap else 0) + 6 * 144
        peaks.append(c.peak_power_mw)
    # 864 busy cycles at 1050 mW in a 1000-cycle window: 150 + 900 * 0.864
    assert peaks == pytest.approx([150 + 900 * 0.864] * 3)


def test_dvfs_slows_compute_not_dram(spec):
    # a long DMA at the lowest clock: its bus time does not stretch, only its set-up
    s = power_profile(spec, 151, 1.0, window=100, interval=100, tcm=False)
    b = ProgramBuilder("dma_under_throttle", s)
    b.tensor("w", (4096, 64), "float16", "const", np.ones((4096, 64)))
    a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), b.tcm((64, 64), "float32")
    for _ in range(4):                           # 4 x 144 cycles of matrix work first ...
        b.emit(Mma(out=out, a=a, b=w))
    big = b.tcm((4096, 64), "float16")
    b.emit(DmaLoad(dst=big, src=b.dram("w")))    # ... while the DMA runs beside them
    r = Emulator(s).run(b.build(), trace=True)
    dma = next(e for e in r.trace if e.unit == "dma0")
    # the governor holds the lowest clock from cycle 100 on (DRAM alone is over budget):
    # the MMAs slow down, the 524288 bytes still take 16384 cycles at 32 B/cycle
    assert r.counters.min_clock_scale == pytest.approx(0.125)
    mma_end = max(e.end for e in r.trace if e.unit == "matrix")
    assert mma_end == pytest.approx(100 + (4 * 144 - 100) / 0.125)
    assert dma.end - dma.start == pytest.approx(64 + 16384)


def test_a_timeline_carries_power_and_clock_across_runs(spec):
    # two halves of the governed MMA stream, run back to back on one timeline, take as
    # long as the whole stream in one run: the window and the clock scale carry over
    s = power_profile(spec, 600, 1.0, tcm=False)
    whole = Emulator(s).run(mma_stream(s, 50, dma=False)).counters
    tl = Emulator(s).timeline()
    first = tl.run(mma_stream(s, 25, dma=False)).counters
    second = tl.run(mma_stream(s, 25, dma=False)).counters
    assert first.total_cycles + second.total_cycles == whole.total_cycles == 13400
    assert second.min_clock_scale == pytest.approx(0.5)
    assert second.throttled_cycles == second.total_cycles      # throttled from its start
    # the same second half on a fresh timeline starts at full clock
    fresh = Emulator(s).run(mma_stream(s, 25, dma=False)).counters
    assert fresh.total_cycles < second.total_cycles
    assert tl.counters()["total_cycles"] == whole.total_cycles
    assert tl.counters()["energy_uj"] == pytest.approx(whole.energy_uj)


@pytest.mark.parametrize("m, n, k, accumulate", [(1, 576, 64, False), (40, 200, 64, True),
                                                 (16, 64, 128, False)])
def test_mma_reads_its_operands_once_per_native_tile_row_and_column(spec, m, n, k, accumulate):
    # the native tile is (16, 64, 64): an MMA spanning ceil(m/16) x ceil(n/64) tiles reads
    # a (m, k) once per column of tiles and b (k, n) once per row of tiles, fp16
    b = ProgramBuilder("mma_reads", spec)
    a, w, out = b.tcm((m, k), "float16"), b.tcm((k, n), "float16"), b.tcm((m, n), "float32")
    b.emit(Mma(out=out, a=a, b=w, accumulate=accumulate))
    c = Emulator(spec).run(b.build()).counters
    rows, cols = -(-m // 16), -(-n // 64)
    reads = m * k * 2 * cols + k * n * 2 * rows + (m * n * 4 if accumulate else 0)
    assert (c.tcm_read_bytes, c.tcm_write_bytes) == (reads, m * n * 4)
    assert c.energy_uj_by["tcm"] == pytest.approx(
        (reads * spec.tcm_read_pj_per_byte + m * n * 4 * spec.tcm_write_pj_per_byte) * 1e-6)


def test_w4a16_mma_rereads_packed_weights_scales_and_zeros_per_tile_row(spec):
    # 48 rows = 3 rows of native tiles; b (N, K/2) uint8, scales fp16 and zeros uint8
    # (N, K/32): each read 3 times, a (48, 128) fp16 once (N = 64 is one column)
    m, n, k, g = 48, 64, 128, 32
    b = ProgramBuilder("w4_reads", spec)
    a, q = b.tcm((m, k), "float16"), b.tcm((n, k // 2), "uint8")
    s, z = b.tcm((n, k // g), "float16"), b.tcm((n, k // g), "uint8")
    out = b.tcm((m, n), "float32")
    b.emit(Mma(out=out, a=a, b=q, transpose_b=True, scales=s, zeros=z, group_size=g))
    c = Emulator(spec).run(b.build()).counters
    assert c.tcm_read_bytes == m * k * 2 + 3 * (n * k // 2 + n * (k // g) * 3)
    assert c.tcm_write_bytes == m * n * 4


def test_power_trace_has_no_empty_interval_at_a_rounded_end():
    """``PowerLog.trace`` over a span that is a whole number of steps only up to rounding
    (0.1 * 3 by 0.1): arange then ends a hair short of the end, and appending the end made
    an empty last interval whose power was 0 / 0 (NaN, and a RuntimeWarning in a tune)."""
    from edgetvm.target.emulator.power import PowerLog
    log = PowerLog(150.0)
    log.add(1.0, {"static": 150.0, "units": 900.0, "dram": 0.0, "tcm": 0.0, "host": 0.0},
            900.0)
    starts, power = log.trace(0.0, 0.1 * 3, 0.1)
    assert len(starts) == len(power) == 3
    assert np.allclose(power, 1050.0)
    starts, power = log.trace(0.0, 0.35, 0.1)          # a short last interval stays
    assert np.allclose(np.diff(np.append(starts, 0.35)), [0.1, 0.1, 0.1, 0.05])
    assert np.allclose(power, 1050.0)


def test_throttling_slows_dma_set_up_and_not_host_ops(spec):
    # the model (device.py): compute and DMA set-up progress at the clock scale s, DRAM
    # transfers and host ops do not. A long DMA holds the DRAM over a budget the
    # governor cannot meet beside a stream of MMAs, so it holds the lowest clock; then a
    # small DMA (its set-up stretched by 1 / s, its one-burst transfer not) and a host op
    # (not stretched at all)
    s = power_profile(spec, 151, 1.0, window=100, interval=100, tcm=False)
    b = ProgramBuilder("setup_under_throttle", s)
    b.tensor("w", (4096, 64), "float16", "const", np.ones((4096, 64)))
    b.tensor("x", (1, 32), "float16", "const", np.ones((1, 32)))
    b.tensor("y", (1, 32), "float16", "output")
    big, small = b.tcm((4096, 64), "float16"), b.tcm((1, 32), "float16")
    a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), b.tcm((64, 64), "float32")
    for _ in range(40):             # matrix work throughout: the governor has a unit to slow
        b.emit(Mma(out=out, a=a, b=w))
    e1, e2 = b.event(), b.event()
    b.emit(DmaLoad(dst=big, src=b.dram("w"), signal=(e1,)))
    b.emit(DmaLoad(dst=small, src=b.dram("x"), wait=(e1,), signal=(e2,)))
    b.emit(HostOp(fn="copy", inputs=("x",), outputs=("y",), wait=(e2,), flops=1000))
    r = Emulator(s).run(b.build(), trace=True)
    assert r.counters.min_clock_scale == pytest.approx(MIN_SCALE)
    first, second = [e for e in r.trace if e.unit == "dma0"]
    burst = 64 // s.dram_bytes_per_cycle                        # 64 B: one whole burst
    assert second.end - second.start == pytest.approx(s.dma_setup_cycles / MIN_SCALE + burst)
    (host,) = [e for e in r.trace if e.unit == "host"]
    assert host.end - host.start == pytest.approx(
        s.host_switch_cycles + math.ceil(1000 / s.host_flops_per_cycle))


@pytest.mark.parametrize("exponent", [1.0, 3.0])
def test_governor_holds_the_budget_when_tcm_power_follows_the_clock(spec, exponent):
    """A stream of MMAs draws TCM power about as large as the matrix unit's; their bytes
    per cycle follow the clock, so the governor must count it with what it slows. It
    counted it as fixed (emulator model 3): throttled, that term shrank and the next
    interval ran too fast, then too slow, the windows swinging around the budget (271 /
    1,328 mW under 700). Now every interval after the first draws the budget, at the
    clock that solves static + matrix * s**e + tcm * s = budget."""
    s = power_profile(spec, 700, exponent)
    curve, c = power_curve(s, 1)
    tcm = curve[-1] - s.power_static_mw - s.power_unit_mw["matrix"]       # at full clock
    assert tcm > 0.5 * s.power_unit_mw["matrix"]      # a test of something: TCM matters
    # the clock that meets the budget, written from the definition (numpy's roots)
    e = int(exponent)
    poly = np.zeros(e + 1)                 # matrix * s**e + tcm * s + static - 700
    poly[0] += s.power_unit_mw["matrix"]
    poly[e - 1] += tcm
    poly[e] = s.power_static_mw - 700.0
    roots = np.roots(poly)
    want = max(r.real for r in roots if abs(r.imag) < 1e-9 and 0 < r.real <= 1)
    r = Emulator(s).run(mma_stream(s, 400, dma=False))
    assert r.counters.min_clock_scale == pytest.approx(want, rel=1e-6)
    # the first interval runs at full clock (the governor has seen nothing yet); every
    # whole one after it draws the budget, none over
    per_interval = np.asarray(r.power_mw)
    assert per_interval[0] == pytest.approx(curve[-1], rel=1e-6)
    assert np.allclose(per_interval[1:-1], 700.0, rtol=1e-6)
    # energy: the MMAs' TCM bytes cost the same at any clock
    work = 400 * c
    assert r.counters.energy_uj_by["tcm"] == pytest.approx(tcm * work / s.clock_mhz * 1e-3,
                                                           rel=1e-6)
    # a run that starts throttled (the clock carried on one timeline) never draws its
    # demand, but reports it: units and their TCM traffic at nominal clock
    tl = Emulator(s).timeline()
    tl.run(mma_stream(s, 200, dma=False))
    second = tl.run(mma_stream(s, 200, dma=False)).counters
    assert second.throttled_cycles == second.total_cycles
    assert second.peak_power_mw == pytest.approx(700.0, rel=1e-6)
    assert second.peak_power_demand_mw == pytest.approx(curve[-1], rel=1e-6)
