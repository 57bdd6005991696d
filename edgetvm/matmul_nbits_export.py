"""Write a W4 quantization of an ONNX model's linears as onnxruntime ``MatMulNBits`` nodes.

Each ``MatMul`` whose weight is a 2-D float initializer ``W (K, N)`` (the set
onnxruntime's own MatMulNBits quantizer takes), and each ``Gemm`` that is ``A @ W (+ C)``
with such a weight (``transB`` allowed; GPT-2's and OPT's linears), becomes
``MatMulNBits(A, B, scales[, zero_points])`` (then ``+ C``) holding exactly the codes,
scales and zero points of the :class:`~edgetvm.relax_passes.w4_pack.W4Weight` a
quantizer function returns, so
onnxruntime runs the quantized model edgetvm would compile (scales and float zero points
are stored in the activation dtype, as MatMulNBits requires; fp16 values are exact in
fp32). With ``transposed=True`` a weight reached through ``Transpose(perm=[1, 0])`` of a
2-D initializer counts too: a tied lm_head (``x @ embedding^T``), which QuantizeW4A16
quantizes and onnxruntime's quantizer does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edgetvm.relax_passes.w4_pack import W4Weight, pack_zero_points

_FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)


@dataclass
class ExportedLinear:
    """One MatMul that became MatMulNBits: its node name, ``K``, ``N`` and the weight."""

    node: str
    k: int
    n: int
    w4: W4Weight


def quantize_matmuls(model: onnx.ModelProto, quantize, transposed: bool = False,
                     select=None, stays_float=None) -> tuple:
    """A copy of ``model`` with its constant-weight MatMuls as MatMulNBits.

    Parameters
    ----------
    model : onnx.ModelProto
        Weights as initializers (external data already loaded).
    quantize : callable
        ``(K, N) float32 array -> W4Weight`` (e.g. ``QuantizeW4A16(...).quantize``).
    transposed : bool
        Also take ``MatMul(x, Transpose(W))`` with a 2-D initializer ``W`` (tied lm_head).
    select : callable, optional
        ``(K, N) -> bool``: which weights to quantize (default all).
    stays_float : callable, optional
        ``weight (K, N) -> bool``: weights to leave float (default none).

    Returns
    -------
    tuple
        ``(model, [ExportedLinear, ...])``.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: node for node in graph.node for o in node.output}
    nodes, exported, new_inits = [], [], []
    for node in graph.node:
        weight_name = _weight_of(node, inits, producers, transposed)
        if weight_name is None:
            nodes.append(node)
            continue
        weight = numpy_helper.to_array(inits[weight_name])
        if node.input[1] != weight_name or _attr(node, "transB", 0):
            weight = weight.T                       # through the Transpose, or Gemm's transB
        k, n = weight.shape
        if select is not None and not select(k, n) or \
                stays_float is not None and stays_float(weight):
            nodes.append(node)
            continue
        w4 = quantize(weight.astype(np.float32))
        if w4.n != n or w4.k != k:
            raise ValueError(f"{node.name}: quantizer returned a {w4.n}x{w4.k} weight for "
                             f"K={k}, N={n}")
        dtype = weight.dtype
        prefix = f"{node.name or weight_name}_w4"
        args = {"B": w4.blocks(), "scales": w4.scales.astype(dtype)}
        if w4.zero_point_kind == "uint4":
            args["zero_points"] = pack_zero_points(w4.zeros)
        elif w4.zero_point_kind == "float":
            args["zero_points"] = w4.zeros.astype(dtype)
        names = []
        for role, arr in args.items():
            names.append(f"{prefix}_{role}")
            new_inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), names[-1]))
        outputs = list(node.output)
        if len(node.input) > 2 and node.input[2]:   # Gemm's C (beta 1): added after
            outputs = [f"{prefix}_product"]
        nodes.append(helper.make_node("MatMulNBits", [node.input[0], *names], outputs,
                                      name=f"{node.name}_Q4", domain="com.microsoft", K=k, N=n,
                                      bits=4, block_size=w4.group_size))
        if outputs != list(node.output):
            nodes.append(helper.make_node("Add", [outputs[0], node.input[2]],
                                          list(node.output), name=f"{node.name}_bias"))
        exported.append(ExportedLinear(node.name, k, n, w4))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(new_inits)
    _drop_unused(graph)
    if not any(o.domain == "com.microsoft" for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return out, exported


def quantized_as_compiled(model: onnx.ModelProto, qpass) -> tuple:
    """``model`` with the linears :class:`~edgetvm.relax_passes.QuantizeW4A16` ``qpass``
    quantizes as MatMulNBits holding its codes: onnxruntime's run of the W4A16 model
    edgetvm compiles (``run --check-onnx`` with ``--quantize``).

    The pass's choice, in ONNX terms: every constant 2-D float weight of a linear (a
    Transpose of an initializer is a constant to the importer) with ``K`` and ``N`` at
    least ``min_features``, but where ``keep_fp16`` names ``lm_head`` the linears as wide
    as the vocabulary (an embedding table's rows that are an output's width: the
    logits'), and where it names ``embedding`` those of them whose weight is an embedding
    table transposed (a tied lm_head). Returns ``(model, exported,
    w4_linears)``: the linears made here and how many W4A16 linears the model then holds
    (MatMulNBits it already had included), for the caller to check against the build's
    own count.
    """
    keep = set(qpass.keep_fp16)
    inits = {i.name: i for i in model.graph.initializer}
    tables = [numpy_helper.to_array(inits[n.input[0]]) for n in model.graph.node
              if n.op_type == "Gather" and n.input[0] in inits and _attr(n, "axis", 0) == 0
              and len(inits[n.input[0]].dims) == 2
              and inits[n.input[0]].data_type in _FLOAT_TYPES]
    widths = {o.type.tensor_type.shape.dim[-1].dim_value for o in model.graph.output
              if o.type.tensor_type.shape.dim}
    vocab = {t.shape[0] for t in tables} & widths

    def stays_float(weight):
        k, n = weight.shape
        return min(k, n) < qpass.min_features or n in vocab and (
            "lm_head" in keep or "embedding" in keep and
            any(t.shape == weight.T.shape and np.array_equal(t, weight.T) for t in tables))

    had = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    out, exported = quantize_matmuls(model, qpass.quantize, transposed=True,
                                     stays_float=stays_float)
    return out, exported, had + len(exported)


def _attr(node, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name),
                default)


