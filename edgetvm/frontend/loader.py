"""Reading and validating an ONNX model before any TVM conversion.

Everything a user can get wrong with the input file (missing, not ONNX, truncated,
rejected by ``onnx.checker``, ops edgetvm cannot compile) is detected here and
reported as a :class:`~edgetvm.errors.ModelImportError` that names the file, so that
no protobuf or TVM traceback ever reaches the user.
"""

from __future__ import annotations

import collections
import heapq
import os
from dataclasses import dataclass

import onnx
from google.protobuf.message import DecodeError

from edgetvm.errors import ModelImportError, UnsupportedOpsError

from .matmul_nbits import MATMUL_NBITS_DOMAIN, matmul_nbits_problem

#: ONNX domains whose ops TVM's converter map implements (it ignores the domain).
DEFAULT_DOMAINS = ("", "ai.onnx")


def _top_k_problem(node, initializers) -> str:
    """TopK: in a decoder LLM, a mixture-of-experts router choosing each token's experts
    (GPT-OSS, Qwen-MoE, Mixtral, Granite-MoE all export one per layer). Which expert weights
    a token needs is known only at run time: no static command stream, and no kernel of
    edgetvm's, runs it (TVM's own import of these models goes wrong further on: a VM
    crash on an expert no token was routed to)."""
    return ("a top-k choice, as a mixture-of-experts router makes: edgetvm compiles dense "
            "decoders; routing tokens to experts has no NPU kernel or static program")


#: Ops edgetvm adds to TVM's converter map or refuses although TVM has them, keyed by
#: (domain, op_type), each with a function returning why one particular node cannot be
#: imported (or None).
EDGETVM_OPS = {(MATMUL_NBITS_DOMAIN, "MatMulNBits"): matmul_nbits_problem,
               ("", "TopK"): _top_k_problem}

# TVM's importer handles these itself instead of through its converter map.
_TVM_DIRECTLY_HANDLED = ("Constant", "If")

_EXAMPLES_PER_OP = 3


@dataclass(frozen=True)
class LoadedModel:
    """An ONNX model that passed every check and can be handed to the converter.

    Attributes
    ----------
    model : onnx.ModelProto
        The model (with external data loaded).
    source : str
        How to name the model in messages: its path, or ``"<ModelProto>"``.
    opset : int
        Version of the default (``ai.onnx``) opset.
    """

    model: onnx.ModelProto
    source: str
    opset: int


def load_model(path_or_model) -> LoadedModel:
    """Read an ONNX model, run ``onnx.checker`` and refuse unsupported ops.

    Parameters
    ----------
    path_or_model : str, os.PathLike or onnx.ModelProto
        The ``.onnx`` file, or an already loaded model.

    Returns
    -------
    LoadedModel

    Raises
    ------
    ModelImportError
        The file is missing, unreadable, not ONNX, truncated or fails ``onnx.checker``.
    UnsupportedOpsError
        The model uses ops edgetvm cannot compile (all of them are listed).
    """
    path = None
    if isinstance(path_or_model, onnx.ModelProto):
        model, source = path_or_model, "<ModelProto>"
    elif isinstance(path_or_model, (str, os.PathLike)):
        path = source = os.fspath(path_or_model)
        model = read_onnx_file(path)
    else:
        raise ModelImportError(
            f"import_onnx expects a path or an onnx.ModelProto, got {type(path_or_model).__name__}"
        )
    _check_is_onnx(model, source)
    # Ops first: an op unknown to ONNX itself would otherwise stop at the checker's first
    # complaint, while this lists every op the user has to deal with.
    check_supported_ops(model, source)
    if sort_topologically(model.graph, source):
        path = None  # the checker must see the sorted model, not the file
    _run_checker(model, source, path)
    return LoadedModel(model=model, source=source, opset=default_opset(model))


def read_onnx_file(path: str) -> onnx.ModelProto:
    """Read an ONNX file; a missing, empty, truncated or foreign file is a ModelImportError."""
    if not os.path.exists(path):
        raise ModelImportError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ModelImportError(f"{path}: is a directory, expected an .onnx file")
    if os.path.getsize(path) == 0:
        raise ModelImportError(f"{path}: the file is empty")
    try:
        return onnx.load(path)
    except DecodeError as err:
        import zipfile
        if zipfile.is_zipfile(path):
            raise ModelImportError(
                f"{path}: a zip archive, not an ONNX model (a model.npu that "
                f"python -m edgetvm.build wrote? python -m edgetvm.run runs it)") from None
        # Truncated files and foreign bytes both end here: protobuf cannot tell them apart.
        raise ModelImportError(
            f"{path}: not a readable ONNX model (truncated or not ONNX at all): {err}"
        ) from None
    except onnx.checker.ValidationError as err:
        # a missing external-data file: onnx says where it looked
        raise ModelImportError(f"{path}: cannot read the model's external data: "
                               f"{str(err).strip().splitlines()[0]}") from None
    except (OSError, ValueError, RuntimeError) as err:
        # Missing or unreadable external-data files surface as these.
        raise ModelImportError(f"{path}: cannot read the model: {err}") from None


def _check_is_onnx(model: onnx.ModelProto, source: str) -> None:
    # Arbitrary bytes occasionally parse as an (empty) ModelProto; say so plainly.
    if model.ir_version == 0 or not model.HasField("graph"):
        raise ModelImportError(f"{source}: not an ONNX model (no IR version or no graph)")
    if model.ir_version < 3:
        raise ModelImportError(
            f"{source}: ONNX IR version {model.ir_version} is too old (need >= 3, ONNX 1.1)"
        )


