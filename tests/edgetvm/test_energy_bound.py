"""benchmarks/strategies.py's energy bound: the cycles a run's measured energy takes at a
profile's budget. Checked on a real run of the tiny Llama's prefill program against the
emulator's own average power and peak windows (a unit slip of mW/uJ/ms, or static power
counted on the wrong side, breaks one of the two)."""
import dataclasses
import pathlib

import pytest

from bench_helpers import load_benchmark
from edgetvm.build.compiler import ModelCompiler
from edgetvm.runtime.model import ModelInfo, ModelRunner
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
    keys = mc.phase_keys((32,))
    key = next(k for k in keys if k[0] == "prefill" and k[1] == 32)
    program = mc.program(*key)
    g = mc.graph(*key)
    info = ModelInfo(g.layers, g.kv_heads, g.head_dim, mc.page_tokens, mc.max_tokens,
                     int(g.tensors["logits"].shape[-1]))
    runner = ModelRunner({key: program}, keys, info, None)
    params = runner.params_for(program, key, list(range(1, 33)), 0)    # a 32-token prompt
    # the budget lifted: the run is not throttled, its draw is what the program asks for
    spec = _with_budget(mc.spec, "performance", 1e9)
    return spec, Emulator(spec, "performance").run(program, {}, params).counters


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
