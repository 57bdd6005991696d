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
are not measured. What the DP leaves out: the overlap the linker adds at kernel
boundaries (cross-kernel prefetch), which is measured in the linked program, not here.
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

    def __init__(self, kernels, spec, profile=None, max_ops: int = MAX_CLUSTER_OPS):
        self.kernels, self.spec = kernels, spec
        self.emulator = Emulator(spec, profile)
        self.max_ops = max_ops
        self._measured: dict = {}
        self.measurements = 0

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
        log.info("edgellm %s %dx%dp: %d clusters, %d measurements so far", graph.phase,
                 graph.rows, graph.pages, len(groups), self.measurements)
        return groups
