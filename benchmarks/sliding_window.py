"""Decode attention with a sliding window: what the window saves, measured on the emulator.

A model whose attention sees only the last ``W`` keys (Mistral, Qwen2, Gemma-2's and
Gemma-3's local layers) needs only those keys' K and V in a decode step. The decode
attention kernel skips the KV tiles wholly behind the window (tile 0 always runs: it
starts the online softmax), so a step reads about ``W`` tokens of K and V, not the whole
valid length. For SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64,
default knobs: 64-token KV tiles), at several valid lengths of one static program, this
prints the kernel's measured cycles and DRAM bytes read with the window and without it
(causal), and the bytes the window's keys need: ``2 (K, V) * kv_heads * head_dim * 2 B``
per key over ``min(W, length)`` keys, plus the query.

    python benchmarks/sliding_window.py [--quick] [--json PATH] [--window W]

Every output is checked against numpy (softmax over the visible keys, written here from
the definition); exits 1 if one differs.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from edgetvm.target.emulator import Emulator
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.attention import ATTENTION_LOWERING, schedule_decode_attention
from edgetvm.tir_schedules.kv_cache import KVCacheLayout, gather_reference
from report import write_json

HQ, HK, D = 9, 3, 64           # SmolLM2-135M
PAGE = 16
TILE = 64


def _reference(q, k, v, window):
    """q (Hq, D) at the last of L keys; k, v (Hkv, L, D); keys ``window`` or more behind
    the query hidden (None: causal)."""
    length = k.shape[1]
    keep = np.ones(length, bool)
    if window is not None:
        keep &= np.arange(length) > length - 1 - window
    out = np.zeros((HQ, D), np.float32)
    for h in range(HQ):
        s = k[h // (HQ // HK)].astype(np.float32) @ q[h].astype(np.float32) / np.sqrt(D)
        s = np.where(keep, s, -np.inf)
        w = np.exp(s - s.max())
        out[h] = (w / w.sum()) @ v[h // (HQ // HK)].astype(np.float32)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="a 1,024-token cache, window 256")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    ap.add_argument("--window", type=int, default=None,
                    help="window in tokens (default 512; --quick 256)")
    args = ap.parse_args(argv)
    capacity = 1024 if args.quick else 4096
    window = args.window or (256 if args.quick else 512)
    lengths = [window // 2, capacity // 4, capacity // 2, capacity]
    spec = load_spec("edge-npu-16mb")
    pages = capacity // PAGE
    lay = KVCacheLayout(kv_heads=HK, head_dim=D, num_pages=pages, page_tokens=PAGE)
    progs = {w: lower_primfunc(schedule_decode_attention(
        lay, HQ, pages, spec, tile_kv=TILE, slots_kv=2, slots_s=1, window=w).mod["main"],
        spec, "decode_attention", outputs=["out"], **ATTENTION_LOWERING)
        for w in (None, window)}
    rng = np.random.default_rng(0)
    k = rng.standard_normal(lay.shape).astype(np.float16)
    v = rng.standard_normal(lay.shape).astype(np.float16)
    table = [int(p) for p in rng.permutation(pages)]
    q = rng.standard_normal((HQ, D)).astype(np.float16)
    print(f"decode attention, SmolLM2 shape, cache {capacity} tokens, window {window}, "
          f"64-token KV tiles (one static program per column)")
    print(f"{'length':>7} {'causal cycles':>14} {'window cycles':>14} {'ratio':>6} "
          f"{'causal read B':>14} {'window read B':>14} {'window keys B':>14}  numerics")
    rows, wrong = [], False
    for length in lengths:
        row = {"length": length, "window": window, "capacity": capacity}
        for w, prog in progs.items():
            r = Emulator(spec).run(prog, {"K_cache": k, "V_cache": v, "q": q},
                                   params={**lay.page_table_params(table, pages),
                                           "valid_len": length})
            ref = _reference(q, gather_reference(k, table, length),
                             gather_reference(v, table, length), w)
            err = float(np.abs(r.outputs["out"].astype(np.float32) - ref).max())
            tag = "window" if w else "causal"
            row[f"{tag}_cycles"] = int(r.counters.total_cycles)
            row[f"{tag}_dram_read_B"] = int(r.counters.dram_read_bytes)
            row[f"{tag}_max_err"] = err
            wrong |= err > 3e-3
        row["window_keys_B"] = 2 * HK * D * 2 * min(window, length) + HQ * D * 2
        row["ratio"] = round(row["window_cycles"] / row["causal_cycles"], 3)
        err = max(row["causal_max_err"], row["window_max_err"])
        print(f"{length:>7} {row['causal_cycles']:>14,} {row['window_cycles']:>14,} "
              f"{row['ratio']:>6.3f} {row['causal_dram_read_B']:>14,} "
              f"{row['window_dram_read_B']:>14,} {row['window_keys_B']:>14,}  "
              f"{'ok' if err <= 3e-3 else 'WRONG'} (max err {err:.1e})", flush=True)
        rows.append(row)
    if args.json:
        write_json(args.json, {"rows": rows})
    if wrong:
        print("WRONG ANSWER: an output differs from numpy beyond 3e-3", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
