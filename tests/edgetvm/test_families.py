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

import numpy as np
import pytest
from reference_loop import assert_outputs_close, greedy_loop, onnxruntime_model

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
    # the only recognised region the host keeps is the mask construction
    assert report.host_region_counts() == {"attention_mask": 1}


def test_chunked_prefill_partial_rotary():
    session = NPUSession(_path("gpt_neox"), "edge-npu-16mb", max_tokens=MAX_TOKENS,
                         row_buckets=(3,))
    _check_against_reference("gpt_neox", session, chunk=3)
