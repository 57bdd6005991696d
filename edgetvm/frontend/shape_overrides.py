"""Fixing some of a model's dynamic input dimensions before import.

ONNX names dynamic dimensions (``dim_param``: ``batch_size``, ``sequence_length``,
``past_sequence_length + sequence_length``); TVM turns each name into one symbolic
``tirx.Var`` and parses ``+ - * //`` expressions. Overrides rewrite the graph inputs of
a copy of the model, so TVM sees the fixed values as ordinary static dimensions and the
remaining names stay symbolic.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import onnx

from edgetvm.errors import ModelImportError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_INTEGER_ARITHMETIC = re.compile(r"[0-9+\-*/ ]+")


def apply_shape_overrides(
    model: onnx.ModelProto, overrides: Mapping[str, int | Sequence[int | str]], source: str
) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have the given dimensions fixed.

    Parameters
    ----------
    model : onnx.ModelProto
        The model; it is not modified.
    overrides : mapping
        Keys are either a symbolic dimension name mapped to an int, fixing it in every
        input and in expressions that use it (``{"batch_size": 1}`` also turns
        ``"past_sequence_length + batch_size"`` into ``"past_sequence_length + 1"``),
        or a graph input name mapped to its full shape (ints, or names for symbolic
        dimensions), e.g. ``{"input_ids": [1, "sequence_length"]}``. Prefer names: a
        dimension fixed in one input but left symbolic in another (batch 1 in
        ``input_ids``, ``batch_size`` in the KV cache) cannot be broadcast by Relax
        and the import fails.
    source : str
        The model's name for error messages.

    Raises
    ------
    ModelImportError
        A key names neither an input nor a dimension, or a shape has the wrong rank.
    """
    model_copy = onnx.ModelProto()
    model_copy.CopyFrom(model)
    graph_inputs = {value.name: value for value in model_copy.graph.input}
    dim_names = {
        name
        for value in graph_inputs.values()
        for dim in value.type.tensor_type.shape.dim
        if dim.dim_param
        for name in _IDENTIFIER.findall(dim.dim_param)
    }
    by_dim_name = {}
    for key, value in overrides.items():
        if key in graph_inputs:
            _set_input_shape(graph_inputs[key], value, source)
        elif key in dim_names:
            if not isinstance(value, int) or value <= 0:
                raise ModelImportError(
                    f"{source}: shape override {key}={value!r} must be a positive int"
                )
            by_dim_name[key] = value
        else:
            raise ModelImportError(
                f"{source}: shape override {key!r} names neither a graph input nor a symbolic "
                f"dimension; inputs: {sorted(graph_inputs)}, dimensions: {sorted(dim_names)}"
            )
    if by_dim_name:
        for value in graph_inputs.values():
            for dim in value.type.tensor_type.shape.dim:
                if dim.dim_param:
                    _substitute(dim, by_dim_name)
    return model_copy


def _set_input_shape(value: onnx.ValueInfoProto, shape, source: str) -> None:
    dims = value.type.tensor_type.shape.dim
    if isinstance(shape, (str, int)) or len(shape) != len(dims):
        raise ModelImportError(
            f"{source}: shape override for input {value.name!r} must have {len(dims)} dimensions, "
            f"got {shape!r}"
        )
    for dim, new in zip(dims, shape):
        if isinstance(new, int):
            dim.dim_value = new
        else:
            dim.dim_param = str(new)


def _substitute(dim: onnx.TensorShapeProto.Dimension, values: Mapping[str, int]) -> None:
    expression = _IDENTIFIER.sub(
        lambda match: str(values.get(match.group(0), match.group(0))), dim.dim_param
    )
    if expression == dim.dim_param:
        return
    if _INTEGER_ARITHMETIC.fullmatch(expression):
        # All names fixed: evaluate left to right like TVM's parser (// for /).
        dim.dim_value = _evaluate(expression)
    else:
        dim.dim_param = expression


def _evaluate(expression: str) -> int:
    tokens = re.split(r"(\+|-|\*|//|/)", expression.replace(" ", ""))
    result = int(tokens[0])
    for operator, operand in zip(tokens[1::2], tokens[2::2]):
        operand = int(operand)
        if operator == "+":
            result += operand
        elif operator == "-":
            result -= operand
        elif operator == "*":
            result *= operand
        else:
            result //= operand
    return result
