"""End to end: ONNX LLM exports compiled for the NPU and run on the emulator, checked
against onnxruntime (the reference)."""
import os

import numpy as np
import onnxruntime as ort
import pytest

from edgetvm.errors import EdgeTVMError
from edgetvm.generate import KVSpec, feeds_for, greedy, onnxruntime_runner, tokens_of
from edgetvm.run import compare_logits, main
from edgetvm.session import NPUSession

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WITH_PAST = os.path.join(REPO, "examples", "llama_tiny_with_past.onnx")
DATA = os.path.join(REPO, "tests", "data")
ATOL, RTOL = 1e-2, 1e-2


def _data(name):
    return os.path.join(DATA, name)


@pytest.fixture(scope="module")
def session():
    return NPUSession(WITH_PAST, "edge-npu-16mb", max_tokens=256)


@pytest.fixture(scope="module")
def kv():
    return KVSpec.of(WITH_PAST)


def test_generation_matches_onnxruntime_across_page_and_bucket_boundaries(session, kv):
    prompt = list(range(3, 17))                        # 14 tokens: 1 KV page of 16
    recs = greedy(session, kv, prompt, 6)              # the cache grows to 20 tokens
    ref = greedy(onnxruntime_runner(WITH_PAST), kv, prompt, 6)
    assert tokens_of(recs) == tokens_of(ref)
    ok, worst, allowed = compare_logits(recs, ref, ATOL, RTOL)
    assert ok, (worst, allowed)
    # decode crossed a KV page (16 tokens) and the decode capacity bucket (1 -> 2 pages)
    assert session.kv.length == 19 and len(session.kv.page_table) == 2
    assert {"decode_attention"} <= {k[0] for k in session._programs if isinstance(k, tuple)}
    assert {k[1] for k in session._programs if k[0] == "decode_attention"} >= {1, 2}
    assert all(r.npu_cycles > 0 for r in recs)


def test_chunked_prefill_one_static_program(kv):
    s = NPUSession(WITH_PAST, "edge-npu-16mb", max_tokens=256, row_buckets=(8,))
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, 2048, 21)]
    recs = greedy(s, kv, prompt, 3, chunk=8)
    ref = greedy(onnxruntime_runner(WITH_PAST), kv, prompt, 3, chunk=8)
    assert tokens_of(recs) == tokens_of(ref)
    assert [r.phase for r in recs[:3]] == ["prefill"] * 3        # 8 + 8 + 5 tokens
    assert compare_logits(recs, ref, ATOL, RTOL)[0]
    prefill_keys = {k for k in s._programs if k[0] == "prefill_attention"}
    assert {k[1] for k in prefill_keys} == {8}                  # every chunk: 8-row program


def test_kv_append_writes_do_not_grow_with_past(session, kv):
    session.reset()
    recs = []

    def keep(rec):
        recs.append(dict(session.meter.write_bytes_by_kind))
    greedy(session, kv, [5, 6, 7], 40, on_step=keep)
    kv_bytes = [r["kv_append"] for r in recs[1:]]               # decode steps, past 3..41
    per_token = 2 * 2 * session.kv.kv_heads * session.kv.head_dim * 2  # layers x K,V x fp16
    assert kv_bytes[0] == kv_bytes[-1] == per_token


def test_padded_attention_mask_is_refused(session, kv):
    feeds = feeds_for(kv, [1, 2, 3], 0, None)
    feeds["attention_mask"][0, 0] = 0
    with pytest.raises(EdgeTVMError, match="attention_mask"):
        session(feeds)


def test_a_sliding_window_is_masked_where_it_hides_keys():
    """Mistral with a 24-token window: its mask is causal for the first 24 positions, then
    hides the oldest keys. The reference path finds the window in each call's mask and
    runs the attention kernel with it: a 30-token prompt and 12 new tokens (it refused
    the prompt, naming the window) give onnxruntime's ids, every step's logits within
    tolerance."""
    path = _data("mistral_sw24_tiny_with_past.onnx")
    s = NPUSession(path, max_tokens=64)
    kv = KVSpec.of(path)
    ref = onnxruntime_runner(path)
    prompt = [(7 * i) % 500 + 3 for i in range(30)]
    got, want = (greedy(r, kv, prompt, 12) for r in (s, ref))
    assert tokens_of(got) == tokens_of(want)
    ok, worst, allowed = compare_logits(got, want, 0.01, 0.01)
    assert ok, (worst, allowed)


@pytest.mark.parametrize("name", ["llama_tiny_decode_p8.onnx", "llama_tiny_prefill_s8.onnx",
                                  "llama_tiny_prefill_dynamic.onnx",
                                  "llama_tiny_prefill_dynamo.onnx",
                                  "llama_tiny_decode_p8_w4.onnx",
                                  "llama_tiny_decode_p8_w4_g64_zp.onnx"])
