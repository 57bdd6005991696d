"""``python -m edgetvm.build model.onnx -o model.npu``: compile an LLM into a deployable
artifact (whole-phase programs, one weight pack, a manifest), without search; ``--log DIR``
replays the best knobs of a tuning log (``python -m edgetvm.tune``)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from edgetvm import interrupt
from edgetvm.collector import fewer_collections
from edgetvm.errors import (EdgeTVMError, check_input_file, check_not_overwriting,
                            check_output_file)

from .fingerprint import describe_quantize, model_sha256

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)


def comma_ints(text: str) -> list:
    """The integers of a comma-separated option value (argparse names the option in the
    error): an empty item or one that is not an integer is refused."""
    items = text.split(",")
    if text.strip() and any(not t.strip() for t in items):
        raise argparse.ArgumentTypeError(f"an empty item in {text!r}")
    try:
        return [int(t) for t in items if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None


def ints_option(text: str) -> tuple:
    vals = tuple(comma_ints(text))
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


@fewer_collections()
def build(onnx_path: str, output: str, *, target="edge-npu-16mb", profile=None,
          strategy="regions", buckets=DEFAULT_BUCKETS, chunk=None, quantize=None,
          max_tokens: int | None = None, progress: bool = True, log_dir: str | None = None,
          jobs: int | None = None) -> dict:
    """Compile ``onnx_path`` into ``output`` (model.npu); returns the manifest.
    ``max_tokens``: the KV capacity (default 1024, or fewer if the model addresses fewer
    positions); ``log_dir``: a tuning log whose best knobs per kernel and best cuts per
    run of fusable ops replace the defaults and the strategy's boundaries (refused if its
    records are of another model, spec, profile, quantization or
    version); ``jobs``: processes compiling programs side by side (default: one per
    CPU, at most 4; the artifact does not depend on it)."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.build.package import write_artifact
    from edgetvm.build.workers import compile_programs, default_jobs
    from edgetvm.runtime.model import program_name

    check_input_file(onnx_path)
    t0 = time.time()
    asked = (chunk,) if chunk else tuple(sorted(set(buckets)))
    mc = ModelCompiler(onnx_path, target, quantize=quantize, max_tokens=max_tokens,
                       strategy=strategy, max_rows=max(asked), profile=profile)
    replay = None
    if log_dir is not None:
        from edgetvm.tune.log import Replay, log_context
        replay = Replay(log_dir, log_context(onnx_path, mc.spec, mc.profile, quantize))
        mc.replay(replay)
    rows = prefill_rows(asked, mc.max_tokens, chunk)
    keys = mc.phase_keys(rows, chunked=bool(chunk))
    jobs = default_jobs() if jobs is None else jobs
    bar = _progress(len(keys), progress)
    bar.set_description(f"compiling {len(keys)} programs" +
                        (f" in {min(jobs, len(keys))} processes" if jobs > 1 else ""))

    def done(key):
        bar.set_postfix_str(f"{key[0]} {key[1]}x{key[2]}p", refresh=False)
        bar.update(1)
    try:
        programs, pack = compile_programs(mc, keys, jobs, on_done=done)
    finally:
        bar.close()
    g = mc.graph(*keys[-1])
    manifest = {
        "onnx": {"file": os.path.basename(onnx_path), "sha256": model_sha256(onnx_path)},
        "target": {"name": mc.spec.name, "hash": mc.spec.hash()},
        "profile": profile or mc.spec.default_profile,
        "strategy": strategy,
        "quantize": describe_quantize(quantize),
        "buckets": list(rows), "chunk": chunk,
        "model": {"layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
                  "page_tokens": mc.page_tokens, "max_tokens": mc.max_tokens,
                  "vocab": int(g.tensors["logits"].shape[-1])},
        "kernels_lowered": mc.kernels.lowered,
        # ops no NPU kernel takes, run by the host between kernels (HostOp commands)
        "host_ops": sorted({n for key in keys for n in mc.graph(*key).host_notes}),
        "quantization_report": mc.quant_report.summary() if mc.quant_report else None,
        # what run --check-onnx checks its quantized copy of the ONNX file against
        "w4_linears": mc.quant_report.w4_linears if mc.quant_report else None,
    }
    if replay is not None:
        manifest["tuning"] = dict(
            replay.summary(),
            programs_untuned=sorted(program_name(k) for k in keys if mc.builds_defaults(*k)),
            programs_prefetch_at_end=sorted(program_name(k) for k in keys
                                            if not mc.spreads(*k)))
    full = write_artifact(output, programs, manifest, pack)
    full["build_seconds"] = time.time() - t0
    return full


