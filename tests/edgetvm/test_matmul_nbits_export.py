"""edgetvm's W4 quantization written as onnxruntime MatMulNBits (matmul_nbits_export.py):
onnxruntime runs the model TVM compiles from the QuantizeW4A16 module, with the same
numbers (the accuracy benchmark relies on it)."""
import pathlib
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from reference_loop import assert_outputs_close, greedy_loop, onnxruntime_model
from tvm import relax

from edgetvm.frontend import import_onnx
from edgetvm.matmul_nbits_export import quantize_matmuls
from edgetvm.relax_passes import QuantizeW4A16
from edgetvm.relax_passes.w4_pack import dequantize_w4
from edgetvm.session import NPUSession

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def _ort(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("zero_points, group", [("float", 32), ("uint4", 64), ("none", 128)])
def test_exported_model_on_onnxruntime_matches_the_pass_compiled_by_tvm(zero_points, group):
    path = DATA / "llama_tiny_prefill_s8.onnx"
    qpass = QuantizeW4A16(group_size=group, zero_points=zero_points)
    model, exported = quantize_matmuls(onnx.load(str(path)), qpass.quantize,
                                       select=lambda k, n: min(k, n) >= qpass.min_features)
    assert len(exported) == 11          # q, o, gate, up, down x 2 layers + lm_head
    assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 11

    imported = import_onnx(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vm = relax.VirtualMachine(tvm.compile(qpass(imported.mod), tvm.target.Target(
            {"kind": "llvm", "num-cores": 2})), tvm.cpu())
    ids = np.random.default_rng(0).integers(1, 512, (1, 8)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, 8), np.int64),
             "position_ids": np.arange(8, dtype=np.int64)[None]}
    want = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in imported.input_names])
    want = (want if isinstance(want, tvm.runtime.Tensor) else want[0]).numpy()
    got = _ort(model).run(["logits"], {n: feeds[n] for n in imported.input_names})[0]
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_tied_lm_head_through_transpose():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((96, 64)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             helper.make_node("MatMul", ["x", "Et"], ["logits"]),
             helper.make_node("Gather", ["E", "ids"], ["emb"])]
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64]),
                        helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 96]),
         helper.make_tensor_value_info("emb", TensorProto.FLOAT, [2, 64])],
        [numpy_helper.from_array(table, "E")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    quantize = QuantizeW4A16(group_size=32, zero_points="float").quantize

    untouched, none = quantize_matmuls(model, quantize)
    assert none == [] and [n.op_type for n in untouched.graph.node] == \
        ["Transpose", "MatMul", "Gather"]

    tied, (lin,) = quantize_matmuls(model, quantize, transposed=True)
    assert [n.op_type for n in tied.graph.node] == ["MatMulNBits", "Gather"]
    assert (lin.k, lin.n) == (64, 96)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    ids = np.array([3, 95], np.int64)
    logits, emb = _ort(tied).run(None, {"x": x, "ids": ids})
    np.testing.assert_allclose(logits, x @ dequantize_w4(lin.w4).T, atol=1e-4, rtol=1e-5)
    np.testing.assert_array_equal(emb, table[ids])          # the gather keeps the table
    # the quantized weight is the table itself (N = vocabulary rows), as an lm_head
    assert np.abs(dequantize_w4(lin.w4) - table).max() < 0.2 * np.abs(table).max()


def test_float_zero_point_matmul_nbits_export_runs_on_the_npu_like_onnxruntime(tmp_path):
    """A MatMulNBits model with float zero points (fp32, as onnxruntime's HQQ writes
    them) imported by the front end: its linears run on the NPU (fp16 zero points) and
    greedy decoding matches onnxruntime on the same file."""
    qpass = QuantizeW4A16(group_size=32, zero_points="float")
    model, exported = quantize_matmuls(onnx.load(str(DATA / "llama_tiny_with_past.onnx")),
                                       qpass.quantize)
    assert len(exported) == 15 and all(lin.w4.zero_point_kind == "float" for lin in exported)
    path = tmp_path / "llama_w4_float_zp.onnx"
    onnx.save(model, str(path))
    session = NPUSession(str(path), max_tokens=64)
    w4 = [r for r in session.regions
          if "w4a16" in {v for k, v in r.attrs.items() if k.endswith("weight_format")}]
    assert {r.kind for r in w4} >= {"linear", "mlp", "lm_head"}      # on the NPU, not the host
    want_run, names, kv = onnxruntime_model(path)
    want, want_calls = greedy_loop(want_run, names, kv, [5, 17, 42, 7], 6)
    got, got_calls = greedy_loop(lambda f: session(f)[0], names, kv, [5, 17, 42, 7], 6)
    assert got == want
    assert_outputs_close(got_calls, want_calls, "float zero points")
