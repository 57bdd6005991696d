"""``python -m edgetvm.build model.onnx -o model.npu``: compile an LLM into a deployable
artifact (whole-phase programs, one weight pack, a manifest), without search."""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

from edgetvm.errors import EdgeTVMError

DEFAULT_BUCKETS = (16, 32, 64, 128, 256, 512)


def _ints(text: str) -> tuple:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build(onnx_path: str, output: str, *, target="edge-npu-16mb", profile=None,
          strategy="regions", buckets=DEFAULT_BUCKETS, chunk=None, quantize=None,
          max_tokens: int = 1024, progress: bool = True) -> dict:
    """Compile ``onnx_path`` into ``output`` (model.npu); returns the manifest."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.build.package import write_artifact

    if not os.path.isfile(onnx_path):
        raise EdgeTVMError(f"{onnx_path}: no such file")
    rows = (chunk,) if chunk else tuple(sorted(b for b in set(buckets) if b <= max_tokens))
    if not rows:
        raise EdgeTVMError(f"no prefill bucket fits a KV cache of {max_tokens} tokens")
    t0 = time.time()
    mc = ModelCompiler(onnx_path, target, quantize=quantize, max_tokens=max_tokens,
                       strategy=strategy, max_rows=max(rows))
    if profile is not None:
        mc.spec.profile(profile)                     # an unknown profile fails here
    keys = mc.phase_keys(rows, chunked=bool(chunk))
    bar = _progress(len(keys), progress)
    programs = {}
    try:
        for key in keys:
            bar.set_description(f"compiling {key[0]} {key[1]}x{key[2]}p")
            programs[key] = mc.program(*key)
            bar.update(1)
    finally:
        bar.close()
    g = mc.graph(*keys[-1])
    manifest = {
        "onnx": {"file": os.path.basename(onnx_path), "sha256": file_sha256(onnx_path)},
        "target": {"name": mc.spec.name, "hash": mc.spec.hash()},
        "profile": profile or mc.spec.default_profile,
        "strategy": strategy,
        "quantize": _describe_quantize(quantize),
        "buckets": list(rows), "chunk": chunk,
        "model": {"layers": g.layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
                  "page_tokens": mc.page_tokens, "max_tokens": mc.max_tokens,
                  "vocab": int(g.tensors["logits"].shape[-1])},
        "kernels_lowered": mc.kernels.lowered,
    }
    full = write_artifact(output, programs, manifest)
    full["build_seconds"] = time.time() - t0
    return full


def _describe_quantize(q):
    if not q:
        return None
    if isinstance(q, int):
        return {"group_size": q}
    return {"group_size": q.group_size, "zero_points": q.zero_points,
            "keep_fp16": list(q.keep_fp16), "scale_rule": q.scale_rule}


class _NoBar:
    def set_description(self, _):
        pass

    def update(self, _):
        pass

    def close(self):
        pass


def _progress(total: int, on: bool):
    if not on:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="program", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgetvm.build", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="ONNX file (text-generation-with-past export)")
    ap.add_argument("-o", "--output", required=True, help="the artifact to write (model.npu)")
    ap.add_argument("--target", default="edge-npu-16mb", help="NPU preset or spec JSON")
    ap.add_argument("--profile", default=None, help="power profile (default: the spec's)")
    ap.add_argument("--strategy", default="regions",
                    help="fusion partition: op-library, regions, local, mega (default regions)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--buckets", type=_ints, default=DEFAULT_BUCKETS, metavar="R1,R2,...",
                       help="prefill length buckets (default 16,32,64,128,256,512)")
    group.add_argument("--chunk", type=int, default=None, metavar="C",
                       help="chunked prefill: one C-row prefill program per KV capacity")
    ap.add_argument("--quantize", type=int, choices=(32, 64, 128), default=None, metavar="G",
                    help="quantize fp32/fp16 linears to W4A16 with group size G")
    ap.add_argument("--max-tokens", type=int, default=1024, help="KV cache capacity (1024)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    if args.chunk is not None and args.chunk < 1:
        ap.error("--chunk must be >= 1")
    try:
        m = build(args.model, args.output, target=args.target, profile=args.profile,
                  strategy=args.strategy, buckets=args.buckets, chunk=args.chunk,
                  quantize=args.quantize, max_tokens=args.max_tokens, progress=not args.quiet)
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(args.output)
    print(f"wrote {args.output}: {len(m['programs'])} programs, "
          f"{m['weights']['bytes'] / 1e6:.1f} MB of weights, {size / 1e6:.1f} MB, "
          f"{m['kernels_lowered']} kernels lowered, {m['build_seconds']:.1f} s")
    return 0
