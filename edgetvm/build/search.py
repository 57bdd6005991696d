"""The ``edgellm`` partition: cut points chosen by measurement.

An exact dynamic program over the cut points of a phase's op sequence (the whole phase,
so a cluster may span the end of one layer and the start of the next):

    best[j] = min over i < j of best[i] + cycles(ops[i:j])

where ``ops[i:j]`` is a candidate cluster when its ops may share a kernel
(:func:`~edgetvm.relax_passes.partition.can_join`) and its kernel fits the TCM, and
``cycles`` is *measured* as :mod:`edgetvm.build.measure` measures a kernel: relocated
onto the phase's tensors (so strided views pay their DMA bursts), alone, in steady state
under the power profile, DVFS throttling included. The power budget enters that way: a
cluster whose power the governor has to throttle is charged the cycles it loses.

Measurements are cached by the kernel's structure and the layout of its operands, so the
30 layers of a model cost one measurement per distinct candidate. Ops that are kernels of
their own template (embedding, KV append, attention) are in every partition alike and
are not measured. What the DP leaves out (the overlap the linker adds at kernel
boundaries, power windows that span kernels) is measured at the end: the DP's partition
and the largest-fit one are linked and run whole, and the faster is kept.
"""
from __future__ import annotations

import logging

from edgetvm.relax_passes.partition import can_join
from edgetvm.target.emulator import Emulator

from .graph import BuildError
from .measure import measure_kernel, measure_program

log = logging.getLogger("edgetvm")

#: the longest cluster the search considers (ops); longer runs have never fit 16 MB
MAX_CLUSTER_OPS = 16


class SegmentSearch:
    """Measures candidate clusters of one compiler's phases and solves the cut-point DP."""

    def __init__(self, kernels, spec, profile=None, max_ops: int = MAX_CLUSTER_OPS,
                 link=None):
        self.kernels, self.spec = kernels, spec
        self.emulator = Emulator(spec, profile)
        self.max_ops = max_ops
        self.link = link                  # (graph, groups, name) -> Program, or None
        self._measured: dict = {}
        self.measurements = 0

    def measure(self, graph, group, consumers):
        """The candidate's measured cycles, or None when it does not lower (TCM)."""
        try:
            k = self.kernels.kernel(graph, list(group), consumers)
        except BuildError:
            return None
        key = (k.key, tuple(sorted((n, v.shape, v.strides, graph.tensors[v.tensor].shape)
                                   for n, v in k.bindings.items())))
        hit = self._measured.get(key)
        if hit is None:
            hit = self._measured[key] = measure_kernel(
                k, graph, self.spec, self.kernels.layout, self.emulator).total_cycles
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
        """Cycles of the linked program of ``groups``, run once at the bucket's worst case
        on a zero KV cache (timing does not depend on the values)."""
        program = self.link(graph, groups, f"edgellm_{graph.phase}_{graph.rows}x{graph.pages}p")
        return measure_program(program, graph, self.kernels.layout,
                               self.emulator).total_cycles

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
                cost = best[i] + m
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
