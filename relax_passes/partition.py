"""Fusion partitions: which ops of a phase share a kernel, their intermediates in TCM.

A partition is a list of op groups (indices into ``PhaseGraph.ops``, in program order);
each group becomes one kernel. Only row-local stage ops fuse (norms, linears, activations,
adds, RoPE): embedding, KV append and attention are kernels of their own. Strategies:

``op-library``
    one op per kernel: every intermediate goes through DRAM (a vendor op library);
``regions``
    one kernel per recognised region (a linear, an MLP, a norm): the reference session's
    kernels;
``local``
    TVM ``FuseOps``-style: a matmul takes the elementwise ops that consume its result
    (bias, activation, residual add, RoPE); norms and lone elementwise ops stand alone;
``mega``
    the longest runs of row-local ops whose kernel fits the TCM (power ignored);
``edgellm``
    cut points chosen by measurement (``edgetvm/build/search.py``).

``mega`` needs to know what fits (``fits(group) -> bool``, which lowers the candidate);
``edgellm`` the search that measures candidates (``search(graph) -> groups``).
"""
from __future__ import annotations

STRATEGIES = ("op-library", "regions", "local", "mega", "edgellm")

#: stage ops that only map elements (fusable into the op producing their input)
ELEMENTWISE = {"bias_add", "add", "silu_mul", "gelu_mul", "relu_mul", "relu2_mul", "gelu",
               "scale", "copy", "rope", "mul_vec"}


def _fusable(graph, i) -> bool:
    return graph.ops[i].kind == "stage"


def op_library(graph) -> list:
    return [[i] for i in range(len(graph.ops))]


def regions(graph) -> list:
    """Consecutive stage ops of one region together."""
    groups: list = []
    for i, op in enumerate(graph.ops):
        prev = graph.ops[groups[-1][-1]] if groups else None
        if prev is not None and op.kind == "stage" and prev.kind == "stage" and \
                op.region is not None and op.region == prev.region:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def local(graph) -> list:
    """Each elementwise stage joins the group of the matmul (or the elementwise op joined to
    it) that produced one of its inputs, when that group is the latest one; otherwise it
    stands alone. Norms (reductions) start their own group."""
    producers = {}
    for i, op in enumerate(graph.ops):
        for v in op.outputs.values():
            producers.setdefault(v.tensor, i)
    groups: list = []
    group_of: dict = {}
    for i, op in enumerate(graph.ops):
        joined = False
        if op.kind == "stage" and op.stage.op in ELEMENTWISE and groups:
            srcs = {producers.get(v.tensor) for v in op.inputs.values()}
            last = groups[-1]
            head = graph.ops[last[0]]
            if head.kind == "stage" and head.stage.op.startswith("linear") and \
                    any(group_of.get(s) == len(groups) - 1 for s in srcs if s is not None) and \
                    can_join(graph, last, i):
                last.append(i)
                joined = True
        if not joined:
            groups.append([i])
        group_of[i] = len(groups) - 1
    return groups


def mega(graph, fits) -> list:
    """Greedy: extend the current run with the next row-local op while the kernel fits."""
    groups: list = []
    for i in range(len(graph.ops)):
        if groups and can_join(graph, groups[-1], i) and fits(groups[-1] + [i]):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def can_join(graph, group, i) -> bool:
    """May op ``i`` share a kernel with ``group``? Both row-local over the same rows, and
    what ``i`` reads from the group is a result the group computes whole (a column slice
    of a fused projection, or a tensor two ops write column by column, is read back from
    DRAM: only after the kernel that writes it)."""
    if not (_fusable(graph, i) and all(_fusable(graph, j) for j in group)):
        return False
    if not _rows_match(graph, group[0], i):
        return False
    writers: dict = {}
    for j in group:
        for v in graph.ops[j].outputs.values():
            writers.setdefault(v.tensor, []).append(v)
    for v in graph.ops[i].inputs.values():
        outs = writers.get(v.tensor)
        if outs is None:
            continue
        shape = graph.tensors[v.tensor].shape
        if len(outs) != 1 or not outs[0].is_whole(shape) or not v.is_whole(shape):
            return False
    return True


def _rows_match(graph, i, j) -> bool:
    return graph.ops[i].rows == graph.ops[j].rows


def partition(graph, strategy: str, fits=None, search=None) -> list:
    """The op groups of ``graph`` under ``strategy`` (``fits(group)``: does its kernel fit
    the TCM, for ``mega``; ``search(graph)``: the measured cut-point search, for
    ``edgellm``)."""
    if strategy == "op-library":
        return op_library(graph)
    if strategy == "regions":
        return regions(graph)
    if strategy == "local":
        return local(graph)
    if strategy == "mega":
        if fits is None:
            raise ValueError("mega needs fits(group)")
        return mega(graph, fits)
    if strategy == "edgellm":
        if search is None:
            raise ValueError("edgellm needs search(graph)")
        return search(graph)
    raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