def _outer_names(node: onnx.NodeProto) -> set[str]:
    """Names ``node``'s subgraphs (If/Loop bodies) read from the enclosing graphs: they
    are inputs of the node as much as its listed ones are."""
    produced: set[str] = set()
    read: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for graph in graphs:
            produced.update(i.name for i in graph.input)
            produced.update(i.name for i in graph.initializer)
            for inner in graph.node:
                read.update(n for n in inner.input if n)
                read.update(_outer_names(inner))
                produced.update(inner.output)
            read.update(o.name for o in graph.output)
    return read - produced


def sort_topologically(graph: onnx.GraphProto, source: str = "<ModelProto>") -> bool:
    """Put ``graph``'s nodes in an order where every value is made before it is read,
    keeping the file's order wherever it already is one. Returns whether it moved any.

    ONNX requires the order, but onnxruntime does not, and some tools (the float16
    converter of ``onnxruntime.transformers`` among them) write graphs out of it; such a
    model runs under onnxruntime, so it is taken here rather than refused by the checker.
    A cycle is refused: it names a value that no order can make before it is read.
    """
    nodes = list(graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    deps = []
    for i, node in enumerate(nodes):
        reads = {n for n in node.input if n} | _outer_names(node)
        deps.append({producer[n] for n in reads if n in producer and producer[n] != i})
    if all(d < i for i, ds in enumerate(deps) for d in ds):
        return False
    users: list[list[int]] = [[] for _ in nodes]
    for i, ds in enumerate(deps):
        for d in ds:
            users[d].append(i)
    waiting = [len(ds) for ds in deps]
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)  # the earliest ready node: the file's order where it can
        order.append(i)
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) < len(nodes):
        stuck = next(nodes[i] for i, w in enumerate(waiting) if w > 0)
        raise ModelImportError(
            f"{source}: the graph has a cycle: node {stuck.name or stuck.op_type!r} reads a "
            "value made (through other nodes) from its own output"
        )
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)
    return True


def _run_checker(model: onnx.ModelProto, source: str, path=None) -> None:
    # From the file when there is one: the checker reads it itself (protobuf cannot
    # serialise a loaded model of > 2 GB back, and for SmolLM2-135M, 540 MB, that takes
    # 3.7 s against 0.4 s for the file).
    try:
        onnx.checker.check_model(path if path is not None else model)
    except Exception as err:  # ValidationError, or ValueError/RuntimeError from the C++ side
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelImportError(f"{source}: fails onnx.checker: {first_line}") from None


def default_opset(model: onnx.ModelProto) -> int:
    """Version of the model's default (``ai.onnx``) opset, 1 when none is declared."""
    for opset in model.opset_import:
        if opset.domain in DEFAULT_DOMAINS:
            return int(opset.version)
    return 1


def iter_nodes(graph: onnx.GraphProto):
    """Every node of ``graph`` and of its subgraphs (If/Loop bodies), depth first."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from iter_nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attr.graphs:
                    yield from iter_nodes(subgraph)


def op_key(node: onnx.NodeProto) -> str:
    """``"Op"`` for default-domain ops, ``"domain:Op"`` otherwise."""
    return node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}:{node.op_type}"


def op_histogram(model: onnx.ModelProto) -> dict[str, int]:
    """Number of nodes per op (see :func:`op_key`), most frequent first."""
    counts = collections.Counter(op_key(node) for node in iter_nodes(model.graph))
    return dict(counts.most_common())


def check_supported_ops(model: onnx.ModelProto, source: str = "<ModelProto>") -> None:
    """Refuse a model whose ops edgetvm cannot compile, listing every one of them.

    An op is supported when TVM's Relax ONNX converter map has it (default domain only;
    TVM picks its newest converter version not above the model's opset) or when
    edgetvm adds it (``com.microsoft:MatMulNBits``, in the forms
    :func:`~edgetvm.frontend.matmul_nbits.matmul_nbits_problem` accepts).

    Raises
    ------
    UnsupportedOpsError
        One error for the whole model: per unsupported op its count and up to three
        example node names.
    """
    from tvm.relax.frontend.onnx import onnx_frontend  # heavy; only when importing

    tvm_ops = set(onnx_frontend._get_convert_map()) | set(_TVM_DIRECTLY_HANDLED)
    initializers = {init.name: init for init in model.graph.initializer}
    unsupported: dict[str, list[str]] = collections.defaultdict(list)
    for index, node in enumerate(iter_nodes(model.graph)):
        name = node.name or f"#{index}"
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        edgetvm_op = EDGETVM_OPS.get((domain, node.op_type))
        if edgetvm_op is not None:
            problem = edgetvm_op(node, initializers)
            if problem:
                unsupported[f"{op_key(node)} ({problem})"].append(name)
        elif node.domain not in DEFAULT_DOMAINS or node.op_type not in tvm_ops:
            unsupported[op_key(node)].append(name)
    if unsupported:
        lines = []
        for op, names in sorted(unsupported.items(), key=lambda item: (-len(item[1]), item[0])):
            examples = ", ".join(names[:_EXAMPLES_PER_OP])
            more = ", ..." if len(names) > _EXAMPLES_PER_OP else ""
            lines.append(f"  {op}: {len(names)} node(s), e.g. {examples}{more}")
        total = sum(len(names) for names in unsupported.values())
        raise UnsupportedOpsError(
            f"{source}: {len(unsupported)} unsupported op type(s) in {total} node(s):\n"
            + "\n".join(lines)
        )
