"""Length buckets for dynamic prompt lengths: optimised (DP) vs the source study's strategies.

Prints a table like the source study's Table 5 (strategy, buckets, boundaries, padding %,
expected latency, variants) for the DP optimum, powers of two, equal 128-wide, one
max_len bucket, the source's own "optimised" boundaries and chunked prefill, all evaluated
the same way (edgetvm/buckets.py).

    python benchmarks/buckets.py [--quick] [--json PATH] [--hist FILE] [--latency-json FILE]
                                 [--variant-cost X] [--chunk C]

``--hist``: CSV ``length,count`` or JSON ``{length: count}``; default the built-in
heavy-tailed log-normal on 128..4096. ``--latency-json``: measured ``(length, cycles)``
points of compiled prefill programs run on the emulator; without it the latency is an
ANALYTIC placeholder and the output says so. ``--quick``: DP on the 16-token grid only
(the full run adds the exact DP over every length).
"""

from __future__ import annotations

import argparse
import os
import dataclasses
import sys
import time

from edgetvm.buckets import (AnalyticLatency, BucketInputError, equal_width_buckets,
                             evaluate_buckets, evaluate_chunked, heavy_tailed_lengths,
                             load_histogram, load_latency_table, optimise_buckets,
                             power_of_two_buckets, single_bucket)
from report import write_json

# EdgeLLM-MLIR, length buckets on its heavy-tailed 128..4096 distribution:
# (padding %, latency proxy); its latency is an analytical proxy, ours is comparable only
# in shape unless measured.
SOURCE = {
    "powers of two": (27.96, 3.311),
    "equal 128-wide": (14.52, 2.631),
    "source's optimised 6": (26.37, 3.122),
    "one max_len bucket": (86.23, 19.139),
}
SOURCE_OPTIMISED = (256, 512, 768, 1152, 2048, 4096)
#: the curve benchmarks/prefill_latency.py measured (SmolLM2-135M on edge-npu-16mb)
MEASURED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "prefill_latency_smollm2_edge-npu-16mb.json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--hist", metavar="FILE")
    ap.add_argument("--latency-json", metavar="FILE",
                    default=MEASURED if os.path.exists(MEASURED) else None,
                    help="measured (length, cycles) points (default: the shipped SmolLM2 "
                         "curve); 'analytic' for the source-fitted placeholder")
    ap.add_argument("--variant-cost", type=float, default=None,
                    help="price of one more program, latency units (default 0.5%% of "
                         "latency(max_len))")
    ap.add_argument("--chunk", type=int, default=256, help="chunked-prefill chunk length")
    args = ap.parse_args(argv)
    if args.latency_json == "analytic":
        args.latency_json = None

    try:
        dist = load_histogram(args.hist) if args.hist else heavy_tailed_lengths()
        if args.latency_json:
            latency = load_latency_table(args.latency_json)
            latency_source = f"measured on emulator from {args.latency_json}"
        else:
            latency = AnalyticLatency()
            latency_source = "ANALYTIC placeholder, not a measurement"
        rows, notes = _rows(dist, latency, args)
    except BucketInputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    unit = getattr(latency, "unit", "")
    print(f"latency source: {latency_source}")
    if not args.latency_json:
        print(f"  latency(b) = {latency.fixed} + {latency.per_token:g} b + "
              f"{latency.per_token_pair:g} b^2 [{unit}], fitted to the source study's proxy")
    print(f"length distribution: {dist.source}; mean {dist.mean_len():.1f} tokens")
    print("padding % = 100 E[(b - l) / b] (the source study's definition); "
          "token overhead % = 100 E[b - l] / E[l]")
    print()
    _print_table(rows, unit)
    for note in notes:
        print(note)

    if args.json:
        out = dict(latency_source=latency_source, latency_unit=unit,
                   distribution=dist.source, mean_len=dist.mean_len(),
                   padding_definition="100 * E[(b - l) / b]",
                   token_overhead_definition="100 * E[b - l] / E[l]",
                   rows=[dict(dataclasses.asdict(r), source_padding_pct=src_pad,
                              source_latency_proxy=src_lat)
                         for r, (src_pad, src_lat) in rows],
                   notes=notes)
        write_json(args.json, out)
    return 0


