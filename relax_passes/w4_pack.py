"""W4A16 weights in numpy: group quantisation, its exact inverse, and the tile-order layout.

The format is the NPU's (``target/isa.py`` ``Mma``) and onnxruntime's ``MatMulNBits``
(bits=4), for a weight ``W`` of shape ``(N, K)`` (output features first, as a torch
``Linear``; a Relax ``matmul(x, W)`` constant is its transpose):

- ``packed``: uint8 ``(N, Kp // 2)``, ``Kp`` = ``K`` rounded up to the group size; two 4-bit
  values per byte, the even ``k`` in the low nibble. Padding columns hold the zero point
  (they dequantise to 0);
- ``scales``: ``(N, Kp // G)`` float16 (float32 on request, for onnxruntime parity);
- ``zeros``: ``(N, Kp // G)`` uint8 in ``[0, 15]``, or ``None`` (symmetric, zero point 8);
- ``w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``.

``MatMulNBits`` stores the zero points two per byte (:func:`pack_zero_points`); the NPU
reads one per byte. The tile-order layout (:func:`pack_tile_order`) puts every
``(tile_n, tile_k)`` weight tile and its scales (and zeros) in one contiguous block of
DRAM, in the order the GEMV/GEMM kernels walk the tiles, so one DMA burst brings a tile
and everything needed to dequantise it into TCM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS = 4
Q_MAX = 2**BITS - 1  # 15
SYMMETRIC_ZERO = 2 ** (BITS - 1)  # 8
GROUP_SIZES = (16, 32, 64, 128)
#: Symmetric scale rules (see :func:`quantize_w4`).
SCALE_RULES = ("absmax", "signed_absmax", "mse")
SCALE_DTYPES = ("float16", "float32")
# Divisors of the signed absmax tried by the "mse" rule (the largest weight lands on code
# -divisor): 7 leaves a step of headroom for the opposite sign, 8 is onnxruntime's, 8.5
# clips the largest weight by half a step for a finer grid for all the others.
_MSE_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5)
_ROW_CHUNK = 4096


@dataclass
class W4Weight:
    """A 4-bit group-quantised ``(N, K)`` weight in the NPU / MatMulNBits format.

    Attributes
    ----------
    packed : np.ndarray
        uint8 ``(N, Kp // 2)``, ``Kp`` = ``K`` rounded up to ``group_size``.
    scales : np.ndarray
        float16 (the NPU's format; float32 on request) ``(N, Kp // group_size)``.
    zeros : np.ndarray or None
        uint8 ``(N, Kp // group_size)``, one zero point per byte; None = 8 everywhere.
    k : int
        Input features before padding.
    group_size : int
        Weights per scale along ``k``.
    """

    packed: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    k: int
    group_size: int

    @property
    def n(self) -> int:
        return int(self.packed.shape[0])

    @property
    def k_blocks(self) -> int:
        return int(self.scales.shape[1])

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def nbytes(self) -> int:
        """DRAM bytes of weights + scales (+ zeros)."""
        extra = 0 if self.zeros is None else self.zeros.nbytes
        return self.packed.nbytes + self.scales.nbytes + extra

    def blocks(self) -> np.ndarray:
        """``packed`` as MatMulNBits' ``B`` input: ``(N, k_blocks, group_size // 2)``."""
        return self.packed.reshape(self.n, self.k_blocks, self.group_size // 2)


def check_w4_options(group_size: int, scale_rule: str, scale_dtype: str) -> None:
    """Raise ValueError for a group size, scale rule or scale dtype edgetvm cannot pack."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} not in {GROUP_SIZES}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule {scale_rule!r} not in {SCALE_RULES}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype!r} not in {SCALE_DTYPES}")


def quantize_w4(
    weight: np.ndarray,
    group_size: int = 32,
    symmetric: bool = True,
    scale_rule: str = "mse",
    scale_dtype: str = "float16",
) -> W4Weight:
    """Group-quantise an ``(N, K)`` float weight to 4 bits.

    Parameters
    ----------
    weight : np.ndarray
        float32/float16/float64 ``(N, K)``; ``K`` is padded with zeros to a group multiple.
    group_size : int
        One of :data:`GROUP_SIZES`.
    symmetric : bool
        True: zero point 8, one scale per group (``q - 8`` in ``[-8, 7]``).
        False: per-group ``[min(w, 0), max(w, 0)]`` mapped onto ``[0, 15]`` with a uint8
        zero point (0 stays exactly representable).
    scale_rule : {"mse", "absmax", "signed_absmax"}
        Symmetric only. ``absmax``: ``max|w| / 7`` (never clips). ``signed_absmax``:
        onnxruntime's rule, ``w_absmax / -8`` (the largest weight lands on -8 exactly;
        an opposite-sign weight of the same size clips to 7). ``mse`` (default): per
        group the scale ``w_absmax / -d``, ``d`` in 7..8.5, with the smallest squared
        error after clipping; it includes onnxruntime's choice (``d = 8``), so it is
        never worse per group (SmolLM2 layers, group 32: ~18 % less squared error than
        ``signed_absmax``, ~40 % less than ``absmax``). Scales may be negative.
    scale_dtype : {"float16", "float32"}
        float16 is the NPU's format; float32 reproduces onnxruntime's fp32-scale models.

    Returns
    -------
    W4Weight
        Scales are rounded to ``scale_dtype`` *before* the codes are computed, so the
        codes are optimal for the stored scales.
    """
    check_w4_options(group_size, scale_rule, scale_dtype)
    w = np.asarray(weight)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"expected a 2-D float weight, got {w.dtype} {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    n, k = w.shape
    if n > _ROW_CHUNK:  # bounded float64 temporaries for vocabulary-sized matrices
        parts = [quantize_w4(w[i: i + _ROW_CHUNK], group_size, symmetric, scale_rule, scale_dtype)
                 for i in range(0, n, _ROW_CHUNK)]
        zeros = None if symmetric else np.concatenate([p.zeros for p in parts])
        return W4Weight(np.concatenate([p.packed for p in parts]),
                        np.concatenate([p.scales for p in parts]), zeros, k, group_size)
    groups = _groups(w, group_size)  # (N, KB, G) float64

    if symmetric:
        scales = _symmetric_scales(groups, scale_rule, scale_dtype)
        zeros = None
        zero = np.float64(SYMMETRIC_ZERO)
    else:
        lo = np.minimum(groups.min(axis=-1), 0.0)
        hi = np.maximum(groups.max(axis=-1), 0.0)
        scales = _to_scale((hi - lo) / Q_MAX, scale_dtype)
        zeros = np.clip(np.rint(-lo / scales.astype(np.float64)), 0, Q_MAX).astype(np.uint8)
        zero = zeros.astype(np.float64)[..., None]

    q = _codes(groups, scales, zero)
    return W4Weight(pack_nibbles(q.reshape(n, -1)), scales, zeros, k, group_size)


def dequantize_w4(w4: W4Weight) -> np.ndarray:
    """The float32 ``(N, K)`` weight a :class:`W4Weight` stands for (exact inverse of the
    storage: the same arithmetic as the NPU's ``dequant_w4``)."""
    q = unpack_nibbles(w4.packed).astype(np.float32)
    g = w4.group_size
    zero = np.float32(SYMMETRIC_ZERO) if w4.zeros is None else np.repeat(
        w4.zeros.astype(np.float32), g, axis=1)
    w = (q - zero) * np.repeat(w4.scales.astype(np.float32), g, axis=1)
    return w[:, : w4.k]


def quantization_codes(w4: W4Weight) -> np.ndarray:
    """The 4-bit codes ``q`` as uint8 ``(N, Kp)`` (padding included)."""
    return unpack_nibbles(w4.packed)


# -- nibble packing ---------------------------------------------------------------------


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes ``(..., 2 * m)`` in ``[0, 15]`` -> ``(..., m)``, even index in the low nibble."""
    q = np.asarray(q)
    if q.shape[-1] % 2:
        raise ValueError(f"last dimension {q.shape[-1]} must be even")
    if q.size and (q.min() < 0 or q.max() > Q_MAX):
        raise ValueError("codes must lie in [0, 15]")
    q = q.astype(np.uint8)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: ``(..., m)`` uint8 -> ``(..., 2 * m)`` codes."""
    packed = np.asarray(packed, dtype=np.uint8)
    q = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), dtype=np.uint8)
    q[..., 0::2] = packed & 0x0F
    q[..., 1::2] = packed >> 4
    return q


def pack_zero_points(zeros: np.ndarray) -> np.ndarray:
    """NPU zero points ``(N, KB)`` (one per byte) -> MatMulNBits' ``(N, ceil(KB / 2))``
    (two per byte, block ``2j`` in the low nibble; an odd last block pads with 0)."""
    zeros = np.asarray(zeros, dtype=np.uint8)
    if zeros.shape[1] % 2:
        zeros = np.concatenate([zeros, np.zeros((zeros.shape[0], 1), np.uint8)], axis=1)
    return pack_nibbles(zeros)


def unpack_zero_points(packed: np.ndarray, k_blocks: int) -> np.ndarray:
    """Inverse of :func:`pack_zero_points`."""
    return unpack_nibbles(packed)[:, :k_blocks]


# -- tile-order layout ------------------------------------------------------------------


@dataclass
class TiledW4Weight:
    """A W4 weight laid out tile by tile in one DRAM buffer.

    Tile ``(i, j)`` covers rows ``i * tile_n ..`` and columns ``j * tile_k ..`` of the
    ``(N, K)`` weight; tiles are stored row of tiles by row of tiles (``j`` fastest): a
    kernel computing output block ``i`` streams its ``k`` tiles back to back. Each tile is
    ``tile_bytes`` long (a multiple of ``align_bytes``) and holds, at the offsets given:

    - ``weight_offset`` (0): uint8 ``(tile_n, tile_k // 2)``, row-major;
    - ``scales_offset``: float16 ``(tile_n, tile_k // group_size)``;
    - ``zeros_offset`` (asymmetric only): uint8 ``(tile_n, tile_k // group_size)``.

    These are exactly the TCM operands of one W4A16 ``Mma`` (``b``, ``scales``, ``zeros``).
    Edge tiles are padded to full size (codes = zero point, scale 0: they dequantise to 0)
    so every tile is one DMA of the same shape.
    """

    data: np.ndarray
    n: int
    k: int
    group_size: int
    tile_n: int
    tile_k: int
    symmetric: bool
    align_bytes: int
    tile_bytes: int
    scales_offset: int
    zeros_offset: int | None

    @property
    def tiles_n(self) -> int:
        return -(-self.n // self.tile_n)

    @property
    def tiles_k(self) -> int:
        return -(-self.k // self.tile_k)

    def tile_offset(self, i: int, j: int) -> int:
        """Byte offset of tile ``(i, j)`` in :attr:`data`."""
        return (i * self.tiles_k + j) * self.tile_bytes

    def tile(self, i: int, j: int) -> tuple:
        """``(packed, scales, zeros)`` views of tile ``(i, j)`` (zeros None if symmetric)."""
        block = self.data[self.tile_offset(i, j): self.tile_offset(i, j) + self.tile_bytes]
        groups = self.tile_k // self.group_size
        packed = block[: self.tile_n * self.tile_k // 2].reshape(self.tile_n, self.tile_k // 2)
        s_end = self.scales_offset + self.tile_n * groups * 2
        scales = block[self.scales_offset: s_end].view(np.float16).reshape(self.tile_n, groups)
        zeros = None
        if self.zeros_offset is not None:
            z_end = self.zeros_offset + self.tile_n * groups
            zeros = block[self.zeros_offset: z_end].reshape(self.tile_n, groups)
        return packed, scales, zeros


def pack_tile_order(w4: W4Weight, tile_n: int, tile_k: int, align_bytes: int = 64) -> TiledW4Weight:
    """Lay ``w4`` out so that each ``(tile_n, tile_k)`` tile and its scales (and zeros)
    are one contiguous block (see :class:`TiledW4Weight`).

    Parameters
    ----------
    w4 : W4Weight
    tile_n, tile_k : int
        Tile shape; ``tile_k`` must be a multiple of the group size (a tile never splits
        a group, so its scales are whole).
    align_bytes : int
        Each tile block starts on this boundary (DMA burst alignment); >= 2.
    """
    g = w4.group_size
    if w4.scales.dtype != np.float16:
        raise ValueError(f"the tile format holds float16 scales, not {w4.scales.dtype}")
    if tile_n <= 0 or tile_k <= 0 or tile_k % g:
        raise ValueError(f"tile_k={tile_k} must be a positive multiple of the group size {g}")
    if align_bytes < 2 or align_bytes % 2:
        raise ValueError(f"align_bytes={align_bytes} must be even (float16 scales)")
    tiles_n, tiles_k = -(-w4.n // tile_n), -(-w4.k // tile_k)
    n_pad, k_pad = tiles_n * tile_n, tiles_k * tile_k
    groups = tile_k // g

    q = _pad_to(quantization_codes(w4), (n_pad, k_pad), SYMMETRIC_ZERO)
    scales = _pad_to(w4.scales, (n_pad, k_pad // g), 0)
    zeros = None if w4.zeros is None else _pad_to(w4.zeros, (n_pad, k_pad // g), SYMMETRIC_ZERO)

    w_bytes = tile_n * tile_k // 2
    scales_offset = _round_up(w_bytes, 2)
    s_bytes = tile_n * groups * 2
    zeros_offset = None if zeros is None else scales_offset + s_bytes
    used = scales_offset + s_bytes + (0 if zeros is None else tile_n * groups)
    tile_bytes = _round_up(used, align_bytes)

    # (tiles_n, tile_n, tiles_k, tile_k) -> (tiles_n, tiles_k, tile_n, tile_k): one tile per row.
    def by_tile(a, cols):
        return a.reshape(tiles_n, tile_n, tiles_k, cols).transpose(0, 2, 1, 3).reshape(
            tiles_n * tiles_k, tile_n * cols)

    data = np.zeros((tiles_n * tiles_k, tile_bytes), np.uint8)
    data[:, :w_bytes] = by_tile(pack_nibbles(q), tile_k // 2)
    data[:, scales_offset: scales_offset + s_bytes] = by_tile(
        scales.astype(np.float16), groups).view(np.uint8)
    if zeros is not None:
        data[:, zeros_offset: zeros_offset + tile_n * groups] = by_tile(zeros, groups)
    return TiledW4Weight(data.reshape(-1), w4.n, w4.k, g, tile_n, tile_k, w4.symmetric,
                         align_bytes, tile_bytes, scales_offset, zeros_offset)


def unpack_tile_order(tiled: TiledW4Weight) -> W4Weight:
    """Inverse of :func:`pack_tile_order` (bit-exact, padding removed)."""
    t = tiled
    tiles_n, tiles_k, g = t.tiles_n, t.tiles_k, t.group_size
    groups = t.tile_k // g
    blocks = t.data.reshape(tiles_n * tiles_k, t.tile_bytes)

    def from_tiles(a, cols):
        return a.reshape(tiles_n, tiles_k, t.tile_n, cols).transpose(0, 2, 1, 3).reshape(
            tiles_n * t.tile_n, tiles_k * cols)

    w_bytes = t.tile_n * t.tile_k // 2
    s_bytes = t.tile_n * groups * 2
    k_blocks = -(-t.k // g)
    q = unpack_nibbles(from_tiles(blocks[:, :w_bytes], t.tile_k // 2))
    scales = from_tiles(
        np.ascontiguousarray(blocks[:, t.scales_offset: t.scales_offset + s_bytes]).view(np.float16),
        groups)
    zeros = None
    if t.zeros_offset is not None:
        zeros = from_tiles(blocks[:, t.zeros_offset: t.zeros_offset + t.tile_n * groups], groups)
        zeros = np.ascontiguousarray(zeros[: t.n, :k_blocks])
    packed = pack_nibbles(q[: t.n, : k_blocks * g])
    return W4Weight(packed, np.ascontiguousarray(scales[: t.n, :k_blocks]), zeros, t.k, g)


# -- helpers ----------------------------------------------------------------------------


def _groups(w: np.ndarray, group_size: int) -> np.ndarray:
    n, k = w.shape
    k_blocks = -(-k // group_size)
    padded = np.zeros((n, k_blocks * group_size), np.float64)
    padded[:, :k] = w
    return padded.reshape(n, k_blocks, group_size)


def _to_scale(scale: np.ndarray, dtype: str) -> np.ndarray:
    """Scales in ``dtype``; an all-zero group gets 1 (any scale is exact for it), and a
    scale too small for the dtype its smallest subnormal, so no group divides by zero."""
    info = np.finfo(dtype)
    if np.any(np.abs(scale) > info.max):
        raise ValueError(f"a group scale overflows {dtype} (|w| > {info.max:.3g} * 7)")
    rounded = scale.astype(dtype)
    rounded[scale == 0] = 1.0
    tiny = (rounded == 0) & (scale != 0)
    rounded[tiny] = np.copysign(info.smallest_subnormal, scale[tiny])
    return rounded


def _codes(groups: np.ndarray, scales: np.ndarray, zero) -> np.ndarray:
    q = np.rint(groups / scales.astype(np.float64)[..., None]) + zero
    return np.clip(q, 0, Q_MAX).astype(np.uint8)


def _symmetric_scales(groups: np.ndarray, rule: str, dtype: str) -> np.ndarray:
    if rule == "absmax":
        return _to_scale(np.abs(groups).max(axis=-1) / 7.0, dtype)
    # The weight of largest magnitude, with its sign: a negative scale puts it on the
    # -8 side of the code range, which is one step longer than the +7 side.
    idx = np.abs(groups).argmax(axis=-1)[..., None]
    signed = np.take_along_axis(groups, idx, axis=-1)[..., 0]
    if rule == "signed_absmax":
        return _to_scale(signed / -8.0, dtype)
    best, best_err = None, None
    for divisor in _MSE_DIVISORS:
        scales = _to_scale(signed / -divisor, dtype)
        q = _codes(groups, scales, SYMMETRIC_ZERO)
        deq = (q.astype(np.float64) - SYMMETRIC_ZERO) * scales.astype(np.float64)[..., None]
        err = ((deq - groups) ** 2).sum(axis=-1)
        if best is None:
            best, best_err = scales, err
        else:
            better = err < best_err
            best = np.where(better, scales, best)
            best_err = np.where(better, err, best_err)
    return best


def _pad_to(a: np.ndarray, shape: tuple, fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
