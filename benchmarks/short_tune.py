"""A short tune against a long one: does a budget of minutes come within 5 % of the
long-run best? (Issue 10: the bundled example within 5 % of its long-run best in <= 5
minutes on 2 cores.)

Tunes the model for ``--time-budget`` seconds (``edgetvm.tune.cli.tune``: cut points,
then kernels; ``--workers`` local emulator processes) into a fresh log, then measures
every phase program of the build (linked, cross-kernel prefetch, full KV capacity:
``edgetvm.tune.cli.program_counters``) with the defaults, replaying the short log and
replaying ``--long-log`` (default the shipped ``tuning_logs/llama_tiny_with_past``, a
15-minute run; repeated, per program the best of the logs), and prints short / long per
program. The target is met when every
program is within 5 % of the long run's (a program faster than the long run counts as
within).

Numerics (exit 1): replayed, the short log measures exactly what the tuner's own
validation reported for each program; the short-tuned decode at KV 1024 and prefill 128
(``strategies.Bench``) give logits within tolerance of onnxruntime on the same inputs.
A missed target is reported, not an error.

    python benchmarks/short_tune.py [--time-budget 300] [--workers 2] [--seed 0]
        [--rounds N] [--cut-share F] [--model PATH] [--long-log DIR ...] [--quick]
        [--json PATH]

``--quick``: 60 seconds of tuning. Run it on a quiet machine: the budget is wall time,
so other jobs on the cores take trials from it.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import strategies as st
from report import write_json
from tuning import replayed

from edgetvm.build.compiler import ModelCompiler
from edgetvm.tune.cli import CUT_SHARE, ROUNDS, program_counters, tune
from edgetvm.target.spec import load_spec
from edgetvm.tune.log import Replay, TuningLogError, log_context

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "examples" / "llama_tiny_with_past.onnx"
LONG_LOG = REPO / "tuning_logs" / "llama_tiny_with_past"
WITHIN = 1.05
CASES = (("decode @1024", "decode", 1, 1023), ("prefill 128", "prefill", 128, 0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--time-budget", type=float, default=None, metavar="S",
                    help="seconds of tuning (default 300; --quick 60)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help=f"rounds of cut points then tiles (default {ROUNDS})")
    ap.add_argument("--cut-share", type=float, default=CUT_SHARE,
                    help=f"share of a round's budget for cut points (default {CUT_SHARE})")
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--long-log", action="append", default=None, metavar="DIR",
                    help="a long run's log; repeat it for several (per program the best "
                         f"of them counts; default {LONG_LOG.relative_to(REPO)})")
    ap.add_argument("--quick", action="store_true", help="60 seconds of tuning")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    long_logs = args.long_log or [str(LONG_LOG)]
    budget = args.time_budget or (60.0 if args.quick else 300.0)
    model = str(args.model)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="short_tune_") as d:
        rep = tune(model, time_budget=budget, workers=args.workers, seed=args.seed,
                   rounds=args.rounds, cut_share=args.cut_share,
                   log_dir=d, progress=True)
        ctx = log_context(model, load_spec("edge-npu-16mb"), None, None)
        try:
            long_mcs = [ModelCompiler(model, max_rows=512,
                                      **Replay(log, ctx).compiler_options)
                        for log in long_logs]
        except TuningLogError as e:
            print(f"error: --long-log: {e}", file=sys.stderr)
            return 2
        short_mc = ModelCompiler(model, max_rows=512, **Replay(d, ctx).compiler_options)
        rows, wrong = [], []
        for ph in rep["phases"]:
            phase, rest = ph["program"].split("_")
            r, g = (int(x) for x in rest.rstrip("p").split("x"))
            short = program_counters(short_mc, (phase, r, g)).total_cycles
            long_ = min(program_counters(m, (phase, r, g)).total_cycles for m in long_mcs)
            if short != ph["tuned_cycles"]:
                wrong.append(f"{ph['program']}: the short log replays to {short:,} cycles, "
                             f"the tuner reported {ph['tuned_cycles']:,}")
            rows.append(dict(program=ph["program"], default_cycles=ph["default_cycles"],
                             short_cycles=short, long_cycles=long_,
                             short_vs_long=short / long_,
                             within=short <= WITHIN * long_))
        bench = st.Bench(model, None, ["performance"])
        st.MAX_TOKENS = 1024
        bench.mc = ModelCompiler(model, bench.mc.spec, max_tokens=1024, max_rows=512)
        tuned = replayed(bench, model, d, "performance", "regions")
        checks = []
        for case in CASES:
            res = tuned.run("model", case, "regions", "performance")
            checks.append(dict(case=case[0], numerics_ok=res["numerics_ok"],
                               max_abs_diff=res["max_abs_diff"], tolerance=res["tolerance"]))
            if not res["numerics_ok"]:
                wrong.append(f"{case[0]}: max |logit diff| {res['max_abs_diff']:.4f} > "
                             f"{res['tolerance']:.4f}")

    print()
    print(f"{budget:.0f} s of tuning (seed {args.seed}, {args.workers} "
          f"workers): {rep['measured']} measurements in {rep['seconds']:.0f} s; against "
          f"the best of {', '.join(long_logs)}")
    print(f"{'program':<18} {'default':>11} {'short':>11} {'long':>11} {'short/long':>10}")
    for r in rows:
        print(f"{r['program']:<18} {r['default_cycles']:>11,} {r['short_cycles']:>11,} "
              f"{r['long_cycles']:>11,} {r['short_vs_long']:>10.3f}"
              f"{'' if r['within'] else '  over 5 %'}")
    worst = max(rows, key=lambda r: r["short_vs_long"])
    met = all(r["within"] for r in rows)
    print(f"worst: {worst['program']} {100 * (worst['short_vs_long'] - 1):+.1f} % against "
          f"the long run; within 5 % on {sum(r['within'] for r in rows)} of {len(rows)} "
          f"programs: target {'met' if met else 'missed'}")
    for c in checks:
        print(f"numerics {c['case']}: max |logit diff| {c['max_abs_diff']:.4f} (tolerance "
              f"{c['tolerance']:.4f}) {'ok' if c['numerics_ok'] else 'WRONG'}")
    print(f"wall time {(time.time() - t0) / 60:.1f} min")
    if args.json:
        write_json(args.json, {"benchmark": "short_tune", "model": model,
                               "time_budget_s": budget, "workers": args.workers,
                               "seed": args.seed, "rounds": args.rounds,
                               "cut_share": args.cut_share, "long_logs": long_logs,
                               "measured": rep["measured"],
                               "tuning_seconds": round(rep["seconds"], 1),
                               "stages": rep["stages"], "rows": rows, "numerics": checks,
                               "target_met": met, "errors": wrong})
    for w in wrong:
        print(f"WRONG: {w}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
