"""Tuned against untuned whole phase programs, and tuning under a binding power budget.

Replays tuning logs (``python -m edgetvm.tune``) into whole phase programs and runs them
on the emulator beside the untuned ones, every program on the same inputs and checked
against onnxruntime (a run outside tolerance fails the benchmark):

* ``untuned local``: default knobs, the ``local`` partition (TVM FuseOps-style);
* ``untuned <strategy>``: default knobs, the tuned log's partition strategy;
* ``tuned <strategy>``: the cuts and knobs of ``--log`` (tuned under ``performance``; the
  strategy's partition with the log's cuts where it has some);
* with ``--budget-log`` (a log tuned under ``--budget-profile``, default ``low-battery``),
  under that profile: the budget-tuned knobs beside the ``performance``-tuned knobs run
  under the budget ("tune unconstrained and let the device throttle"), with each
  program's peak windowed power against the budget.

Cases: decode at KV 1024 (1,023 cached tokens and the new one: the ``decode_1x64p``
program) and prefill 512 from position 0 (``--quick``: decode and prefill 128).

    python benchmarks/tuning.py --log DIR [--budget-log DIR] [--strategy mega]
        [--quantize G] [--model PATH] [--quick] [--json PATH]

The decode rows also give the latency against the bandwidth roofline (the bytes a step
must move over the DRAM bandwidth; ``strategies.Bench.decode_roofline``), the prefill rows
against the compute roofline (the MACs a step must do at the matrix unit's peak;
``strategies.Bench.compute_roofline``) and the bound the program's measured energy sets
under the profile's budget (``strategies.energy_bound``: its energy above static
power over the budget above static power).

Without ``--model``, SmolLM2-135M (``$EDGETVM_SMOLLM2`` or ``../smollm2``), else the
bundled example. A log of another model, spec, profile or version is refused.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import strategies as st
from report import numerics_exit_code, write_json

from edgetvm.build.compiler import ModelCompiler
from edgetvm.tune.log import Replay, TuningLogError, log_context

REPO = Path(__file__).resolve().parent.parent
BUNDLED = REPO / "examples" / "llama_tiny_with_past.onnx"
MAX_TOKENS = 1024
CASES = {"d1024": ("decode @1024", "decode", 1, MAX_TOKENS - 1),
         "p512": ("prefill 512", "prefill", 512, 0),
         "p128": ("prefill 128", "prefill", 128, 0)}


def replayed(bench, model, log_dir, profile, strategy, quantize=None):
    """A copy of ``bench`` whose compiler replays ``log_dir`` (tuned under ``profile``,
    with ``quantize``: a QuantizeW4A16 as ``tune --quantize G`` makes it, or None)."""
    mc = bench.mc
    ctx = log_context(str(model), mc.spec, profile, quantize)
    b = copy.copy(bench)
    b.mc = ModelCompiler(str(model), mc.spec, max_tokens=MAX_TOKENS, max_rows=512,
                         strategy=strategy, profile=profile, quantize=quantize,
                         **Replay(log_dir, ctx).compiler_options)
    b.mc.graph("decode", 1, 1)            # the replayed kernels are looked up from here on
    return b


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--log", required=True, help="tuning log tuned under performance")
    ap.add_argument("--budget-log", default=None,
                    help="tuning log tuned under --budget-profile")
    ap.add_argument("--budget-profile", default="low-battery")
    ap.add_argument("--strategy", default="mega", help="the logs' partition strategy")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantize", type=int, default=None, metavar="G",
                    help="W4A16 with group G, as the logs were tuned with `tune --quantize "
                         "G` (default: fp16)")
    ap.add_argument("--quick", action="store_true", help="decode and prefill 128")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    model = Path(args.model) if args.model else (st.find_model() or BUNDLED)
    print(f"model: {model}", flush=True)
    st.MAX_TOKENS = MAX_TOKENS             # the KV capacity the logs were tuned for
    cases = [CASES["d1024"], CASES["p128" if args.quick else "p512"]]
    profiles = ["performance"] + ([args.budget_profile] if args.budget_log else [])
    quantize = None
    if args.quantize:
        from edgetvm.relax_passes import QuantizeW4A16
        quantize = QuantizeW4A16(group_size=args.quantize)
    bench = st.Bench(str(model), quantize, profiles)
    bench.mc = ModelCompiler(str(model), bench.mc.spec, max_tokens=MAX_TOKENS, max_rows=512,
                             strategy=args.strategy, quantize=quantize)
    try:
        tuned = replayed(bench, model, args.log, "performance", args.strategy, quantize)
        budget = replayed(bench, model, args.budget_log, args.budget_profile,
                          args.strategy, quantize) if args.budget_log else None
    except TuningLogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    budget_mw = bench.mc.spec.profile(args.budget_profile).budget_mw
    rows = []

    def run(b, label, case, strategy, profile):
        r = b.run("model", case, strategy, profile)
        r.update(variant=label, over_budget=r["peak_power_mw"] >
                 bench.mc.spec.profile(profile).budget_mw)
        rows.append(r)
        print(f"  {case[0]} {profile} {label}: {r['cycles']:,} cycles, peak "
              f"{r['peak_power_mw']:.0f} mW, numerics {'ok' if r['numerics_ok'] else 'WRONG'}",
              flush=True)
        return r

    for case in cases:
        base = run(bench, "untuned local", case, "local", "performance")
        variants = [] if args.strategy == "local" else [
            run(bench, f"untuned {args.strategy}", case, args.strategy, "performance")]
        variants.append(run(tuned, f"tuned {args.strategy}", case, args.strategy,
                            "performance"))
        for r in variants:
            r["vs_untuned_local"] = r["cycles"] / base["cycles"]
        base["vs_untuned_local"] = 1.0
        if budget is not None:
            p = args.budget_profile
            free = run(tuned, "tuned under performance, throttled", case, args.strategy, p)
            held = run(budget, f"tuned under {p}", case, args.strategy, p)
            held["vs_throttled"] = held["cycles"] / free["cycles"]

    print()
    print(f"{'case':<14} {'profile':<12} {'variant':<40} {'cycles':>12} {'x local':>8} "
          f"{'x roofl':>7} {'peak mW':>8} {'over':>5} {'numerics':>8}")
    for r in rows:
        x = f"{r['vs_untuned_local']:.3f}" if "vs_untuned_local" in r else ""
        ratio = r.get("bandwidth_roofline_ratio", r.get("compute_roofline_ratio"))
        rf = f"{ratio:.3f}" if ratio is not None else ""
        print(f"{r['case']:<14} {r['profile']:<12} {r['variant']:<40} {r['cycles']:>12,} "
              f"{x:>8} {rf:>7} {r['peak_power_mw']:>8.0f} {str(r['over_budget']):>5} "
              f"{'ok' if r['numerics_ok'] else 'WRONG':>8}")
    for r in rows:
        if "energy_bound_roofline_ratio" in r:
            print(f"{r['case']} {r['profile']} {r['variant']}: "
                  f"{st.roofline_summary(r, 'compute')}")
    for r in rows:
        if "vs_throttled" in r:
            print(f"{r['case']}: tuned under {args.budget_profile} (budget {budget_mw:.0f} mW) "
                  f"is {r['vs_throttled']:.3f}x the latency of the performance-tuned program "
                  f"throttled")
    if args.json:
        write_json(args.json, {"benchmark": "tuning", "model": str(model),
                               "strategy": args.strategy, "quantize": args.quantize,
                               "log": args.log,
                               "budget_log": args.budget_log, "rows": rows})
    return numerics_exit_code(rows, ("case", "profile", "variant"))


if __name__ == "__main__":
    sys.exit(main())
