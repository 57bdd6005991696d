"""Timing model: every expected cycle count is worked out by hand from the spec's figures.

Notation in the comments: D = one DMA alone (setup + its bursts' bytes / bus bytes per
cycle), C = one MMA (issue latency + padded native tiles * tile MACs / MACs per cycle),
S = event_sync_cycles. The 16 MB preset: 64 setup, 32 B/cycle bus, 64 B bursts, 16 issue
cycles, 2048 fp16 MACs/cycle on (16, 64, 64) tiles, S = 8. Transfers on the bus together
share it equally (each k-th of the bandwidth while k are on it).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, DmaStore, Launch, Mma, TcmRef, Vector


def ceil_div(a, b):
    return -(-a // b)


def bus(spec, nbytes):
    """Cycles a contiguous, burst-aligned transfer alone takes on the DRAM bus."""
    bursts = ceil_div(nbytes, spec.dram_burst_bytes)
    return math.ceil(bursts * spec.dram_burst_bytes / spec.dram_bytes_per_cycle)


def dma(spec, nbytes):
    return spec.dma_setup_cycles + bus(spec, nbytes)


def mma(spec, m, n, k, kind="fp16"):
    tm, tn, tk = spec.mma_tile
    tiles = ceil_div(m, tm) * ceil_div(n, tn) * ceil_div(k, tk)
    return spec.mma_issue_cycles + ceil_div(tiles * tm * tn * tk, spec.mma_macs_per_cycle[kind])


def one_load(spec, shape, dtype, channel=0):
    b = ProgramBuilder("load", spec)
    b.tensor("x", shape, dtype, "input")
    b.emit(DmaLoad(dst=b.tcm(shape, dtype), src=b.dram("x"), channel=channel))
    return b


def test_lone_dma_is_setup_plus_bursts_over_bandwidth(spec):
    shape = (3, 11)                      # 132 bytes: 3 bursts of 64
    nbytes = 3 * 11 * 4
    b = one_load(spec, shape, "float32")
    r = Emulator(spec).run(b.build(), {"x": np.ones(shape, np.float32)})
    c = r.counters
    assert c.total_cycles == spec.dma_setup_cycles + 3 * 64 // spec.dram_bytes_per_cycle
    assert c.total_cycles == 64 + 6
    assert c.busy_cycles["dma0"] == c.total_cycles
    assert c.dram_read_bytes == nbytes and c.dram_write_bytes == 0
    assert c.dram_bus_bytes == 192
    assert c.time_us == pytest.approx(c.total_cycles / spec.clock_mhz)


def _column_load(spec, rows, row_stride_elems, col0=0):
    """One fp16 element per row, rows ``row_stride_elems`` apart in DRAM."""
    b = ProgramBuilder("column", spec)
    b.tensor("x", (rows, row_stride_elems), "float16", "input")
    b.emit(DmaLoad(dst=b.tcm((rows, 1), "float16"), src=b.dram("x", col0=col0, cols=1)))
    return b.build(), {"x": np.ones((rows, row_stride_elems), np.float16)}


def test_narrow_strided_transfer_pays_a_burst_per_row(spec):
    # 1024 rows of one fp16 element, 2 KB apart: 1024 bursts (65536 bus bytes), where 2 KB
    # in one piece is 32 bursts
    program, x = _column_load(spec, 1024, 1024)
    c = Emulator(spec).run(program, x).counters
    assert c.dram_read_bytes == 2048 and c.dram_bus_bytes == 1024 * 64
    assert c.total_cycles == spec.dma_setup_cycles + 1024 * 64 // 32 == 64 + 2048
    contiguous = one_load(spec, (1, 1024), "float16").build()
    c1 = Emulator(spec).run(contiguous, {"x": np.ones((1, 1024), np.float16)}).counters
    assert c1.dram_bus_bytes == 2048 and c1.total_cycles == 64 + 64


def test_runs_that_straddle_bursts_pay_for_both(spec):
    # rows of 64 bytes 80 bytes apart: a row starting at byte 80 * r covers bytes
    # [80 r, 80 r + 64): rows 0, 4, 8, ... start on a burst (1 burst), the others straddle
    # two bursts: 4 rows -> 1 + 2 + 2 + 2 = 7 bursts
    b = ProgramBuilder("straddle", spec)
    b.tensor("x", (4, 20), "float32", "input")
    b.emit(DmaLoad(dst=b.tcm((4, 16), "float32"), src=b.dram("x", cols=16)))
    c = Emulator(spec).run(b.build(), {"x": np.ones((4, 20), np.float32)}).counters
    assert c.dram_bus_bytes == 7 * 64 and c.dram_read_bytes == 4 * 64


@pytest.mark.parametrize("preset", ["edge-npu-4mb", "edge-npu-32mb"])
def test_lone_dma_on_other_presets(preset):
    from edgetvm.target.spec import load_spec
    s = load_spec(preset)
    b = one_load(s, (64, 64), "float16")
    c = Emulator(s).run(b.build(), {"x": np.ones((64, 64), np.float16)}).counters
    assert c.total_cycles == s.dma_setup_cycles + 64 * 64 * 2 // s.dram_bytes_per_cycle
    assert c.time_us == pytest.approx(c.total_cycles / s.clock_mhz)


def test_two_channels_share_the_dram_bus(spec):
    b = ProgramBuilder("two_loads", spec)
    b.tensor("x", (64, 64), "float16", "input")
    b.tensor("w", (128, 64), "float16", "input")
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), channel=0))
    b.emit(DmaLoad(dst=b.tcm((128, 64), "float16"), src=b.dram("w"), channel=1))
    r = Emulator(spec).run(b.build(), {"x": np.ones((64, 64), np.float16),
                                       "w": np.ones((128, 64), np.float16)}, trace=True)
    c = r.counters
    bx, bw = bus(spec, 64 * 64 * 2), bus(spec, 128 * 64 * 2)      # 256, 512 alone
    # both channels set up in parallel, then share the bus: x's 8192 bytes at 16 B/cycle
    # take 512 cycles; w then has 8192 left, alone at 32 B/cycle: 256 more
    setup = spec.dma_setup_cycles
    assert [(e.unit, e.start, e.end) for e in r.trace] == [
        ("dma0", 0, setup + 2 * bx), ("dma1", 0, setup + bx + bw)] == [
        ("dma0", 0, 576), ("dma1", 0, 832)]
    assert c.total_cycles == setup + bx + bw
    assert c.stall_cycles["dram_bus"] == (2 * bx - bx) + (bx + bw - bw)     # beyond alone
    assert c.busy_cycles == {"dma0": setup + 2 * bx, "dma1": setup + bx + bw, "matrix": 0,
                             "vector": 0, "host": 0}
    # one channel: the setups serialise as well
    b1 = ProgramBuilder("two_loads_one_channel", spec)
    b1.tensor("x", (64, 64), "float16", "input")
    b1.tensor("w", (128, 64), "float16", "input")
    b1.emit(DmaLoad(dst=b1.tcm((64, 64), "float16"), src=b1.dram("x")))
    b1.emit(DmaLoad(dst=b1.tcm((128, 64), "float16"), src=b1.dram("w")))
    c1 = Emulator(spec).run(b1.build(), {"x": np.ones((64, 64), np.float16),
                                         "w": np.ones((128, 64), np.float16)}).counters
    assert c1.total_cycles == 2 * setup + bx + bw
    assert c1.stall_cycles.get("dram_bus", 0) == 0


def test_a_prefetch_does_not_starve_a_short_load(spec):
    # a 512 KB prefetch and a 1 KB load issued together on the two channels: the bus
    # serves them round robin, so the 1 KB moves at half the bandwidth (64 cycles after
    # set-up) instead of waiting for the whole prefetch (16,384 cycles)
    b = ProgramBuilder("prefetch", spec)
    b.tensor("w", (4096, 64), "float16", "input")       # 512 KiB
    b.tensor("x", (8, 64), "float16", "input")          # 1 KiB
    b.emit(DmaLoad(dst=b.tcm((4096, 64), "float16"), src=b.dram("w"), channel=1))
    b.emit(DmaLoad(dst=b.tcm((8, 64), "float16"), src=b.dram("x"), channel=0))
    r = Emulator(spec).run(b.build(), {"w": np.ones((4096, 64), np.float16),
                                       "x": np.ones((8, 64), np.float16)}, trace=True)
    ev = {e.unit: (e.start, e.end) for e in r.trace}
    assert ev["dma0"] == (0, 64 + 1024 // 16) == (0, 128)       # 96 alone
    assert ev["dma1"] == (0, 64 + (512 * 1024 + 1024) // 32)     # the bus never idles


def test_dma_overlaps_mma(spec):
    """MMA on tile 0 runs while the DMA loads tile 1 (different buffers)."""
    b = ProgramBuilder("overlap", spec)
    b.tensor("A", (64, 128), "float16", "const", np.ones((64, 128)))
    b.tensor("B", (128, 64), "float16", "const", np.ones((128, 64)))
    b.tensor("y", (64, 64), "float32", "output")
    ta = b.tcm((64, 128), "float16")
    t0, t1 = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16")
    out = b.tcm((64, 64), "float32")
    ea, e0, e1, m0, m1 = (b.event() for _ in range(5))
    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=1, signal=(ea,)))
    b.emit(DmaLoad(dst=t0, src=b.dram("B", rows=64), channel=0, signal=(e0,)))
    b.emit(DmaLoad(dst=t1, src=b.dram("B", row0=64, rows=64), channel=0, signal=(e1,)))
    b.emit(Mma(out=out, a=ta.cols(0, 64), b=t0, wait=(ea, e0), signal=(m0,)))
    b.emit(Mma(out=out, a=ta.cols(64, 64), b=t1, accumulate=True, wait=(e1,), signal=(m1,)))
    b.emit(DmaStore(dst=b.dram("y"), src=out, channel=1, wait=(m1,)))
    r = Emulator(spec).run(b.build(), trace=True)
    np.testing.assert_array_equal(r.outputs["y"], np.full((64, 64), 128.0))
    setup, s = spec.dma_setup_cycles, spec.event_sync_cycles
    c = mma(spec, 64, 64, 64)                                   # 16 + 128
    # A (16384 B, dma1) and tile 0 (8192 B, dma0) set up together and share the bus from
    # cycle 64: tile 0 is done after 8192 / 16 = 512 cycles, A has 8192 B left
    t0_end = setup + 8192 // 16                                 # 576
    # dma0 sets tile 1 up (64 cycles) while A has the bus alone: 2048 B more, 6144 left;
    # then they share: A's 6144 B at 16 B/cycle, tile 1 the same, its last 2048 alone
    t1_on_bus = t0_end + setup                                  # 640
    a_end = t1_on_bus + 6144 // 16                              # 1024
    t1_end = a_end + 2048 // 32                                 # 1088
    m0_start = max(a_end, t0_end) + s
    m0_end = m0_start + c
    m1_start = max(m0_end, t1_end + s)
    ev = {(e.unit, e.index): (e.start, e.end) for e in r.trace}
    assert ev[("dma1", 0)] == (0, a_end)
    assert ev[("dma0", 1)] == (0, t0_end)
    assert ev[("dma0", 2)] == (t0_end, t1_end)
    assert ev[("matrix", 3)] == (m0_start, m0_end) == (1032, 1176)
    assert ev[("matrix", 4)] == (m1_start, m1_start + c)
    # the overlap itself: tile 1 is on the bus while the MMA of tile 0 runs
    assert ev[("dma0", 2)][0] < m0_start < ev[("dma0", 2)][1]
    store = dma(spec, 64 * 64 * 4)
    assert r.counters.total_cycles == m1_start + c + s + store == 1904


@pytest.mark.parametrize("bound, m", [("transfer", 64), ("compute", 256)])
def test_double_buffered_loop_reaches_max_of_compute_and_transfer(spec, double_buffered,
                                                                 bound, m):
    steps, kt, n = 8, 64, 64
    prog, inputs, ref = double_buffered(spec, m, steps, kt, n)
    r = Emulator(spec).run(prog, inputs, trace=True)
    np.testing.assert_allclose(r.outputs["y"], ref, rtol=1e-4, atol=1e-3)
    s = spec.event_sync_cycles
    d_a = dma(spec, m * steps * kt * 2)          # A, once, before the first tile
    d = dma(spec, kt * n * 2)                    # one B tile (one channel: no bus sharing)
    c = mma(spec, m, n, kt)
    d_store = dma(spec, m * n * 4)
    if bound == "transfer":
        # DMA k never waits for its buffer's MMA (k-2) when D >= C + 2S: loads run back to
        # back; MMA k starts S after load k ends and ends before load k+1 does.
        assert d >= c + 2 * s and (d, c) == (320, 144)
        prologue, epilogue = d_a, s + c + s + d_store
    else:
        # MMA k starts as MMA k-1 ends when C >= D + 2S: the load of tile k (waiting S after
        # MMA k-2) is done S before MMA k-1 ends.
        assert c >= d + 2 * s and (d, c) == (320, 528)
        prologue, epilogue = d_a + d + s, s + d_store
    assert r.counters.total_cycles == prologue + steps * max(c, d) + epilogue
    # steady state: one MMA every max(C, D) cycles
    starts = [e.start for e in r.trace if e.unit == "matrix"]
    assert np.diff(starts).tolist() == [max(c, d)] * (steps - 1)
    assert r.counters.busy_cycles["matrix"] == steps * c
    assert r.counters.busy_cycles["dma0"] == d_a + steps * d + d_store
    assert r.counters.dram_read_bytes == m * steps * kt * 2 + steps * kt * n * 2
    assert r.counters.dram_write_bytes == m * n * 4


def test_single_buffered_loop_serialises(spec):
    """Reference point: dropping the second buffer makes every step D + S + C + S."""
    steps, m = 4, 64
    b = ProgramBuilder("single_buffered", spec)
    b.tensor("B", (steps * 64, 64), "float16", "const", np.ones((steps * 64, 64)))
    a = b.tcm((m, 64), "float16")
    buf = b.tcm((64, 64), "float16")
    out = b.tcm((m, 64), "float32")
    full, empty = b.event(), b.event()
    for k in range(steps):
        b.emit(DmaLoad(dst=buf, src=b.dram("B", row0=64 * k, rows=64),
                       wait=(empty,) if k else (), signal=(full,)))
        b.emit(Mma(out=out, a=a, b=buf, accumulate=k > 0, wait=(full,), signal=(empty,)))
    c = Emulator(spec).run(b.build()).counters
    d, cm, s = dma(spec, 64 * 64 * 2), mma(spec, m, 64, 64), spec.event_sync_cycles
    assert c.total_cycles == steps * (d + s + cm) + (steps - 1) * s


def chain(spec):
    """DMA -> vector -> DMA, each waiting on the previous one's event."""
    b = ProgramBuilder("chain", spec)
    b.tensor("x", (8, 64), "float32", "input")
    b.tensor("y", (8, 64), "float32", "output")
    t, u = b.tcm((8, 64), "float32"), b.tcm((8, 64), "float32")
    e1, e2 = b.event(), b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), signal=(e1,)))
    b.emit(Vector(op="exp", dst=u, srcs=(t,), wait=(e1,), signal=(e2,)))
    b.emit(DmaStore(dst=b.dram("y"), src=u, channel=1, wait=(e2,)))
    return b.build()


