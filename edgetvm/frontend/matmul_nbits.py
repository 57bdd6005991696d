"""``com.microsoft:MatMulNBits`` (onnxruntime's 4-bit weight format) as edgetvm's W4A16 linear.

The weights stay packed: each node becomes a ``relax.call_tir`` of one TIR PrimFunc that
reads the uint8 blocks, the per-block scales and the optional zero points, dequantises
inside the reduction and accumulates in float32. Expanding the weights to float in the
graph would quadruple (fp16) or octuple (fp32) the DRAM traffic the NPU is built to
avoid, and later passes could no longer see that the layer is quantised. They recognise
the kernel by its function attributes:

``edgetvm.op = "linear_w4a16"``, ``edgetvm.group_size`` (the block size),
``edgetvm.has_zero_points`` (0/1), plus ``edgetvm.zero_point_kind``
(``"none"``, ``"uint4"`` or ``"float"``) and ``edgetvm.has_bias`` (0/1).

Semantics (onnxruntime contrib op MatMulNBits, bits=4):

- ``B``: uint8 ``(N, k_blocks, block_size / 2)`` (or any reshape of it, e.g. ``(N, K/2)``);
  element ``2j`` of a block is the low nibble of byte ``j``, element ``2j+1`` the high one.
- ``scales``: ``(N, k_blocks)`` or flat, same float type as ``A``.
- ``zero_points``: optional; uint8 with two 4-bit values per byte ``(N, ceil(k_blocks/2))``
  (or flat), or the float type of ``A`` with shape ``(N, k_blocks)``; 8 when absent.
- ``W[n, k] = (q[n, k] - zp[n, k // block]) * scale[n, k // block]``; ``Y = A @ W.T + bias``.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax, te, tirx

MATMUL_NBITS_DOMAIN = "com.microsoft"
LINEAR_W4A16 = "linear_w4a16"
SUPPORTED_BITS = 4
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)

# Input positions of MatMulNBits (onnxruntime contrib op schema).
_A, _B, _SCALES, _ZERO_POINTS, _G_IDX, _BIAS = range(6)


def matmul_nbits_problem(node, initializers) -> str | None:
    """Why edgetvm cannot import this MatMulNBits node, or None when it can.

    Parameters
    ----------
    node : onnx.NodeProto
        A ``com.microsoft:MatMulNBits`` node.
    initializers : dict of str to onnx.TensorProto
        The graph's initializers (unused today; kept so every op check has one signature).
    """
    del initializers
    attrs = {attr.name: attr for attr in node.attribute}
    bits = attrs["bits"].i if "bits" in attrs else SUPPORTED_BITS
    block_size = attrs["block_size"].i if "block_size" in attrs else 0
    if bits != SUPPORTED_BITS:
        return f"bits={bits}, only 4-bit is supported"
    if block_size not in SUPPORTED_BLOCK_SIZES:
        return f"block_size={block_size}, supported: {', '.join(map(str, SUPPORTED_BLOCK_SIZES))}"
    if "K" not in attrs or "N" not in attrs:
        return "attributes K and N are required"
    if len(node.input) > _G_IDX and node.input[_G_IDX]:
        return "g_idx (act-order) is not supported"
    return None


def linear_w4a16_primfunc(
    k: int,
    n: int,
    block_size: int,
    zero_point_kind: str,
    has_bias: bool,
    dtype: str,
    scale_dtype: str | None = None,
) -> tirx.PrimFunc:
    """The W4A16 linear kernel: ``Y[m, n] = sum_k A[m, k] * dequant(B)[n, k] (+ bias[n])``.

    Parameters
    ----------
    k, n : int
        Input and output features.
    block_size : int
        Quantisation block (group) size along ``k``.
    zero_point_kind : {"none", "uint4", "float"}
        Absent (8 is used), packed uint8 with two 4-bit zero points per byte
        ``(n, ceil(k_blocks / 2))``, or float ``(n, k_blocks)``.
    has_bias : bool
        Whether a ``(n,)`` bias is added.
    dtype : str
        Activation, bias and output type; accumulation is float32.
    scale_dtype : str, optional
        Type of the scales (and float zero points); default ``dtype``. edgetvm's own
        quantizer keeps float16 scales beside float32 activations.

    Returns
    -------
    tvm.tirx.PrimFunc
        Parameters ``A (m, k)``, ``B (n, k_blocks, block_size/2) uint8``,
        ``scales (n, k_blocks)``, [``zero_points``], [``bias``], output ``(m, n)``;
        ``m`` is symbolic so one kernel serves every sequence length.
    """
    k_blocks = math.ceil(k / block_size)
    m = tirx.Var("m", "int64")
    acc = "float32"
    a = te.placeholder((m, k), dtype, name="A")
    packed = te.placeholder((n, k_blocks, block_size // 2), "uint8", name="B")
    scale_dtype = scale_dtype or dtype
    scales = te.placeholder((n, k_blocks), scale_dtype, name="scales")
    params = [a, packed, scales]

    if zero_point_kind == "uint4":
        zero_points = te.placeholder((n, (k_blocks + 1) // 2), "uint8", name="zero_points")
        params.append(zero_points)

        def zero_point(j, blk):
            return _nibble(zero_points[j, blk // 2], blk % 2).astype(acc)

    elif zero_point_kind == "float":
        zero_points = te.placeholder((n, k_blocks), scale_dtype, name="zero_points")
        params.append(zero_points)

        def zero_point(j, blk):
            return zero_points[j, blk].astype(acc)

    elif zero_point_kind == "none":

        def zero_point(j, blk):
            del j, blk
            return tirx.const(2 ** (SUPPORTED_BITS - 1), acc)

    else:
        raise ValueError(f"unknown zero point kind {zero_point_kind!r}")

    def weight(j, kk):
        blk = kk // block_size
        quant = _nibble(packed[j, blk, (kk % block_size) // 2], kk % 2).astype(acc)
        return (quant - zero_point(j, blk)) * scales[j, blk].astype(acc)

    red = te.reduce_axis((0, k), name="k")
    matmul = te.compute(
        (m, n),
        lambda i, j: te.sum(a[i, red].astype(acc) * weight(j, red), axis=red),
        name="linear_w4a16",
    )
    out = matmul
    if has_bias:
        bias = te.placeholder((n,), dtype, name="bias")
        params.append(bias)
        out = te.compute(
            (m, n), lambda i, j: (matmul[i, j] + bias[j].astype(acc)).astype(dtype), name="bias_add"
        )
    elif dtype != acc:
        out = te.compute((m, n), lambda i, j: matmul[i, j].astype(dtype), name="cast")

    # te names every PrimFunc "main"; the Relax module assigns the symbol when it is linked.
    func = te.create_prim_func([*params, out]).without_attr("global_symbol")
    return func.with_attrs(
        {
            "edgetvm.op": LINEAR_W4A16,
            "edgetvm.group_size": block_size,
            "edgetvm.has_zero_points": int(zero_point_kind != "none"),
            "edgetvm.zero_point_kind": zero_point_kind,
            "edgetvm.has_bias": int(has_bias),
        }
    )


def _nibble(byte, index):
    """4-bit value ``index`` (0 = low nibble) of a uint8 expression."""
    shift = (index * 4).astype("uint8")
    return tirx.bitwise_and(tirx.shift_right(byte, shift), tirx.const(0xF, "uint8"))


def convert_matmul_nbits(bb: relax.BlockBuilder, inputs, attrs, params, fallback):
    """Converter for MatMulNBits: reshape ``A`` to 2-D, call the W4A16 kernel, reshape back.

    Follows the signature of edgetvm's converter overrides (see ``importer.py``);
    ``params`` and ``fallback`` are unused because TVM has no converter for this op.
    """
    del params, fallback
    k, n, block_size = int(attrs["K"]), int(attrs["N"]), int(attrs["block_size"])
    k_blocks = math.ceil(k / block_size)
    a = inputs[_A]
    dtype = str(a.ty.dtype)
    if a.ty.shape is None:
        raise ValueError(f"MatMulNBits input A has no known shape ({a.ty}); cannot flatten it")
    lead = list(a.ty.shape.values[:-1])

    args = [
        _as_2d_or_3d(bb, inputs[_B], (n, k_blocks, block_size // 2)),
        _as_2d_or_3d(bb, inputs[_SCALES], (n, k_blocks)),
    ]
    zero_points = inputs[_ZERO_POINTS] if len(inputs) > _ZERO_POINTS else None
    if zero_points is None:
        zero_point_kind = "none"
    elif str(zero_points.ty.dtype) == "uint8":
        zero_point_kind = "uint4"
        args.append(_as_2d_or_3d(bb, zero_points, (n, (k_blocks + 1) // 2)))
    else:
        zero_point_kind = "float"
        args.append(_as_2d_or_3d(bb, zero_points, (n, k_blocks)))
    bias = inputs[_BIAS] if len(inputs) > _BIAS else None
    if bias is not None:
        args.append(bias)

    func = linear_w4a16_primfunc(k, n, block_size, zero_point_kind, bias is not None, dtype)
    # add_func returns the existing GlobalVar for a structurally equal kernel, so layers of
    # one shape share one PrimFunc (one kernel to schedule and tune).
    kernel = bb.add_func(func, f"{LINEAR_W4A16}_k{k}_n{n}_g{block_size}")

    rows = _product(lead)
    a_2d = a if len(lead) == 1 else bb.normalize(relax.op.reshape(a, [rows, k]))
    out = bb.emit(relax.call_tir(kernel, [a_2d, *args], relax.TensorType([rows, n], dtype)))
    if len(lead) == 1:
        return out
    return relax.op.reshape(out, [*lead, n])


def _as_2d_or_3d(bb: relax.BlockBuilder, expr: relax.Expr, shape: tuple[int, ...]) -> relax.Expr:
    """``expr`` in the kernel's canonical shape; constants are reshaped here, not in the graph."""
    if isinstance(expr, tvm.ir.GenericConst):
        array = expr.value.numpy()
        if array.shape == shape:
            return expr
        if array.size != int(np.prod(shape)):
            raise ValueError(f"MatMulNBits tensor {array.shape} cannot be viewed as {shape}")
        return relax.const(array.reshape(shape), str(array.dtype))
    known = expr.ty.shape
    if known is not None and all(isinstance(d, tirx.IntImm) for d in known.values):
        if tuple(int(d) for d in known.values) == shape:
            return expr
    return bb.normalize(relax.op.reshape(expr, list(shape)))


def _product(dims):
    """Product of shape dims, kept a plain int when they are all static (the common case).

    Shared with relax_passes.quantize_w4a16."""
    static = 1
    symbolic = None
    for dim in dims:
        if isinstance(dim, tirx.IntImm):
            static *= int(dim)
        else:
            symbolic = dim if symbolic is None else symbolic * dim
    if symbolic is None:
        return static
    return symbolic if static == 1 else symbolic * static
