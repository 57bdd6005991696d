"""benchmarks/strategies.py's energy bound: the cycles a run's measured energy takes at a
profile's budget. Checked on a real run of the tiny Llama's prefill program against the
emulator's own average power and peak windows (a unit slip of mW/uJ/ms, or static power
counted on the wrong side, breaks one of the two)."""
import dataclasses
import pathlib

import numpy as np
import pytest

from bench_helpers import load_benchmark
from edgetvm.build.compiler import ModelCompiler
from edgetvm.target.emulator import Emulator

LLAMA = str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" /
            "llama_tiny_with_past.onnx")


def _with_budget(spec, profile, budget_mw):
    profiles = dict(spec.power_profiles)
    profiles[profile] = dataclasses.replace(profiles[profile], budget_mw=budget_mw)
    return dataclasses.replace(spec, power_profiles=profiles)


@pytest.fixture(scope="module")
def prefill_run():
    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=32, strategy="local")
    key = next(k for k in mc.phase_keys((32,)) if k[0] == "prefill" and k[1] == 32)
    program = mc.program(*key)
    rng = np.random.default_rng(0)
    inputs = {n: (rng.integers(0, 100, t.shape) if "int" in t.dtype
                  else rng.standard_normal(t.shape) * 0.1).astype(t.dtype)
              for n, t in program.tensors.items() if t.kind == "input"}
    params = {k: 0 for k in program.params}
    params.update({k: int(k.split(".")[1]) for k in program.params
                   if k.startswith(("page_table.", "dst_page."))})
    params.update({k: v for k, v in dict(pos=0, valid_len=32, last_row=31).items()
                   if k in program.params})
    # the budget lifted: the run is not throttled, its draw is what the program asks for
    spec = _with_budget(mc.spec, "performance", 1e9)
    return spec, Emulator(spec, "performance").run(program, inputs, params).counters


def test_energy_bound_equals_the_run_at_its_own_average_power(prefill_run, monkeypatch):
    st = load_benchmark(monkeypatch, "strategies")
    spec, c = prefill_run
    assert c.avg_power_mw > spec.power_static_mw
    at_avg = _with_budget(spec, "performance", c.avg_power_mw)
    assert st.energy_bound(at_avg, c, "performance") == pytest.approx(c.total_cycles,
                                                                        rel=1e-3)


def test_energy_bound_is_below_a_run_within_its_budget(prefill_run, monkeypatch):
    st = load_benchmark(monkeypatch, "strategies")
    spec, c = prefill_run
    # a budget at the run's peak window: every window within it, so its average too
    at_peak = _with_budget(spec, "performance", c.peak_power_mw)
    bound = st.energy_bound(at_peak, c, "performance")
    assert 0 < bound <= c.total_cycles
    # twice the budget above static halves the bound
    twice = _with_budget(spec, "performance", 2 * c.peak_power_mw - spec.power_static_mw)
    assert st.energy_bound(twice, c, "performance") == pytest.approx(bound / 2, rel=1e-9)