def _progress(total: int, on: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="program", file=sys.stderr, disable=not on)


def _layer_names(text: str) -> tuple:
    from edgetvm.relax_passes.quantize_w4a16 import KEEP_FP16_LAYERS
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise argparse.ArgumentTypeError("--keep-fp16 is empty; 'none' quantizes every "
                                         "linear")
    if names == ("none",):
        return ()
    unknown = sorted(set(names) - set(KEEP_FP16_LAYERS))
    if unknown:
        raise argparse.ArgumentTypeError(f"--keep-fp16: unknown layer(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(KEEP_FP16_LAYERS)}")
    return names


def prefill_rows(asked, max_tokens: int, chunk=None) -> tuple:
    """The prefill buckets of ``asked`` that fit a KV cache of ``max_tokens``; none is
    refused, naming what would fit."""
    rows = tuple(b for b in asked if b <= max_tokens)
    if rows:
        return rows
    fit = 1 << (max_tokens.bit_length() - 1)           # a power of two that fits
    if chunk:
        raise EdgeTVMError(f"--chunk {chunk} is over the KV cache of {max_tokens} tokens "
                           f"(--chunk {fit}, or a larger --max-tokens)")
    raise EdgeTVMError(f"no prefill bucket of {','.join(map(str, asked))} fits a KV cache of "
                       f"{max_tokens} tokens (--buckets {fit} or --chunk {fit}, or a larger "
                       f"--max-tokens)")


def add_target_options(ap, buckets_default=DEFAULT_BUCKETS) -> None:
    """``--target``, ``--profile`` and the prefill programs (``--buckets`` / ``--chunk``) of
    a build (``edgetvm.build``, ``edgetvm.tune``)."""
    ap.add_argument("--target", default="edge-npu-16mb", help="NPU preset or spec JSON")
    ap.add_argument("--profile", default=None, help="power profile (default: the spec's)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--buckets", type=ints_option, default=buckets_default, metavar="R1,R2,...",
                       help="prefill length buckets (default 16,32,64,128,256,512)")
    group.add_argument("--chunk", type=int, default=None, metavar="C",
                       help="chunked prefill: one C-row prefill program per KV capacity")


