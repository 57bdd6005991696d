"""``python -m edgetvm.run model.onnx --prompt-ids 1,2,3 --max-new-tokens 8``

Compile an LLM (optimum text-generation-with-past ONNX export) for the NPU with the
default, untuned schedules, run prefill then greedy decode on the emulator, and print the
tokens with each step's emulated NPU latency and DRAM traffic. ``--check-onnx`` runs
onnxruntime on the same file step by step (present fed back as past) and fails unless the
generated ids are identical and every step's logits agree within
``atol + rtol * max|reference logits|`` (fp16 activations on the NPU vs fp32 onnxruntime).
``--chunk C`` runs the prompt as chunked prefill: chunks of C tokens, each attending to the
KV of the earlier ones, so one static prefill program (C rows) serves every prompt length.
"""
from __future__ import annotations

import argparse
import logging
import sys

import numpy as np

from edgetvm.errors import EdgeTVMError
from edgetvm.relax_passes.quantize_w4a16 import KEEP_FP16_LAYERS
from edgetvm.relax_passes.w4_pack import ZERO_POINT_KINDS

DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2


def _ids(text: str) -> list:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got "
                                         f"{text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def _layer_names(text: str) -> tuple:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if names == ("none",):
        return ()
    unknown = sorted(set(names) - set(KEEP_FP16_LAYERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"--keep-fp16: unknown layer(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(KEEP_FP16_LAYERS)}")
    return names


def compare_logits(recs, ref, atol: float, rtol: float) -> tuple:
    """(all steps within tolerance, worst diff, its allowance) over matching steps."""
    ok, worst, allowed = True, 0.0, 0.0
    for a, b in zip(recs, ref):
        diff = float(np.abs(a.logits - b.logits).max())
        tol = atol + rtol * float(np.abs(b.logits).max())
        ok &= diff <= tol
        if diff - tol >= worst - allowed or worst == 0.0:
            worst, allowed = diff, tol
    return ok, worst, allowed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgetvm.run", description=__doc__.split("\n")[2])
    ap.add_argument("model", help="ONNX file (text-generation-with-past export)")
    ap.add_argument("--prompt-ids", type=_ids, required=True, help="e.g. 1,504,3575")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--target", default="edge-npu-16mb", help="NPU preset or spec JSON")
    ap.add_argument("--profile", default=None, help="power profile (default: the spec's)")
    ap.add_argument("--check-onnx", action="store_true",
                    help="compare every step with onnxruntime; exit 1 on a mismatch")
    ap.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                    help=f"absolute logits tolerance of --check-onnx (default {DEFAULT_ATOL})")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                    help="logits tolerance relative to the step's max |logit| "
                         f"(default {DEFAULT_RTOL})")
    ap.add_argument("--chunk", type=int, default=None, metavar="C",
                    help="chunked prefill with chunks of C tokens")
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="KV cache capacity in tokens (default 1024)")
    ap.add_argument("--quantize", type=int, choices=(32, 64, 128), default=None, metavar="G",
                    help="quantize fp32/fp16 linears to W4A16 with group size G (32/64/128); "
                         "--check-onnx then compares against the unquantized model")
    ap.add_argument("--zero-points", choices=ZERO_POINT_KINDS, default="float",
                    help="with --quantize: float (default; fitted scale and fp16 zero point "
                         "per group, 5.0 bits/weight at G=32), none (symmetric, 4.5) or "
                         "uint4 (4.75)")
    ap.add_argument("--keep-fp16", type=_layer_names, default=None, metavar="LAYERS",
                    help="with --quantize: comma-separated layers that stay fp16, of "
                         f"{', '.join(KEEP_FP16_LAYERS)}, or none (default: embedding, the "
                         "table and a tied lm_head that is that table)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    if args.chunk is not None and args.chunk < 1:
        ap.error("--chunk must be >= 1")
    if args.quantize is None and (args.keep_fp16 is not None or args.zero_points != "float"):
        ap.error("--zero-points and --keep-fp16 apply to --quantize G")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        from edgetvm.generate import KVSpec, greedy, onnxruntime_runner, tokens_of
        from edgetvm.relax_passes import QuantizeW4A16
        from edgetvm.session import NPUSession

        kv = KVSpec.of(args.model)
        print(f"compiling {args.model} for {args.target} ...", flush=True)
        extra = {"row_buckets": (args.chunk,)} if args.chunk else {}
        quantize = None
        if args.quantize:
            keep = {} if args.keep_fp16 is None else {"keep_fp16": args.keep_fp16}
            quantize = QuantizeW4A16(group_size=args.quantize, zero_points=args.zero_points,
                                     **keep)
        session = NPUSession(args.model, args.target, args.profile,
                             max_tokens=args.max_tokens, quantize=quantize, **extra)
        if session.quant_report is not None:
            print(session.quant_report.summary(), flush=True)
        print(f"{len(session.regions)} regions on the NPU; running "
              f"{args.max_new_tokens} step(s)", flush=True)
        print(f"{'step':<5} {'phase':<8} {'token':>7} {'npu_us':>10} {'npu_cycles':>11} "
              f"{'dram_read_B':>12} {'dram_write_B':>12} {'energy_uJ':>10} {'avg_mW':>7} "
              f"{'peak_mW':>7} {'throttled':>9}")

        def show(rec):
            us = session.spec.cycles_to_us(rec.npu_cycles)
            rec.npu_us = us
            print(f"{len(records_seen):<5} {rec.phase:<8} {rec.token:>7} {us:>10.1f} "
                  f"{rec.npu_cycles:>11} {rec.dram_read_bytes:>12} {rec.dram_write_bytes:>12} "
                  f"{rec.energy_uj:>10.2f} {rec.avg_power_mw:>7.0f} {rec.peak_power_mw:>7.0f} "
                  f"{rec.throttled_cycles:>9}", flush=True)
            records_seen.append(rec)

        records_seen: list = []
        recs = greedy(session, kv, args.prompt_ids, args.max_new_tokens, on_step=show,
                      chunk=args.chunk)
        ids = tokens_of(recs)
        print("generated ids:", ",".join(map(str, ids)))
        if args.check_onnx:
            ref = greedy(onnxruntime_runner(args.model), kv, args.prompt_ids,
                         args.max_new_tokens, chunk=args.chunk)
            ok, worst, allowed = compare_logits(recs, ref, args.atol, args.rtol)
            same = ids == tokens_of(ref)
            print(f"onnxruntime ids: {','.join(map(str, tokens_of(ref)))}")
            print(f"check-onnx: ids {'identical' if same else 'DIFFER'}; worst step: max "
                  f"|logits diff| {worst:.3e}, allowed {allowed:.3e} "
                  f"(atol {args.atol} + rtol {args.rtol} * max|logit|)")
            if not same or not ok:
                return 1
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
