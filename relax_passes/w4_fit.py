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
weights"): on SmolLM2 at group 64 the constraint lowers the mean |logit error| from 1.81
to 1.61; on the random-weight tiny Llama it raises it by under 1 %.

The error is measured after the float16 rounding of ``s`` and ``z`` and the best
admissible ``(s, z)`` seen is kept per group, so the result is never worse than any of its
starting points. Starting points: the group's range ``[min, max]`` mapped onto ``[0, 15]``
(round-to-nearest with a float zero point: admissible, and exact for weights that already
lie on a 16-level grid, such as a Q4_1 checkpoint's; such groups stop there), the same
range shrunk by :data:`SHRINK` (a finer grid that least squares then refines), and HQQ's
solution (:func:`half_quadratic_zero`: the min-max scale kept, only the zero point
fitted). Alternating least squares descends to the fixed point of its codes nearest its
start, and moving scale and zero point together it reaches other fixed points than moving
the zero point alone: HQQ's has the lower squared error in 10-18 % of the groups of
SmolLM2 at groups 64 and 128 and of the tiny Llama (total squared error -1 to -2.4 %; on
SmolLM2 at group 64 the mean |logit error| goes from 1.63 to 1.61 and top-1 agreement
from 63.6 % to 72.9 %; onnxruntime's HQQ alone: 67.8 %, 1.70). No calibration data:
only the weights are used.
"""

from __future__ import annotations

import numpy as np

Q_MAX = 15
#: Fractions of the group's range clipped at the start (half at each end).
SHRINK = (0.0, 0.1, 0.2)
#: Alternating steps per starting point (the error has settled after ~6 on LLM weights).
FIT_ITERS = 8
#: HQQ's solver (Badri & Shaji 2023, onnxruntime's HQQWeightOnlyQuantizer): the lp exponent,
#: the initial half-quadratic penalty ``beta``, its growth per step and the steps.
HQQ_P, HQQ_BETA, HQQ_KAPPA, HQQ_ITERS = 0.7, 10.0, 1.01, 20
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
    starts = [(shrink, iters) for shrink in SHRINK] + [(None, 1)]
    for shrink, steps in starts:
        sub = (w[todo], mask[todo], lo[todo], span[todo])
        if shrink is None:    # HQQ's solution as it is: least squares would move it back
            s0, z0 = half_quadratic_zero(*sub)
            s0, z0 = _stored(s0, -z0 * s0, None, dtype)
        else:
            s0, z0 = _stored(sub[3] * (1.0 - shrink) / Q_MAX, None,
                             sub[2] + sub[3] * shrink / 2, dtype)
        s, z, err = _refine(sub[0], sub[1], keep[todo], s0, z0, dtype, steps)
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


def _refine(w, mask, keep, s, z, dtype: str, iters: int) -> tuple:
    """Alternate codes / least squares from the stored grid ``(s, z)``: the best
    admissible stored ``(s, z)`` per group and its squared error (inf: none was)."""
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


def half_quadratic_zero(w, mask, lo, span) -> tuple:
    """HQQ's zero point for the min-max scale, per group (float64 ``(s, z)``, unrounded).

    With ``s = span / 15`` fixed, HQQ minimises ``sum |w - (q - z) * s|^p`` (``p`` =
    :data:`HQQ_P`) over ``z`` by half-quadratic splitting: the error the grid leaves gets
    the lp proximal step ``e = shrink_p(w - w_hat)`` (0 where ``|w - w_hat| <=
    beta^(-1 / (2 - p))``, so small errors pull on ``z`` and large ones are let go), then
    ``z = mean(q - (w - e) / s)`` is the exact quadratic step, and ``beta`` grows by
    :data:`HQQ_KAPPA` per step. The threshold is absolute (0.17 at the first ``beta``): on
    LLM weights, whose rounding errors are far smaller, it lets go of clipped weights only
    (it moves ``z`` in 0.06 % of SmolLM2's groups at G=64, none of the tiny Llama's), and
    the solver is an alternation of codes and the least-squares zero point for the fixed
    scale. Starts from the rounded min-max zero point, as HQQ does; each group keeps the
    zero point of its lowest mean |error| and stops when that stops falling
    (onnxruntime stops a whole matrix at once).
    """
    inv = Q_MAX / np.where(span > 0, span, Q_MAX)            # HQQ works with 1 / s
    zero = np.rint(-lo * inv)
    best_z, best_err = zero.copy(), np.full(zero.shape, np.inf)
    n = mask.sum(axis=-1, dtype=np.float64)
    beta = HQQ_BETA
    act = np.arange(zero.size)                    # groups whose error still falls
    for _ in range(HQQ_ITERS):
        wa, ma = w[act], mask[act]
        ia, za = inv[act].astype(np.float32)[:, None], zero[act].astype(np.float32)[:, None]
        q = np.clip(np.rint(wa * ia + za), 0, Q_MAX)
        r = wa - (q - za) / ia
        a = np.abs(r)
        err = (a * ma).sum(axis=-1, dtype=np.float64) / n[act]
        falls = err < best_err[act]
        act, q, r, a, wa, ma, ia = (x[falls] for x in (act, q, r, a, wa, ma, ia))
        if act.size == 0:
            break
        best_z[act], best_err[act] = zero[act], err[falls]
        e = np.sign(r) * np.maximum(a - np.power(a + 1e-8, HQQ_P - 1) / beta, 0)
        zero[act] = ((q - (wa - e) * ia) * ma).sum(axis=-1, dtype=np.float64) / n[act]
        beta *= HQQ_KAPPA
    return 1.0 / inv, best_z


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
