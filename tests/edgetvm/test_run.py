"""The judges of ``edgetvm.run``: ``compare_logits``, the greedy loop, and the CLI's verdict.

Every other end-to-end test leans on these, so each is tested here against numbers worked
out by hand."""
import os
import re

import numpy as np
import pytest

from edgetvm.errors import EdgeTVMError
from edgetvm.generate import KVSpec, StepRecord, greedy, tokens_of
from edgetvm.run import compare_logits, divergence, main
from edgetvm.runtime.model import ModelRunner
from edgetvm.session import NPUSession

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
MODEL = os.path.join(DATA, "llama_tiny_with_past.onnx")


def _rec(logits):
    return StepRecord("decode", 0, 1, 0, logits=np.asarray(logits, np.float32))


def test_compare_logits_uses_the_worst_element_not_the_mean():
    ref = np.zeros(512, np.float32)
    ref[0] = 10.0                                   # allowed: 0.01 + 0.01 * 10 = 0.11
    bad = ref.copy()
    bad[7] += 0.5                                   # one element off; mean diff ~0.001
    ok, worst, allowed = compare_logits([_rec(bad)], [_rec(ref)], 0.01, 0.01)
    assert not ok and worst == pytest.approx(0.5) and allowed == pytest.approx(0.11)
    close = ref.copy()
    close[7] += 0.1
    ok, worst, allowed = compare_logits([_rec(close)], [_rec(ref)], 0.01, 0.01)
    assert ok and worst == pytest.approx(0.1, abs=1e-6)


def test_compare_logits_tolerance_is_relative_to_the_reference():
    ref = np.full(4, 0.1, np.float32)               # allowed: 0.01 + 0.01 * 0.1 = 0.011
    candidate = np.array([50.0, 0.1, 0.1, 0.1], np.float32)   # a blown-up candidate
    ok, worst, allowed = compare_logits([_rec(candidate)], [_rec(ref)], 0.01, 0.01)
    assert not ok and allowed == pytest.approx(0.011)


def test_compare_logits_fails_if_any_step_fails_and_reports_it():
    ref = [_rec([1.0, 0.0]), _rec([1.0, 0.0]), _rec([1.0, 0.0])]
    got = [_rec([1.0, 0.0]), _rec([1.0, 0.3]), _rec([1.0, 0.001])]
    ok, worst, allowed = compare_logits(got, ref, 0.01, 0.01)
    assert not ok and worst == pytest.approx(0.3) and allowed == pytest.approx(0.02)
    # only the steps before the ids part are compared (steps=1): the first agrees
    ok, worst, _ = compare_logits(got, ref, 0.01, 0.01, steps=1)
    assert ok and worst == 0.0


def _tok(token, logits):
    return StepRecord("decode", token, 1, 0, logits=np.asarray(logits, np.float32))


def test_divergence_finds_the_first_differing_token_and_tells_a_near_tie():
    ref = [_tok(-1, [0, 0, 0]), _tok(0, [3.0, 1.0, 0.0]), _tok(2, [0.0, 1.0, 2.0]),
           _tok(1, [0.0, 5.0, 0.0])]
    # ids 0, 1, ...: the second token differs; onnxruntime's logit of 1 is 1.0 below 2
    got = [_tok(-1, [9, 9, 9]), _tok(0, [3.0, 1.0, 0.0]), _tok(1, [0.0, 2.0, 1.5]),
           _tok(0, [9.0, 0.0, 0.0])]
    assert divergence(ref, ref, 0.01, 0.01) is None
    k, tok, want, margin, diff, tol = divergence(got, ref, 0.01, 0.01)
    assert (k, tok, want) == (1, 1, 2)
    assert margin == pytest.approx(1.0) and diff == pytest.approx(1.0)
    assert tol == pytest.approx(0.01 + 0.01 * 2.0)      # a real difference, not a tie
    near = [_tok(0, [3.0, 1.0, 0.0]), _tok(1, [0.0, 2.0, 2.005])]
    k, tok, want, margin, diff, tol = divergence(near, ref, 0.01, 0.01)
    assert (k, tok, want) == (1, 1, 2) and margin == pytest.approx(1.0)
    ref_tie = [ref[1], _tok(2, [0.0, 2.0, 2.001])]
    k, tok, want, margin, diff, tol = divergence(near, ref_tie, 0.01, 0.01)
    assert margin == pytest.approx(0.001, abs=1e-6) and margin <= tol and diff <= tol


