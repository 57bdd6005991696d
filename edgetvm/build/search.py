"""The ``edgellm`` partition: cut points chosen by measurement.

An exact dynamic program over the cut points of a phase's op sequence (the whole phase,
so a cluster may span the end of one layer and the start of the next):

    best[j] = min over i < j of best[i] + cycles(ops[i:j])

where ``ops[i:j]`` is a candidate cluster when its ops may share a kernel
(:func:`~edgetvm.relax_passes.partition.can_join`) and its kernel fits the TCM, and
``cycles`` is *measured*: the candidate's kernel, relocated onto the phase's tensors as
the linker would place it (so strided views pay their DMA bursts) and run alone on the
emulator under the power profile, DVFS throttling included, in steady state (run twice
back to back on one timeline, the second run counted, so its power windows see a busy
device rather than an idle one). The power budget enters that way: a cluster whose power
the governor has to throttle is charged the cycles it loses.

Measurements are cached by the kernel's structure and the layout of its operands, so the
30 layers of a model cost one measurement per distinct candidate. Ops that are kernels of
their own template (embedding, KV append, attention) are in every partition alike and
are not measured. What the DP leaves out (the overlap the linker adds at kernel
boundaries, power windows that span kernels) is measured at the end: the DP's partition
and the largest-fit one are linked and run whole, and the faster is kept.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from edgetvm.relax_passes.partition import can_join
from edgetvm.target.emulator import Emulator

from .graph import BuildError
from .link import Linker, plan_dram

log = logging.getLogger("edgetvm")

#: the longest cluster the search considers (ops); longer runs have never fit 16 MB
MAX_CLUSTER_OPS = 16


@dataclass
class Measured:
    cycles: int
    peak_power_mw: float
    dram_bytes: int


class SegmentSearch:
    """Measures candidate clusters of one compiler's phases and solves the cut-point DP."""

    def __init__(self, kernels, spec, profile=None, max_ops: int = MAX_CLUSTER_OPS,
                 link=None, page_tokens: int = 16):
        self.kernels, self.spec = kernels, spec
        self.profile = profile
        self.emulator = Emulator(spec, profile)
        self.max_ops = max_ops
        self.link = link                  # (graph, groups, name) -> Program, or None
        self.page_tokens = page_tokens
        self._measured: dict = {}
        self.measurements = 0
        self.whole_runs = 0

    def measure(self, graph, group, consumers):
        """The candidate's measured cost, or None when it does not lower (TCM)."""
        try:
            k = self.kernels.kernel(graph, list(group), consumers)
        except BuildError:
            return None
        key = (k.key, tuple(sorted((n, v.shape, v.strides, graph.tensors[v.tensor].shape)
                                   for n, v in k.bindings.items())))
        hit = self._measured.get(key)
        if hit is None:
            plan = plan_dram(graph, [k], self.spec.dram_burst_bytes)
            linker = Linker(graph, plan, self.spec, f"candidate_{k.name}", prefetch=False)
            linker.add(k)
            program = linker.build()
            params = {p: 0 for p in program.params}
            clock = self.emulator.timeline()      # steady state: the power windows of
            clock.run(program, {}, params)        # a kernel that runs among its like
            c = clock.run(program, {}, params).counters
            hit = self._measured[key] = Measured(c.total_cycles, c.peak_power_mw,
                                                 c.dram_read_bytes + c.dram_write_bytes)
            self.measurements += 1
        return hit

    def partition(self, graph) -> list:
        """The DP's partition, or the largest-fit one (``mega``) when that measures faster
        as a whole program (with ``link``): the DP adds up clusters measured alone, and a
        whole step also has prefetch across kernel boundaries and power windows that span
        kernels, so the two candidates are linked and run whole, and the faster kept."""
        best = self.cut_points(graph)
        if self.link is None:
            return best
        from edgetvm.relax_passes.partition import mega

        consumers = graph.consumers()
        other = mega(graph, lambda grp: self.measure(graph, grp, consumers) is not None)
        if other == best:
            return best
        cycles = {k: self.run_whole(graph, groups) for k, groups in (("dp", best),
                                                                     ("mega", other))}
        log.info("edgellm %s %dx%dp whole: DP %d cycles, largest-fit %d", graph.phase,
                 graph.rows, graph.pages, cycles["dp"], cycles["mega"])
        return best if cycles["dp"] <= cycles["mega"] else other

    def run_whole(self, graph, groups) -> int:
        """Cycles of the linked program of ``groups``, run once at the bucket's full
        length on a zero KV cache (timing does not depend on the values)."""
        from edgetvm.runtime.model import ModelInfo, ModelRunner

        program = self.link(graph, groups, f"edgellm_{graph.phase}_{graph.rows}x{graph.pages}p")
        pt = self.page_tokens
        # the bucket's capacity, within the cache the state tensors hold
        tokens = min(graph.pages, self.kernels.layout.num_pages) * pt
        key = (graph.phase, graph.rows, graph.pages)
        other = ("decode", 1, 1) if graph.phase == "prefill" else ("prefill", graph.rows, 1)
        info = ModelInfo(graph.layers, graph.kv_heads, graph.head_dim, pt, tokens,
                         int(graph.tensors[graph.logits].shape[-1]))
        model = ModelRunner({key: program}, [key, other], info, None)
        if graph.phase == "decode":
            pos, ids = tokens - 1, [0]
        else:
            pos, ids = max(0, (tokens - graph.rows) // pt * pt), [0] * graph.rows
        model.kv.reserve(0, pos)
        params = model.params_for(program, key, ids, pos)
        self.whole_runs += 1
        return Emulator(self.spec, self.profile).run(program, {}, params).counters.total_cycles

    def cut_points(self, graph) -> list:
        """The exact DP over cut points (measured clusters, summed)."""
        ops = graph.ops
        n = len(ops)
        consumers = graph.consumers()
        inf = float("inf")
        best = [0.0] + [inf] * n
        cut = [0] * (n + 1)
        for i in range(n):
            if best[i] == inf:
                continue
            if ops[i].kind != "stage":        # a kernel of its own in every partition
                if best[i] < best[i + 1]:
                    best[i + 1], cut[i + 1] = best[i], i
                continue
            group: list = []
            for j in range(i, min(n, i + self.max_ops)):
                if group and not can_join(graph, group, j):
                    break
                group.append(j)
                m = self.measure(graph, group, consumers)
                if m is None:
                    if len(group) == 1:
                        raise BuildError(f"op {ops[j].name} does not lower on its own")
                    break
                cost = best[i] + m.cycles
                if cost < best[j + 1]:
                    best[j + 1], cut[j + 1] = cost, i
        groups = []
        j = n
        while j > 0:
            i = cut[j]
            groups.append(list(range(i, j)))
            j = i
        groups.reverse()
        log.info("edgellm %s %dx%dp DP: %d clusters, %d measurements so far", graph.phase,
                 graph.rows, graph.pages, len(groups), self.measurements)
        return groups
