"""Accuracy of W4A16 weight quantisation: edgetvm's quantizers beside onnxruntime's.

Every quantizer writes its codes, scales and zero points as onnxruntime ``MatMulNBits``
nodes (edgetvm's through ``edgetvm/matmul_nbits_export.py``, exactly the numbers
``QuantizeW4A16`` compiles for the NPU); onnxruntime runs each quantized model and the
fp32 export, teacher-forced on a fixed prompt set, and the fp32 run is the reference.
That the NPU executes the quantized module as the host does is checked by the tests
(``tests/edgetvm/test_quantize_session.py``), not here.

Models: SmolLM2-135M (the 8 prompts below; its weights come from a Q4_1 GGUF, so a
quantizer that finds 16-level grids recovers them) and a model that was never quantized
(``tests/data/llama_tiny_with_past.onnx``: random weights with std 0.2; 64 random prompts
of 32 tokens). Rows per group size G (32/64/128): onnxruntime RTN symmetric and
asymmetric (uint4 zero points), onnxruntime HQQ (float zero points; needs torch, skipped
with a note without it), edgetvm symmetric / uint4 / float zero points; at G=32 edgetvm
float with the tied lm_head quantized too (``--keep-fp16 none``). The quantized set is
onnxruntime's: every MatMul whose weight is a 2-D initializer (a tied lm_head,
``x @ Transpose(embedding)``, is not one).

Columns: ``top1_%`` (positions whose argmax equals fp32's), ``mean_abs`` / ``max_abs``
(logits difference), ``bits/w`` (DRAM bits per quantized weight in the NPU's format:
fp16 scales, uint8 or fp16 zero points), ``MB/token`` (weight bytes one decoded token
reads: quantized and float linears, one embedding row), ``quant_s``.

Exits 1 when a measured result is numerically wrong: non-finite logits, an fp32
reference that does not give the known next token, or an edgetvm MatMulNBits node that
onnxruntime evaluates differently from edgetvm's dequantisation.

Usage::

    python benchmarks/quant_accuracy.py [--quick] [--json PATH] [--model PATH] [--no-smollm2]

``--quick``: groups 32 and 128, 2 SmolLM2 prompts, 16 tiny prompts. SmolLM2 is looked up in
``$EDGETVM_SMOLLM2`` and ``../smollm2`` next to the repository.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from edgetvm.matmul_nbits_export import quantize_matmuls
from edgetvm.relax_passes import QuantizeW4A16
from edgetvm.relax_passes.w4_pack import dequantize_w4

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_PROMPTS = {
    "The capital of France is": [1, 504, 3575, 282, 4649, 314],
    "Once upon a time, there was a little girl who lived in a village near the forest.": [
        1, 6403, 1980, 253, 655, 28, 665, 436, 253, 1838, 8180, 617, 4161, 281, 253, 6560,
        2141, 260, 3150, 30],
    "def fibonacci(n): ... return": [
        1, 1604, 3987, 46477, 24, 94, 727, 472, 585, 304, 2067, 216, 34, 42, 448, 1003, 304,
        472, 1003],
    "The quick brown fox jumps over the lazy dog. The dog": [
        1, 504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30, 378, 2767],
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes": [
        1, 12615, 36411, 418, 216, 33, 32, 32, 5027, 20590, 418, 3426, 1106, 28, 564, 418,
        2061, 29326],
    "In 1969, Neil Armstrong became the first person to walk on the": [
        1, 788, 216, 33, 41, 38, 41, 28, 27639, 24955, 2163, 260, 808, 1055, 288, 4549, 335,
        260],
    "To make a cup of tea, first boil some water, then": [
        1, 2068, 919, 253, 7118, 282, 7188, 28, 808, 17663, 634, 913, 28, 965],
    "The three primary colors are red, blue and": [
        1, 504, 1296, 3003, 4683, 359, 2382, 28, 4461, 284],
}
#: (prompt, fp32 greedy next token) per model: a reference that misses it is wrong
#: (SmolLM2: " Paris"; the tiny Llama: tests/data/README.md).
KNOWN_NEXT = {"smollm2": ([1, 504, 3575, 282, 4649, 314], 7042),
              "llama_tiny_with_past": ([5, 17, 42, 7], 75)}
ZERO_POINT_BYTES = {"none": 0, "uint4": 1, "float": 2}


@dataclass(frozen=True)
class Quantizer:
    source: str          # "edgetvm" or "onnxruntime"
    method: str          # edgetvm: none / uint4 / float; onnxruntime: rtn_sym / rtn_asym / hqq
    group_size: int
    lm_head: bool = False  # edgetvm: the tied lm_head too (keep_fp16=())

    @property
    def label(self) -> str:
        name = {"none": "sym", "uint4": "uint4 zp", "float": "float zp", "rtn_sym": "RTN sym",
                "rtn_asym": "RTN asym", "hqq": "HQQ"}[self.method]
        return f"{self.source} {name}" + (" +lm_head" if self.lm_head else "")


@dataclass
class Row:
    model: str
    quantizer: str
    group_size: int | None
    top1_pct: float
    mean_abs_diff: float
    max_abs_diff: float
    bits_per_weight: float
    weight_MB_per_token: float
    quantized_linears: int
    positions: int
    quant_s: float
    run_s: float


@dataclass
class ModelCase:
    name: str
    path: Path
    prompts: list


def quantizers(groups, has_torch: bool) -> list:
    out = []
    for g in groups:
        out += [Quantizer("onnxruntime", "rtn_sym", g), Quantizer("onnxruntime", "rtn_asym", g)]
        if has_torch:
            out.append(Quantizer("onnxruntime", "hqq", g))
        out += [Quantizer("edgetvm", m, g) for m in ("none", "uint4", "float")]
        if g == 32:
            out.append(Quantizer("edgetvm", "float", g, lm_head=True))
    return out


def quantize(base: onnx.ModelProto, q: Quantizer) -> tuple:
    """(quantized model, edgetvm's exported linears or None)."""
    if q.source == "edgetvm":
        qpass = QuantizeW4A16(group_size=q.group_size, zero_points=q.method)
        return quantize_matmuls(base, qpass.quantize, transposed=q.lm_head)
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq  # noqa: PLC0415

    logging.getLogger(mnq.__name__).setLevel(logging.WARNING)
    if q.method == "hqq":
        config = mnq.HQQWeightOnlyQuantConfig(block_size=q.group_size, bits=4)
    else:
        config = mnq.DefaultWeightOnlyQuantConfig(block_size=q.group_size,
                                                   is_symmetric=q.method == "rtn_sym")
    model = onnx.ModelProto()
    model.CopyFrom(base)
    quantizer = mnq.MatMulNBitsQuantizer(model, algo_config=config)
    with warnings.catch_warnings():      # torch: "non-writable array" from HQQ's from_numpy
        warnings.simplefilter("ignore")
        quantizer.process()
    return quantizer.model.model, None


def has_tied_lm_head(model: onnx.ModelProto) -> bool:
    """Is a MatMul weight a Transpose of an initializer (``x @ embedding^T``)?"""
    inits = {i.name for i in model.graph.initializer}
    transposed = {o for n in model.graph.node if n.op_type == "Transpose" and n.input[0] in inits
                  for o in n.output}
    return any(n.op_type == "MatMul" and n.input[1] in transposed for n in model.graph.node)


def weight_traffic(model: onnx.ModelProto) -> tuple:
    """(quantized linears, NPU-format bits per quantized weight, weight MB per token)."""
    inits = {i.name: i for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    q_weights = q_bytes = f_bytes = emb = count = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            a = {x.name: x.i for x in node.attribute}
            k, n, g = a["K"], a["N"], a["block_size"]
            groups = n * -(-k // g)
            zp = "none"
            if len(node.input) > 3 and node.input[3]:
                zp = "uint4" if inits[node.input[3]].data_type == onnx.TensorProto.UINT8 else "float"
            count += 1
            q_weights += k * n
            q_bytes += groups * (g // 2 + 2 + ZERO_POINT_BYTES[zp])
        elif node.op_type == "MatMul":
            b = node.input[1]
            if b not in inits and b in producers and producers[b].op_type == "Transpose":
                b = producers[b].input[0]
            if b in inits and len(inits[b].dims) == 2:
                f_bytes += 2 * int(np.prod(inits[b].dims))
        elif node.op_type == "Gather" and node.input[0] in inits and \
                len(inits[node.input[0]].dims) == 2:
            emb += 2 * int(inits[node.input[0]].dims[1])
    bits = 8.0 * q_bytes / q_weights if q_weights else 0.0
    return count, bits, (q_bytes + f_bytes + emb) / 1e6


def session(model) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    opts.log_severity_level = 3
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def teacher_forced_logits(sess: ort.InferenceSession, prompts: list) -> list:
    """Logits (len(prompt), vocab) of each prompt: one call, past empty (with-past
    exports) or right-padded with mask 0 (fixed-length folds)."""
    out = []
    for prompt in prompts:
        feeds = {}
        for inp in sess.get_inputs():
            dims = [d if isinstance(d, int) else None for d in inp.shape]
            seq = dims[1] if inp.name in ("input_ids", "attention_mask", "position_ids") and \
                dims[1] else len(prompt)
            if inp.name == "input_ids":
                feeds[inp.name] = np.zeros((1, seq), np.int64)
                feeds[inp.name][0, :len(prompt)] = prompt
            elif inp.name == "attention_mask":
                feeds[inp.name] = (np.arange(seq) < len(prompt)).astype(np.int64)[None]
            elif inp.name == "position_ids":
                feeds[inp.name] = np.arange(seq, dtype=np.int64)[None]
            elif inp.name.startswith("past_key_values"):
                feeds[inp.name] = np.zeros((1, dims[1], 0, dims[3]), np.float32)
            else:
                raise ValueError(f"input {inp.name!r}: not an LLM export input")
        logits = sess.run(["logits"], feeds)[0]
        out.append(logits.reshape(-1, logits.shape[-1])[: len(prompt)].astype(np.float64))
    return out


def compare(ref: list, out: list) -> dict:
    diff = np.concatenate([np.abs(r - o).ravel() for r, o in zip(ref, out)])
    agree = np.concatenate([r.argmax(-1) == o.argmax(-1) for r, o in zip(ref, out)])
    return {"top1_pct": 100.0 * float(agree.mean()), "mean_abs_diff": float(diff.mean()),
            "max_abs_diff": float(diff.max()), "positions": int(agree.size)}


def format_problem(exported) -> str | None:
    """Does onnxruntime's MatMulNBits compute ``x @ dequantize_w4(w4)^T`` (edgetvm's and
    the NPU's dequantisation) for the first exported linear? None if so."""
    lin = exported[0]
    w4 = lin.w4
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"])], "probe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, lin.k])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, lin.n])],
        [numpy_helper.from_array(np.zeros((lin.k, lin.n), np.float32), "W")])
    probe = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model, _ = quantize_matmuls(probe, lambda _w: w4)
    x = np.random.default_rng(0).standard_normal((4, lin.k)).astype(np.float32)
    got = session(model).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ dequantize_w4(w4).astype(np.float64).T
    err = float(np.abs(got - want).max())
    tol = 1e-4 * (1.0 + float(np.abs(want).max()))
    return None if err <= tol else f"{lin.node}: MatMulNBits differs from dequantize_w4 by {err:.3g}"


