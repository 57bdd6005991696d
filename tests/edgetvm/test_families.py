"""Every decoder family of tests/data on the NPU, token-exact against onnxruntime.

Each model is a tiny random-weight optimum ``text-generation-with-past`` export (see
tests/data/README.md). Random weights make a wrong kernel visible in the logits even where
greedy ids repeat, so every step's logits and ``present`` outputs are compared too.

The reference is a loop written here: onnxruntime on the ONNX file, its own greedy choice
(argmax of the last position) and its own ``present`` fed back as past. The NPU side runs
the same loop through ``NPUSession`` with a KV page pool handed out in a shuffled order (a
page table that is not the identity), so a page-table bug shows as a wrong answer.

Tolerance: the NPU keeps activations in fp16; max |logits diff| measured 5.1e-3..2.4e-2 on
logits up to ~5 (``python -m edgetvm.run tests/data/<family>_tiny_with_past.onnx
--prompt-ids 5,17,42,7 --max-new-tokens 16 --check-onnx``), allowed
``0.01 + 0.01 * max|reference logits|`` per step.
"""
import pathlib
from collections import Counter

import numpy as np
import pytest
from reference_loop import (assert_outputs_close, greedy_loop, onnxruntime_model,
                            with_random_vectors)

from edgetvm.inspect import inspect_model
from edgetvm.session import NPUSession

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
PROMPT = [5, 17, 42, 7]
NEW_TOKENS = 16            # 4 + 16 tokens: the cache crosses its first 16-token page
MAX_TOKENS = 256           # 16 pages, handed out in a shuffled order

COMMON = {"embedding", "linear", "kv_append", "attention", "residual_add", "lm_head"}
#: family -> (region kinds that must run on the NPU, what the family exercises)
FAMILIES = {
    "llama": (COMMON | {"rms_norm", "rope", "mlp"}, "RMSNorm, RoPE, GQA, SwiGLU"),
    "qwen2": (COMMON | {"rms_norm", "rope", "mlp"}, "q/k/v bias"),
    "gpt2": (COMMON | {"layer_norm", "mlp"},
             "LayerNorm, GELU (tanh) MLP with bias, learned positions, fused c_attn"),
    "gemma": (COMMON | {"rms_norm", "rope", "mlp"},
              "GeGLU, RMSNorm (1 + w), scaled embedding, head_dim 24, MQA"),
    "phi3": (COMMON | {"rms_norm", "rope", "activation"}, "fused qkv and gate_up"),
    "gpt_neox": (COMMON | {"layer_norm", "rope", "mlp"},
                 "parallel residual, partial rotary (4 of 16), fused qkv with bias"),
    "nemotron": (COMMON | {"layer_norm", "rope", "mlp"},
                 "squared-ReLU MLP (no gate), LayerNorm (1 + w), partial rotary (8 of 16)"),
}


def _path(family):
    return str(DATA / f"{family}_tiny_with_past.onnx")


