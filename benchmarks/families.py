"""Decoder families on the NPU: what is recognised, what runs where, and whether the answer
is right.

For every tiny with-past export of tests/data (``*_tiny_with_past.onnx``: one per decoder
family the project runs, see tests/data/README.md) and any ``--model`` given:

- ``coverage_pct`` / ``npu_share_pct``: FLOPs in recognised regions / in regions that run
  on the NPU, over all FLOPs of a decode step at the KV capacity (``python -m
  edgetvm.inspect``'s definition);
- ``npu_regions`` / ``host_regions``: region calls on the NPU / recognised but kept on the
  host (by kind);
- greedy generation of ``--tokens`` tokens from prompt ids 5,17,42,7 on the emulator and
  in onnxruntime (present fed back as past): ``token_exact`` and the worst step's
  ``max_logits_diff`` against its allowance ``0.01 + 0.01 * max|logit|``;
- ``decode_us`` (median emulated NPU time of a decode step) and its DRAM bytes.

    python benchmarks/families.py [--quick] [--json PATH] [--model PATH ...]

Exits 1 if a family's ids differ from onnxruntime's or its logits are out of tolerance.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from edgetvm.generate import KVSpec, greedy, onnxruntime_runner, tokens_of
from edgetvm.inspect import inspect_model
from edgetvm.run import compare_logits
from edgetvm.session import NPUSession
from report import write_json

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
#: every family export of tests/data (a family added there is measured here too)
FAMILIES = tuple(sorted(p.name.removesuffix("_tiny_with_past.onnx")
                        for p in DATA.glob("*_tiny_with_past.onnx")))
PROMPT = [5, 17, 42, 7]


def measure(path: str, tokens: int) -> dict:
    t0 = time.time()
    _, (report,), _ = inspect_model(path)
    session = NPUSession(path, max_tokens=256)
    kv = KVSpec.of(path)
    recs = greedy(session, kv, PROMPT, tokens)
    ref = greedy(onnxruntime_runner(path), kv, PROMPT, tokens)
    ok, worst, allowed = compare_logits(recs, ref, 0.01, 0.01)
    decode = [r for r in recs if r.phase == "decode"]
    return {
        "model": Path(path).name,
        "coverage_pct": round(100 * report.coverage, 2),
        "npu_share_pct": round(100 * report.npu_share, 2),
        "npu_regions": sum(1 for _ in session.regions),
        "npu_kinds": dict(Counter(r.kind for r in session.regions)),
        "host_regions": report.host_region_counts(),
        "generic_ops": dict(sum((Counter(row.generic_ops) for row in report.layers),
                                Counter())),
        "tokens": tokens_of(recs),
        "token_exact": tokens_of(recs) == tokens_of(ref),
        "logits_ok": bool(ok),
        "max_logits_diff": worst,
        "allowed": allowed,
        "decode_us": float(np.median([session.spec.cycles_to_us(r.npu_cycles)
                                      for r in decode])) if decode else None,
        "decode_dram_read_B": int(np.median([r.dram_read_bytes for r in decode]))
        if decode else None,
        "wall_s": round(time.time() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="4 generated tokens instead of 16")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    ap.add_argument("--model", action="append", default=[],
                    help="another with-past export to measure (repeatable)")
    args = ap.parse_args(argv)
    tokens = 4 if args.quick else 16
    paths = [str(DATA / f"{f}_tiny_with_past.onnx") for f in FAMILIES] + args.model
    print(f"{'model':<30} {'coverage':>8} {'NPU':>7} {'regions NPU/host':>16} "
          f"{'exact':>5} {'max|dlogit|':>11} {'allowed':>8} {'decode_us':>9}  host")
    rows, wrong = [], []
    for path in paths:
        r = measure(path, tokens)
        rows.append(r)
        host = ", ".join(f"{k}x{n}" for k, n in {**r["host_regions"], **r["generic_ops"]}
                         .items()) or "-"
        print(f"{r['model']:<30} {r['coverage_pct']:>7.2f}% {r['npu_share_pct']:>6.2f}% "
              f"{r['npu_regions']:>8}/{sum(r['host_regions'].values()):<7} "
              f"{'yes' if r['token_exact'] else 'NO':>5} {r['max_logits_diff']:>11.2e} "
              f"{r['allowed']:>8.2e} {r['decode_us']:>9.1f}  {host}", flush=True)
        if not (r["token_exact"] and r["logits_ok"]):
            wrong.append(r["model"])
    if args.json:
        write_json(args.json, {"tokens": tokens, "prompt": PROMPT, "rows": rows})
    if wrong:
        print("WRONG ANSWER (ids or logits differ from onnxruntime): " + ", ".join(wrong),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