def evaluate(case: ModelCase, qs: list, problems: list) -> list:
    print(f"\n{case.name}: {case.path} ({len(case.prompts)} prompts)", flush=True)
    base = onnx.load(str(case.path))
    t0 = time.perf_counter()
    ref = teacher_forced_logits(session(case.path), case.prompts)
    known = KNOWN_NEXT.get(case.name)
    if known is not None:
        nxt = int(teacher_forced_logits(session(case.path), [known[0]])[0][-1].argmax())
        if nxt != known[1]:
            problems.append(f"{case.name}: fp32 reference predicts {nxt}, not {known[1]}")
    n, bits, mb = weight_traffic(base)
    rows = [Row(case.name, "fp32 (onnxruntime)", None, 100.0, 0.0, 0.0, 32.0, mb, 0,
                sum(len(p) for p in case.prompts), 0.0, time.perf_counter() - t0)]
    for q in qs:
        if q.lm_head and not has_tied_lm_head(base):
            continue                 # the lm_head is a plain MatMul weight: quantized already
        t0 = time.perf_counter()
        model, exported = quantize(base, q)
        t1 = time.perf_counter()
        out = teacher_forced_logits(session(model), case.prompts)
        run_s = time.perf_counter() - t1
        if not all(np.isfinite(o).all() for o in out):
            problems.append(f"{case.name} {q.label} g{q.group_size}: non-finite logits")
        if exported:
            problem = format_problem(exported)
            if problem:
                problems.append(f"{case.name} {q.label} g{q.group_size}: {problem}")
        m = compare(ref, out)
        n, bits, mb = weight_traffic(model)
        rows.append(Row(case.name, q.label, q.group_size, m["top1_pct"], m["mean_abs_diff"],
                        m["max_abs_diff"], bits, mb, n, m["positions"], t1 - t0, run_s))
        print(f"  g{q.group_size:<4} {q.label:<28} top-1 {m['top1_pct']:6.2f} %  mean "
              f"{m['mean_abs_diff']:.4f}  ({t1 - t0:.1f} s quantize)", flush=True)
    return rows


