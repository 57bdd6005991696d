"""The kernels of a phase: a partition's op groups, lowered to position-independent programs.

A group of stage ops becomes one :class:`~edgetvm.tir_schedules.fused.FusionCluster`:
inputs that another op of the group writes whole stay in TCM, every other input is a
kernel parameter, and results read outside the group (or strided into another tensor) are
kernel outputs. Embedding, KV append and attention ops lower their own templates; a host op is one
``HostOp`` command. Each
kernel is lowered with local tensor names (``t0``, ``s1``, ``q``, ...) and cached by
structure, so the 30 layers of a model share one lowering per distinct shape; a
:class:`Kernel` then says which graph tensor view each local name is (``link.py``
relocates the program onto them).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

from edgetvm.errors import CandidateRejected
from edgetvm.npu_regions import default_knobs
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.isa import End, HostOp
from edgetvm.target.lowering import LIST_SCHEDULE_AUTO, lower_primfunc
from edgetvm.tir_schedules.attention import ATTENTION_LOWERING
from edgetvm.tir_schedules.attention import DECODE_REVISION, PREFILL_REVISION
from edgetvm.tir_schedules.attention import schedule_decode_attention, schedule_prefill_attention
from edgetvm.tir_schedules.attention import two_pass_bytes
from edgetvm.tir_schedules.common import new_schedule
from edgetvm.tir_schedules.embedding import schedule_embedding
from edgetvm.tir_schedules.fused import (FusionCluster, Stage, knob_names, lower_cluster,
                                         schedule_cluster)
from edgetvm.tir_schedules.kv_cache import (KV_APPEND_LOWERING, KV_APPEND_PAGES_LOWERING,
                                            KVCacheLayout, schedule_kv_append,
                                            schedule_kv_append_pages)
from edgetvm.tir_schedules.workloads import embedding as embedding_workload

from .graph import BuildError, PhaseGraph
from .kv_pages import KV_PAGES, append_mode


@dataclass
class Kernel:
    """A lowered kernel and what its DRAM tensors are in the phase.

    ``bindings``: local tensor name -> View of a graph tensor (the view's elements in
    row-major order are the local tensor's); ``state``: local name -> graph state tensor
    (the layer's KV cache); ``knobs``: the schedule's knob values."""

    name: str
    ops: tuple
    program: object
    bindings: dict
    state: dict = field(default_factory=dict)
    knobs: dict = field(default_factory=dict)
    key: str = ""


def kernel_shape(view) -> tuple:
    """The 2-D shape a kernel declares for a row-local view (1-D vectors stay 1-D)."""
    if view.ndim <= 2:
        return tuple(view.shape)
    return (view.shape[0], int(np.prod(view.shape[1:])))


def stage_cluster(graph: PhaseGraph, group, consumers=None) -> tuple:
    """``(FusionCluster, bindings)`` of a group of stage ops (indices into ``graph.ops``)."""
    consumers = graph.consumers() if consumers is None else consumers
    members = set(group)
    tensors, consts, bind, stages, outputs = {}, [], {}, [], []
    produced: dict = {}                 # graph tensor -> local stage result (whole)
    written = {v.tensor for i in group for v in graph.ops[i].outputs.values()}
    external: dict = {}                 # view -> local input name
    for i in group:
        op = graph.ops[i]
        if op.kind != "stage":
            raise BuildError(f"op {op.name} ({op.kind}) is not a row-local stage")
        ins = []
        for role in op.stage.inputs:
            v = op.inputs[role]
            t = graph.tensors[v.tensor]
            if v.tensor in produced and v.is_whole(t.shape):
                ins.append(produced[v.tensor])
                continue
            if v.tensor in written:
                raise BuildError(f"op {op.name} reads a strided view of {v.tensor}, which its "
                                 f"own kernel writes: they cannot share a kernel")
            key = (v.tensor, v.shape, v.strides, v.offset)
            name = external.get(key)
            if name is None:
                name = external[key] = f"t{len(external)}"
                tensors[name] = (kernel_shape(v), t.dtype)
                bind[name] = v
                if t.kind == "const":
                    consts.append(name)
            ins.append(name)
        out = op.outputs[op.stage.output]
        local = f"s{len(stages)}"
        stages.append(Stage(op.stage.op, tuple(ins), local, dict(op.stage.attrs)))
        whole = out.is_whole(graph.tensors[out.tensor].shape)
        if whole:
            produced[out.tensor] = local
        if not whole or graph.tensors[out.tensor].kind in ("output", KV_PAGES) or \
                any(c not in members for c in consumers.get(out.tensor, ())):
            outputs.append(local)
            bind[local] = out
    if not outputs:
        raise BuildError(f"ops {[graph.ops[i].name for i in group]}: nothing is read after them")
    cluster = FusionCluster("+".join(graph.ops[i].stage.op for i in group), tensors, stages,
                            tuple(outputs), tuple(consts))
    return cluster, bind


def cluster_key(cluster: FusionCluster) -> str:
    """The structural key of a fusion cluster's kernel (:attr:`Kernel.key`): its tensors,
    stages, outputs and constants, not where in a graph it sits."""
    return repr(("cluster", cluster.tensors, cluster.stages, cluster.outputs, cluster.consts))


class KernelBuilder:
    """Lowers groups of a phase's ops, cached by structure.

    Every kernel has a structural key (:attr:`Kernel.key`: its cluster's tensors, stages
    and outputs, or its template's shape). Its knobs are, in order: ``knobs`` given to
    :meth:`kernel` (the tuner's candidate), ``knobs_for(key)`` (replay of a tuning log;
    ``None`` for a kernel the log does not cover) or the template's defaults. Explicit or
    replayed knobs are lowered exactly as given: a set that does not fit the TCM raises
    :class:`CandidateRejected` (explicit) or :class:`BuildError` (replayed), never falls
    back silently to other knobs.
    """

    def __init__(self, spec, layout: KVCacheLayout, knobs_for=None):
        self.spec = spec
        self.layout = layout
        self.knobs_for = knobs_for
        self._cache: dict = {}
        #: (key, knobs) of every kernel lowered and kept (a build's workers send theirs)
        self.lowered_keys: set = set()

    def without_replay(self) -> "KernelBuilder":
        """This builder lowering every kernel with its default knobs (``knobs_for``
        ignored); it shares the cache (keyed by the knobs) and :attr:`lowered_keys`."""
        other = copy.copy(self)
        other.knobs_for = None
        return other

    @property
    def lowered(self) -> int:
        """How many distinct kernels were lowered and kept."""
        return len(self.lowered_keys)

    def kernel(self, graph: PhaseGraph, group, consumers=None, knobs: dict | None = None
               ) -> Kernel:
        ops = [graph.ops[i] for i in group]
        if ops[0].kind == "stage":
            return self._stage_kernel(graph, tuple(group), consumers, knobs)
        if len(ops) != 1:
            raise BuildError(f"a {ops[0].kind} op is a kernel of its own")
        op = ops[0]
        return getattr(self, f"_{op.kind}")(graph, group[0], op, knobs)

    def _knobs(self, key: str, knobs):
        """(knobs to lower with or None for the defaults, whether they were replayed)."""
        if knobs is not None:
            return knobs, False
        if self.knobs_for is not None:
            replayed = self.knobs_for(key)
            if replayed is not None:
                return replayed, True
        return None, False

    def _cached(self, key, knobs, replayed, build):
        """``build(knobs)`` once per (key, knobs); refusals are cached too."""
        if knobs is not None and not replayed:
            # a tuner's candidate: lowered once, not kept (thousands would pile up)
            try:
                return build(knobs)
            except BuildError as e:
                raise CandidateRejected(str(e)) from None
        ck = (key, None if knobs is None else _canonical(knobs))
        hit = self._cache.get(ck)
        if hit is None:
            try:
                hit = build(knobs)
            except (BuildError, CandidateRejected) as e:
                hit = e                      # a candidate that does not fit stays refused
            self._cache[ck] = hit
            if not isinstance(hit, Exception):
                self.lowered_keys.add(ck)
        if isinstance(hit, CandidateRejected) and replayed:
            raise BuildError(f"the logged knobs {_canonical(knobs)} of kernel {key[:80]}... "
                             f"do not lower on {self.spec.name}: {hit}")
        if isinstance(hit, Exception):
            raise hit
        return hit

    # -- row-local clusters ---------------------------------------------------------------
    def _stage_kernel(self, graph, group, consumers, knobs) -> Kernel:
        cluster, bind = stage_cluster(graph, group, consumers)
        key = cluster_key(cluster)
        knobs, replayed = self._knobs(key, knobs)
        program, used = self._cached(key, knobs, replayed,
                                     lambda kn: self._lower_cluster(cluster, kn))
        return Kernel(cluster.name, group, program, bind, knobs=used, key=key)

    def _lower_cluster(self, cluster: FusionCluster, knobs: dict | None = None):
        """The cluster lowered with ``knobs`` (the :func:`schedule_cluster` keyword
        arguments), or with the first default set that fits, in the order (loop nest or
        list schedule) the lowering's plan estimates faster (``LIST_SCHEDULE_AUTO``)."""
        zeros = {n: np.zeros(cluster.tensors[n][0], cluster.tensors[n][1])
                 for n in cluster.consts}
        func = cluster.prim_func()
        if knobs is not None:
            sch = new_schedule(func, seed=1)
            try:
                schedule_cluster(sch, **knobs)
            except (TypeError, ValueError, RuntimeError, IndexError) as e:
                raise CandidateRejected(f"fusion cluster {cluster.name!r}: knobs {knobs} do "
                                        f"not apply: {_gist(e)}") from None
            return lower_cluster(cluster, sch, self.spec, zeros), dict(knobs)
        names = knob_names(func)
        rows = cluster_rows(cluster)
        err = None
        for knobs in default_knobs(rows, cluster_matmuls(cluster)):
            if "tile_n" in names:        # 2-D elementwise clusters also tile their columns
                knobs["tile_n"] = int(_shape_of(cluster, cluster.stages[-1].output)[1])
            sch = new_schedule(func, seed=1)
            try:
                schedule_cluster(sch, **knobs, list_schedule=LIST_SCHEDULE_AUTO)
                program = lower_cluster(cluster, sch, self.spec, zeros)
            except CandidateRejected as e:
                err = e
                continue
            # the order the lowering's plan took, as an explicit knob: the same knob set
            # lowers to the same program (a log's record of the defaults replays them)
            knobs["list_schedule"] = int(program.metadata["list_scheduled"])
            return program, knobs
        raise BuildError(f"no default schedule of cluster {cluster.name} fits "
                         f"{self.spec.name}: {err}")

    # -- kernels of their own template ----------------------------------------------------
    def _embedding(self, graph, index, op, knobs=None) -> Kernel:
        rows = op.outputs["out"].shape[0]
        vocab, hidden = op.attrs["vocab"], op.attrs["hidden"]
        key = repr(("embedding", rows, vocab, hidden))
        knobs, replayed = self._knobs(key, knobs)

        def build(kn):
            kn = dict(tile_m=min(rows, 16), slots_out=2, dma_split=1) if kn is None \
                else dict(kn)
            sch = new_schedule(embedding_workload(rows, vocab, hidden))
            _apply(schedule_embedding, sch, "embedding", kn)
            placeholder = {"E": np.zeros((vocab, hidden), np.float16)}
            return lower_primfunc(sch.mod["main"], self.spec, "embedding", consts=placeholder,
                                  runtime=["ids"]), kn
        program, used = self._cached(key, knobs, replayed, build)
        return Kernel(op.name, (index,), program, {"E": op.inputs["E"], "out": op.outputs["out"]},
                      knobs=used, key=key)

    def _host(self, graph, index, op, knobs=None) -> Kernel:
        """An elementwise op the host runs (``target/host_ops.py``): one ``HostOp`` on the
        whole input and output tensors, which the linker names. No knobs."""
        if knobs:
            raise CandidateRejected("a host op has no knobs")
        attrs = {k: v for k, v in op.attrs.items() if k != "flops"}
        key = repr(("host", sorted(attrs.items())))

        def build(_):
            b = ProgramBuilder(f"host_{op.attrs['op']}")
            for role, v in (*op.inputs.items(), *op.outputs.items()):
                b.tensor(role, v.shape, graph.tensors[v.tensor].dtype, "scratch")
            b.emit(HostOp(fn="elementwise", inputs=tuple(op.inputs), outputs=tuple(op.outputs),
                          attrs=tuple(sorted(attrs.items())), flops=int(op.attrs["flops"])))
            b.emit(End())
            return b.build(tcm_bytes=0), {}
        program, _ = self._cached(key, None, False, build)
        return Kernel(op.name, (index,), program, {**op.inputs, **op.outputs}, key=key)

    def _kv_append(self, graph, index, op, knobs=None) -> Kernel:
        """A prefill of whole pages writes them whole (one DMA per page and head; such a
        program runs only at a page boundary); otherwise one DMA per token and head, at
        any position. No knobs."""
        if knobs:
            raise CandidateRejected("a KV append has no knobs")
        rows = op.inputs["k_new"].shape[0]
        pt = self.layout.page_tokens
        if append_mode(graph, self.layout) == "pages":
            key = ("kv_append_pages", rows // pt)

            def build(_):
                sch = schedule_kv_append_pages(self.layout, rows // pt, self.spec)
                return lower_primfunc(sch.mod["main"], self.spec, f"kv_append_pages_{rows}",
                                      **KV_APPEND_PAGES_LOWERING), {}
        else:
            key = ("kv_append", rows)

            def build(_):
                sch = schedule_kv_append(self.layout, rows, self.spec)
                return lower_primfunc(sch.mod["main"], self.spec, f"kv_append_{rows}",
                                      **KV_APPEND_LOWERING), {}
        program, _ = self._cached(repr(key), None, False, build)
        return Kernel(op.name, (index,), program, dict(op.inputs),
                      state=_layer_state(op.layer), key=repr(key))

    def _attention(self, graph, index, op, knobs=None) -> Kernel:
        hq, scale = op.attrs["q_heads"], op.attrs["scale"]
        alibi = bool(op.attrs.get("alibi"))
        cap, window = op.attrs.get("softcap"), op.attrs.get("window")
        pages = graph.pages
        # (ALiBi's, soft-capped and windowed kernels have keys of their own; a causal one
        # keeps its key, and so its tuning-log records)
        extra = (("alibi",) if alibi else ()) + (("softcap", cap) if cap else ()) + \
            (("window", window) if window else ())
        one_query = attention_kind(graph, op) == "decode_attention"
        if one_query:
            key = repr(("decode_attention", DECODE_REVISION, hq, pages, scale, *extra))
        else:
            key = repr(("prefill_attention", PREFILL_REVISION, hq, graph.rows, pages, scale,
                        *extra))
        knobs, replayed = self._knobs(key, knobs)

        def lower(kn):
            if one_query:
                sch = _apply(schedule_decode_attention, None, "decode attention", kn,
                             self.layout, hq, pages, self.spec, scale=scale, alibi=alibi,
                             softcap=cap, window=window)
            else:
                sch = _apply(schedule_prefill_attention, None, "prefill attention", kn,
                             self.layout, hq, graph.rows, self.spec, chunked=True,
                             max_pages=pages, scale=scale, alibi=alibi, softcap=cap,
                             window=window)
            # list-scheduled for the bucket's worst case (the tiles a chunk's position
            # predicates off take no time in the plan)
            return lower_primfunc(sch.mod["main"], self.spec, f"{graph.phase}_attention",
                                  outputs=["out"], **ATTENTION_LOWERING,
                                  plan_params=graph.worst_case_lengths(self.layout)), kn

        def build(kn):
            if kn is not None:
                return lower(dict(kn))
            kn = attention_default_knobs("decode" if one_query else graph.phase, graph.rows,
                                         pages, self.layout, hq, self.spec)
            try:
                return lower(kn)
            except CandidateRejected:
                if not kn.get("two_pass"):
                    raise
                # the defaults' TCM estimate was short: the one-pass loop holds a KV tile
                return lower({**kn, "two_pass": 0})
        program, used = self._cached(key, knobs, replayed, build)
        bindings = {"q": op.inputs["q"], "out": op.outputs["out"]}
        if alibi:
            bindings["slopes"] = op.inputs["slopes"]
        return Kernel(op.name, (index,), program, bindings,
                      state=_layer_state(op.layer), knobs=used, key=key)


def attention_kind(graph, op) -> str:
    """``decode_attention`` (one query: a decode step's, or a prefill's last row where only
    its logits are read, ``graph.py``) or ``prefill_attention`` (a query per row)."""
    one = graph.phase == "decode" or op.attrs.get("last_row")
    return "decode_attention" if one else "prefill_attention"


def attention_default_knobs(phase: str, rows: int, pages: int, layout: KVCacheLayout,
                            q_heads: int, spec) -> dict:
    """The default (untuned) knobs of a decode or prefill attention kernel."""
    cap = pages * layout.page_tokens
    tile = min(64, cap)
    if phase == "decode":
        return dict(tile_kv=tile, slots_kv=2, slots_s=1)
    # list-scheduled: SmolLM2's prefill-512 attention alone 236.7 k -> 229.5 k cycles
    # (tile_q = tile_kv = 64), 244.5 k -> 224.9 k (128); decode measured 1-4 % slower. In
    # the phase programs the order is planned for the bucket's worst case (``_attention``).
    # Two passes (a q tile's scores over the whole cache in the TCM, no rescaling, K and V
    # kept for the head's q tiles): 229.5 k -> 177.3 k at 64 x 64, while those scores and
    # K and V (two slots each) take at most a quarter of the TCM
    tq = min(64, rows)
    held = two_pass_bytes(tq, cap, q_heads // layout.kv_heads, layout.head_dim,
                          slots_kv=2, slots_s=2)
    return dict(tile_q=tq, tile_kv=tile, slots_kv=2, slots_s=2, rowsum_mma=1,
                list_schedule=1, two_pass=int(held <= spec.tcm_bytes // 4))


def cluster_rows(cluster: FusionCluster) -> int:
    return int(next(iter(cluster.tensors.values()))[0][0]) if cluster.tensors else 1


def cluster_matmuls(cluster: FusionCluster) -> dict:
    """stage output -> (n, k, W4 group or 0) of every matmul stage of ``cluster``."""
    matmuls = {}
    for st in cluster.stages:
        if st.op.startswith("linear"):
            n, k = cluster.tensors[st.inputs[1]][0][0], _shape_of(cluster, st.inputs[0])[1]
            group = 0
            if st.op == "linear_w4a16":
                group = k // cluster.tensors[st.inputs[2]][0][1]
            matmuls[st.output] = (n, k, group)
    return matmuls


def _apply(schedule_fn, sch, what: str, knobs: dict, *args, **kwargs):
    """``schedule_fn`` with ``knobs``; a knob set the template refuses (an unknown knob, a
    tile that does not divide) is a rejected candidate, not a crash."""
    try:
        if sch is not None:
            return schedule_fn(sch, *args, **knobs, **kwargs)
        return schedule_fn(*args, **knobs, **kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        raise CandidateRejected(f"{what}: knobs {knobs} do not apply: {_gist(e)}") from None


def _gist(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


def _canonical(knobs: dict) -> str:
    import json
    return json.dumps(knobs, sort_keys=True, separators=(",", ":"))


def _layer_state(layer: int) -> dict:
    return {"K_cache": f"L{layer}.K_cache", "V_cache": f"L{layer}.V_cache"}


def _shape_of(cluster: FusionCluster, name: str) -> tuple:
    """Shape of a cluster input or stage result."""
    if name in cluster.tensors:
        return tuple(cluster.tensors[name][0])
    for st in cluster.stages:
        if st.output == name:
            first = _shape_of(cluster, st.inputs[0])
            if st.op.startswith("linear"):
                return (first[0], cluster.tensors[st.inputs[1]][0][0])
            return first
    raise KeyError(name)

