"""Where a whole phase program's cycles go: per kind of kernel, its share of the step and
what each unit did meanwhile, measured from the emulator's trace of the program.

The program is the one ``benchmarks/tuning.py`` measures (a replayed tuning log with
``--log``, else default knobs), run once on the same inputs, its logits checked against
onnxruntime (a run outside tolerance fails the benchmark). Per kernel kind (the kernels'
names with their layer numbers folded, ``L#.attention``):

* ``wall``: cycles from each of its kernels' first command to the next kernel's first
  command (kernels overlap at their boundaries, so a kernel's time is counted from its
  start to its successor's; the shares add up to the step);
* per unit: the cycles the kernels' commands kept that unit busy (at the clock the
  governor set: a throttled command takes longer);

and the step's totals: cycles, throttled cycles, the compute (prefill) or bandwidth
(decode) roofline ratio. ``--no-budget`` runs the same program with the profile's power
budget lifted (a device that never throttles): what throttling costs, side by side.

    python benchmarks/phase_breakdown.py [--log DIR] [--strategy local] [--quantize G]
        [--case p512|p128|d1024] [--profile performance] [--no-budget] [--model PATH]
        [--prefetch-at-end] [--quick] [--json PATH]

Without ``--model``, SmolLM2-135M (``$EDGETVM_SMOLLM2`` or ``../smollm2``), else the
bundled example; ``--quick``: the bundled example at prefill 128.
"""
from __future__ import annotations

import argparse
import bisect
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

import strategies as st
import tuning as tu
from report import numerics_exit_code, write_json

from edgetvm.build.compiler import ModelCompiler
from edgetvm.target.isa import Launch
from edgetvm.target.spec import PowerProfile
from edgetvm.tune.log import TuningLogError


def breakdown(program, result) -> list:
    """Rows per kernel kind: kernels, wall cycles (start to the next kernel's start) and
    busy cycles per unit, from ``result``'s trace (commands before the first launch count
    as ``(before the first kernel)``)."""
    launches = [(i, re.sub(r"\d+", "#", c.name)) for i, c in enumerate(program.commands)
                if isinstance(c, Launch)]
    first = [i for i, _ in launches]
    start: dict = {}
    busy: dict = defaultdict(Counter)
    for e in result.trace:
        k = bisect.bisect_right(first, e.index) - 1
        start[k] = min(start.get(k, e.start), e.start)
        busy[k][e.unit] += e.end - e.start
    order = sorted(start, key=lambda k: start[k])
    end = result.counters.total_cycles
    kinds: dict = {}
    for j, k in enumerate(order):
        name = launches[k][1] if k >= 0 else "(before the first kernel)"
        row = kinds.setdefault(name, {"kind": name, "kernels": 0, "wall": 0.0,
                                      "busy": Counter()})
        row["kernels"] += 1
        row["wall"] += (start[order[j + 1]] if j + 1 < len(order) else end) - start[k]
        row["busy"].update(busy[k])
    rows = sorted(kinds.values(), key=lambda r: -r["wall"])
    for r in rows:
        r["busy"] = {u: round(v) for u, v in sorted(r["busy"].items()) if v}
        r["wall"] = round(r["wall"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--log", help="replay this tuning log (default: default knobs)")
    ap.add_argument("--strategy", default="local")
    ap.add_argument("--quantize", type=int, default=None, metavar="G")
    ap.add_argument("--case", choices=sorted(tu.CASES), default="p512")
    ap.add_argument("--profile", default="performance")
    ap.add_argument("--no-budget", action="store_true",
                    help="also run with the profile's power budget lifted")
    ap.add_argument("--prefetch-at-end", action="store_true",
                    help="queue each kernel's prefetch at the end of the kernel before, "
                         "never spread under it (link.py: the linker's choice before)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quick", action="store_true", help="the bundled example, prefill 128")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    args = ap.parse_args(argv)
    if args.quick:
        model, case = tu.BUNDLED, tu.CASES["p128"]
    else:
        model = Path(args.model) if args.model else (st.find_model() or tu.BUNDLED)
        case = tu.CASES[args.case]
    print(f"model: {model}", flush=True)
    st.MAX_TOKENS = tu.MAX_TOKENS
    quantize = None
    if args.quantize:
        from edgetvm.relax_passes import QuantizeW4A16
        quantize = QuantizeW4A16(group_size=args.quantize)
    bench = st.Bench(str(model), quantize, [args.profile])
    bench.mc = ModelCompiler(str(model), bench.mc.spec, max_tokens=tu.MAX_TOKENS, max_rows=512,
                             strategy=args.strategy, quantize=quantize)
    if args.log:
        try:
            bench = tu.replayed(bench, model, args.log, args.profile, args.strategy, quantize)
        except TuningLogError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    bench.mc.spread_prefetch = not args.prefetch_at_end
    spec = bench.mc.spec
    runs = [("budget", None)]
    if args.no_budget:
        lifted = PowerProfile(args.profile, 1e12, spec.profile(args.profile).dvfs_exponent)
        runs.append(("no budget", spec.replace(power_profiles={
            **spec.power_profiles, args.profile: lifted})))
    out = []
    for label, run_spec in runs:
        row = bench.run("model", case, args.strategy, args.profile, trace=True, spec=run_spec)
        program, result = bench.last_run
        row.update(run=label, kinds=breakdown(program, result))
        out.append(row)
        ratio = row.get("bandwidth_roofline_ratio", row.get("compute_roofline_ratio"))
        print(f"\n{case[0]}, {args.profile}, {label}: {row['cycles']:,} cycles, throttled "
              f"{row['throttled_cycles']:,}, {ratio:.3f}x the roofline, numerics "
              f"{'ok' if row['numerics_ok'] else 'WRONG'}")
        units = sorted({u for k in row["kinds"] for u in k["busy"]})
        print(f"{'kernel kind':<48} {'n':>4} {'wall':>12} {'share':>6} " +
              " ".join(f"{u:>11}" for u in units))
        for k in row["kinds"]:
            name = k["kind"] if len(k["kind"]) <= 48 else k["kind"][:45] + "..."
            print(f"{name:<48} {k['kernels']:>4} {k['wall']:>12,} "
                  f"{k['wall'] / row['cycles']:>6.1%} " +
                  " ".join(f"{k['busy'].get(u, 0):>11,}" for u in units))
    if args.json:
        write_json(args.json, {"benchmark": "phase_breakdown", "model": str(model),
                               "strategy": args.strategy, "quantize": args.quantize,
                               "log": args.log, "case": case[0], "rows": out})
    return numerics_exit_code(out, ("case", "run"))


if __name__ == "__main__":
    sys.exit(main())
