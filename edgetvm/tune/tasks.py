"""Tuning tasks: the distinct kernels of a model's phase programs and their knob spaces.

A **task** is one structural kernel key (:attr:`~edgetvm.build.kernels.Kernel.key`): the
30 layers of a model share one task per distinct cluster shape, and a shape that occurs
in several phase programs (a decode MLP serves every KV capacity) is one task. Its
weight is how often the kernel runs over the selected phase programs times its measured
default latency, its share of the summed step latency.

A **candidate** is a knob set of the task's template, in the keyword form the template
takes (what :class:`~edgetvm.build.kernels.KernelBuilder` lowers and the log stores).
The space of a fusion cluster is read from its template's sampling instructions
(``SampleCategorical``, :func:`~edgetvm.tir_schedules.search.knob_space`): row tile,
column tile of elementwise clusters, buffering slots per streamed input and output, the
DMA split and, per matmul stage, its output and reduction tiles, weight and
accumulator slots. Attention: query and KV tiles, KV and score slots. Embedding: row
tile, output slots, DMA split. KV appends have no knobs and are not tasks.

A **partition task** (:class:`PartitionTask`) is the cuts of one run of fusable ops
(:mod:`edgetvm.build.cuts`: the row-local ops between two template kernels, a layer's tail
and the next layer's head): one 0/1 knob per position that may be cut, the compiler's
cuts as its default. Its candidate is the run's clusters, each with its tuned knobs from
the log where it has some, else its default knobs.

A candidate is measured **in context** (:func:`~edgetvm.build.measure.measure_in_context`):
linked between the kernels before and after the task's first occurrence, with their
default knobs and the linker's cross-kernel prefetch, less those two neighbours linked
alone. :attr:`Task.context` names that context (the neighbours' keys and
:data:`DEFAULTS_REVISION`); records measured in another one are not compared with it.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field

import numpy as np

from edgetvm.build.cuts import cuts_of, forced_cuts, groups_of, joinable, run_key, runs
from edgetvm.build.graph import BuildError
from edgetvm.build.kernels import (attention_kind, cluster_key, cluster_matmuls, cluster_rows,
                                   stage_cluster)
from edgetvm.errors import CandidateRejected
from edgetvm.npu_regions import default_knobs
from edgetvm.tir_schedules.attention import KNOBS_SINCE as ATTENTION_KNOBS_SINCE
from edgetvm.tir_schedules.attention import kv_tile_candidates
from edgetvm.tir_schedules.common import new_schedule, tile_candidates
from edgetvm.tir_schedules.fused import KNOBS_SINCE, ROW_TILES, knob_names, schedule_cluster
from edgetvm.tir_schedules.search import knob_space

from .log import canonical_knobs, workload_hash

log = logging.getLogger("edgetvm")

#: what the build's default knobs lower to, part of every measuring context: kernels are
#: measured between neighbours at their defaults, and a cut set with its untuned clusters
#: at theirs, so a record measured with other defaults is another measurement.
#: 2: default clusters take the order their lowering's plan estimates faster
#: (``LIST_SCHEDULE_AUTO``); 1 (the hash without a revision): the loop nest's order
DEFAULTS_REVISION = 2


@dataclass
class Task:
    key: str                     # the kernel's structural key
    kind: str                    # cluster | decode_attention | prefill_attention | embedding
    name: str
    graph: object                # a representative instance: the first occurrence
    group: tuple
    per_program: dict = field(default_factory=dict)  # program name -> occurrences
    space: dict = field(default_factory=dict)     # flat knob name -> candidate values
    default_knobs: dict = field(default_factory=dict)
    shape: dict = field(default_factory=dict)     # what the cost features need
    before: tuple | None = None  # the op groups of the neighbouring kernels in ``graph``
    after: tuple | None = None
    context: str = ""            # the measuring context: hash of the neighbours' keys

    def context_kernels(self, mc) -> tuple:
        """(before, after) kernels with their default knobs (None at a phase's ends)."""
        cons = self.graph.consumers()
        return tuple(None if grp is None else mc.kernels.kernel(self.graph, list(grp), cons)
                     for grp in (self.before, self.after))

    def set_context(self, mc) -> None:
        """:attr:`context`: the hash of the neighbouring kernels' keys and the defaults'
        revision."""
        self.context = workload_hash("|".join(
            "" if nk is None else nk.key for nk in self.context_kernels(mc))
            + f"|defaults {DEFAULTS_REVISION}")[:16]

    def occurs_in(self, key) -> None:
        """Count one occurrence in the phase program ``key`` ((phase, rows, pages))."""
        name = f"{key[0]}_{key[1]}x{key[2]}p"
        self.per_program[name] = self.per_program.get(name, 0) + 1

    @property
    def count(self) -> int:
        """How often the kernel runs over the selected programs."""
        return sum(self.per_program.values())

    @property
    def phases(self) -> set:
        """The names of the programs it runs in."""
        return set(self.per_program)

    @property
    def per_phase(self) -> dict:
        """Phase (prefill, decode) -> occurrences."""
        out: dict = {}
        for name, n in self.per_program.items():
            ph = name.split("_", 1)[0]
            out[ph] = out.get(ph, 0) + n
        return out

    @property
    def label(self) -> str:
        """The kernel and its shape, for people: ``mlp m=1 1536x576,1536x576,576x1536``."""
        sh = self.shape
        if self.kind == "cluster":
            mm = ",".join(f"{n}x{k}" for n, k, _ in sh["matmuls"].values())
            return f"{self.name} m={sh['rows']}" + (f" {mm}" if mm else "")
        if self.kind == "embedding":
            return f"embedding m={sh['rows']}"
        return f"{self.kind} q={sh['rows']} kv={sh['capacity']}"

    def tile_ops(self, knobs: dict) -> int:
        """Tile operations the knobs make the kernel issue, from the shapes (no lowering):
        row tiles x (weight tiles per matmul + column tiles per elementwise stage);
        query tiles x KV tiles x heads; embedding row tiles. What the tuner compares with
        the defaults' count to leave out command streams that take minutes to lower."""
        sh = self.shape
        rows = sh["rows"]
        if self.kind == "cluster":
            row_tiles = -(-rows // knobs.get("tile_m", rows))
            mm = knobs.get("matmul", {})
            w = sum(-(-n // mm.get(st, {}).get("tile_n", n)) *
                    -(-k // mm.get(st, {}).get("tile_k", k))
                    for st, (n, k, _) in sh["matmuls"].items())
            cols = max(sh["row_bytes"].values()) // 2 // max(1, rows)
            col_tiles = -(-cols // knobs["tile_n"]) if knobs.get("tile_n") else 1
            return row_tiles * (w + sh["stages"] * col_tiles)
        if self.kind == "embedding":
            return -(-rows // knobs["tile_m"])
        return -(-rows // knobs.get("tile_q", 1)) * -(-sh["capacity"] // knobs["tile_kv"]) * \
            sh["q_heads"]

    @property
    def size_hint(self) -> int:
        """Bytes the kernel must touch at least, from its shapes (no measurement): what
        orders the baselines, the largest first, before any cycles are known."""
        sh = self.shape
        if self.kind == "cluster":
            return int(sh["const_bytes"] + sum(sh["row_bytes"].values()))
        if self.kind == "embedding":
            return int(sh["rows"] * sh["hidden"] * 2)
        return int(2 * sh["capacity"] * sh["kv_heads"] * sh["head_dim"] * 2 +
                   2 * sh["rows"] * sh["q_heads"] * sh["head_dim"] * 2)

    @property
    def workload(self) -> str:
        return workload_hash(self.key)

    @property
    def space_size(self) -> int:
        return int(np.prod([len(v) for v in self.space.values()])) if self.space else 1

    # -- the knob space --------------------------------------------------------------------
    def to_knobs(self, point: dict) -> dict:
        """A flat point of :attr:`space` in the template's keyword form. Resident weights
        have no weight-tile copies: their ``slots_w`` is written as 1, so that points
        differing only there are one knob set (measured once)."""
        if self.kind != "cluster":
            return dict(point)
        knobs: dict = {"slots_in": {}, "matmul": {}}
        for name, v in point.items():
            if "." in name:
                stage, k = name.split(".", 1)
                knobs["matmul"].setdefault(stage, {})[k] = int(v)
            elif name.startswith("slots_") and name not in ("slots_out",):
                knobs["slots_in"][name[len("slots_"):]] = int(v)
            else:
                knobs[name] = int(v)
        if knobs.get("resident_w"):
            for kn in knobs["matmul"].values():
                kn["slots_w"] = 1
        return knobs

    def flatten(self, knobs: dict) -> dict:
        """The flat form (names of :attr:`space`) of a knob set."""
        if self.kind != "cluster":
            return {k: knobs.get(k, ATTENTION_KNOBS_SINCE.get(k)) for k in self.space}
        return flat_cluster_knobs(self.space, knobs)

    def to_point(self, knobs: dict) -> dict | None:
        """The flat point of a knob set, or None when it is not in :attr:`space`."""
        point = self.flatten(knobs)
        if any(point[k] not in vals for k, vals in self.space.items()):
            return None
        return point

    def include(self, knobs: dict) -> None:
        """Widen :attr:`space` to hold ``knobs`` (the defaults may pick a value the
        template's candidate lists lack, e.g. a 512-row tile)."""
        for k, v in self.flatten(knobs).items():
            if v is not None and v not in self.space[k]:
                self.space[k] = sorted(self.space[k] + [int(v)])

    def sample(self, rng: random.Random, n: int, seen: set) -> list:
        """Up to ``n`` distinct unseen points (canonical knob text not in ``seen``)."""
        names = list(self.space)
        if self.space_size <= 4 * n:
            pts = [dict(zip(names, vals)) for vals in itertools.product(*self.space.values())]
            rng.shuffle(pts)
        else:
            pts = [{k: rng.choice(v) for k, v in self.space.items()} for _ in range(2 * n)]
        out, keys = [], set()
        for p in pts:
            k = canonical_knobs(self.to_knobs(p))
            if k not in seen and k not in keys:
                keys.add(k)
                out.append(p)
                if len(out) == n:
                    break
        return out

    def seeds(self) -> list:
        """Points measured before the model's picks: a cluster's default knob ladder (one
        set per row tile, largest first, as the build tries them until one fits the TCM)
        in either order. The defaults are the ladder's first rung that fits; a smaller row
        tile reads the weights more often but, list-scheduled, runs one tile's vector
        stages under the next one's projections, and one-knob moves from the defaults
        rarely reach it: a row tile pays off with the other order and other matmul tiles
        at once (SmolLM2's W4A16 prefill-512 layer: 128-row tiles list-scheduled, 0.951 M
        cycles, found by these seeds; 1.005 M the best of the tuning runs before them).
        List-scheduled rungs of several row tiles come once more with their weights
        resident (``resident_w``), which takes the re-reads away from small row tiles."""
        if self.kind != "cluster" or "matmuls" not in self.shape:
            return []
        out, keys = [], set()
        rows = self.shape["rows"]
        for kn in default_knobs(rows, self.shape["matmuls"]):
            for ls in self.space.get("list_schedule", (KNOBS_SINCE["list_schedule"],)):
                # list-scheduled with several row tiles, each rung also with its weights
                # resident (read once, not once per row tile)
                resident = [KNOBS_SINCE["resident_w"]] + (
                    [1] if ls and kn["tile_m"] < rows and
                    1 in self.space.get("resident_w", ()) else [])
                for rw in resident:
                    # a rung's value the space lacks (a tile_k of 80 where the space has
                    # 64 and 160) becomes the space's largest value below it
                    rung = self.flatten({**kn, "list_schedule": ls, "resident_w": rw})
                    snapped = {k: _snap(v, self.space[k]) for k, v in rung.items()}
                    p = self.flatten(self.to_knobs(snapped))   # resident: slots_w as 1
                    key = tuple(sorted(p.items()))
                    if key not in keys:
                        keys.add(key)
                        out.append(p)
        return out

    def neighbours(self, point: dict) -> list:
        """Points one knob away from ``point``."""
        out = []
        for name, vals in self.space.items():
            for v in vals:
                if v != point[name]:
                    out.append({**point, name: v})
        return out


def _snap(v, values: list):
    """``v`` if it is one of ``values``, else the largest below it (the smallest if none
    is; a knob the set does not give: the first of the space's values)."""
    if v in values:
        return v
    if v is None:
        return values[0]
    below = [x for x in values if x < v]
    return max(below) if below else min(values)


def flat_cluster_knobs(space: dict, knobs: dict) -> dict:
    """A fusion cluster's knob set (``matmul`` per stage, ``slots_in`` one value or per
    input) in the flat form of its space's names (``s0.tile_n``, ``slots_t0``, ...)."""
    point = {}
    for name in space:
        if "." in name:
            stage, k = name.split(".", 1)
            point[name] = knobs.get("matmul", {}).get(stage, {}).get(k)
        elif name.startswith("slots_") and name != "slots_out":
            s = knobs.get("slots_in")
            point[name] = s.get(name[len("slots_"):]) if isinstance(s, dict) else s
        else:
            point[name] = knobs.get(name, KNOBS_SINCE.get(name))
    return point


def cluster_space(cluster) -> tuple:
    """(flat knob space, shape facts) of a fusion cluster, read from its template."""
    func = cluster.prim_func()
    names = knob_names(func)
    probe = new_schedule(func, seed=1)
    schedule_cluster(probe, tcm_fresh=None, list_schedule=None, resident_w=None)
    space = knob_space(probe, names)
    matmuls = cluster_matmuls(cluster)
    shape = dict(rows=cluster_rows(cluster), matmuls=matmuls,
                 quant=[st.op == "linear_w4a16" for st in cluster.stages
                        if st.op.startswith("linear")],
                 stages=len(cluster.stages),
                 row_bytes={n: int(np.prod(s)) * 2 for n, (s, d) in cluster.tensors.items()
                            if n not in cluster.consts},
                 const_bytes=sum(int(np.prod(s)) * np.dtype(d).itemsize
                                 for n, (s, d) in cluster.tensors.items()
                                 if n in cluster.consts),
                 out_bytes=0, row_stages=_row_stages(cluster))
    return space, shape


def _row_stages(cluster) -> list:
    """(op, columns of its result) of each stage of ``cluster`` that is not a matmul: the
    vector unit's own work per row (the cost model's prior)."""
    env = cluster._graph()
    return [(st.op, int(env[st.output].shape[-1])) for st in cluster.stages
            if not st.op.startswith("linear")]


def template_space(kind: str, graph, op, layout) -> tuple:
    """(flat knob space, shape facts) of an attention or embedding kernel."""
    if kind == "embedding":
        rows = op.outputs["out"].shape[0]
        space = dict(tile_m=tile_candidates(rows, ROW_TILES), slots_out=[1, 2],
                     dma_split=[0, 1])
        return space, dict(rows=rows, hidden=op.attrs["hidden"])
    cap = graph.pages * layout.page_tokens
    space = {}
    if kind == "prefill_attention":
        space["tile_q"] = tile_candidates(graph.rows, (8, 16, 32, 64, 128))
    space.update(tile_kv=kv_tile_candidates(layout.page_tokens, cap), slots_kv=[1, 2],
                 slots_s=[1, 2])
    if kind == "prefill_attention":
        space["rowsum_mma"] = [0, 1]
        space["two_pass"] = [0, 1]
    space["list_schedule"] = [0, 1]
    rows = graph.rows if kind == "prefill_attention" else 1       # the queries
    return space, dict(rows=rows, capacity=cap, q_heads=op.attrs["q_heads"],
                       kv_heads=layout.kv_heads, head_dim=layout.head_dim,
                       page_tokens=layout.page_tokens, alibi=bool(op.attrs.get("alibi")),
                       **({"softcap": True} if op.attrs.get("softcap") else {}))


def extract_tasks(mc, keys, strategy: str | None = None) -> list:
    """The tasks of compiler ``mc``'s phase programs ``keys`` ((phase, rows, pages)), in
    order of first occurrence."""
    tasks: dict = {}
    for key in keys:
        g = mc.graph(*key)
        consumers = g.consumers()
        groups = mc.partition(g, strategy)
        for i, group in enumerate(groups):
            op = g.ops[group[0]]
            if op.kind in ("kv_append", "host"):           # nothing to tune
                continue
            k = mc.kernels.kernel(g, group, consumers)      # default knobs
            t = tasks.get(k.key)
            if t is None:
                if op.kind == "stage":
                    cluster, _ = stage_cluster(g, group, consumers)
                    kind, (space, shape) = "cluster", cluster_space(cluster)
                elif op.kind == "attention":
                    kind = attention_kind(g, op)
                    space, shape = template_space(kind, g, op, mc.layout)
                elif op.kind == "embedding":
                    kind = "embedding"
                    space, shape = template_space(kind, g, op, mc.layout)
                else:
                    raise BuildError(f"op {op.name}: no tuning template for {op.kind}")
                before = tuple(groups[i - 1]) if i > 0 else None
                after = tuple(groups[i + 1]) if i + 1 < len(groups) else None
                t = tasks[k.key] = Task(k.key, kind, k.name, g, tuple(group), space=space,
                                        default_knobs=dict(k.knobs), shape=shape,
                                        before=before, after=after)
                t.set_context(mc)
                t.include(t.default_knobs)
                # the defaults in the space's own form, so that the search never measures
                # them again under another spelling (slots_in 2 vs {"t0": 2})
                t.default_knobs = t.to_knobs(t.to_point(t.default_knobs))
            t.occurs_in(key)
    return list(tasks.values())


@dataclass
class PartitionTask(Task):
    """The cuts of one run of fusable ops (:mod:`edgetvm.build.cuts`): which kernel
    boundaries it has. A point is one 0/1 knob per position that may be cut (``cut_P``);
    its knobs are ``{"cuts": [P, ...]}`` with the forced cuts included. A candidate is the
    run's clusters (each with its :attr:`tiles` or default knobs) linked between the
    kernels before and after the run, measured in context as a kernel is; joins that may
    not share a kernel are never proposed, and clusters over the TCM are rejected when
    lowered."""

    forced: tuple = ()
    #: op group (a contiguous span of the run) -> the tuned knobs its cluster is lowered
    #: with (from the log, :func:`extract_partition_tasks`; only where they are not the
    #: defaults); others get the default knobs
    tiles: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        sh = self.shape
        return f"cuts of {sh['ops']} ops m={sh['rows']} {self.name}"

    def set_context(self, mc) -> None:
        """The neighbours' keys and the tuned knobs its clusters are lowered with: cuts
        measured with other tiles are another measurement (a resumed or second cut stage
        after a tile stage measures again, never compares with the default-tile ones)."""
        super().set_context(mc)
        if self.tiles:
            tiles = sorted((list(g), canonical_knobs(k)) for g, k in self.tiles.items())
            self.context = workload_hash(f"{self.context}|tiles {tiles!r}")[:16]

    def tiles_of(self, group) -> dict | None:
        """The knobs the cluster of ``group`` is lowered with (None: the defaults)."""
        return self.tiles.get(tuple(group))

    def tile_ops(self, knobs: dict) -> int:
        return 0                       # no tile knobs of its own

    @property
    def size_hint(self) -> int:
        return int(sum(self.shape["const_bytes"]) + sum(self.shape["cut_bytes"]))

    def to_knobs(self, point: dict) -> dict:
        free = [int(k[len("cut_"):]) for k, v in point.items() if v]
        return {"cuts": sorted(set(self.forced) | set(free))}

    def flatten(self, knobs: dict) -> dict:
        cuts = {int(p) for p in knobs.get("cuts", ())}
        return {k: int(int(k[len("cut_"):]) in cuts) for k in self.space}

    def groups(self, knobs: dict) -> list:
        return groups_of(list(self.group), knobs["cuts"])

    def valid(self, point: dict) -> bool:
        return all(joinable(self.graph, g) for g in self.groups(self.to_knobs(point)))

    def sample(self, rng: random.Random, n: int, seen: set) -> list:
        out = [p for p in super().sample(rng, 4 * n, seen) if self.valid(p)]
        return out[:n]

    def neighbours(self, point: dict) -> list:
        return [p for p in super().neighbours(point) if self.valid(p)]


def extract_partition_tasks(mc, keys, knobs_for=None) -> list:
    """One :class:`PartitionTask` per distinct run of fusable ops (two ops or more, with a
    position that may be cut or not) of compiler ``mc``'s phase programs ``keys``; its
    default cuts are those of the compiler's partition (its strategy's, or the cuts it
    replays: a later cut stage starts from the cuts the earlier one chose).

    ``knobs_for`` (kernel key -> knobs or None, e.g. a :class:`~edgetvm.tune.log.Replay`):
    the tuned knobs of clusters; a candidate lowers each of its clusters that has some
    with them (:attr:`PartitionTask.tiles`), so that the cuts are chosen on tuned kernels,
    not on default ones: cut points and tiles, searched in turns, are one search."""
    tasks: dict = {}
    fixed: set = set()                 # runs with no choice
    for key in keys:
        g = mc.graph(*key)
        consumers = g.consumers()
        groups = mc.partition(g)
        start = {grp[0]: n for n, grp in enumerate(groups)}
        end = {grp[-1]: n for n, grp in enumerate(groups)}
        for run in runs(g):
            if len(run) < 2:
                continue
            rk = run_key(g, run, consumers)
            if rk in fixed:
                continue
            t = tasks.get(rk)
            if t is None:
                default = cuts_of(run, groups)
                # forced: the two ops may not join, or do not lower, as a pair (a cluster
                # holding both has the same refusal or a larger footprint); a strategy's
                # own join stays open
                forced = set(forced_cuts(g, run)) | {
                    p for p in range(1, len(run))
                    if not mc.fits(g, [run[p - 1], run[p]])}
                forced = sorted(p for p in forced if p in default)
                free = sorted(set(range(1, len(run))) - set(forced))
                if not free:
                    fixed.add(rk)
                    continue
                a, b = start[run[0]], end[run[-1]]
                t = tasks[rk] = PartitionTask(
                    rk, "partition", "+".join(g.ops[i].stage.op for i in run), g,
                    tuple(run), space={f"cut_{p}": [0, 1] for p in free},
                    default_knobs={"cuts": default}, shape=_run_shape(g, run),
                    before=tuple(groups[a - 1]) if a > 0 else None,
                    after=tuple(groups[b + 1]) if b + 1 < len(groups) else None,
                    forced=tuple(forced),
                    tiles=_tuned_spans(mc, g, run, consumers, knobs_for))
                t.set_context(mc)
            t.occurs_in(key)
    return list(tasks.values())


def _tuned_spans(mc, graph, run, consumers, knobs_for) -> dict:
    """Contiguous op spans of ``run`` (as tuples) -> ``knobs_for`` their cluster's key,
    where it has knobs other than the defaults."""
    if knobs_for is None:
        return {}
    out: dict = {}
    for a in range(len(run)):
        for b in range(a + 1, len(run) + 1):
            span = tuple(run[a:b])
            try:
                cluster, _ = stage_cluster(graph, span, consumers)
            except BuildError:
                continue
            knobs = knobs_for(cluster_key(cluster))
            if knobs is None:
                continue
            # compared in the space's flat form (slots_in 2 is {"t0": 2})
            space = cluster_space(cluster)[0]
            try:
                default = mc.kernels.kernel(graph, list(span), consumers).knobs
            except (BuildError, CandidateRejected):
                default = None           # the defaults do not lower: the logged knobs do
            if default is None or \
                    flat_cluster_knobs(space, knobs) != flat_cluster_knobs(space, default):
                out[span] = knobs
    return out


def _run_shape(graph, run) -> dict:
    """What the cost features of a run's cuts need: per position the bytes a cut there
    sends through DRAM (results of the ops before it read by the ops after it), per op
    its constant (weight) bytes and whether it is a matmul."""
    pos = {i: n for n, i in enumerate(run)}
    made: dict = {}
    for i in run:
        for v in graph.ops[i].outputs.values():
            made.setdefault(v.tensor, pos[i])
    last_read: dict = {}
    for i in run:
        for v in graph.ops[i].inputs.values():
            if v.tensor in made:
                last_read[v.tensor] = max(last_read.get(v.tensor, 0), pos[i])
    cut_bytes = [0] * (len(run) + 1)
    for t, a in made.items():
        b = last_read.get(t)
        if b is None:
            continue
        nbytes = int(np.prod(graph.tensors[t].shape)) * np.dtype(graph.tensors[t].dtype).itemsize
        for p in range(a + 1, b + 1):
            cut_bytes[p] += nbytes
    const, macs = [], []
    rows = graph.ops[run[0]].rows
    for i in run:
        consts = [graph.tensors[v.tensor] for v in graph.ops[i].inputs.values()
                  if graph.tensors[v.tensor].kind == "const"]
        const.append(sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize
                         for c in consts))
        w = consts[0] if consts and graph.ops[i].stage.op.startswith("linear") else None
        # a linear's weight is (N, K), or (N, K / 2) packed 4-bit
        macs.append(0 if w is None else
                    rows * int(w.shape[0]) * int(w.shape[1]) * (2 if w.dtype == "uint8" else 1))
    return dict(rows=rows, ops=len(run), cut_bytes=cut_bytes, const_bytes=const, macs=macs,
                matmul=[graph.ops[i].stage.op.startswith("linear") for i in run])
