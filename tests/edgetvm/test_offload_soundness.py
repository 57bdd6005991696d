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
from edgetvm.session import NPUSession, _mask_slopes

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
    # u + 0.1 u^3 adds a projection's output to a value computed from it: not a residual
    rows = [row for row in report.layers if row.label in ("0", "1")]
    assert [(row.regions["residual_add"], row.generic_ops["add"]) for row in rows] == [(2, 2)] * 2


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

    def spy(mask, pos, s, index, heads):
        seen.append((mask.shape, pos, s))
        return _mask_slopes(mask, pos, s, index, heads)
    monkeypatch.setattr(session_module, "_mask_slopes", spy)
    path = str(DATA / "gpt2_tiny_with_past.onnx")
    _same_as_onnxruntime(NPUSession(path, max_tokens=64), path, steps=2)
    assert [(p, s) for _, p, s in seen] == [(0, 4), (0, 4), (4, 1), (4, 1)]   # 2 layers


def _causal(pos, s, fill=np.float32(-3.4e38)):
    total = pos + s
    visible = np.arange(total)[None, :] <= (pos + np.arange(s))[:, None]
    return np.where(visible, 0, fill).astype(np.float32)[None, None]


def test_causal_mask_check():
    """``(slopes, window)``: the causal mask alone, ALiBi's, a sliding window; anything
    else refused."""
    assert _mask_slopes(_causal(0, 5), 0, 5, 0, 4) == (None, None)
    assert _mask_slopes(_causal(7, 3), 7, 3, 0, 4) == (None, None)
    assert _mask_slopes(_causal(7, 1, fill=np.float32(-1e9)), 7, 1, 0, 4) == (None, None)
    # ALiBi (MPT's: 0 at the last key) gives the attention its slopes
    alibi = _causal(2, 3) - 0.5 * np.arange(5)[None, None, None, ::-1]
    slopes, window = _mask_slopes(alibi, 2, 3, 0, 4)
    np.testing.assert_allclose(slopes, [0.5] * 4)
    assert window is None
    # keys 4 or more behind the query hidden too: a window of 4
    windowed = _causal(6, 3)
    behind = (6 + np.arange(3))[:, None] - np.arange(9)[None, :]
    windowed[..., behind >= 4] = np.float32(-3.4e38)
    assert _mask_slopes(windowed, 6, 3, 0, 4) == (None, 4)
    padded = _causal(2, 3)
    padded[..., 0] = np.float32(-3.4e38)
    holed = windowed.copy()
    holed[..., 0, 5] = np.float32(-3.4e38)        # a key inside the window hidden
    for bad, pos, s in ((padded, 2, 3), (holed, 6, 3), (_causal(2, 3, fill=np.float32(-1.0)),
                                                        2, 3), (_causal(3, 2), 2, 3)):
        with pytest.raises(EdgeTVMError, match="mask"):
            _mask_slopes(bad, pos, s, 0, 4)


def _set_constant(model, output_name, value):
    node = next(n for n in model.graph.node if n.output[0] == output_name)
    old = numpy_helper.to_array(node.attribute[0].t)
    node.attribute[0].t.CopyFrom(numpy_helper.from_array(np.asarray(value, old.dtype),
                                                         node.attribute[0].t.name))
    return old


def _region_kinds_of_edited(model, path):
    """Save the edited ``model`` at ``path``, check it runs as onnxruntime does, and return
    the kinds of the regions the NPU took."""
    onnx.save(model, path)
    session = NPUSession(str(path), max_tokens=64)
    _same_as_onnxruntime(session, str(path))
    return {r.kind for r in session.regions}


@pytest.mark.parametrize("op, operand, value", [("Pow", 1, 4.0), ("Div", 0, 2.0)])
def test_an_rms_norm_shaped_function_with_other_constants_stays_on_the_host(
        tmp_path, op, operand, value):
    # Llama's RMSNorm with mean(x^4) in place of mean(x^2), or 2 / sqrt(...) in place of
    # 1 / sqrt(...): the same graph shape, another function; the NPU rms_norm kernel would
    # compute x / rms(x) * w regardless
    model = onnx.load(DATA / "llama_tiny_with_past.onnx")
    changed = 0
    for node in model.graph.node:
        if node.op_type == op and "norm/" in node.name:
            old = _set_constant(model, node.input[operand], value)
            assert float(old) == {"Pow": 2.0, "Div": 1.0}[op]
            changed += 1
    assert changed == 5                                  # 2 per layer + the final norm
    kinds = _region_kinds_of_edited(model, tmp_path / "not_rms_norm.onnx")
    assert "rms_norm" not in kinds and {"attention", "mlp", "rope"} <= kinds


def test_a_rotation_by_other_than_half_the_head_stays_on_the_host(tmp_path):
    # Llama's rotate_half(x) = concat(-x[..., 8:], x[..., :8]) rebuilt as
    # concat(-x[..., 4:], x[..., :4]): the RoPE graph shape with other slices, another
    # function; the NPU rope kernel rotates by halves
    model = onnx.load(DATA / "llama_tiny_with_past.onnx")
    model.graph.initializer.append(numpy_helper.from_array(np.array([4], np.int64), "four"))
    bounds = {"Slice": 2, "Slice_1": 1, "Slice_2": 2, "Slice_3": 1}   # q, k: end / start
    changed = 0
    for node in model.graph.node:
        layer, _, name = node.name.rpartition("/")
        if node.op_type == "Slice" and layer.endswith("self_attn") and name in bounds:
            node.input[bounds[name]] = "four"
            changed += 1
    assert changed == 8                                  # q and k, 2 slices, 2 layers
    kinds = _region_kinds_of_edited(model, tmp_path / "not_rope.onnx")
    assert "rope" not in kinds and {"attention", "kv_append", "mlp"} <= kinds


