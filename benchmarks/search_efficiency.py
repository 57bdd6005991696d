"""Search efficiency of the tuner: trials to reach within 5 % of the best schedule, cost
model vs random sampling (issue 10's target: the model needs <= 0.2x the trials).

For SmolLM2-135M (else the bundled tiny Llama) on ``edge-npu-16mb``, profile
``performance``, each task below is tuned alone by :class:`~edgetvm.tune.tuner.Tuner`,
once per method and seed, each run with a fresh tuning log:

* decode GEMV chain: the decode cluster with the most (then the largest) matmuls, the MLP;
* prefill MLP cluster: the same at the prefill bucket;
* prefill attention, and decode attention at the largest KV capacity;
* a partition task: the cut points of the prefill bucket's run of fusable ops with the
  largest space (a layer's output projection, residual adds and MLP and the next layer's
  norm and QKV projections; each candidate is that run's clusters linked in context).

Methods: ``model`` (``use_model=True``: the XGBoost model ranks a pool before measuring)
and ``random`` (``use_model=False``: the same pool -- random points plus the neighbours of
the best one -- shuffled). Both measure the default knobs first. A run's curve is its best
cycles after each *measured* trial (ok or failed; a candidate rejected before measuring,
e.g. over the TCM, does not count), read from its log in order. The task's best is the
fewest cycles any run found; a run's trials-to-5 % is the first trial whose best-so-far is
within 5 % of it (never: more than the budget). Medians over the seeds; ratio model/random.
Where the default is already within 5 % of the best that says nothing (goal "n/a"), so
the table also gives the trials to reach 95 % of the way from the default to the best.
Under one seed both methods measure the default first. A cluster with matmuls, an
attention kernel and a partition have their first round ranked by the analytic prior
(``edgetvm/tune/cost_model.py``); random shuffles the same pool.

That is a cold start, which a tune meets only at its first task: ``python -m
edgetvm.tune`` shares one model across its tasks, so when the scheduler reaches a task
the model has already learned the others (the same MLP at other buckets, other runs'
cuts). The third method, ``warm``, measures that: the model first learns a *sister*
task's measurements (:meth:`~edgetvm.tune.tuner.Tuner.learn`; the sister is one
``model`` run of the same role in the programs with half the prefill rows and half the
KV capacity, or where that is the same task, the most similar other task of its kind),
then tunes the task from its first round. Its ratio is warm / random; the sister's
trials are not counted (``--no-warm`` skips it).

Candidates are measured in one forked worker with the tuner's timeout (``--timeout``,
default 10 s): a candidate past it is a failed trial, as in ``python -m edgetvm.tune``.
The tuner itself stops a candidate once it has cost 4x the task's best (a failed trial
with that lower bound, which the cost model learns from); random points of a prefill
MLP's space (tiny tiles, millions of commands, 100x the default's cycles) otherwise
emulate for minutes. None of them is near the best, so neither limit changes a curve,
only the wall time. (The figures in README were measured before the 4x stop existed.)

A space so small that random sampling finds the best in a few trials says little: the
table prints each space's size.

Numerics (exit 1): every log record readable, no measured record with cycles <= 0, the
curve's trial count equal to the tuner's, the knobs the log replays (``Replay``) equal to
the best run's and measuring them again giving the logged cycles, a knob set measured in
two runs giving the same cycles, no knob set measured twice in one run.

    python benchmarks/search_efficiency.py [--quick] [--json PATH] [--model PATH]
        [--quantize G] [--prefill ROWS] [--trials N] [--seeds N]

``--quick``: 24 trials per run, one seed. The model is ``--model``, else
``$EDGETVM_SMOLLM2`` or ``../smollm2`` (``../shared/tools/models/make_smollm2.sh`` builds
it), else the bundled example.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from edgetvm.build.compiler import ModelCompiler
from edgetvm.tune.cli import make_measurer
from edgetvm.tune.log import (FAILED, OK, REJECTED, Replay, TuningLog, canonical_knobs,
                              log_context)
from edgetvm.tune.measure import Measurer
from edgetvm.tune.tasks import extract_partition_tasks, extract_tasks
from edgetvm.tune.tuner import Tuner
from report import write_json
from strategies import find_model

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "examples" / "llama_tiny_with_past.onnx"
METHODS = (("model", True), ("random", False))
WITHIN = 1.05          # "within 5 % of the best"
GOAL = 0.2             # model trials / random trials
GAIN = 0.95            # the second target: 95 % of the way from the default to the best
ROLES = ("decode GEMV chain", "prefill MLP cluster", "prefill attention",
         "decode attention", "partition")


def weight_elems(task) -> int:
    return sum(n * k for n, k, _ in task.shape.get("matmuls", {}).values())


def pick_tasks(mc, decode_key, prefill_key) -> dict:
    """role -> Task (or None when the model has no such kernel)."""
    dec = extract_tasks(mc, [decode_key])
    pre = extract_tasks(mc, [prefill_key])

    def chain(tasks, rows):
        c = [t for t in tasks if t.kind == "cluster" and t.shape["rows"] == rows and
             len(t.shape["matmuls"]) > 1]
        return max(c, key=lambda t: (len(t.shape["matmuls"]), weight_elems(t)), default=None)

    def first(tasks, kind):
        return next((t for t in tasks if t.kind == kind), None)

    out = {"decode GEMV chain": chain(dec, 1),
           "prefill MLP cluster": chain(pre, prefill_key[1]),
           "prefill attention": first(pre, "prefill_attention"),
           "decode attention": first(dec, "decode_attention")}
    # the cut points of the prefill bucket's run of fusable ops with the largest space
    # (a layer's tail, its residual adds and MLP, and the next layer's norm and QKV)
    out["partition"] = max(extract_partition_tasks(mc, [prefill_key]),
                           key=lambda t: (t.space_size, t.key), default=None)
    return out


def pick_sister(mc, role: str, task, keys: list, picked: dict):
    """The task whose measurements warm the cost model for ``task`` (the ``warm``
    method): the same role in the programs ``keys`` (prefill at half the rows, decode at
    half the KV capacity; ``picked``: :func:`pick_tasks` of them), else, when that is
    ``task`` itself (a decode MLP serves every capacity), the most similar other task of
    its kind there: a cluster of the same row count with the most matmuls, another run's
    cuts. None when there is none."""
    if not keys:
        return None
    same = picked[role]
    if same is not None and same.workload != task.workload:
        return same
    if task.kind == "partition":
        pool = extract_partition_tasks(mc, [keys[1]]) + extract_partition_tasks(mc, [keys[0]])
    else:
        pool = [t for t in extract_tasks(mc, list(keys)) if t.kind == task.kind]
        if task.kind == "cluster":
            pool = [t for t in pool if t.shape["rows"] == task.shape["rows"] and
                    t.shape["matmuls"]]
    pool = [t for t in pool if t.workload != task.workload]
    return max(pool, key=lambda t: (len(t.shape.get("matmuls", ())), t.space_size, t.key),
               default=None)


class OneByOne(Measurer):
    """A measurer that hands its inner one a batch's candidates one at a time, so that a
    timeout is a candidate's own: a pool given the whole batch starts every candidate's
    clock when the one before it is collected, and fails the candidates queued behind a
    hung one."""

    def __init__(self, inner):
        self.inner = inner

    def measure(self, task, batch: list, slow_after: int | None = None) -> list:
        return [self.inner.measure(task, [kn], slow_after=slow_after)[0] for kn in batch]

    def close(self) -> None:
        self.inner.close()


def tune_once(mc, task, ctx, seed: int, use_model: bool, trials: int, batch: int,
              timeout: float = 0.0, prior=None) -> dict:
    """One run on a fresh log: its curve, best, and what the checks need. ``prior``:
    (another task, its records) the cost model learns from before the run
    (:meth:`~edgetvm.tune.tuner.Tuner.learn`)."""
    t0 = time.time()
    if timeout:
        # one forked worker: a candidate past ``timeout`` is a failed trial (the tuner's
        # own rule); only the slowest, far-from-best candidates of a huge space hit it
        from edgetvm.tune.measure import ForkMeasurer
        measurer = OneByOne(ForkMeasurer(mc, [task], ctx.profile, 1, timeout))
    else:
        measurer = make_measurer(mc, [task], ctx.profile)
    try:
        with tempfile.TemporaryDirectory(prefix="search_eff_") as d:
            with TuningLog(d) as tlog:
                tuner = Tuner(mc, [task], tlog, ctx, seed=seed, batch=batch,
                              measurer=measurer, use_model=use_model, progress=False)
                learned = tuner.learn(*prior) if prior else 0
                rep = tuner.run(trials=trials)
                recs, skipped = tlog.records(), tlog.skipped
            (row,) = rep["tasks"]
            replayed = None
            if row["best_cycles"]:
                rp = Replay(d, ctx)
                replayed = {"cuts": rp.cuts_for(task.key)} if task.kind == "partition" \
                    else rp(task.key)
        again = None
        if row["best_knobs"] is not None:
            ((res, _),) = measurer.measure(task, [row["best_knobs"]])
            again = res.cycles if not isinstance(res, BaseException) else repr(res)
    finally:
        measurer.close()
    curve, best, measured, errors = [], None, [], []
    for r in recs:
        if r.status == REJECTED:
            continue
        if r.status == OK:
            if not r.cycles or r.cycles <= 0:
                errors.append(f"a measured record with {r.cycles!r} cycles")
                continue
            best = r.cycles if best is None else min(best, r.cycles)
        measured.append((r.knobs_key, r.cycles if r.status == OK else None))
        curve.append(best)
    if skipped:
        errors.append(f"{skipped} unreadable log record(s)")
    if len(curve) != rep["measured"] or len(curve) != row["trials"]:
        errors.append(f"the log has {len(curve)} measured trials, the tuner says "
                      f"{rep['measured']} (task: {row['trials']})")
    if recs and (recs[0].status != OK or
                 recs[0].knobs_key != canonical_knobs(task.default_knobs)):
        errors.append("the first trial is not the default knobs")
    if curve and curve[-1] != row["best_cycles"]:
        errors.append(f"the log's best {curve[-1]} != the tuner's {row['best_cycles']}")
    if row["best_knobs"] is not None:
        if replayed is None or canonical_knobs(replayed) != canonical_knobs(row["best_knobs"]):
            errors.append("the log replays other knobs than the tuner's best")
        if again != row["best_cycles"]:
            errors.append(f"the best knobs measure {again} cycles again, logged "
                          f"{row['best_cycles']}")
    keys = [k for k, _ in measured]
    if len(set(keys)) != len(keys):
        errors.append(f"{len(keys) - len(set(keys))} knob set(s) measured twice in one run")
    if prior and not learned:
        errors.append("the warm start learned nothing from its sister task's records")
    return dict(seed=seed, curve=curve, measured=measured, records=recs, learned=learned,
                best_cycles=row["best_cycles"],
                best_knobs=row["best_knobs"], default_cycles=row["default_cycles"],
                trials=row["trials"], rejected=row["rejected"], failed=row["failed"],
                remeasured_cycles=again, seconds=round(time.time() - t0, 2), errors=errors,
                failures=[dict(knobs=r.knobs, error=r.error) for r in recs
                          if r.status == FAILED])


def trials_to(curve: list, target: float):
    """The first trial count whose best-so-far is <= target, or None."""
    for i, c in enumerate(curve, 1):
        if c is not None and c <= target:
            return i
    return None


def median_trials(values: list) -> float:
    """Median of trial counts; None (never) counts as infinity."""
    return statistics.median([math.inf if v is None else v for v in values])


def trials_ratio(runs: dict, target: float, trials: int) -> tuple:
    """(trials to ``target`` per run, medians, ratio model/random, "<" or ">" when the
    ratio is a bound because one method never got there, goal met)."""
    per = {m: [trials_to(r["curve"], target) for r in rs] for m, rs in runs.items()}
    med = {m: median_trials(v) for m, v in per.items()}
    m, r = med["model"], med["random"]
    if math.isinf(m) and math.isinf(r):
        return per, med, None, "", None
    if math.isinf(r):                         # random needed more than the budget
        return per, med, m / trials, "<", m / trials <= GOAL
    if math.isinf(m):
        return per, med, trials / r, ">", False
    return per, med, m / r, "", m / r <= GOAL


def compare(role: str, task, runs: dict, trials: int) -> dict:
    """The row of one task: best over every run, trials-to-5 % per run, medians, ratio."""
    best = min(r["best_cycles"] for rs in runs.values() for r in rs if r["best_cycles"])
    default = runs["model"][0]["default_cycles"]
    target = WITHIN * best
    cold = {m: runs[m] for m in ("model", "random")}
    per, med, ratio, bound, met = trials_ratio(cold, target, trials)
    warm = None
    if runs.get("warm"):
        w_per, w_med, w_ratio, w_bound, w_met = trials_ratio(
            {"model": runs["warm"], "random": runs["random"]}, target, trials)
        warm = dict(trials_to_5pct=w_per["model"],
                    median_trials_to_5pct=None if math.isinf(w_med["model"])
                    else w_med["model"], ratio=w_ratio, ratio_bound=w_bound,
                    goal_met=None if default and default <= target else w_met,
                    learned=[r["learned"] for r in runs["warm"]])
    # the same with the target 95 % of the way from the default to the best: says
    # something where the default is already within 5 % of the best
    gain_target = best + (1 - GAIN) * ((default or best) - best)
    g_per, g_med, g_ratio, g_bound, g_met = trials_ratio(cold, gain_target, trials)
    notes = []
    if default and default <= target:
        notes.append("the default knobs are within 5 % of the best: nothing to search "
                     "(goal n/a)")
        met = None
    if default == best:
        notes.append("no run beat the default knobs (goal n/a)")
        g_met = None
    if task.space_size <= trials:
        notes.append(f"space of {task.space_size} <= {trials} trials: exhaustible")
    return dict(role=role, task=task.label, kind=task.kind, space=task.space_size,
                default_cycles=default, best_cycles=best, target_cycles=target,
                speedup=default / best if default else None,
                trials_to_5pct=per, median_trials_to_5pct={k: None if math.isinf(v) else v
                                                           for k, v in med.items()},
                ratio=ratio, ratio_bound=bound, goal_met=met,
                gain_target_cycles=gain_target, trials_to_95pct_gain=g_per,
                median_trials_to_95pct_gain={k: None if math.isinf(v) else v
                                             for k, v in g_med.items()},
                gain_ratio=g_ratio, gain_ratio_bound=g_bound, gain_goal_met=g_met,
                notes=notes, warm=warm,
                runs={k: [{x: y for x, y in run.items() if x not in ("measured", "records")}
                          for run in rs] for k, rs in runs.items()})


def cross_check(runs: dict) -> list:
    """A knob set measured in two runs of one task must measure the same cycles."""
    seen, errors = {}, []
    for rs in runs.values():
        for run in rs:
            for k, c in run["measured"]:
                if c is None:
                    continue
                if seen.setdefault(k, c) != c:
                    errors.append(f"knobs {k[:80]} measured {seen[k]} and {c} cycles")
    return errors


def fmt_trials(v, trials: int) -> str:
    return f">{trials}" if v is None or (isinstance(v, float) and math.isinf(v)) else f"{v:g}"


def _ratio(r: dict, prefix: str = "") -> str:
    v = r[prefix + "ratio"]
    return "-" if v is None else f"{r[prefix + 'ratio_bound']}{v:.2f}"


def _goal(met) -> str:
    return "n/a" if met is None else ("met" if met else "missed")


def print_table(rows: list, trials: int, seeds: int) -> None:
    hdr = (f"{'task':<20} {'space':>11} {'default cyc':>12} {'best cyc':>11} {'x':>6} "
           f"{'model':>6} {'random':>6} {'ratio':>6} {'goal':>6} | {'model':>6} "
           f"{'random':>6} {'ratio':>6} {'goal':>6}")
    print(f"measured trials to reach the target, median over {seeds} seed(s) of {trials} "
          f"trials per run; goal: model/random <= {GOAL}x")
    print(f"{'':<64}{'to within 5 % of best':^27} | {'to 95 % of the gain':^27}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if r.get("task") is None:
            print(f"{r['role']:<20} {r['note']}")
            continue
        med, gm = r["median_trials_to_5pct"], r["median_trials_to_95pct_gain"]
        print(f"{r['role']:<20} {r['space']:>11,} {r['default_cycles'] or 0:>12,} "
              f"{r['best_cycles']:>11,} {r['speedup'] or 0:>6.3f} "
              f"{fmt_trials(med['model'], trials):>6} {fmt_trials(med['random'], trials):>6} "
              f"{_ratio(r):>6} {_goal(r['goal_met']):>6} | "
              f"{fmt_trials(gm['model'], trials):>6} {fmt_trials(gm['random'], trials):>6} "
              f"{_ratio(r, 'gain_'):>6} {_goal(r['gain_goal_met']):>6}")
    warm = [r for r in rows if r.get("warm")]
    if warm:
        print()
        print(f"warm start: the model first learns a sister task's {trials} measured trials "
              f"(as one tune's shared model has when its scheduler reaches a task)")
        hdr = f"{'task':<20} {'warm':>6} {'random':>6} {'ratio':>6} {'goal':>6}  sister task"
        print(hdr)
        print("-" * len(hdr))
        for r in warm:
            w = r["warm"]
            print(f"{r['role']:<20} {fmt_trials(w['median_trials_to_5pct'], trials):>6} "
                  f"{fmt_trials(r['median_trials_to_5pct']['random'], trials):>6} "
                  f"{_ratio(w):>6} {_goal(w['goal_met']):>6}  {r['sister']}")
    print()
    for r in rows:
        if r.get("task") is None:
            continue
        print(f"{r['role']}: {r['task']} ({r['kind']})")
        if r.get("warm"):
            print("  per seed to 5 % warm: " + ",".join(
                fmt_trials(v, trials) for v in r["warm"]["trials_to_5pct"]))
        for name, key in (("to 5 %", "trials_to_5pct"),
                          ("to 95 % gain", "trials_to_95pct_gain")):
            per = "; ".join(f"{m} " + ",".join(fmt_trials(v, trials) for v in vs)
                            for m, vs in r[key].items())
            print(f"  per seed {name}: {per}")
        for n in r["notes"]:
            print(f"  note: {n}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="24 trials per run, one seed")
    ap.add_argument("--profile", default="performance",
                    help="power profile the candidates run under (default performance)")
    ap.add_argument("--json", help="write the rows and curves as JSON to this path")
    ap.add_argument("--model", help="a text-generation-with-past ONNX export "
                                    "(default SmolLM2, else the bundled example)")
    ap.add_argument("--quantize", type=int, choices=(32, 64, 128), default=None, metavar="G",
                    help="W4A16 with group G (default: fp16 weights)")
    ap.add_argument("--prefill", type=int, default=128, metavar="ROWS",
                    help="the prefill bucket (default 128)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="KV cache capacity (default: the compiler's)")
    ap.add_argument("--trials", type=int, default=None,
                    help="measured trials per run (default 32; --quick 24)")
    ap.add_argument("--seeds", type=int, default=None, help="default 3; --quick 1")
    ap.add_argument("--batch", type=int, default=8, help="candidates per round (default 8)")
    ap.add_argument("--timeout", type=float, default=10.0, metavar="S",
                    help="seconds a candidate's measurement may take before it is a failed "
                         "trial (default 10, in one forked worker; 0: in this process, no "
                         "limit)")
    ap.add_argument("--no-warm", action="store_true",
                    help="skip the warm start (the model first trained on a sister task)")
    ap.add_argument("--roles", default=None, metavar="R1,R2",
                    help=f"only these tasks, of: {', '.join(ROLES)}")
    args = ap.parse_args(argv)
    trials = args.trials or (24 if args.quick else 32)
    seeds = args.seeds or (1 if args.quick else 3)
    if trials < 2 or seeds < 1:
        ap.error("--trials must be >= 2 and --seeds >= 1")
    roles = [r.strip() for r in args.roles.split(",")] if args.roles else list(ROLES)
    if set(roles) - set(ROLES):
        ap.error(f"--roles: unknown {sorted(set(roles) - set(ROLES))}")
    model = args.model or find_model()
    if model is None:
        model = BUNDLED
        print(f"SmolLM2 not found ($EDGETVM_SMOLLM2, ../smollm2): the bundled example "
              f"{model}")
    print(f"model: {model}")
    quantize = None
    if args.quantize:
        from edgetvm.relax_passes import QuantizeW4A16
        quantize = QuantizeW4A16(group_size=args.quantize)
    t0 = time.time()
    mc = ModelCompiler(str(model), "edge-npu-16mb", quantize=quantize,
                       max_tokens=args.max_tokens, max_rows=args.prefill,
                       profile=args.profile)
    keys = mc.phase_keys((args.prefill,))
    prefill_key = min(k for k in keys if k[0] == "prefill" and k[1] == args.prefill)
    decode_key = max(k for k in keys if k[0] == "decode")
    ctx = log_context(str(model), mc.spec, mc.profile, quantize)
    tasks = pick_tasks(mc, decode_key, prefill_key)
    # the sister programs, whose tasks warm the model (``warm``): half the rows, half the KV
    decodes = sorted(k for k in keys if k[0] == "decode")
    half = mc.phase_keys((args.prefill // 2,)) if args.prefill >= 2 else []
    half_prefill = min((k for k in half if k[0] == "prefill"), default=None)
    sister_keys = (decodes[-2] if len(decodes) > 1 else decode_key, half_prefill) \
        if half_prefill else None
    sisters = pick_tasks(mc, *sister_keys) if sister_keys and not args.no_warm else {}
    print(f"front end and tasks: {time.time() - t0:.1f} s; target {mc.spec.name}, profile "
          f"{mc.profile}, {'W4A16 g' + str(args.quantize) if args.quantize else 'fp16'}; "
          f"decode {decode_key}, prefill {prefill_key}; {trials} trials x {seeds} seed(s) x "
          f"{len(METHODS)} methods per task", flush=True)

    rows, errors = [], []
    for role in roles:
        task = tasks[role]
        if task is None:
            note = "not available: no such kernel" if role != "partition" else \
                "not available: no run of fusable ops with a choice of cuts"
            rows.append(dict(role=role, task=None, note=note))
            print(f"{role}: {note}", flush=True)
            continue
        runs = {}
        for method, use_model in METHODS:
            runs[method] = []
            for seed in range(seeds):
                run = tune_once(mc, task, ctx, seed, use_model, trials, args.batch,
                                args.timeout)
                runs[method].append(run)
                errors += [f"{role} {method} seed {seed}: {e}" for e in run["errors"]]
                print(f"  {role} {method} seed {seed}: best {run['best_cycles'] or 0:,} cycles "
                      f"(default {run['default_cycles'] or 0:,}) after {run['trials']} trials, "
                      f"{run['rejected']} rejected, {run['failed']} failed, "
                      f"{run['seconds']:.0f} s", flush=True)
        sister = None if args.no_warm else pick_sister(mc, role, task, sister_keys,
                                                        sisters)
        if sister is not None:
            runs["warm"] = []
            for seed in range(seeds):
                sis = tune_once(mc, sister, ctx, seed, True, trials, args.batch,
                                args.timeout)
                errors += [f"{role} sister seed {seed}: {e}" for e in sis["errors"]]
                run = tune_once(mc, task, ctx, seed, True, trials, args.batch, args.timeout,
                                prior=(sister, sis["records"]))
                runs["warm"].append(run)
                errors += [f"{role} warm seed {seed}: {e}" for e in run["errors"]]
                print(f"  {role} warm seed {seed} (model first trained on {sis['trials']} "
                      f"trials of {sister.label}): best {run['best_cycles'] or 0:,} cycles "
                      f"after {run['trials']} trials, {run['seconds']:.0f} s", flush=True)
        errors += [f"{role}: {e}" for e in cross_check(runs)]
        rows.append(compare(role, task, runs, trials))
        rows[-1]["sister"] = None if sister is None else sister.label
    wall = time.time() - t0
    print()
    print_table(rows, trials, seeds)
    print("random = the tuner without its cost model: the same pool (random points and the "
          "best one's neighbours), shuffled.")
    print(f"Both methods measure the default first; the model ranks its first round of "
          f"{args.batch} by the analytic prior, random shuffles the same pool.")
    print(f"wall time {wall / 60:.1f} min")
    if args.json:
        write_json(args.json, {"benchmark": "search_efficiency", "model": str(model),
                               "target": mc.spec.name, "profile": mc.profile,
                               "quantize": args.quantize, "decode_key": decode_key,
                               "prefill_key": prefill_key, "trials": trials, "seeds": seeds,
                               "batch": args.batch, "timeout_s": args.timeout,
                               "within": WITHIN, "goal_ratio": GOAL,
                               "wall_s": round(wall, 1), "rows": rows, "errors": errors})
    if errors:
        for e in errors:
            print(f"WRONG: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