def targets(rows: list) -> list:
    """The issue's targets: edgetvm float zero points vs onnxruntime HQQ per group."""
    out = []
    by = {(r.model, r.quantizer, r.group_size): r for r in rows}
    for (model, label, g), hqq in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2] or 0)):
        ours = by.get((model, "edgetvm float zp", g))
        if label != "onnxruntime HQQ" or ours is None:
            continue
        ok = ours.top1_pct >= hqq.top1_pct
        text = f"{model} g{g}: top-1 {ours.top1_pct:.1f} % vs HQQ {hqq.top1_pct:.1f} %"
        if g == 32:
            ok &= ours.mean_abs_diff <= hqq.mean_abs_diff
            text += f", mean |diff| {ours.mean_abs_diff:.4f} vs {hqq.mean_abs_diff:.4f}"
        out.append({"target": text, "met": bool(ok)})
    return out


def find_smollm2() -> Path | None:
    for folder in (os.environ.get("EDGETVM_SMOLLM2"), REPO.parent / "smollm2"):
        for name in ("optimum_with_past/model.onnx", "smollm2_prefill_s32.onnx"):
            if folder and (Path(folder) / name).is_file():
                return Path(folder) / name
    return None


def model_cases(args) -> list:
    rng = np.random.default_rng(0)
    # many positions: top-1 agreement of a random-weight model moves by ~1 point per 500
    tiny = [list(map(int, rng.integers(3, 512, 32))) for _ in range(16 if args.quick else 64)]
    cases = [ModelCase("llama_tiny_with_past", REPO / "tests" / "data" /
                       "llama_tiny_with_past.onnx", tiny)]
    smollm2 = None if args.no_smollm2 else find_smollm2()
    if smollm2 is None and not args.no_smollm2:
        print("SmolLM2 not found ($EDGETVM_SMOLLM2 or ../smollm2): skipped")
    if smollm2 is not None:
        prompts = list(SMOLLM2_PROMPTS.values())
        cases.append(ModelCase("smollm2", smollm2, prompts[:2] if args.quick else prompts))
    for path in args.model or []:
        cases.append(ModelCase(Path(path).stem, Path(path), tiny))
    return cases


