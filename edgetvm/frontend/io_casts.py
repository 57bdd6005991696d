"""Casts between float types at a graph's inputs and outputs, folded into the inputs'
and outputs' own types.

A model converted to float16 with its interface kept in float32 (onnxruntime's
``float16.convert_float_to_float16(..., keep_io_types=True)``, the default of its
transformer optimiser) casts every float input to float16 where it enters the graph and
every float output back to float32 where it leaves. The LLM patterns look for the past
KV cache as a graph input read by the concat that grows it, and for the grown cache as
the graph output, so a cast on either side hides them; and the NPU holds activations and
the cache in float16 whatever the interface says. So the casts are folded: the input
takes the type its casts convert to, the output the type its cast converts from. Every
value the graph computes is the one it computed before (a float-to-float cast of an input
is the same rounding wherever it happens); only the interface's float widths change.
"""

from __future__ import annotations

import collections

import onnx
from onnx import TensorProto

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


def _cast_to(node: onnx.NodeProto) -> int | None:
    """The float type a ``Cast`` node converts to, else None."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    to = next((a.i for a in node.attribute if a.name == "to"), None)
    return to if to in _FLOATS else None


def _elem_type(value: onnx.ValueInfoProto) -> int | None:
    t = value.type
    return t.tensor_type.elem_type if t.HasField("tensor_type") else None


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every read of ``old`` in ``graph`` and its subgraphs now reads ``new``."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new
        for attr in node.attribute:
            subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs
            for sub in subgraphs:
                if not any(v.name == old for v in list(sub.input) + list(sub.initializer)):
                    _rename_reads(sub, old, new)


def fold_io_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` itself when no input or output of its graph is cast between float types,
    else a copy in which those casts are folded (see the module's docstring).

    An input is folded when every node that reads it is a ``Cast`` to one and the same
    float type; an output when it is the only use of a ``Cast`` from a float value that
    a node computes (the source's type found by ONNX shape inference)."""
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    outputs = {value.name for value in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in set(node.input):
            readers.setdefault(name, []).append(node)

    fold_in = []
    for value in graph.input:
        if value.name in initializers or value.name in outputs or \
                _elem_type(value) not in _FLOATS:
            continue
        users = readers.get(value.name, [])
        targets = {_cast_to(node) for node in users}
        if users and len(targets) == 1 and None not in targets and \
                targets != {_elem_type(value)} and \
                not any(node.output[0] in outputs for node in users):
            fold_in.append((value.name, targets.pop(), users))

    producer = {out: node for node in graph.node for out in node.output}
    casts_out = [(value.name, producer[value.name]) for value in graph.output
                 if value.name in producer and _cast_to(producer[value.name]) is not None]
    sources = collections.Counter(cast.input[0] for _, cast in casts_out)
    casts_out = [(name, cast) for name, cast in casts_out       # one output per source
                 if cast.input[0] in producer and cast.input[0] not in outputs and
                 sources[cast.input[0]] == 1]
    if not fold_in and not casts_out:
        return model

    source_types = {}
    if casts_out:
        try:
            inferred = onnx.shape_inference.infer_shapes(model)
        except Exception:  # noqa: BLE001 (> 2 GB, or a graph inference rejects): keep them
            inferred = None
        if inferred is not None:
            source_types = {v.name: _elem_type(v) for v in inferred.graph.value_info}
    casts_out = [(name, cast) for name, cast in casts_out
                 if source_types.get(cast.input[0]) in _FLOATS]
    if not fold_in and not casts_out:
        return model

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    drop = set()
    for name, to, users in fold_in:
        next(v for v in graph.input if v.name == name).type.tensor_type.elem_type = to
        for node in users:
            drop.add(node.name or node.output[0])
            _rename_reads(graph, node.output[0], name)
    for name, cast in casts_out:
        source = cast.input[0]
        drop.add(cast.name or cast.output[0])
        out = next(v for v in graph.output if v.name == name)
        out.type.tensor_type.elem_type = source_types[source]
        for node in graph.node:     # the source's producer now writes the output itself
            for i, o in enumerate(node.output):
                if o == source:
                    node.output[i] = name
        _rename_reads(graph, source, name)
    stale = {name for name, _, _ in fold_in} | {cast.input[0] for _, cast in casts_out} | \
        {node.output[0] for _, _, users in fold_in for node in users}
    kept_info = [v for v in graph.value_info if v.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    kept = [n for n in graph.node
            if not (n.op_type == "Cast" and (n.name or n.output[0]) in drop)]
    del graph.node[:]
    graph.node.extend(kept)
    return copy