def _weight_of(node, inits, producers, transposed: bool):
    """Name of the 2-D float initializer that is ``node``'s weight, or None: a MatMul's, or
    a Gemm's that is a plain ``A @ W (+ C)`` (alpha and beta 1, A not transposed)."""
    if node.op_type == "Gemm":
        if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0 or \
                _attr(node, "beta", 1.0) != 1.0 or node.input[1] not in inits:
            return None
    elif node.op_type != "MatMul" or len(node.input) != 2:
        return None
    name = node.input[1]
    if name not in inits and transposed and name in producers:
        t = producers[name]
        perm = [list(a.ints) for a in t.attribute if a.name == "perm"]
        if t.op_type == "Transpose" and perm in ([[1, 0]], []) and t.input[0] in inits:
            name = t.input[0]
    init = inits.get(name)
    if init is None or len(init.dims) != 2 or init.data_type not in _FLOAT_TYPES:
        return None
    return name


def _drop_unused(graph) -> None:
    """Remove initializers and Transpose nodes no node reads any more."""
    while True:
        used = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
        dead = [n for n in graph.node if n.op_type == "Transpose" and
                not any(o in used for o in n.output)]
        for n in dead:
            graph.node.remove(n)
        if not dead:
            break
    used = {i for node in graph.node for i in node.input}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
