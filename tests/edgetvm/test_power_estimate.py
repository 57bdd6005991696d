"""The cost model's power estimate (``edgetvm/tune/cost_model.py``: ``power_estimate``)
against the emulator: the clock the governor holds and the latency it leaves a kernel,
for a compute-bound stream of MMAs and a bandwidth-bound stream of DMAs. The estimate is
a prior (the trees learn what it misses), so it is held to a few per cent of what the
emulator measures, not to its exact cycles."""
from __future__ import annotations

import math
import pathlib

import numpy as np
import pytest

import edgetvm.tune.tuner as tuner_module
from edgetvm.build.compiler import ModelCompiler
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.emulator.power import MIN_SCALE
from edgetvm.target.isa import DmaLoad, Mma
from edgetvm.target.spec import PowerProfile, load_spec
from edgetvm.tune.cost_model import power_estimate
from edgetvm.tune.log import TuningLog, log_context
from edgetvm.tune.tasks import extract_tasks
from edgetvm.tune.tuner import Tuner

LLAMA = str(pathlib.Path(__file__).resolve().parents[1] / "data" / "llama_tiny_with_past.onnx")


@pytest.fixture(scope="module")
def spec():
    return load_spec("edge-npu-16mb")


def with_budget(spec, budget_mw, exponent):
    p = PowerProfile("test", budget_mw, exponent)
    return spec.replace(power_profiles={"test": p}, default_profile="test"), p


def mma_cycles(spec, m, n, k):
    """One fp16 MMA's cycles, from the preset's definition: whole native tiles at the
    array's MACs per cycle, plus its issue."""
    tm, tn, tk = spec.mma_tile
    tiles = math.ceil(m / tm) * math.ceil(n / tn) * math.ceil(k / tk)
    return spec.mma_issue_cycles + math.ceil(tiles * tm * tn * tk / spec.mma_macs_per_cycle["fp16"])


def gemm_stream(spec, n_mma, k=576):
    """``n_mma`` back-to-back (64, 64, k) MMAs (a GEMM's inner loop: the weights' K tiles),
    no DMA."""
    b = ProgramBuilder("gemm", spec)
    a, w, out = b.tcm((64, k), "float16"), b.tcm((k, 64), "float16"), b.tcm((64, 64), "float32")
    for _ in range(n_mma):
        b.emit(Mma(out=out, a=a, b=w))
    return b.build()


def dma_stream(spec, n_dma, rows=2048):
    """``n_dma`` loads of ``rows`` x 64 fp16 (256 KiB), alternating the two channels, each
    into its own buffer, beside one small MMA per load: a bandwidth-bound kernel."""
    b = ProgramBuilder("gemv", spec)
    b.tensor("w", (rows, 64), "float16", "const", np.ones((rows, 64)))
    a, w, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), b.tcm((64, 64), "float32")
    for i in range(n_dma):
        b.emit(DmaLoad(dst=b.tcm((rows, 64), "float16"), src=b.dram("w"), channel=i % 2))
        b.emit(Mma(out=out, a=a, b=w))
    return b.build()


@pytest.mark.parametrize("exponent", [1.0, 3.0])
def test_a_compute_bound_kernel_is_throttled_as_the_emulator_throttles_it(spec, exponent):
    s, profile = with_budget(spec, 700.0, exponent)
    n, c = 400, mma_cycles(spec, 64, 64, 576)
    est = dict(mma=n * c, vec=0.0, wdma=0.0, act=0.0, overlap=n * c)
    got = power_estimate(est, s, profile)
    r = Emulator(s).run(gemm_stream(s, n)).counters
    # a test of something: the budget binds, well above the floor
    assert r.throttled_cycles > 0.9 * r.total_cycles and r.min_clock_scale > 2 * MIN_SCALE
    assert got["scale"] == pytest.approx(r.min_clock_scale, rel=0.05)
    assert got["latency"] == pytest.approx(r.total_cycles, rel=0.05)
    # what it draws at nominal clock: the matrix unit and its TCM reads (a large part)
    assert got["tcm_mw"] > 0.5 * got["units_mw"]
    assert got["total_mw"] == pytest.approx(r.peak_power_demand_mw, rel=0.05)


def test_a_kernel_within_its_budget_keeps_the_clock(spec):
    s, profile = with_budget(spec, 2500.0, 1.0)
    n, c = 100, mma_cycles(spec, 64, 64, 576)
    est = dict(mma=n * c, vec=0.0, wdma=0.0, act=0.0, overlap=n * c)
    got = power_estimate(est, s, profile)
    r = Emulator(s).run(gemm_stream(s, n)).counters
    assert r.throttled_cycles == 0
    assert (got["scale"], got["latency"]) == (1.0, n * c)


@pytest.mark.parametrize("exponent", [1.0, 3.0])
def test_a_bandwidth_bound_kernel_loses_little_at_the_floor(spec, exponent):
    """DRAM power alone breaks 700 mW, so the governor holds the floor; the DMAs keep
    their rate and the small MMAs, 8x slower, still hide under them: the kernel takes
    about what it takes at full clock. Stretching the whole kernel by the clock (what a
    compute-bound model says) would be 8x off."""
    s, profile = with_budget(spec, 700.0, exponent)
    n, rows = 16, 2048
    transfer = rows * 64 * 2 / s.dram_bytes_per_cycle
    c = mma_cycles(spec, 64, 64, 64)
    wdma = n * (transfer + s.dma_setup_cycles)
    est = dict(mma=n * c, vec=0.0, wdma=wdma, act=0.0, overlap=wdma + c)
    got = power_estimate(est, s, profile)
    r = Emulator(s).run(dma_stream(s, n, rows)).counters
    assert r.min_clock_scale == MIN_SCALE
    assert got["scale"] == MIN_SCALE
    assert got["latency"] == pytest.approx(r.total_cycles, rel=0.05)
    assert got["dram_mw"] > 700.0


def test_the_tuner_ranks_and_trains_its_model_under_its_profile(tmp_path, monkeypatch):
    """Every feature row the tuner computes (the pool it ranks, the measurements it trains
    on) is under the tune's power profile: a row without it would estimate an unthrottled
    kernel and rank for the wrong device."""
    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16, profile="low-battery")
    tasks = [t for t in extract_tasks(mc, mc.phase_keys((8,)))
             if t.kind == "cluster" and t.shape.get("matmuls")][:2]
    seen = []
    real = tuner_module.features

    def spy(task, knobs, spec, profile=None):
        seen.append(profile)
        return real(task, knobs, spec, profile)

    monkeypatch.setattr(tuner_module, "features", spy)
    ctx = log_context(LLAMA, mc.spec, "low-battery", None)
    with TuningLog(str(tmp_path / "log")) as tlog:
        Tuner(mc, tasks, tlog, ctx, progress=False, seed=0).run(trials=24)
    assert len(seen) > 24          # ranked pools and the measurements trained on
    assert {p.name if p else None for p in seen} == {"low-battery"}