def format_table(rows: list) -> str:
    header = (f"{'model':<21} {'quantizer':<28} {'G':>4} {'top1_%':>7} {'mean_abs':>9} "
              f"{'max_abs':>8} {'bits/w':>6} {'MB/token':>9} {'quant_s':>7}")
    lines = [header, "-" * len(header)]
    for r in rows:
        g = "-" if r.group_size is None else str(r.group_size)
        lines.append(f"{r.model:<21} {r.quantizer:<28} {g:>4} {r.top1_pct:>7.2f} "
                     f"{r.mean_abs_diff:>9.4f} {r.max_abs_diff:>8.3f} {r.bits_per_weight:>6.2f} "
                     f"{r.weight_MB_per_token:>9.2f} {r.quant_s:>7.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--quick", action="store_true", help="groups 32/128, fewer prompts")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument("--model", action="append", help="extra LLM export (with-past or fixed)")
    parser.add_argument("--no-smollm2", action="store_true", help="skip SmolLM2")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401, PLC0415  (onnxruntime's HQQ quantizer runs on torch)
        has_torch = True
    except ImportError:
        has_torch = False
        print("note: torch is not importable: the onnxruntime HQQ rows are skipped "
              "(pip install torch to add them)")
    qs = quantizers((32, 128) if args.quick else (32, 64, 128), has_torch)
    rows, problems = [], []
    for case in model_cases(args):
        rows += evaluate(case, qs, problems)
    print()
    print(format_table(rows))
    met = targets(rows)
    for t in met:
        print(f"target {'met' if t['met'] else 'NOT met'}: {t['target']}")
    for p in problems:
        print(f"NUMERICALLY WRONG: {p}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "reference": "onnxruntime fp32", "onnxruntime": ort.__version__,
            "rows": [asdict(r) for r in rows], "targets": met, "problems": problems},
            indent=2))
        print(f"wrote {args.json}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
