"""Semantic annotation on the real tiny-Llama exports: counts, attributes, coverage,
and numerics of the annotated module against onnxruntime."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from edgetvm import inspect as edge_inspect
from edgetvm.relax_passes import AnnotateLLMSemantics, semantic_report

ort = pytest.importorskip("onnxruntime")

from edgetvm.frontend import import_onnx

# the tiny Llama exports of tests/data (2 layers, hidden 64, 4 query / 2 KV heads of 16,
# intermediate 160, vocab 512; see tests/data/README.md)
MODELS = Path(__file__).resolve().parents[1] / "data"

TARGET = tvm.target.Target({"kind": "llvm", "num-cores": 2})
MAX_ABS_ERR = 1e-4  # measured ~1e-6 on logits of magnitude ~1

# Whole-model counts. RoPE is one region per rotated tensor (q and k separately: 2 per
# layer); "linear" includes the 3 projections inside each MLP region (7 per layer) and
# excludes lm_head. The cos/sin table of RoPE is computed once per call from the positions
# and is not a region: its ops (positions x inv_freq, cos, sin, the attention scaling) stay
# generic, before the first layer.
PREFILL_COUNTS = {
    "embedding": 1, "attention_mask": 1, "rms_norm": 5, "rope": 4, "attention": 2,
    "mlp": 2, "linear": 14, "residual_add": 4, "lm_head": 1,
}
DECODE_COUNTS = {**PREFILL_COUNTS, "kv_append": 4}
LAYER_COUNTS = {"rms_norm": 2, "linear": 7, "rope": 2, "attention": 1, "mlp": 1, "residual_add": 2}

ROPE_TABLE_OPS = {"matmul", "multiply", "cos", "sin"}

MODEL_CASES = {
    # name: (file, expected counts)
    "prefill_s8": ("llama_tiny_prefill_s8.onnx", PREFILL_COUNTS),
    "decode_p8": ("llama_tiny_decode_p8.onnx", DECODE_COUNTS),
    "decode_p8_w4": ("llama_tiny_decode_p8_w4.onnx", DECODE_COUNTS),
    "with_past": ("llama_tiny_with_past.onnx", DECODE_COUNTS),
    "prefill_dynamic": ("llama_tiny_prefill_dynamic.onnx", PREFILL_COUNTS),
    # torch's dynamo exporter: SDPA decomposed, K transposed as (heads, seq, d)
    "prefill_dynamo": ("llama_tiny_prefill_dynamo.onnx", PREFILL_COUNTS),
}


def _import(path) -> tvm.IRModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_onnx(str(path)).mod


_cache: dict = {}


def annotated(name: str) -> tvm.IRModule:
    if name not in _cache:
        file, _ = MODEL_CASES[name]
        _cache[name] = AnnotateLLMSemantics()(_import(MODELS / file))
    return _cache[name]


def _feeds(session, seq_past=(8, 8)):
    rng = np.random.default_rng(0)
    seq, past = seq_past
    sizes = {"batch_size": 1, "batch": 1, "sequence_length": seq, "seq": seq,
             "past_sequence_length": past, "past_sequence_length + sequence_length": past + seq}
    feeds = {}
    for inp in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes[d] for d in inp.shape]
        if inp.name == "input_ids":
            feeds[inp.name] = rng.integers(0, 512, shape).astype("int64")
        elif inp.name == "attention_mask":
            mask = np.ones(shape, "int64")
            mask[..., 0] = 0  # one padded position exercises the mask path
            feeds[inp.name] = mask
        elif inp.name == "position_ids":
            total = shape[-1]
            feeds[inp.name] = np.arange(past, past + total, dtype="int64").reshape(shape)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype("float32")
    return feeds


def _max_abs_err(mod: tvm.IRModule, path) -> float:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = _feeds(session)
    ref = session.run(None, feeds)
    vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(feeds[i.name]) for i in session.get_inputs()])
    outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
    assert len(outs) == len(ref)
    return max(float(np.abs(o.numpy() - r).max()) for o, r in zip(outs, ref))


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_region_counts_and_coverage(name):
    report = semantic_report(annotated(name), dims={"sequence_length": 8,
                                                    "past_sequence_length": 8})
    assert report.counts() == MODEL_CASES[name][1]
    layers = {row.label: row for row in report.layers}
    assert sorted(layers) == ["0", "1", "head", "pre"]
    for label in ("0", "1", "head"):
        assert not layers[label].generic_ops, label
    for label in ("0", "1"):
        for kind, n in LAYER_COUNTS.items():
            assert layers[label].regions[kind] == n, (label, kind)
    assert layers["head"].regions == {"rms_norm": 1, "lm_head": 1}
    # what stays generic is the RoPE table (folded to constants in the fixed-shape folds)
    assert set(layers["pre"].generic_ops) <= ROPE_TABLE_OPS
    assert report.coverage > 0.9995


def test_region_attributes():
    report = semantic_report(annotated("decode_p8"))
    by_kind: dict = {}
    for kind, attrs in report.region_attrs:
        by_kind.setdefault(kind, []).append(attrs)
    for attn in by_kind["attention"]:
        assert (attn["num_heads"], attn["num_kv_heads"], attn["gqa_group"]) == ("4", "2", "2")
        assert (attn["head_dim"], attn["q_len"], attn["kv_len"]) == ("16", "1", "9")
        assert float(attn["scale"]) == pytest.approx(16 ** -0.5, rel=1e-6)
    assert {a["eps"] for a in by_kind["rms_norm"]} == {repr(float(np.float32(1e-6)))}
    assert sorted(a["num_heads"] for a in by_kind["rope"]) == ["2", "2", "4", "4"]
    assert all(a["rotary_dim"] == a["head_dim"] == "16" for a in by_kind["rope"])
    assert sorted(a["cache"] for a in by_kind["kv_append"]) == ["key", "key", "value", "value"]
    assert all(a["past_len"] == "8" and a["total_len"] == "9" for a in by_kind["kv_append"])
    mlp = by_kind["mlp"][0]
    assert (mlp["activation"], mlp["intermediate_size"], mlp["num_linears"]) == ("silu", "160", "3")
    assert by_kind["lm_head"][0]["vocab_size"] == "512"


def test_w4a16_attributes():
    report = semantic_report(annotated("decode_p8_w4"))
    linears = [a for k, a in report.region_attrs if k == "linear"]
    assert len(linears) == 8 and all(a["weight_format"] == "w4a16" for a in linears)
    assert {a["group_size"] for a in linears} == {"32"}
    mlps = [a for k, a in report.region_attrs if k == "mlp"]
    assert all(a[p + "weight_format"] == "w4a16" for a in mlps for p in ("gate_", "up_", "down_"))


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_annotated_module_matches_onnxruntime(name):
    err = _max_abs_err(annotated(name), MODELS / MODEL_CASES[name][0])
    assert err < MAX_ABS_ERR, err


# ------------------------------------------------------------------ generic path


def _mlp_model(path: Path) -> None:
    """A plain 2-layer MLP (Gemm-free MatMul + Add + Tanh): no LLM block."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.3).astype("float32"), "w1"),
        numpy_helper.from_array(rng.standard_normal(32).astype("float32"), "b1"),
        numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.3).astype("float32"), "w2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Mul", ["h3", "h3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def _elementwise_model(path: Path) -> None:
    """Two activations multiplied and reduced: nothing to recognise at all."""
    nodes = [
        helper.make_node("MatMul", ["a", "b"], ["c"]),
        helper.make_node("Sigmoid", ["c"], ["d"]),
        helper.make_node("ReduceSum", ["d"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "generic",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 8]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def test_unknown_architecture_goes_generic(tmp_path, capsys):
    path = tmp_path / "generic.onnx"
    _elementwise_model(path)
    mod = AnnotateLLMSemantics()(_import(path))
    report = semantic_report(mod)
    assert report.counts() == {} and report.coverage == 0.0
    # 2*4*4*8 (matmul) + 16 (sigmoid) + 16 (reduce-sum reads 16 elements)
    assert report.total_flops == 256 + 16 + 16
    assert edge_inspect.main([str(path)]) == 0
    assert "generic: 100% of FLOPs not recognised" in capsys.readouterr().out
    assert _max_abs_err(mod, path) < 1e-5


def test_plain_mlp_partly_recognised_and_numerically_exact(tmp_path):
    path = tmp_path / "mlp.onnx"
    _mlp_model(path)
    mod = AnnotateLLMSemantics()(_import(path))
    report = semantic_report(mod)
    assert report.counts() == {"linear": 2}  # no embedding, so no lm_head
    (row,) = report.layers
    assert row.label == "model" and row.generic_ops == {"tanh": 1, "multiply": 1}
    linear_flops = 2 * 4 * 16 * 32 + 4 * 32 + 2 * 4 * 32 * 8  # bias add counts 1/element
    assert report.recognised_flops == linear_flops
    assert report.total_flops == linear_flops + 4 * 32 + 4 * 8
    assert _max_abs_err(mod, path) < 1e-5


# ------------------------------------------------------------------ CLI


def test_cli_prints_table_coverage_and_npu_share(capsys):
    assert edge_inspect.main([str(MODELS / "llama_tiny_decode_p8.onnx")]) == 0
    out = capsys.readouterr().out
    coverage = float(re.search(r"coverage: ([0-9.]+) %", out).group(1))
    npu_share = float(re.search(r"NPU share: ([0-9.]+) %", out).group(1))
    assert 99.9 < npu_share <= coverage < 100     # the RoPE table stays generic, on the host
    assert "generic (not recognised, on the host): matmulx1 cosx1 sinx1" in out
    assert "FLOPs counted at the model's fixed shapes" in out
    assert "kv_appendx2" in out and "lm_headx1" in out
    assert "recognised, on the host: attention_maskx1" in out


@pytest.mark.parametrize("content", [None, b"not an onnx file"])
def test_cli_bad_input_exits_2(tmp_path, capsys, content):
    path = tmp_path / "bad.onnx"
    if content is not None:
        path.write_bytes(content)
    assert edge_inspect.main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and "Traceback" not in captured.err


def test_cli_names_an_artifact_and_a_kv_capacity_it_cannot_take(tmp_path, capsys):
    """``inspect model.npu`` said "not a readable ONNX model"; --max-tokens past what a
    build takes was accepted."""
    npu = tmp_path / "model.npu"
    npu.write_bytes(b"PK\x03\x04 an artifact")
    assert edge_inspect.main([str(npu)]) == 2
    assert "a built artifact (model.npu); inspect reads the ONNX file" in \
        capsys.readouterr().err
    assert edge_inspect.main([str(MODELS / "llama_tiny_decode_p8.onnx"), "--max-tokens",
                              "100000"]) == 2
    assert "--max-tokens must be in 1..16384" in capsys.readouterr().err


def test_cli_bad_dim_exits_2(tmp_path, capsys):
    path = tmp_path / "generic.onnx"
    _elementwise_model(path)
    assert edge_inspect.main([str(path), "--dim", "seq"]) == 2
    assert "--dim expects NAME=N" in capsys.readouterr().err


# ------------------------------------------------------------------ squared ReLU


def _activation_model(path: Path, square: str) -> None:
    """``MatMul -> Relu -> <square> -> MatMul`` with 2-D (rows, features) activations:
    ``mul`` the ReLU by itself (Nemotron's export), ``pow2`` / ``pow3`` a ``Pow`` by 2 / 3,
    ``two`` the product of the ReLUs of two different projections (a gated ReLU)."""
    rng = np.random.default_rng(3)
    w = {n: numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype("float32"), n)
         for n, s in (("wu", (64, 96)), ("wg", (64, 96)), ("wd", (96, 64)))}
    inits = [w["wu"], w["wd"]]
    nodes = [helper.make_node("MatMul", ["x", "wu"], ["u"]),
             helper.make_node("Relu", ["u"], ["r"])]
    if square == "mul":
        nodes.append(helper.make_node("Mul", ["r", "r"], ["h"]))
    elif square in ("pow2", "pow3"):
        inits.append(numpy_helper.from_array(np.array(float(square[-1]), np.float32), "e"))
        nodes.append(helper.make_node("Pow", ["r", "e"], ["h"]))
    else:
        inits.append(w["wg"])
        nodes += [helper.make_node("MatMul", ["x", "wg"], ["g"]),
                  helper.make_node("Relu", ["g"], ["rg"]),
                  helper.make_node("Mul", ["r", "rg"], ["h"])]
    nodes.append(helper.make_node("MatMul", ["h", "wd"], ["y"]))
    graph = helper.make_graph(
        nodes, "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.parametrize("square, want", [
    ("mul", "relu2"), ("pow2", "relu2"),
    ("pow3", None),            # relu(u) ** 3 is not squared ReLU
    ("two", None),             # relu(u) * relu(g): a gated ReLU, not the square of one
])
def test_squared_relu_is_told_from_its_look_alikes(tmp_path, square, want):
    path = tmp_path / f"{square}.onnx"
    _activation_model(path, square)
    mod = AnnotateLLMSemantics()(_import(path))
    report = semantic_report(mod)
    acts = [a.get("activation") for k, a in report.region_attrs if k in ("mlp", "activation")]
    if want is None:
        assert "relu2" not in acts, acts
    else:
        assert acts == [want], report.region_attrs
    assert _max_abs_err(mod, path) < MAX_ABS_ERR


# ------------------------------------------------------------------ grouped-query repeat


def _gqa_model(path: Path, new_axis: int) -> None:
    """Attention of 4 query heads over 2 KV heads (S = 8, d = 16), K and V repeated by
    ``Reshape(Expand(Unsqueeze(t, new_axis)))``: axis 2 gives query head h KV head h // 2
    (HF's repeat_kv), axis 1 tiles them (h -> h % 2)."""
    s, d = 8, 16
    inits = [numpy_helper.from_array(np.array([new_axis], np.int64), "ax"),    # G = kv = 2
             numpy_helper.from_array(np.array([1, 2, 2, s, d], np.int64), "rep"),
             numpy_helper.from_array(np.array([1, 4, s, d], np.int64), "merged"),
             numpy_helper.from_array(np.array([1, s, 4 * d], np.int64), "out_shape"),
             numpy_helper.from_array(np.array(0.25, np.float32), "scale")]
    nodes = []
    for t in ("k", "v"):
        nodes += [helper.make_node("Unsqueeze", [t, "ax"], [f"{t}5"]),
                  helper.make_node("Expand", [f"{t}5", "rep"], [f"{t}e"]),
                  helper.make_node("Reshape", [f"{t}e", "merged"], [f"{t}r"])]
    nodes += [helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["qk"]),
              helper.make_node("Mul", ["qk", "scale"], ["sc"]),
              helper.make_node("Softmax", ["sc"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vr"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "out_shape"], ["y"])]
    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes, "gqa", [helper.make_tensor_value_info("q", f32, [1, 4, s, d]),
                       helper.make_tensor_value_info("k", f32, [1, 2, s, d]),
                       helper.make_tensor_value_info("v", f32, [1, 2, s, d])],
        [helper.make_tensor_value_info("y", f32, [1, s, 4 * d])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.parametrize("new_axis, recognised", [(2, True), (1, False)])
def test_a_kv_repeat_that_tiles_the_heads_is_not_grouped_query_attention(tmp_path, new_axis,
                                                                         recognised):
    # the NPU kernel gives query head h the KV head h // G; a repeat whose new axis comes
    # before the KV heads (query head h -> KV head h % kv) was taken for one all the same
    path = tmp_path / f"gqa_axis{new_axis}.onnx"
    _gqa_model(path, new_axis)
    mod = AnnotateLLMSemantics()(_import(path))
    attn = [a for k, a in semantic_report(mod).region_attrs if k == "attention"]
    if recognised:
        assert [(a["num_heads"], a["num_kv_heads"], a["gqa_group"]) for a in attn] == \
            [("4", "2", "2")]
    else:
        assert attn == []
    assert _max_abs_err(mod, path) < MAX_ABS_ERR


def test_squared_relu_outside_an_mlp_is_an_ungated_activation(tmp_path):
    # no projections around it (Phi-3-like layouts leave activations to this pass): the
    # product of a ReLU with itself is squared ReLU, not a gated ReLU (no NPU kernel)
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "r"], ["y"])]
    graph = helper.make_graph(
        nodes, "relu2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "relu2.onnx"
    onnx.save(model, str(path))
    mod = AnnotateLLMSemantics()(_import(path))
    assert semantic_report(mod).region_attrs == [
        ("activation", {"activation": "relu2", "gated": "0", "width": "64"})]
    assert _max_abs_err(mod, path) < MAX_ABS_ERR
