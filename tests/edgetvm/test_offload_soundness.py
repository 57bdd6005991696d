"""What the NPU must not take: offload decisions that would give a wrong answer.

A region runs on the NPU only when its kernel computes exactly what the graph computes;
otherwise the host runs it and ``inspect`` says so. Each test builds a case where a
careless offload would be wrong and checks the answer against onnxruntime."""
import pathlib

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from reference_loop import assert_outputs_close, greedy_loop, onnxruntime_model

import edgetvm.session as session_module
from edgetvm.errors import EdgeTVMError
from edgetvm.inspect import inspect_model
from edgetvm.session import NPUSession, _check_causal_mask

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
PROMPT = [5, 17, 42, 7]


def _same_as_onnxruntime(session, path, steps=4):
    run, names, kv = onnxruntime_model(path)
    want, want_calls = greedy_loop(run, names, kv, PROMPT, steps)
    got, got_calls = greedy_loop(lambda f: session(f)[0], names, kv, PROMPT, steps)
    assert got == want
    assert_outputs_close(got_calls, want_calls)


def test_a_gelu_shaped_function_with_other_constants_stays_on_the_host(tmp_path):
    # GPT-2's tanh GELU with 0.1 in place of 0.044715: same graph shape, another function
    model = onnx.load(DATA / "gpt2_tiny_with_past.onnx")
    for node in model.graph.node:
        if node.op_type == "Constant" and node.name.endswith("mlp/act/Constant_2"):
            value = numpy_helper.to_array(node.attribute[0].t)
            assert abs(float(value) - 0.044715) < 1e-6
            node.attribute[0].t.CopyFrom(numpy_helper.from_array(
                np.asarray(0.1, value.dtype), node.attribute[0].t.name))
    path = tmp_path / "not_gelu.onnx"
    onnx.save(model, path)
    session = NPUSession(str(path), max_tokens=64)
    kinds = {r.kind for r in session.regions}
    assert "mlp" not in kinds and "activation" not in kinds     # no GELU kernel for it
    assert "linear" in kinds                                   # its projections still are
    _same_as_onnxruntime(session, str(path))
    _, (report,), _ = inspect_model(str(path))
    generic = {op for row in report.layers for op in row.generic_ops}
    assert {"tanh", "power"} <= generic


def _session_refusing(monkeypatch, kind, family):
    """A session whose offload decision refuses every region of ``kind`` (as if the NPU
    had no kernel for it)."""
    real = session_module.offloadable
    monkeypatch.setattr(session_module, "offloadable", lambda r: r.kind != kind and real(r))
    path = str(DATA / f"{family}_tiny_with_past.onnx")
    return NPUSession(path, max_tokens=64), path


def test_attention_over_host_kv_appends_stays_on_the_host(monkeypatch):
    # KV appends on the host: an NPU attention would read device pages nobody wrote, so
    # the whole-graph check keeps attention on the host too
    session, path = _session_refusing(monkeypatch, "kv_append", "qwen2")
    kinds = {r.kind for r in session.regions}
    assert "attention" not in kinds and "kv_append" not in kinds and "linear" in kinds
    _same_as_onnxruntime(session, path)


def test_host_attention_reads_the_present_of_npu_kv_appends(monkeypatch):
    # attention on the host, KV appends on the NPU: the host attention reads ``present``,
    # which must carry its data
    session, path = _session_refusing(monkeypatch, "attention", "llama")
    kinds = {r.kind for r in session.regions}
    assert "attention" not in kinds and "kv_append" in kinds
    _same_as_onnxruntime(session, path)


def test_every_attention_call_checks_its_mask(monkeypatch):
    seen = []

    def spy(mask, pos, s, index):
        seen.append((mask.shape, pos, s))
        _check_causal_mask(mask, pos, s, index)
    monkeypatch.setattr(session_module, "_check_causal_mask", spy)
    path = str(DATA / "gpt2_tiny_with_past.onnx")
    _same_as_onnxruntime(NPUSession(path, max_tokens=64), path, steps=2)
    assert [(p, s) for _, p, s in seen] == [(0, 4), (0, 4), (4, 1), (4, 1)]   # 2 layers


def _causal(pos, s, fill=np.float32(-3.4e38)):
    total = pos + s
    visible = np.arange(total)[None, :] <= (pos + np.arange(s))[:, None]
    return np.where(visible, 0, fill).astype(np.float32)[None, None]


def test_causal_mask_check():
    _check_causal_mask(_causal(0, 5), 0, 5, 0)
    _check_causal_mask(_causal(7, 3), 7, 3, 0)
    _check_causal_mask(_causal(7, 1, fill=np.float32(-1e9)), 7, 1, 0)
    alibi = _causal(2, 3) - 0.5 * np.arange(5)[None, None, None, ::-1]
    padded = _causal(2, 3)
    padded[..., 0] = np.float32(-3.4e38)
    for bad in (alibi, padded, _causal(2, 3, fill=np.float32(-1.0)), _causal(3, 2)):
        with pytest.raises(EdgeTVMError, match="mask"):
            _check_causal_mask(bad, 2, 3, 0)
