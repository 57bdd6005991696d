"""Chrome-trace export: one X event per executed command on its unit's track, power counter."""
from __future__ import annotations

import json

import numpy as np

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator, chrome_trace, write_chrome_trace
from edgetvm.target.isa import DmaLoad, DmaStore, EventSignal, Launch, Mma, Vector


def program(spec):
    b = ProgramBuilder("traced", spec)
    on = b.param("on")
    b.tensor("a", (16, 64), "float16", "const", np.ones((16, 64)))
    b.tensor("w", (64, 64), "float16", "const", np.ones((64, 64)))
    b.tensor("y", (16, 64), "float32", "output")
    ta, tw, out = b.tcm((16, 64), "float16"), b.tcm((64, 64), "float16"), \
        b.tcm((16, 64), "float32")
    e = [b.event() for _ in range(5)]
    b.emit(DmaLoad(dst=ta, src=b.dram("a"), channel=0, signal=(e[0],)))       # 0 dma0
    b.emit(DmaLoad(dst=tw, src=b.dram("w"), channel=1, signal=(e[1],)))       # 1 dma1
    b.emit(Mma(out=out, a=ta, b=tw, wait=(e[0], e[1]), signal=(e[2],)))       # 2 matrix
    b.emit(Vector(op="mul", dst=out, srcs=(out,), imm=0.5, wait=(e[2],),      # 3 vector
                  signal=(e[3],)))
    b.emit(Vector(op="exp", dst=out, srcs=(out,), when=on))                   # 4 vector, skipped
    b.emit(EventSignal(on="vector", signal=(e[4],)))                          # 5 no time
    b.emit(Launch(name="store", keep_tcm=True))                               # 6 control
    b.emit(DmaStore(dst=b.dram("y"), src=out, channel=0))                     # 7 dma0
    return b.build()


def test_chrome_trace_has_one_event_per_executed_command(spec):
    s = spec.replace(dvfs_interval_cycles=500)
    r = Emulator(s).run(program(s), params={"on": 0}, trace=True)
    np.testing.assert_array_equal(r.outputs["y"], np.full((16, 64), 32.0))
    t = chrome_trace(r, s)
    xs = [ev for ev in t["traceEvents"] if ev["ph"] == "X"]
    assert [ev["args"]["command"] for ev in xs] == [0, 1, 2, 3, 6, 7]
    names = {ev["tid"]: ev["args"]["name"] for ev in t["traceEvents"]
             if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert [(names[ev["tid"]], ev["name"]) for ev in xs] == [
        ("dma0", "DmaLoad"), ("dma1", "DmaLoad"), ("matrix", "Mma"), ("vector", "Vector.mul"),
        ("control", "Launch store"), ("dma0", "DmaStore")]
    # tracks in unit order: control, DMA channels, matrix, vector
    assert [names[k] for k in sorted(names)] == ["control", "dma0", "dma1", "matrix", "vector"]
    # times in microseconds at the spec's clock, matching the run's trace (cycles)
    for ev, te in zip(xs, r.trace):
        assert ev["ts"] == te.start / s.clock_mhz
        assert ev["dur"] == (te.end - te.start) / s.clock_mhz
        assert ev["args"]["start_cycle"] == te.start
    assert xs[-1]["ts"] + xs[-1]["dur"] == r.counters.total_cycles / s.clock_mhz
    launch = xs[4]
    assert launch["dur"] == s.launch_cycles / s.clock_mhz
    counters = [ev for ev in t["traceEvents"] if ev["ph"] == "C"]
    windows = -(-r.counters.total_cycles // s.dvfs_interval_cycles)   # one per interval
    assert len(counters) == windows == len(r.power_mw)
    assert [c["args"]["mW"] for c in counters] == r.power_mw.tolist()
    assert [c["ts"] for c in counters] == [k * 500 / s.clock_mhz for k in range(windows)]
    assert t["otherData"]["counters"]["total_cycles"] == r.counters.total_cycles


def test_write_chrome_trace_writes_valid_json(spec, tmp_path):
    r = Emulator(spec).run(program(spec), params={"on": 1}, trace=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(r, spec, str(path))
    t = json.loads(path.read_text())
    assert t["displayTimeUnit"] == "ns" and t["otherData"]["spec"] == "edge-npu-16mb"
    xs = [ev for ev in t["traceEvents"] if ev["ph"] == "X"]
    assert len(xs) == 7                      # the exp runs this time
    assert all(ev["dur"] > 0 and ev["pid"] == 1 for ev in xs)


def test_no_trace_unless_asked(spec):
    r = Emulator(spec).run(program(spec), params={"on": 1})
    assert r.trace == []
