"""Prefill latency per length bucket, measured on the emulator: the curve the length-bucket
optimiser (edgetvm/buckets.py) needs.

For each bucket length L, the kernels of one SmolLM2-135M decoder layer at L rows (fused
RMSNorm -> QKV (W4A16) -> RoPE, KV append of L tokens, causal prefill attention, O
projection, residual add, RMSNorm, fused W4A16 MLP, residual add) are compiled with the
default (untuned) schedules and run on the emulator; the row reports their summed cycles,
and the model's prefill latency is that times the layer count.

    python benchmarks/prefill_latency.py [--quick] [--json PATH] [--latency-json PATH]

``--latency-json`` writes ``{"unit": "cycles", "points": [[L, cycles], ...]}`` for
``python benchmarks/buckets.py --latency-json PATH``. ``--quick``: lengths up to 1024.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from edgetvm.npu_regions import KernelCache
from edgetvm.target.emulator import Emulator
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.attention import ATTENTION_LOWERING, schedule_prefill_attention
from edgetvm.tir_schedules.fused import FusionCluster, Stage, mlp_cluster, norm_qkv_rope_cluster
from edgetvm.tir_schedules.kv_cache import KV_APPEND_LOWERING, KVCacheLayout, schedule_kv_append
from report import write_json

SMOLLM2 = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, mlp=1536, layers=30, group=32)


def _zeros(program) -> dict:
    return {t.name: np.zeros(t.shape, t.dtype) for t in program.tensors.values()
            if t.kind in ("input", "state")}


def layer_kernels(length: int, spec, cfg=SMOLLM2):
    """(name, program, params) of one decoder layer's prefill at ``length`` rows."""
    h, hq, hk, d, g = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["group"]
    cache = KernelCache(spec)
    out = []

    def cluster(cl, matmuls):
        consts = {n: np.zeros(cl.tensors[n][0], cl.tensors[n][1]) for n in cl.consts}
        return cache.build(cl, consts, matmuls, length)

    qkv = norm_qkv_rope_cluster(length, h, hq, hk, d, g)
    out.append(("norm_qkv_rope", cluster(qkv, {"q_lin": (hq * d, h, g), "k_lin": (hk * d, h, g),
                                               "v_lin": (hk * d, h, g)}), {}))
    pages = -(-length // 16)
    lay = KVCacheLayout(hk, d, pages, 16)
    app = lower_primfunc(schedule_kv_append(lay, length, spec).mod["main"], spec, "kv_append",
                         **KV_APPEND_LOWERING)
    out.append(("kv_append", app, lay.slot_params(list(range(pages)), 0, length)))
    att = schedule_prefill_attention(lay, hq, length, spec, tile_q=64, tile_kv=64, slots_kv=2,
                                     slots_s=1)
    att = lower_primfunc(att.mod["main"], spec, "prefill_attention", outputs=["out"],
                         **ATTENTION_LOWERING)
    out.append(("attention", att, lay.page_table_params(list(range(pages)), pages)))
    o_proj = FusionCluster("o_proj", {"x": ((length, hq * d), "float16"),
                                      "w": ((h, hq * d // 2), "uint8"),
                                      "s": ((h, hq * d // g), "float16")},
                           [Stage("linear_w4a16", ("x", "w", "s"), "y")], ("y",), ("w", "s"))
    out.append(("o_proj", cluster(o_proj, {"y": (h, hq * d, g)}), {}))
    add = FusionCluster("residual_add", {"x": ((length, h), "float16"),
                                         "x2": ((length, h), "float16")},
                        [Stage("add", ("x", "x2"), "y")], ("y",), ())
    norm = FusionCluster("rms_norm", {"x": ((length, h), "float16"), "nw": ((h,), "float16")},
                         [Stage("rms_norm", ("x", "nw"), "y", {"eps": 1e-5})], ("y",), ("nw",))
    out.append(("residual_add", cluster(add, {}), {}))
    out.append(("rms_norm", cluster(norm, {}), {}))
    mlp = mlp_cluster(length, h, cfg["mlp"], g)
    out.append(("mlp", cluster(mlp, {"gate": (cfg["mlp"], h, g), "up": (cfg["mlp"], h, g),
                                     "down": (h, cfg["mlp"], g)}), {}))
    out.append(("residual_add", cluster(add, {}), {}))
    return out


def measure(length: int, spec) -> dict:
    t0 = time.time()
    emu = Emulator(spec)
    by_kernel = {}
    for name, program, params in layer_kernels(length, spec):
        c = emu.run(program, _zeros(program), params=params).counters
        by_kernel[name] = by_kernel.get(name, 0) + c.total_cycles
    layer = sum(by_kernel.values())
    return {"length": length, "layer_cycles": layer, "model_cycles": layer * SMOLLM2["layers"],
            "model_ms": spec.cycles_to_us(layer * SMOLLM2["layers"]) / 1e3,
            "by_kernel": by_kernel, "wall_s": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="lengths up to 1024")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--latency-json", metavar="PATH", help="(length, cycles) points for "
                    "benchmarks/buckets.py --latency-json")
    ap.add_argument("--spec", default="edge-npu-16mb")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    lengths = [128, 256, 512, 1024] + ([] if args.quick else [1536, 2048, 3072, 4096])
    print(f"SmolLM2-135M prefill on {spec.name}: one layer's kernels measured on the emulator")
    print(f"{'length':>7} {'layer_cycles':>13} {'model_ms':>9} {'wall_s':>7}  by kernel")
    rows = []
    for n in lengths:
        r = measure(n, spec)
        rows.append(r)
        print(f"{n:>7} {r['layer_cycles']:>13} {r['model_ms']:>9.2f} {r['wall_s']:>7}  "
              f"{r['by_kernel']}", flush=True)
    if args.json:
        write_json(args.json, {"spec": spec.name, "rows": rows})
    if args.latency_json:
        write_json(args.latency_json, {
            "unit": "cycles", "source": f"benchmarks/prefill_latency.py on {spec.name} "
            f"(SmolLM2-135M, {SMOLLM2['layers']} layers)",
            "points": [[r["length"], r["model_cycles"]] for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