def test_inspect_counts_a_refused_attention_on_the_host(monkeypatch):
    # attention refused: its FLOPs (at least q @ k^T and p @ v of both layers at the KV
    # capacity: 2 matmuls x 2 x 4 heads x 16 x 1023 keys per layer) leave the NPU share
    import edgetvm.npu_regions as npu_regions
    path = str(DATA / "llama_tiny_with_past.onnx")
    _, (full,), _ = inspect_model(path)
    real = npu_regions.offloadable
    monkeypatch.setattr(npu_regions, "offloadable", lambda r: r.kind != "attention" and real(r))
    _, (report,), dims = inspect_model(path)
    assert dims["past_sequence_length"] == 1023
    assert report.host_region_counts() == {"attention_mask": 1, "attention": 2}
    attention_matmuls = 2 * (2 * 2 * 4 * 16 * 1023)
    assert report.recognised_flops == full.recognised_flops        # still recognised
    assert report.recognised_flops - report.npu_flops >= attention_matmuls
    assert full.npu_flops - report.npu_flops >= attention_matmuls


def test_npu_attention_of_a_later_layer_reads_its_own_layers_pages(monkeypatch):
    # the first layer's attention refused (as a layer of another form would be), the
    # second's on the NPU: that one is the first NPU attention call of each step, and must
    # still read layer 1's pages
    real = session_module.offloadable
    first = {}

    def offload(r):
        if r.kind == "attention" and first.setdefault("index", r.index) == r.index:
            return False
        return real(r)
    monkeypatch.setattr(session_module, "offloadable", offload)
    path = str(DATA / "llama_tiny_with_past.onnx")
    session = NPUSession(path, max_tokens=64)
    assert sum(r.kind == "attention" for r in session.regions) == 1
    assert sum(r.kind == "kv_append" for r in session.regions) == 4
    _same_as_onnxruntime(session, path)


def test_a_partial_rotation_of_other_dimensions_stays_on_the_host(tmp_path):
    # GPT-NeoX's partial rotary concat(rotate(x[..., :4]), x[..., 4:]) rebuilt as
    # concat(rotate(x[..., 12:]), x[..., :12]): the partial-RoPE graph shape, another
    # function; the NPU path rotates the first rotary_dim dimensions and appends the rest
    model = onnx.load(DATA / "gpt_neox_tiny_with_past.onnx")
    for name, value in (("twelve", 12), ("sixteen", 16), ("zero", 0)):
        model.graph.initializer.append(numpy_helper.from_array(np.array([value], np.int64),
                                                               name))
    # rotated part (q: Slice_3, k: Slice_5) and pass-through part (Slice_4, Slice_6)
    bounds = {"Slice_3": ("twelve", "sixteen"), "Slice_5": ("twelve", "sixteen"),
              "Slice_4": ("zero", "twelve"), "Slice_6": ("zero", "twelve")}
    changed = 0
    for node in model.graph.node:
        layer, _, name = node.name.rpartition("/")
        if node.op_type == "Slice" and layer.endswith("attention") and name in bounds:
            node.input[1], node.input[2] = bounds[name]
            changed += 1
    assert changed == 8                                  # q and k, 2 slices, 2 layers
    path = tmp_path / "other_partial_rotary.onnx"
    onnx.save(model, path)
    session = NPUSession(str(path), max_tokens=64)
    _same_as_onnxruntime(session, str(path))
    # the NPU may rotate the 4 sliced-out dimensions as a whole (a full RoPE of width 4);
    # the concat with the other 12 stays on the host
    ropes = [(r.attrs["edgetvm.head_dim"], r.attrs["edgetvm.rotary_dim"])
             for r in session.regions if r.kind == "rope"]
    assert ropes == [("4", "4")] * 4


def test_attention_uses_the_graphs_scale(tmp_path):
    # Llama scales q and k^T by sqrt(1 / sqrt(16)) = 0.5 each: head_dim ** -0.5 overall;
    # with 0.7 each the scale is 0.49, which the NPU kernel must use, not head_dim ** -0.5
    model = onnx.load(DATA / "llama_tiny_with_past.onnx")
    changed = 0
    for node in model.graph.node:
        if node.op_type == "Mul" and node.name.split("/")[-1] in ("Mul_8", "Mul_9") and \
                "self_attn" in node.name:
            assert float(_set_constant(model, node.input[1], 0.7)) == 0.5
            changed += 1
    assert changed == 4                                   # q and k, 2 layers
    path = tmp_path / "scaled.onnx"
    onnx.save(model, path)
    session = NPUSession(str(path), max_tokens=64)
    scales = [float(r.attrs["edgetvm.scale"]) for r in session.regions if r.kind == "attention"]
    assert scales == pytest.approx([0.49, 0.49], rel=1e-6)
    _same_as_onnxruntime(session, str(path))