def test_event_sync_cycles(spec):
    d = dma(spec, 8 * 64 * 4)
    v = ceil_div(8 * 64, spec.vector_lanes) * spec.vector_op_cycles["exp"]
    x = {"x": np.zeros((8, 64), np.float32)}
    for sync in (0, spec.event_sync_cycles, 100):
        s2 = spec.replace(event_sync_cycles=sync)
        c = Emulator(s2).run(chain(s2), x).counters
        assert c.total_cycles == d + sync + v + sync + d
        # the vector unit stalls until the load's event arrives; dma1 until the vector op's
        assert c.stall_cycles["wait_dma"] == d + sync
        assert c.stall_cycles["wait_vector"] == d + sync + v + sync


def test_launch_costs_launch_cycles(spec):
    x = {"x": np.zeros((8, 64), np.float32)}
    base = Emulator(spec).run(chain(spec), x).counters.total_cycles
    prog = chain(spec)
    prog.commands.insert(0, Launch(name="k"))
    prog.commands.insert(len(prog.commands) - 1, Launch(name="tail"))
    c = Emulator(spec).run(prog, x).counters
    assert c.launches == 2
    assert c.total_cycles == base + 2 * spec.launch_cycles
    s2 = spec.replace(launch_cycles=1000)
    assert Emulator(s2).run(prog, x).counters.total_cycles == base + 2000


