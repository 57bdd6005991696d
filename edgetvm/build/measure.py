"""Measuring kernels and phase programs on the emulator at compile time.

One method serves every search (``edgellm``'s cut points, the tuner's knobs and its
whole-program check): a kernel is relocated onto its phase tensors as the linker places
it (strided views pay their DMA bursts), alone in a program, and run twice back to back
on one emulator timeline under the power profile (DVFS throttling charged), the second
run counted, so its power windows see a busy device rather than an idle one. Runtime
parameters are those of the bucket's worst case: the KV cache full to the bucket's
capacity, within the pages the state tensors hold (pages 0, 1, ... in order), the new
rows at its end.
"""
from __future__ import annotations

from .graph import BuildError
from .link import Linker, plan_dram


def measurement_params(program, graph, layout) -> dict:
    """Runtime parameters of ``program`` (a kernel or a whole phase of ``graph``) at the
    bucket's worst case."""
    pt = layout.page_tokens
    # the bucket's capacity, within the cache the state tensors hold (a 1,040-token build
    # has 65 pages and a 128-page decode bucket)
    cap = min(graph.pages, layout.num_pages) * pt
    rows = graph.rows
    pos = max(0, cap - rows)
    table = list(range(layout.num_pages))
    params = {f"ids.{i}": i for i in range(rows)}
    params.update(pos=pos, valid_len=pos + rows, last_row=rows - 1)
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
    plan = plan_dram(graph, [kernel] * copies, spec.dram_burst_bytes)
    linker = Linker(graph, plan, spec, f"candidate_{kernel.name}", prefetch=False)
    for _ in range(copies):
        linker.add(kernel)
    return linker.build()


def run_steady(emulator, program, params):
    """Counters of the second of two back-to-back runs on one timeline."""
    clock = emulator.timeline()
    clock.run(program, {}, params)
    return clock.run(program, {}, params).counters


def measure_kernel(kernel, graph, spec, layout, emulator):
    """The measured Counters of ``kernel`` alone (see the module docstring)."""
    program = kernel_program(kernel, graph, spec)
    return run_steady(emulator, program, measurement_params(program, graph, layout))


def measure_program(program, graph, layout, emulator):
    """The Counters of one run of a whole linked phase ``program`` of ``graph``."""
    return emulator.run(program, {}, measurement_params(program, graph, layout)).counters