def add_build_options(ap, run: bool = False) -> None:
    """The options that decide what a build is (``edgetvm.build``, and ``edgetvm.run`` on
    an ONNX file)."""
    from edgetvm.relax_passes.partition import STRATEGIES
    from edgetvm.relax_passes.quantize_w4a16 import KEEP_FP16_LAYERS
    from edgetvm.relax_passes.w4_pack import ZERO_POINT_KINDS

    ap.add_argument("--strategy", default="regions", choices=STRATEGIES,
                    help="fusion partition (default regions; edgellm searches cut points "
                         "by measuring candidate clusters under --profile)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="KV cache capacity in tokens (default 1024, or the positions the "
                         "model can address if fewer)")
    ap.add_argument("--quantize", type=int, choices=(32, 64, 128), default=None, metavar="G",
                    help="quantize fp32/fp16 linears to W4A16 with group size G" +
                         ("; --check-onnx then runs onnxruntime on a copy of the file "
                          "whose linears hold the same 4-bit codes (MatMulNBits)"
                          if run else ""))
    ap.add_argument("--zero-points", choices=ZERO_POINT_KINDS, default="float",
                    help="with --quantize: float (default; fitted scale and fp16 zero point "
                         "per group, 5.0 bits/weight at G=32), none (symmetric, 4.5) or "
                         "uint4 (4.75)")
    ap.add_argument("--keep-fp16", type=_layer_names, default=None, metavar="LAYERS",
                    help="with --quantize: comma-separated layers that stay fp16, of "
                         f"{', '.join(KEEP_FP16_LAYERS)}, or none (default: embedding, the "
                         "table and a tied lm_head that is that table)")


def parse_build_args(ap, argv):
    """Add ``-q`` / ``-v``, parse, set up logging and check the build options."""
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    check_build_options(ap, args)
    return args


def check_build_options(ap, args) -> None:
    if args.chunk is not None and args.chunk < 1:
        ap.error("--chunk must be >= 1")
    from edgetvm.build.compiler import MAX_KV_TOKENS
    if args.max_tokens is not None and not 1 <= args.max_tokens <= MAX_KV_TOKENS:
        ap.error(f"--max-tokens must be in 1..{MAX_KV_TOKENS}")
    if args.quantize is None and (args.keep_fp16 is not None or args.zero_points != "float"):
        ap.error("--zero-points and --keep-fp16 apply to --quantize G")


def quantizer_of(args):
    """The QuantizeW4A16 pass the options ask for, or None."""
    if not args.quantize:
        return None
    from edgetvm.relax_passes import QuantizeW4A16
    keep = {} if args.keep_fp16 is None else {"keep_fp16": args.keep_fp16}
    return QuantizeW4A16(group_size=args.quantize, zero_points=args.zero_points, **keep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgetvm.build",
                                 description=" ".join(__doc__.split()))
    ap.add_argument("model", help="ONNX file (text-generation-with-past export)")
    ap.add_argument("-o", "--output", required=True, help="the artifact to write (model.npu)")
    add_target_options(ap)
    add_build_options(ap)
    ap.add_argument("--log", default=None, metavar="DIR",
                    help="replay the best knobs of this tuning log (python -m edgetvm.tune)")
    ap.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                    help="processes compiling programs side by side (default: one per CPU, "
                         "at most 4; the artifact's bytes do not depend on it)")
    args = parse_build_args(ap, argv)
    if args.jobs is not None and args.jobs < 1:
        ap.error("--jobs must be >= 1")
    try:
        check_output_file(args.output, "-o")
        if os.path.exists(args.output):
            # the zip would replace the model, or the weights it keeps beside itself
            from .fingerprint import model_files
            check_not_overwriting(args.output, "-o",
                                  model_files(args.model, "the model being built"),
                                  "model.npu")
        with interrupt.watching():
            m = build(args.model, args.output, target=args.target, profile=args.profile,
                      strategy=args.strategy, buckets=args.buckets, chunk=args.chunk,
                      quantize=quantizer_of(args), max_tokens=args.max_tokens,
                      progress=not args.quiet, log_dir=args.log, jobs=args.jobs)
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # the artifact is written whole and renamed into place: none, or the old one, is there
        print(f"\ninterrupted; {args.output} was not written", file=sys.stderr)
        return 130
    size = os.path.getsize(args.output)
    arena = max(p.get("arena_bytes", 0) for p in m["programs"])
    md = m["model"]
    pages = -(-md["max_tokens"] // md["page_tokens"])
    kv = 2 * md["layers"] * md["kv_heads"] * md["head_dim"] * 2 * pages * md["page_tokens"]
    print(f"wrote {args.output}: {len(m['programs'])} programs, "
          f"{m['weights']['bytes'] / 1e6:.1f} MB of weights, {size / 1e6:.1f} MB, "
          f"{m['kernels_lowered']} kernels lowered, {m['build_seconds']:.1f} s")
    if m.get("tuning"):
        print(f"replayed {args.log}: tuned knobs for {m['tuning']['kernels_tuned']} kernels"
              f", tuned cuts for {m['tuning']['runs_cut']} runs of fusable ops")
        if m["tuning"]["programs_untuned"]:
            print(f"  built with the defaults (the log measured them better so, as whole "
                  f"programs): "
                  f"{', '.join(m['tuning']['programs_untuned'])}")
        if m["tuning"]["programs_prefetch_at_end"]:
            print(f"  linked with each prefetch at the end of the kernel before (the log "
                  f"measured them faster so): "
                  f"{', '.join(m['tuning']['programs_prefetch_at_end'])}")
    print(f"DRAM: {m['weights']['bytes'] / 1e6:.1f} MB weights + {arena / 1e6:.2f} MB "
          f"activation arena (high-water, slots reused by lifetime) + {kv / 1e6:.2f} MB KV "
          f"cache ({md['max_tokens']} tokens)")
    print_host_ops(m)
    if m.get("quantization_report"):
        print(m["quantization_report"])
    return 0


def print_host_ops(manifest: dict) -> None:
    """Say which ops of the artifact the host runs (each a HostOp at its switch cost)."""
    notes = manifest.get("host_ops") or ()
    if notes:
        print(f"{len(notes)} op(s) run on the host between NPU kernels (no NPU kernel takes "
              f"them; each costs a host switch):")
        for n in notes:
            print(f"  {n}")
