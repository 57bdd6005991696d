"""Fold an ONNX node whose inputs are all constants, by ONNX's reference implementation.

TVM's converters fold some all-constant nodes themselves (arithmetic, Concat, Shape) and
emit run-time ops for others (``ReduceMax`` of a constant, say). A run-time value where a
shape is expected then loses the shape downstream: Cohere's rotary embedding computes a
Reshape target as ``Concat(-1, Unsqueeze(ReduceMax(ConstantOfShape(...))), seq, batch)``,
and TVM's Concat cannot mix a run-time tensor with shapes. Evaluating such nodes with
``onnx.reference`` (ONNX's own executable specification) gives the exact constant the
exporter meant, for every op it implements.
"""

from __future__ import annotations

import numpy as np
import onnx
import tvm
from onnx import helper, numpy_helper
from tvm import relax

#: Ops never folded here: graph inputs and constants (nothing to fold), ops with
#: subgraphs or randomness, and ops TVM's importer gives special meaning.
_NOT_FOLDED = frozenset(
    {"Constant", "If", "Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike",
     "RandomUniformLike", "Multinomial", "Bernoulli", "MatMulNBits"}
)
#: Larger constant inputs are left to TVM: folding is for shape arithmetic, not weights.
MAX_FOLDED_ELEMENTS = 1 << 16
#: numpy dtype kinds folded: integers and booleans (index and shape arithmetic). Float
#: constants (weights, masks' fill values) keep the form TVM's converters give them, which
#: the annotation passes match.
_FOLDED_KINDS = "iub"


def fold_constant_node(node: onnx.NodeProto, inputs, opset: int):
    """The node's single output as a ``relax.Constant`` when every input and the output
    are small integer or boolean constants and ``onnx.reference`` evaluates the node;
    else ``None``."""
    if node.op_type in _NOT_FOLDED or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    arrays = []
    for value in inputs:
        if value is None:
            arrays.append(None)
            continue
        if not isinstance(value, tvm.ir.GenericConst):
            return None
        array = value.value.numpy()
        if array.size > MAX_FOLDED_ELEMENTS or array.dtype.kind not in _FOLDED_KINDS:
            return None
        arrays.append(array)
    if not any(array is not None for array in arrays):
        return None
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if array is not None else "" for i, array in enumerate(arrays)]
    folded = helper.make_node(node.op_type, names, ["out"], **{
        attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute
    })
    graph = helper.make_graph(
        [folded], "fold", [],
        [helper.make_tensor_value_info("out", onnx.TensorProto.UNDEFINED, None)],
        initializer=[numpy_helper.from_array(array, name)
                     for name, array in zip(names, arrays) if array is not None],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        (out,) = ReferenceEvaluator(model).run(None, {})
    except Exception:  # an op the reference lacks or rejects: TVM converts it as before
        return None
    out = np.asarray(out)
    if out.dtype.kind not in _FOLDED_KINDS or out.size > MAX_FOLDED_ELEMENTS:
        return None
    return relax.const(out, str(out.dtype))
