"""List scheduling: the order each unit runs its ops in, chosen for overlap.

Every unit issues its commands in program order, so the order the loop nest gives (all
of row block ``r``'s ops before any of row block ``r + 1``'s) serialises what the data
does not: the matrix unit waits for block ``r``'s norm before block ``r``'s next
projection, although block ``r + 1``'s first projection is ready. A compiler for an
in-order accelerator reorders the stream (software pipelining, as Vela's and TVM's
Hexagon/VTA pipelines do by hand per template); this pass does it for any program:

1. dependencies: two ops that touch the same bytes, one of them writing, keep their
   order. The bytes are the allocated ones (after ``tcm_alloc``): a TCM buffer's (slot,
   footprint-relative box), so a refill of a rotating slot waits for the reads of the
   instance it replaces (the double buffer's own rule), and a buffer placed in the bytes
   of one dead before it follows every access of that one. DRAM boxes with runtime
   coordinates are taken to overlap. Nothing else is reordered: the result computes
   exactly what the loop nest's order computes, in the same TCM;
2. costs: each op's cycles from the emulator's own per-command formulas (``costs.py``),
   a DMA at the whole bus's bandwidth (an estimate for choosing an order, never a
   measurement); an op its predicates switch off at the runtime parameters the order is
   planned for costs nothing (``lower_primfunc``'s ``plan_params``);
3. list scheduling: a simulation of the units, each starting, whenever it is idle, the
   ready op with the longest estimated path to the end (ties: the loop nest's order).

The program is then the ops by simulated start; ``sync`` inserts the events for that
order. The emulator measures what the order gains; the tuner keeps it only where it does
(the ``list_schedule`` knob of the fused clusters). Where nothing is measured (a build's
default knobs), ``AUTO`` keeps the list schedule only if :func:`in_order_makespan`
estimates it no slower than the loop nest's order: greedy list scheduling is not always
better (the bus is shared by the DMA channels, which its plan does not model: it helps
the large prefill clusters and can cost decode GEMVs a few per cent). Measured on whole
programs at default knobs, this choice took SmolLM2's prefill 512 from 67.3 M to 65.2 M
cycles (fp16) and left its decode step within 0.1 % (README, "Lowering").
"""
from __future__ import annotations

import heapq

from ..emulator.costs import command_cycles, dma_estimate
from ..isa import DmaLoad, DmaStore
from .sync import accesses, earlier_sharers, overlap

#: ``npu.list_schedule`` value: list-schedule only if the plan estimates it faster
AUTO = 2


def _covers(lo, hi, plo, phi) -> bool:
    """Whether ``[lo, hi)`` contains ``[plo, phi)`` (False for runtime coordinates)."""
    for a, b, c, d in zip(lo, hi, plo, phi):
        if not all(isinstance(x, int) for x in (a, b, c, d)) or not (a <= c and d <= b):
            return False
    return True


def dependencies(ops, kinds, tcm) -> tuple[list, int]:
    """(preds, nodes): ``preds[n]`` the nodes node ``n`` must follow. Nodes ``0 ..
    len(ops) - 1`` are the ops by position; nodes after them are zero-cost joins (all the
    accesses of a dead buffer's slot, which a buffer placed in its bytes follows)."""
    sharers = earlier_sharers(tcm)
    preds: list = [set() for _ in ops]
    history: dict = {}      # access key -> {(lo, hi): ([writers], [readers])}
    all_of: dict = {}       # (buffer, slot) -> every node that accessed it
    joins: dict = {}        # (buffer, slot) -> its join node
    for n, op in enumerate(ops):
        for key, lo, hi, write in accesses(op, kinds, tcm):
            # a read follows the writes it overlaps; a write follows every access it
            # overlaps, and the ones it covers need not be looked at again: a later access
            # that conflicts with them conflicts with this write, which follows them
            boxes = history.setdefault(key, {})
            for box, (ws, rs) in list(boxes.items()):
                if not overlap(lo, hi, *box):
                    continue
                preds[n].update(ws)
                if write:
                    preds[n].update(rs)
                    if _covers(lo, hi, *box):
                        del boxes[box]
            ws, rs = boxes.setdefault((lo, hi), ([], []))
            (ws if write else rs).append(n)
            preds[n].discard(n)
            if key[0] == "tcm":
                for prev in sharers.get((key[1], key[2]), ()):
                    if prev not in joins:
                        joins[prev] = len(preds)
                        preds.append(set(all_of.get(prev, ())))
                    preds[n].add(joins[prev])
                all_of.setdefault((key[1], key[2]), []).append(n)
    return preds, len(preds)


