"""How well the cost model's analytic prior orders a task's knob sets before any
measurement: every point of a task's space (or a seeded sample of ``--points``) measured
as the tuner measures it (in context, between its neighbours, stopped at 4x the
defaults), against the prior (``edgetvm/tune/cost_model.py``: ``prior``).

Per task (the roles of ``search_efficiency.py``; default the two attention kernels): the
points measured, Spearman's rank correlation of prior and cycles, where the prior ranks
the best point (1 = first), and the best of the prior's first 1 and 8 points against the
best of all. The prior only ranks a task's first round (the trees take over from
measurements), so "best of the prior's first 8" is what a first round of 8 would find.

Numerics (exit 1): the defaults' prior is 0, every measured point has cycles > 0, and the
defaults measured again give the same cycles.

    python benchmarks/prior_quality.py [--quick] [--json PATH] [--model PATH]
        [--prefill ROWS] [--roles R1,R2] [--points N] [--seed S]

``--quick``: 24 points per task. The model is ``--model``, else ``$EDGETVM_SMOLLM2`` or
``../smollm2``, else the bundled example.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import numpy as np

from edgetvm.build.compiler import ModelCompiler
from edgetvm.errors import CandidateRejected
from edgetvm.target.emulator import Emulator
from edgetvm.tune.cost_model import prior
from edgetvm.tune.measure import TooSlow, measure_candidate
from report import write_json
from search_efficiency import BUNDLED, ROLES, pick_tasks
from strategies import find_model

SLOW = 4                  # a point is stopped once it costs this many times the defaults
TOP = 8                   # a first round's size


def spearman(a, b) -> float:
    rank = lambda v: np.argsort(np.argsort(v, kind="stable"), kind="stable")  # noqa: E731
    return float(np.corrcoef(rank(np.asarray(a)), rank(np.asarray(b)))[0, 1])


def measure_task(mc, task, n: int, seed: int, profile: str = "performance") -> dict:
    emu = Emulator(mc.spec, profile)
    budget = mc.spec.profile(profile)
    errors = []
    default = measure_candidate(mc, task, task.default_knobs, emu).cycles
    if prior(task, task.default_knobs, mc.spec, profile=budget) != 0.0:
        errors.append(f"{task.label}: the defaults' prior is not 0")
    priors, cycles, rejected, stopped, failed = [], [], 0, 0, []
    # every point of a space of at most ``n`` (``Task.sample`` takes them all), else n
    for p in task.sample(random.Random(seed), n, set()):
        kn = task.to_knobs(p)
        try:
            c = measure_candidate(mc, task, kn, emu, slow_after=SLOW * default).cycles
        except CandidateRejected:
            rejected += 1
            continue
        except TooSlow:
            stopped += 1
            continue
        except Exception as e:          # a failed trial to the tuner; here, a reported one
            failed.append(f"{kn}: {e!r}"[:300])
            continue
        if not c or c <= 0:
            errors.append(f"{task.label}: {kn} measured {c!r} cycles")
            continue
        priors.append(prior(task, kn, mc.spec, profile=budget))
        cycles.append(int(c))
    again = measure_candidate(mc, task, task.default_knobs, emu).cycles
    if again != default:
        errors.append(f"{task.label}: the defaults measured {default} then {again} cycles")
    row = dict(task=task.label, kind=task.kind, space=task.space_size, measured=len(cycles),
               rejected=rejected, stopped=stopped, failed=failed, default_cycles=default,
               errors=errors)
    if len(cycles) >= 2:
        order = np.argsort(priors, kind="stable")
        best = min(cycles)
        row.update(spearman=spearman(priors, cycles), best_cycles=best,
                   best_prior_rank=1 + int(min(np.nonzero(np.asarray(cycles)[order] ==
                                                          best)[0])),
                   top1_vs_best=cycles[order[0]] / best,
                   top8_vs_best=min(cycles[i] for i in order[:TOP]) / best)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="24 points per task")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    ap.add_argument("--model", help="a text-generation-with-past ONNX export")
    ap.add_argument("--prefill", type=int, default=128, metavar="ROWS")
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--roles", default="prefill attention,decode attention",
                    help=f"comma-separated, of: {', '.join(ROLES)}")
    ap.add_argument("--points", type=int, default=None,
                    help="points per task: the whole space up to this many, else a "
                         "sample (default 400; --quick 24)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default="performance",
                    help="power profile the points are measured under (default performance)")
    args = ap.parse_args(argv)
    roles = [r.strip() for r in args.roles.split(",") if r.strip()]
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        ap.error(f"unknown role(s) {unknown}; known: {', '.join(ROLES)}")
    n = args.points or (24 if args.quick else 400)
    model = args.model or find_model() or BUNDLED
    print(f"model: {model}, profile {args.profile}")
    t0 = time.time()
    mc = ModelCompiler(str(model), "edge-npu-16mb", max_tokens=args.max_tokens,
                       max_rows=args.prefill, profile=args.profile)
    keys = mc.phase_keys((args.prefill,))
    prefill_key = min(k for k in keys if k[0] == "prefill" and k[1] == args.prefill)
    decode_key = max(k for k in keys if k[0] == "decode")
    tasks = pick_tasks(mc, decode_key, prefill_key)
    rows = []
    for role in roles:
        if tasks[role] is None:
            print(f"{role}: the model has no such task")
            continue
        r = measure_task(mc, tasks[role], n, args.seed, args.profile)
        r["role"] = role
        rows.append(r)
        print(f"  {role}: {r['measured']} points measured ({r['rejected']} over the TCM, "
              f"{r['stopped']} stopped, {len(r['failed'])} failed) in "
              f"{time.time() - t0:.0f} s", flush=True)
        for f in r["failed"]:
            print("    failed:", f)
    print()
    print(f"{'task':<22} {'space':>7} {'measured':>8} {'spearman':>8} {'best':>10} "
          f"{'prior rank of best':>18} {'prior top-1':>11} {'top-8':>7}")
    for r in rows:
        if "spearman" not in r:
            print(f"{r['role']:<22} {r['space']:>7} {r['measured']:>8}  (too few points)")
            continue
        print(f"{r['role']:<22} {r['space']:>7} {r['measured']:>8} {r['spearman']:>8.3f} "
              f"{r['best_cycles']:>10,} {r['best_prior_rank']:>18} "
              f"{r['top1_vs_best']:>10.3f}x {r['top8_vs_best']:>6.3f}x")
    print("prior top-1 / top-8: the best cycles among the prior's first 1 / 8 points, "
          "over the best of all measured")
    errors = [e for r in rows for e in r["errors"]]
    for e in errors:
        print("ERROR:", e)
    print(f"wall time {(time.time() - t0) / 60:.1f} min")
    if args.json:
        write_json(args.json, {"benchmark": "prior_quality", "model": str(model),
                               "prefill": args.prefill, "profile": args.profile, "points": n,
                               "seed": args.seed,
                               "rows": rows, "errors": errors})
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
