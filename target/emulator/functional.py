"""Functional model: what each command does to TCM and DRAM bytes, in numpy.

Views, not copies: a :class:`TcmRef` is a strided numpy view into the TCM byte array and
a :class:`DramRef` one into a DRAM tensor, so a command costs one numpy operation.
Arithmetic is fp32 (int32 for int8 x int8), rounded to the destination dtype on store,
as the NPU's accumulators and vector ALUs do.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..isa import ITEMSIZE, DmaLoad, DramRef, Mma, TcmRef, Vector, eval_value

_F32 = np.float32


def tcm_view(tcm: np.ndarray, ref: TcmRef) -> np.ndarray:
    isz = ITEMSIZE[ref.dtype]
    return np.ndarray(ref.shape, dtype=ref.dtype, buffer=tcm, offset=ref.offset,
                      strides=(ref.stride * isz, isz))


def dram_view(flat: np.ndarray, ref: DramRef, offset: int) -> np.ndarray:
    isz = flat.itemsize
    return as_strided(flat[offset:], shape=ref.shape, strides=(ref.row_stride * isz, isz),
                      writeable=True)


def valid_rows(cmd, params) -> int:
    rows = cmd.src.shape[0] if isinstance(cmd, DmaLoad) else cmd.dst.shape[0]
    v = eval_value(cmd.valid_rows, params)
    return rows if v is None else max(0, min(rows, v))


def dma(cmd, tcm, src_or_dst: np.ndarray, n_rows: int) -> None:
    """Copy ``n_rows`` rows; ``src_or_dst`` is the DRAM view."""
    if isinstance(cmd, DmaLoad):
        tcm_view(tcm, cmd.dst)[:n_rows] = src_or_dst[:n_rows]
    else:
        src_or_dst[:n_rows] = tcm_view(tcm, cmd.src)[:n_rows]


def dequant_w4(packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None,
               group_size: int) -> np.ndarray:
    """(N, K//2) uint8 + (N, K//G) scales [+ uint8 or float16 zero points] -> (N, K) fp32
    weights (MatMulNBits layout), ``(q - zero) * scale`` in fp32."""
    n, half = packed.shape
    q = np.empty((n, 2 * half), dtype=_F32)
    q[:, 0::2] = packed & 0x0F
    q[:, 1::2] = packed >> 4
    z = _F32(8) if zeros is None else np.repeat(zeros.astype(_F32), group_size, axis=1)
    s = np.repeat(scales.astype(_F32), group_size, axis=1)
    return (q - z) * s


def mma(cmd: Mma, tcm: np.ndarray) -> None:
    a = tcm_view(tcm, cmd.a)
    b = tcm_view(tcm, cmd.b)
    out = tcm_view(tcm, cmd.out)
    kind = cmd.kind
    if kind == "int8":
        bb = b.T if cmd.transpose_b else b
        r = a.astype(np.int32) @ bb.astype(np.int32)
    elif kind == "w4a16":
        zeros = tcm_view(tcm, cmd.zeros) if cmd.zeros is not None else None
        w = dequant_w4(b, tcm_view(tcm, cmd.scales), zeros, cmd.group_size)
        r = a.astype(_F32) @ w.T
    else:
        bb = b.T if cmd.transpose_b else b
        r = a.astype(_F32) @ bb.astype(_F32)
    if cmd.accumulate:
        out += r.astype(out.dtype)
    else:
        out[...] = r


_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
           "div": np.divide}


def _erf(x: np.ndarray) -> np.ndarray:
    # Abramowitz & Stegun 7.1.26, |error| < 1.5e-7: numpy has no erf and scipy is not a dependency.
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t
               + 0.254829592) * t * np.exp(-x * x)
    return np.sign(x) * y


def vector(cmd: Vector, tcm: np.ndarray, params) -> None:
    op = cmd.op
    dst = tcm_view(tcm, cmd.dst)
    x = tcm_view(tcm, cmd.srcs[0]).astype(_F32)
    if op in _BINARY:
        y = _F32(cmd.imm) if len(cmd.srcs) == 1 else tcm_view(tcm, cmd.srcs[1]).astype(_F32)
        r = _BINARY[op](x, y)
    elif op == "reduce_max":
        r = x.max(axis=1, keepdims=True)
    elif op == "reduce_sum":
        r = x.sum(axis=1, keepdims=True)
    elif op == "exp":
        with np.errstate(over="ignore"):     # fp32: overflows to inf, as the hardware does
            r = np.exp(x if cmd.imm is None else x * _F32(cmd.imm))   # isa.py: exp(x * imm)
    elif op == "exp_sub":
        d = x - tcm_view(tcm, cmd.srcs[1]).astype(_F32)
        with np.errstate(over="ignore"):
            r = np.exp(d if cmd.imm is None else d * _F32(cmd.imm))
    elif op == "rsqrt":
        r = 1.0 / np.sqrt(x + _F32(cmd.imm or 0.0))
    elif op == "silu":
        r = x / (1.0 + np.exp(-x))
    elif op == "gelu":
        r = 0.5 * x * (1.0 + _erf(x * _F32(0.7071067811865476)))
    elif op == "gelu_tanh":
        r = 0.5 * x * (1.0 + np.tanh(_F32(0.7978845608028654) * (x + _F32(0.044715) * x * x * x)))
    elif op in ("cast", "copy"):
        r = tcm_view(tcm, cmd.srcs[0])
    elif op == "rope":
        cos = tcm_view(tcm, cmd.srcs[1]).astype(_F32)
        sin = tcm_view(tcm, cmd.srcs[2]).astype(_F32)
        h = x.shape[1] // 2
        rot = np.concatenate([-x[:, h:], x[:, :h]], axis=1)
        r = x * cos + rot * sin
    elif op == "rope_pairs":
        # rotate_pairs: each (even, odd) column pair (a, b) becomes (-b, a)
        cos = tcm_view(tcm, cmd.srcs[1]).astype(_F32)
        sin = tcm_view(tcm, cmd.srcs[2]).astype(_F32)
        rot = np.empty_like(x)
        rot[:, 0::2], rot[:, 1::2] = -x[:, 1::2], x[:, 0::2]
        r = x * cos + rot * sin
    elif op == "alibi":
        slope = tcm_view(tcm, cmd.srcs[1]).astype(_F32)           # (rows, 1) or (1, 1)
        col = np.arange(x.shape[1], dtype=_F32)[None, :]
        r = x + slope * (col - _F32(eval_value(cmd.origin, params)))
    elif op == "mask":
        rows, cols = x.shape
        keep = np.ones((rows, cols), dtype=bool)
        j = np.arange(cols)[None, :]
        limit = eval_value(cmd.limit, params)
        if limit is not None:
            keep &= j < limit
        off = eval_value(cmd.causal_offset, params)
        if off is not None:
            keep &= (j - np.arange(rows)[:, None]) <= off
        r = np.where(keep, x, _F32(-np.inf))
        # a sliding window's lower edge: fp32's lowest finite value (isa.py)
        behind = np.zeros((rows, cols), dtype=bool)
        floor = eval_value(cmd.floor, params)
        if floor is not None:
            behind |= j < floor
        wo = eval_value(cmd.window_offset, params)
        if wo is not None:
            behind |= (j - np.arange(rows)[:, None]) < wo
        r = np.where(behind & keep, _F32(np.finfo(np.float32).min), r)
    else:  # validated before execution
        raise AssertionError(op)
    if np.issubdtype(dst.dtype, np.integer):
        # integer destinations saturate, as NPU ALUs do (no wrap-around): round to
        # nearest even, then clip to the type's range
        info = np.iinfo(dst.dtype)
        r = np.asarray(r)
        r = np.rint(r.astype(np.float64)) if r.dtype.kind == "f" else r.astype(np.int64)
        r = np.clip(r, info.min, info.max)
    dst[...] = r
