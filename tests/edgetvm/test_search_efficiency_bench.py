"""benchmarks/search_efficiency.py in a tiny configuration: the tiny Llama, a few trials,
one seed; its curves, trial counts and checks hold together."""
import json
import math
import pathlib

from bench_helpers import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[2]
LLAMA = str(REPO / "tests" / "data" / "llama_tiny_with_past.onnx")


def _benchmark_main(monkeypatch):
    return load_benchmark(monkeypatch, "search_efficiency")


def test_search_efficiency_benchmark_on_the_tiny_llama(tmp_path, capsys, monkeypatch):
    bench = _benchmark_main(monkeypatch)
    out_json = tmp_path / "se.json"
    trials = 10
    assert bench.main(["--model", LLAMA, "--prefill", "16", "--max-tokens", "64",
                       "--trials", str(trials), "--seeds", "1", "--timeout", "0",
                       "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "partition" in out and "goal: model/random <= 0.2x" in out
    data = json.loads(out_json.read_text())
    assert data["errors"] == []
    rows = {r["role"]: r for r in data["rows"]}
    assert set(rows) == set(bench.ROLES)
    kinds = {role: rows[role]["kind"] for role in bench.ROLES}
    assert kinds == {"decode GEMV chain": "cluster", "prefill MLP cluster": "cluster",
                     "prefill attention": "prefill_attention",
                     "decode attention": "decode_attention", "partition": "partition"}
    for role, kind in kinds.items():
        r = rows[role]
        assert 0 < r["best_cycles"] <= r["default_cycles"]
        bests = []
        assert set(r["runs"]) == {"model", "random", "warm"} and r["sister"]
        assert r["warm"]["learned"][0] >= 1        # the sister's measured trials
        for method in ("model", "random", "warm"):
            (run,) = r["runs"][method]
            curve = run["curve"]
            # one point per measured trial, up to the budget (a small space runs out)
            assert len(curve) == run["trials"] <= trials
            assert len(curve) == min(trials, r["space"])
            assert curve[0] == run["default_cycles"] == r["default_cycles"]
            assert all(b <= a for a, b in zip(curve, curve[1:]))
            assert curve[-1] == run["best_cycles"] == run["remeasured_cycles"]
            bests.append(run["best_cycles"])
            (n,) = r["warm"]["trials_to_5pct"] if method == "warm" else \
                r["trials_to_5pct"][method]
            assert n == bench.trials_to(curve, 1.05 * r["best_cycles"])
            # None: this method never came within 5 % of the other's best in 10 trials
            assert n is None or 1 <= n <= len(curve)
            assert n is not None or run["best_cycles"] > 1.05 * r["best_cycles"]
        assert r["best_cycles"] == min(bests)
        assert min(r["trials_to_5pct"]["model"][0] or 99, r["warm"]["trials_to_5pct"][0]
                   or 99, r["trials_to_5pct"]["random"][0] or 99) <= trials  # the best's
        if r["default_cycles"] <= 1.05 * r["best_cycles"]:      # nothing to search
            assert r["goal_met"] is None and r["trials_to_5pct"] == {"model": [1],
                                                                     "random": [1]}


def test_trials_to_and_medians(monkeypatch):
    bench = _benchmark_main(monkeypatch)
    curve = [100, 100, 90, 80, 80]
    assert bench.trials_to(curve, 84.0) == 4
    assert bench.trials_to(curve, 100) == 1
    assert bench.trials_to(curve, 79) is None
    assert bench.median_trials([3, None, 5]) == 5            # never counts as infinity
    assert math.isinf(bench.median_trials([None, None, 5]))


def test_one_by_one_hands_each_candidate_and_the_stop_limit_to_its_measurer(monkeypatch):
    """With ``--timeout`` the benchmark measures through ``OneByOne``; the tuner passes it
    the 4x stop limit (``slow_after``), which must reach the inner measurer."""
    bench = _benchmark_main(monkeypatch)
    calls = []

    class Inner:
        def measure(self, task, batch, slow_after=None):
            calls.append((list(batch), slow_after))
            return [("m", kn) for kn in batch]

        def close(self):
            calls.append("closed")

    m = bench.OneByOne(Inner())
    assert m.measure("t", [1, 2], slow_after=40) == [("m", 1), ("m", 2)]
    m.close()
    assert calls == [([1], 40), ([2], 40), "closed"]
