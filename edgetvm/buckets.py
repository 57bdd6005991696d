"""Length buckets: which static prefill programs to compile for dynamic prompt lengths.

The NPU runs static command streams, so a prompt of length ``l`` runs on the program of
the smallest bucket ``b >= l`` and ``b - l`` tokens are padding (masked by the runtime
``valid length`` parameter). More buckets mean less padding but more compiled variants
(compile time, program storage). This module picks the boundaries by exact dynamic
programming over a length distribution and a per-bucket latency curve, and evaluates the
reference strategies of the source study (powers of two, equal 128-wide, one bucket) and
chunked prefill the same way.

Two padding figures are reported for every strategy (``l`` a request length drawn from
the distribution, ``b = bucket(l)``):

``padding_pct = 100 * E[(b - l) / b]``
    the mean, over requests, of the fraction of the executed sequence that is padding.
    This is the definition that reproduces the source study's numbers (27.96 / 14.52 /
    86.23 % for powers of two / equal 128 / one 4096 bucket): the one-bucket 86.23 %
    would need a mean prompt of ~2200 tokens under the token-overhead definition below,
    not a heavy-tailed 128..4096 distribution.
``token_overhead_pct = 100 * E[b - l] / E[l]``
    padded tokens per useful token, over the whole workload (can exceed 100 %).
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from edgetvm.errors import EdgeTVMError


class BucketInputError(EdgeTVMError, ValueError):
    """A length histogram or latency table is missing, malformed or inconsistent."""


# ----------------------------------------------------------------------------------------
# length distributions


@dataclass(frozen=True)
class LengthDistribution:
    """Probability of each prompt length 1..max_len.

    ``probs[l]`` is P(length == l); ``probs[0]`` is unused (always 0). ``source`` says
    where it came from (a file name or the built-in model).
    """

    probs: np.ndarray
    source: str

    @property
    def max_len(self) -> int:
        return len(self.probs) - 1

    @property
    def lengths(self) -> np.ndarray:
        """The lengths with non-zero probability, ascending."""
        return np.nonzero(self.probs)[0]

    def mean_len(self) -> float:
        return float(np.dot(np.arange(len(self.probs)), self.probs))


def as_distribution(hist, max_len: int | None = None, source: str = "histogram"):
    """Normalise ``hist`` (length -> probability or count) into a `LengthDistribution`.

    ``hist`` is a mapping, a sequence of ``(length, weight)`` pairs, or an existing
    `LengthDistribution`. Lengths are integers >= 1; weights are finite and >= 0 with a
    positive sum. ``max_len`` defaults to the largest length; a larger one leaves room
    for lengths the histogram never saw, a smaller one is an error.
    """
    if isinstance(hist, LengthDistribution):
        pairs = [(int(l), float(hist.probs[l])) for l in hist.lengths]
        source = hist.source
    else:
        items = hist.items() if isinstance(hist, Mapping) else hist
        pairs = []
        for item in items:
            try:
                length, weight = item
            except (TypeError, ValueError):
                raise BucketInputError(f"{source}: entry {item!r} is not (length, weight)")
            pairs.append((_as_length(length, source), _as_weight(weight, length, source)))
    if not pairs:
        raise BucketInputError(f"{source}: the histogram is empty")
    top = max(l for l, _ in pairs)
    if max_len is None:
        max_len = top
    elif top > max_len:
        raise BucketInputError(f"{source}: length {top} exceeds max_len {max_len}")
    probs = np.zeros(max_len + 1)
    for length, weight in pairs:
        probs[length] += weight
    total = probs.sum()
    if not total > 0:
        raise BucketInputError(f"{source}: all weights are zero")
    return LengthDistribution(probs / total, source)


def _as_length(value, source) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BucketInputError(f"{source}: length {value!r} is not a number")
    if not number.is_integer() or number < 1:
        raise BucketInputError(f"{source}: length {value!r} is not an integer >= 1")
    return int(number)


def _as_weight(value, length, source) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise BucketInputError(f"{source}: weight {value!r} of length {length} is not a number")
    if not math.isfinite(weight) or weight < 0:
        raise BucketInputError(
            f"{source}: weight {value!r} of length {length} must be finite, >= 0")
    return weight


def load_histogram(path, max_len: int | None = None) -> LengthDistribution:
    """Read a length histogram file: CSV ``length,count`` lines or JSON ``{length: count}``.

    The CSV may start with a header line (``length,count``); blank lines and ``#``
    comments are skipped; a length listed twice is an error. JSON keys are lengths as
    strings. Counts or probabilities, they are normalised. Raises `BucketInputError`
    naming the file and line on any problem.
    """
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise BucketInputError(f"cannot read histogram {path}: {err.strerror}") from None
    if not text.strip():
        raise BucketInputError(f"{path}: the histogram file is empty")
    if path.suffix.lower() == ".json" or text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise BucketInputError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(data, dict):
            raise BucketInputError(f"{path}: JSON must be an object {{length: count}}")
        return as_distribution(data, max_len, source=str(path))
    pairs, seen = [], set()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 2:
            raise BucketInputError(f"{path}:{number}: expected 'length,count', got {line!r}")
        if not pairs and not seen and fields[0].lower() == "length":
            continue  # header
        where = f"{path}:{number}"
        length = _as_length(fields[0], where)
        if length in seen:
            raise BucketInputError(f"{where}: length {length} listed twice")
        seen.add(length)
        pairs.append((length, _as_weight(fields[1], length, where)))
    return as_distribution(pairs, max_len, source=str(path))


def heavy_tailed_lengths(min_len=128, max_len=4096, median=384.0, sigma=0.8):
    """The built-in request distribution: a log-normal truncated to [min_len, max_len].

    ``P(l) ∝ exp(-(ln l - ln median)^2 / (2 sigma^2)) / l`` for integer ``l`` in
    ``[min_len, max_len]``, renormalised (truncated, not clipped: no point mass at the
    ends). Analytic, so deterministic without a seed. The defaults (median 384 tokens,
    sigma 0.8, mean ~530) reproduce the source study's baseline padding (see the module
    docstring) within 0.35 percentage points.
    """
    lengths = np.arange(min_len, max_len + 1)
    density = np.exp(-((np.log(lengths) - math.log(median)) ** 2) / (2 * sigma**2)) / lengths
    probs = np.zeros(max_len + 1)
    probs[min_len:] = density / density.sum()
    source = f"built-in log-normal (median {median:g}, sigma {sigma:g}) on [{min_len}, {max_len}]"
    return LengthDistribution(probs, source)


# ----------------------------------------------------------------------------------------
# latency curves


class LatencyTable:
    """Latency of the program of each bucket length, from sparse measured points.

    Measurements (an emulator run of a compiled prefill program per length) are
    expensive, so the table holds a few ``(length, latency)`` points and interpolates
    piecewise-linearly between neighbouring measured lengths. Piecewise-linear never
    overshoots (unlike a cubic spline): between two measured lengths the value stays
    between the two measurements, so monotone measurements give a monotone curve. Outside
    ``[first, last]`` measured length there is no extrapolation: calling it there raises,
    and `optimise_buckets` only considers boundaries inside the measured range.
    """

    def __init__(self, points, unit="cycles", source="table"):
        pairs = sorted((_as_length(l, source), float(v)) for l, v in _point_pairs(points, source))
        if not pairs:
            raise BucketInputError(f"{source}: the latency table is empty")
        for (l0, _), (l1, _) in zip(pairs, pairs[1:]):
            if l0 == l1:
                raise BucketInputError(f"{source}: length {l0} measured twice")
        for l, v in pairs:
            if not math.isfinite(v) or v < 0:
                raise BucketInputError(
                    f"{source}: latency {v!r} at length {l} must be finite, >= 0")
        self.lengths = np.array([l for l, _ in pairs], dtype=float)
        self.values = np.array([v for _, v in pairs])
        self.unit = unit
        self.source = source

    @property
    def domain(self) -> tuple[int, int]:
        return int(self.lengths[0]), int(self.lengths[-1])

    def __call__(self, length):
        lo, hi = self.domain
        x = np.asarray(length, dtype=float)
        if np.any(x < lo) or np.any(x > hi):
            raise BucketInputError(
                f"{self.source}: latency asked at length {length}, outside the measured "
                f"range {lo}..{hi}; measure that length's program")
        out = np.interp(x, self.lengths, self.values)
        return float(out) if out.ndim == 0 else out


def _point_pairs(points, source):
    if isinstance(points, Mapping):
        return list(points.items())
    pairs = []
    for p in points:
        if isinstance(p, Mapping):
            if "length" not in p or not ({"cycles", "latency"} & p.keys()):
                raise BucketInputError(f"{source}: point {p!r} needs 'length' and 'cycles'")
            pairs.append((p["length"], p.get("cycles", p.get("latency"))))
        elif isinstance(p, (list, tuple)) and len(p) == 2:
            pairs.append(tuple(p))
        else:
            raise BucketInputError(f"{source}: point {p!r} is not (length, latency)")
    return pairs


def load_latency_table(path) -> LatencyTable:
    """Read measured latency points from JSON.

    Accepted: ``{"unit": "cycles", "points": [[length, cycles], ...]}``, the points as
    ``{"length": l, "cycles": c}`` objects, a bare list of pairs, or ``{"128": c, ...}``.
    """
    path = pathlib.Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise BucketInputError(f"cannot read latency table {path}: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise BucketInputError(f"{path}: not valid JSON ({err})") from None
    unit = "cycles"
    if isinstance(data, dict) and "points" in data:
        unit = str(data.get("unit", unit))
        data = data["points"]
    if not isinstance(data, (dict, list)):
        raise BucketInputError(f"{path}: expected a list of (length, cycles) points")
    return LatencyTable(data, unit=unit, source=str(path))


@dataclass(frozen=True)
class AnalyticLatency:
    """PLACEHOLDER prefill latency ``fixed + per_token * b + per_token_pair * b^2`` (ms proxy).

    Not a measurement: a launch overhead, a linear term (GEMMs) and a quadratic term
    (attention). The default coefficients are fitted so that the source study's strategies
    on the built-in distribution land near its latency proxy (3.311 / 2.631 / 3.122 /
    19.139). Use a `LatencyTable` of emulator measurements for real decisions.
    """

    fixed: float = 0.94
    per_token: float = 2.17e-3
    per_token_pair: float = 5.55e-7
    unit: str = "ms (proxy)"
    source: str = "ANALYTIC placeholder, not a measurement"

    def __call__(self, length):
        b = np.asarray(length, dtype=float)
        out = self.fixed + self.per_token * b + self.per_token_pair * b * b
        return float(out) if out.ndim == 0 else out


# ----------------------------------------------------------------------------------------
# evaluation


@dataclass(frozen=True)
class LengthBuckets:
    """A bucketing strategy evaluated on one length distribution and latency curve.

    ``boundaries``: ascending bucket lengths; a prompt runs on the smallest ``b >= l``.
    ``padding_pct``: ``100 E[(b - l) / b]`` (the source study's definition, see module).
    ``token_overhead_pct``: ``100 E[b - l] / E[l]``.
    ``expected_latency``: ``E[latency(b)]`` in ``latency_unit``.
    ``variant_count``: compiled programs needed (``len(boundaries)``, 1 for chunking).
    ``objective``: ``expected_latency + variant_cost * variant_count``.
    """

    name: str
    boundaries: tuple[int, ...]
    padding_pct: float
    token_overhead_pct: float
    expected_latency: float
    latency_unit: str
    variant_count: int
    objective: float
    bucket_probability: tuple[float, ...] = ()

    def bucket_of(self, length: int) -> int:
        i = int(np.searchsorted(self.boundaries, length))
        if i == len(self.boundaries):
            raise ValueError(f"length {length} exceeds the largest bucket {self.boundaries[-1]}")
        return self.boundaries[i]


def evaluate_buckets(boundaries, hist, latency, name="buckets", variant_cost=0.0):
    """Evaluate fixed ``boundaries`` on ``hist`` with ``latency``; returns `LengthBuckets`."""
    dist = as_distribution(hist)
    lat = _as_latency(latency)
    bounds = np.array(sorted(set(int(b) for b in boundaries)))
    lengths = dist.lengths
    if len(bounds) == 0 or bounds[0] < 1:
        raise ValueError(f"boundaries {list(boundaries)} must be non-empty lengths >= 1")
    if bounds[-1] < lengths[-1]:
        raise ValueError(f"largest bucket {bounds[-1]} < longest prompt {lengths[-1]}")
    p = dist.probs[lengths]
    which = np.searchsorted(bounds, lengths)
    b = bounds[which].astype(float)
    bucket_lat = np.array([lat(int(x)) for x in bounds], dtype=float)
    expected = float(np.dot(p, bucket_lat[which]))
    mass = np.bincount(which, weights=p, minlength=len(bounds))
    return LengthBuckets(
        name=name,
        boundaries=tuple(int(x) for x in bounds),
        padding_pct=100.0 * float(np.dot(p, (b - lengths) / b)),
        token_overhead_pct=100.0 * float(np.dot(p, b - lengths)) / dist.mean_len(),
        expected_latency=expected,
        latency_unit=_unit(lat),
        variant_count=len(bounds),
        objective=expected + variant_cost * len(bounds),
        bucket_probability=tuple(float(m) for m in mass),
    )


def evaluate_chunked(hist, latency, chunk, context_latency=None, name=None):
    """Chunked prefill: one static program of ``chunk`` tokens serves every length.

    A prompt of length ``l`` runs ``n = ceil(l / chunk)`` chunks; latency is
    ``n * latency(chunk) + sum_k context_latency(chunk, k * chunk)`` where chunk ``k``
    (0-based) also attends to the ``k * chunk`` tokens of KV already written. Without
    ``context_latency`` that term is 0 and the row is a lower bound. Padding is the last
    chunk's tail: ``b = n * chunk``.
    """
    dist = as_distribution(hist)
    lat = _as_latency(latency)
    lengths = dist.lengths
    p = dist.probs[lengths]
    n = -(-lengths // chunk)
    per_request = n * lat(int(chunk))
    if context_latency is not None:
        extra = np.cumsum([0.0] + [context_latency(chunk, k * chunk) for k in range(n.max())])
        per_request = per_request + extra[n]
    b = (n * chunk).astype(float)
    expected = float(np.dot(p, per_request))
    return LengthBuckets(
        name=name or f"chunked prefill C={chunk}",
        boundaries=(int(chunk),),
        padding_pct=100.0 * float(np.dot(p, (b - lengths) / b)),
        token_overhead_pct=100.0 * float(np.dot(p, b - lengths)) / dist.mean_len(),
        expected_latency=expected,
        latency_unit=_unit(lat),
        variant_count=1,
        objective=expected,
    )


def _as_latency(latency):
    if callable(latency):
        return latency
    return LatencyTable(latency, source="latency table")


def _unit(latency) -> str:
    return getattr(latency, "unit", "latency units")


# ----------------------------------------------------------------------------------------
# reference strategies


def power_of_two_buckets(max_len: int, min_len: int = 1) -> tuple[int, ...]:
    """Powers of two from the first one >= ``min_len``; ``max_len`` closes the last bucket."""
    b, out = 1, []
    while b < min_len:
        b *= 2
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out + [max_len])


def equal_width_buckets(max_len: int, width: int = 128, min_len: int = 1) -> tuple[int, ...]:
    """Multiples of ``width`` from the first one >= ``min_len``; ``max_len`` closes the last."""
    first = -(-min_len // width) * width
    return tuple(list(range(first, max_len, width)) + [max_len])


def single_bucket(max_len: int) -> tuple[int, ...]:
    return (max_len,)


# ----------------------------------------------------------------------------------------
# optimiser


def candidate_boundaries(dist: LengthDistribution, grid, max_len: int, domain=None):
    """Boundaries the DP may choose: multiples of ``grid`` (int) or, for ``grid="lengths"``,
    the distinct lengths with non-zero probability; ``max_len`` is always one, and with a
    measured table only lengths inside its measured range are."""
    if grid == "lengths":
        cands = set(int(l) for l in dist.lengths)
    elif isinstance(grid, int) and grid >= 1:
        cands = set(range(grid, max_len + 1, grid))
    else:
        raise ValueError(f"grid must be a positive int or 'lengths', got {grid!r}")
    cands = {c for c in cands if c <= max_len} | {max_len}
    if domain is not None:
        lo, hi = domain
        if not lo <= max_len <= hi:
            raise BucketInputError(
                f"the latency table covers lengths {lo}..{hi} but max_len is {max_len}: "
                f"measure the max_len program")
        cands = {c for c in cands if lo <= c <= hi}
    return np.array(sorted(cands))


def optimise_buckets(hist, latency, max_len=None, variant_cost=0.0, max_buckets=None,
                     grid=16, name="optimised (DP)") -> LengthBuckets:
    """Choose bucket boundaries minimising ``E[latency(bucket(l))] + variant_cost * n``.

    Parameters
    ----------
    hist : mapping length -> probability or count, pairs, or `LengthDistribution`
        Lengths over 1..max_len.
    latency : callable ``latency(bucket_len)`` or a table of measured points
        A table (``{length: value}`` or ``[(length, value), ...]``, or a `LatencyTable`) is
        interpolated piecewise-linearly between measured lengths (see `LatencyTable`).
        Seconds, cycles, anything additive: ``variant_cost`` is in the same unit.
    max_len : int, optional
        Longest prompt served; always the last boundary. Default: longest in ``hist``.
    variant_cost : float
        Price of one more compiled program (compile time, storage), latency units.
    max_buckets : int, optional
        Hard cap on the number of buckets.
    grid : int or "lengths"
        Candidate boundaries (`candidate_boundaries`). ``"lengths"`` is exact over all
        integer boundaries when latency is non-decreasing (a boundary can always move
        down to the longest length it serves); a grid of 16 keeps ``L = 4096`` at 256
        candidates.

    Exact DP over candidates ``c_1 < ... < c_m = max_len`` with ``F`` the CDF:
    ``best[j] = min_{i<j} best[i] + latency(c_j) * (F(c_j) - F(c_i)) + variant_cost``,
    O(m^2), or O(max_buckets * m^2) with the cap. Ties go to fewer buckets; buckets that
    serve no probability mass are dropped (they cannot lower the expected latency).
    """
    dist = as_distribution(hist, max_len)
    max_len = dist.max_len
    lat = _as_latency(latency)
    cands = candidate_boundaries(dist, grid, max_len, getattr(lat, "domain", None))
    cdf = np.concatenate([[0.0], np.cumsum(dist.probs)[cands]])
    cdf[-1] = 1.0
    lat_c = np.concatenate([[0.0], np.array([lat(int(c)) for c in cands], dtype=float)])
    m = len(cands)
    if max_buckets is None:
        chosen = _dp_free(cdf, lat_c, variant_cost, m)
    else:
        if max_buckets < 1:
            raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
        chosen = _dp_capped(cdf, lat_c, variant_cost, m, int(max_buckets))
    bounds = [int(cands[j - 1]) for j in chosen]
    # a bucket whose range has no mass changes nothing but the variant count
    mass = np.diff(np.concatenate([[0.0], cdf[chosen]]))
    bounds = [b for b, w in zip(bounds[:-1], mass[:-1]) if w > 0] + [bounds[-1]]
    return evaluate_buckets(bounds, dist, lat, name=name, variant_cost=variant_cost)


def _tie_break(values, counts):
    """Index of the minimum of ``values``; among near-ties the one with the fewest buckets."""
    best = values.min()
    near = values <= best + 1e-12 * max(1.0, abs(best))
    return int(np.argmin(np.where(near, counts, np.inf)))


def _dp_free(cdf, lat_c, variant_cost, m):
    best = np.full(m + 1, np.inf)
    count = np.zeros(m + 1)
    prev = np.zeros(m + 1, dtype=int)
    best[0] = 0.0
    for j in range(1, m + 1):
        values = best[:j] + lat_c[j] * (cdf[j] - cdf[:j]) + variant_cost
        i = _tie_break(values, count[:j])
        best[j], count[j], prev[j] = values[i], count[i] + 1, i
    return _backtrack(prev, m)


def _dp_capped(cdf, lat_c, variant_cost, m, cap):
    # best[k, j]: cheapest cover of lengths <= c_j with exactly k buckets, the last at c_j
    best = np.full((cap + 1, m + 1), np.inf)
    prev = np.zeros((cap + 1, m + 1), dtype=int)
    best[0, 0] = 0.0
    for k in range(1, cap + 1):
        for j in range(k, m + 1):
            values = best[k - 1, :j] + lat_c[j] * (cdf[j] - cdf[:j]) + variant_cost
            i = int(np.argmin(values))
            best[k, j], prev[k, j] = values[i], i
    k = _tie_break(best[1:, m], np.arange(1, cap + 1)) + 1
    chosen, j = [], m
    while j > 0:
        chosen.append(j)
        j, k = prev[k, j], k - 1
    return chosen[::-1]


def _backtrack(prev, m):
    chosen, j = [], m
    while j > 0:
        chosen.append(j)
        j = prev[j]
    return chosen[::-1]
