"""Cut points: a partition's kernel boundaries inside the runs of fusable ops, as the tuner
searches and a tuning log replays them.

A **run** is a maximal sequence of consecutive row-local stage ops over the same rows: the
ops between two kernels of their own template (embedding, KV append, attention). In a
decoder that is the span from one layer's attention to the next layer's KV append (output
projection, residual add, norm, MLP, residual add, the next norm, the QKV projections and
RoPE), so a cluster may cross a layer boundary. Every partition strategy cuts inside runs
only, so a partition is, run by run, a set of **cuts**: positions ``p`` (1 ... len - 1)
where a kernel starts at ``run[p]``.

A run has a structural key (:func:`run_key`): the ops' clusters alone, their wiring
within the run and what is read after it, so the runs of the 30 layers of a model are
one key (one search, one logged choice) and a choice logged for one key is replayed on
every run of that key (:func:`apply_cuts`).
"""
from __future__ import annotations

import logging

from edgetvm.relax_passes.partition import can_join

from .graph import BuildError
from .kernels import stage_cluster

log = logging.getLogger("edgetvm")


def runs(graph) -> list:
    """The runs of ``graph`` (lists of op indices, in program order), including runs of
    one op."""
    out: list = []
    for i, op in enumerate(graph.ops):
        if op.kind != "stage":
            continue
        if out and out[-1][-1] == i - 1 and graph.ops[i - 1].rows == op.rows:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def run_key(graph, run, consumers=None) -> str:
    """The structural key of ``run``: per op its cluster alone (tensors, stage, what is read
    outside it) and where each operand comes from within the run."""
    consumers = graph.consumers() if consumers is None else consumers
    pos = {i: n for n, i in enumerate(run)}
    producer: dict = {}
    for i in run:
        for v in graph.ops[i].outputs.values():
            producer.setdefault(v.tensor, i)
    parts = []
    for i in run:
        op = graph.ops[i]
        try:
            c, _ = stage_cluster(graph, (i,), consumers)
            alone = (c.tensors, c.stages, c.outputs, c.consts)
        except BuildError as e:           # an op that is no kernel alone: its error is its key
            alone = str(e)
        # the views, not the whole tensors: a RoPE table's length follows the build's
        # largest bucket, which kernels (and so their keys) never see
        wiring = tuple((role, pos.get(producer.get(v.tensor), -1), v.shape, v.strides,
                        v.offset) for role, v in sorted(op.inputs.items()))
        parts.append((alone, wiring))
    return repr(("run", parts))


def groups_of(run, cuts) -> list:
    """The op groups of ``run`` cut before the positions ``cuts``."""
    bounds = [0] + sorted(int(p) for p in cuts) + [len(run)]
    return [list(run[a:b]) for a, b in zip(bounds, bounds[1:])]


def cuts_of(run, groups) -> list:
    """The cuts of ``run`` under a partition ``groups`` (every group inside or outside the
    run, as every strategy makes them)."""
    first = {g[0] for g in groups}
    return [p for p in range(1, len(run)) if run[p] in first]


def joinable(graph, group) -> bool:
    """May the ops of ``group`` share one kernel (each joins the ops before it)?"""
    return all(can_join(graph, list(group[:n]), group[n]) for n in range(1, len(group)))


def forced_cuts(graph, run) -> list:
    """Positions where no partition can avoid a cut: the two ops do not join even as a
    pair (a larger group only adds constraints)."""
    return [p for p in range(1, len(run)) if not can_join(graph, [run[p - 1]], run[p])]


def apply_cuts(graph, groups, cuts_for) -> list:
    """``groups`` (a partition of ``graph``) with the cuts ``cuts_for(run key)`` gives (None:
    the run keeps its groups). Cuts that would join ops that may not share a kernel are
    refused with a warning and the run keeps its groups."""
    consumers = graph.consumers()
    replaced: dict = {}                       # first op of a run -> its groups
    inside: set = set()
    for run in runs(graph):
        if len(run) < 2:
            continue
        cuts = cuts_for(run_key(graph, run, consumers))
        if cuts is None:
            continue
        if any(not 0 < int(p) < len(run) for p in cuts):
            raise BuildError(f"cuts {cuts} do not fit a run of {len(run)} ops "
                             f"({graph.ops[run[0]].name} ...)")
        new = groups_of(run, cuts)
        if not all(joinable(graph, g) for g in new):
            log.warning("logged cuts %s of the run at %s join ops that may not share a "
                        "kernel here; the run keeps its partition", cuts,
                        graph.ops[run[0]].name)
            continue
        replaced[run[0]] = new
        inside |= set(run)
    out: list = []
    for g in groups:
        if g[0] in replaced:
            out += [list(x) for x in replaced[g[0]]]
        elif g[0] not in inside:
            out.append(list(g))
    if sorted(i for g in out for i in g) != list(range(len(graph.ops))):
        raise BuildError("the logged cuts do not partition the phase's ops (a group of the "
                         "strategy crosses a run boundary)")
    return out
