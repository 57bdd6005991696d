"""The tuner end to end on the tiny Llama: knob overrides, tasks, measurement, resume,
failed and rejected trials, the cost model, replay into byte-identical artifacts whose
kernels measure what the log says."""
import dataclasses
import json
import math
import pathlib
import zipfile

import numpy as np
import pytest

from edgetvm.build.cli import build
from edgetvm.build.cli import main as build_main
from edgetvm.build.compiler import ModelCompiler
from edgetvm.build.graph import BuildError
from edgetvm.errors import CandidateRejected, EdgeTVMError
from edgetvm.relax_passes import QuantizeW4A16
from edgetvm.target.emulator import Emulator
from edgetvm.target.spec import load_spec, spec_from_dict
from edgetvm.tune.cli import select_keys, tune
from edgetvm.tune.cli import main as tune_main
from edgetvm.tune.cost_model import (FEATURES, PRIOR, CostModel, attention_estimate,
                                     cluster_estimate, features, prior)
from edgetvm.tune.log import (FAILED, OK, REJECTED, Replay, TuningLog, canonical_knobs,
                              log_context, workload_hash)
from edgetvm.build.measure import measure_kernel
from edgetvm.tune.measure import measure_candidate
from edgetvm.tune.tasks import extract_tasks
from edgetvm.tune.tuner import Tuner, format_report
from tune_helpers import logged_tasks

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
LLAMA = str(DATA / "llama_tiny_with_past.onnx")
SMALL = dict(buckets=(8, 16), max_tokens=64)


@pytest.fixture(scope="module")
def mc():
    return ModelCompiler(LLAMA, max_tokens=64, max_rows=16)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tl") / "log")
    rep = tune(LLAMA, **SMALL, trials=150, log_dir=d, progress=False, seed=1)
    return d, rep


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    """A tune whose tiles stall (stall=16 on the decode programs of the tiny model), so
    its budget goes to several rounds of cuts, then tiles."""
    d = str(tmp_path_factory.mktemp("rounds") / "log")
    rep = tune(LLAMA, buckets=(8,), max_tokens=16, phases=["decode"], trials=200,
               log_dir=d, progress=False, seed=3, stall=16)
    return d, rep


def _mlp(mc, phase=("prefill", 16, 1)):
    g = mc.graph(*phase)
    for grp in mc.partition(g):
        if g.ops[grp[0]].kind == "stage" and len(grp) == 4:
            return g, grp
    raise AssertionError("no MLP cluster")


def test_knob_overrides_lower_the_given_knobs_on_the_build_path(mc):
    g, grp = _mlp(mc)
    default = mc.kernels.kernel(g, grp)
    knobs = json.loads(json.dumps(default.knobs))
    knobs["tile_m"] = 4
    knobs["matmul"]["s3"]["tile_k"] = 32
    k = mc.kernels.kernel(g, grp, knobs=knobs)
    assert k.knobs == knobs and k.key == default.key
    assert k.program.commands != default.program.commands
    # knobs_for: the same kernel through a builder that replays them
    from edgetvm.build.kernels import KernelBuilder
    kb = KernelBuilder(mc.spec, mc.layout, knobs_for=lambda key: knobs if key == k.key else None)
    again = kb.kernel(g, grp)
    assert again.knobs == knobs and again.program.commands == k.program.commands
    # attention knobs too; a tile the template refuses is a rejected candidate
    att = [grp for grp in mc.partition(g) if g.ops[grp[0]].kind == "attention"][0]
    a = mc.kernels.kernel(g, att, knobs=dict(tile_q=8, tile_kv=16, slots_kv=1, slots_s=2))
    assert a.knobs["tile_q"] == 8
    with pytest.raises(CandidateRejected, match="tile_kv"):
        mc.kernels.kernel(g, att, knobs=dict(tile_q=8, tile_kv=24, slots_kv=1, slots_s=1))


def test_knobs_set_after_the_first_graph_still_reach_every_kernel(mc):
    """``build --log`` sets the replay on a compiler that has built a graph already (the
    capacity probe of a default KV capacity builds the largest decode graph in the
    constructor): the replayed knobs must reach the kernels all the same."""
    g, grp = _mlp(mc)
    default = mc.kernels.kernel(g, grp)
    knobs = json.loads(json.dumps(default.knobs))
    knobs["tile_m"] = 4
    fresh = ModelCompiler(LLAMA, max_rows=16)            # default capacity: probes a graph
    assert fresh.layout is not None
    key = default.key
    asked = []
    fresh.knobs_for = lambda k: asked.append(k) or (knobs if k == key else None)
    g2 = fresh.graph("prefill", 16, 1)
    k = fresh.kernels.kernel(g2, grp)
    assert asked and k.knobs == knobs


def test_knobs_over_the_tcm_are_rejected_and_replayed_ones_refused():
    d = load_spec("edge-npu-16mb").to_dict()
    d.update(tcm_bytes=32768, name="tcm-32k")
    small = ModelCompiler(LLAMA, spec_from_dict(d), max_tokens=64, max_rows=16)
    g, grp = _mlp(small)
    big = dict(tile_m=16, slots_in=2, slots_out=2, dma_split=1,
               matmul={s: dict(tile_n=n, tile_k=k, slots_w=2, slots_c=2)
                       for s, n, k in (("s0", 160, 64), ("s1", 160, 64), ("s3", 64, 160))})
    with pytest.raises(CandidateRejected, match="TCM overflow"):
        small.kernels.kernel(g, grp, knobs=big)
    from edgetvm.build.kernels import KernelBuilder
    kb = KernelBuilder(small.spec, small.layout, knobs_for=lambda key: big)
    with pytest.raises(BuildError, match="logged knobs"):
        kb.kernel(g, grp)


def test_tasks_are_distinct_kernels_counted_over_the_programs(mc):
    keys = select_keys(mc.phase_keys((8, 16)), ["decode"])
    assert keys == [("decode", 1, 1), ("decode", 1, 2), ("decode", 1, 4)]
    tasks = extract_tasks(mc, keys)
    assert len({t.key for t in tasks}) == len(tasks)
    n_kernels = 0
    for k in keys:
        g = mc.graph(*k)
        n_kernels += sum(g.ops[grp[0]].kind != "kv_append" for grp in mc.partition(g))
    assert sum(t.count for t in tasks) == n_kernels
    att = [t for t in tasks if t.kind == "decode_attention"]
    assert len(att) == 3 and all(t.count == 2 for t in att)      # one per capacity, 2 layers
    mlp = [t for t in tasks if t.name.count("+") == 3]
    assert len(mlp) == 1 and mlp[0].count == 2 * 3 and \
        {"decode_1x1p", "decode_1x4p"} <= mlp[0].phases
    for t in tasks:                       # the default knobs are a point of the space,
        p = t.to_point(t.default_knobs)   # in the spelling the search proposes
        assert p is not None and canonical_knobs(t.to_knobs(p)) == \
            canonical_knobs(t.default_knobs)
        k = mc.kernels.kernel(t.graph, list(t.group))
        assert mc.kernels.kernel(t.graph, list(t.group), knobs=t.default_knobs
                                 ).program.commands == k.program.commands


def test_a_prefills_last_attention_is_a_decode_attention_task(mc):
    """Prefill reads the last row's logits only, so its last layer attends for one query
    (``graph.py``): that kernel is the decode attention of the same capacity, tuned as one
    task with the decode program's (one knob space, no ``tile_q``), measured in its
    prefill context, and its knobs replay in both programs."""
    keys = [("prefill", 8, 1), ("decode", 1, 1)]
    tasks = extract_tasks(mc, keys)
    dec = [t for t in tasks if t.kind == "decode_attention"]
    pre = [t for t in tasks if t.kind == "prefill_attention"]
    assert len(dec) == 1 and dec[0].count == 1 + 2 and len(pre) == 1 and pre[0].count == 1
    t = dec[0]
    assert t.shape["rows"] == 1 and "tile_q" not in t.space and \
        {"prefill_8x1p", "decode_1x1p"} <= t.phases
    assert t.graph.phase == "prefill"                 # first met there, measured there
    kn = {**t.default_knobs, "slots_kv": 3 - t.default_knobs["slots_kv"]}
    emu = Emulator(mc.spec)
    assert measure_candidate(mc, t, kn, emu).cycles > 0
    for key in keys:
        g = mc.graph(*key)
        i = max(i for i, op in enumerate(g.ops) if op.kind == "attention")
        k = mc.kernels.kernel(g, [i], g.consumers(), knobs=kn)
        assert k.key == t.key and k.knobs == kn


def test_the_space_holds_the_defaults_of_tall_row_tiles():
    big = ModelCompiler(LLAMA, max_tokens=512, max_rows=512)
    tasks = extract_tasks(big, [("prefill", 512, 32)])
    mlp = [t for t in tasks if t.name.count("+") == 3][0]
    assert mlp.default_knobs["tile_m"] > 128          # beyond the template's candidates
    for t in tasks:
        assert t.to_point(t.default_knobs) is not None, t.label
    # a default the template's candidates lack (256 rows of 512) widens the space
    odd = {**mlp.default_knobs, "tile_m": 256}
    before = list(mlp.space["tile_m"])
    assert 256 not in before and mlp.to_point(odd) is None
    mlp.include(odd)
    assert mlp.space["tile_m"] == sorted(before + [256]) and mlp.to_point(odd)["tile_m"] == 256


