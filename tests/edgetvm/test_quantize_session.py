"""``NPUSession(quantize=G)`` and ``run --quantize G``: float linears quantised to W4A16 by
``QuantizeW4A16`` and run on the NPU.

The reference is the same quantised Relax module compiled for the host CPU by TVM (llvm):
it executes the MatMulNBits-form kernel the pass emits, so it shares the quantiser but
none of the NPU path (weight packing for the NPU, the kernel binding, the emulator's MMA).
Tolerance as everywhere on the NPU: ``0.01 + 0.01 * max|reference|`` per output and step.
"""
import pathlib

import numpy as np
import onnx
import pytest
import tvm
from reference_loop import assert_outputs_close, greedy_loop, onnxruntime_model
from tvm import relax

from edgetvm.frontend import import_onnx
from edgetvm.generate import KVSpec, feeds_for
from edgetvm.relax_passes import QuantizeW4A16
from edgetvm.run import main
from edgetvm.session import NPUSession

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
PROMPT = [5, 17, 42, 7]


def _host_model(path, qpass):
    imported = import_onnx(str(path))
    mod = qpass(imported.mod)
    mod = relax.transform.DecomposeOpsForInference()(mod)
    target = tvm.target.Target({"kind": "llvm", "num-cores": 2})
    vm = relax.VirtualMachine(tvm.compile(mod, target), tvm.cpu())

    def run(feeds):
        out = vm["main"](*[tvm.runtime.tensor(feeds[n]) for n in imported.input_names])
        return {n: o.numpy() for n, o in zip(imported.output_names, out)}
    return run


@pytest.mark.parametrize("family, group, zero_points", [
    ("llama", 32, "float"), ("gpt2", 64, "float"),      # float16 zero points on the NPU
    ("qwen2", 32, "none"), ("llama", 64, "uint4")])
def test_quantized_session_matches_the_quantized_model_on_the_host(family, group, zero_points):
    path = DATA / f"{family}_tiny_with_past.onnx"
    # keep_fp16=(): the tied lm_heads of GPT-2 and Qwen2 are quantized too (by default
    # they stay fp16 with the embedding table they are)
    qpass = QuantizeW4A16(group_size=group, zero_points=zero_points, keep_fp16=())
    session = NPUSession(str(path), quantize=qpass, max_tokens=64)
    w4 = [r for r in session.regions if "w4a16" in {v for k, v in r.attrs.items()
                                                      if k.endswith("weight_format")}]
    # every quantised projection runs on the NPU: q, o, the MLP (or its projections) and
    # the lm_head; the 32-wide K/V projections (below min_features 64) stay float
    assert {r.kind for r in w4} >= {"linear", "mlp", "lm_head"}
    assert all(r.attrs.get("edgetvm.group_size", r.attrs.get("edgetvm.up_group_size")) ==
               str(group) for r in w4)
    assert session.quant_report.zero_point_kinds == {zero_points}
    _, names, kv = onnxruntime_model(path)
    want, want_calls = greedy_loop(_host_model(path, qpass), names, kv, PROMPT, 6)
    got, got_calls = greedy_loop(lambda f: session(f)[0], names, kv, PROMPT, 6)
    assert got == want
    assert_outputs_close(got_calls, want_calls, family)


def test_quantized_decode_moves_fewer_bytes():
    path = str(DATA / "llama_tiny_decode_p8.onnx")
    kv = KVSpec.of(path)
    past = {n: np.zeros((1, kv.kv_heads, 8, kv.head_dim), np.float32)
            for names in kv.names for n in names[2:]}
    fp16 = NPUSession(path)(feeds_for(kv, [7], 8, past))[1]
    w4 = NPUSession(path, quantize=32)(feeds_for(kv, [7], 8, past))[1]
    assert w4.dram_read_bytes < 0.6 * fp16.dram_read_bytes


