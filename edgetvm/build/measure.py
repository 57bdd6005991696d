"""Measuring kernels and phase programs on the emulator at compile time.

A kernel is relocated onto its phase tensors as the linker places it (strided views pay
their DMA bursts) and run twice back to back on one emulator timeline under the power
profile (DVFS throttling charged), the second run counted, so its power windows see a
busy device rather than an idle one. Two forms:

* **alone** (:func:`measure_kernel`, ``edgellm``'s cut-point search): the kernel by
  itself, no cross-kernel prefetch;
* **in context** (:func:`measure_in_context`, the tuner): the kernel (or the clusters of a
  run of fusable ops under candidate cuts) linked between its neighbours in the phase
  program, with the linker's cross-kernel prefetch, minus the two neighbours linked
  without it. That difference is what the kernel adds to the
  step, including what it does to its neighbours: a footprint that leaves no TCM beside
  the next kernel stops that kernel's weight prefetch; a kernel whose first tiles can
  move while the previous one computes hides its start-up. Measured alone, knobs that
  win in isolation (a DMA split, a TCM-filling tile) lost 3-4 % once linked.

Runtime parameters are those of the bucket's worst case: the KV cache full to the
bucket's capacity, within the pages the state tensors hold (pages 0, 1, ... in order),
the new rows at its end.
"""
from __future__ import annotations

from .graph import BuildError
from .link import Linker, plan_dram


def measurement_params(program, graph, layout) -> dict:
    """Runtime parameters of ``program`` (a kernel or a whole phase of ``graph``) at the
    bucket's worst case."""
    pt = layout.page_tokens
    rows = graph.rows
    lengths = graph.worst_case_lengths(layout)
    pos = lengths["pos"]
    table = list(range(layout.num_pages))
    params = {f"ids.{i}": i for i in range(rows)}
    params.update(lengths, last_row=rows - 1)
    params.update(layout.slot_params(table, pos, rows, rows))
    params.update(layout.page_table_params(table, graph.pages))
    params.update({f"dst_page.{i}": table[pos // pt + i] for i in range(max(1, rows // pt))
                   if pos // pt + i < len(table)})
    missing = [p for p in program.params if p not in params]
    if missing:
        raise BuildError(f"program {program.name}: no measurement value for runtime "
                         f"parameter(s) {missing}")
    return {p: params[p] for p in program.params}


def kernel_program(kernel, graph, spec, copies: int = 1):
    """The kernel alone in a program (``copies`` times, back to back), relocated onto its
    phase tensors."""
    return chain_program([kernel], graph, spec, copies, prefetch=False)


def chain_program(kernels: list, graph, spec, copies: int = 1, prefetch: bool = True,
                  name: str | None = None):
    """``kernels`` linked in order (``copies`` times, back to back, each copy starting as a
    program does: what two runs on one timeline do) as the phase program links them, with
    cross-kernel prefetch unless ``prefetch`` is False."""
    plan = plan_dram(graph, list(kernels) * copies, spec.dram_burst_bytes)
    linker = Linker(graph, plan, spec, name or "candidate_" + "+".join(
        k.name for k in kernels), prefetch=prefetch)
    for _ in range(copies):
        linker.barrier()
        for k in kernels:
            linker.add(k)
    return linker.build()


def run_twice(emulator, program, params, cycle_limit: float | None = None) -> tuple:
    """Counters of two back-to-back runs on one timeline (each stopped with
    ``CycleLimitExceeded`` past ``cycle_limit`` cycles)."""
    clock = emulator.timeline()
    return tuple(clock.run(program, {}, params, cycle_limit=cycle_limit).counters
                 for _ in range(2))


def run_steady(emulator, program, params):
    """Counters of the second of two back-to-back runs on one timeline."""
    return run_twice(emulator, program, params)[1]


def measure_kernel(kernel, graph, spec, layout, emulator):
    """The measured Counters of ``kernel`` alone (see the module docstring)."""
    program = kernel_program(kernel, graph, spec)
    return run_steady(emulator, program, measurement_params(program, graph, layout))


def context_programs(kernels, before, after, graph, spec, copies: int = 1) -> tuple:
    """(``kernels`` (one candidate kernel, or the clusters of a run's candidate cuts)
    between their neighbours, the neighbours without them): the two programs
    :func:`measure_in_context` runs; ``before`` / ``after`` may be None (a phase's first
    or last kernel). The second is None when there is no neighbour."""
    around = [k for k in (before, after) if k is not None]
    chain = [k for k in [before, *kernels, after] if k is not None]
    with_it = chain_program(chain, graph, spec, copies)
    without = chain_program(around, graph, spec, copies) if around else None
    return with_it, without


def measure_in_context(kernels, before, after, graph, spec, layout, emulator) -> tuple:
    """(Counters of ``kernels`` between ``before`` and ``after``, Counters of the two
    neighbours alone or None): their cost in context is the difference of their
    ``total_cycles`` (see the module docstring)."""
    with_it, without = context_programs(kernels, before, after, graph, spec)
    a = run_steady(emulator, with_it, measurement_params(with_it, graph, layout))
    b = None if without is None else \
        run_steady(emulator, without, measurement_params(without, graph, layout))
    return a, b


def measure_program(program, graph, layout, emulator):
    """The Counters of one run of a whole linked phase ``program`` of ``graph``."""
    return emulator.run(program, {}, measurement_params(program, graph, layout)).counters
