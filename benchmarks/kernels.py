"""Kernel efficiency on the emulated NPU: best schedule found by a simple search vs roofline.

For each kernel and shape: search the template's knobs (tir_schedules/search.py), run the
best program on the emulator, check its output against numpy, and compare its measured
cycles with the roofline bound for the same work, every unit that can bound it counted,

    roofline_cycles = max(MACs / peak MACs per cycle,                       (matrix)
                          vector work of the kernel's ops,                   (vector)
                          minimal DRAM bytes / DRAM bytes per cycle)         (bandwidth)

where the minimal DRAM bytes read every input and weight once and write every output once
(in whole bursts), and the vector work is the vector unit's busy cycles in the best
program: the softmax, norm and cast passes the template's ops need at that tiling (lane
passes per row), which no overlap can hide. ``bound`` names the largest term.
Double buffering on vs off: the best knobs re-run with every ``slots_*`` knob at 1.

    python benchmarks/kernels.py [--quick] [--json PATH] [--spec edge-npu-16mb] [--trials N]

``--quick``: SmolLM2-135M shapes only (and shorter attention). Targets: decode GEMV W4A16
within 1.15x of the roofline (bandwidth bound); prefill GEMM within 1.3x of the roofline
(compute bound). Attention has no target.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

from edgetvm.target.emulator import Emulator
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules import gemm, workloads
from edgetvm.tir_schedules.attention import (ATTENTION_LOWERING, kv_tile_candidates,
                                             schedule_decode_attention,
                                             schedule_prefill_attention)
from edgetvm.tir_schedules.kv_cache import KVCacheLayout
from edgetvm.tir_schedules.search import search, search_space
from report import write_json

#: measurement budget: candidates with more tile operations are rejected unmeasured
MAX_OPS = 20000
#: a kernel whose output is further than this from numpy (max |err| / max |ref|) is wrong:
#: fp16 outputs of fp32 accumulations measured <= 1e-3 (attention softmax included)
MAX_REL_ERR = 1e-2
SMOLLM2 = dict(key="smollm2", model="SmolLM2-135M", hidden=576, mlp=1536, prefill=512, heads=(9, 3, 64))
LLAMA7B = dict(key="llama7b", model="Llama-7B-like", hidden=4096, mlp=11008, prefill=512, heads=(32, 32, 128))


@dataclass
class Bench:
    kernel: str
    model: str
    shape: str
    func: object
    schedule_fn: object
    knob_names: tuple
    consts: dict
    inputs: dict
    reference: np.ndarray
    output: str
    macs: int
    mma_kind: str
    min_bytes: int
    target: float | None
    fixed: dict
    space: dict | None = None        # explicit knob space (hand-built kernels) ...
    build: object = None             # ... and build(knobs) -> Program
    params: dict | None = None       # runtime parameters of a run


def _matmul_bench(kind, model, m, n, k, rng, group=32) -> Bench:
    x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
    if kind == "fp16":
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float16)
        func = workloads.gemm_fp16(m, n, k)
        consts = {"B": w}
        ref = x.astype(np.float32) @ w.astype(np.float32)
        inputs = {"A": x}
    else:
        # the reference weight comes from the 4-bit codes, which are then packed as
        # MatMulNBits defines them (even K in the low nibble, zero point 8): it never goes
        # through the emulator's dequantisation
        codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
        s = (rng.random((n, k // group)) * 0.02 + 0.005).astype(np.float16)
        w = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
        weight = (codes.astype(np.float32) - 8) * np.repeat(s.astype(np.float32), group, 1)
        func = workloads.gemm_w4a16(m, n, k, group)
        consts = {"W": w, "S": s}
        ref = x.astype(np.float32) @ weight.T
        inputs = {"X": x}
    decode = m == 1
    name = ("gemv" if decode else "gemm") + ("_w4a16" if kind == "w4a16" else "_fp16")
    min_bytes = x.nbytes + sum(c.nbytes for c in consts.values()) + m * n * 2
    # GEMV: the activation row is tiny, keep it resident (a_at=1, one slot)
    fixed = {"a_at": 1, "slots_a": 1} if decode else {}
    return Bench(name, model, f"{m}x{k}x{n}", func,
                 lambda sch, **kn: gemm.schedule_matmul(sch, group=group if kind != "fp16"
                                                       else 0, **kn),
                 gemm.KNOBS, consts, inputs, ref, "D", m * n * k,
                 "w4a16" if kind == "w4a16" else "fp16", min_bytes,
                 1.15 if decode else 1.3, fixed)


def _attention_ref(q, k, v, causal_from: int | None):
    """q (s, hq, d), k/v (hk, L, d) -> (s, hq, d); causal with queries at causal_from."""
    s, hq, d = q.shape
    g = hq // k.shape[0]
    kk, vv = (np.repeat(x.astype(np.float32), g, axis=0) for x in (k, v))
    sc = np.einsum("shd,hld->hsl", q.astype(np.float32), kk) / np.sqrt(d)
    if causal_from is not None:
        keep = np.arange(k.shape[1])[None, :] <= causal_from + np.arange(s)[:, None]
        sc = np.where(keep[None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hsl,hld->shd", p, vv)


def _attention_bench(model, heads, tokens, rng, prefill: bool, spec) -> Bench:
    hq, hk, d = heads
    pages = -(-tokens // 16)
    lay = KVCacheLayout(hk, d, pages + 1, 16)
    k_cache = (rng.standard_normal(lay.shape) * 0.5).astype(np.float16)
    v_cache = rng.standard_normal(lay.shape).astype(np.float16)
    table = list(range(1, pages + 1))                 # page 0 unused: a real page table
    k = np.concatenate([k_cache[p] for p in table], axis=1)[:, :tokens]
    v = np.concatenate([v_cache[p] for p in table], axis=1)[:, :tokens]
    s = tokens if prefill else 1
    q = (rng.standard_normal((s, hq, d)) * 0.5).astype(np.float16)
    params = lay.page_table_params(table, pages)
    inputs = {"K_cache": k_cache, "V_cache": v_cache, "q": q if prefill else q[0]}
    ref = _attention_ref(q, k, v, 0 if prefill else None)
    kv_tiles = [t for t in kv_tile_candidates(16, tokens) if t <= 256]
    if prefill:
        space = {"tile_q": [t for t in (32, 64, 128) if t <= tokens], "tile_kv": kv_tiles,
                 "slots_kv": [1, 2], "slots_s": [1, 2], "rowsum_mma": [0, 1],
                 "list_schedule": [0, 1], "two_pass": [0, 1]}
        macs = hq * d * tokens * (tokens + 1)          # QK^T and PV below the diagonal

        def build(kn):
            return lower_primfunc(schedule_prefill_attention(lay, hq, tokens, spec, **kn)
                                  .mod["main"], spec, "prefill_attention", outputs=["out"],
                                  max_ops=MAX_OPS, **ATTENTION_LOWERING)
    else:
        space = {"tile_kv": kv_tiles, "slots_kv": [1, 2], "slots_s": [1, 2],
                 "list_schedule": [0, 1]}
        params["valid_len"] = tokens
        ref = ref[0]
        macs = 2 * hq * d * tokens

        def build(kn):
            return lower_primfunc(schedule_decode_attention(lay, hq, pages, spec, **kn)
                                  .mod["main"], spec, "decode_attention", outputs=["out"],
                                  max_ops=MAX_OPS, **ATTENTION_LOWERING)
    min_bytes = 2 * hk * tokens * d * 2 + 2 * q.nbytes
    return Bench("prefill_attn" if prefill else "decode_attn", model,
                 f"{hq}/{hk}x{d} L={tokens}", None, None, (), {}, inputs, ref, "out", macs,
                 "fp16", min_bytes, None, {}, space, build, params)


def benches(quick: bool, rng, spec, models=None, kernels=None) -> list:
    out = []
    cfgs = [SMOLLM2] + ([] if quick else [LLAMA7B])
    if models:
        cfgs = [c for c in (SMOLLM2, LLAMA7B) if c["key"] in models]
    for cfg in cfgs:
        h, f, p = cfg["hidden"], cfg["mlp"], cfg["prefill"]
        for n, k in ((h, h), (f, h), (h, f)):
            out.append(_matmul_bench("w4a16", cfg["model"], 1, n, k, rng))
        out.append(_matmul_bench("fp16", cfg["model"], p, f, h, rng))
        out.append(_matmul_bench("w4a16", cfg["model"], p, f, h, rng))
        out.append(_attention_bench(cfg["model"], cfg["heads"], 1024, rng, False, spec))
        out.append(_attention_bench(cfg["model"], cfg["heads"], 128 if quick else 512, rng,
                                    True, spec))
    return [b for b in out if not kernels or b.kernel in kernels]


def run_bench(b: Bench, spec, trials: int, seed: int) -> dict:
    emu = Emulator(spec)
    consts = b.consts

    def lower(f):
        return lower_primfunc(f, spec, b.kernel, consts=consts, max_ops=MAX_OPS)

    def run(program):
        return emu.run(program, b.inputs, params=b.params).counters

    def build_template(knobs):
        import tvm
        from tvm import s_tir
        sch = s_tir.Schedule(tvm.IRModule({"main": b.func}))
        b.schedule_fn(sch, **knobs)
        return lower(sch.mod["main"])

    t0 = time.time()
    if b.space is not None:
        res = search_space(b.space, b.build, run, trials=trials, seed=seed)
    else:
        res = search(b.func, b.schedule_fn, b.knob_names, lower, run, trials=trials,
                     seed=seed, fixed=b.fixed)
    if res.best is None:
        raise RuntimeError(f"{b.kernel} {b.shape}: every candidate was rejected: "
                           f"{res.candidates[0].rejected}")
    best = res.best
    out = emu.run(best.program, b.inputs, params=b.params).outputs[b.output]
    out = out.astype(np.float32)[:len(b.reference)] if out.ndim == b.reference.ndim else out
    rel_err = float(np.abs(out.astype(np.float32) - b.reference).max()
                    / max(1e-6, np.abs(b.reference).max()))
    single = {k: (1 if k.startswith("slots_") else v) for k, v in best.knobs.items()}
    db_off = run((b.build or build_template)(single)).total_cycles
    compute = b.macs / spec.mma_macs_per_cycle[b.mma_kind]
    burst = spec.dram_burst_bytes
    bandwidth = -(-b.min_bytes // burst) * burst / spec.dram_bytes_per_cycle
    vector = float(best.counters["busy_cycles"]["vector"])
    bounds = {"compute": compute, "vector": vector, "bandwidth": bandwidth}
    bound = max(bounds, key=bounds.get)
    roof = bounds[bound]
    return {"kernel": b.kernel, "model": b.model, "shape": b.shape, "spec": spec.name,
            "cycles": best.cycles, "roofline_cycles": round(roof),
            "roofline_ratio": round(best.cycles / roof, 3), "bound": bound,
            "compute_cycles": round(compute), "vector_cycles": round(vector),
            "bandwidth_cycles": round(bandwidth),
            "target_ratio": b.target,
            "meets_target": None if b.target is None else best.cycles / roof <= b.target,
            "db_off_cycles": db_off, "db_speedup": round(db_off / best.cycles, 3),
            "dram_read_bytes": best.counters["dram_read_bytes"],
            "min_dram_bytes": b.min_bytes, "tcm_bytes": best.program.tcm_bytes,
            "max_rel_err": rel_err, "knobs": best.knobs,
            "candidates_measured": len(res.measured),
            "candidates_rejected": sum(c.rejected is not None for c in res.candidates),
            "search_s": round(time.time() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="SmolLM2 shapes only")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    ap.add_argument("--spec", default="edge-npu-16mb")
    ap.add_argument("--trials", type=int, default=None, help="candidates per kernel")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models", default=None, help="comma list of smollm2,llama7b")
    ap.add_argument("--kernels", default=None,
                    help="comma list, e.g. gemv_w4a16,decode_attn (default: all)")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    trials = args.trials or (64 if args.quick else 96)
    rng = np.random.default_rng(args.seed)
    rows = []
    hdr = (f"{'kernel':<12} {'model':<14} {'shape':<18} {'cycles':>10} {'roofline':>10} "
           f"{'ratio':>6} {'target':>6} {'bound':>9} {'DB on/off':>9} {'err':>8}  knobs")
    print(f"kernels on {spec.name}, {trials} candidates each")
    print(hdr)
    models = args.models.split(",") if args.models else None
    kernels = args.kernels.split(",") if args.kernels else None
    wrong = []
    for b in benches(args.quick, rng, spec, models, kernels):
        r = run_bench(b, spec, trials, args.seed)
        rows.append(r)
        r["correct"] = r["max_rel_err"] <= MAX_REL_ERR
        if not r["correct"]:
            wrong.append(f"{r['kernel']} {r['model']} {r['shape']}")
        ok = "-" if r["meets_target"] is None else "ok" if r["meets_target"] else "MISS"
        print(f"{r['kernel']:<12} {r['model']:<14} {r['shape']:<18} {r['cycles']:>10} "
              f"{r['roofline_cycles']:>10} {r['roofline_ratio']:>6.3f} {ok:>6} {r['bound']:>9} "
              f"{r['db_speedup']:>9.3f} {r['max_rel_err']:>8.1e}  {r['knobs']}", flush=True)
    if args.json:
        write_json(args.json, {"spec": spec.name, "trials": trials, "rows": rows})
    if wrong:
        print(f"WRONG RESULT (max relative error > {MAX_REL_ERR}): " + "; ".join(wrong),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
