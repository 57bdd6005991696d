"""benchmarks/prior_quality.py on the tiny Llama: every point of a small space measured,
the prior's ranking reported, and its numerics checks fire."""
import json
import pathlib

from bench_helpers import load_benchmark

REPO = pathlib.Path(__file__).resolve().parents[2]
LLAMA = str(REPO / "tests" / "data" / "llama_tiny_with_past.onnx")
ARGS = ["--model", LLAMA, "--prefill", "16", "--max-tokens", "64"]


def test_prior_quality_measures_whole_spaces_and_reports_the_ranking(tmp_path, capsys,
                                                                      monkeypatch):
    bench = load_benchmark(monkeypatch, "prior_quality")
    out = tmp_path / "pq.json"
    assert bench.main(ARGS + ["--points", "64", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["errors"] == []
    rows = {r["role"]: r for r in data["rows"]}
    assert set(rows) == {"prefill attention", "decode attention"}
    for r in rows.values():
        # spaces of at most 64 points are measured whole
        assert r["space"] <= 64
        assert r["measured"] + r["rejected"] + r["stopped"] + len(r["failed"]) == r["space"]
        assert r["measured"] >= 16 and r["failed"] == []
        assert 1 <= r["best_prior_rank"] <= r["measured"]
        assert r["best_cycles"] <= r["default_cycles"]
        assert 1.0 <= r["top8_vs_best"] <= r["top1_vs_best"]
        # the attention prior orders the tiny model's points (a constant or inverted
        # prior would give about 0 or below)
        assert r["spearman"] > 0.7, r
    assert "prior rank of best" in capsys.readouterr().out


def test_prior_quality_fails_when_the_defaults_prior_is_not_zero(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "prior_quality")
    monkeypatch.setattr(bench, "prior", lambda task, knobs, spec, profile=None: 0.25)
    assert bench.main(ARGS + ["--quick", "--roles", "decode attention"]) == 1
    assert "the defaults' prior is not 0" in capsys.readouterr().out