@pytest.mark.parametrize("now, boundary, scale", [
    (10000.0, 10000.0, 1.0), (10000.0 - 1e-12, 10000.0, 1.0), (10000.0 - 5e-10, 10000.0, 1.0),
    # a launch that crosses a boundary throttled, late in a long step: the float step left
    # after the crossing (~1e-8 cycles) is below the clock's resolution at 8.7e7 cycles
    (87179674.69190432, 87180000.0, 0.5)])
def test_a_launch_at_a_dvfs_boundary_terminates(spec, now, boundary, scale):
    # both once made the launch loop spin forever: a clock within _EPS short of a
    # boundary (the governor only acted on a step that crossed it), and a remainder of
    # the launch too small to move the clock
    import signal

    x = {"x": np.zeros((8, 64), np.float32)}
    prog = chain(spec)
    prog.commands.insert(0, Launch(name="k"))
    base = Emulator(spec).run(prog, x).counters.total_cycles
    clock = Emulator(spec).timeline()
    clock.now, clock.next_dvfs, clock.scale = now, boundary, scale
    old = signal.signal(signal.SIGALRM, lambda *a: pytest.fail("the run does not end"))
    signal.alarm(20)
    try:
        c = clock.run(prog, x).counters
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    # the launch's 400 cycles at half clock until the boundary: the step takes longer
    assert base <= c.total_cycles <= base + spec.launch_cycles + 1