class _FakeModel:
    """A 'model' whose logits say which position they belong to: the first position
    always prefers token 1, the last prefers ``10 + the number of calls so far``."""

    def __init__(self):
        self.calls = []

    def __call__(self, feeds):
        self.calls.append(feeds)
        s = feeds["input_ids"].shape[1]
        logits = np.zeros((1, s, 64), np.float32)
        logits[0, 0, 1] = 5.0
        logits[0, -1, 10 + len(self.calls)] = 9.0
        present = {"present.0.key": np.zeros((1, 1, feeds["attention_mask"].shape[1], 2))}
        present["present.0.value"] = present["present.0.key"]
        return {"logits": logits, **present}, None


def test_greedy_reads_the_last_position_and_feeds_back_the_token():
    kv = KVSpec([("past_key_values.0.key", "past_key_values.0.value", "present.0.key",
                  "present.0.value")], 1, 2, "float32")
    model = _FakeModel()
    recs = greedy(model, kv, [3, 4, 5], 3)
    assert tokens_of(recs) == [11, 12, 13]
    assert [c["input_ids"].tolist() for c in model.calls] == [[[3, 4, 5]], [[11]], [[12]]]
    assert [c["past_key_values.0.key"].shape[2] for c in model.calls] == [0, 3, 4]
    assert [c["position_ids"].tolist() for c in model.calls][1:] == [[[3]], [[4]]]


def test_greedy_refuses_a_present_that_does_not_grow():
    """A layer whose present is not its past plus the new tokens (Gemma-3n's layers that
    reuse another's KV return an empty one) cannot be fed back as one past length: a clear
    error after the step, not the VM's shape check in the middle of the next one."""
    class Shared(_FakeModel):
        def __call__(self, feeds):
            outs, meter = super().__call__(feeds)
            outs["present.1.key"] = outs["present.1.value"] = np.zeros((1, 1, 0, 2))
            return outs, meter
    kv = KVSpec([("past_key_values.0.key", "past_key_values.0.value", "present.0.key",
                  "present.0.value"),
                 ("past_key_values.1.key", "past_key_values.1.value", "present.1.key",
                  "present.1.value")], 1, 2, "float32")
    model = Shared()
    with pytest.raises(EdgeTVMError, match="present.1.key holds 0 positions after 3 tokens"):
        greedy(model, kv, [3, 4, 5], 3)
    assert len(model.calls) == 1


def test_greedy_chunked_prompt_yields_a_token_only_after_the_last_chunk():
    kv = KVSpec([("past_key_values.0.key", "past_key_values.0.value", "present.0.key",
                  "present.0.value")], 1, 2, "float32")
    model = _FakeModel()
    recs = greedy(model, kv, [3, 4, 5, 6, 7], 2, chunk=2)
    assert [r.token for r in recs] == [-1, -1, 13, 14]
    assert [c["input_ids"].shape[1] for c in model.calls] == [2, 2, 1, 1]
    assert [c["position_ids"][0, 0] for c in model.calls] == [0, 2, 4, 5]


def _patch_logits(monkeypatch, edit, reference: bool):
    """Make the NPU's logits ``edit(logits)`` on the compiled path (ModelRunner.step) or
    on the reference path (NPUSession)."""
    if reference:
        real_call = NPUSession.__call__

        def call(self, feeds):
            out, meter = real_call(self, feeds)
            out["logits"] = edit(out["logits"])
            return out, meter
        monkeypatch.setattr(NPUSession, "__call__", call)
    else:
        real_step = ModelRunner.step

        def step(self, ids, pos, trace=False):
            logits, counters, key = real_step(self, ids, pos, trace)
            return edit(logits), counters, key
        monkeypatch.setattr(ModelRunner, "step", step)
    return ["--reference"] if reference else []


@pytest.mark.parametrize("reference", [False, True])
def test_run_check_onnx_fails_on_logits_with_identical_ids(monkeypatch, capsys, reference):
    # every logit + 0.5: the argmax, so the ids, unchanged
    extra = _patch_logits(monkeypatch, lambda x: x + 0.5, reference)
    assert main([MODEL, "--prompt-ids", "5,17,42", "--max-new-tokens", "2",
                 "--check-onnx", *extra]) == 1
    out = capsys.readouterr().out
    worst = float(re.search(r"max \|logits diff\| ([0-9.e+-]+)", out).group(1))
    assert "ids identical" in out and 0.5 <= worst < 0.6
    assert "check-onnx: FAILED: the ids agree, but the logits differ" in out


@pytest.mark.parametrize("reference", [False, True])
def test_run_check_onnx_fails_on_different_ids(monkeypatch, capsys, reference):
    def wrong(x):
        x = np.array(x, copy=True)
        x[..., 3] += 100.0                  # token 3 wins every step
        return x
    extra = _patch_logits(monkeypatch, wrong, reference)
    assert main([MODEL, "--prompt-ids", "5,17,42", "--max-new-tokens", "2",
                 "--check-onnx", *extra]) == 1
    assert "ids DIFFER" in capsys.readouterr().out


