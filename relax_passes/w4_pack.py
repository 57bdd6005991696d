"""W4A16 weights in numpy: the storage format, its exact inverse, and the tile-order layout.

The format is the NPU's (``target/isa.py`` ``Mma``) and onnxruntime's ``MatMulNBits``
(bits=4), for a weight ``W`` of shape ``(N, K)`` (output features first, as a torch
``Linear``; a Relax ``matmul(x, W)`` constant is its transpose):

- ``packed``: uint8 ``(N, Kp // 2)``, ``Kp`` = ``K`` rounded up to the group size; two 4-bit
  values per byte, the even ``k`` in the low nibble. Padding columns hold the code nearest
  the zero point (they dequantise to 0, or to ~0 with float zero points);
- ``scales``: ``(N, Kp // G)`` float16 (float32 on request, for onnxruntime parity);
- ``zeros``: ``(N, Kp // G)``: uint8 in ``[0, 15]`` (uint4 zero points), float16/float32
  like the scales (float zero points), or ``None`` (symmetric, zero point 8);
- ``w[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``.

``MatMulNBits`` stores uint4 zero points two per byte (:func:`pack_zero_points`) and float
zero points as they are; the NPU reads one per byte (uint4) or one float16 each. The
tile-order layout (:func:`pack_tile_order`) puts every ``(tile_n, tile_k)`` weight tile
and its scales (and zeros) in one contiguous block of DRAM, in the order the GEMV/GEMM
kernels walk the tiles, so one DMA burst brings a tile and everything needed to
dequantise it into TCM. How float weights become codes is ``w4_quantize.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS = 4
Q_MAX = 2**BITS - 1  # 15
SYMMETRIC_ZERO = 2 ** (BITS - 1)  # 8
#: Zero-point forms: none (symmetric, 8), uint4 (integer), float (scales' dtype).
ZERO_POINT_KINDS = ("none", "uint4", "float")


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
        ``(N, Kp // group_size)``: uint8 (uint4 zero points, one per byte), float like
        ``scales`` (float zero points), or None (8 everywhere).
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
    def zero_point_kind(self) -> str:
        """One of :data:`ZERO_POINT_KINDS`."""
        if self.zeros is None:
            return "none"
        return "uint4" if self.zeros.dtype == np.uint8 else "float"

    @property
    def bits_per_weight(self) -> float:
        """DRAM bits per weight of the ``N x K`` matrix (padding, scales and zeros included)."""
        return 8.0 * self.nbytes / (self.n * self.k)

    @property
    def nbytes(self) -> int:
        """DRAM bytes of weights + scales (+ zeros)."""
        extra = 0 if self.zeros is None else self.zeros.nbytes
        return self.packed.nbytes + self.scales.nbytes + extra

    def blocks(self) -> np.ndarray:
        """``packed`` as MatMulNBits' ``B`` input: ``(N, k_blocks, group_size // 2)``."""
        return self.packed.reshape(self.n, self.k_blocks, self.group_size // 2)


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
    - ``zeros_offset`` (zero points only): ``(tile_n, tile_k // group_size)``, uint8 (uint4
      zero points) or float16 (float zero points) right after the scales.

    These are exactly the TCM operands of one W4A16 ``Mma`` (``b``, ``scales``, ``zeros``).
    Edge tiles are padded to full size (codes = 8, zero point 8 or 0, scale 0: they
    dequantise to 0) so every tile is one DMA of the same shape.
    """

    data: np.ndarray
    n: int
    k: int
    group_size: int
    tile_n: int
    tile_k: int
    zero_point_kind: str
    align_bytes: int
    tile_bytes: int
    scales_offset: int
    zeros_offset: int | None

    @property
    def symmetric(self) -> bool:
        return self.zero_point_kind == "none"

    @property
    def zeros_dtype(self):
        return {"none": None, "uint4": np.uint8, "float": np.float16}[self.zero_point_kind]

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
            dtype = self.zeros_dtype
            z_end = self.zeros_offset + self.tile_n * groups * np.dtype(dtype).itemsize
            zeros = block[self.zeros_offset: z_end].view(dtype).reshape(self.tile_n, groups)
        return packed, scales, zeros


def pack_tile_order(w4: W4Weight, tile_n: int, tile_k: int, align_bytes: int = 64) -> TiledW4Weight:
    """Lay ``w4`` out so that each ``(tile_n, tile_k)`` tile and its scales (and zeros)
    are one contiguous block (see :class:`TiledW4Weight`).

    Parameters
    ----------
    w4 : W4Weight
        float16 scales (and float16 zeros, for float zero points).
    tile_n, tile_k : int
        Tile shape; ``tile_k`` must be a multiple of the group size (a tile never splits
        a group, so its scales are whole).
    align_bytes : int
        Each tile block starts on this boundary (DMA burst alignment); >= 2.
    """
    g = w4.group_size
    kind = w4.zero_point_kind
    if w4.scales.dtype != np.float16:
        raise ValueError(f"the tile format holds float16 scales, not {w4.scales.dtype}")
    if kind == "float" and w4.zeros.dtype != np.float16:
        raise ValueError(f"the tile format holds float16 zero points, not {w4.zeros.dtype}")
    if tile_n <= 0 or tile_k <= 0 or tile_k % g:
        raise ValueError(f"tile_k={tile_k} must be a positive multiple of the group size {g}")
    if align_bytes < 2 or align_bytes % 2:
        raise ValueError(f"align_bytes={align_bytes} must be even (float16 scales)")
    tiles_n, tiles_k = -(-w4.n // tile_n), -(-w4.k // tile_k)
    n_pad, k_pad = tiles_n * tile_n, tiles_k * tile_k
    groups = tile_k // g

    q = _pad_to(quantization_codes(w4), (n_pad, k_pad), SYMMETRIC_ZERO)
    scales = _pad_to(w4.scales, (n_pad, k_pad // g), 0)
    zeros = None if w4.zeros is None else _pad_to(
        w4.zeros, (n_pad, k_pad // g), 0 if kind == "float" else SYMMETRIC_ZERO)

    w_bytes = tile_n * tile_k // 2
    scales_offset = _round_up(w_bytes, 2)
    s_bytes = tile_n * groups * 2
    zeros_offset = None if zeros is None else scales_offset + s_bytes
    z_bytes = 0 if zeros is None else tile_n * groups * zeros.itemsize
    tile_bytes = _round_up(scales_offset + s_bytes + z_bytes, align_bytes)

    # (tiles_n, tile_n, tiles_k, tile_k) -> (tiles_n, tiles_k, tile_n, tile_k): one tile per row.
    def by_tile(a, cols):
        return a.reshape(tiles_n, tile_n, tiles_k, cols).transpose(0, 2, 1, 3).reshape(
            tiles_n * tiles_k, tile_n * cols)

    data = np.zeros((tiles_n * tiles_k, tile_bytes), np.uint8)
    data[:, :w_bytes] = by_tile(pack_nibbles(q), tile_k // 2)
    data[:, scales_offset: scales_offset + s_bytes] = by_tile(
        scales.astype(np.float16), groups).view(np.uint8)
    if zeros is not None:
        data[:, zeros_offset: zeros_offset + z_bytes] = by_tile(zeros, groups).view(np.uint8)
    return TiledW4Weight(data.reshape(-1), w4.n, w4.k, g, tile_n, tile_k, kind,
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

    def section(offset, dtype):
        nbytes = t.tile_n * groups * np.dtype(dtype).itemsize
        return from_tiles(np.ascontiguousarray(blocks[:, offset: offset + nbytes]).view(dtype),
                          groups)[: t.n, :k_blocks]

    w_bytes = t.tile_n * t.tile_k // 2
    k_blocks = -(-t.k // g)
    q = unpack_nibbles(from_tiles(blocks[:, :w_bytes], t.tile_k // 2))
    scales = section(t.scales_offset, np.float16)
    zeros = None
    if t.zeros_offset is not None:
        zeros = np.ascontiguousarray(section(t.zeros_offset, t.zeros_dtype))
    packed = pack_nibbles(q[: t.n, : k_blocks * g])
    return W4Weight(packed, np.ascontiguousarray(scales), zeros, t.k, g)


# -- helpers ----------------------------------------------------------------------------


def _pad_to(a: np.ndarray, shape: tuple, fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[: a.shape[0], : a.shape[1]] = a
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
