"""How fast the NPU emulator executes command streams (wall time of ``Emulator.run``).

Three programs built with :class:`ProgramBuilder`, each checked against numpy first so the
benchmark measures correct programs:

* ``gemv_w4a16``: ``(1, K) @ (K, N)`` W4A16 weights in 64x64 tiles (4-bit packed weights
  with their scales co-located per tile row), double-buffered DMA on two channels,
  fp32 accumulation, store;
* ``gemm_fp16``: ``(M, K) @ (K, N)`` fp16 in 64x64 tiles, A and B tiles double-buffered,
  output tiles double-buffered and stored;
* ``smollm2_decode_layer``: one decode step of a SmolLM2-135M layer (hidden 576, 9 query /
  3 KV heads of 64, MLP 1536, W4A16 group 32): RMSNorm, QKV GEMVs, RoPE, KV-cache append,
  attention over a 256-token cache (mask from the runtime position), O projection,
  residual, RMSNorm, gate/up GEMVs, SiLU * up, down GEMV, residual.

Usage::

    python benchmarks/emulator_speed.py [--quick] [--json PATH] [--spec edge-npu-16mb]

Prints one row per program: commands, simulated cycles, wall seconds of one run (best and
median of several, after a first run that also validates the program), commands per wall
second and simulated cycles per wall second.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, DmaStore, DramRef, EventWait, Mma, TcmRef, Vector
from edgetvm.target.spec import load_spec
from report import write_json

TILE = 64
F16, F32 = np.float16, np.float32
DECODE_TARGET_S = 0.2


# -- W4A16 weights, co-located with their scales in tile order --------------------------------
def quantize_w4(w: np.ndarray, group: int):
    """(N, K) float -> packed (N, K/2) uint8 (MatMulNBits), scales (N, K/group) fp16, and
    the dequantised fp32 weights the NPU will compute with."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scales = (np.abs(g).max(axis=2) / 7.0 + 1e-8).astype(F16)
    q = np.clip(np.rint(g / scales.astype(F32)[..., None]) + 8, 0, 15).astype(np.uint8)
    q = q.reshape(n, k)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    deq = (q.astype(F32) - 8) * np.repeat(scales.astype(F32), group, axis=1)
    return packed, scales, deq