def test_float_zero_points_cost_two_bytes_each_per_decode_step():
    """The only difference between the float and symmetric forms in DRAM traffic is the
    zero points: 2 bytes per group of 32, every group read once per decode step. Groups
    counted from the ONNX file: every MatMul weight with K and N >= 64 (min_features)."""
    path = str(DATA / "llama_tiny_decode_p8.onnx")
    inits = {i.name: i for i in onnx.load(path).graph.initializer}
    shapes = [tuple(inits[n.input[1]].dims) for n in onnx.load(path).graph.node
              if n.op_type == "MatMul" and n.input[1] in inits]
    groups = sum(n * k // 32 for k, n in (s for s in shapes if len(s) == 2) if min(k, n) >= 64)
    kv = KVSpec.of(path)
    past = {n: np.zeros((1, kv.kv_heads, 8, kv.head_dim), np.float32)
            for names in kv.names for n in names[2:]}
    read = {}
    for zp in ("none", "float"):
        session = NPUSession(path, quantize=QuantizeW4A16(group_size=32, zero_points=zp))
        read[zp] = session(feeds_for(kv, [7], 8, past))[1].dram_read_bytes
    assert groups > 1000 and read["float"] - read["none"] == 2 * groups


def test_run_cli_quantize(capsys):
    assert main([str(DATA / "gpt2_tiny_with_past.onnx"), "--prompt-ids", "5,17",
                 "--max-new-tokens", "2", "--quantize", "32"]) == 0
    out = capsys.readouterr().out
    assert "generated ids:" in out and "decode" in out
    assert "5.00 bits/weight" in out and "g32 float zero points" in out   # the report
    assert main([str(DATA / "gpt2_tiny_with_past.onnx"), "--prompt-ids", "5,17",
                 "--max-new-tokens", "1", "--quantize", "64", "--zero-points", "none",
                 "--keep-fp16", "none"]) == 0
    out = capsys.readouterr().out
    assert "4.25 bits/weight" in out and "g64 none zero points" in out
    assert "fp16 linears:  0 " in out          # the tied lm_head is quantized too


@pytest.mark.parametrize("args, message", [
    (["--quantize", "32", "--keep-fp16", "lm_hed"], "unknown layer(s) lm_hed"),
    (["--keep-fp16", "lm_head"], "apply to --quantize G"),
    (["--quantize", "32", "--keep-fp16", ""], "--keep-fp16 is empty"),
    (["--quantize", "32", "--zero-points", "int8"], "invalid choice"),
])
def test_run_cli_refuses_bad_quantization_options(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        main([str(DATA / "gpt2_tiny_with_past.onnx"), "--prompt-ids", "5", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


W4_REFERENCE = "quantized linears as onnxruntime MatMulNBits holding the program's 4-bit codes"


def _check_onnx(capsys, model, *extra):
    code = main([str(DATA / model), "--prompt-ids", "5,17,42,7", "--max-new-tokens", "4",
                 "--check-onnx", *extra])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("model, extra, linears", [
    ("llama_tiny_with_past.onnx", ["--quantize", "32"], 11),
    ("llama_tiny_with_past.onnx", ["--quantize", "32", "--reference"], 11),
    # GPT-2's linears are Gemm nodes, and its tied lm_head (a Transpose) is quantized too
    ("gpt2_tiny_with_past.onnx", ["--quantize", "64", "--zero-points", "uint4",
                                  "--keep-fp16", "none"], 9),
    ("qwen2_tiny_with_past.onnx", ["--quantize", "64", "--keep-fp16", "lm_head"], 10)])
def test_check_onnx_of_a_quantized_build_runs_its_codes_on_onnxruntime(capsys, model, extra,
                                                                       linears):
    """``--check-onnx`` of a W4A16 build compares with onnxruntime running the ONNX file's
    linears as MatMulNBits holding the codes the build's quantizer makes (it compared with
    the float weights, which fails the tiny Llama's ids: the check could not tell a right
    quantized program from a wrong one). Fails if the ONNX copy quantizes other linears
    than the build (another count: the float fallback), a Gemm or a tied lm_head is
    exported wrong, or the program's W4A16 linears compute something else."""
    code, out = _check_onnx(capsys, model, *extra)
    assert f"with its {linears} {W4_REFERENCE}" in out
    assert code == 0 and "ids identical" in out


def test_check_onnx_of_a_quantized_build_fails_on_other_codes(monkeypatch, capsys):
    """The reference's codes are what the check compares with: quantized in groups of 64
    where the program's are in groups of 32, the same linears fail it."""
    import edgetvm.matmul_nbits_export as export

    real = export.quantized_as_compiled
    monkeypatch.setattr(export, "quantized_as_compiled", lambda model, qpass: real(
        model, QuantizeW4A16(group_size=64)))
    code, out = _check_onnx(capsys, "llama_tiny_with_past.onnx", "--quantize", "32")
    assert W4_REFERENCE in out and code == 1 and "ids DIFFER" in out
    assert "own float weights" not in out


def test_check_onnx_says_when_it_cannot_rebuild_the_codes(monkeypatch, capsys):
    """An ONNX copy that quantizes another number of linears than the build is not used:
    the check says so and compares with the float weights (whose ids differ here)."""
    import edgetvm.matmul_nbits_export as export

    real = export.quantized_as_compiled

    def one_short(model, qpass):
        copy, exported, made = real(model, qpass)
        return copy, exported, made - 1
    monkeypatch.setattr(export, "quantized_as_compiled", one_short)
    code, out = _check_onnx(capsys, "llama_tiny_with_past.onnx", "--quantize", "32")
    assert "cannot rebuild the program's 4-bit weights in ONNX (10 linears where the " \
           "build quantized 11)" in out
    assert W4_REFERENCE not in out and code == 1
    assert "onnxruntime ran the file's own float weights" in out


def test_keep_fp16_lm_head_keeps_the_lm_head_alone():
    """The lm_head is the linear as wide as the vocabulary: an embedding table's rows that
    are also the logits' width. GPT-2's MLP is 256 wide, as many as its position table has
    rows, and ``keep_fp16=("lm_head",)`` kept both its MLP's up projections float too."""
    from edgetvm.relax_passes.quant_report import quantization_report

    mod = import_onnx(str(DATA / "gpt2_tiny_with_past.onnx")).mod
    report = quantization_report(QuantizeW4A16(group_size=32, keep_fp16=("lm_head",))(mod))
    assert (report.w4_linears, report.float_linears) == (8, 1)