def test_other_exports_match_onnxruntime(name):
    path = _data(name)
    s = NPUSession(path)
    ref_sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in ref_sess.get_inputs():
        shp = [d if isinstance(d, int) else (1 if "batch" in str(d) else 6) for d in i.shape]
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(0, 512, shp).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones(shp, np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = (np.arange(shp[1]) + (8 if shp[1] == 1 else 0))[None]
        else:
            feeds[i.name] = rng.standard_normal(shp).astype(np.float32)
    out, meter = s(feeds)
    ref = ref_sess.run(None, feeds)[0]
    assert np.abs(out["logits"] - ref).max() <= ATOL + RTOL * np.abs(ref).max()
    kinds = {r.kind for r in s.regions}
    assert {"embedding", "linear", "mlp", "lm_head", "attention", "rms_norm", "rope",
            "residual_add"} <= kinds
    if "w4" in name:           # every projection runs as W4A16 on the NPU, none on the host
        w4 = [r for r in s.regions if r.attrs.get("edgetvm.weight_format") == "w4a16" or
              r.attrs.get("edgetvm.gate_weight_format") == "w4a16"]
        assert len(w4) == sum(r.kind in ("linear", "mlp", "lm_head") for r in s.regions) == 11
    assert meter.cycles > 0 and meter.kernels >= 20


def test_w4a16_export_moves_fewer_bytes_than_fp32_export():
    meters = []
    for name in ("llama_tiny_decode_p8.onnx", "llama_tiny_decode_p8_w4.onnx"):
        path = _data(name)
        s = NPUSession(path)
        kv = KVSpec.of(path)
        feeds = feeds_for(kv, [7], 8, {n: np.zeros((1, kv.kv_heads, 8, kv.head_dim),
                                                   np.float32)
                                       for names in kv.names for n in names[2:]})
        meters.append(s(feeds)[1])
    assert meters[1].dram_read_bytes < 0.45 * meters[0].dram_read_bytes
    assert meters[1].cycles < meters[0].cycles


def test_run_cli_check_onnx(capsys):
    assert main([WITH_PAST, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "3",
                 "--check-onnx"]) == 0
    out = capsys.readouterr().out
    assert "ids identical" in out and "decode" in out and "npu_us" in out


def test_run_cli_bad_input(capsys, tmp_path):
    bad = tmp_path / "x.onnx"
    bad.write_bytes(b"not onnx")
    assert main([str(bad), "--prompt-ids", "1,2"]) == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([WITH_PAST, "--prompt-ids", "a,b"])


def test_smollm2_capital_of_france():
    root = os.environ.get("EDGETVM_SMOLLM2", os.path.join(REPO, "..", "smollm2"))
    path = os.path.join(root, "optimum_with_past", "model.onnx")
    if not os.path.exists(path):
        pytest.skip(f"SmolLM2 export not found at {path} (build it with "
                    f"shared/tools/models/make_smollm2.sh or set EDGETVM_SMOLLM2)")
    s = NPUSession(path, max_tokens=64)
    recs = greedy(s, KVSpec.of(path), [1, 504, 3575, 282, 4649, 314], 2)
    assert tokens_of(recs) == [7042, 30]                 # " Paris", as onnxruntime


@pytest.mark.parametrize("k, n, block, zero_points, bias", [
    (96, 40, 32, "uint4", True),      # 3 blocks: the odd zero point in a padded byte
    (80, 48, 64, None, True),          # K not a multiple of the block: padded on the NPU
    (256, 16, 128, "uint4", False),
    (64, 16, 32, "float", True),       # float (fp16) zero points, dequantised by the Mma
])
def test_matmul_nbits_on_the_npu_matches_numpy(k, n, block, zero_points, bias):
    # MatMulNBits alone, as a linear region on the NPU: its packed weight, scales, uint4
    # or float zero points and bias bound to the W4A16 kernel, against numpy from the op's definition
    from test_frontend import matmul_nbits_model
    model, weight, bias_value = matmul_nbits_model(k, n, block, zero_points, bias)
    s = NPUSession(model)
    a = np.random.default_rng(1).standard_normal((2, 3, k)).astype(np.float32)
    out, meter = s({"A": a})
    want = a.astype(np.float64) @ weight.T + bias_value
    assert np.abs(out["Y"] - want).max() <= ATOL + RTOL * np.abs(want).max()
    assert [r.kind for r in s.regions] == ["linear"]
    assert meter.kernels == 1


def test_negative_token_ids_index_from_the_end_like_onnx_gather(session, kv):
    # ONNX Gather: an index -i is vocab - i; the NPU embedding DMA's offset must wrap too
    session.reset()
    ref = ort.InferenceSession(WITH_PAST, providers=["CPUExecutionProvider"])
    names = [o.name for o in ref.get_outputs()]
    for ids in ([5, -1, 42, -2048], [-3]):
        feeds = feeds_for(kv, ids, 0, None)
        want = dict(zip(names, ref.run(None, feeds)))["logits"]
        got = session(feeds)[0]["logits"]
        assert np.abs(got - want).max() <= ATOL + RTOL * np.abs(want).max()
