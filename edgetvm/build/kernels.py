"""The kernels of a phase: a partition's op groups, lowered to position-independent programs.

A group of stage ops becomes one :class:`~edgetvm.tir_schedules.fused.FusionCluster`:
inputs that another op of the group writes whole stay in TCM, every other input is a
kernel parameter, and results read outside the group (or strided into another tensor) are
kernel outputs. Embedding, KV append and attention ops lower their own templates. Each
kernel is lowered with local tensor names (``t0``, ``s1``, ``q``, ...) and cached by
structure, so the 30 layers of a model share one lowering per distinct shape; a
:class:`Kernel` then says which graph tensor view each local name is (``link.py``
relocates the program onto them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import s_tir

from edgetvm.errors import CandidateRejected
from edgetvm.npu_regions import default_knobs
from edgetvm.target.lowering import lower_primfunc
from edgetvm.tir_schedules.attention import (ATTENTION_LOWERING, schedule_decode_attention,
                                             schedule_prefill_attention)
from edgetvm.tir_schedules.embedding import schedule_embedding
from edgetvm.tir_schedules.fused import (FusionCluster, Stage, knob_names, lower_cluster,
                                         schedule_cluster)
from edgetvm.tir_schedules.kv_cache import (KV_APPEND_LOWERING, KV_APPEND_PAGES_LOWERING,
                                            KVCacheLayout, schedule_kv_append,
                                            schedule_kv_append_pages)
from edgetvm.tir_schedules.workloads import embedding as embedding_workload

from .graph import BuildError, PhaseGraph


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
        if not whole or graph.tensors[out.tensor].kind == "output" or \
                any(c not in members for c in consumers.get(out.tensor, ())):
            outputs.append(local)
            bind[local] = out
    if not outputs:
        raise BuildError(f"ops {[graph.ops[i].name for i in group]}: nothing is read after them")
    cluster = FusionCluster("+".join(graph.ops[i].stage.op for i in group), tensors, stages,
                            tuple(outputs), tuple(consts))
    return cluster, bind


class KernelBuilder:
    """Lowers groups of a phase's ops with default (untuned) knobs, cached by structure."""

    def __init__(self, spec, layout: KVCacheLayout):
        self.spec = spec
        self.layout = layout
        self._cache: dict = {}
        self.lowered = 0

    def kernel(self, graph: PhaseGraph, group, consumers=None) -> Kernel:
        ops = [graph.ops[i] for i in group]
        if ops[0].kind == "stage":
            return self._stage_kernel(graph, tuple(group), consumers)
        if len(ops) != 1:
            raise BuildError(f"a {ops[0].kind} op is a kernel of its own")
        op = ops[0]
        return getattr(self, f"_{op.kind}")(graph, group[0], op)

    def _cached(self, key, build):
        hit = self._cache.get(key)
        if hit is None:
            try:
                hit = build()
            except BuildError as e:
                hit = e                      # a candidate that does not fit stays refused
            self._cache[key] = hit
            self.lowered += not isinstance(hit, BuildError)
        if isinstance(hit, BuildError):
            raise hit
        return hit

    # -- row-local clusters ---------------------------------------------------------------
    def _stage_kernel(self, graph, group, consumers) -> Kernel:
        cluster, bind = stage_cluster(graph, group, consumers)
        key = repr(("cluster", cluster.tensors, cluster.stages, cluster.outputs,
                    cluster.consts))
        program, knobs = self._cached(key, lambda: self._lower_cluster(cluster))
        return Kernel(cluster.name, group, program, bind, knobs=knobs, key=key)

    def _lower_cluster(self, cluster: FusionCluster):
        zeros = {n: np.zeros(cluster.tensors[n][0], cluster.tensors[n][1])
                 for n in cluster.consts}
        func = cluster.prim_func()
        names = knob_names(func)
        rows = int(next(iter(cluster.tensors.values()))[0][0]) if cluster.tensors else 1
        matmuls = {}
        for st in cluster.stages:
            if st.op.startswith("linear"):
                n, k = cluster.tensors[st.inputs[1]][0][0], _shape_of(cluster, st.inputs[0])[1]
                group = 0
                if st.op == "linear_w4a16":
                    group = k // cluster.tensors[st.inputs[2]][0][1]
                matmuls[st.output] = (n, k, group)
        err = None
        for knobs in default_knobs(rows, matmuls):
            if "tile_n" in names:        # 2-D elementwise clusters also tile their columns
                knobs["tile_n"] = int(_shape_of(cluster, cluster.stages[-1].output)[1])
            sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=1)
            try:
                schedule_cluster(sch, **knobs)
                return lower_cluster(cluster, sch, self.spec, zeros), knobs
            except CandidateRejected as e:
                err = e
        raise BuildError(f"no default schedule of cluster {cluster.name} fits "
                         f"{self.spec.name}: {err}")

    # -- kernels of their own template ----------------------------------------------------
    def _embedding(self, graph, index, op) -> Kernel:
        rows = op.outputs["out"].shape[0]
        vocab, hidden = op.attrs["vocab"], op.attrs["hidden"]

        def build():
            sch = s_tir.Schedule(tvm.IRModule({"main": embedding_workload(rows, vocab, hidden)}))
            knobs = dict(tile_m=min(rows, 16), slots_out=2, dma_split=1)
            schedule_embedding(sch, **knobs)
            placeholder = {"E": np.zeros((vocab, hidden), np.float16)}
            return lower_primfunc(sch.mod["main"], self.spec, "embedding", consts=placeholder,
                                  runtime=["ids"]), knobs
        program, knobs = self._cached(("embedding", rows, vocab, hidden), build)
        return Kernel(op.name, (index,), program, {"E": op.inputs["E"], "out": op.outputs["out"]},
                      knobs=knobs, key=repr(("embedding", rows, vocab, hidden)))

    def _kv_append(self, graph, index, op) -> Kernel:
        """A prefill of whole pages writes them whole (one DMA per page and head; such a
        program runs only at a page boundary); otherwise one DMA per token and head, at
        any position."""
        rows = op.inputs["k_new"].shape[0]
        pt = self.layout.page_tokens
        if graph.phase == "prefill" and rows % pt == 0:
            key = ("kv_append_pages", rows // pt)

            def build():
                sch = schedule_kv_append_pages(self.layout, rows // pt, self.spec)
                return lower_primfunc(sch.mod["main"], self.spec, f"kv_append_pages_{rows}",
                                      **KV_APPEND_PAGES_LOWERING), {}
        else:
            key = ("kv_append", rows)

            def build():
                sch = schedule_kv_append(self.layout, rows, self.spec)
                return lower_primfunc(sch.mod["main"], self.spec, f"kv_append_{rows}",
                                      **KV_APPEND_LOWERING), {}
        program, knobs = self._cached(key, build)
        return Kernel(op.name, (index,), program, dict(op.inputs),
                      state=_layer_state(op.layer), key=repr(key))

    def _attention(self, graph, index, op) -> Kernel:
        hq, scale = op.attrs["q_heads"], op.attrs["scale"]
        pages = graph.pages
        tile = min(64, pages * self.layout.page_tokens)
        if graph.phase == "decode":
            knobs = dict(tile_kv=tile, slots_kv=2, slots_s=1)
            key = ("decode_attention", hq, pages, scale)

            def build():
                return lower_primfunc(schedule_decode_attention(
                    self.layout, hq, pages, self.spec, scale=scale, **knobs).mod["main"],
                    self.spec, "decode_attention", outputs=["out"], **ATTENTION_LOWERING)
        else:
            rows = graph.rows
            knobs = dict(tile_q=min(64, rows), tile_kv=tile, slots_kv=2, slots_s=1)
            key = ("prefill_attention", hq, rows, pages, scale)

            def build():
                return lower_primfunc(schedule_prefill_attention(
                    self.layout, hq, rows, self.spec, chunked=True, max_pages=pages,
                    scale=scale, **knobs).mod["main"], self.spec, "prefill_attention",
                    outputs=["out"], **ATTENTION_LOWERING)
        program, _ = self._cached(key, lambda: (build(), knobs))
        return Kernel(op.name, (index,), program, {"q": op.inputs["q"], "out": op.outputs["out"]},
                      state=_layer_state(op.layer), knobs=knobs, key=repr(key))


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