def test_tuning_improves_logs_everything_and_resumes_without_remeasuring(tuned, tmp_path):
    d, rep = tuned
    assert rep["measured"] == 150
    assert rep["step_cycles_tuned"] < rep["step_cycles_default"]
    reached = [row for row in rep["tasks"] if row["default_cycles"]]
    assert len(reached) >= 5
    for row in reached:
        assert row["best_cycles"] <= row["default_cycles"]
    # the kernel boundaries first, then the tiles of the chosen clusters (which do not
    # stall within this budget: one round)
    assert [st["stage"] for st in rep["stages"]] == ["cuts 1", "tiles 1"]
    assert rep["stages"][0]["measured"] <= 38        # ceil(150 x CUT_SHARE)
    assert any(r["kind"] == "partition" for r in rep["tasks"])
    # measured in context, the chosen knobs never make a linked program slower (measured
    # alone, a DMA split or a TCM-filling tile won and then lost 3-4 % once linked)
    assert all(p["tuned_cycles"] <= p["default_cycles"] for p in rep["phases"])
    assert any(p["tuned_cycles"] < p["default_cycles"] for p in rep["phases"])
    recs = TuningLog(d).trials()
    assert len(recs) == 150 and {r.status for r in recs} <= {OK, "failed"}
    assert all(r.error.startswith("stopped") for r in recs if r.status != OK)
    ctx = recs[0].context
    assert all(r.context == ctx for r in recs)
    assert ctx.profile == "performance" and ctx.spec == load_spec("edge-npu-16mb").hash()
    # nothing measured twice in one context (a second round measures the first one's
    # cuts again with tuned tiles, and kernels again between new neighbours)
    seen = {(r.workload, r.knobs_key, r.neighbours) for r in recs}
    assert len(seen) == len(recs)
    # rerun with the same log: the baselines come from the log, nothing is tried twice
    # (on a copy: the other tests replay the fixture's log of one run)
    import shutil
    d = shutil.copytree(d, tmp_path / "resumed")
    rep2 = tune(LLAMA, **SMALL, trials=30, log_dir=str(d), progress=False, seed=1)
    recs2 = TuningLog(str(d)).trials()
    assert rep2["measured"] == 30 and len(recs2) == 180
    # (a kernel measured between other neighbours, after the cut stage chose another
    # partition, is another measurement)
    assert len({(r.workload, r.knobs_key, r.neighbours) for r in recs2}) == 180
    before = {(r["workload"], r["context"]): r for r in rep["tasks"]}
    again = [(before[b["workload"], b["context"]], b) for b in rep2["tasks"]
             if (b["workload"], b["context"]) in before]
    assert len(again) >= 0.5 * len(rep2["tasks"])
    for a, b in again:
        if a["default_cycles"] is not None:
            assert b["best_cycles"] <= a["best_cycles"]
            # a kernel starts again from its template's defaults, measured before; a run's
            # cuts from those the first run chose (the compiler replays them)
            start = "best" if b["kind"] == "partition" else "default"
            assert (b["default_cycles"], b["default_knobs"]) == \
                (a[f"{start}_cycles"], a[f"{start}_knobs"]), (a, b)


def test_a_later_cut_stage_starts_from_the_chosen_cuts_on_tuned_kernels(rounds, tmp_path):
    """Cut points and tiles are one search: a later round's partition tasks start from the
    cuts chosen before and lower every cluster the log had tuned (to other than its
    defaults) with its tuned knobs. Rebuilt from the log as it stood before that cut
    stage (a copy of its first records), they are measured in a context of their own and
    remeasure that stage's records."""
    from edgetvm.tune.measure import lower_kernels
    from edgetvm.tune.tasks import extract_partition_tasks
    d, rep = rounds
    # rounds: cuts, then tiles until they stall, again; each cut stage at most CUT_SHARE
    # of the budget left, the last tile stage till the budget's end
    names = [st["stage"] for st in rep["stages"]]
    assert names[:4] == ["cuts 1", "tiles 1", "cuts 2", "tiles 2"]
    assert rep["stages"][1]["stalled"] and not rep["stages"][-1]["stalled"]
    assert rep["measured"] == 200
    done = 0
    for st in rep["stages"]:
        if st["stage"].startswith("cuts"):
            assert st["measured"] <= math.ceil((200 - done) * 0.25)
        done += st["measured"]
    assert all(p["tuned_cycles"] <= p["default_cycles"] for p in rep["phases"])
    recs = TuningLog(d).trials()
    assert REJECTED not in {r.status for r in recs}
    assert len({(r.workload, r.knobs_key, r.neighbours) for r in recs}) == len(recs)
    with open(pathlib.Path(d) / "records.jsonl") as f:
        lines = f.readlines()
    # and one record per program of each build, defaults and tuned, from the tune's end
    assert len(lines) == len(recs) + 2 * len(rep["phases"]) == len(TuningLog(d).records())
    ctx = log_context(LLAMA, load_spec("edge-npu-16mb"), None, None)
    emu = Emulator(load_spec("edge-npu-16mb"))
    ends = np.cumsum([st["measured"] for st in rep["stages"]])
    tiled = 0
    for n, st in enumerate(rep["stages"]):
        if not st["stage"].startswith("cuts") or n == 0 or not st["measured"]:
            continue
        n0, n1 = int(ends[n - 1]), int(ends[n])
        before = tmp_path / f"upto{n}"
        before.mkdir()
        (before / "records.jsonl").write_text("".join(lines[:n0]))
        rp = Replay(str(before), ctx)
        mc2 = ModelCompiler(LLAMA, max_tokens=16, max_rows=8, cuts_for=rp.cuts_for)
        keys = select_keys(mc2.phase_keys((8,)), ["decode"])
        tasks = {t.workload: t for t in extract_partition_tasks(mc2, keys, knobs_for=rp)}
        stage = recs[n0:n1]
        assert all(r.kind == "partition" for r in stage)

        def best(w, upto=n0):   # the fastest record of w so far, in its latest context
            mine = [r for r in recs[:upto] if r.workload == w]
            ok = [r for r in mine if r.status == OK and r.neighbours == mine[-1].neighbours]
            return min(ok, key=lambda r: (r.cycles, r.knobs_key)) if ok else None
        for w in {r.workload for r in stage}:
            t = tasks[w]
            first = next(r for r in stage if r.workload == w)
            assert first.neighbours == t.context
            if best(w) is not None and best(w).neighbours == t.context:
                continue                         # it resumed a search, no new baseline
            # a new context starts from the cuts chosen so far: its baseline is first
            assert first.knobs == t.default_knobs
            if best(w) is not None:
                assert t.default_knobs == best(w).knobs
            if not t.tiles:
                continue
            tiled += 1
            for span, knobs in t.tiles.items():
                kernel = mc2.kernels.kernel(t.graph, list(span))
                assert knobs == best(workload_hash(kernel.key)).knobs != kernel.knobs
            for r in [x for x in stage if x.workload == w and x.status == OK][:3]:
                groups = t.groups(r.knobs)
                ks = lower_kernels(mc2, t, r.knobs)
                assert [k.knobs for k, g in zip(ks, groups) if tuple(g) in t.tiles] == \
                    [t.tiles[tuple(g)] for g in groups if tuple(g) in t.tiles]
                assert measure_candidate(mc2, t, r.knobs, emu).cycles == r.cycles
    assert tiled


def test_a_stage_stalls_when_its_last_searched_candidates_gain_too_little():
    """The window is the last max(stall, a quarter of the searched) candidates; the gain
    is compared with where it stood before them."""
    from edgetvm.tune.tuner import STALL_GAIN
    gains = [(0, 0.0), (64, 0.05), (128, 0.05), (200, 0.05 + STALL_GAIN / 2)]
    assert Tuner._stalled(gains, 200, 128)           # since 64: +0.001
    assert not Tuner._stalled(gains, 150, 128)       # since 0: +0.051
    assert not Tuner._stalled(gains, 100, 128)       # fewer than the window
    gains.append((1000, 0.06))
    # a quarter of 1000: since 750, where it stood at 200
    assert not Tuner._stalled(gains, 1000, 128)
    assert not Tuner._stalled(gains + [(1200, 0.06)], 1200, 128)  # since 900: +0.009
    assert Tuner._stalled(gains + [(1500, 0.06)], 1500, 128)      # since 1125: nothing


def test_failed_and_rejected_trials_are_logged_and_the_tuner_goes_on(tmp_path, monkeypatch):
    import edgetvm.tune.measure as measure_mod
    d = load_spec("edge-npu-16mb").to_dict()
    d.update(tcm_bytes=32768, name="tcm-32k")
    small = ModelCompiler(LLAMA, spec_from_dict(d), max_tokens=64, max_rows=16)
    keys = [("prefill", 16, 1)]
    tasks = [t for t in extract_tasks(small, keys) if t.name.count("+") == 3]
    real = measure_mod.run_twice
    calls = {"n": 0}

    def flaky(emu, program, params, cycle_limit=None):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("emulator lost")
        return real(emu, program, params, cycle_limit)
    monkeypatch.setattr(measure_mod, "run_twice", flaky)
    ctx = log_context(LLAMA, small.spec, None, None)
    with TuningLog(str(tmp_path / "log")) as tl:
        rep = Tuner(small, tasks, tl, ctx, progress=False, seed=3).run(trials=12)
    recs = TuningLog(str(tmp_path / "log")).records()
    by = {s: [r for r in recs if r.status == s] for s in ("ok", "failed", "rejected")}
    assert rep["measured"] == 12 == len(by["ok"]) + len(by["failed"])
    lost = [r for r in by["failed"] if not r.error.startswith("stopped")]
    assert len(lost) >= 3 and all("emulator lost" in r.error for r in lost)
    assert by["rejected"] and all("TCM overflow" in r.error for r in by["rejected"])
    assert sum(t["failed"] for t in rep["tasks"]) == len(by["failed"])


def _measured_points(mc, t, rng, n: int) -> list:
    """(knobs, Counters of the kernel alone) of task ``t``'s defaults and of ``n`` random
    points of its space that fit the TCM."""
    emu = Emulator(mc.spec)
    out = []
    for p in [t.to_point(t.default_knobs)] + t.sample(rng, n, set()):
        kn = t.to_knobs(p)
        try:
            k = mc.kernels.kernel(t.graph, list(t.group), knobs=kn)
        except CandidateRejected:
            continue
        out.append((kn, measure_kernel(k, t.graph, mc.spec, mc.layout, emu)))
    return out


def _spearman(a, b) -> float:
    rank = lambda v: np.argsort(np.argsort(v))        # noqa: E731
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


