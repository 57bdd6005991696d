"""``python -m edgetvm.run model.npu --prompt-ids 1,2,3 --max-new-tokens 8``

Run a compiled model (``python -m edgetvm.build``) on the emulated NPU: prefill, then
greedy decode, one whole-phase program per step, and print the tokens with each step's
emulated latency, DRAM traffic, energy and power. Nothing is compiled at run time.

Given an ONNX file instead, ``run`` builds it first into a cache (``$EDGETVM_CACHE``,
default ``~/.cache/edgetvm``; the same file and options reuse the build; ``--log DIR``
replays a tuning log into that build, as ``edgetvm.build --log`` does), or, with
``--reference``, runs it region by region through the Relax VM (the reference path: every
NPU region its own kernel and emulator run, the glue on the host).

``--check-onnx [MODEL.onnx]`` runs onnxruntime on the ONNX file step by step (present fed
back as past) and fails unless the generated ids are identical and every step's logits
agree within ``atol + rtol * max|reference logits|`` (fp16 activations on the NPU vs fp32
onnxruntime); where the ids part, the steps after it (each side on its own tokens) are not
compared, and it says whether that step was a near-tie (:func:`divergence`). ``--chunk C``
runs the prompt as chunked prefill (chunks of C tokens, each attending to the KV of the
earlier ones).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import sys

import numpy as np

from edgetvm import interrupt
from edgetvm.collector import fewer_collections
from edgetvm.errors import (EdgeTVMError, check_input_file, check_not_overwriting,
                            check_output_file)
from edgetvm.build.cli import (add_build_options, check_build_options, comma_ints, ints_option,
                               print_host_ops, quantizer_of)

DEFAULT_ATOL = 1e-2
DEFAULT_RTOL = 1e-2


def _ids(text: str) -> list:
    ids = comma_ints(text)
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    negative = [i for i in ids if i < 0]
    if negative:     # -1 would index the vocabulary from its end, here and in onnxruntime
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {negative}")
    return ids


def compare_logits(recs, ref, atol: float, rtol: float, steps: int | None = None) -> tuple:
    """(all steps within tolerance, worst diff, its allowance) over the steps that give a
    token (a prompt may be run in other chunks on each side), the first ``steps`` of them
    if given."""
    ok, worst, allowed = True, 0.0, 0.0
    pairs = zip([r for r in recs if r.token >= 0], [r for r in ref if r.token >= 0])
    for a, b in list(pairs)[:steps]:
        diff = float(np.abs(a.logits - b.logits).max())
        tol = atol + rtol * float(np.abs(b.logits).max())
        ok &= diff <= tol
        if diff - tol >= worst - allowed or worst == 0.0:
            worst, allowed = diff, tol
    return ok, worst, allowed


def divergence(recs, ref, atol: float, rtol: float):
    """Where the generated ids first differ, or None: ``(k, token, ref token, ref margin,
    logits diff, allowance)`` at the k-th generated token, ``ref margin`` being how far
    below its own choice the reference puts the NPU's token. A margin and a diff within
    the allowance make it a near-tie that fp16 rounding may tip, not a wrong program."""
    got = [r for r in recs if r.token >= 0]
    want = [r for r in ref if r.token >= 0]
    for k, (a, b) in enumerate(zip(got, want)):
        if a.token != b.token:
            lb = np.asarray(b.logits, np.float32).ravel()
            margin = float(lb[b.token] - lb[a.token])
            diff = float(np.abs(np.asarray(a.logits, np.float32).ravel() - lb).max())
            return k, a.token, b.token, margin, diff, atol + rtol * float(np.abs(lb).max())
    return None


HEADER = (f"{'step':<5} {'phase':<8} {'token':>7} {'npu_us':>10} {'npu_cycles':>11} "
          f"{'dram_read_B':>12} {'dram_write_B':>12} {'energy_uJ':>10} {'avg_mW':>7} "
          f"{'peak_mW':>7} {'throttled':>9}")


def format_step(k: int, rec) -> str:
    return (f"{k:<5} {rec.phase:<8} {rec.token:>7} {rec.npu_us:>10.1f} {rec.npu_cycles:>11} "
            f"{rec.dram_read_bytes:>12} {rec.dram_write_bytes:>12} {rec.energy_uj:>10.2f} "
            f"{rec.avg_power_mw:>7.0f} {rec.peak_power_mw:>7.0f} {rec.throttled_cycles:>9}")


def cache_dir() -> str:
    return os.environ.get("EDGETVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "edgetvm")


def cached_build(args):
    """Build ``args.model`` into the cache unless an identical build is there; the loaded
    artifact."""
    from edgetvm import __version__
    from edgetvm.build.cli import DEFAULT_BUCKETS, build
    from edgetvm.build.fingerprint import compiler_fingerprint, model_sha256
    from edgetvm.runtime.artifact import load_artifact
    from edgetvm.target.spec import EMULATOR_MODEL_VERSION, load_spec

    spec = load_spec(args.target or "edge-npu-16mb")
    options = {"onnx": model_sha256(args.model), "target": spec.hash(), "profile": args.profile,
               "strategy": args.strategy, "chunk": args.chunk, "quantize": args.quantize,
               "zero_points": args.zero_points, "keep_fp16": args.keep_fp16,
               "max_tokens": args.max_tokens,
               "buckets": sorted(set(args.buckets or DEFAULT_BUCKETS)),
               "edgetvm": __version__, "compiler": compiler_fingerprint(),
               "emulator_model": EMULATOR_MODEL_VERSION,
               "log": _log_digest(args.log)}
    digest = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:20]
    path = os.path.join(cache_dir(), f"{os.path.basename(args.model)}.{digest}.npu")
    if os.path.exists(path):
        try:
            art = load_artifact(path)
        except EdgeTVMError as e:
            print(f"the build in {path} does not load ({e}); rebuilding it", flush=True)
        else:
            print(f"using the build in {path}", flush=True)
            return art
    try:
        os.makedirs(cache_dir(), exist_ok=True)
    except OSError as e:
        raise EdgeTVMError(f"the build cache {cache_dir()} ($EDGETVM_CACHE) is not a "
                           f"directory edgetvm can create: {e.strerror}") from None
    print(f"building {args.model} for {spec.name} into {path} ...", flush=True)
    build(args.model, path, target=spec, profile=args.profile, strategy=args.strategy,
          buckets=args.buckets or DEFAULT_BUCKETS, chunk=args.chunk,
          quantize=quantizer_of(args), max_tokens=args.max_tokens, progress=not args.quiet,
          log_dir=args.log)
    return load_artifact(path)


def _log_digest(log_dir):
    """SHA-256 of a tuning log's records (None without a log): a build replaying a log
    that has grown since is not reused."""
    if log_dir is None:
        return None
    from edgetvm.tune.log import LOG_FILE
    path = os.path.join(log_dir, LOG_FILE)
    if not os.path.isfile(path):
        raise EdgeTVMError(f"{log_dir}: no such tuning log (no {LOG_FILE})")
    from edgetvm.build.fingerprint import file_sha256
    return file_sha256(path)


@fewer_collections()
def run_artifact(art, args) -> list:
    """Generate with the loaded model.npu ``art``; prints the step table; the records."""
    from edgetvm.runner import connect
    from edgetvm.runtime.model import ModelRunner
    from edgetvm.target.spec import load_spec

    path = art.path
    m = art.manifest
    spec = load_spec(args.target or m["target"]["name"])
    if spec.name != m["target"]["name"]:
        raise EdgeTVMError(f"{path} was built for {m['target']['name']}, not "
                           f"{spec.name} (--target): build it for {spec.name}, or leave "
                           f"--target out")
    if spec.hash() != m["target"]["hash"]:
        raise EdgeTVMError(f"{path} was built for {m['target']['name']} "
                           f"({m['target']['hash']}); this edgetvm's spec hashes to "
                           f"{spec.hash()}: rebuild it")
    runner = connect(args.rpc or "local", spec=spec)
    model = ModelRunner(art.program, art.keys, art.info, runner,
                        profile=args.profile or m.get("profile"))
    if m.get("quantization_report"):
        print(m["quantization_report"], flush=True)
    print(f"{path}: {len(art.keys)} programs ({m['strategy']} partition) for "
          f"{m['target']['name']}; running {args.max_new_tokens} step(s) on "
          f"{args.rpc or 'the local emulator'}", flush=True)
    print_host_ops(m)
    print(HEADER)
    seen: list = []

    def show(rec):
        print(format_step(len(seen), rec), flush=True)
        seen.append(rec)
    recs = model.generate(args.prompt_ids, args.max_new_tokens, chunk=args.chunk,
                          on_step=show, trace_first="decode" if args.trace else None)
    if args.trace:
        from edgetvm.target.emulator import write_chrome_trace
        key, result = model.traced
        write_chrome_trace(result, spec, args.trace)
        print(f"wrote a Chrome trace of the first {key[0]} step to {args.trace} "
              f"(open it in https://ui.perfetto.dev)", flush=True)
    runner.close()
    return recs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgetvm.run",
                                 description=" ".join(__doc__.split("\n\n")[1].split()))
    ap.add_argument("model", help="model.npu (python -m edgetvm.build), or an ONNX file "
                                  "(text-generation-with-past export)")
    ap.add_argument("--prompt-ids", type=_ids, required=True, help="e.g. 1,504,3575")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--target", default=None,
                    help="NPU preset or spec JSON (default: the artifact's, or edge-npu-16mb)")
    ap.add_argument("--profile", default=None, help="power profile (default: the spec's)")
    ap.add_argument("--rpc", default=None, metavar="URL",
                    help="run on an emulator server: rpc://HOST:PORT or tracker://HOST:PORT/KEY")
    ap.add_argument("--trace", default=None, metavar="STEP.json",
                    help="write a Chrome trace (ui.perfetto.dev) of the first decode step")
    ap.add_argument("--check-onnx", nargs="?", const=True, default=None, metavar="MODEL.onnx",
                    help="compare every step with onnxruntime on this ONNX file (the model "
                         "itself when it is one); exit 1 on a mismatch")
    ap.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                    help=f"absolute logits tolerance of --check-onnx (default {DEFAULT_ATOL})")
    ap.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                    help="logits tolerance relative to the step's max |logit| "
                         f"(default {DEFAULT_RTOL})")
    prefill = ap.add_mutually_exclusive_group()
    prefill.add_argument("--chunk", type=int, default=None, metavar="C",
                         help="chunked prefill with chunks of C tokens")
    prefill.add_argument("--buckets", type=ints_option, default=None, metavar="R1,R2,...",
                         help="building an ONNX file: prefill length buckets (default "
                              "16,32,64,128,256,512)")
    build = ap.add_argument_group("building an ONNX file (ignored for model.npu)")
    add_build_options(build, run=True)
    build.add_argument("--log", default=None, metavar="DIR",
                       help="replay this tuning log's best knobs (python -m edgetvm.tune)")
    build.add_argument("--reference", action="store_true",
                       help="run the ONNX file region by region (Relax VM + one emulator run "
                            "per kernel) instead of building it")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be >= 1")
    check_build_options(ap, args)
    is_artifact = args.model.endswith(".npu")
    if is_artifact and args.reference:
        ap.error("--reference runs an ONNX file")
    if is_artifact and args.check_onnx is True:
        ap.error("--check-onnx needs the ONNX file to compare a model.npu with")
    if args.reference and (args.rpc or args.trace or args.log):
        ap.error("--rpc, --trace and --log are for compiled models, not the --reference "
                 "path")
    if is_artifact and args.buckets:
        ap.error("--buckets chooses the programs of a build; a model.npu has its own")
    if is_artifact and args.log:
        ap.error("--log replays a tuning log while building an ONNX file; a model.npu "
                 "is already built")
    given = [o for o, v in (("--quantize", args.quantize), ("--max-tokens", args.max_tokens),
                            ("--keep-fp16", args.keep_fp16)) if v is not None]
    if is_artifact and given:
        ap.error(f"{', '.join(given)} choose(s) how an ONNX file is built; a model.npu is "
                 f"already built (python -m edgetvm.build ... to build another)")
    if not (math.isfinite(args.atol) and args.atol >= 0 and math.isfinite(args.rtol) and
            args.rtol >= 0):
        ap.error("--atol and --rtol must be finite and >= 0")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        with interrupt.watching():
            # everything that can be refused is refused before the build and the run
            if args.trace:
                check_output_file(args.trace, "--trace")
                from edgetvm.build.fingerprint import model_files
                read = model_files(args.model, "the model being run")
                if args.check_onnx:
                    read += model_files(_check_onnx_path(args), "the --check-onnx model")
                if args.log:
                    from edgetvm.tune.log import LOG_FILE
                    read.append(("the tuning log", os.path.join(args.log, LOG_FILE)))
                check_not_overwriting(args.trace, "--trace", read, "step.json")
            if not is_artifact:
                check_input_file(args.model)
            reference = _reference_runner(args) if args.check_onnx else None
            theirs = reference[1].vocab if reference else None
            if not is_artifact:
                from edgetvm.generate import KVSpec, check_vocab
                vocab = KVSpec.of(args.model).vocab
                _check_vocab(lambda: vocab, theirs, args)
                check_vocab(args.prompt_ids, vocab)      # before a build, not after it
            if args.reference:
                recs, quantized = run_reference(args)
            else:
                if is_artifact:
                    from edgetvm.runtime.artifact import load_artifact
                    art = load_artifact(args.model)
                    if not _same_onnx(art, args):
                        _check_vocab(lambda: art.manifest["model"]["vocab"], theirs, args)
                else:
                    art = cached_build(args)
                quantized = (art.manifest.get("quantize"), art.manifest.get("w4_linears"))
                recs = run_artifact(art, args)
            against = None                  # the build is not quantized
            if reference and quantized[0]:
                reference, against = _quantized_reference(args, reference, *quantized)
            return _report(recs, args, reference, against)
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def run_reference(args) -> tuple:
    """Generate region by region through the Relax VM; prints the step table. The records
    and the quantization: ``(QuantizeW4A16 or None, its W4A16 linears)``."""
    from edgetvm.generate import KVSpec, check_capacity, check_vocab, greedy
    from edgetvm.session import NPUSession

    kv = KVSpec.of(args.model)
    # what the compiled path refuses before its first step, refused here before compiling
    prompt = args.prompt_ids
    check_capacity(len(prompt), args.max_new_tokens, args.max_tokens or 1024)
    check_vocab(prompt, kv.vocab)
    print(f"compiling {args.model} (reference path) ...", flush=True)
    rows = (args.chunk,) if args.chunk else args.buckets
    extra = {"row_buckets": tuple(rows)} if rows else {}
    qpass = quantizer_of(args)
    session = NPUSession(args.model, args.target or "edge-npu-16mb", args.profile,
                         max_tokens=args.max_tokens or 1024, quantize=qpass, **extra)
    if session.quant_report is not None:
        print(session.quant_report.summary(), flush=True)
    print(f"{len(session.regions)} regions on the NPU; running {args.max_new_tokens} "
          f"step(s)", flush=True)
    print(HEADER)
    seen: list = []

    def show(rec):
        rec.npu_us = session.spec.cycles_to_us(rec.npu_cycles)
        print(format_step(len(seen), rec), flush=True)
        seen.append(rec)
    recs = greedy(session, kv, args.prompt_ids, args.max_new_tokens, on_step=show,
                  chunk=args.chunk)
    report = session.quant_report
    return recs, (qpass, report.w4_linears if report is not None else None)


def _check_onnx_path(args) -> str:
    return args.model if args.check_onnx is True else args.check_onnx


def _reference_runner(args):
    """(onnxruntime runner, KV inputs) of the --check-onnx file, made before anything
    runs: a file onnxruntime cannot load is refused then, not after the generation."""
    from edgetvm.generate import KVSpec, onnxruntime_runner

    path = _check_onnx_path(args)
    check_input_file(path)
    try:
        runner = onnxruntime_runner(path)
    except Exception as e:             # onnxruntime's own errors have no common base
        raise EdgeTVMError(f"--check-onnx {path}: onnxruntime cannot load it: "
                           f"{_first_line(e)}") \
            from None
    kv = KVSpec.of(path)
    if kv.fixed:      # generation feeds a growing prompt and KV cache
        raise EdgeTVMError(f"--check-onnx {path}: its lengths are fixed ({kv.fixed}): the "
                           f"check feeds it prompts and a KV cache of any length; give an "
                           f"export with symbolic sequence and past lengths (as optimum's)")
    return runner, kv


def _quantized_reference(args, reference, quantize, w4_linears):
    """The --check-onnx reference of a W4A16 build: onnxruntime on a copy of the ONNX file
    whose linears are ``MatMulNBits`` holding the 4-bit codes the build's quantizer
    (``quantize``: a :class:`~edgetvm.relax_passes.QuantizeW4A16` or the manifest's
    description of one) makes of them, so the check measures the program and not the
    quantization. The copy is used only if it quantizes as many linears as the build did
    (``w4_linears``); otherwise the file as it is, saying why. Returns the reference and
    what it holds: ``"w4"`` or ``"float"``."""
    import onnx

    from edgetvm.generate import onnxruntime_runner
    from edgetvm.matmul_nbits_export import quantized_as_compiled
    from edgetvm.relax_passes import QuantizeW4A16

    path = _check_onnx_path(args)
    qpass = quantize if isinstance(quantize, QuantizeW4A16) else QuantizeW4A16(**quantize)
    print(f"check-onnx: quantizing {path}'s linears as the build did (W4A16 g"
          f"{qpass.group_size}) ...", flush=True)
    model, _, made = quantized_as_compiled(onnx.load(path), qpass)
    if made != w4_linears:
        why = ("the build did not record how many it quantized" if w4_linears is None else
               f"{made} linears where the build quantized {w4_linears}")
        print(f"check-onnx: cannot rebuild the program's 4-bit weights in ONNX ({why}); "
              f"comparing with {path}'s own float weights", flush=True)
        return reference, "float"
    try:
        runner = onnxruntime_runner(model.SerializeToString())
    except Exception as e:             # onnxruntime's own errors have no common base
        print(f"check-onnx: onnxruntime cannot run the quantized copy ("
              f"{_first_line(e)}); comparing with "
              f"{path}'s own float weights", flush=True)
        return reference, "float"
    print(f"check-onnx: the reference is {path} with its {made} quantized linears as "
          f"onnxruntime MatMulNBits holding the program's 4-bit codes", flush=True)
    return (runner, reference[1]), "w4"


def _first_line(exc: Exception) -> str:
    """An onnxruntime error for one line: its message's first, or its type's name."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _check_vocab(vocab_of, theirs, args) -> None:
    """Refuse, before the run, a --check-onnx file (another file than the model) whose
    logits are ``theirs`` entries wide where the model's are ``vocab_of()``."""
    if args.check_onnx is True or theirs is None:
        return
    vocab = vocab_of()
    if vocab is not None and vocab != theirs:
        raise EdgeTVMError(f"--check-onnx {_check_onnx_path(args)}: its logits have {theirs} "
                           f"entries, the model's {vocab}: not the same model")


