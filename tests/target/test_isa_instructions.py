"""One test per NPU instruction: the emulator's result against numpy.

Tolerances: data that only moves (DMA, copy, cast, mask, int8 MMA) must be exact;
fp32 vector arithmetic is compared at rtol 1e-6; MMAs accumulate in fp32 like numpy's
float32 matmul, but in another summation order, so rtol 1e-4; results stored as fp16
(an fp16 data path) at rtol 1e-2.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from edgetvm.errors import InvalidProgramError
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.emulator.functional import tcm_view
from edgetvm.target.isa import (VECTOR_OP_ARITY, Affine, DmaLoad, DmaStore, DramRef, End,
                                EventSignal, EventWait, HostOp, Launch, Mma, TcmRef, Vector)

RNG = np.random.default_rng(1234)
F32 = dict(rtol=1e-6, atol=1e-6)
MMA_TOL = dict(rtol=1e-4, atol=1e-4)
FP16_TOL = dict(rtol=1e-2, atol=1e-2)


def ceil_div(a, b):
    return -(-a // b)


def dma_cycles(spec, nbytes):
    """A lone contiguous transfer from the start of a tensor: set-up, then whole bursts."""
    bursts = ceil_div(nbytes, spec.dram_burst_bytes)
    return spec.dma_setup_cycles + math.ceil(bursts * spec.dram_burst_bytes /
                                             spec.dram_bytes_per_cycle)


def mma_cycles(spec, m, n, k, kind):
    """Issue latency plus padded native tiles (W4A16: or the dequantiser, if slower)."""
    tm, tn, tk = spec.mma_tile
    tiles = ceil_div(m, tm) * ceil_div(n, tn) * ceil_div(k, tk)
    macs = ceil_div(tiles * tm * tn * tk, spec.mma_macs_per_cycle[kind])
    if kind == "w4a16":
        macs = max(macs, ceil_div(n * k, spec.w4a16_dequant_weights_per_cycle))
    return spec.mma_issue_cycles + macs


def vector_cycles(spec, op, rows, cols):
    """Every row takes whole passes of the lanes."""
    return rows * ceil_div(cols, spec.vector_lanes) * spec.vector_op_cycles[op]


# -- helpers ------------------------------------------------------------------------------
def load_inputs(b, spec, arrays):
    """Declare each array as an input, DMA it into its own TCM region; -> (refs, events)."""
    refs, events = [], []
    for j, (name, x) in enumerate(arrays.items()):
        b.tensor(name, x.shape, str(x.dtype), "input")
        t = b.tcm(x.shape, str(x.dtype))
        e = b.event()
        b.emit(DmaLoad(dst=t, src=b.dram(name), channel=j % spec.dma_channels, signal=(e,)))
        refs.append(t)
        events.append(e)
    return refs, events


def store_output(b, ref, wait, name="y"):
    b.tensor(name, ref.shape, ref.dtype, "output")
    b.emit(DmaStore(dst=b.dram(name), src=ref, wait=tuple(wait)))


def run_vector(spec, op, xs, dst_shape=None, dst_dtype=None, params=None, **vkw):
    """x0, x1, ... -> one Vector op -> y; returns (y, counters)."""
    b = ProgramBuilder(f"vector_{op}", spec)
    for p in params or {}:
        b.param(p)
    arrays = {f"x{j}": x for j, x in enumerate(xs)}
    refs, events = load_inputs(b, spec, arrays)
    dst = b.tcm(dst_shape or xs[0].shape, dst_dtype or str(xs[0].dtype))
    done = b.event()
    b.emit(Vector(op=op, dst=dst, srcs=tuple(refs), wait=tuple(events), signal=(done,), **vkw))
    store_output(b, dst, (done,))
    r = Emulator(spec).run(b.build(), arrays, params or {})
    return r.outputs["y"], r.counters


def run_mma(spec, a, bmat, out_shape, out_dtype="float32", **mkw):
    """a, b (+ scales/zeros in mkw as arrays) -> one Mma -> y."""
    b = ProgramBuilder("mma", spec)
    arrays = {"a": a, "b": bmat}
    for k in ("scales", "zeros"):
        v = mkw.pop(k, None)
        if v is not None:
            arrays[k] = v
    refs, events = load_inputs(b, spec, arrays)
    named = dict(zip(arrays, refs))
    out = b.tcm(out_shape, out_dtype)
    done = b.event()
    b.emit(Mma(out=out, a=named["a"], b=named["b"], scales=named.get("scales"),
               zeros=named.get("zeros"), wait=tuple(events), signal=(done,), **mkw))
    store_output(b, out, (done,))
    r = Emulator(spec).run(b.build(), arrays)
    return r.outputs["y"], r.counters


# -- DMA ----------------------------------------------------------------------------------
def test_dma_load_strided_window_into_strided_tcm(spec):
    x = RNG.standard_normal((16, 40)).astype(np.float32)
    b = ProgramBuilder("dma_window", spec)
    b.tensor("x", x.shape, "float32", "input")
    # rows 2..6, cols 3..9 of x into a TCM region whose rows are 12 elements apart
    tile = TcmRef(0, (5, 7), "float32", row_stride=12)
    e = b.event()
    b.emit(DmaLoad(dst=tile, src=b.dram("x", row0=2, col0=3, rows=5, cols=7), signal=(e,)))
    store_output(b, tile, (e,))
    emu = Emulator(spec)
    r = emu.run(b.build(tcm_bytes=5 * 12 * 4), {"x": x})
    np.testing.assert_array_equal(r.outputs["y"], x[2:7, 3:10])
    # the 5 gap elements after each row of the strided TCM region are untouched (zero)
    whole = tcm_view(emu.tcm, TcmRef(0, (5, 12), "float32"))
    np.testing.assert_array_equal(whole[:, :7], x[2:7, 3:10])
    assert not whole[:, 7:].any()
    assert r.counters.dram_read_bytes == 5 * 7 * 4
    assert r.counters.dram_write_bytes == 5 * 7 * 4


def test_dma_store_into_strided_dram_window(spec):
    x = RNG.standard_normal((4, 6)).astype(np.float16)
    b = ProgramBuilder("dma_store_window", spec)
    (t,), (e,) = load_inputs(b, spec, {"x": x})
    b.tensor("y", (10, 20), "float16", "output")
    b.emit(DmaStore(dst=b.dram("y", row0=5, col0=11, rows=4, cols=6), src=t, wait=(e,),
                    channel=1))
    y = Emulator(spec).run(b.build(), {"x": x}).outputs["y"]
    want = np.zeros((10, 20), np.float16)
    want[5:9, 11:17] = x
    np.testing.assert_array_equal(y, want)


def test_dma_raw_dram_ref_with_custom_row_stride(spec):
    # every other row of x: DRAM row stride 2 * cols
    x = RNG.standard_normal((8, 16)).astype(np.float32)
    b = ProgramBuilder("dma_every_other_row", spec)
    b.tensor("x", x.shape, "float32", "input")
    t = b.tcm((4, 16), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=DramRef("x", (4, 16), 32, 16), signal=(e,)))
    store_output(b, t, (e,))
    y = Emulator(spec).run(b.build(), {"x": x}).outputs["y"]
    np.testing.assert_array_equal(y, x[1::2])


def test_dma_zero_dram_row_stride_broadcasts_one_row(spec):
    table = RNG.standard_normal((10, 64)).astype(np.float32)
    b = ProgramBuilder("dma_broadcast", spec)
    pos = b.param("pos")
    b.tensor("table", table.shape, "float32", "input")
    t = b.tcm((9, 64), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=DramRef("table", (9, 64), 0, pos * 64), signal=(e,)))
    store_output(b, t, (e,))
    r = Emulator(spec).run(b.build(), {"table": table}, {"pos": 4})
    np.testing.assert_array_equal(r.outputs["y"], np.repeat(table[4:5], 9, axis=0))
    assert r.counters.dram_read_bytes == 9 * 64 * 4     # every row crosses the bus


@pytest.mark.parametrize("n, moved", [(3, 3), (8, 8), (100, 8), (0, 0), (-2, 0)])
def test_dma_valid_rows_is_a_runtime_repeat_count(spec, n, moved):
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    b = ProgramBuilder("dma_valid_rows", spec)
    rows = b.param("n")
    b.tensor("x", x.shape, "float32", "input")
    t = b.tcm(x.shape, "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), valid_rows=rows, signal=(e,)))
    b.tensor("y", x.shape, "float32", "output")
    b.emit(DmaStore(dst=b.dram("y"), src=t, wait=(e,), valid_rows=rows))
    r = Emulator(spec).run(b.build(), {"x": x}, {"n": n})
    want = np.zeros_like(x)
    want[:moved] = x[:moved]
    np.testing.assert_array_equal(r.outputs["y"], want)
    assert r.counters.dram_read_bytes == r.counters.dram_write_bytes == moved * 32 * 4
    assert r.counters.commands_skipped == (2 if moved == 0 else 0)
    # only the moved rows cost bus time: setup + ceil(bytes / bus width), or nothing
    assert r.counters.busy_cycles["dma0"] == 2 * (dma_cycles(spec, moved * 32 * 4) if moved
                                                  else 0)


def test_reading_tcm_an_earlier_kernel_left_is_refused(spec):
    # kernel 1 fills the tile; kernel 2 loads 3 of its 8 rows and stores all 8: rows 3..7
    # are kernel 1's data, stale for kernel 2 (on hardware: whatever was there)
    x = RNG.standard_normal((8, 32)).astype(np.float32)
    b = ProgramBuilder("stale_rows", spec)
    rows = b.param("n")
    b.tensor("x", x.shape, "float32", "input")
    b.tensor("y", x.shape, "float32", "output")
    t = b.tcm(x.shape, "float32")
    e, f = b.event(), b.event()
    b.emit(Launch(name="first"))
    b.emit(DmaLoad(dst=t, src=b.dram("x"), signal=(e,)))
    b.emit(DmaStore(dst=b.dram("y"), src=t, wait=(e,)))
    b.emit(Launch(name="second"))
    b.emit(DmaLoad(dst=t, src=b.dram("x"), valid_rows=rows, signal=(f,)))
    b.emit(DmaStore(dst=b.dram("y"), src=t, wait=(f,)))
    program = b.build()
    Emulator(spec).run(program, {"x": x}, {"n": 8})          # every row rewritten: fine
    with pytest.raises(InvalidProgramError, match=r"command 5: DmaStore reads TCM byte 384 "
                                                  r".*nothing wrote since its kernel was "
                                                  r"launched"):
        Emulator(spec).run(program, {"x": x}, {"n": 3})


@pytest.mark.parametrize("pos", [0, 5, 11])
def test_dma_dram_offset_from_runtime_parameter(spec, pos):
    cache = RNG.standard_normal((12, 64)).astype(np.float16)
    b = ProgramBuilder("dma_param_offset", spec)
    p = b.param("pos")
    b.tensor("cache", cache.shape, "float16", "input")
    t = b.tcm((1, 64), "float16")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=DramRef("cache", (1, 64), 64, p * 64), signal=(e,)))
    store_output(b, t, (e,))
    y = Emulator(spec).run(b.build(), {"cache": cache}, {"pos": pos}).outputs["y"]
    np.testing.assert_array_equal(y, cache[pos:pos + 1])


# -- MMA ----------------------------------------------------------------------------------
def test_mma_fp16(spec):
    a = RNG.standard_normal((16, 64)).astype(np.float16)
    w = RNG.standard_normal((64, 64)).astype(np.float16)
    y, c = run_mma(spec, a, w, (16, 64))
    np.testing.assert_allclose(y, a.astype(np.float32) @ w.astype(np.float32), **MMA_TOL)
    assert c.macs == 16 * 64 * 64
    # one native tile: tm * tn * tk MACs at the fp16 rate, plus the issue latency
    assert c.busy_cycles["matrix"] == spec.mma_issue_cycles + spec.mma_tile[0] * \
        spec.mma_tile[1] * spec.mma_tile[2] // spec.mma_macs_per_cycle["fp16"] == 16 + 32


def test_mma_accumulate(spec):
    a = RNG.standard_normal((16, 128)).astype(np.float16)
    w = RNG.standard_normal((128, 64)).astype(np.float16)
    b = ProgramBuilder("mma_acc", spec)
    (ta, tw), evs = load_inputs(b, spec, {"a": a, "w": w})
    out = b.tcm((16, 64), "float32")
    done = b.event()
    b.emit(Mma(out=out, a=ta.cols(0, 64), b=tw.rows(0, 64), wait=tuple(evs)))
    b.emit(Mma(out=out, a=ta.cols(64, 64), b=tw.rows(64, 64), accumulate=True, signal=(done,)))
    store_output(b, out, (done,))
    r = Emulator(spec).run(b.build(), {"a": a, "w": w})
    np.testing.assert_allclose(r.outputs["y"], a.astype(np.float32) @ w.astype(np.float32),
                               **MMA_TOL)
    assert r.counters.macs == 2 * 16 * 64 * 64


def test_mma_transpose_b(spec):
    a = RNG.standard_normal((32, 64)).astype(np.float16)
    wt = RNG.standard_normal((48, 64)).astype(np.float16)     # (N, K)
    y, _ = run_mma(spec, a, wt, (32, 48), transpose_b=True)
    np.testing.assert_allclose(y, a.astype(np.float32) @ wt.astype(np.float32).T, **MMA_TOL)


def test_mma_non_native_shape_5x70x48(spec):
    a = RNG.standard_normal((5, 48)).astype(np.float16)
    w = RNG.standard_normal((48, 70)).astype(np.float16)
    y, c = run_mma(spec, a, w, (5, 70))
    np.testing.assert_allclose(y, a.astype(np.float32) @ w.astype(np.float32), **MMA_TOL)
    # padded to ceil(5/16) x ceil(70/64) x ceil(48/64) = 1 x 2 x 1 native tiles
    assert c.busy_cycles["matrix"] == mma_cycles(spec, 5, 70, 48, "fp16") == \
        spec.mma_issue_cycles + 2 * 16 * 64 * 64 // spec.mma_macs_per_cycle["fp16"]
    assert c.macs == 5 * 70 * 48


def test_mma_int8_is_exact_int32(spec):
    a = RNG.integers(-128, 128, (16, 128), dtype=np.int8)
    w = RNG.integers(-128, 128, (128, 64), dtype=np.int8)
    a[0, :] = -128
    w[:, 0] = -128      # 128 * 128 * 128 = 2**21: far beyond int16, exact in int32
    y, c = run_mma(spec, a, w, (16, 64), out_dtype="int32")
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, a.astype(np.int64) @ w.astype(np.int64))
    assert y[0, 0] == 128 * 128 * 128
    assert c.busy_cycles["matrix"] == mma_cycles(spec, 16, 64, 128, "int8")


def pack_w4(q):
    """(N, K) ints in [0, 16) -> (N, K/2) uint8, even k in the low nibble (MatMulNBits)."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def w4_reference(a, q, scales, zeros, group):
    """a @ W^T, W[n, k] = (q - zero) * scale per group, in float64 from the codes."""
    n, k = q.shape
    w = np.empty((n, k), np.float64)
    for j in range(k // group):
        z = 8 if zeros is None else zeros[:, j:j + 1].astype(np.float64)
        w[:, j * group:(j + 1) * group] = (q[:, j * group:(j + 1) * group] - z) * \
            scales[:, j:j + 1].astype(np.float64)
    return a.astype(np.float64) @ w.T


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("zeros_dtype", [None, "uint8", "float16"])
def test_mma_w4a16(spec, group, zeros_dtype):
    m, n, k = 4, 64, 256
    a = RNG.standard_normal((m, k)).astype(np.float16)
    q = RNG.integers(0, 16, (n, k))
    scales = (RNG.random((n, k // group)) * 0.1 + 0.01).astype(np.float16)
    zeros = None
    if zeros_dtype == "uint8":
        zeros = RNG.integers(0, 16, (n, k // group)).astype(np.uint8)
    elif zeros_dtype == "float16":      # anywhere, fractional: MatMulNBits' float form
        zeros = (RNG.random((n, k // group)) * 30 - 7).astype(np.float16)
    packed = pack_w4(q)
    assert packed.shape == (n, k // 2)
    y, c = run_mma(spec, a, packed, (m, n), transpose_b=True, scales=scales, zeros=zeros,
                   group_size=group)
    np.testing.assert_allclose(y, w4_reference(a, q, scales, zeros, group), **MMA_TOL)
    assert c.busy_cycles["matrix"] == mma_cycles(spec, m, n, k, "w4a16")


def test_mma_w4a16_waits_for_a_slow_dequantiser(spec):
    # with a dequantiser slower than the MACs, the MMA takes N * K / its rate (+ issue)
    slow = spec.replace(w4a16_dequant_weights_per_cycle=16)
    m, n, k = 1, 64, 128
    a = RNG.standard_normal((m, k)).astype(np.float16)
    packed = pack_w4(RNG.integers(0, 16, (n, k)))
    scales = np.ones((n, k // 32), np.float16)
    _, c = run_mma(slow, a, packed, (m, n), transpose_b=True, scales=scales, group_size=32)
    assert c.busy_cycles["matrix"] == slow.mma_issue_cycles + n * k // 16 == 16 + 512


def test_w4a16_float_zero_points_are_not_rounded(spec):
    # one group of codes 3 with zero point 2.5 and scale 2: every weight is exactly 1.0
    a = np.ones((1, 32), np.float16)
    packed = np.full((16, 16), 0x33, np.uint8)
    scales = np.full((16, 1), 2.0, np.float16)
    zeros = np.full((16, 1), 2.5, np.float16)
    y, c = run_mma(spec, a, packed, (1, 16), transpose_b=True, scales=scales, zeros=zeros,
                   group_size=32)
    np.testing.assert_array_equal(y, np.full((1, 16), 32.0, np.float32))
    # float zero points move 2 bytes each, uint8 ones 1: the DMA counts what it moves
    _, c8 = run_mma(spec, a, packed, (1, 16), transpose_b=True, scales=scales,
                    zeros=np.full((16, 1), 2, np.uint8), group_size=32)
    assert c.dram_read_bytes - c8.dram_read_bytes == 16


def test_w4a16_default_zero_point_is_8(spec):
    # all nibbles 8 with the default zero point: every weight is 0
    a = RNG.standard_normal((1, 64)).astype(np.float16)
    packed = np.full((64, 32), 0x88, np.uint8)
    scales = np.ones((64, 2), np.float16)
    y, _ = run_mma(spec, a, packed, (1, 64), transpose_b=True, scales=scales, group_size=32)
    assert not y.any()
    # nibbles 9 (low) and 7 (high): w[:, even] = +1, w[:, odd] = -1
    packed[:] = 0x79
    y, _ = run_mma(spec, a, packed, (1, 64), transpose_b=True, scales=scales, group_size=32)
    af = a.astype(np.float32)
    np.testing.assert_allclose(y, np.full((1, 64), af[0, 0::2].sum() - af[0, 1::2].sum()),
                               **MMA_TOL)


# -- vector unit ----------------------------------------------------------------------------
BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
          "div": np.divide}


@pytest.mark.parametrize("op", sorted(BINARY))
@pytest.mark.parametrize("shape2", ["full", "row", "col", "imm"])
def test_vector_binary(spec, op, shape2):
    x = RNG.standard_normal((8, 96)).astype(np.float32)
    if shape2 == "imm":
        y, c = run_vector(spec, op, [x], imm=0.75)
        want = BINARY[op](x, np.float32(0.75))
    else:
        other = {"full": (8, 96), "row": (8, 1), "col": (1, 96)}[shape2]
        z = RNG.standard_normal(other).astype(np.float32)
        y, c = run_vector(spec, op, [x, z])
        want = BINARY[op](x, z)
    np.testing.assert_allclose(y, want, **F32)
    # 8 rows of 96: two passes of 64 lanes each
    assert c.busy_cycles["vector"] == vector_cycles(spec, op, 8, 96) == \
        8 * 2 * spec.vector_op_cycles[op]


def test_vector_binary_fp16_data_path(spec):
    x = RNG.standard_normal((4, 64)).astype(np.float16)
    z = RNG.standard_normal((4, 64)).astype(np.float16)
    y, _ = run_vector(spec, "mul", [x, z])
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32) * z.astype(np.float32),
                               **FP16_TOL)


@pytest.mark.parametrize("op, fn", [("reduce_max", np.max), ("reduce_sum", np.sum)])
def test_vector_reduce(spec, op, fn):
    x = RNG.standard_normal((6, 200)).astype(np.float32)
    y, c = run_vector(spec, op, [x], dst_shape=(6, 1))
    np.testing.assert_allclose(y, fn(x, axis=1, keepdims=True), rtol=1e-5, atol=1e-5)
    assert c.busy_cycles["vector"] == vector_cycles(spec, op, 6, 200)


def test_vector_exp(spec):
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    y, c = run_vector(spec, "exp", [x])
    np.testing.assert_allclose(y, np.exp(x), **F32)
    assert c.busy_cycles["vector"] == 4 * spec.vector_op_cycles["exp"]


def test_vector_exp_with_imm_scales_the_input(spec):
    # isa.py: "exp(x * imm)" (softmax with a 1/sqrt(d) scale folded in)
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    y, _ = run_vector(spec, "exp", [x], imm=0.125)
    np.testing.assert_allclose(y, np.exp(x * np.float32(0.125)), **F32)


def test_vector_rsqrt_with_eps(spec):
    x = RNG.random((4, 1)).astype(np.float32) * 3
    x[0, 0] = 0.0            # eps keeps it finite
    y, _ = run_vector(spec, "rsqrt", [x], imm=1e-5)
    np.testing.assert_allclose(y, 1.0 / np.sqrt(x.astype(np.float64) + 1e-5), rtol=1e-6)
    assert np.isfinite(y).all()


def test_vector_silu(spec):
    x = (RNG.standard_normal((4, 128)) * 4).astype(np.float32)
    y, _ = run_vector(spec, "silu", [x])
    xd = x.astype(np.float64)
    np.testing.assert_allclose(y, xd / (1 + np.exp(-xd)), rtol=1e-5, atol=1e-6)


def test_vector_gelu_is_erf_based(spec):
    x = np.linspace(-6, 6, 4 * 64, dtype=np.float32).reshape(4, 64)
    y, _ = run_vector(spec, "gelu", [x])
    erf = np.vectorize(math.erf)
    want = 0.5 * x.astype(np.float64) * (1 + erf(x.astype(np.float64) / math.sqrt(2)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=2e-6)
    # not the tanh approximation: they differ by ~1e-3 around |x| = 2
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    assert np.abs(tanh - want).max() > 1e-4


def test_vector_gelu_tanh_is_the_tanh_approximation(spec):
    x = np.linspace(-6, 6, 4 * 64, dtype=np.float32).reshape(4, 64)
    y, _ = run_vector(spec, "gelu_tanh", [x])
    xd = x.astype(np.float64)
    want = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=2e-6)
    erf = np.vectorize(math.erf)
    assert np.abs(0.5 * xd * (1 + erf(xd / math.sqrt(2))) - want).max() > 1e-4


def test_vector_cast_fp32_to_fp16(spec):
    x = (RNG.standard_normal((4, 64)) * 100).astype(np.float32)
    y, _ = run_vector(spec, "cast", [x], dst_dtype="float16")
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, x.astype(np.float16))     # round to nearest even


def test_vector_cast_fp16_to_fp32(spec):
    x = RNG.standard_normal((4, 64)).astype(np.float16)
    y, _ = run_vector(spec, "cast", [x], dst_dtype="float32")
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x.astype(np.float32))


def test_vector_copy(spec):
    x = RNG.integers(-100, 100, (3, 50)).astype(np.int32)
    y, c = run_vector(spec, "copy", [x])
    np.testing.assert_array_equal(y, x)
    assert c.busy_cycles["vector"] == vector_cycles(spec, "copy", 3, 50)


def test_vector_rope_rotate_half(spec):
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    ang = RNG.standard_normal((3, 32)).astype(np.float32)
    cos = np.concatenate([np.cos(ang)] * 2, axis=1)
    sin = np.concatenate([np.sin(ang)] * 2, axis=1)
    y, _ = run_vector(spec, "rope", [x, cos, sin])
    x1, x2 = x[:, :32], x[:, 32:]
    want = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_vector_rope_pairs_rotates_neighbouring_columns(spec):
    # GPT-J / Cohere: pairs (x[2i], x[2i+1]) rotate by the angle of i, cos/sin repeated
    # per pair; a rotation of the halves (or of the wrong neighbour) gives other values
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    ang = RNG.standard_normal((3, 32)).astype(np.float32)
    cos, sin = np.repeat(np.cos(ang), 2, axis=1), np.repeat(np.sin(ang), 2, axis=1)
    y, c = run_vector(spec, "rope_pairs", [x, cos, sin])
    even, odd = x[:, 0::2], x[:, 1::2]
    want = np.empty_like(x)
    want[:, 0::2] = even * np.cos(ang) - odd * np.sin(ang)
    want[:, 1::2] = odd * np.cos(ang) + even * np.sin(ang)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    assert c.busy_cycles["vector"] == vector_cycles(spec, "rope", 3, 64)


@pytest.mark.parametrize("length, pos", [(16, 15), (10, 12), (5, 2)])
def test_vector_mask_limit_and_causal_offset(spec, length, pos):
    rows, cols = 4, 16
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    y, _ = run_vector(spec, "mask", [x], params={"len": length, "pos": pos},
                      limit=Affine.param("len"), causal_offset=Affine.param("pos", const=-3))
    i, j = np.arange(rows)[:, None], np.arange(cols)[None, :]
    keep = (j < length) & (j - i <= pos - 3)
    np.testing.assert_array_equal(y, np.where(keep, x, -np.inf))
    assert (y == -np.inf).sum() == (~keep).sum()


@pytest.mark.parametrize("rows_of_slopes", [4, 1])
def test_vector_alibi_adds_a_slope_per_row_times_the_key_distance(spec, rows_of_slopes):
    # x + slope[row] * (col - origin), origin = pos - 2 at run time; one slope per row (the
    # heads of a decode group) or one for all rows (a prefill tile of one head). A bias on
    # the wrong axis, of the wrong sign or without the origin gives other values
    rows, cols, pos = 4, 80, 9
    x = RNG.standard_normal((rows, cols)).astype(np.float32)
    slopes = RNG.uniform(0.05, 1.0, (rows_of_slopes, 1)).astype(np.float32)
    y, c = run_vector(spec, "alibi", [x, slopes], params={"pos": pos},
                      origin=Affine.param("pos", const=-2))
    col = np.arange(cols)[None, :]
    np.testing.assert_allclose(y, x + slopes * (col - (pos - 2)), rtol=1e-6, atol=1e-5)
    # three elementary passes (ramp - origin, times the slope, plus x) over 4 rows of
    # two lane-widths each
    per_pass = sum(spec.vector_op_cycles[o] for o in ("sub", "mul", "add"))
    assert c.busy_cycles["vector"] == rows * ceil_div(cols, spec.vector_lanes) * per_pass


def test_vector_alibi_refuses_slopes_that_are_not_one_per_row(spec):
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    with pytest.raises(InvalidProgramError, match="alibi"):
        run_vector(spec, "alibi", [x, np.ones((1, 16), np.float32)], origin=Affine(0))


def test_vector_exp_sub_shifts_each_row_then_exponentiates(spec):
    # exp((x - y[row]) * imm) into fp16 (the softmax's P): a shift on the wrong axis, a
    # scale applied before the shift or not at all gives other values (or overflows)
    rows, cols, imm = 4, 80, 0.125
    x = (RNG.standard_normal((rows, cols)) * 40).astype(np.float32)
    y = x.max(axis=1, keepdims=True)
    p, c = run_vector(spec, "exp_sub", [x, y], dst_dtype="float16", imm=imm)
    want = np.exp((x.astype(np.float64) - y) * imm)
    np.testing.assert_allclose(p.astype(np.float64), want, rtol=1e-3, atol=1e-7)
    # a sub and an exp pass per lane-width of each row; the TCM sees x, y and the fp16
    # result only (``sub`` then ``exp`` would also write and read the fp32 difference):
    # the loads write x and y, the op reads them and writes P, the store reads P
    passes = rows * ceil_div(cols, spec.vector_lanes)
    assert c.busy_cycles["vector"] == passes * (spec.vector_op_cycles["sub"] +
                                                spec.vector_op_cycles["exp"])
    assert c.tcm_read_bytes == c.tcm_write_bytes == x.nbytes + y.nbytes + p.nbytes


def test_vector_exp_sub_without_its_shift_is_refused(spec):
    # its imm is the scale, not a second operand (a binary op's may be)
    with pytest.raises(InvalidProgramError, match="exp_sub takes 2"):
        run_vector(spec, "exp_sub", [np.zeros((2, 64), np.float32)], imm=0.5)


def test_every_vector_op_is_covered():
    tested = set(BINARY) | {"reduce_max", "reduce_sum", "exp", "rsqrt", "silu", "gelu",
                            "gelu_tanh", "cast", "exp_sub",
                            "copy", "rope", "rope_pairs", "mask", "alibi"}
    assert tested == set(VECTOR_OP_ARITY)


# -- predication, events, host, control -------------------------------------------------------
@pytest.mark.parametrize("flag", [0, 1])
def test_when_predicated_off_leaves_data_and_takes_no_time(spec, flag):
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    old = RNG.standard_normal((4, 64)).astype(np.float32)
    b = ProgramBuilder("when", spec)
    on = b.param("flag")
    (tx, tdst), evs = load_inputs(b, spec, {"x": x, "old": old})
    done = b.event()
    b.emit(Vector(op="add", dst=tdst, srcs=(tx,), imm=1.0, wait=tuple(evs), signal=(done,),
                  when=on))
    store_output(b, tdst, (done,))
    r = Emulator(spec).run(b.build(), {"x": x, "old": old}, {"flag": flag})
    c = r.counters
    np.testing.assert_array_equal(r.outputs["y"], x + 1 if flag else old)
    assert c.commands_skipped == 1 - flag
    vec = vector_cycles(spec, "add", 4, 64) if flag else 0
    assert c.busy_cycles["vector"] == vec
    # the store still waits for the (skipped) vector command's signal: both loads share the
    # bus, the vector op starts event_sync_cycles after the later one, the store likewise
    nbytes = 4 * 64 * 4
    loads = dma_cycles(spec, nbytes) + math.ceil(nbytes / spec.dram_bytes_per_cycle)
    s = spec.event_sync_cycles
    assert c.total_cycles == loads + s + vec + s + dma_cycles(spec, nbytes)


@pytest.mark.parametrize("a,b", [(1, 1), (1, 0), (0, 1), (-2, 5)])
def test_a_tuple_of_predicates_runs_only_when_all_hold(spec, a, b):
    """``when`` as a tuple (a live tile AND one its diagonal crosses): the command runs iff
    every value is > 0; a predicate naming an undeclared parameter is refused."""
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    old = RNG.standard_normal((4, 64)).astype(np.float32)

    def program(names):
        b_ = ProgramBuilder("when2", spec)
        pa = b_.param("a")
        b_.param("b")
        (tx, tdst), evs = load_inputs(b_, spec, {"x": x, "old": old})
        done = b_.event()
        # a > 0 and 1 - b > 0
        b_.emit(Vector(op="add", dst=tdst, srcs=(tx,), imm=1.0, wait=tuple(evs),
                       signal=(done,), when=(pa, Affine.param(names, -1, 3) - 2)))
        store_output(b_, tdst, (done,))
        return b_.build()
    r = Emulator(spec).run(program("b"), {"x": x, "old": old}, {"a": a, "b": b})
    runs = a > 0 and 1 - b > 0
    np.testing.assert_array_equal(r.outputs["y"], x + 1 if runs else old)
    assert r.counters.commands_skipped == (not runs)
    with pytest.raises(InvalidProgramError, match="undeclared runtime parameter"):
        Emulator(spec).run(program("c"), {"x": x, "old": old}, {"a": a, "b": b})


def test_event_wait_and_signal_commands(spec):
    x = RNG.standard_normal((16, 64)).astype(np.float16)
    w = RNG.standard_normal((64, 64)).astype(np.float16)
    b = ProgramBuilder("events", spec)
    (tx, tw), (ex, ew) = load_inputs(b, spec, {"x": x, "w": w})
    out = b.tcm((16, 64), "float32")
    sig = b.event()
    # EventWait blocks the matrix queue; the Mma itself waits on nothing
    b.emit(EventWait(on="matrix", wait=(ex, ew)))
    b.emit(Mma(out=out, a=tx, b=tw))
    # EventSignal signals once everything before it on the matrix unit is done
    b.emit(EventSignal(on="matrix", signal=(sig,)))
    store_output(b, out, (sig,))
    r = Emulator(spec).run(b.build(), {"x": x, "w": w}, trace=True)
    np.testing.assert_allclose(r.outputs["y"], x.astype(np.float32) @ w.astype(np.float32),
                               **MMA_TOL)
    s = spec.event_sync_cycles
    nbytes = 16 * 64 * 2 + 64 * 64 * 2
    loads_end = spec.dma_setup_cycles + math.ceil(nbytes / spec.dram_bytes_per_cycle)
    mma = mma_cycles(spec, 16, 64, 64, "fp16")
    store = dma_cycles(spec, 16 * 64 * 4)
    mm = [e for e in r.trace if e.unit == "matrix"]
    assert [(e.name, e.start, e.end) for e in mm] == [("Mma", loads_end + s, loads_end + s + mma)]
    assert r.counters.total_cycles == loads_end + s + mma + s + store


def test_host_op_argmax(spec):
    x = RNG.standard_normal((3, 1000)).astype(np.float16)
    b = ProgramBuilder("host_argmax", spec)
    b.tensor("logits", x.shape, "float16", "input")
    b.tensor("token", (3,), "int32", "output")
    b.emit(HostOp(fn="argmax", inputs=("logits",), outputs=("token",), flops=3000))
    r = Emulator(spec).run(b.build(), {"logits": x})
    np.testing.assert_array_equal(r.outputs["token"], np.argmax(x, axis=1))
    host = spec.host_switch_cycles + ceil_div(3000, int(spec.host_flops_per_cycle))
    assert r.counters.busy_cycles["host"] == host == r.counters.total_cycles
    assert r.counters.dram_read_bytes == 0   # the host reads through its caches


def test_host_op_softmax_after_npu_store(spec):
    x = RNG.standard_normal((2, 64)).astype(np.float32)
    b = ProgramBuilder("host_softmax", spec)
    (tx,), (ex,) = load_inputs(b, spec, {"x": x})
    t2 = b.tcm((2, 64), "float32")
    e2, e3 = b.event(), b.event()
    b.emit(Vector(op="mul", dst=t2, srcs=(tx,), imm=2.0, wait=(ex,), signal=(e2,)))
    b.tensor("scores", (2, 64), "float32", "scratch")
    b.emit(DmaStore(dst=b.dram("scores"), src=t2, wait=(e2,), signal=(e3,)))
    b.tensor("p", (2, 64), "float32", "output")
    b.emit(HostOp(fn="softmax", inputs=("scores",), outputs=("p",), wait=(e3,), flops=640))
    r = Emulator(spec).run(b.build(), {"x": x})
    z = np.exp(2 * x - (2 * x).max(axis=1, keepdims=True))
    np.testing.assert_allclose(r.outputs["p"], z / z.sum(axis=1, keepdims=True), **F32)
    np.testing.assert_allclose(r.outputs["p"].sum(axis=1), 1.0, rtol=1e-6)


def test_launch_is_a_barrier_and_costs_launch_cycles(spec):
    x = RNG.standard_normal((8, 64)).astype(np.float32)
    b = ProgramBuilder("two_kernels", spec)
    (tx,), (ex,) = load_inputs(b, spec, {"x": x})
    b.tensor("mid", x.shape, "float32", "scratch")
    b.emit(DmaStore(dst=b.dram("mid"), src=tx, wait=(ex,)))
    b.emit(Launch(name="second"))
    # no event: the Launch orders the store before this load (and the TCM reuse)
    t = TcmRef(tx.offset, tx.shape, tx.dtype)
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("mid"), channel=1, signal=(e,)))
    t2 = b.tcm(x.shape, "float32")
    e2 = b.event()
    b.emit(Vector(op="sub", dst=t2, srcs=(t,), imm=1.0, wait=(e,), signal=(e2,)))
    store_output(b, t2, (e2,))
    r = Emulator(spec).run(b.build(), {"x": x})
    np.testing.assert_allclose(r.outputs["y"], x - 1, **F32)
    c, s, d = r.counters, spec.event_sync_cycles, dma_cycles(spec, 8 * 64 * 4)
    assert c.launches == 1
    kernel1 = d + s + d
    kernel2 = d + s + vector_cycles(spec, "sub", 8, 64) + s + d
    assert c.total_cycles == kernel1 + spec.launch_cycles + kernel2


def test_end_waits_for_every_unit(spec):
    # nobody waits on the last DMA: End still waits until it finishes
    x = RNG.standard_normal((64, 64)).astype(np.float16)
    b = ProgramBuilder("end", spec)
    b.tensor("x", x.shape, "float16", "input")
    b.emit(DmaLoad(dst=b.tcm(x.shape, "float16"), src=b.dram("x")))
    b.emit(End())
    b.emit(DmaLoad(dst=b.tcm(x.shape, "float16"), src=b.dram("x"), channel=1))  # after End
    p = b.build()
    assert len(p.commands) == 4 and isinstance(p.commands[1], End)
    r = Emulator(spec).run(p, {"x": x})
    assert r.counters.total_cycles == dma_cycles(spec, x.nbytes)
    assert r.counters.dram_read_bytes == x.nbytes      # the command after End never runs


def test_state_persists_across_runs(spec):
    """A KV-cache-like state tensor: each run appends a row at ``pos`` and reads it all back."""
    b = ProgramBuilder("kv_append", spec)
    pos = b.param("pos")
    b.tensor("kv", (4, 64), "float16", "state")
    (tx,), (ex,) = load_inputs(b, spec, {"x": np.zeros((1, 64), np.float16)})
    stored = b.event()
    b.emit(DmaStore(dst=DramRef("kv", (1, 64), 64, pos * 64), src=tx, wait=(ex,),
                    signal=(stored,)))
    tk = b.tcm((4, 64), "float16")
    loaded = b.event()
    b.emit(DmaLoad(dst=tk, src=b.dram("kv"), channel=1, wait=(stored,), signal=(loaded,)))
    store_output(b, tk, (loaded,), name="cache")
    p = b.build()
    emu = Emulator(spec)
    rows = [RNG.standard_normal((1, 64)).astype(np.float16) for _ in range(2)]
    r0 = emu.run(p, {"x": rows[0]}, {"pos": 0})
    r1 = emu.run(p, {"x": rows[1]}, {"pos": 1})
    want = np.zeros((4, 64), np.float16)
    want[0] = rows[0]
    np.testing.assert_array_equal(r0.outputs["cache"], want)
    want[1] = rows[1]
    np.testing.assert_array_equal(r1.outputs["cache"], want)
    np.testing.assert_array_equal(emu.state["kv"], want)
    # a new emulator starts from zeros; the host may also set the state explicitly
    fresh = Emulator(spec).run(p, {"x": rows[1]}, {"pos": 3}).outputs["cache"]
    assert not fresh[:3].any() and (fresh[3] == rows[1][0]).all()
    seeded = emu.run(p, {"x": rows[0], "kv": np.ones((4, 64), np.float16)}, {"pos": 2})
    assert (seeded.outputs["cache"][[0, 1, 3]] == 1).all()
    np.testing.assert_array_equal(seeded.outputs["cache"][2], rows[0][0])


def test_integer_results_saturate(spec):
    # NPU ALUs saturate: 100 + 100 in int8 is 127, not -56; out-of-range floats clip to the
    # int32 range instead of wrapping (or becoming 0)
    x = np.full((2, 64), 100, np.int8)
    y, _ = run_vector(spec, "add", [x, x])
    assert y.dtype == np.int8 and (y == 127).all()
    y, _ = run_vector(spec, "sub", [-x, x])
    assert (y == -128).all()
    f = np.array([[1e10, -1e10, 2.5, -2.5] * 16] * 2, np.float32)
    y, _ = run_vector(spec, "cast", [f], dst_dtype="int32")
    info = np.iinfo(np.int32)
    np.testing.assert_array_equal(y[0, :4], [info.max, info.min, 2, -2])     # half to even
    y, _ = run_vector(spec, "cast", [f], dst_dtype="int8")
    np.testing.assert_array_equal(y[0, :4], [127, -128, 2, -2])