def test_busy_and_stall_counters(spec):
    """The smoke GEMM: A on dma0, B on dma1 (sharing the bus), one MMA, store on dma0."""
    b = ProgramBuilder("gemm", spec)
    b.tensor("A", (64, 128), "float16", "input")
    b.tensor("B", (128, 64), "float16", "const", np.ones((128, 64)))
    b.tensor("C", (64, 64), "float32", "output")
    ta, tb = b.tcm((64, 128), "float16"), b.tcm((128, 64), "float16")
    tc = b.tcm((64, 64), "float32")
    e0, e1, e2 = b.event(), b.event(), b.event()
    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=0, signal=(e0,)))
    b.emit(DmaLoad(dst=tb, src=b.dram("B"), channel=1, signal=(e1,)))
    b.emit(Mma(out=tc, a=ta, b=tb, wait=(e0, e1), signal=(e2,)))
    b.emit(DmaStore(dst=b.dram("C"), src=tc, wait=(e2,)))
    c = Emulator(spec).run(b.build(), {"A": np.ones((64, 128), np.float16)}).counters
    setup, s = spec.dma_setup_cycles, spec.event_sync_cycles
    ba, bb, bc = bus(spec, 64 * 128 * 2), bus(spec, 128 * 64 * 2), bus(spec, 64 * 64 * 4)
    cm = mma(spec, 64, 64, 128)                                 # 16 + 8 tiles * 32
    # A and B (16384 B each) share the bus from cycle 64: both end at 64 + 32768 / 32
    a_end = b_end = setup + ba + bb
    m_start = b_end + s
    st_start = m_start + cm + s
    assert c.busy_cycles == {"dma0": a_end + setup + bc, "dma1": b_end, "matrix": cm,
                             "vector": 0, "host": 0}
    # matrix idles from 0 until the loads' events; dma0 from the end of A until the MMA's
    # event; each load took twice as long on the bus as it would alone
    assert c.stall_cycles == {"dram_bus": ba + bb, "wait_dma": m_start,
                              "wait_matrix": st_start - a_end}
    assert c.total_cycles == st_start + setup + bc == 1952
    assert c.macs == 64 * 64 * 128
    assert (c.dram_read_bytes, c.dram_write_bytes) == (64 * 128 * 2 * 2, 64 * 64 * 4)
    assert c.tcm_high_water_bytes == tc.end == 64 * 128 * 2 * 2 + 64 * 64 * 4


