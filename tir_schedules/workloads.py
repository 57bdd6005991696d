"""Tensor-expression definitions of the ops edgetvm schedules onto the NPU.

Each returns a PrimFunc (``te.create_prim_func``) whose block names the templates look up.
Matmuls accumulate in fp32 (block ``C``) and cast to fp16 on the way out (block ``D``);
W4A16 weights stay packed: the dequantisation is part of the matmul block's expression,
so a kernel never writes a dequantised copy of the weights anywhere.
"""
from __future__ import annotations

from tvm import te, tirx


def gemm_fp16(m: int, n: int, k: int, b_layout: str = "kn"):
    """D (m, n) fp16 = A (m, k) fp16 @ B; B is (k, n) or, with ``b_layout="nk"``, (n, k)."""
    a = te.placeholder((m, k), "float16", name="A")
    shape_b = (k, n) if b_layout == "kn" else (n, k)
    b = te.placeholder(shape_b, "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    if b_layout == "kn":
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") *
                                                   b[r, j].astype("float32"), axis=r), name="C")
    else:
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") *
                                                   b[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype("float16"), name="D")
    return te.create_prim_func([a, b, d])


def dequant_w4_expr(w, s, z, n, kk, group: int):
    """fp32 value of 4-bit weight (n, kk) in MatMulNBits packing (low nibble = even k)."""
    byte = w[n, tirx.floordiv(kk, 2)]
    q = tirx.bitwise_and(tirx.shift_right(byte, (tirx.floormod(kk, 2) * 4).astype("uint8")),
                         tirx.const(15, "uint8"))
    zero = z[n, tirx.floordiv(kk, group)].astype("float32") if z is not None \
        else tirx.const(8.0, "float32")
    return (q.astype("float32") - zero) * s[n, tirx.floordiv(kk, group)].astype("float32")


def gemm_w4a16(m: int, n: int, k: int, group: int = 32, zeros: bool = False):
    """D (m, n) fp16 = X (m, k) fp16 @ dequant(W (n, k/2) uint8, S (n, k/group) fp16)^T."""
    if k % group or group % 2:
        raise ValueError(f"K={k} must be a multiple of the (even) group size {group}")
    x = te.placeholder((m, k), "float16", name="X")
    w = te.placeholder((n, k // 2), "uint8", name="W")
    s = te.placeholder((n, k // group), "float16", name="S")
    z = te.placeholder((n, k // group), "uint8", name="Z") if zeros else None
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        x[i, r].astype("float32") * dequant_w4_expr(w, s, z, j, r, group), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype("float16"), name="D")
    args = [x, w, s] + ([z] if zeros else []) + [d]
    return te.create_prim_func(args)
