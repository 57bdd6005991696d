"""benchmarks/phase_breakdown.py on the bundled example: each kernel's time and unit work
attributed to its own kind, the step's time accounted for, numerics checked."""
import json

from bench_helpers import load_benchmark


def test_phase_breakdown_attributes_each_kernels_work_to_it(tmp_path, monkeypatch):
    bench = load_benchmark(monkeypatch, "phase_breakdown")
    out = tmp_path / "pb.json"
    assert bench.main(["--quick", "--no-budget", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    budget, free = data["rows"]
    assert (budget["run"], free["run"]) == ("budget", "no budget")
    assert free["throttled_cycles"] == 0 and free["numerics_ok"] and budget["numerics_ok"]
    for row in (budget, free):
        kinds = {k["kind"]: k for k in row["kinds"]}
        # every cycle of the step is some kernel's (from the first command on)
        assert abs(sum(k["wall"] for k in row["kinds"]) - row["cycles"]) <= len(kinds)
        # attention computes on both units, once in each of the two layers; the new K
        # and V go into the pages from the kernels that make them (no append kernel)
        attention = kinds["L#.attention"]
        assert attention["kernels"] == 2
        assert attention["busy"]["matrix"] > 0 and attention["busy"]["vector"] > 0
        assert not any("kv_append" in k for k in kinds)
        # a kernel's units are busy only while it runs, at most its wall per unit
        for k in row["kinds"]:
            for unit, cycles in k["busy"].items():
                if unit != "control":
                    assert cycles <= k["wall"] * 1.05 + 100, (k["kind"], unit)


def test_the_benchmarks_measure_a_whole_program_as_a_build_links_it(monkeypatch):
    """``strategies.Bench.programs`` (which ``tuning.py`` and ``phase_breakdown.py`` run)
    links a replayed log's whole program as ``edgetvm.build`` does: with the strategy's
    partition and default knobs where the log measured that faster (before, it linked
    the tuned kernels anyway, and ``tuning.py`` reported a program no build makes), and
    with the prefetch placement the log chose."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.tune.cli import DEFAULT_MODEL
    from edgetvm.tune.log import Replay, log_context
    st = load_benchmark(monkeypatch, "strategies")
    bench = st.Bench(DEFAULT_MODEL, None, ["performance"])
    log = str(st.REPO / "tuning_logs" / "llama_tiny_with_past")
    replay = Replay(log, log_context(DEFAULT_MODEL, bench.mc.spec, None, None))
    key = ("prefill", 64, 4)
    built = {}
    for defaults in (False, True):
        opts = dict(replay.compiler_options, spread_for=lambda name, ident: False,
                    defaults_for=lambda name, ident, d=defaults: d and name == "prefill_64x4p")
        bench.mc = ModelCompiler(DEFAULT_MODEL, bench.mc.spec, max_tokens=st.MAX_TOKENS,
                                 max_rows=512, strategy="regions", **opts)
        program = bench.programs("model", *key, "regions", "performance")[0]
        linked = bench.mc.program(*key, keep=False)              # (another name)
        assert program.commands == linked.commands, defaults
        assert program.metadata["kernels"] == linked.metadata["kernels"], defaults
        built[defaults] = program
    assert built[False].commands != built[True].commands
    assert len(built[True].metadata["kernels"]) > len(built[False].metadata["kernels"])