def tile_order(packed: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """One uint8 row per (n-tile, k-tile, n): the tile row's 32 weight bytes, then its scales.

    A 64x64 tile is then one dense DMA of ``64 x (32 + 2 * 64 / group)`` bytes.
    """
    n, half = packed.shape
    kt, nt, spt = half * 2 // TILE, n // TILE, TILE // group
    s8 = scales.view(np.uint8).reshape(n, kt, spt * 2)
    p8 = packed.reshape(n, kt, TILE // 2)
    rows = np.concatenate([p8, s8], axis=2)                       # (n, kt, width)
    rows = rows.reshape(nt, TILE, kt, -1).transpose(0, 2, 1, 3)   # (nt, kt, 64, width)
    return np.ascontiguousarray(rows.reshape(nt * kt * TILE, -1))


class TileRing:
    """``nbuf`` TCM buffers that DMA fills (alternating channels) and one unit drains.

    ``load`` emits the DMA of the next buffer (waiting until the consumer of the buffer's
    previous contents signalled ``empty``); the consumer waits on ``full`` and signals
    ``empty``. Events are counting semaphores, so one pair per buffer serves every round.
    """

    def __init__(self, b: ProgramBuilder, shape, dtype, nbuf=2):
        self.b, self.nbuf, self.count = b, nbuf, 0
        self.channels = b.spec.dma_channels
        self.bufs = [b.tcm(shape, dtype) for _ in range(nbuf)]
        self.full = [b.event() for _ in range(nbuf)]
        self.empty = [b.event() for _ in range(nbuf)]

    def load(self, src: DramRef):
        s = self.count % self.nbuf
        wait = (self.empty[s],) if self.count >= self.nbuf else ()
        self.b.emit(DmaLoad(dst=self.bufs[s], src=src, channel=s % self.channels, wait=wait,
                            signal=(self.full[s],)))
        self.count += 1
        return self.bufs[s], self.full[s], self.empty[s]


def linear_w4(b, ring, x: TcmRef, wname: str, k: int, n: int, out: TcmRef, group: int,
              wait=(), signal=()):
    """``out (1, n) fp32 = x (1, k) fp16 @ W^T``, one DMA + one MMA per 64x64 weight tile."""
    kt, nt = k // TILE, n // TILE
    width = TILE // 2 + 2 * (TILE // group)
    for j in range(nt):
        for i in range(kt):
            buf, full, empty = ring.load(b.dram(wname, row0=(j * kt + i) * TILE, rows=TILE))
            first, last = (j, i) == (0, 0), (j, i) == (nt - 1, kt - 1)
            b.emit(Mma(out=out.cols(j * TILE, TILE), a=x.cols(i * TILE, TILE),
                       b=TcmRef(buf.offset, (TILE, TILE // 2), "uint8", width),
                       scales=TcmRef(buf.offset + TILE // 2, (TILE, TILE // group), "float16",
                                     width // 2),
                       group_size=group, transpose_b=True, accumulate=i > 0,
                       wait=(full,) + (tuple(wait) if first else ()),
                       signal=(empty,) + (tuple(signal) if last else ())))


def weight_tensor(b, rng, name, n, k, group):
    w = rng.standard_normal((n, k)).astype(F32) / np.sqrt(k)
    packed, scales, deq = quantize_w4(w, group)
    b.tensor(name, (n // TILE * k // TILE * TILE, TILE // 2 + 2 * TILE // group), "uint8",
             "const", tile_order(packed, scales, group))
    return deq


# -- GEMV ------------------------------------------------------------------------------------------
def build_gemv(spec, k, n, group=32, seed=0):
    rng = np.random.default_rng(seed)
    b = ProgramBuilder(f"gemv_w4a16_{k}x{n}", spec)
    x = rng.standard_normal((1, k)).astype(F16)
    b.tensor("x", x.shape, "float16", "input")
    b.tensor("y", (1, n), "float32", "output")
    deq = weight_tensor(b, rng, "w", n, k, group)
    tx, ty = b.tcm((1, k), "float16"), b.tcm((1, n), "float32")
    ring = TileRing(b, (TILE, TILE // 2 + 2 * TILE // group), "uint8")
    ex, done = b.event(), b.event()
    b.emit(DmaLoad(dst=tx, src=b.dram("x"), channel=1 % spec.dma_channels, signal=(ex,)))
    linear_w4(b, ring, tx, "w", k, n, ty, group, wait=(ex,), signal=(done,))
    b.emit(DmaStore(dst=b.dram("y"), src=ty, wait=(done,)))
    ref = x.astype(F32) @ deq.T
    return b.build(), {"x": x}, {}, {"y": ref}


# -- GEMM ------------------------------------------------------------------------------------------
def build_gemm(spec, m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    b = ProgramBuilder(f"gemm_fp16_{m}x{k}x{n}", spec)
    a = rng.standard_normal((m, k)).astype(F16)
    w = rng.standard_normal((k, n)).astype(F16)
    b.tensor("a", a.shape, "float16", "input")
    b.tensor("w", w.shape, "float16", "const", w)
    b.tensor("y", (m, n), "float32", "output")
    ring_a = TileRing(b, (TILE, TILE), "float16")
    ring_b = TileRing(b, (TILE, TILE), "float16")
    outs = [b.tcm((TILE, TILE), "float32") for _ in range(2)]
    computed = [b.event() for _ in range(2)]
    stored = [b.event() for _ in range(2)]
    t = 0
    for mi in range(m // TILE):
        for nj in range(n // TILE):
            o = t % 2
            for ki in range(k // TILE):
                ta, fa, ea = ring_a.load(b.dram("a", mi * TILE, ki * TILE, TILE, TILE))
                tb, fb, eb = ring_b.load(b.dram("w", ki * TILE, nj * TILE, TILE, TILE))
                wait = (fa, fb) + ((stored[o],) if ki == 0 and t >= 2 else ())
                last = ki == k // TILE - 1
                b.emit(Mma(out=outs[o], a=ta, b=tb, accumulate=ki > 0, wait=wait,
                           signal=(ea, eb) + ((computed[o],) if last else ())))
            b.emit(DmaStore(dst=b.dram("y", mi * TILE, nj * TILE, TILE, TILE), src=outs[o],
                            channel=o % spec.dma_channels, wait=(computed[o],),
                            signal=(stored[o],)))
            t += 1
    ref = a.astype(F32) @ w.astype(F32)
    return b.build(), {"a": a}, {}, {"y": ref}


# -- one SmolLM2-135M decode layer -----------------------------------------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 576, 9, 3, 64, 1536
EPS, THETA = 1e-5, 10000.0


def rope_tables(max_len):
    inv = 1.0 / THETA ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    ang = np.arange(max_len)[:, None] * inv[None, :]
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


class _Vec:
    """Emits one vector op and returns its dst; ``wait`` / ``signal`` go in as keywords."""

    def __init__(self, b):
        self.b = b

    def __call__(self, op, dst, *srcs, **kw):
        self.b.emit(Vector(op=op, dst=dst, srcs=srcs, **kw))
        return dst


def rmsnorm(b, vec, x32, gamma, out16, wait=(), signal=()):
    """``out16 = x32 * rsqrt(mean(x32^2) + eps) * gamma`` on the vector unit."""
    n = x32.shape[1]
    sq = vec("mul", b.tcm((1, n), "float32"), x32, x32, wait=tuple(wait))
    ss = vec("reduce_sum", b.tcm((1, 1), "float32"), sq)
    ms = vec("mul", b.tcm((1, 1), "float32"), ss, imm=1.0 / n)
    r = vec("rsqrt", b.tcm((1, 1), "float32"), ms, imm=EPS)
    xn = vec("mul", b.tcm((1, n), "float32"), x32, r)
    vec("mul", out16, xn, gamma, signal=tuple(signal))
    return out16


def build_decode_layer(spec, max_len=256, group=32, seed=0):
    """One decode step at runtime position ``pos`` (the cache holds ``pos`` earlier tokens)."""
    rng = np.random.default_rng(seed)
    b = ProgramBuilder("smollm2_decode_layer", spec)
    vec = _Vec(b)
    pos = b.param("pos")
    nch = spec.dma_channels
    x = (rng.standard_normal((1, HIDDEN)) * 0.5).astype(F16)
    g1 = (1 + 0.1 * rng.standard_normal((1, HIDDEN))).astype(F32)
    g2 = (1 + 0.1 * rng.standard_normal((1, HIDDEN))).astype(F32)
    cos, sin = rope_tables(max_len)
    b.tensor("x", x.shape, "float16", "input")
    b.tensor("y", (1, HIDDEN), "float32", "output")
    b.tensor("g1", g1.shape, "float32", "const", g1)
    b.tensor("g2", g2.shape, "float32", "const", g2)
    b.tensor("cos", cos.shape, "float32", "const", cos)
    b.tensor("sin", sin.shape, "float32", "const", sin)
    kv_shape = (KV_HEADS * max_len, HEAD_DIM)
    b.tensor("k_cache", kv_shape, "float16", "state")
    b.tensor("v_cache", kv_shape, "float16", "state")
    qd, kd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    W = {name: weight_tensor(b, rng, name, n, k, group) for name, n, k in [
        ("wq", qd, HIDDEN), ("wk", kd, HIDDEN), ("wv", kd, HIDDEN), ("wo", HIDDEN, qd),
        ("wgate", MLP, HIDDEN), ("wup", MLP, HIDDEN), ("wdown", HIDDEN, MLP)]}
    ring = TileRing(b, (TILE, TILE // 2 + 2 * TILE // group), "uint8")
    kv_ring = TileRing(b, (TILE, HEAD_DIM), "float16")
    ev = b.event

    # inputs, norm weights and this position's RoPE rows (one DRAM row broadcast to every
    # head with a zero DRAM row stride)
    tx16 = b.tcm((1, HIDDEN), "float16")
    tg1, tg2 = b.tcm((1, HIDDEN), "float32"), b.tcm((1, HIDDEN), "float32")
    tcos, tsin = b.tcm((HEADS, HEAD_DIM), "float32"), b.tcm((HEADS, HEAD_DIM), "float32")
    e_in = [ev() for _ in range(5)]
    for j, (dst, src) in enumerate([
            (tx16, b.dram("x")), (tg1, b.dram("g1")), (tg2, b.dram("g2")),
            (tcos, DramRef("cos", (HEADS, HEAD_DIM), 0, pos * HEAD_DIM)),
            (tsin, DramRef("sin", (HEADS, HEAD_DIM), 0, pos * HEAD_DIM))]):
        b.emit(DmaLoad(dst=dst, src=src, channel=j % nch, signal=(e_in[j],)))

    # RMSNorm 1
    x32 = vec("cast", b.tcm((1, HIDDEN), "float32"), tx16, wait=tuple(e_in[:2]))
    h16, e_h = b.tcm((1, HIDDEN), "float16"), ev()
    rmsnorm(b, vec, x32, tg1, h16, signal=(e_h,))

    # QKV
    q, k, v = b.tcm((1, qd), "float32"), b.tcm((1, kd), "float32"), b.tcm((1, kd), "float32")
    e_qkv = ev()
    linear_w4(b, ring, h16, "wq", HIDDEN, qd, q, group, wait=(e_h,))
    linear_w4(b, ring, h16, "wk", HIDDEN, kd, k, group)
    linear_w4(b, ring, h16, "wv", HIDDEN, kd, v, group, signal=(e_qkv,))

    # RoPE; q is pre-scaled by 1/sqrt(head_dim) in the softmax's exp instead
    qh = TcmRef(q.offset, (HEADS, HEAD_DIM), "float32")
    kh = TcmRef(k.offset, (KV_HEADS, HEAD_DIM), "float32")
    vh = TcmRef(v.offset, (KV_HEADS, HEAD_DIM), "float32")
    q16 = b.tcm((HEADS, HEAD_DIM), "float16")
    k16, v16 = b.tcm((KV_HEADS, HEAD_DIM), "float16"), b.tcm((KV_HEADS, HEAD_DIM), "float16")
    e_kv16 = ev()
    vec("rope", q16, qh, tcos, tsin, wait=(e_qkv, e_in[3], e_in[4]))
    vec("rope", k16, kh, tcos.rows(0, KV_HEADS), tsin.rows(0, KV_HEADS))
    vec("cast", v16, vh, signal=(e_kv16,))

    # append this token's K and V at row ``pos`` of every KV head
    e_app = [ev() for _ in range(nch)]
    e_app_v = ev()
    b.emit(DmaStore(dst=DramRef("k_cache", (KV_HEADS, HEAD_DIM), max_len * HEAD_DIM,
                                pos * HEAD_DIM), src=k16, wait=(e_kv16,), signal=(e_app_v,)))
    b.emit(DmaStore(dst=DramRef("v_cache", (KV_HEADS, HEAD_DIM), max_len * HEAD_DIM,
                                pos * HEAD_DIM), src=v16, wait=(e_app_v,),
                    signal=tuple(e_app)))
    for c in range(1, nch):      # channel 0 is ordered by program order
        b.emit(EventWait(on=f"dma{c}", wait=(e_app[c],)))

    # attention: per KV head, scores of its 3 query heads over the whole cache, masked to
    # the pos + 1 valid tokens, softmax, then P @ V
    attn = b.tcm((HEADS, HEAD_DIM), "float32")
    attn16 = b.tcm((1, qd), "float16")
    rep = HEADS // KV_HEADS
    ntiles = max_len // TILE
    e_attn = ev()
    for g in range(KV_HEADS):
        scores = b.tcm((rep, max_len), "float32")
        e_s = ev()
        for t in range(ntiles):
            buf, full, empty = kv_ring.load(b.dram("k_cache", g * max_len + t * TILE, 0, TILE))
            b.emit(Mma(out=scores.cols(t * TILE, TILE), a=q16.rows(g * rep, rep), b=buf,
                       transpose_b=True, wait=(full,),
                       signal=(empty,) + ((e_s,) if t == ntiles - 1 else ())))
        masked = vec("mask", b.tcm((rep, max_len), "float32"), scores, limit=pos + 1,
                     wait=(e_s,))
        mx = vec("reduce_max", b.tcm((rep, 1), "float32"), masked)
        sh = vec("sub", b.tcm((rep, max_len), "float32"), masked, mx)
        ex = vec("exp", b.tcm((rep, max_len), "float32"), sh, imm=1.0 / np.sqrt(HEAD_DIM))
        den = vec("reduce_sum", b.tcm((rep, 1), "float32"), ex)
        e_p = ev()
        p16 = vec("div", b.tcm((rep, max_len), "float16"), ex, den, signal=(e_p,))
        out = attn.rows(g * rep, rep)
        for t in range(ntiles):
            buf, full, empty = kv_ring.load(b.dram("v_cache", g * max_len + t * TILE, 0, TILE))
            last = g == KV_HEADS - 1 and t == ntiles - 1
            b.emit(Mma(out=out, a=p16.cols(t * TILE, TILE), b=buf, accumulate=t > 0,
                       wait=(full,) + ((e_p,) if t == 0 else ()),
                       signal=(empty,) + ((e_attn,) if last else ())))
    e_a16 = ev()
    vec("cast", TcmRef(attn16.offset, (HEADS, HEAD_DIM), "float16"), attn, wait=(e_attn,),
        signal=(e_a16,))

    # O projection + residual, RMSNorm 2
    o, e_o = b.tcm((1, HIDDEN), "float32"), ev()
    linear_w4(b, ring, attn16, "wo", qd, HIDDEN, o, group, wait=(e_a16,), signal=(e_o,))
    x1 = vec("add", b.tcm((1, HIDDEN), "float32"), x32, o, wait=(e_o,))
    h2, e_h2 = b.tcm((1, HIDDEN), "float16"), ev()
    rmsnorm(b, vec, x1, tg2, h2, wait=(e_in[2],), signal=(e_h2,))

    # MLP
    gate, up, e_gu = b.tcm((1, MLP), "float32"), b.tcm((1, MLP), "float32"), ev()
    linear_w4(b, ring, h2, "wgate", HIDDEN, MLP, gate, group, wait=(e_h2,))
    linear_w4(b, ring, h2, "wup", HIDDEN, MLP, up, group, signal=(e_gu,))
    act = vec("silu", b.tcm((1, MLP), "float32"), gate, wait=(e_gu,))
    act16, e_act = b.tcm((1, MLP), "float16"), ev()
    vec("mul", act16, act, up, signal=(e_act,))
    down, e_d = b.tcm((1, HIDDEN), "float32"), ev()
    linear_w4(b, ring, act16, "wdown", MLP, HIDDEN, down, group, wait=(e_act,), signal=(e_d,))
    y, e_y = b.tcm((1, HIDDEN), "float32"), ev()
    vec("add", y, x1, down, wait=(e_d,), signal=(e_y,))
    b.emit(DmaStore(dst=b.dram("y"), src=y, wait=(e_y,)))
    program = b.build()

    # a cache with pos earlier tokens, and the numpy reference of this step
    p = max_len - 1
    kc = np.zeros((KV_HEADS, max_len, HEAD_DIM), F16)
    vc = np.zeros((KV_HEADS, max_len, HEAD_DIM), F16)
    kc[:, :p] = rng.standard_normal((KV_HEADS, p, HEAD_DIM)).astype(F16)
    vc[:, :p] = rng.standard_normal((KV_HEADS, p, HEAD_DIM)).astype(F16)
    inputs = {"x": x, "k_cache": kc.reshape(kv_shape), "v_cache": vc.reshape(kv_shape)}
    ref = decode_reference(x, g1, g2, W, cos[p], sin[p], kc.copy(), vc.copy(), p)
    return program, inputs, {"pos": p}, {"y": ref}


def decode_reference(x, g1, g2, W, cos, sin, kc, vc, pos):
    """numpy, fp32 math with fp16 at the same points as the program."""
    def rms(v, g):
        r = 1.0 / np.sqrt((v * v).sum() / v.shape[1] + EPS)
        return (v * r * g).astype(F16).astype(F32)

    def rope(t):
        h = HEAD_DIM // 2
        return t * cos + np.concatenate([-t[:, h:], t[:, :h]], axis=1) * sin

    x32 = x.astype(F32)
    h = rms(x32, g1)
    q, k, v = h @ W["wq"].T, h @ W["wk"].T, h @ W["wv"].T
    q16 = rope(q.reshape(HEADS, HEAD_DIM)).astype(F16).astype(F32)
    kc[:, pos] = rope(k.reshape(KV_HEADS, HEAD_DIM)).astype(F16)
    vc[:, pos] = v.reshape(KV_HEADS, HEAD_DIM).astype(F16)
    rep = HEADS // KV_HEADS
    attn = np.empty((HEADS, HEAD_DIM), F32)
    for g in range(KV_HEADS):
        s = q16[g * rep:(g + 1) * rep] @ kc[g].astype(F32).T
        s[:, pos + 1:] = -np.inf
        e = np.exp((s - s.max(axis=1, keepdims=True)) / np.sqrt(HEAD_DIM))
        p = (e / e.sum(axis=1, keepdims=True)).astype(F16).astype(F32)
        attn[g * rep:(g + 1) * rep] = p @ vc[g].astype(F32)
    x1 = x32 + attn.reshape(1, -1).astype(F16).astype(F32) @ W["wo"].T
    h2 = rms(x1, g2)
    gate, up = h2 @ W["wgate"].T, h2 @ W["wup"].T
    act = (gate / (1 + np.exp(-gate)) * up).astype(F16).astype(F32)
    return x1 + act @ W["wdown"].T


# -- measurement -----------------------------------------------------------------------------------
def measure(spec, name, built, repeats):
    program, inputs, params, refs = built
    emu = Emulator(spec)
    t0 = time.perf_counter()
    r = emu.run(program, inputs, params)        # validates and plans the program, once
    first = time.perf_counter() - t0
    for k, want in refs.items():
        got = r.outputs[k]
        err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
        if not np.allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max()):
            raise SystemExit(f"{name}: output {k!r} differs from numpy (max rel err {err:.3g})")
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        emu.run(program, inputs, params)
        walls.append(time.perf_counter() - t0)
    best, median = min(walls), statistics.median(walls)
    c = r.counters
    return {"program": name, "commands": len(program), "simulated_cycles": c.total_cycles,
            "simulated_us": c.time_us, "first_run_wall_s": first, "wall_s_best": best,
            "wall_s_median": median, "commands_per_s": len(program) / median,
            "sim_cycles_per_wall_s": c.total_cycles / median, "max_rel_err": err,
            "dram_read_bytes": c.dram_read_bytes, "repeats": repeats, "spec": spec.name}


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="smaller GEMV/GEMM, fewer repeats")
    ap.add_argument("--json", help="write the rows as JSON to this path")
    ap.add_argument("--spec", default="edge-npu-16mb", help="NPU preset or spec file")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    repeats = 3 if args.quick else 7
    gk, gn = (1024, 1024) if args.quick else (2048, 2048)
    mm = (128, 256, 256) if args.quick else (256, 512, 512)
    cases = [
        (f"gemv_w4a16 1x{gk}x{gn}", lambda: build_gemv(spec, gk, gn)),
        (f"gemm_fp16 {mm[0]}x{mm[1]}x{mm[2]}", lambda: build_gemm(spec, *mm)),
        ("smollm2_decode_layer kv256", lambda: build_decode_layer(spec)),
    ]
    rows = [measure(spec, name, build(), repeats) for name, build in cases]
    head = (f"{'program':<30} {'commands':>8} {'sim cycles':>11} {'first s':>8} {'best s':>8} "
            f"{'median s':>8} {'commands/s':>11} {'sim cycles/s':>13}")
    print(f"emulator speed on {spec.name} ({repeats} runs each after a first, validating run)")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['program']:<30} {r['commands']:>8} {r['simulated_cycles']:>11} "
              f"{r['first_run_wall_s']:>8.4f} {r['wall_s_best']:>8.4f} {r['wall_s_median']:>8.4f} "
              f"{r['commands_per_s']:>11.0f} {r['sim_cycles_per_wall_s']:>13.3g}")
    decode = rows[-1]
    verdict = "meets" if decode["wall_s_median"] < DECODE_TARGET_S else "MISSES"
    print(f"decode layer: {decode['wall_s_median']:.3f} s median wall, {verdict} the "
          f"< {DECODE_TARGET_S} s target")
    if args.json:
        write_json(args.json, {"spec": spec.name, "quick": args.quick, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
