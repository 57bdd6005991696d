"""Activation regions on the NPU: the kernel computes the function the graph spells (GELU
erf form or tanh approximation), and a gated kernel gets the gate as its first input.

References: numpy from the definitions; the graphs are built here with onnx.helper."""
import math
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper

from edgetvm.session import NPUSession, _kernel_input_order


def _gelu_model(path, form):
    """y = GELU(x) spelled as exporters do: the tanh approximation (GPT-2's gelu_new) or
    the erf form; no other op, so the activation is a standalone region."""
    c = lambda name, v: numpy_helper.from_array(np.asarray(v, np.float32), name)  # noqa: E731
    if form == "gelu_tanh":
        inits = [c("three", 3.0), c("c2", 0.044715), c("c1", math.sqrt(2 / math.pi)),
                 c("one", 1.0), c("half", 0.5)]
        nodes = [helper.make_node("Pow", ["x", "three"], ["x3"]),
                 helper.make_node("Mul", ["c2", "x3"], ["a"]),
                 helper.make_node("Add", ["x", "a"], ["b"]),
                 helper.make_node("Mul", ["c1", "b"], ["cb"]),
                 helper.make_node("Tanh", ["cb"], ["t"]),
                 helper.make_node("Add", ["one", "t"], ["o"]),
                 helper.make_node("Mul", ["half", "x"], ["h"]),
                 helper.make_node("Mul", ["h", "o"], ["y"])]
    else:
        inits = [c("root2", math.sqrt(2)), c("one", 1.0), c("half", 0.5)]
        nodes = [helper.make_node("Div", ["x", "root2"], ["s"]),
                 helper.make_node("Erf", ["s"], ["e"]),
                 helper.make_node("Add", ["e", "one"], ["o"]),
                 helper.make_node("Mul", ["x", "o"], ["xo"]),
                 helper.make_node("Mul", ["xo", "half"], ["y"])]
    graph = helper.make_graph(
        nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.parametrize("form", ["gelu_tanh", "gelu"])
def test_gelu_kernel_is_the_function_the_graph_spells(tmp_path, form):
    # the two GELUs differ by up to 45 % of the value at x in [-4, -3] (tanh form:
    # -7.0e-5 at x = -4, erf form: -1.27e-4); both are exact to fp16 rounding on the NPU
    path = tmp_path / f"{form}.onnx"
    _gelu_model(path, form)
    session = NPUSession(str(path))
    assert [(r.kind, r.attrs["edgetvm.activation"]) for r in session.regions] == \
        [("activation", form)]
    x = (np.arange(512, dtype=np.float32) / 64 - 4).reshape(1, 8, 64)   # -4 .. 4, fp16-exact
    out, meter = session({"x": x})
    if form == "gelu_tanh":
        want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    else:
        want = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert meter.kernels == 1
    np.testing.assert_allclose(out["y"], want, rtol=2e-3, atol=2e-6)



_GATED_UP_FIRST = """
@R.function(private=True)
def main(u: R.Tensor((1, 8, 64), dtype="float32"), g: R.Tensor((1, 8, 64), dtype="float32")):
    R.func_attr({"Composite": "edgetvm.activation", "edgetvm.activation": "silu",
                 "edgetvm.gated": "1"})
    with R.dataflow():
        lv = R.sigmoid(g)
        lv1 = R.multiply(g, lv)
        gv = R.multiply(u, lv1)
        R.output(gv)
    return gv
"""


def test_gated_activation_kernel_takes_the_gate_first_whatever_the_parameter_order():
    # pattern fusion orders a region's parameters by first use, which puts the gate first
    # in every export seen so far; the binding must not rely on it: here the multiplier is
    # parameter 0 and the gate (the sigmoid's operand) parameter 1
    region = SimpleNamespace(kind="activation", attrs={"edgetvm.gated": "1"},
                             func=tvm.script.from_source(_GATED_UP_FIRST),
                             runtime_positions=[0, 1])
    assert _kernel_input_order(region)(2) == [1, 0]
