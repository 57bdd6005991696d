"""The cost model: XGBoost over features of what decides a kernel's cost on this NPU.

Features are computed from a candidate's knobs and its task's shapes, without lowering
(so a pool of hundreds of candidates is ranked in milliseconds and only the top ones are
lowered and measured): DRAM bytes per level (activations, weights re-read per row tile,
outputs), DMA count and mean DMA size (bursts), the TCM footprint of the tiles and their
buffering slots (and its share of the TCM), tile counts, MACs and arithmetic intensity,
the pipeline depth (slots), the DMA split, whether TCM buffers share bytes
(``tcm_fresh``) and whether the units' order is list-scheduled (``list_schedule``). For
a run's cuts (a partition task): the activation bytes the cuts send through DRAM, the
number of kernels, and the largest cluster's weights against the TCM. Power per unit
(:func:`power_estimate`): what the matrix and vector units, their TCM traffic and the
DRAM draw on average, as shares of the profile's budget, and the clock and latency the
governor would leave the kernel (under a binding budget a candidate that moves fewer
bytes keeps more of its clock). MetaSchedule's per-store features know nothing of TCM,
DMA or power, so its ``XGBModel`` feature extractor does not apply; the model itself is
the same idea (gradient-boosted trees on log latency, trained online).

One model serves every task: the target is ``log(cycles / default cycles)`` of the task,
so tasks of very different sizes share what they teach (a larger tile that halves the
weight re-reads helps every GEMV alike). The model only ranks which candidates to measure
next; a chosen knob set is always a measured one.

For a cluster with matmuls, an attention kernel and a run's cuts the trees are boosted
from an analytic prior (the ``prior`` feature is each row's base margin):
:func:`cluster_estimate` charges the knobs' MMAs, weight and activation DMAs and casts
with the spec's per-command costs, :func:`attention_estimate` the live KV tiles' MMAs,
softmax passes and page DMAs, :func:`partition_estimate` what the cuts send through DRAM
and the kernels' launches; the prior is the ratio of that estimate to the defaults'
(for a kernel, of the latency the governor would leave each under the profile's
budget). It ranks a task's first round before any measurement, and the trees learn what
it misses (pipeline fill at stage boundaries, bus contention, power in a kernel's hot
phases, a joined cluster's TCM pressure). Also
per matmul, in stage order, the knobs themselves (AutoTVM's knob features): the best
prefill MLPs differ from the defaults in one stage's tiles.
"""
from __future__ import annotations

import math

import numpy as np

from edgetvm.target.emulator.costs import mma_shape_cycles, vector_shape_cycles
from edgetvm.target.emulator.power import largest_scale
from edgetvm.tir_schedules.attention import two_pass_bytes
from edgetvm.tir_schedules.fused import KNOBS_SINCE

#: template kinds, one-hot in the features
KINDS = ("cluster", "decode_attention", "prefill_attention", "embedding", "partition")

FEATURES = (
    "log_rows", "log_tile_m", "row_tiles", "tile_n_frac",
    "log_act_bytes", "log_weight_bytes", "log_weight_dram", "weight_rereads",
    "log_dma_count", "log_mean_dma", "log_tcm", "tcm_frac",
    "log_macs", "log_intensity", "log_w_tiles", "mean_tn_frac", "mean_tk_frac",
    "slots_in", "slots_out", "slots_w", "slots_c", "dma_split", "matmuls", "w4",
    "log_tile_q", "log_tile_kv", "kv_tiles", "slots_kv", "slots_s", "rowsum_mma",
    "two_pass", "clusters", "log_cut_bytes", "max_cluster_ops", "max_cluster_w_frac", "mm_clusters",
    "log_est_mma", "log_est_wdma", "log_est_act", "log_est_vec", "log_est_serial",
    "log_est_overlap", "prior", "tile_m_frac", "tcm_fresh", "list_schedule", "resident_w",
    "pw_units", "pw_tcm", "pw_dram", "pw_total", "est_scale", "log_est_throttled",
) + tuple(f"mm{i}_{k}" for i in range(4) for k in (
    "log_tile_n", "log_tile_k", "tile_n_frac", "tile_k_frac", "slots_w", "slots_c")
) + tuple(f"kind_{k}" for k in KINDS)
#: the column of :data:`FEATURES` that holds the analytic prior (the model's base margin)
PRIOR = FEATURES.index("prior")


def _l(x) -> float:
    return math.log2(1.0 + max(0.0, float(x)))


def _splits(extent: int, tile: int) -> list:
    """(tile size, count) of a loop of ``extent`` split by ``tile`` (the edge tile last)."""
    tile = max(1, min(int(tile), extent))
    full, rem = divmod(extent, tile)
    return [(tile, full)] + ([(rem, 1)] if rem else [])