def _npu_session(family):
    pool = [int(p) for p in np.random.default_rng(7).permutation(MAX_TOKENS // 16)]
    return NPUSession(_path(family), "edge-npu-16mb", max_tokens=MAX_TOKENS,
                      kv_page_pool=pool)


def _check_against_reference(family, session, chunk=None):
    ref_run, input_names, kv = onnxruntime_model(_path(family))
    want, ref_calls = greedy_loop(ref_run, input_names, kv, PROMPT, NEW_TOKENS, chunk)
    got, npu_calls = greedy_loop(lambda f: session(f)[0], input_names, kv, PROMPT,
                                 NEW_TOKENS, chunk)
    assert got == want, family
    assert_outputs_close(npu_calls, ref_calls, family)     # logits and every present.*


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_token_exact_on_the_npu(family):
    session = _npu_session(family)
    npu_kinds = {r.kind for r in session.regions}
    assert npu_kinds == FAMILIES[family][0], family
    _check_against_reference(family, session)
    # the cache crossed a page: the pages the sequence got are not 0, 1, ...
    assert session.kv.length == len(PROMPT) + NEW_TOKENS - 1
    assert session.kv.page_table == session.kv.page_pool[:2] != [0, 1]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_npu_share_reported_by_inspect(family):
    _, (report,), dims = inspect_model(_path(family))
    assert dims["past_sequence_length"] == 1023          # counted at the KV capacity
    assert report.npu_share >= 0.95, (family, report.npu_share)
    # attention counted at that length: against an empty cache, q @ k^T and p @ v of every
    # layer (2 x 2 x heads x head_dim per key) account for the difference
    _, (empty,), _ = inspect_model(_path(family), {"past_sequence_length": 0})
    heads_x_dim = {"gemma": 4 * 24}.get(family, 4 * 16)
    assert report.total_flops - empty.total_flops >= 2 * 4 * heads_x_dim * 1023
    # the only recognised region the host keeps is the mask construction (Nemotron's
    # export builds its mask with a Trilu the mask pattern does not know: generic host code
    # before the first layer, which the phase programs check is the causal mask)
    assert report.host_region_counts() == ({} if family == "nemotron" else
                                           {"attention_mask": 1})
    # every op of a layer is in a region: two residual adds per layer (GPT-NeoX's parallel
    # residual adds attention and MLP outputs, then the stream), no generic op left over
    rows = {row.label: row for row in report.layers}
    assert [rows[label].regions.get("residual_add") for label in ("0", "1")] == [2, 2]
    assert all(not rows[label].generic_ops for label in ("0", "1", "head")), family


def test_falcon_attention_that_keeps_its_heads_runs_on_the_npu():
    # Falcon reshapes attention's (batch, heads, seq, d) output to that same shape and
    # merges the heads only after it; the NPU kernel writes its output heads merged,
    # (seq, heads * d): taken for a head merge, that reshape once put the NPU's rows where
    # the model reads heads (logits 3.2 off at the first token). The region's output is
    # now the kernel's, transposed back to heads-major; K and V are picked out of the
    # fused qkv at indices -2 and -1
    session = _npu_session("falcon")
    kinds = Counter(r.kind for r in session.regions)
    assert kinds["attention"] == 2
    assert {"layer_norm", "linear", "mlp", "rope", "kv_append", "lm_head"} <= set(kinds)
    _check_against_reference("falcon", session)


#: families whose import needed a front-end fix: family -> (regions that must run on the NPU,
#: what the export needed). GPT-J's and Cohere's rotary rotates neighbouring pairs (the
#: vector unit's rope_pairs); Cohere's bias-free LayerNorm is spelled out with a
#: reciprocal square root. MPT's attention adds ALiBi's bias and fills the hidden scores
#: (a masked fill, not an added mask): the NPU kernel adds the bias from the slopes
IMPORTED = {
    "gptj": ({"layer_norm", "linear", "attention", "mlp", "kv_append", "lm_head", "rope"},
             "a Tile by a Shape, an Expand of symbolic dims"),
    "cohere": ({"layer_norm", "linear", "attention", "mlp", "kv_append", "rope"},
               "ReduceMax of a constant in a Reshape target"),
    "mpt": ({"layer_norm", "linear", "mlp", "kv_append", "lm_head", "attention"},
            "a Slice from kv_len to INT64_MAX"),
    # not an import fix: two of CodeGen's four appends bring (batch, seq, 4, 1, d) pieces
    # (heads in groups), which stopped the run before; its attention adds the mask before
    # it scales the scores
    "codegen": ({"layer_norm", "linear", "mlp", "lm_head", "attention", "rope", "kv_append"},
                ""),
    # not an import fix either: BLOOM's attention runs on (batch * heads)-row 3-D tensors
    # with its ALiBi bias added before the heads split out, and its GELU factors the inner
    # polynomial; both ran on the host before
    "bloom": ({"layer_norm", "linear", "mlp", "lm_head", "attention", "kv_append"}, ""),
    # XGLM's attention is BLOOM's (batch * heads)-row 3-D form with the scores reshaped
    # back to 4-D for the mask and clamped by Max(scores, finfo.min) before a 3-D softmax:
    # an import fix (ONNX Max was a stack and a reduction no pattern spells) and a
    # pattern; its sinusoidal positions are gathered by flat position ids
    "xglm": ({"layer_norm", "linear", "mlp", "lm_head", "attention", "kv_append"},
             "Max as an elementwise maximum"),
    # StableLM's qk_layernorm: one LayerNorm per head's slice, concatenated back, becomes
    # one LayerNorm with a gain per head (PerHeadLayerNorm): the norm region and its gain
    # on the NPU, not a split, eight norms and a concat per layer on the host
    "stablelm_qk": ({"layer_norm", "linear", "mlp", "lm_head", "attention", "kv_append",
                     "rope"}, ""),
    # ModernBERT-decoder's GLU: one fused projection sliced in two, GELU spelled with the
    # erf of its input over sqrt(2); the gated activation's input is found through that
    # scaling (it was a traceback on the reference path, an internal error compiled)
    "modernbert_decoder": ({"layer_norm", "linear", "lm_head", "attention", "kv_append",
                            "rope", "activation"}, ""),
    # OpenLLaMA clamps its masked 4-D scores by Max(scores, finfo.min), and its tied
    # lm_head is an Einsum("blh,vh->blv"), imported as a matmul (it was TOPI's einsum,
    # which the phase programs could not run)
    "open_llama": ({"rms_norm", "linear", "mlp", "lm_head", "attention", "kv_append",
                    "rope"}, "Einsum as a matmul"),
    # not an import fix: BitNet's gated squared ReLU, relu(gate)^2 * up, had no NPU stage
    # (squared ReLU was ungated only); with its ffn_sub_norm between the product and the
    # down projection it is an activation region of two inputs, then a norm
    "bitnet": ({"rms_norm", "linear", "activation", "lm_head", "attention", "kv_append",
                "rope"}, ""),
    # not an import fix: Gemma-2's attention soft-capping, cap * tanh(scores / cap) between
    # the scores and the mask, was refused (no attention region); now the attention
    # kernel caps its scores (the lm_head, whose logits are soft-capped too, is a linear)
    "gemma2_softcap": ({"rms_norm", "linear", "mlp", "attention", "kv_append", "rope"},
                       "attention soft-capping"),
}


@pytest.mark.parametrize("family", list(IMPORTED))
def test_family_that_needed_an_import_fix(family):
    # before the fixes, each failed to import at all; now the reference path is
    # token-exact, with the regions the NPU has kernels for on the NPU
    session = _npu_session(family)
    kinds = {r.kind for r in session.regions}
    assert IMPORTED[family][0] <= kinds, (family, kinds)
    if family == "codegen":
        assert Counter(r.kind for r in session.regions)["kv_append"] == 4
    if family in ("mpt", "bloom", "xglm", "open_llama"):
        assert Counter(r.kind for r in session.regions)["attention"] == 2
    if family == "stablelm_qk":   # per layer: its two norms, then one for q and one for k
        assert Counter(r.kind for r in session.regions)["layer_norm"] == 2 * 4 + 1
    if family == "bitnet":        # per layer: input, attention-output, MLP and sub norms
        assert Counter(r.kind for r in session.regions)["rms_norm"] == 2 * 4 + 1
    if family == "gemma2_softcap":     # cap 2, inside the tanh 1 / (sqrt(16) * 2)
        caps = [(float(r.attrs["edgetvm.softcap"]), float(r.attrs["edgetvm.scale"]))
                for r in session.regions if r.kind == "attention"]
        assert np.allclose(caps, [(2.0, 0.125)] * 2), caps
    _check_against_reference(family, session)


def test_opt_relu_mlp_and_flattened_rows_on_the_npu():
    # OPT: a ReLU MLP (an NPU ``max`` with 0), and norms and residual adds over rows
    # flattened to (batch * seq, hidden), whose regions take the symbolic row count as a
    # shape argument besides their tensors: all of them on the NPU, not the host
    session = _npu_session("opt")
    on_npu = Counter(r.kind for r in session.regions)
    assert on_npu["mlp"] == 2 and on_npu["layer_norm"] == 5 and on_npu["residual_add"] == 4
    _check_against_reference("opt", session)


def test_chunked_prefill_partial_rotary():
    session = NPUSession(_path("gpt_neox"), "edge-npu-16mb", max_tokens=MAX_TOKENS,
                         row_buckets=(3,))
    _check_against_reference("gpt_neox", session, chunk=3)


def _feeds(names, kv, ids, pos, previous=None):
    """One call's inputs: ``ids`` at ``pos``, the past taken from the ``present.*`` of the
    ``previous`` call's outputs (empty without one)."""
    feeds = {"input_ids": np.array([ids], np.int64),
             "attention_mask": np.ones((1, pos + len(ids)), np.int64),
             "position_ids": np.arange(pos, pos + len(ids), dtype=np.int64)[None]}
    for n, shape in kv.items():
        feeds[n] = np.zeros(shape, np.float32) if previous is None else \
            previous[n.replace("past_key_values", "present")]
    return {k: v for k, v in feeds.items() if k in names}


def test_switching_sequences_at_the_same_length_uploads_the_callers_past(monkeypatch):
    # two prompts of one length through one session, then a decode step of the FIRST: the
    # device pages hold the second's K/V, so the session must notice that the past it is
    # given is not what the device holds, and upload it through the (shuffled) page
    # table; an ordinary greedy loop never uploads, and reset frees the pages
    run, names, kv = onnxruntime_model(_path("llama"))
    session = _npu_session("llama")
    uploads = []
    real_upload = NPUSession._upload_past
    monkeypatch.setattr(NPUSession, "_upload_past",
                        lambda self, *a: uploads.append(a[0]) or real_upload(self, *a))
    want_a = run(_feeds(names, kv, PROMPT, 0))
    got_a = session(_feeds(names, kv, PROMPT, 0))[0]
    session(_feeds(names, kv, [9, 3, 300, 77], 0))
    assert uploads == []                                   # prefills from an empty past
    token = int(np.argmax(want_a["logits"][0, -1]))
    want = run(_feeds(names, kv, [token], len(PROMPT), want_a))
    got = session(_feeds(names, kv, [token], len(PROMPT), got_a))[0]
    assert_outputs_close([got], [want], "llama")
    assert sorted(set(uploads)) == [0, 1]                  # both layers' pasts uploaded
    uploads.clear()
    session.reset()
    assert (session.kv.length, session.kv.page_table, session.kv.layer_len) == (0, [], {})
    greedy_loop(lambda f: session(f)[0], names, kv, PROMPT, 4)
    assert uploads == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_with_random_biases_and_norm_gains(family, tmp_path):
    # the exports' biases are all zero and their norm gains all one: made random here, so
    # a bias or gain the NPU drops, or a gain and bias it swaps, changes the answer
    path = str(tmp_path / f"{family}_random_vectors.onnx")
    drawn = with_random_vectors(_path(family), path)
    assert drawn >= 5
    pool = [int(p) for p in np.random.default_rng(7).permutation(MAX_TOKENS // 16)]
    session = NPUSession(path, "edge-npu-16mb", max_tokens=MAX_TOKENS, kv_page_pool=pool)
    assert {r.kind for r in session.regions} == FAMILIES[family][0], family
    run, names, kv = onnxruntime_model(path)
    want, want_calls = greedy_loop(run, names, kv, PROMPT, 6)
    got, got_calls = greedy_loop(lambda f: session(f)[0], names, kv, PROMPT, 6)
    assert got == want, family
    assert_outputs_close(got_calls, want_calls, family)


def test_a_clamp_that_changes_the_scores_is_not_taken_for_attention(tmp_path, capsys):
    """XGLM's ``Max(scores, fill)`` belongs to the attention only where the fill hides a
    score (<= -1e4: what it raises weighs 0 after the softmax either way). Clamped at -0.5
    it changes the answer (onnxruntime's ids differ from the unclamped model's): the
    compiled path must refuse it, not run the attention without it, and the reference path
    runs the clamp on the host, token-exact."""
    import onnx
    from onnx import numpy_helper

    from edgetvm.run import main

    model = onnx.load(_path("xglm"))
    consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    fills = [consts[n.input[1]] for n in model.graph.node if n.op_type == "Max"]
    assert len(fills) == 2
    for c in fills:
        assert numpy_helper.to_array(c.attribute[0].t) <= -1e38         # finfo.min
        c.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(-0.5, np.float32)))
    path = str(tmp_path / "xglm_clamped.onnx")
    onnx.save(model, path)
    ref_run, input_names, kv = onnxruntime_model(path)
    clamped, _ = greedy_loop(ref_run, input_names, kv, PROMPT, 4)
    plain, _ = greedy_loop(*onnxruntime_model(_path("xglm"))[:3], PROMPT, 4)
    assert clamped != plain
    assert main([path, "--prompt-ids", "5,17,42,7", "--max-new-tokens", "2"]) == 2
    assert "with no NPU kernel; the phase program cannot run it" in capsys.readouterr().err
    session = NPUSession(path, "edge-npu-16mb", max_tokens=MAX_TOKENS)
    assert Counter(r.kind for r in session.regions)["attention"] == 0
    got, _ = greedy_loop(lambda f: session(f)[0], input_names, kv, PROMPT, 4)
    assert got == clamped


@pytest.mark.parametrize("shape, value", [((), 1.9), ((1,), 0.6)])
def test_an_rms_norm_weight_of_one_value_scales_every_column(tmp_path, capsys, shape, value):
    """An RMSNorm weight that is one value (a scalar, or one element; DiffLlama's export
    folds its ``(1 - lambda_init)`` into one) broadcasts over the columns. A scalar was
    taken for no weight (ids as if it were 1, on both paths), one element failed deep in
    numpy. onnxruntime's ids for the edited model differ from the model's own, so a
    dropped weight fails."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(_path("llama"))
    (init,) = [i for i in model.graph.initializer if i.name.endswith("input_layernorm.weight")]
    init.CopyFrom(numpy_helper.from_array(np.full(shape, value, np.float32), init.name))
    _edited_model_is_token_exact(model, "llama", tmp_path, capsys)


def _edited_model_is_token_exact(model, family, tmp_path, capsys, check_session=None):
    """Save ``model``, an edit of ``family``'s export: onnxruntime's ids for it differ from
    the family's own (the edit matters), and the reference path (its session passed to
    ``check_session`` first) and the compiled path give them."""
    import onnx

    from edgetvm.run import main

    path = str(tmp_path / f"{family}_edited.onnx")
    onnx.save(model, path)
    ref_run, input_names, kv = onnxruntime_model(path)
    want, ref_calls = greedy_loop(ref_run, input_names, kv, PROMPT, 8)
    assert want != greedy_loop(*onnxruntime_model(_path(family))[:3], PROMPT, 8)[0]
    session = NPUSession(path, "edge-npu-16mb", max_tokens=MAX_TOKENS)
    if check_session is not None:
        check_session(session)
    got, npu_calls = greedy_loop(lambda f: session(f)[0], input_names, kv, PROMPT, 8)
    assert got == want
    assert_outputs_close(npu_calls, ref_calls, f"{family} edited")
    assert main([path, "--prompt-ids", "5,17,42,7", "--max-new-tokens", "8",
                 "--check-onnx"]) == 0, capsys.readouterr().out


def test_an_attention_the_kernel_does_not_take_is_refused_naming_what_it_computes(
        tmp_path, capsys):
    """A tanh of the masked scores between them and the softmax (not Gemma-2's
    soft-capping, which caps the scores before the mask, and which the kernel computes):
    the attention is not recognised, and the refusal named a KV layout op; it names the
    ops between q @ k^T and the softmax."""
    import onnx
    from onnx import helper

    from edgetvm.run import main

    model = onnx.load(_path("llama"))
    nodes = list(model.graph.node)
    (i, softmax), = [(i, n) for i, n in enumerate(nodes)
                     if n.op_type == "Softmax" and "layers.1" in n.name]
    capped = helper.make_node("Tanh", [softmax.input[0]], ["capped_scores"],
                              name="/model/layers.1/self_attn/SoftCap")
    softmax.input[0] = "capped_scores"
    nodes.insert(i, capped)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    path = str(tmp_path / "llama_capped.onnx")
    onnx.save(model, path)
    onnxruntime_model(path)                                     # a model onnxruntime runs
    assert main([path, "--prompt-ids", "5,17,42,7", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "an attention the NPU kernel does not take: between its scores q @ k^T (ONNX " \
           "node '/model/layers.1/self_attn/MatMul')" in err
    assert "tanh (ONNX node '/model/layers.1/self_attn/SoftCap')" in err


def test_a_layer_that_scales_its_scores_twice_runs_with_its_own_scale(tmp_path, capsys):
    """GPT-J's second layer divides its scores once more, by 3 (as GPT-2's
    ``scale_attn_by_inverse_layer_idx`` divides by the layer's index plus one): the two
    scalings are one (FoldScalarScalings), so the attention is recognised (it was refused),
    and the reference path's attention program is keyed by its scale (one program for
    every layer gave the second layer the first's scale: a wrong answer there)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(_path("gptj"))
    nodes = list(model.graph.node)
    (i, div), = [(i, n) for i, n in enumerate(nodes) if n.op_type == "Div" and
                 "h.1/attn" in n.name and any(m.op_type == "Add" and n.output[0] in m.input
                                              for m in nodes)]
    model.graph.initializer.append(numpy_helper.from_array(np.array(3.0, np.float32),
                                                           "layer_divisor"))
    again = helper.make_node("Div", [div.output[0], "layer_divisor"], ["scores_again"],
                             name="/transformer/h.1/attn/Div_again")
    for n in nodes[i + 1:]:
        n.input[:] = ["scores_again" if x == div.output[0] else x for x in n.input]
    nodes.insert(i + 1, again)
    del model.graph.node[:]
    model.graph.node.extend(nodes)

    def both_attentions_recognised(session):
        assert Counter(r.kind for r in session.regions)["attention"] == 2
    _edited_model_is_token_exact(model, "gptj", tmp_path, capsys, both_attentions_recognised)
