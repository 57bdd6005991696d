"""A data-free fit of one float scale and one float zero point per group of 4-bit weights.

For a group ``w`` (``G`` weights) the stored form is ``w_hat = (q - z) * s`` with codes
``q`` in ``[0, 15]`` and ``s``, ``z`` in float16 (MatMulNBits' float ``zero_points``).
The fit minimises the squared error ``sum((w_hat - w)^2)`` by alternating two exact steps,
as the half-quadratic / least-squares solvers of HQQ and llama.cpp's k-quants do:

1. codes for the current ``(s, z)``: ``q = clip(rint(w / s + z), 0, 15)`` (optimal per
   weight for a fixed grid);
2. the grid for the current codes: ``w ~ a * q + b`` is a linear least-squares problem in
   ``(a, b)`` with a closed form; ``s = a``, ``z = -b / a``.

One constraint: the group's largest-magnitude weight stays within half a step of its
stored value (a grid that clips it is rejected). Least squares alone would clip a lone
outlier to fit the other weights of its group better, and trained LLMs keep a few large
weights whose loss hurts far more than their share of the squared error ("super
weights"): on SmolLM2 at group 64 the constraint lowers the mean |logit error| from 1.87
to 1.63 (onnxruntime's HQQ: 1.70), on the random-weight tiny Llama it costs nothing.

The error is measured after the float16 rounding of ``s`` and ``z`` and the best
admissible ``(s, z)`` seen is kept per group, so the result is never worse than its
starting point. Starting points: the group's range ``[min, max]`` mapped onto ``[0, 15]``
(round-to-nearest with a float zero point: admissible, and exact for weights that already
lie on a 16-level grid, such as a Q4_1 checkpoint's; such groups stop there) and the same
range shrunk by :data:`SHRINK` (a finer grid that least squares then refines). No
calibration data: only the weights are used.
"""

from __future__ import annotations

import numpy as np

Q_MAX = 15
#: Fractions of the group's range clipped at the start (half at each end).
SHRINK = (0.0, 0.1, 0.2)
#: Alternating steps per starting point (the error has settled after ~6 on LLM weights).
FIT_ITERS = 8
#: A group whose RMS error is below this fraction of its range is exact (a 16-level grid
#: up to the zero point's float16 rounding): it is not refined further.
EXACT = 1e-3


def fit_float_zero(groups: np.ndarray, valid: np.ndarray, dtype: str,
                   iters: int = FIT_ITERS) -> tuple:
    """Fit ``(scales, zeros, codes)`` for ``groups`` (see the module docstring).

    Parameters
    ----------
    groups : np.ndarray
        float ``(R, KB, G)``: ``R`` rows of ``KB`` groups of ``G`` weights.
    valid : np.ndarray
        bool ``(KB, G)``: False for padding (a partial last group); padding takes no part
        in the fit and gets the code nearest the zero point (it dequantises to ~0).
    dtype : str
        Storage type of scales and zero points ("float16" or "float32").
    iters : int
        Alternating steps per starting point (>= 1).

    Returns
    -------
    tuple
        ``scales`` and ``zeros`` ``(R, KB)`` in ``dtype``, ``codes`` uint8 ``(R, KB, G)``.
    """
    if iters < 1:
        raise ValueError(f"iters={iters} must be >= 1")
    rows, k_blocks, g = groups.shape
    w = groups.astype(np.float32).reshape(-1, g)    # float32 passes: half the memory traffic
    ok = np.broadcast_to(valid, groups.shape).reshape(-1, g)
    mask = ok.astype(np.float32)
    lo = np.where(ok, w, np.inf).min(axis=-1).astype(np.float64)
    span = np.where(ok, w, -np.inf).max(axis=-1) - lo
    absw = np.where(ok, np.abs(w), -1.0)
    keep = absw == absw.max(axis=-1, keepdims=True)        # the largest-magnitude weight
    s_best, z_best = np.ones_like(lo), np.zeros_like(lo)
    err_best = np.full(lo.shape, np.inf)
    todo = np.arange(lo.size)
    for shrink in SHRINK:
        s, z, err = _refine(w[todo], mask[todo], keep[todo], lo[todo], span[todo], shrink,
                            dtype, iters)
        better = err < err_best[todo]
        idx = todo[better]
        s_best[idx], z_best[idx], err_best[idx] = s[better], z[better], err[better]
        todo = np.nonzero(err_best > EXACT ** 2 * span * span * mask.sum(axis=-1))[0]
        if todo.size == 0:
            break
    none = ~np.isfinite(err_best)     # no admissible grid (float16 cannot hold z): min-max
    if none.any():
        s_best[none], z_best[none] = _stored(span[none] / Q_MAX, None, lo[none], dtype)
    codes = _codes(w, s_best, z_best)
    codes = np.where(ok, codes, np.clip(np.rint(z_best), 0, Q_MAX)[:, None])
    shape = (rows, k_blocks)
    return (s_best.astype(dtype).reshape(shape), z_best.astype(dtype).reshape(shape),
            codes.astype(np.uint8).reshape(groups.shape))


