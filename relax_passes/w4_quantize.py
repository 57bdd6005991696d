"""Float weights -> W4 codes, scales and zero points (numpy, data-free).

Three zero-point forms (:data:`~edgetvm.relax_passes.w4_pack.ZERO_POINT_KINDS`), each
stored as :class:`~edgetvm.relax_passes.w4_pack.W4Weight`:

- ``"none"`` (symmetric): zero point 8, one scale per group from a scale rule;
- ``"uint4"``: a 4-bit integer zero point per group, the range ``[min(w, 0), max(w, 0)]``
  mapped onto ``[0, 15]`` (onnxruntime's asymmetric round-to-nearest);
- ``"float"``: a zero point in the scales' dtype per group (MatMulNBits' float
  ``zero_points``), scale and zero point fitted per group: of the grids least squares
  reaches from the min-max and shrunk ranges and HQQ's, the one of least squared error
  (:func:`~edgetvm.relax_passes.w4_fit.fit_float_zero`). A float zero point can sit
  anywhere, so a group that lies on any 16-level grid (a Q4_1 checkpoint) is recovered
  exactly, and any other group gets the grid of least squared error the fit finds.
"""

from __future__ import annotations

import numpy as np

from .w4_fit import fit_float_zero
from .w4_pack import Q_MAX, SYMMETRIC_ZERO, ZERO_POINT_KINDS, W4Weight, pack_nibbles

GROUP_SIZES = (16, 32, 64, 128)
#: Symmetric scale rules (see :func:`quantize_w4`).
SCALE_RULES = ("absmax", "signed_absmax", "mse")
SCALE_DTYPES = ("float16", "float32")
# Divisors of the signed absmax tried by the "mse" rule (the largest weight lands on code
# -divisor): 7 leaves a step of headroom for the opposite sign, 8 is onnxruntime's, 8.5
# clips the largest weight by half a step for a finer grid for all the others.
_MSE_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5)
_ROW_CHUNK = 4096


def check_w4_options(group_size: int, scale_rule: str, scale_dtype: str,
                     zero_points: str = "none") -> None:
    """Raise ValueError for a group size, scale rule, scale dtype or zero-point form
    edgetvm cannot pack."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size {group_size} not in {GROUP_SIZES}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule {scale_rule!r} not in {SCALE_RULES}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype {scale_dtype!r} not in {SCALE_DTYPES}")
    if zero_points not in ZERO_POINT_KINDS:
        raise ValueError(f"zero_points {zero_points!r} not in {ZERO_POINT_KINDS}")


def quantize_w4(
    weight: np.ndarray,
    group_size: int = 32,
    zero_points: str = "none",
    scale_rule: str = "mse",
    scale_dtype: str = "float16",
) -> W4Weight:
    """Group-quantise an ``(N, K)`` float weight to 4 bits.

    Parameters
    ----------
    weight : np.ndarray
        float32/float16/float64 ``(N, K)``; ``K`` is padded to a group multiple.
    group_size : int
        One of :data:`GROUP_SIZES`.
    zero_points : {"none", "uint4", "float"}
        ``none``: zero point 8, one scale per group (``q - 8`` in ``[-8, 7]``).
        ``uint4``: per-group ``[min(w, 0), max(w, 0)]`` mapped onto ``[0, 15]`` with a
        uint8 zero point (0 stays exactly representable; padding counts as 0).
        ``float``: scale and float zero point fitted per group (padding takes no part).
    scale_rule : {"mse", "absmax", "signed_absmax"}
        Symmetric only. ``absmax``: ``max|w| / 7`` (never clips). ``signed_absmax``:
        onnxruntime's rule, ``w_absmax / -8`` (the largest weight lands on -8 exactly;
        an opposite-sign weight of the same size clips to 7). ``mse`` (default): per
        group the scale ``w_absmax / -d``, ``d`` in 7..8.5, with the smallest squared
        error after clipping; it includes onnxruntime's choice (``d = 8``), so it is
        never worse per group. Scales may be negative.
    scale_dtype : {"float16", "float32"}
        Type of the scales (and float zero points). float16 is the NPU's format;
        float32 reproduces onnxruntime's fp32-scale models.

    Returns
    -------
    W4Weight
        Scales (and float zero points) are rounded to ``scale_dtype`` *before* the codes
        are computed, so the codes are optimal for the stored values.
    """
    check_w4_options(group_size, scale_rule, scale_dtype, zero_points)
    w = np.asarray(weight)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating):
        raise ValueError(f"expected a 2-D float weight, got {w.dtype} {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    n, k = w.shape
    if n > _ROW_CHUNK:  # bounded float64 temporaries for vocabulary-sized matrices
        parts = [quantize_w4(w[i: i + _ROW_CHUNK], group_size, zero_points, scale_rule,
                             scale_dtype) for i in range(0, n, _ROW_CHUNK)]
        zeros = None if zero_points == "none" else np.concatenate([p.zeros for p in parts])
        return W4Weight(np.concatenate([p.packed for p in parts]),
                        np.concatenate([p.scales for p in parts]), zeros, k, group_size)
    groups = _groups(w, group_size)  # (N, KB, G) float64

    if zero_points == "float":
        valid = (np.arange(groups.shape[1] * group_size) < k).reshape(groups.shape[1:])
        scales, zeros, q = fit_float_zero(groups, valid, scale_dtype)
        return W4Weight(pack_nibbles(q.reshape(n, -1)), scales, zeros, k, group_size)
    if zero_points == "none":
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