def estimated_cycles(cmds, spec) -> float:
    """Cycles the commands of one op keep its unit busy: compute by the emulator's
    formulas, a DMA as its set-up plus its bytes at the whole bus's bandwidth."""
    total = 0.0
    for cmd in cmds:
        if isinstance(cmd, (DmaLoad, DmaStore)):
            total += dma_estimate(cmd, spec)
        else:
            total += command_cycles(cmd, spec)
    return total


def list_schedule(ops, units: dict, kinds: dict, tcm: dict, cycles) -> list:
    """``ops`` in the order the simulated units start them (see the module docstring);
    ``units``: op index -> unit, ``cycles(op)``: its estimated cost."""
    preds, nodes = dependencies(ops, kinds, tcm)
    n_ops = len(ops)
    cost = [float(cycles(op)) for op in ops]
    cost += [0.0] * (nodes - n_ops)
    succs: list = [[] for _ in range(nodes)]
    for n, ps in enumerate(preds):
        for p in ps:
            succs[p].append(n)
    # priority: the longest estimated path to the end (joins are numbered after every op,
    # so node order is not a topological order)
    order = _topological(preds, succs, nodes)
    rank = [0.0] * nodes
    for n in reversed(order):
        rank[n] = cost[n] + max((rank[s] for s in succs[n]), default=0.0)
    unit_of = [units[op.index] for op in ops] + [None] * (nodes - n_ops)
    left = [len(ps) for ps in preds]
    ready: dict = {}                       # unit -> heap of (-rank, node)
    free: dict = {}                        # unit -> time it is free
    running: list = []                     # heap of (end, node)
    start = [0.0] * n_ops
    now = 0.0

    def release(n):
        if unit_of[n] is None:             # a join: done as soon as it is ready
            finish(n)
        else:
            heapq.heappush(ready.setdefault(unit_of[n], []), (-rank[n], n))

    def finish(n):
        for s in succs[n]:
            left[s] -= 1
            if left[s] == 0:
                release(s)

    for n in [n for n in range(nodes) if left[n] == 0]:
        release(n)
    done = 0
    while done < n_ops:
        for u, heap in ready.items():
            if heap and free.get(u, 0.0) <= now:
                _, n = heapq.heappop(heap)
                start[n] = now
                free[u] = now + cost[n]
                heapq.heappush(running, (free[u], n))
        if not running:
            raise AssertionError("list scheduling deadlocked: a dependency cycle")
        now, n = heapq.heappop(running)
        done += 1
        finish(n)
        while running and running[0][0] <= now:
            _, m = heapq.heappop(running)
            done += 1
            finish(m)
    return [ops[n] for n in sorted(range(n_ops), key=lambda n: (start[n], n))]


def _topological(preds, succs, nodes) -> list:
    left = [len(ps) for ps in preds]
    stack = [n for n in range(nodes) if left[n] == 0]
    out = []
    while stack:
        n = stack.pop()
        out.append(n)
        for s in succs[n]:
            left[s] -= 1
            if left[s] == 0:
                stack.append(s)
    return out


def in_order_makespan(ops, units: dict, kinds: dict, tcm: dict, cycles, spec) -> float:
    """Estimated cycles of ``ops`` issued in this order, with the costs and dependencies
    :func:`list_schedule` plans with: each unit runs its ops in program order; an op
    starts when its unit is free and every op it depends on has finished, plus the
    spec's ``event_sync_cycles`` when that op ran on another unit (the event the
    emulator charges for a wait). An estimate for choosing between two orders of the
    same ops (``AUTO``), never a measurement."""
    preds, nodes = dependencies(ops, kinds, tcm)
    n_ops = len(ops)
    unit_of = [units[op.index] for op in ops]
    finish = [0.0] * n_ops
    sync = float(spec.event_sync_cycles)
    seen: dict = {}

    def ready(p, u) -> float:
        """When node ``p`` no longer holds back an op on unit ``u``."""
        if p < n_ops:
            return finish[p] + (sync if unit_of[p] != u else 0.0)
        if (p, u) not in seen:         # a join: the last of the accesses it stands for,
            seen[p, u] = max((ready(q, u) for q in preds[p]), default=0.0)  # all earlier
        return seen[p, u]

    free: dict = {}
    for n in range(n_ops):
        u = unit_of[n]
        start = max([free.get(u, 0.0)] + [ready(p, u) for p in preds[n]])
        finish[n] = free[u] = start + float(cycles(ops[n]))
    return max(finish, default=0.0)