def _rows(dist, latency, args):
    lengths = dist.lengths
    min_len, max_len = int(lengths[0]), dist.max_len
    variant_cost = args.variant_cost
    if variant_cost is None:
        variant_cost = 0.005 * latency(max_len)
    pow2 = power_of_two_buckets(max_len, min_len)
    notes = []
    rows = []

    def add(result, source_key=None):
        # the source's numbers are for its distribution: only shown next to the built-in one
        source = SOURCE.get(source_key, (None, None)) if not args.hist else (None, None)
        rows.append((result, source))

    t0 = time.perf_counter()
    add(optimise_buckets(dist, latency, max_buckets=len(pow2),
                         name=f"optimised DP, <= {len(pow2)} buckets (grid 16)"))
    notes.append(f"DP (grid 16, <= {len(pow2)} buckets): {time.perf_counter() - t0:.2f} s")
    if not args.quick:
        t0 = time.perf_counter()
        add(optimise_buckets(dist, latency, max_buckets=len(pow2), grid="lengths",
                             name=f"optimised DP, <= {len(pow2)} buckets (every length)"))
        notes.append(f"DP (every length, <= {len(pow2)} buckets): "
                     f"{time.perf_counter() - t0:.2f} s")
    add(optimise_buckets(dist, latency, variant_cost=variant_cost,
                         name=f"optimised DP, variant cost {variant_cost:.4g}"))
    add(evaluate_buckets(pow2, dist, latency, "powers of two"), "powers of two")
    add(evaluate_buckets(equal_width_buckets(max_len, 128, min_len), dist, latency,
                         "equal 128-wide"), "equal 128-wide")
    if max_len == SOURCE_OPTIMISED[-1]:
        add(evaluate_buckets(SOURCE_OPTIMISED, dist, latency, "source's optimised 6"),
            "source's optimised 6")
    add(evaluate_buckets(single_bucket(max_len), dist, latency, f"one {max_len} bucket"),
        "one max_len bucket")
    context = None
    if isinstance(latency, AnalyticLatency):
        # chunk k's C queries also attend to the k*C keys already in the KV cache: the
        # quadratic (attention) term for C x k*C scores
        context = lambda chunk, past: latency.per_token_pair * chunk * past  # noqa: E731
    try:
        add(evaluate_chunked(dist, latency, args.chunk, context_latency=context))
        if context is None:
            notes.append("chunked prefill row ignores attention to earlier chunks' KV "
                         "(no measurement of it): a lower bound")
    except BucketInputError as err:
        notes.append(f"chunked prefill row skipped: {err}")
    return rows, notes


def _print_table(rows, unit):
    head = ["strategy", "buckets", "boundaries", "padding %", "token overhead %",
            f"E[latency] {unit}", "variants", "source padding %", "source latency proxy"]
    body = []
    for r, (src_pad, src_lat) in rows:
        b = r.boundaries
        shown = "/".join(map(str, b)) if len(b) <= 8 else \
            "/".join(map(str, b[:3])) + "/.../" + "/".join(map(str, b[-2:]))
        if r.name.startswith("chunked"):
            shown = f"chunk {b[0]}"
        body.append([r.name, str(len(b)) if not r.name.startswith("chunked") else "-", shown,
                     f"{r.padding_pct:.2f}", f"{r.token_overhead_pct:.2f}",
                     f"{r.expected_latency:.4g}", str(r.variant_count),
                     "-" if src_pad is None else f"{src_pad:.2f}",
                     "-" if src_lat is None else f"{src_lat:.3f}"])
    widths = [max(len(row[i]) for row in [head] + body) for i in range(len(head))]
    for row in [head] + body:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))))


if __name__ == "__main__":
    sys.exit(main())