def test_tcm_high_water_is_the_highest_byte_touched(spec):
    b = ProgramBuilder("high_water", spec)
    b.tensor("x", (4, 64), "float32", "input")
    b.tensor("y", (4, 64), "float32", "output")
    lo = TcmRef(0, (4, 64), "float32")
    hi = TcmRef(100_032, (4, 64), "float32", row_stride=80)   # strided: ends mid-row-stride
    e1, e2 = b.event(), b.event()
    b.emit(DmaLoad(dst=lo, src=b.dram("x"), signal=(e1,)))
    b.emit(Vector(op="copy", dst=hi, srcs=(lo,), wait=(e1,), signal=(e2,)))
    b.emit(DmaStore(dst=b.dram("y"), src=hi, wait=(e2,)))
    p = b.build(tcm_bytes=1 << 20)   # declared footprint larger than what is touched
    c = Emulator(spec).run(p, {"x": np.zeros((4, 64), np.float32)}).counters
    assert c.tcm_high_water_bytes == hi.end == 100_032 + (3 * 80 + 64) * 4


def test_dram_bytes_count_only_moved_rows_and_both_directions(spec):
    b = ProgramBuilder("bytes", spec)
    n = b.param("n")
    b.tensor("x", (16, 64), "float16", "input")
    b.tensor("y", (16, 64), "float16", "output")
    t = b.tcm((16, 64), "float16")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), valid_rows=n, signal=(e,)))
    b.emit(DmaStore(dst=b.dram("y"), src=t, valid_rows=n + 2, wait=(e,)))
    c = Emulator(spec).run(b.build(), {"x": np.ones((16, 64), np.float16)}, {"n": 5}).counters
    assert (c.dram_read_bytes, c.dram_write_bytes) == (5 * 128, 7 * 128)
    assert c.total_cycles == dma(spec, 5 * 128) + spec.event_sync_cycles + dma(spec, 7 * 128)