def _refine(w, mask, keep, lo, span, shrink: float, dtype: str, iters: int) -> tuple:
    """Alternate codes / least squares from the range shrunk by ``shrink``: the best
    admissible stored ``(s, z)`` per group and its squared error (inf: none was)."""
    s, z = _stored(span * (1.0 - shrink) / Q_MAX, None, lo + span * shrink / 2, dtype)
    best = None
    q_prev = None
    for _ in range(iters):
        q = _codes(w, s, z)
        if q_prev is not None and np.array_equal(q, q_prev):
            break                         # a fixed point: the same codes give the same line
        q_prev = q
        step = s.astype(np.float32)[:, None]
        r = (q - z.astype(np.float32)[:, None]) * step - w
        err = (r * r * mask).sum(axis=-1, dtype=np.float64)
        clips = (keep & (np.abs(r) > 0.5001 * step)).any(axis=-1)
        err = np.where(clips, np.inf, err)
        if best is None:
            best = [s, z, err]
        else:
            better = err < best[2]
            best = [np.where(better, s, best[0]), np.where(better, z, best[1]),
                    np.where(better, err, best[2])]
        s, z = _least_squares(w, q, mask, s, dtype)
    return best


def _codes(w: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    inv = (1.0 / s).astype(np.float32)[:, None]
    return np.clip(np.rint(w * inv + z.astype(np.float32)[:, None]), 0, Q_MAX)


def _least_squares(w, q, mask, s_prev, dtype) -> tuple:
    """Stored ``(s, z)`` of the least-squares line ``w ~ a * q + b`` per group; a group
    whose codes are all equal (no slope to fit) keeps ``s`` and fits only ``b``."""
    f64 = np.float64
    n = mask.sum(axis=-1, dtype=f64)
    qm = q * mask
    sq, sw = qm.sum(axis=-1, dtype=f64), (w * mask).sum(axis=-1, dtype=f64)
    sqq, sqw = (qm * q).sum(axis=-1, dtype=f64), (qm * w).sum(axis=-1, dtype=f64)
    det = n * sqq - sq * sq
    flat = det <= 1e-9 * np.maximum(n * sqq, 1.0)
    a = np.where(flat, s_prev, (n * sqw - sq * sw) / np.where(flat, 1.0, det))
    a = np.where(a > 0, a, s_prev)   # a falling line never fits better than the last grid
    b = (sw - a * sq) / n
    return _stored(a, b, None, dtype)


def _stored(scale: np.ndarray, offset, lo, dtype: str) -> tuple:
    """``(s, z)`` as float64 arrays holding ``dtype`` values: ``s`` rounded first, then
    ``z = -offset / s`` (or ``-lo / s``) rounded for that ``s``. A zero scale (a constant
    group) becomes 1 and a scale below the dtype's range its smallest normal number."""
    info = np.finfo(dtype)
    if np.any(np.abs(scale) > info.max):
        raise ValueError(f"a group scale overflows {dtype} (range > {info.max:.3g} * 15)")
    s = np.where(scale == 0, 1.0, np.maximum(scale, float(info.tiny)))
    s = s.astype(dtype).astype(np.float64)
    z = -(lo if offset is None else offset) / s
    z = np.clip(z, -float(info.max), float(info.max)).astype(dtype).astype(np.float64)
    return s, z