def _same_onnx(art, args) -> bool:
    """Whether --check-onnx names the ONNX file the artifact was built from; says so, before
    the run, when it does not."""
    if not args.check_onnx:
        return True
    from edgetvm.build.fingerprint import model_sha256
    path = _check_onnx_path(args)
    built = (art.manifest.get("onnx") or {}).get("sha256")
    if built and model_sha256(path) == built:
        return True
    print(f"check-onnx: {path} is not the ONNX file {args.model} was built from (another "
          f"SHA-256); a difference may be the files', not the program's", flush=True)
    return False


def _report(recs, args, reference, against=None) -> int:
    """Compare the run's records with onnxruntime's (``reference``: its runner and KV
    inputs) and say so; ``against``: for a W4A16 build, whether the reference holds the
    program's 4-bit codes (``"w4"``) or the file's float weights (``"float"``)."""
    from edgetvm.generate import greedy, tokens_of

    ids = tokens_of(recs)
    print("generated ids:", ",".join(map(str, ids)))
    if not args.check_onnx:
        return 0
    runner, kv = reference
    ref = greedy(runner, kv, args.prompt_ids, args.max_new_tokens, chunk=args.chunk)
    same = ids == tokens_of(ref)
    split = None if same else divergence(recs, ref, args.atol, args.rtol)
    # after the ids part, each side runs on its own tokens: compare the steps up to there
    ok, worst, allowed = compare_logits(recs, ref, args.atol, args.rtol,
                                        steps=None if split is None else split[0] + 1)
    print(f"onnxruntime ids: {','.join(map(str, tokens_of(ref)))}")
    print(f"check-onnx: ids {'identical' if same else 'DIFFER'}; worst step"
          f"{'' if same else ' up to the first difference'}: max |logits diff| "
          f"{worst:.3e}, allowed {allowed:.3e} (atol {args.atol} + rtol {args.rtol} * "
          f"max|logit|)")
    if split is not None:
        k, tok, want, margin, diff, tol = split
        print(f"check-onnx: generated token {k} is {tok}, onnxruntime's {want}; "
              f"onnxruntime puts {tok} {margin:.3e} below {want}, and the NPU's logits "
              f"there are {diff:.3e} from onnxruntime's (allowed {tol:.3e})")
        if margin <= tol and diff <= tol:
            print("check-onnx: a near-tie within the logits tolerance: fp16 rounding "
                  "chose the other token; try another prompt to check the program")
    if same and not ok:
        print("check-onnx: FAILED: the ids agree, but the logits differ from onnxruntime's "
              "beyond the tolerance")
    if not (same and ok) and against == "float":
        print("check-onnx: the linears were quantized to W4A16 and onnxruntime ran the "
              "file's own float weights: the difference measures the quantization as well "
              "as the program (benchmarks/quant_accuracy.py measures the quantization "
              "alone)")
    return 0 if same and ok else 1


if __name__ == "__main__":
    sys.exit(main())