def test_run_refuses_what_check_onnx_cannot_compare_before_running(monkeypatch, capsys,
                                                                     tmp_path):
    """A --check-onnx file that is missing, a directory or not loadable by onnxruntime,
    and tolerances that no step could meet: refused before the build and the run (it was
    an onnxruntime traceback after the whole generation)."""
    import edgetvm.run as run_mod

    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(run_mod, "cached_build", no_work)
    monkeypatch.setattr(run_mod, "run_reference", no_work)
    text = tmp_path / "notes.onnx"
    text.write_text("not a model")
    for ref, message in ((str(tmp_path / "missing.onnx"), "no such file"),
                         (str(tmp_path), "is a directory"),
                         (str(text), "onnxruntime cannot load it")):
        for extra in ([], ["--reference"]):
            assert main([MODEL, "--prompt-ids", "5", "--check-onnx", ref, *extra]) == 2
            assert message in capsys.readouterr().err
    # another model: its logits of another width (the bundled example's 2048, not 512)
    bundled = os.path.join(os.path.dirname(os.path.dirname(DATA)), "examples",
                           "llama_tiny_with_past.onnx")
    for extra in ([], ["--reference"]):
        assert main([MODEL, "--prompt-ids", "5", "--check-onnx", bundled, *extra]) == 2
        assert "its logits have 2048 entries, the model's 512" in capsys.readouterr().err
    # a with-past export of fixed lengths: onnxruntime's traceback after the NPU run
    fixed = os.path.join(DATA, "llama_tiny_decode_p8.onnx")
    assert main([MODEL, "--prompt-ids", "5", "--check-onnx", fixed]) == 2
    err = capsys.readouterr().err
    assert "its lengths are fixed (input_ids (1, 1); past_key_values.0.key (1, 2, 8, 16))" \
        in err and "Traceback" not in err
    for bad in ("1,,2", "", "-1", "5,-2048"):
        with pytest.raises(SystemExit):
            main([MODEL, "--prompt-ids", bad])
        assert "--prompt-ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):                    # would run token 2047
        main([MODEL, "--prompt-ids", "-1"])
    assert "token ids are >= 0, got [-1]" in capsys.readouterr().err
    assert main([MODEL, "--prompt-ids", "5,512"]) == 2          # not after a build
    assert "token id(s) [512] out of the vocabulary (512)" in capsys.readouterr().err
    # the reference path refuses what the compiled one does, before any step (it ran
    # 1,022 steps, then failed; or failed inside the emulator on an id out of range)
    monkeypatch.undo()
    for argv, message in ((["--max-new-tokens", "1100"], "the KV cache holds 1024 tokens; "
                           "a prompt of 1 and 1100 new token(s) need 1100"),
                          (["--max-tokens", "8", "--max-new-tokens", "20"],
                           "the KV cache holds 8 tokens"),
                          (["--prompt-ids", "5,512"], "token id(s) [512] out of the "
                           "vocabulary (512)")):
        args = [MODEL, "--prompt-ids", "5", "--reference", *argv]
        assert main(args) == 2
        captured = capsys.readouterr()
        assert message in captured.err and "compiling" not in captured.out
    for tol in (["--atol", "-1"], ["--rtol", "nan"]):
        with pytest.raises(SystemExit):
            main([MODEL, "--prompt-ids", "5", "--check-onnx", *tol])
        assert "--atol and --rtol must be finite and >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("which, dim, size", [("1.value", 3, 24),   # V wider than K (MLA)
                                              ("1.key", 1, 4)])      # a layer of more heads
def test_kv_caches_of_other_shapes_are_refused_naming_the_input(tmp_path, capsys, which,
                                                                dim, size):
    # DeepSeek's multi-head latent attention exports K of 24 and V of 16 per head: the
    # reference path took the first key's shape for every past and failed inside TVM's
    # VM (a match_cast traceback); both paths now refuse the model up front
    import onnx
    m = onnx.load(MODEL)
    (inp,) = [i for i in m.graph.input if i.name == f"past_key_values.{which}"]
    inp.type.tensor_type.shape.dim[dim].dim_value = size
    path = str(tmp_path / "kv_shapes.onnx")
    onnx.save(m, path)
    with pytest.raises(Exception, match=rf"past_key_values\.{re.escape(which)} is .*not "
                                        r"supported"):
        KVSpec.of(path)
    assert main([path, "--prompt-ids", "5,17", "--max-new-tokens", "1", "--reference"]) == 2
    err = capsys.readouterr().err
    assert f"past_key_values.{which}" in err and "Traceback" not in err