#: vector passes (in units of one elementary pass's cycles, the preset's ``add``) per row
#: pass of a cluster's non-matmul stages, from their vector ops (a norm: square, sum,
#: scale, gain; SiLU and the product; ...): a prior, the emulator decides
STAGE_VECTOR_OPS = {
    "rms_norm": ("mul", "reduce_sum", "mul", "mul"),
    "layer_norm": ("reduce_sum", "sub", "mul", "reduce_sum", "mul", "mul", "add"),
    "silu_mul": ("silu", "mul"), "gelu_mul": ("gelu", "mul"), "gelu": ("gelu",),
    "relu_mul": ("max", "mul"), "relu2_mul": ("max", "mul", "mul"),
    "relu": ("max",), "relu2": ("max", "mul"), "rope": ("rope",), "add": ("add",), "bias_add": ("add",),
    "mul_vec": ("mul",), "scale": ("mul",), "copy": ("copy",),
    "softmax": ("reduce_max", "sub", "exp", "reduce_sum", "div"),
}


def _row_vector_cycles(sh: dict, spec) -> float:
    """Vector cycles per row of a cluster's non-matmul stages."""
    total = 0.0
    for op, cols in sh.get("row_stages", ()):
        passes = -(-cols // spec.vector_lanes)
        total += passes * sum(spec.vector_op_cycles.get(v, 1)
                              for v in STAGE_VECTOR_OPS.get(op, ("add",)))
    return total


def cluster_estimate(sh: dict, knobs: dict, spec) -> dict:
    """Unit cycles of a fusion cluster's knob set from its shapes and the spec's
    per-command costs, without lowering: the matrix unit (every MMA padded to whole
    native tiles, plus its issue cycles; a W4A16 MMA bounded by its dequantisation rate),
    the weight DMAs (bytes over the bus plus a set-up per transfer), the activations'
    and outputs' DMAs, the vector unit (the accumulator casts and the other stages: norms,
    activations, RoPE); and two latencies from them, each with the kernel's launch:
    ``serial`` (no unit overlaps another) and ``overlap`` (each matmul's weight stream
    hidden under its MMAs where it has two weight slots, the activations' under the
    compute where they have two slots; list-scheduled with several row tiles, the vector
    stages of one tile under the matrix work of the others). With resident weights
    (``resident_w``) each weight is one DMA per kernel, not one per tile and row tile: the
    first stage's waits before its MMAs, the others' load under the compute of the first
    row tile. The emulator decides; this only tells the cost model where to start (its
    prior)."""
    rows = sh.get("rows", 1)
    tm = knobs.get("tile_m", rows)
    bw, setup, lanes = spec.dram_bytes_per_cycle, spec.dma_setup_cycles, spec.vector_lanes
    mm = knobs.get("matmul", {})
    slots_in = knobs.get("slots_in", 1)
    si = min(slots_in.values(), default=1) if isinstance(slots_in, dict) else slots_in
    so = knobs.get("slots_out", 1)
    act_bytes = sum(sh["row_bytes"].values())
    est = dict(mma=0.0, wdma=0.0, act=0.0, vec=0.0, serial=float(spec.launch_cycles),
               overlap=float(spec.launch_cycles))
    row_vec = _row_vector_cycles(sh, spec)
    listed = knobs.get("list_schedule", 0) and tm < rows
    resident = bool(knobs.get("resident_w", KNOBS_SINCE["resident_w"]))
    whole = [_weight_dma(n, k, group, spec)           # each weight in one DMA
             for _, (n, k, group) in sorted(sh["matmuls"].items())]
    matrix_side = vector_side = fill = 0.0         # over the row tiles, list-scheduled
    first_tile = None                              # the first row tile's compute
    for m, cm in _splits(rows, tm):
        act = (act_bytes * m / rows) / bw + setup * (len(sh["row_bytes"]) + 1)
        stage_vec = m * row_vec
        compute = stage_vec
        serial = act + stage_vec
        est["vec"] += cm * stage_vec
        matrix_part = vector_part = 0.0
        for stage, (n, k, group) in sorted(sh["matmuls"].items()):
            kn = mm.get(stage, {})
            kind = "w4a16" if group else "fp16"
            c_mma = c_dma = c_vec = 0.0
            for a, ca in _splits(n, kn.get("tile_n", n)):
                for b, cb in _splits(k, kn.get("tile_k", k)):
                    c_mma += ca * cb * mma_shape_cycles(m, a, b, kind, spec)
                    if not resident:
                        c_dma += ca * cb * _weight_dma(a, b, group, spec)
                c_vec += ca * m * -(-a // lanes)          # the cast of each j0 tile
            est["mma"] += cm * c_mma
            est["wdma"] += cm * c_dma
            est["vec"] += cm * c_vec
            both = max(c_mma, c_dma) if kn.get("slots_w", 1) > 1 else c_mma + c_dma
            compute += both + c_vec
            serial += c_mma + c_dma + c_vec
            matrix_part += both
            vector_part += c_vec
        est["act"] += cm * act
        est["serial"] += cm * serial
        est["overlap"] += cm * (max(compute, act) if min(si, so) > 1 else compute + act)
        matrix_side += cm * matrix_part
        vector_side += cm * (vector_part + stage_vec)
        fill = max(fill, stage_vec)
        first_tile = compute if first_tile is None else first_tile
    if listed:
        est["overlap"] = min(est["overlap"], float(spec.launch_cycles) +
                             max(matrix_side, vector_side) + fill)
    if resident and whole:
        est["wdma"] = float(sum(whole))
        est["serial"] += sum(whole)
        est["overlap"] += whole[0] + max(0.0, sum(whole[1:]) - (first_tile or 0.0))
    return est


def _weight_bytes(a: int, b: int, group: int) -> float:
    """Bytes of an ``a x b`` weight tile: fp16, or W4A16 codes and their group scales
    (``group``)."""
    return a * b / 2 + a * (b // group) * 4 if group else a * b * 2


def _weight_dmas(group: int) -> int:
    """DMAs of one weight tile: fp16 one; W4A16 codes, scales and zero points one each."""
    return 3 if group else 1


def _weight_dma(a: int, b: int, group: int, spec) -> float:
    """Bus cycles of an ``a x b`` weight tile: its bytes over the DRAM rate, a set-up per
    DMA."""
    return _weight_bytes(a, b, group) / spec.dram_bytes_per_cycle + \
        spec.dma_setup_cycles * _weight_dmas(group)


def _mma(m: int, n: int, k: int, spec) -> int:
    """Cycles of one fp16 MMA command (the emulator's per-command cost)."""
    return mma_shape_cycles(m, n, k, "fp16", spec)


def _vec(rows: int, cols: int, spec, *ops) -> int:
    """Cycles of one vector command per op of ``ops`` over ``rows`` x ``cols``."""
    return sum(vector_shape_cycles(o, rows, cols, spec) for o in ops)


def attention_estimate(kind: str, sh: dict, knobs: dict, spec) -> dict:
    """Unit cycles of an attention kernel's knob set from its shapes, without lowering,
    following the templates' loop nests (``tir_schedules/attention.py``): per KV tile
    that is live (prefill: causal, its queries at the bucket's last positions as the
    kernel is measured), the QK^T and P @ V MMAs (and prefill's row sums as an MMA, or
    as a vector reduction with ``rowsum_mma=0``), the softmax's vector passes over the
    scores (the mask on the tiles the diagonal crosses, ALiBi's bias) and over the rows
    (with ``two_pass``, the running max only: no correction, no rescaled O or l; the two
    passes overlap their units each, not each other; K and V loaded once per KV head),
    and the K/V page DMAs (bytes and one set-up per page DMA); then per query tile the Q
    load, its per-head copy, the normalisation and the store. ``serial``: no unit
    overlaps another; ``overlap``: per KV tile the longer of the matrix and vector work
    when the scores are pipelined (``slots_s=2``) or list-scheduled, else the vector
    work plus one query head's MMAs, the K/V DMAs hidden when double-buffered
    (``slots_kv=2``) but for the pipeline's fill, else added; list-scheduled, the busiest
    unit over the whole kernel plus what cannot overlap (the first tile's load and
    scores, a query tile's set-up and end). A prior for the cost model, as
    :func:`cluster_estimate` is: the emulator decides."""
    rows, cap, d = sh["rows"], sh["capacity"], sh["head_dim"]
    hq, hk, page = sh["q_heads"], sh["kv_heads"], sh["page_tokens"]
    g = max(1, hq // hk)
    bw, setup = spec.dram_bytes_per_cycle, spec.dma_setup_cycles
    tt = max(1, min(int(knobs["tile_kv"]), cap))
    page_dmas = max(1, tt // page)                  # page DMAs per K (or V) tile
    tile_bytes = tt * d * 2                          # one head's K (or V) tile
    n_kt = -(-cap // tt)
    est = dict(mma=0.0, wdma=0.0, act=0.0, vec=0.0, serial=float(spec.launch_cycles),
               overlap=float(spec.launch_cycles))
    listed = bool(knobs.get("list_schedule", 0))
    piped = knobs.get("slots_s", 1) > 1 or listed
    kv_hidden = knobs.get("slots_kv", 1) > 1
    two_pass = bool(knobs.get("two_pass", 0)) and kind == "prefill_attention"
    # two passes shift and exponentiate in one command (``exp_sub``)
    score_ops = ("reduce_max",) + (("exp_sub",) if two_pass else ("sub", "exp")) + \
        (("alibi",) if sh["alibi"] else ()) + \
        (("exp", "rsqrt", "mul", "mul") if sh.get("softcap") else ())     # the soft-cap

    def step(m: int, masked: bool, first: bool, rowsum_mma: bool, heads: int,
             kv_cycles: float, n: int = 1) -> None:
        """``n`` live KV tiles alike for ``heads`` query heads of ``m`` rows each."""
        if n <= 0:
            return
        qk = heads * _mma(m, tt, d, spec)
        mat = qk + heads * (_mma(m, d, tt, spec) + (_mma(m, 1, tt, spec) if rowsum_mma else 0))
        vec = _vec(m, tt, spec, *score_ops) + (_vec(m, tt, spec, "mask") if masked else 0)
        if not rowsum_mma:
            vec += _vec(m, tt, spec, "reduce_sum") + (0 if first else _vec(1, m, spec, "add"))
        if not first and two_pass:     # the running max only: nothing is rescaled
            vec += _vec(1, m, spec, "max")
        elif not first:      # the running max, its correction, O and l rescaled
            vec += _vec(1, m, spec, "max", "sub", "exp", "copy", "mul") + \
                _vec(m, d, spec, "mul")
        vec *= heads
        est["mma"] += n * mat
        est["vec"] += n * vec
        est["wdma"] += n * kv_cycles
        # unpipelined, one head's MMAs wait for its softmax; the matrix unit's own work
        # still bounds the tile where the MMAs outweigh the vector passes (tiny heads pad
        # to the array's native tile)
        compute = max(mat, vec) if piped else max(mat, vec + mat / heads)
        if two_pass:         # the passes do not overlap each other: QK^T beside the max
            # (and the masks and bias), then the exponents beside the sums and P @ V;
            # their score slots are per q tile, not per KV tile: in loop order a head's
            # max waits for its QK^T, its MMAs for its exponents (as unpipelined)
            vec_max = heads * (_vec(m, tt, spec, *score_ops) - _vec(m, tt, spec, "exp_sub") +
                               (_vec(m, tt, spec, "mask") if masked else 0) +
                               (0 if first else _vec(1, m, spec, "max")))
            compute = max(qk, vec_max) + max(mat - qk, vec - vec_max) if listed else \
                max(mat, vec + mat / heads)
        est["serial"] += n * (mat + vec + kv_cycles)
        est["overlap"] += n * (max(compute, kv_cycles) if kv_hidden else compute + kv_cycles)
        if first and kv_hidden:      # the pipeline's fill: the first tile's load
            est["overlap"] += min(compute, kv_cycles)

    if kind == "prefill_attention":
        tq = max(1, min(int(knobs.get("tile_q", rows)), rows))
        pos = max(0, cap - rows)                  # measured at the bucket's last positions
        kv = 2 * tile_bytes / bw + setup * page_dmas     # K and V on their own channels
        rs = bool(knobs.get("rowsum_mma", 1))
        loaded = 0                 # two passes: the KV tiles resident for the head so far
        for q0 in range(0, rows, tq):
            m = min(tq, rows - q0)
            live = min(n_kt, -(-(pos + q0 + m) // tt))
            # the tiles the causal diagonal crosses (masked): from the first whose last
            # key is past the q tile's first row
            unmasked = min(live, max(0, (pos + q0 + 1) // tt))
            kv_step = 0.0 if two_pass else kv
            step(m, unmasked == 0, True, rs, g, kv_step)                  # tile 0
            step(m, False, False, rs, g, kv_step, unmasked - 1)
            step(m, True, False, rs, g, kv_step, live - max(1, unmasked))
            if two_pass:           # each KV tile loaded once, by its first live q tile
                new = live - loaded
                loaded = live
                est["wdma"] += new * kv
                est["serial"] += new * kv
                est["overlap"] += kv * (min(1, new) if kv_hidden else new)
            # Q in, each head's copy, the normalisation (1 / l, O * it), the output out
            io = (2 * m * g * d * 2) / bw + 2 * setup
            vec = g * (_vec(m, d, spec, "copy") + _vec(m, d, spec, "mul") +
                       _vec(1, m, spec, "rsqrt", "mul", "copy"))
            est["act"] += io
            est["vec"] += vec
            est["serial"] += io + vec
            est["overlap"] += io + vec
            if q0 == 0:      # what cannot overlap: the first tile's load and QK^T, the
                fill = kv + _mma(m, tt, d, spec) + io + vec     # first q tile's Q and out
        for k in ("mma", "vec", "wdma", "act", "serial", "overlap"):
            est[k] *= hk
    else:                    # decode: KV tiles outside, every head's pages in one DMA each
        kv = 2 * hk * tile_bytes / bw + setup * page_dmas
        step(g, True, True, False, hk, kv)          # every tile masked (valid length)
        step(g, True, False, False, hk, kv, n_kt - 1)
        io = 2 * hq * d * 2 / bw + 2 * setup
        vec = _vec(hq, d, spec, "mul") + _vec(1, hq, spec, "rsqrt", "mul", "copy")
        est["act"] += io
        est["vec"] += vec
        est["serial"] += io + vec
        est["overlap"] += io + vec
        fill = kv + _mma(g, tt, d, spec) + io + vec
    if listed:
        # list-scheduled, each unit runs ahead to its next ready op across KV tiles,
        # heads and query tiles: the busiest unit bounds it, plus what cannot overlap
        # (the first tile's load and scores, a query tile's Q in and output out; with one
        # K/V slot, every tile's load)
        busiest = max(est["mma"], est["vec"], est["wdma"] + est["act"])
        est["overlap"] = min(est["overlap"], spec.launch_cycles + busiest + fill +
                             (0 if kv_hidden else est["wdma"]))
    return est


def partition_estimate(sh: dict, cuts, spec) -> float:
    """Cycles of a run of ops cut at ``cuts``, from its shapes: every op's own work (a
    matmul's MACs or its weights' bytes, whichever takes longer; another op's constants)
    is the same under any cuts; each cut adds what crosses it through DRAM and back, and
    each kernel its launch and the set-ups of its first load and last store. What the
    cuts cost, not what they save inside a cluster (prefetch, a TCM too small for the
    joined ops: the lowering rejects those)."""
    bw = spec.dram_bytes_per_cycle
    work = sum(max(c / bw, m / spec.mma_macs_per_cycle["fp16"])
               for c, m in zip(sh["const_bytes"], sh["macs"]))
    moved = sum(2 * sh["cut_bytes"][p] for p in cuts)
    kernels = len(set(cuts) - {0, sh["ops"]}) + 1
    return work + moved / bw + kernels * (spec.launch_cycles + 2 * spec.dma_setup_cycles)


def power_estimate(est: dict, spec, profile=None) -> dict:
    """What a kernel's unit estimate (:func:`cluster_estimate`, :func:`attention_estimate`)
    draws, and the latency the governor leaves it under ``profile``'s budget.

    Energies at nominal clock, from the estimate's unit cycles and the spec's power
    model (``target/emulator/power.py``): the matrix and vector units at their
    ``power_unit_mw`` while busy; the TCM traffic of their commands (the matrix unit
    reads one native tile of ``a`` and of ``b`` per native tile's MACs; a vector pass
    reads and writes ``vector_lanes`` fp16 elements), which follows the clock; the DRAM
    bytes of the DMA cycles and the TCM side of those transfers, which do not. Average
    powers per source are over the overlapped latency ``T0``.

    Throttled at scale ``s`` the compute ``C`` (the busier unit's cycles) stretches to
    ``C / s`` and the DMAs ``D`` keep their rate, so the kernel takes ``T(s) = T0 -
    max(C, D) + max(C / s, D)`` (a bandwidth-bound kernel loses nothing until its compute
    outgrows its transfers) and draws on average ``static + (E_fixed + E_tcm + E_units *
    s ** (e - 1)) / T(s)`` (a unit's power goes as ``s ** e`` for ``1 / s`` the time);
    the governor holds the largest ``s`` at which that meets the budget, the floor when
    none does (DRAM power alone over it). A whole-kernel average: the governor sees 10 us
    windows, so a kernel with a hot phase throttles more than this says (the trees learn
    that). Keys:
    ``units_mw``, ``tcm_mw``, ``dram_mw``, ``total_mw`` (static included) at nominal
    clock, ``scale`` and ``latency`` (``T(s)``; ``T0`` without a profile)."""
    mhz = spec.clock_mhz / 1000.0                     # pJ per cycle -> mW
    t0 = max(1.0, est["overlap"])
    t_dma, t_c = est["wdma"] + est["act"], max(est["mma"], est["vec"])
    tm, tn, tk = spec.mma_tile
    native = tm * tn * tk / spec.mma_macs_per_cycle["fp16"]
    tcm_pj = (spec.tcm_read_pj_per_byte + spec.tcm_write_pj_per_byte) / 2
    units = spec.power_unit_mw
    e_units = est["mma"] * units["matrix"] + est["vec"] * units["vector"]
    e_tcm = (est["mma"] * (tm * tk + tk * tn) * 2 / native * spec.tcm_read_pj_per_byte +
             est["vec"] * spec.vector_lanes * 2 * 2 * tcm_pj) * mhz
    e_fixed = t_dma * spec.dram_bytes_per_cycle * \
        (spec.dram_pj_per_byte + spec.tcm_write_pj_per_byte) * mhz
    out = dict(units_mw=e_units / t0, tcm_mw=e_tcm / t0, dram_mw=e_fixed / t0,
               total_mw=spec.power_static_mw + (e_units + e_tcm + e_fixed) / t0,
               scale=1.0, latency=t0)
    if profile is None:
        return out
    e = profile.dvfs_exponent

    def latency(s: float) -> float:
        return t0 - max(t_c, t_dma) + max(t_c / s, t_dma)

    def fits(s: float) -> bool:
        drawn = (e_fixed + e_tcm + e_units * s ** (e - 1)) / latency(s)
        return spec.power_static_mw + drawn <= profile.budget_mw

    s = largest_scale(fits, tol=1e-4)       # the draw grows with s
    if s < 1.0:
        out.update(scale=s, latency=latency(s))
    return out


def _estimate(task, knobs: dict, spec) -> dict | None:
    """The unit estimate of ``knobs`` for a task that has one (a cluster with matmuls, an
    attention kernel), else None."""
    if task.kind == "cluster" and task.shape.get("matmuls"):
        return cluster_estimate(task.shape, knobs, spec)
    if task.kind in ("prefill_attention", "decode_attention"):
        return attention_estimate(task.kind, task.shape, knobs, spec)
    return None


def prior(task, knobs: dict, spec, est: dict | None = None, profile=None) -> float:
    """The analytic prior of ``log(cycles / default cycles)``: the same ratio of the
    latency :func:`power_estimate` leaves :func:`cluster_estimate`'s or
    :func:`attention_estimate`'s overlapped latency under ``profile``'s budget (``est``:
    that unit estimate of ``knobs`` when the caller has it; without a profile, or within
    the budget, the overlapped latency itself), or for a run's cuts of
    :func:`partition_estimate` (0 where there is no estimate)."""
    if task.kind == "partition":
        base = partition_estimate(task.shape, task.default_knobs["cuts"], spec)
        cost = partition_estimate(task.shape, knobs["cuts"], spec)
    else:
        default = _estimate(task, task.default_knobs, spec)
        if default is None:
            return 0.0
        base = power_estimate(default, spec, profile)["latency"]
        cost = power_estimate(est or _estimate(task, knobs, spec), spec, profile)["latency"]
    return math.log(max(1.0, cost) / max(1.0, base))


def features(task, knobs: dict, spec, profile=None) -> np.ndarray:
    """The feature row of ``knobs`` for ``task`` (:data:`FEATURES`), under power profile
    ``profile`` (a :class:`~edgetvm.target.spec.PowerProfile`; None: no budget)."""
    f = dict.fromkeys(FEATURES, 0.0)
    f[f"kind_{task.kind}"] = 1.0
    sh = task.shape
    rows = sh.get("rows", 1)
    f["log_rows"] = _l(rows)
    if task.kind == "cluster":
        tm = knobs.get("tile_m", rows)
        tiles = math.ceil(rows / tm)
        f["log_tile_m"], f["row_tiles"], f["tile_m_frac"] = _l(tm), tiles, tm / rows
        if "tile_n" in knobs:
            cols = max(b for b in sh["row_bytes"].values()) // 2 // max(1, rows)
            f["tile_n_frac"] = knobs["tile_n"] / max(1, cols)
        act = sum(sh["row_bytes"].values())
        slots_in = knobs.get("slots_in", 1)
        si = np.mean(list(slots_in.values())) if isinstance(slots_in, dict) and slots_in \
            else float(slots_in if not isinstance(slots_in, dict) else 1)
        so = knobs.get("slots_out", 1)
        tcm = act / tiles * si + so * act / tiles
        w_bytes = w_dram = dma = macs = w_tiles = 0.0
        sw = sc = tnf = tkf = 0.0
        mm = knobs.get("matmul", {})
        rw = int(knobs.get("resident_w", KNOBS_SINCE["resident_w"]))
        loads = 1 if rw else tiles                # how often the weights cross the bus
        for i, (stage, (n, k, group)) in enumerate(sorted(sh["matmuls"].items())):
            kn = mm.get(stage, {})
            tn, tk = kn.get("tile_n", n), kn.get("tile_k", k)
            per_w = 0.5 if group else 2.0
            wb = _weight_bytes(n, k, group)
            w_bytes += wb
            w_dram += wb * loads                      # weights re-read per row tile
            nt = math.ceil(n / tn) * math.ceil(k / tk)
            w_tiles += nt * tiles
            dma += (1 if rw else nt * tiles) * _weight_dmas(group)
            macs += rows * n * k
            tcm += (wb if rw else kn.get("slots_w", 1) * tn * tk * per_w) + \
                kn.get("slots_c", 1) * tm * tn * 4
            if i < 4:       # the knobs themselves, per matmul in stage order
                f.update({f"mm{i}_log_tile_n": _l(tn), f"mm{i}_log_tile_k": _l(tk),
                          f"mm{i}_tile_n_frac": tn / n, f"mm{i}_tile_k_frac": tk / k,
                          f"mm{i}_slots_w": kn.get("slots_w", 1),
                          f"mm{i}_slots_c": kn.get("slots_c", 1)})
            sw += kn.get("slots_w", 1)
            sc += kn.get("slots_c", 1)
            tnf += tn / n
            tkf += tk / k
        nm = max(1, len(sh["matmuls"]))
        dma += tiles * (len(sh["row_bytes"]) + 1)
        dram = act + w_dram + rows * 2
        f.update(log_act_bytes=_l(act), log_weight_bytes=_l(w_bytes), log_weight_dram=_l(w_dram),
                 weight_rereads=loads if w_bytes else 0.0, log_dma_count=_l(dma),
                 log_mean_dma=_l(dram / max(1.0, dma)), log_tcm=_l(tcm),
                 tcm_frac=tcm / spec.tcm_bytes, log_macs=_l(macs),
                 log_intensity=_l(macs / max(1.0, dram)), log_w_tiles=_l(w_tiles),
                 mean_tn_frac=tnf / nm, mean_tk_frac=tkf / nm, slots_in=si, slots_out=so,
                 slots_w=sw / nm, slots_c=sc / nm, dma_split=knobs.get("dma_split", 0),
                 tcm_fresh=knobs.get("tcm_fresh", KNOBS_SINCE["tcm_fresh"]),
                 list_schedule=knobs.get("list_schedule", KNOBS_SINCE["list_schedule"]),
                 resident_w=rw, matmuls=len(sh["matmuls"]), w4=float(any(sh["quant"])))
        if sh["matmuls"]:
            est = cluster_estimate(sh, knobs, spec)
            f.update(_estimate_features(est, spec, profile))
            f["prior"] = prior(task, knobs, spec, est, profile)
    elif task.kind == "partition":
        # a run's cuts: activation bytes the cuts send through DRAM and back, how many
        # kernels (start-ups, pipeline fills), the largest cluster's weights against the
        # TCM (a cluster near it leaves no room to prefetch or double-buffer)
        bounds = [0] + list(knobs["cuts"]) + [sh["ops"]]
        spans = list(zip(bounds, bounds[1:]))
        w = [sum(sh["const_bytes"][a:b]) for a, b in spans]
        cut = sum(sh["cut_bytes"][p] for p in knobs["cuts"])
        f.update(clusters=len(spans), log_cut_bytes=_l(cut),
                 max_cluster_ops=max(b - a for a, b in spans),
                 max_cluster_w_frac=max(w) / spec.tcm_bytes,
                 mm_clusters=sum(any(sh["matmul"][a:b]) for a, b in spans),
                 log_weight_bytes=_l(sum(w)), log_act_bytes=_l(cut),
                 matmuls=sum(sh["matmul"]), prior=prior(task, knobs, spec, profile=profile))
    elif task.kind == "embedding":
        tm = knobs["tile_m"]
        tiles = math.ceil(rows / tm)
        act = rows * sh["hidden"] * 2
        f.update(log_tile_m=_l(tm), row_tiles=tiles, log_act_bytes=_l(act),
                 log_dma_count=_l(rows + tiles), log_mean_dma=_l(act / (rows + tiles)),
                 log_tcm=_l(knobs["slots_out"] * tm * sh["hidden"] * 2),
                 tcm_frac=knobs["slots_out"] * tm * sh["hidden"] * 2 / spec.tcm_bytes,
                 slots_out=knobs["slots_out"], dma_split=knobs["dma_split"])
    else:
        cap, hd, hk, hq = sh["capacity"], sh["head_dim"], sh["kv_heads"], sh["q_heads"]
        tq = knobs.get("tile_q", 1)
        tkv = knobs["tile_kv"]
        q_tiles = math.ceil(rows / tq)
        kv_tiles = math.ceil(cap / tkv)
        kv_bytes = 2 * cap * hk * hd * 2
        if knobs.get("two_pass"):
            # one KV head's K and V over the cache, the q tile's scores for its query heads
            # over the cache; every KV tile loaded once
            tcm = two_pass_bytes(tq, cap, max(1, hq // hk), hd, slots_kv=knobs["slots_kv"],
                                 slots_s=knobs["slots_s"])
            loads = 1
        else:
            tcm = knobs["slots_kv"] * 2 * tkv * hk * hd * 2 + knobs["slots_s"] * tq * tkv * hq * 4
            loads = q_tiles
        macs = 2 * rows * cap * hq * hd
        dram = kv_bytes * loads + rows * hq * hd * 4
        # a page DMA per KV head (prefill), or one per page for all heads (decode)
        dma = 2 * loads * kv_tiles * max(1, tkv // 16) * (hk if "tile_q" in knobs else 1)
        f.update(log_tile_q=_l(tq), log_tile_kv=_l(tkv), kv_tiles=kv_tiles,
                 row_tiles=q_tiles, log_act_bytes=_l(rows * hq * hd * 2),
                 log_weight_dram=_l(kv_bytes * loads), log_dma_count=_l(dma),
                 log_mean_dma=_l(dram / max(1, dma)), log_tcm=_l(tcm),
                 tcm_frac=tcm / spec.tcm_bytes, log_macs=_l(macs),
                 log_intensity=_l(macs / max(1, dram)), slots_kv=knobs["slots_kv"],
                 slots_s=knobs["slots_s"],
                 rowsum_mma=knobs.get("rowsum_mma", 1) if "tile_q" in knobs else 0,
                 two_pass=knobs.get("two_pass", 0),
                 list_schedule=knobs.get("list_schedule", 0))
        est = attention_estimate(task.kind, sh, knobs, spec)
        f.update(_estimate_features(est, spec, profile))
        f["prior"] = prior(task, knobs, spec, est, profile)
    return np.array([f[k] for k in FEATURES], dtype=np.float32)


def _estimate_features(est: dict, spec, profile) -> dict:
    """The unit estimate's cycles (log) and its power per source (matrix and vector
    units, their TCM traffic, DRAM) as shares of the budget, the clock and latency the
    governor would leave it (:func:`power_estimate`)."""
    pw = power_estimate(est, spec, profile)
    budget = profile.budget_mw if profile is not None else spec.power_static_mw + \
        sum(v for k, v in spec.power_unit_mw.items() if k != "host")
    f = {f"log_est_{k}": _l(v) for k, v in est.items()}
    f.update({f"pw_{k}": pw[f"{k}_mw"] / budget for k in ("units", "tcm", "dram", "total")})
    f.update(est_scale=pw["scale"], log_est_throttled=_l(pw["latency"]))
    return f


class CostModel:
    """XGBoost regressor of ``log(cycles / task default cycles)``, refit as measurements
    arrive, boosted from the analytic prior (the ``prior`` feature is each row's base
    margin: the trees learn what the estimate misses); :meth:`rank` orders candidates by
    predicted latency (best first), by the prior alone until the model has data."""

    def __init__(self, seed: int = 0, min_samples: int = 8):
        self.seed = seed
        self.min_samples = min_samples
        self.X: list = []
        self.y: list = []
        self._booster = None
        self._fitted_on = 0

    def add(self, x: np.ndarray, cycles: int, default_cycles: int) -> None:
        self.X.append(x)
        self.y.append(math.log(cycles / default_cycles))

    @property
    def trained(self) -> bool:
        return self._booster is not None

    @staticmethod
    def _matrix(X: np.ndarray, y=None):
        import xgboost as xgb
        return xgb.DMatrix(X, label=y, base_margin=X[:, PRIOR], feature_names=list(FEATURES))

    def fit(self) -> None:
        if len(self.y) < self.min_samples or len(self.y) == self._fitted_on:
            return
        import xgboost as xgb
        d = self._matrix(np.stack(self.X), np.asarray(self.y, np.float32))
        params = dict(max_depth=6, eta=0.2, min_child_weight=1, subsample=1.0,
                      objective="reg:squarederror", nthread=1, seed=self.seed, verbosity=0)
        self._booster = xgb.train(params, d, num_boost_round=60)
        self._fitted_on = len(self.y)

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Predicted ``log(cycles / default cycles)`` per row (the prior while untrained)."""
        if self._booster is None:
            return X[:, PRIOR].astype(np.float64)
        return self._booster.predict(self._matrix(X))

    def rank(self, X: np.ndarray) -> np.ndarray:
        """Indices of the rows of ``X`` by predicted latency, best first."""
        return np.argsort(self.predict(X), kind="stable")