def test_the_cost_model_ranks_unseen_candidates(mc):
    """Trained on 48 measured candidates of the decode tasks, it orders 48 others far
    better than chance (Spearman rank correlation)."""
    import random
    tasks = [t for t in extract_tasks(mc, [("decode", 1, 4), ("prefill", 16, 1)])
             if t.space_size > 40]
    emu = Emulator(mc.spec)
    rng = random.Random(0)
    rows = []
    for t in tasks:
        base = measure_kernel(mc.kernels.kernel(t.graph, list(t.group)), t.graph, mc.spec,
                              mc.layout, emu).total_cycles
        for p in t.sample(rng, 16, set()):
            kn = t.to_knobs(p)
            try:
                k = mc.kernels.kernel(t.graph, list(t.group), knobs=kn)
            except CandidateRejected:
                continue
            c = measure_kernel(k, t.graph, mc.spec, mc.layout, emu).total_cycles
            rows.append((features(t, kn, mc.spec), c, base))
    rng.shuffle(rows)
    train, test = rows[:len(rows) // 2], rows[len(rows) // 2:]
    assert len(test) >= 24
    m = CostModel(seed=0)
    for x, c, b in train:
        m.add(x, c, b)
    m.fit()
    pred = m.predict(np.stack([x for x, _, _ in test]))
    truth = np.log([c / b for _, c, b in test])
    rho = _spearman(pred, truth)
    assert rho > 0.5, rho


def test_the_analytic_prior_charges_the_emulators_mma_cycles_and_orders_candidates(mc):
    """The estimate behind the cost model's prior: its matrix-unit cycles are exactly what
    the emulator's matrix unit is busy for (padding to native tiles, edge tiles, issue
    cycles, per row tile), and its latency ratio orders measured candidates of every
    cluster task with matmuls (a wrong tile count or an inverted ratio would not). An
    untrained model ranks by that prior."""
    import random
    tasks = [t for t in extract_tasks(mc, [("prefill", 16, 1), ("decode", 1, 4)])
             if t.kind == "cluster" and t.shape["matmuls"]]
    assert len(tasks) >= 3
    rng = random.Random(0)
    rhos = {}
    for t in tasks:
        priors, cycles = [], []
        for kn, c in _measured_points(mc, t, rng, 12):
            assert cluster_estimate(t.shape, kn, mc.spec)["mma"] == \
                c.busy_cycles["matrix"], (t.label, kn)
            priors.append(prior(t, kn, mc.spec))
            cycles.append(c.total_cycles)
        assert priors[0] == 0.0                       # the defaults against themselves
        assert len(cycles) >= 8, t.label
        rhos[t.label] = _spearman(priors, cycles)
    # tiny GEMVs are mostly fixed costs (launch, set-ups), the larger clusters not
    assert min(rhos.values()) > 0.4 and np.mean(list(rhos.values())) > 0.75, rhos
    X = np.stack([features(tasks[0], t, mc.spec) for t in
                  [tasks[0].to_knobs(p) for p in tasks[0].sample(rng, 10, set())]])
    assert list(CostModel().rank(X)) == list(np.argsort(X[:, PRIOR], kind="stable"))


@pytest.mark.parametrize("family", ["llama", "bloom"])
def test_the_attention_prior_charges_the_emulators_mma_cycles_and_orders_candidates(family):
    """The attention templates' estimate (causal, and ALiBi's bias for BLOOM): its
    matrix-unit cycles are exactly the emulator's (QK^T and P @ V per live KV tile --
    prefill's causal tiles at the bucket's last positions --, prefill's row sums as an
    MMA or not), so are its vector cycles (the scores' passes, the masks on the tiles
    they change, the per-row state), and its prior orders measured knob sets of both
    kernels (a wrong live-tile count, a missing pipeline or an inverted ratio would not);
    the prior of the defaults is 0 and an untrained model ranks an attention task's pool
    by it."""
    import random
    # a whole 64-token prompt (the KV tiles above the diagonal are skipped) and decode
    mc = ModelCompiler(str(DATA / f"{family}_tiny_with_past.onnx"), max_tokens=64,
                       max_rows=64)
    keys = [("prefill", 64, 4), ("decode", 1, 4)]
    tasks = [t for t in extract_tasks(mc, keys) if t.kind.endswith("attention")]
    assert all(t.shape["alibi"] == (family == "bloom") for t in tasks)
    assert {t.kind for t in tasks} == {"prefill_attention", "decode_attention"}
    rng = random.Random(0)
    rhos = {}
    for t in tasks:
        priors, cycles = [], []
        for kn, c in _measured_points(mc, t, rng, 16):
            est = attention_estimate(t.kind, t.shape, kn, mc.spec)
            assert est["mma"] == c.busy_cycles["matrix"], (t.label, kn)
            assert est["vec"] == c.busy_cycles["vector"], (t.label, kn)
            priors.append(prior(t, kn, mc.spec))
            cycles.append(c.total_cycles)
        assert priors[0] == 0.0
        assert len(cycles) >= 12, t.label
        rhos[t.kind] = _spearman(priors, cycles)
    # decode is bound by its KV bytes: the knobs move it little, the prior less surely
    assert rhos["prefill_attention"] > 0.85 and rhos["decode_attention"] > 0.6, rhos
    t = next(t for t in tasks if t.kind == "prefill_attention")
    X = np.stack([features(t, t.to_knobs(p), mc.spec) for p in t.sample(rng, 10, set())])
    assert np.ptp(X[:, PRIOR]) > 0.1
    assert list(CostModel().rank(X)) == list(np.argsort(X[:, PRIOR], kind="stable"))


def test_the_prior_charges_the_vector_stages_and_what_list_scheduling_hides():
    """The estimate counts a cluster's own vector stages (SiLU and the product: 7 cycles
    per pass of 64 lanes) and, list-scheduled over several row tiles, hides them under the
    other tiles' matrix work; in one row tile the order changes nothing it models. On
    the emulator the same knob sets order the same way (a 256-row norm -> QKV -> RoPE:
    96.4 k -> 88.7 k cycles, ``test_fused``)."""
    from edgetvm.tir_schedules import fused
    from edgetvm.tune.tasks import cluster_space
    spec = load_spec("edge-npu-16mb")
    _, sh = cluster_space(fused.mlp_cluster(512, 576, 1536, 32))
    assert sh["row_stages"] == [("silu_mul", 1536)]
    mm = {s: dict(tile_n=256, tile_k=576, slots_w=2, slots_c=2) for s in ("gate", "up", "down")}

    def est(tm, ls):
        return cluster_estimate(sh, dict(tile_m=tm, slots_in=2, slots_out=2, list_schedule=ls,
                                         matmul=mm), spec)
    casts = 512 * (1536 // 64 * 2 + 576 // 64)     # each output column tile cast once
    silu_mul = 512 * (1536 // 64) * (spec.vector_op_cycles["silu"] +
                                      spec.vector_op_cycles["mul"])
    assert est(512, 0)["vec"] == pytest.approx(silu_mul + casts, rel=0.05)
    assert est(512, 1) == est(512, 0)
    assert est(128, 1)["overlap"] < 0.95 * est(128, 0)["overlap"]
    assert est(128, 1)["serial"] == est(128, 0)["serial"]


def test_the_prior_and_features_read_resident_weights_once():
    """``resident_w=1``: the estimate charges each weight one DMA per kernel (the W4A16
    codes and scales of all three matmuls, whole), not one per tile and row tile, and the
    features see the weights cross the bus once and take their whole size in the TCM; the
    MMAs are the same. With one row tile the bytes are the same either way."""
    from edgetvm.tir_schedules import fused
    from edgetvm.tune.tasks import cluster_space
    spec = load_spec("edge-npu-16mb")
    space, sh = cluster_space(fused.mlp_cluster(512, 576, 1536, 32))
    assert space["resident_w"] == [0, 1]
    mm = {s: dict(tile_n=256, tile_k=576, slots_w=2, slots_c=2) for s in ("gate", "up", "down")}
    mm["down"]["tile_k"] = 512

    def est(tm, rw):
        return cluster_estimate(sh, dict(tile_m=tm, slots_in=2, slots_out=2, list_schedule=1,
                                         resident_w=rw, matmul=mm), spec)
    whole = 3 * (576 * 1536 / 2 + 1536 * 576 // 32 * 4) / spec.dram_bytes_per_cycle + \
        3 * 3 * spec.dma_setup_cycles
    assert est(128, 1)["wdma"] == pytest.approx(whole)
    assert est(128, 0)["wdma"] > 4 * whole                # per row tile, per tile set-ups
    assert est(128, 1)["mma"] == est(128, 0)["mma"]
    assert est(128, 1)["serial"] < est(128, 0)["serial"]
    task = type("T", (), {"kind": "cluster", "shape": sh,
                          "default_knobs": dict(tile_m=512, matmul=mm)})()
    def feats(tm, rw):
        return dict(zip(FEATURES, features(task, dict(
            tile_m=tm, slots_in=2, slots_out=2, list_schedule=1, resident_w=rw, matmul=mm),
            spec)))
    f = {rw: feats(128, rw) for rw in (0, 1)}
    assert f[1]["resident_w"] == 1 and f[0]["resident_w"] == 0
    assert (f[0]["weight_rereads"], f[1]["weight_rereads"]) == (4, 1)
    assert f[0]["log_weight_dram"] == pytest.approx(f[1]["log_weight_dram"] + 2, abs=0.01)
    assert f[1]["tcm_frac"] > f[0]["tcm_frac"]
    assert feats(512, 0)["log_weight_dram"] == feats(512, 1)["log_weight_dram"]


def test_replay_builds_identical_bytes_with_the_logged_knobs_and_latency(tuned, tmp_path):
    d, rep = tuned
    a, b, plain = tmp_path / "a.npu", tmp_path / "b.npu", tmp_path / "plain.npu"
    m = build(LLAMA, str(a), **SMALL, progress=False, log_dir=d, jobs=2)
    build(LLAMA, str(b), **SMALL, progress=False, log_dir=d, jobs=1)   # the same manifest
    build(LLAMA, str(plain), **SMALL, progress=False)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != plain.read_bytes()
    # the runs whose cuts the log has (the tuner reached them: measured at least their
    # defaults; this run's and the resumed run's) replay; so do the kernels it has
    recs = TuningLog(d).records()
    assert m["tuning"]["runs_cut"] == len({r.workload for r in recs
                                           if r.kind == "partition" and r.status == OK}) > 0
    assert 0 < m["tuning"]["kernels_tuned"] <= len(
        {r.workload for r in recs if r.kind != "partition" and r.status == OK})
    # every kernel of every program carries its log's best knobs
    best = TuningLog.best(TuningLog(d).records())
    replay = Replay(d, log_context(LLAMA, load_spec("edge-npu-16mb"), None, None))
    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16, **replay.compiler_options)
    with zipfile.ZipFile(a) as z:
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["tuning"] == m["tuning"]
    emu = Emulator(mc.spec)
    # the tiles were tuned on the partition of the best logged cuts, default knobs
    plain_mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16, cuts_for=replay.cuts_for)
    tasks = {t.workload: t for t in extract_tasks(plain_mc, plain_mc.phase_keys((8, 16)))}
    checked = 0
    for phase, rows, pages in [("decode", 1, 4), ("prefill", 16, 1)]:
        g = mc.graph(phase, rows, pages)
        cons = g.consumers()
        for grp in mc.partition(g):
            k = mc.kernels.kernel(g, grp, cons)
            r = best.get(workload_hash(k.key))
            if r is None:            # a KV append (no knobs) or a task never reached
                assert canonical_knobs(k.knobs) == canonical_knobs(
                    plain_mc.kernels.kernel(g, grp, cons).knobs)
                continue
            assert canonical_knobs(k.knobs) == r.knobs_key
            # the replayed knobs measure what the log recorded, in the same context
            t = tasks[r.workload]
            assert r.neighbours == t.context
            assert measure_candidate(plain_mc, t, r.knobs, emu).cycles == r.cycles
            checked += 1
    assert checked >= 12


def test_a_program_the_log_measured_slower_tuned_is_built_with_the_defaults(tuned, tmp_path,
                                                                           capsys):
    """The tune measures every program whole, defaults and tuned, and logs both; a build
    with --log builds a program whose tuned form measured slower (here: a later
    measurement says so) with the strategy's partition and default knobs, the others as
    tuned, the same bytes whatever -j; a build of another strategy, or a selection the
    measurement was not of (a new best record), is not judged by it."""
    import shutil

    from edgetvm.runtime.artifact import load_artifact, program_file
    from edgetvm.runtime.model import program_name
    from edgetvm.tune.cli import program_counters
    from edgetvm.tune.log import DEFAULTS, PROGRAM, TUNED, program_record
    d0, rep = tuned
    ctx = log_context(LLAMA, load_spec("edge-npu-16mb"), None, None)
    ident = {"strategy": "regions", "max_tokens": 64, "max_rows": 16}    # SMALL's build
    names = [r["program"] for r in rep["phases"]]

    def untuned(rp, identity=ident):
        return {n for n in names if rp.builds_defaults(n, identity)}

    # the tune's own records: both builds of every program, what the report said
    progs = [r for r in TuningLog(d0).records() if r.kind == PROGRAM]
    rp = Replay(d0, ctx)
    for row in rep["phases"]:
        mine = {r.knobs["build"]: r for r in progs if r.name == row["program"]
                and r.knobs["selection"] == rp.selection}
        assert {k: mine[TUNED].knobs[k] for k in ident} == ident
        assert mine[DEFAULTS].cycles == row["default_cycles"]
        assert mine[TUNED].cycles == row["tuned_cycles"]
        assert (row["program"] in untuned(rp)) == (row["replayed"] == DEFAULTS) == \
            (row["tuned_cycles"] > row["default_cycles"] or row["tuned_over_budget"])
    d = str(tmp_path / "log")
    shutil.copytree(d0, d)
    row = next(r for r in rep["phases"] if r["replayed"] == TUNED and
               r["tuned_cycles"] < r["default_cycles"])
    victim = row["program"]
    with TuningLog(d) as tl:
        tl.append(program_record(ctx, victim, ident, rp.selection, TUNED,
                                 row["default_cycles"] + 1, 1, 1.0))
    rp2 = Replay(d, ctx)
    assert untuned(rp2) == untuned(rp) | {victim}
    assert untuned(rp2, dict(ident, strategy="mega")) == set()
    art = tmp_path / "a.npu"
    m = build(LLAMA, str(art), **SMALL, progress=False, log_dir=d, jobs=2)
    build(LLAMA, str(tmp_path / "a1.npu"), **SMALL, progress=False, log_dir=d, jobs=1)
    assert art.read_bytes() == (tmp_path / "a1.npu").read_bytes()       # whatever -j
    build(LLAMA, str(tmp_path / "plain.npu"), **SMALL, progress=False)
    build(LLAMA, str(tmp_path / "t.npu"), **SMALL, progress=False, log_dir=d0, jobs=1)
    assert m["tuning"]["programs_untuned"] == sorted(untuned(rp2))
    assert build_main([LLAMA, "-o", str(tmp_path / "cli.npu"), "--buckets", "8,16",
                       "--max-tokens", "64", "--log", d]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "with the defaults" in ln]
    assert len(said) == 1 and victim in said[0]
    a, plain, t = (load_artifact(str(tmp_path / n)) for n in ("a.npu", "plain.npu", "t.npu"))
    keys = {program_name(k): k for k in a.keys}
    for name, key in keys.items():
        want = plain if name in untuned(rp2) else t
        assert a._read(program_file(key)) == want._read(program_file(key)), name
    assert a._read(program_file(keys[victim])) != t._read(program_file(keys[victim]))
    # built with the defaults, it measures the logged defaults' cycles
    mc = ModelCompiler(LLAMA, max_tokens=64, max_rows=16, **rp2.compiler_options)
    assert mc.build_identity() == ident
    assert program_counters(mc, keys[victim]).total_cycles == row["default_cycles"]
    # a new best kernel record: another selection, which no program record judged
    best = next(r for r in rp.best.values() if r.kind != "partition")
    with TuningLog(d) as tl:
        tl.append(dataclasses.replace(best, cycles=best.cycles - 1,
                                      knobs=dict(best.knobs, _other=1), time=best.time + 1))
    rp3 = Replay(d, ctx)
    assert rp3.selection != rp.selection and untuned(rp3) == set()


def test_a_program_measured_faster_with_its_prefetches_at_the_end_is_linked_so(
        tuned, tmp_path, monkeypatch, capsys):
    """Where the linker spread a program's prefetches under the kernel before, a tune's
    whole-program step measures it with each at that kernel's end too (the cycles a
    compiler linking it so measures), and a build with --log links every program as its
    records say. The tiny kernels are never compute-bound: spreading is forced, as in
    test_phase_programs, and the programs so spread measure faster at the end; a later
    record says one of them is faster spread, and it is built spread."""
    import shutil

    from edgetvm.build import link
    from edgetvm.runtime.artifact import load_artifact, program_file
    from edgetvm.runtime.model import program_name
    from edgetvm.tune.cli import program_counters
    from edgetvm.tune.log import AT_END, PROGRAM, SPREAD, TUNED, program_record
    d0, _ = tuned
    assert not any(r.knobs.get("prefetch") == AT_END for r in TuningLog(d0).records()
                   if r.kind == PROGRAM)             # nothing the tiny kernels spread
    d = str(tmp_path / "log")
    shutil.copytree(d0, d)
    monkeypatch.setattr(link.Linker, "_has_dma_slack", lambda self, body, hoisted: True)
    monkeypatch.setattr(link.Linker, "_tail_hides", lambda self, tail, loads: False)
    monkeypatch.setattr(link, "SPREAD_BLOCK_BYTES", 2048)
    rep = tune(LLAMA, **SMALL, trials=0, log_dir=d, progress=False)
    ctx = log_context(LLAMA, load_spec("edge-npu-16mb"), None, None)
    rp = Replay(d, ctx)
    ident = {"strategy": "regions", "max_tokens": 64, "max_rows": 16}
    end = ModelCompiler(LLAMA, max_tokens=64, max_rows=16,
                        **dict(rp.compiler_options, defaults_for=None, spread_for=None))
    rows = {r["program"]: r for r in rep["phases"]}
    spread = [n for n, r in rows.items() if "tuned_at_end_cycles" in r]
    assert spread and all("defaults_at_end_cycles" in rows[n] for n in spread)
    keys = {program_name(k): k for k in end.phase_keys((8, 16))}
    for n in spread:                    # measured unspread: what a compiler so links
        assert program_counters(end, keys[n], spread=False).total_cycles == \
            rows[n]["tuned_at_end_cycles"]
        assert (rows[n]["prefetch"] == AT_END) == (not rp.spreads(n, ident))
    # spread under kernels that are not compute-bound, the programs measured faster
    # unspread; a later measurement says one of them is faster spread
    assert any(rows[n]["prefetch"] == AT_END for n in spread)
    victim = next(n for n in spread if rows[n]["replayed"] == TUNED and
                  rows[n]["prefetch"] == AT_END)
    fastest = min(v for k, v in rows[victim].items() if k.endswith("cycles"))
    with TuningLog(d) as tl:
        tl.append(program_record(ctx, victim, ident, rp.selection, TUNED, fastest - 1,
                                 1, 1.0, prefetch=SPREAD))
    rp = Replay(d, ctx)
    at_end = {n for n in keys if not rp.spreads(n, ident)}
    assert victim not in at_end and at_end == {n for n in spread if n != victim and
                                               rows[n]["prefetch"] == AT_END}
    capsys.readouterr()
    assert build_main([LLAMA, "-o", str(tmp_path / "a.npu"), "--buckets", "8,16",
                       "--max-tokens", "64", "--log", d, "-j", "1"]) == 0
    said = [ln for ln in capsys.readouterr().out.splitlines() if "at the end of" in ln]
    assert len(said) == 1 and set(said[0].split(": ")[-1].split(", ")) == at_end
    build(LLAMA, str(tmp_path / "s.npu"), **SMALL, progress=False, log_dir=d0, jobs=1)
    monkeypatch.setattr(link.Linker, "_has_dma_slack", lambda self, body, hoisted: False)
    build(LLAMA, str(tmp_path / "e.npu"), **SMALL, progress=False, log_dir=d0, jobs=1)
    a, s, e = (load_artifact(str(tmp_path / f)) for f in ("a.npu", "s.npu", "e.npu"))
    assert a.manifest["tuning"]["programs_prefetch_at_end"] == sorted(at_end)
    for name, key in keys.items():
        want = e if name in at_end else s
        assert a._read(program_file(key)) == want._read(program_file(key)), name
    assert s._read(program_file(keys[victim])) != e._read(program_file(keys[victim]))


def test_tune_with_no_trials_measures_only_the_whole_programs(tuned, tmp_path, capsys):
    """--trials 0: no candidate, only the whole programs against the log (as at a tune's
    end), logged again with the same cycles; an empty log is refused, not a traceback."""
    import shutil

    from edgetvm.tune.log import PROGRAM
    d0, rep = tuned
    d = str(tmp_path / "log")
    shutil.copytree(d0, d)
    before = TuningLog(d).records()
    assert tune_main([LLAMA, "--buckets", "8,16", "--max-tokens", "64", "--phases", "decode",
                      "--trials", "0", "--log", d, "-q"]) == 0
    assert "whole program" in capsys.readouterr().out
    new = TuningLog(d).records()[len(before):]
    assert new and {r.kind for r in new} == {PROGRAM}
    want = {(r["program"], b): r[f"{c}_cycles"] for r in rep["phases"]
            for b, c in (("defaults", "default"), ("tuned", "tuned"))}
    assert {(r.name, r.knobs["build"]): r.cycles for r in new} == \
        {k: v for k, v in want.items() if k[0].startswith("decode")}
    assert tune_main([LLAMA, "--trials", "0", "--log", str(tmp_path / "empty"), "-q"]) == 1
    assert "no tuning records" in capsys.readouterr().err


def test_build_refuses_a_log_of_another_profile_or_quantization(tuned, tmp_path, capsys):
    d, _ = tuned
    out = str(tmp_path / "x.npu")
    args = [LLAMA, "-o", out, "--buckets", "8,16", "--max-tokens", "64", "-q", "--log", d]
    assert build_main(args + ["--profile", "balanced"]) == 1
    err = capsys.readouterr().err
    assert "profile is 'balanced' here, the log has 'performance'" in err
    assert build_main(args + ["--quantize", "32"]) == 1
    err = capsys.readouterr().err
    assert "quantization is" in err and "profile" not in err
    assert build_main(args[:-2] + ["--log", str(tmp_path / "none")]) == 1
    assert "no such tuning log" in capsys.readouterr().err


def test_tune_cli(tmp_path, capsys):
    d = str(tmp_path / "log")
    assert tune_main([LLAMA, "--buckets", "8", "--max-tokens", "16", "--phases", "decode",
                      "--trials", "20", "--log", d, "-q", "--report-json",
                      str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "20 measurements" in out and "decode_attention" in out
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["programs"] == ["decode_1x1p"] and rep["measured"] == 20
    # the whole linked program, default vs replayed knobs, measured as the runtime runs it
    from edgetvm.tune.cli import program_counters
    (ph,) = rep["phases"]
    assert ph["program"] == "decode_1x1p" and "whole program" in out
    plain = ModelCompiler(LLAMA, max_tokens=16, max_rows=8)
    assert ph["default_cycles"] == program_counters(plain, ("decode", 1, 1)).total_cycles
    rp = Replay(d, log_context(LLAMA, plain.spec, None, None))
    replayed = ModelCompiler(LLAMA, max_tokens=16, max_rows=8, **rp.compiler_options)
    tuned = program_counters(replayed, ("decode", 1, 1))
    assert ph["tuned_cycles"] == tuned.total_cycles
    assert ph["tuned_peak_mw"] == round(tuned.peak_power_mw, 1)
    assert tune_main([LLAMA, "--trials", "5", "--phases", "nope", "--buckets", "8",
                      "--max-tokens", "16", "--log", d, "-q"]) == 1
    assert "no program 'nope'" in capsys.readouterr().err
    assert tune_main([str(tmp_path / "missing.onnx"), "--trials", "5", "--log", d]) == 1
    assert tune_main([LLAMA, "--trials", "5", "--cut-share", "1.5", "--log", d]) == 1
    assert "--cut-share" in capsys.readouterr().err
    assert tune_main([LLAMA, "--trials", "5", "--rounds", "0", "--log", d]) == 1
    assert "--rounds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tune_main([LLAMA, "--trials", "5", "--rpc-tracker", "nohost", "--log", d])
    assert "HOST:PORT" in capsys.readouterr().err


def test_parallel_workers_measure_what_one_process_measures(tmp_path, mc):
    d = str(tmp_path / "log")
    rep = tune(LLAMA, buckets=(8,), max_tokens=16, phases=["decode"], trials=24, log_dir=d,
               workers=2, progress=False, seed=5)
    assert rep["measured"] == 24
    recs = [r for r in TuningLog(d).trials() if r.status == OK]
    mc1, tasks = logged_tasks(LLAMA, d, [("decode", 1, 1)], max_tokens=16, max_rows=8)
    emu = Emulator(mc1.spec)
    assert {r.kind for r in recs} >= {"partition", "cluster"}
    for r in recs[:4] + recs[-8:]:
        assert measure_candidate(mc1, tasks[r.workload], r.knobs, emu).cycles == r.cycles
    assert REJECTED not in {r.status for r in recs}


def test_kinds_tunes_only_the_kernels_asked_for(tmp_path, capsys):
    """``--kinds attention`` (after an attention template change): every trial is an
    attention kernel's, no cut point is searched, and a kind the tuner does not know, or
    one the programs lack, is refused by name."""
    from edgetvm.tune.cli import task_kinds
    d = str(tmp_path / "log")
    rep = tune(LLAMA, buckets=(8,), max_tokens=16, phases=["decode_1x1p", "prefill_8x1p"],
               trials=12, log_dir=d, progress=False, seed=2, kinds=["attention"],
               validate=False)
    recs = TuningLog(d).records()
    assert rep["measured"] == len(recs) >= 4          # the tiny spaces may run out first
    assert {r.kind for r in recs} == {"decode_attention", "prefill_attention"}
    assert task_kinds(["attention", "cluster", "decode_attention"]) == \
        ("decode_attention", "prefill_attention", "cluster")
    with pytest.raises(EdgeTVMError, match="no task kind 'mlp'"):
        task_kinds(["mlp"])
    assert tune_main([LLAMA, "--trials", "5", "--kinds", "prefill_attention", "--phases",
                      "decode", "--buckets", "8", "--max-tokens", "16", "--log", d, "-q"]) == 1
    assert "no kernel of kind prefill_attention" in capsys.readouterr().err


def test_kinds_without_partition_tunes_the_kernels_of_the_logged_cuts(tuned, tmp_path):
    """``--kinds cluster`` searches no cut point but tunes the clusters of the cut points
    the log chose (those a build replays), not the strategy's default clusters."""
    import shutil
    src, _ = tuned
    d = str(tmp_path / "log")
    shutil.copytree(src, d)
    before = len(TuningLog(d).records())
    replayed = Replay(d, log_context(LLAMA, load_spec("edge-npu-16mb"), None, None))
    logged = ModelCompiler(LLAMA, max_tokens=64, max_rows=16, cuts_for=replayed.cuts_for)
    default = ModelCompiler(LLAMA, max_tokens=64, max_rows=16)
    keys = default.phase_keys(SMALL["buckets"])
    want = {t.workload for t in extract_tasks(logged, keys) if t.kind == "cluster"}
    others = {t.workload for t in extract_tasks(default, keys) if t.kind == "cluster"} - want
    assert others               # the log's cuts made other clusters: the test can tell
    tune(LLAMA, **SMALL, trials=10, log_dir=d, progress=False, seed=4, kinds=["cluster"],
         validate=False)
    new = TuningLog(d).records()[before:]
    assert len(new) == 10 and {r.kind for r in new} == {"cluster"}
    assert {r.workload for r in new} <= want


def test_a_measurement_past_the_timeout_is_a_failure_and_the_pool_recovers(mc):
    from edgetvm.tune.measure import ForkMeasurer
    tasks = extract_tasks(mc, [("decode", 1, 1)])
    t = [t for t in tasks if t.name.count("+") == 3][0]
    fm = ForkMeasurer(mc, tasks, "performance", 1, timeout=1e-4)   # nothing is that fast
    try:
        ((res, _),) = fm.measure(t, [t.default_knobs])
        assert isinstance(res, TimeoutError) and fm.pool is None
        fm.timeout = 120
        (res, _), (rej, _) = fm.measure(t, [t.default_knobs, {"tile_m": 1, "bogus": 3}])
        assert res == measure_candidate(mc, t, t.default_knobs, Emulator(mc.spec))
        assert isinstance(rej, CandidateRejected) and "bogus" in str(rej)
    finally:
        fm.close()


def test_candidates_over_the_power_budget_are_measured_but_never_chosen(tmp_path):
    """Under ``low-battery`` (700 mW) some of prefill 64's kernels are over the budget
    even throttled (DRAM power does not scale with the clock). A candidate over the limit
    is logged as measured, counts as a trial and is never replayed; the limit is the
    budget, or the defaults' peak for a kernel whose defaults break the budget themselves."""
    from edgetvm.tune.log import OVER_BUDGET
    from edgetvm.tune.tuner import DEFAULTS_OVER
    d = str(tmp_path / "log")
    rep = tune(LLAMA, buckets=(64,), max_tokens=64, phases=["prefill_64x4p"],
               trials=40, log_dir=d, profile="low-battery", progress=False, seed=4,
               validate=False, cuts=False)
    recs = TuningLog(d).records()
    over = [r for r in recs if r.status == OVER_BUDGET]
    ok = [r for r in recs if r.status == OK]
    assert over and ok and rep["measured"] == len(over) + len(ok) + \
        sum(r.status == "failed" for r in recs)
    assert sum(row["over_budget"] for row in rep["tasks"]) == len(over)
    limit = {}
    for r in ok:
        if (r.error or "").startswith(DEFAULTS_OVER):
            assert r.peak_power_mw > 700
            limit[r.workload] = r.peak_power_mw
    assert limit, "no kernel's defaults are over the low-battery budget"
    for r in over:
        assert r.peak_power_mw > limit.get(r.workload, 700) and "limit" in r.error
    spec = load_spec("edge-npu-16mb")
    replay = Replay(d, log_context(LLAMA, spec, "low-battery", None))
    assert replay.best and all(r.status == OK for r in replay.best.values())


def test_run_an_onnx_file_with_a_tuning_log(tuned, tmp_path, monkeypatch, capsys):
    from edgetvm.run import main as run_main
    d, _ = tuned
    monkeypatch.setenv("EDGETVM_CACHE", str(tmp_path))
    args = [LLAMA, "--prompt-ids", "5,17,42", "--max-new-tokens", "2", "--max-tokens", "64",
            "-q", "--check-onnx"]
    assert run_main(args + ["--log", d]) == 0
    assert "building" in capsys.readouterr().out
    assert run_main(args) == 0                     # without the log: another build
    assert "building" in capsys.readouterr().out
    builds = sorted(tmp_path.glob("*.npu"))
    assert len(builds) == 2
    tuned_manifest = [load_artifact_manifest(b) for b in builds]
    assert sorted("tuning" in m for m in tuned_manifest) == [False, True]
    assert run_main(args + ["--log", str(tmp_path / "nolog")]) == 2
    assert "no such tuning log" in capsys.readouterr().err


def load_artifact_manifest(path) -> dict:
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read("manifest.json"))


def test_candidates_queued_behind_a_hung_one_are_measured_not_failed(mc, monkeypatch):
    """One worker, a batch whose first candidate hangs: it fails at the timeout, the two
    queued behind it (which never got the worker) run on a fresh pool."""
    import time as _time

    import edgetvm.tune.measure as measure_mod
    from edgetvm.tune.measure import ForkMeasurer

    def fake(mc_, task, knobs, emulator, slow_after=None):
        if knobs.get("hang"):
            _time.sleep(60)
        return ("measured", knobs["n"]), 0.0
    monkeypatch.setattr(measure_mod, "_lower_and_run", fake)
    tasks = extract_tasks(mc, [("decode", 1, 1)])
    fm = ForkMeasurer(mc, tasks, "performance", 1, timeout=3)
    try:
        out = fm.measure(tasks[0], [{"hang": True, "n": 0}, {"n": 1}, {"n": 2}])
    finally:
        fm.close()
    assert isinstance(out[0][0], TimeoutError)
    assert [o[0] for o in out[1:]] == [("measured", 1), ("measured", 2)]


def test_the_shipped_log_of_the_bundled_example_replays():
    """tuning_logs/llama_tiny_with_past matches this edgetvm (model, spec, profile,
    versions): the README's replay works on a clean clone; retune it when a key changes.
    Its knobs cover the decode program's kernels and do not make it slower."""
    from edgetvm.tune.cli import DEFAULT_MODEL, program_counters
    repo = pathlib.Path(__file__).resolve().parents[2]
    d = str(repo / "tuning_logs" / "llama_tiny_with_past")
    spec = load_spec("edge-npu-16mb")
    replay = Replay(d, log_context(DEFAULT_MODEL, spec, None, None))
    tuned = ModelCompiler(DEFAULT_MODEL, max_rows=16, **replay.compiler_options)
    plain = ModelCompiler(DEFAULT_MODEL, max_rows=16)
    key = ("decode", 1, 64)
    t, p = program_counters(tuned, key), program_counters(plain, key)
    g = tuned.graph(*key)
    knobbed = {tuned.kernels.kernel(g, grp).key for grp in tuned.partition(g)
               if g.ops[grp[0]].kind != "kv_append"}
    used = {w for w, r in replay.used.items() if r.kind != "partition"}
    assert len(used) >= 0.9 * len(knobbed)
    assert t.total_cycles <= p.total_cycles
    # every program measured whole for this selection (tune --trials 0), each faster
    # tuned: none is built with the defaults, not even those whose tuned peak is over
    # the budget (the governor corrects it; its cost is in the cycles)
    from edgetvm.tune.log import PROGRAM, SPREAD, TUNED
    whole = {r.name: r for r in TuningLog(d).records() if r.kind == PROGRAM and
             r.knobs["selection"] == replay.selection and r.knobs["build"] == TUNED and
             r.knobs.get("prefetch", SPREAD) == SPREAD}
    assert {f"{p}_{r}x{g}p" for p, r, g in plain.phase_keys((16, 32, 64, 128, 256, 512))} \
        <= set(whole)
    assert whole["decode_1x64p"].cycles == t.total_cycles
    assert any(r.peak_power_mw > 2500 for r in whole.values())
    ident = {k: whole["decode_1x64p"].knobs[k] for k in ("strategy", "max_tokens",
                                                          "max_rows")}
    assert ident == dict(plain.build_identity(), max_rows=512)   # the tune's: every bucket
    assert not any(replay.builds_defaults(n, ident) for n in whole)
    # each program links its prefetches as its tuned build measured faster (spread under
    # compute-bound kernels, or at the end of the kernel before; a tie keeps spread)
    from edgetvm.tune.log import AT_END
    at_end = {r.name: r for r in TuningLog(d).records() if r.kind == PROGRAM and
              r.knobs["selection"] == replay.selection and r.knobs["build"] == TUNED and
              r.knobs.get("prefetch") == AT_END}
    assert at_end, "no program of the shipped log was measured with its prefetches at the end"
    for n, r in whole.items():
        assert replay.spreads(n, ident) is (n not in at_end or r.cycles <= at_end[n].cycles), n


def test_over_the_budget_means_beyond_what_the_governor_corrects():
    from edgetvm.tune.measure import beyond_governor
    assert beyond_governor(800.0, 700.0, 650.0, 0.125)
    assert not beyond_governor(800.0, 700.0, 650.0, 0.5)       # the governor still had room
    assert not beyond_governor(800.0, 700.0, 900.0, 0.125)     # the baseline is over itself
    assert not beyond_governor(700.0004, 700.0, 650.0, 0.125)  # within the log's precision


def test_a_candidate_far_slower_than_the_best_is_stopped_with_a_lower_bound(mc):
    """The emulator stops a run at its cycle limit; the tuner's measurement turns that
    into TooSlow(bound) for a candidate that costs more than ``slow_after`` in context."""
    from edgetvm.target.emulator import CycleLimitExceeded
    from edgetvm.tune.measure import TooSlow
    t = [t for t in extract_tasks(mc, [("prefill", 16, 1)]) if t.name.count("+") == 3][0]
    emu = Emulator(mc.spec)
    full = measure_candidate(mc, t, t.default_knobs, emu)
    assert measure_candidate(mc, t, t.default_knobs, emu, slow_after=full.cycles + 1) == full
    with pytest.raises(TooSlow) as e:
        measure_candidate(mc, t, t.default_knobs, emu, slow_after=full.cycles // 2)
    assert e.value.cycles == full.cycles // 2
    # it comes back from a worker process whole (an exception that does not unpickle
    # kills the pool's result thread, and the tuner waits for ever)
    import pickle
    back = pickle.loads(pickle.dumps(e.value))
    assert isinstance(back, TooSlow) and back.cycles == e.value.cycles
    assert str(back) == str(e.value) and str(back).startswith("stopped")
    k = mc.kernels.kernel(t.graph, list(t.group))
    from edgetvm.build.measure import kernel_program, measurement_params
    prog = kernel_program(k, t.graph, mc.spec)
    params = measurement_params(prog, t.graph, mc.layout)
    whole = emu.run(prog, {}, params).counters.total_cycles
    with pytest.raises(CycleLimitExceeded) as e:
        emu.timeline().run(prog, {}, params, cycle_limit=whole // 3)
    assert str(pickle.loads(pickle.dumps(e.value))) == str(e.value)
    assert emu.timeline().run(prog, {}, params, cycle_limit=whole + 1).counters.total_cycles \
        == whole


def test_the_shipped_smollm2_log_matches_the_export():
    """tuning_logs/smollm2-135m was tuned on make_smollm2.sh's export, under `performance`
    and under `balanced`, and W4A16 g32 under `performance`: its contexts match that file
    and this edgetvm, and each replays its own records (skipped without the 540 MB
    export)."""
    import os
    repo = pathlib.Path(__file__).resolve().parents[2]
    root = os.environ.get("EDGETVM_SMOLLM2", str(repo.parent / "smollm2"))
    model = os.path.join(root, "optimum_with_past", "model.onnx")
    if not os.path.exists(model):
        pytest.skip(f"no SmolLM2 export at {model}")
    w4 = QuantizeW4A16(group_size=32)
    # one log, a context per profile and quantization
    for profile, quantize in (("performance", None), ("balanced", None), ("performance", w4)):
        replay = Replay(str(repo / "tuning_logs" / "smollm2-135m"),
                        log_context(model, load_spec("edge-npu-16mb"), profile, quantize))
        assert len(replay.best) >= 10
        assert {r.context.profile for r in replay.best.values()} == {profile}
        assert {r.context.quantization == "none" for r in replay.best.values()} == \
            {quantize is None}


def test_a_resumed_task_without_todays_default_still_reports(tmp_path, mc):
    """A log whose records of a task lack the task's current default knobs (the defaults
    changed since it was written, as when clusters gained ``tcm_fresh``) resumes with a
    best but no default; a budget that ends before the default is measured again must
    still report (it raised TypeError in ``report`` at the end of such a resume, after
    10 minutes of tuning)."""
    tasks = extract_tasks(mc, mc.phase_keys((8,)))
    d = tmp_path / "log"
    ctx = log_context(LLAMA, mc.spec, None, None)
    with TuningLog(str(d)) as tlog:
        Tuner(mc, tasks, tlog, ctx, progress=False).run(trials=24)
        path = pathlib.Path(tlog.path)
    defaults = {t.workload: canonical_knobs(t.default_knobs) for t in tasks}
    lines = path.read_text().splitlines()
    kept = [ln for ln, r in zip(lines, map(json.loads, lines))
            if canonical_knobs(r["knobs"]) != defaults.get(r["workload"])]
    assert len(kept) < len(lines)
    path.write_text("".join(ln + "\n" for ln in kept))
    with TuningLog(str(d)) as tlog:
        rep = Tuner(mc, tasks, tlog, ctx, progress=False).run(trials=0)
    rows = [r for r in rep["tasks"] if r["best_cycles"] and r["default_cycles"] is None]
    assert rows and all(r["speedup"] is None for r in rows)
    assert format_report(rep)


def test_a_time_budget_covers_the_baselines(tmp_path, mc):
    """The defaults' baselines count against ``time_budget`` (before, every task's defaults
    were measured first, minutes on a large model): a budget of half a second reaches a
    few tasks and leaves the others at their defaults, every measurement logged."""
    d = str(tmp_path / "log")
    tasks = extract_tasks(mc, mc.phase_keys((8, 16)))
    with TuningLog(d) as tlog:
        rep = Tuner(mc, tasks, tlog, log_context(LLAMA, mc.spec, None, None),
                    progress=False).run(time_budget=0.5)
    rows = rep["tasks"]
    assert rep["measured"] >= 1
    assert 1 <= sum(r["default_cycles"] is not None for r in rows) < len(rows) / 2
    assert sum(r["trials"] for r in rows) == rep["measured"]
    assert len(TuningLog(d).records()) == rep["measured"]


def test_baselines_are_measured_only_for_tasks_the_budget_tunes(tmp_path, mc):
    """A baseline alone gains nothing: with 40 trials for 5 tasks of 4 prefill buckets
    (one baseline each would leave 35 trials), the heavy tasks get baselines and several
    rounds of candidates, and the budget is not spread as a baseline per task first."""
    tasks = extract_tasks(mc, mc.phase_keys((4, 8, 16)))
    assert len(tasks) > 12
    with TuningLog(str(tmp_path / "log")) as tlog:
        tuner = Tuner(mc, tasks, tlog, log_context(LLAMA, mc.spec, None, None),
                      progress=False, seed=0)
        rep = tuner.run(trials=40)
    rows = rep["tasks"]
    tuned = [r for r in rows if r["trials"] > 1]
    assert rep["measured"] == 40 and tuned
    assert any(r["default_cycles"] is None for r in rows)      # some never reached
    assert max(r["trials"] for r in rows) > tuner.batch         # a second round
    # the tasks tuned were the heavy ones: each outweighs (its share of its programs'
    # default latency) every reached task left at its baseline
    totals = tuner.program_defaults()
    weight = {s.task.workload[:12]: tuner.weight(s, totals) * s.default_cycles
              for s in tuner.states if s.default_cycles}
    left = [weight[r["workload"]] for r in rows if r["trials"] == 1 and r["default_cycles"]]
    assert not left or min(weight[r["workload"]] for r in tuned) >= 0.5 * max(left)


def test_a_clusters_default_ladder_is_measured_in_both_orders_before_the_models_picks(
        tmp_path, mc):
    """Tuner._propose: a cluster's first batches start with its seeds, the build's default
    knob sets per row tile (16 rows, then 8, ...) in either order (list-scheduled ones of
    several row tiles also with resident weights), at most half a batch
    each round, never one already measured; then the model's picks fill the batch."""
    from edgetvm.npu_regions import default_knobs
    t = next(t for t in extract_tasks(mc, [("prefill", 16, 1)])
             if t.kind == "cluster" and len(t.shape["matmuls"]) >= 2)
    seeds = t.seeds()
    ladder = default_knobs(16, t.shape["matmuls"])
    assert len(ladder) == 4 and [kn["tile_m"] for kn in ladder] == [16, 16, 8, 4]
    # list-scheduled rungs of several row tiles once more with their weights resident
    assert sorted((p["tile_m"], p["list_schedule"], p["resident_w"]) for p in seeds) == \
        sorted([(kn["tile_m"], ls, 0) for kn in ladder for ls in (0, 1)] +
               [(kn["tile_m"], 1, 1) for kn in ladder if kn["tile_m"] < 16])
    assert all(t.to_point(t.to_knobs(p)) == p for p in seeds)       # all in the space
    # resident weights have no weight-tile copies: points that differ only there are one
    # knob set, measured once
    res = next(p for p in seeds if p["resident_w"])
    other = {**res, **{k: 2 for k in res if k.endswith(".slots_w")}}
    assert all(res[k] == 1 for k in res if k.endswith(".slots_w")) and other != res
    assert canonical_knobs(t.to_knobs(other)) == canonical_knobs(t.to_knobs(res))
    assert canonical_knobs(t.to_knobs({**other, "resident_w": 0})) != \
        canonical_knobs(t.to_knobs({**res, "resident_w": 0}))
    # each the matmul tiles of its rung (the space's value at or just below), not the
    # defaults': the 8-row rung's down projection takes a quarter of k = 160
    eight = next(p for p in seeds if p["tile_m"] == 8)
    assert ladder[2]["matmul"]["s3"]["tile_k"] == 40 and eight["s3.tile_k"] == 32
    assert eight["s0.tile_n"] == ladder[2]["matmul"]["s0"]["tile_n"] == 64
    with TuningLog(str(tmp_path / "log")) as tlog:
        tuner = Tuner(mc, [t], tlog, log_context(LLAMA, mc.spec, None, None),
                      progress=False, seed=0)
        s = tuner.states[0]
        # (seeds whose command streams would be too long to lower are left out, as any
        # candidate: the 8- and 4-row rungs' small tiles here)
        keys = [canonical_knobs(t.to_knobs(p)) for p in tuner._affordable(t, seeds)]
        assert len(keys) == 4
        first = [canonical_knobs(k) for k in tuner._propose(s, 4)]
        assert len(first) == 4 and first[:2] == keys[:2]
        s.seen |= set(first)
        second = [canonical_knobs(k) for k in tuner._propose(s, 4)]
        assert len(second) == 4 and second[:2] == keys[2:]
        assert not set(second) & set(first)
        s.seen |= set(keys)
        assert not set(canonical_knobs(k) for k in tuner._propose(s, 4)) & set(keys)


def test_the_best_knobs_of_another_measuring_context_are_measured_first(tmp_path, mc):
    """A task whose neighbours changed (its records are of another context): a tune
    measures the best knob sets found there first, before the template's own seeds, up to
    ``CARRIED`` per context, the latest context first, none already measured in this
    context nor twice; the cycles of the other contexts are never taken as this one's."""
    from edgetvm.tune.log import Record
    from edgetvm.tune.tuner import CARRIED
    import random
    t = next(t for t in extract_tasks(mc, [("prefill", 16, 1)])
             if t.kind == "cluster" and len(t.shape["matmuls"]) >= 2)
    ctx = log_context(LLAMA, mc.spec, None, None)
    with TuningLog(str(tmp_path / "log")) as tlog:
        probe = Tuner(mc, [t], tlog, ctx, progress=False, seed=0)
        pts = probe._affordable(t, t.sample(random.Random(3), 40, set()))
        ladder = {canonical_knobs(t.to_knobs(p)) for p in t.seeds()}
        pts = [p for p in pts if canonical_knobs(t.to_knobs(p)) not in ladder][:9]
        kn = [t.to_knobs(p) for p in pts]

        def rec(k, cycles, neighbours, time):
            return Record(ctx, t.workload, t.kind, t.label, k, OK, cycles=cycles,
                          neighbours=neighbours, time=time)
        # an old context: five records (the best four carried, best first); a newer one:
        # two; this context: one of the old context's best, measured already
        for i, c in enumerate((500, 100, 300, 200, 400)):
            tlog.append(rec(kn[i], c, "old-neighbours", 1000.0 + i))
        tlog.append(rec(kn[5], 700, "newer-neighbours", 2000.0))
        tlog.append(rec(kn[1], 900, "newer-neighbours", 2001.0))      # also carried there
        tlog.append(rec(kn[6], 50, "newer-neighbours", 2002.0))
        tlog.append(rec(kn[3], 10_000, t.context, 3000.0))            # seen here
        tuner = Tuner(mc, [t], tlog, ctx, progress=False, seed=0)
    s = tuner.states[0]
    want = [kn[6], kn[5], kn[1], kn[2], kn[4], kn[0]]
    assert CARRIED == 4 and [canonical_knobs(k) for k in s.carried] == \
        [canonical_knobs(k) for k in want]
    assert s.best_cycles == 10_000 and s.trials == 1     # only this context's record counts
    first = [canonical_knobs(k) for k in tuner._propose(s, 8)]
    assert first[:4] == [canonical_knobs(k) for k in want[:4]]      # half the batch
    s.seen |= set(first)
    second = [canonical_knobs(k) for k in tuner._propose(s, 8)]
    assert second[:2] == [canonical_knobs(k) for k in want[4:]]
    assert canonical_knobs(kn[3]) not in first + second


def test_the_best_knobs_of_an_earlier_emulator_model_are_measured_again_first(tmp_path, mc):
    """After the emulator model changed (its version is part of a record's key) a log's
    records no longer count, but its best knobs are still the best guess: a tune measures
    them first (carried, ``CARRIED`` per context), even beside the same neighbours; the
    records of another profile or another model are not carried, and no old record's
    cycles are taken as this version's."""
    import dataclasses

    from edgetvm.tune.log import Record
    import random
    t = next(t for t in extract_tasks(mc, [("prefill", 16, 1)])
             if t.kind == "cluster" and len(t.shape["matmuls"]) >= 2)
    ctx = log_context(LLAMA, mc.spec, None, None)
    old = dataclasses.replace(ctx, emulator=ctx.emulator - 1, edgetvm="0.0.1")
    other_profile = dataclasses.replace(old, profile="balanced")
    other_model = dataclasses.replace(old, model="0" * 64)
    with TuningLog(str(tmp_path / "log")) as tlog:
        probe = Tuner(mc, [t], tlog, ctx, progress=False, seed=0)
        pts = probe._affordable(t, t.sample(random.Random(5), 40, set()))
        ladder = {canonical_knobs(t.to_knobs(p)) for p in t.seeds()}
        kn = [t.to_knobs(p) for p in pts if canonical_knobs(t.to_knobs(p)) not in ladder][:8]
        for i, c in enumerate((300, 100, 200)):
            tlog.append(Record(old, t.workload, t.kind, t.label, kn[i], OK, cycles=c,
                               neighbours=t.context, time=1000.0 + i))
        for i, cx in ((3, other_profile), (4, other_model)):
            tlog.append(Record(cx, t.workload, t.kind, t.label, kn[i], OK, cycles=1,
                               neighbours=t.context, time=2000.0 + i))
        tuner = Tuner(mc, [t], tlog, ctx, progress=False, seed=0)
    s = tuner.states[0]
    assert [canonical_knobs(k) for k in s.carried] == \
        [canonical_knobs(kn[i]) for i in (1, 2, 0)]
    assert s.best_cycles is None and s.trials == 0
    first = [canonical_knobs(k) for k in tuner._propose(s, 8)]
    assert first[:3] == [canonical_knobs(kn[i]) for i in (1, 2, 0)]


def test_every_program_counts_alike_in_a_tasks_weight(tmp_path, mc):
    """Tuner.weight: a task's occurrences over its programs' default cycles (a program's
    default is its tasks' occurrences x cycles). A kernel of a short program weighs more
    per occurrence than one of a long program."""
    tasks = extract_tasks(mc, mc.phase_keys((4, 16)))
    with TuningLog(str(tmp_path / "log")) as tlog:
        tuner = Tuner(mc, tasks, tlog, log_context(LLAMA, mc.spec, None, None),
                      progress=False)
    for i, s in enumerate(tuner.states):
        s.default_cycles = 1000 * (i + 1)           # as if measured
    totals = tuner.program_defaults()
    for prog, total in totals.items():
        part = sum(s.task.per_program[prog] * s.default_cycles for s in tuner.states
                   if prog in s.task.per_program)
        assert part == total
    one = [s for s in tuner.states if len(s.task.per_program) == 1]
    owned = {p for s in one for p in s.task.per_program}     # programs with a task alone
    short = min(owned, key=totals.get)
    long_ = max(owned, key=totals.get)
    assert totals[short] < totals[long_]
    a = next(s for s in one if short in s.task.per_program)
    b = next(s for s in one if long_ in s.task.per_program)
    assert tuner.weight(a) == pytest.approx(a.task.per_program[short] / totals[short])
    assert tuner.weight(a) / a.task.count > tuner.weight(b) / b.task.count


def test_the_cost_model_learns_another_tasks_records_before_measuring(tmp_path, mc):
    """Tuner.learn: the model ranks a task's first round from another task's
    measurements (its defaults' record is the scale); without that record it learns
    nothing."""
    a, b = [t for t in extract_tasks(mc, [("prefill", 16, 1), ("prefill", 8, 1)])
            if t.name.count("+") == 3][:2]
    assert a.workload != b.workload
    ctx = log_context(LLAMA, mc.spec, None, None)
    with TuningLog(str(tmp_path / "a")) as tlog:
        Tuner(mc, [a], tlog, ctx, progress=False, seed=0).run(trials=24)
    recs = TuningLog(str(tmp_path / "a")).records()
    with TuningLog(str(tmp_path / "b")) as tlog:
        tuner = Tuner(mc, [b], tlog, ctx, progress=False, seed=0)
        assert not tuner.model.trained
        no_default = [r for r in recs if r.knobs_key != canonical_knobs(a.default_knobs)]
        assert tuner.learn(a, no_default) == 0 and not tuner.model.trained
        assert tuner.learn(a, recs) == sum(1 for r in recs if r.cycles) >= 8
        assert tuner.model.trained
    assert TuningLog(str(tmp_path / "b")).records() == []      # nothing measured
    # what it learned from the 16-row MLP orders the 8-row MLP's candidates (chance: rho
    # about 0 +- 0.26 over 15 candidates)
    with TuningLog(str(tmp_path / "b2")) as tlog:
        Tuner(mc, [b], tlog, ctx, progress=False, seed=1, use_model=False).run(trials=16)
    got = [r for r in TuningLog(str(tmp_path / "b2")).records() if r.status == OK]
    pred = tuner.model.predict(np.stack([features(b, r.knobs, mc.spec) for r in got]))
    rho = _spearman(pred, [r.cycles for r in got])
    assert len(got) >= 12 and rho > 0.5, rho


def test_candidates_with_far_more_tile_operations_than_the_defaults_are_never_proposed(
        tmp_path):
    """A prefill-512 attention at 8x16 tiles issues 27x the default's commands (minutes to
    lower): proposals stay within MAX_TILE_OPS x the defaults' tile operations, counted
    here from the tile sizes alone."""
    import math
    import random as _random

    from edgetvm.tune.tuner import MAX_TILE_OPS
    big = ModelCompiler(LLAMA, max_rows=512)
    t = next(t for t in extract_tasks(big, [("prefill", 512, 32)])
             if t.kind == "prefill_attention")

    def ops(kn):
        return math.ceil(512 / kn["tile_q"]) * math.ceil(t.shape["capacity"] / kn["tile_kv"])
    assert any(ops(t.to_knobs(p)) > MAX_TILE_OPS * ops(t.default_knobs)
               for p in t.sample(_random.Random(0), 64, set()))    # the space has them
    with TuningLog(str(tmp_path / "log")) as tlog:
        tuner = Tuner(big, [t], tlog, log_context(LLAMA, big.spec, None, None),
                      progress=False)
        s = tuner.states[0]
        s.default_cycles = 1                         # no baseline needed to propose
        for _ in range(4):
            batch = tuner._propose(s, 16)
            assert batch
            assert all(ops(kn) <= MAX_TILE_OPS * ops(t.default_knobs) for kn in batch)
            s.seen |= {canonical_knobs(kn) for kn in batch}


def test_ctrl_c_stops_a_tune_with_workers_cleanly_and_loses_nothing(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-tune with
    forked workers: exit 130 within seconds with a note on resuming, no traceback, every
    logged record readable and none twice. The workers used to die holding the pool's
    queue lock, and the tuner hung in the pool's terminate."""
    import os
    import signal
    import subprocess
    import sys
    import time

    log_dir = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgetvm.tune", LLAMA, "--buckets", "8,16", "--trials", "500",
         "--workers", "2", "--log", str(log_dir), "-q", "--no-validate"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        records = log_dir / "records.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None and (
                not records.exists() or records.read_text().count("\n") < 6):
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; every measurement made is in" in err
    assert "Traceback" not in err, err[-2000:]
    got = TuningLog(str(log_dir)).records()
    keys = [(r.workload, r.knobs_key, r.neighbours) for r in got]
    assert len(got) >= 6 and len(keys) == len(set(keys))


def test_ctrl_c_that_tvm_turns_into_an_error_still_stops_the_tune(tmp_path):
    """tvm_ffi turns a KeyboardInterrupt raised while C++ is on the stack (a Python
    callback, the FFI's own signal check in a long C++ call) into a RuntimeError with no
    message. The tuner took that for a failed trial, logged the candidate as failed and
    tuned on (a Ctrl-C with no effect, and a candidate never measured again). Here
    SIGINT arrives inside an FFI callback during the third candidate's measurement."""
    import subprocess
    import sys
    import textwrap

    log_dir = tmp_path / "log"
    script = textwrap.dedent(f"""
        import os, signal, sys
        import tvm_ffi
        import edgetvm.tune.measure as m
        real, calls = m.measure_candidate, []

        def measure(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                tvm_ffi.convert(lambda: os.kill(os.getpid(), signal.SIGINT))()
            return real(*a, **k)
        m.measure_candidate = measure
        from edgetvm.tune.cli import main
        sys.exit(main([{LLAMA!r}, "--buckets", "8", "--max-tokens", "64", "--trials", "40",
                       "--log", {str(log_dir)!r}, "-q", "--no-validate"]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert "interrupted; every measurement made is in" in proc.stderr
    got = TuningLog(str(log_dir)).records()
    # the interrupted candidate is not logged failed (nor anything after it)
    assert len(got) <= 2 and all(r.status != FAILED for r in got), got


@pytest.mark.parametrize("argv, message", [
    (["--time-budget", "nan"], "--time-budget must be a finite number of seconds > 0"),
    (["--time-budget", "inf"], "--time-budget must be a finite number of seconds > 0"),
    (["--trials", "5", "--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
    (["--trials", "5", "--timeout", "nan"], "--timeout must be a finite number"),
    (["--trials", "5", "--kinds", "partition", "--no-cuts"], "which --no-cuts leaves out"),
])
def test_tune_refuses_budgets_and_options_that_cannot_work(argv, message, capsys, tmp_path):
    """(--time-budget nan was a ValueError traceback after the front end; --timeout 0
    failed every trial and exited 0.)"""
    with pytest.raises(SystemExit):
        tune_main([LLAMA, "--log", str(tmp_path / "log"), *argv])
    assert message in capsys.readouterr().err


def test_a_trial_that_found_no_server_is_measured_again_on_resume(tmp_path, mc):
    """A trial logged failed because no emulator server answered (all gone, the wrong key)
    says nothing of its candidate: a resumed tune does not count it as tried. A trial
    that failed on its own (here: any other error) stays tried."""
    from edgetvm.tune.log import Record
    tasks = extract_tasks(mc, mc.phase_keys((8,)))
    ctx = log_context(LLAMA, mc.spec, None, None)
    t = tasks[0]
    lost, bad = {"x": 1}, {"x": 2}
    with TuningLog(str(tmp_path / "log")) as tlog:
        for knobs, error in ((lost, "RunnerConnectionError: no server with key 'k' became "
                                    "free on tracker 127.0.0.1:9 within 60 s"),
                             (bad, "ValueError: boom")):
            tlog.append(Record(ctx, t.workload, t.kind, t.label, knobs, FAILED, error=error,
                               neighbours=t.context))
        state = Tuner(mc, tasks, tlog, ctx, progress=False).states[0]
    assert canonical_knobs(bad) in state.seen and canonical_knobs(lost) not in state.seen
    assert state.failed == 1 and state.first_error == "ValueError: boom"


def test_a_tune_whose_every_trial_fails_reports_why(tmp_path):
    """Every candidate over a 0.01 s timeout: the tune reports its failures and the hint
    (it ended in "no successful measurement for this build's context", the report lost)."""
    rep = tune(LLAMA, buckets=(8,), max_tokens=64, phases=["decode_1x4p"], trials=4,
               log_dir=str(tmp_path / "log"), workers=2, timeout=0.01, progress=False)
    assert sum(t["failed"] for t in rep["tasks"]) >= 1
    assert rep["note"].startswith("no candidate was measured") and "raise --timeout" in \
        rep["note"]
    assert rep["note"] in format_report(rep)


def test_the_report_says_which_phase_a_build_replays_with_the_defaults():
    """Kernels measured faster beside their neighbours can add up to a slower step (under
    a binding budget the clock one kernel leaves the next is not in that measurement):
    the report says which program a build with --log builds with the defaults, and why
    (slower by how much, or over the budget), and only for those."""
    rep = dict(tasks=[], stages=[], measured=0, seconds=1.0, log="L", budget_mw=700.0,
               step_cycles_default=0, step_cycles_tuned=0, phases=[
                   dict(program="decode_1x64p", default_cycles=264_668, tuned_cycles=268_766,
                        default_peak_mw=1624.0, tuned_peak_mw=1371.0, replayed="defaults"),
                   dict(program="prefill_128x8p", default_cycles=543_151,
                        tuned_cycles=453_681, default_peak_mw=1681.0, tuned_peak_mw=1590.0,
                        replayed="tuned"),
                   dict(program="prefill_16x8p", default_cycles=543_151,
                        tuned_cycles=453_681, default_peak_mw=600.0, tuned_peak_mw=750.0,
                        replayed="defaults")])
    notes = [ln for ln in format_report(rep).splitlines() if ln.startswith("note")]
    assert len(notes) == 2
    assert "decode_1x64p" in notes[0] and "1.5% slower" in notes[0]
    assert "prefill_16x8p" in notes[1] and "over the budget at the floor clock (750 mW)" \
        in notes[1]