def test_vector_ops_cost_lane_passes_per_row(spec):
    # a (576, 1) column: one element per row, 576 passes (not 576 / 64 = 9)
    b = ProgramBuilder("column_op", spec)
    b.tensor("x", (576, 1), "float32", "input")
    t, u = b.tcm((576, 1), "float32"), b.tcm((576, 1), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), signal=(e,)))
    b.emit(Vector(op="exp", dst=u, srcs=(t,), wait=(e,)))
    c = Emulator(spec).run(b.build(), {"x": np.zeros((576, 1), np.float32)}).counters
    assert c.busy_cycles["vector"] == 576 * spec.vector_op_cycles["exp"]


def test_every_mma_pays_its_issue_latency(spec):
    # 64 MMAs of one native tile each: 64 * (16 + 32), not 64 * 32
    b = ProgramBuilder("tiny_mmas", spec)
    a, w = b.tcm((16, 64), "float16"), b.tcm((64, 64), "float16")
    out = b.tcm((16, 64), "float32")
    for k in range(64):
        b.emit(Mma(out=out, a=a, b=w, accumulate=k > 0))
    c = Emulator(spec).run(b.build()).counters
    assert c.busy_cycles["matrix"] == 64 * (spec.mma_issue_cycles + 32) == c.total_cycles


@pytest.mark.parametrize("offset, rows, row_bytes, stride", [
    (32, 1, 64, 64), (16, 3, 64, 64), (0, 1, 64, 64), (63, 1, 2, 2),   # contiguous
    (8, 4, 40, 128), (100, 3, 20, 64),                                 # strided
    (10, 5, 30, 70), (0, 6, 64, 96), (50, 7, 1, 33),                   # stride not a burst multiple
])
def test_dram_bursts_counts_every_burst_a_transfer_touches(offset, rows, row_bytes, stride):
    # the bus moves whole bursts: a transfer that starts or ends inside a burst moves it
    # all (a contiguous 64 B at offset 32 of 64 B bursts is 2 bursts); reference: the set
    # of burst indices the bytes fall in, counted row by row from the definition
    from edgetvm.target.emulator.costs import dram_bursts
    burst = 64
    want = sum(len({b // burst for b in range(offset + r * stride,
                                              offset + r * stride + row_bytes)})
               for r in range(rows))
    if stride == row_bytes:       # one run: rows share the bursts at their seams
        want = len({b // burst for b in range(offset, offset + rows * row_bytes)})
    assert dram_bursts(offset, rows, row_bytes, stride, burst) == want
