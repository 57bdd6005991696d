"""Accuracy of W4A16 weight quantisation (QuantizeW4A16) against the fp32 model.

For each model (the tiny Llama prefill_s8 always, SmolLM2-135M prefill_s32 when it has
been built) the fp32 Relax module and one quantised module per configuration (group size
32/64/128 x symmetric/asymmetric, plus the other symmetric scale rules at group 32) are
compiled for llvm and run on a fixed prompt set. Reported per configuration, over the
valid (unpadded) positions of all prompts:

- ``max_abs_diff`` / ``mean_abs_diff``: of the logits against fp32;
- ``top1_pct``: positions whose argmax token equals fp32's;
- ``weight_MB``: DRAM bytes of the linear weights (packed + scales + zeros; fp32 for the
  baseline row).

Usage::

    python benchmarks/quant_accuracy.py [--quick] [--json PATH] [--model PATH] [--no-smollm2]

``--quick`` runs group 32 and 128 only and two SmolLM2 prompts; ``--model`` adds a
fixed-shape ONNX model (inputs among input_ids, attention_mask, position_ids).
SmolLM2 is looked up in ``$EDGETVM_SMOLLM2`` and ``../smollm2`` next to the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from edgetvm.frontend import import_onnx
from edgetvm.relax_passes.quantize_w4a16 import QuantizeW4A16

REPO = Path(__file__).resolve().parents[1]
TARGET = tvm.target.Target({"kind": "llvm", "num-cores": os.cpu_count() or 1})

# SmolLM2 tokenizer ids (tokenizer.json of SmolLM2-135M-Instruct, BOS 1 included).
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


@dataclass(frozen=True)
class QuantConfig:
    group_size: int
    symmetric: bool
    scale_rule: str = "mse"

    @property
    def label(self) -> str:
        kind = f"sym/{self.scale_rule}" if self.symmetric else "asym"
        return f"w4 g{self.group_size} {kind}"


@dataclass
class Row:
    model: str
    config: str
    group_size: int | None
    symmetric: bool | None
    scale_rule: str | None
    max_abs_diff: float
    mean_abs_diff: float
    top1_pct: float
    weight_MB: float
    positions: int
    compile_s: float
    run_s: float


@dataclass
class ModelCase:
    name: str
    path: Path
    prompts: list  # lists of token ids, each at most the model's sequence length


def configs(quick: bool) -> list:
    groups = (32, 128) if quick else (32, 64, 128)
    out = [QuantConfig(g, sym) for g in groups for sym in (True, False)]
    if not quick:
        out += [QuantConfig(32, True, rule) for rule in ("absmax", "signed_absmax")]
    return out


def find_smollm2() -> Path | None:
    """``smollm2_prefill_s32.onnx`` from $EDGETVM_SMOLLM2 or ../smollm2, if built."""
    for folder in (os.environ.get("EDGETVM_SMOLLM2"), REPO.parent / "smollm2"):
        if folder and (Path(folder) / "smollm2_prefill_s32.onnx").is_file():
            return Path(folder) / "smollm2_prefill_s32.onnx"
    return None


def find_tiny() -> Path:
    for folder in (REPO / "examples" / "models", REPO / "examples", REPO.parent / "shared" / "models"):
        if (folder / "llama_tiny_prefill_s8.onnx").is_file():
            return folder / "llama_tiny_prefill_s8.onnx"
    raise FileNotFoundError("llama_tiny_prefill_s8.onnx not found in examples/ or ../shared/models")


def model_cases(args) -> list:
    rng = np.random.default_rng(0)
    tiny = [list(rng.integers(1, 2048, 8)) for _ in range(8)]
    cases = [ModelCase("llama_tiny_prefill_s8", find_tiny(), tiny)]
    smollm2 = None if args.no_smollm2 else find_smollm2()
    if args.no_smollm2:
        print("SmolLM2: skipped (--no-smollm2)")
    elif smollm2 is None:
        print("SmolLM2 not found ($EDGETVM_SMOLLM2 or ../smollm2/smollm2_prefill_s32.onnx): skipped")
    else:
        prompts = list(SMOLLM2_PROMPTS.values())
        cases.append(ModelCase("smollm2_prefill_s32", smollm2, prompts[:2] if args.quick else prompts))
    for path in args.model or []:
        cases.append(ModelCase(Path(path).stem, Path(path), tiny))
    return cases


def _inputs(func: relax.Function, names: list, prompt: list) -> list:
    """input_ids right-padded to the static length, mask 1 on the prompt, positions 0..S-1."""
    arrays = []
    for param, name in zip(func.params, names):
        shape = [int(d) for d in param.ty.shape.values]
        seq = shape[-1]
        if len(prompt) > seq:
            raise ValueError(f"prompt of {len(prompt)} tokens > sequence length {seq}")
        if name == "input_ids":
            a = np.zeros(shape, "int64")
            a[..., : len(prompt)] = prompt
        elif name == "attention_mask":
            a = np.zeros(shape, "int64")
            a[..., : len(prompt)] = 1
        elif name == "position_ids":
            a = np.broadcast_to(np.arange(seq, dtype="int64"), shape).copy()
        else:
            raise ValueError(f"input {name!r}: only input_ids, attention_mask, position_ids are fed")
        arrays.append(tvm.runtime.tensor(a))
    return arrays


def run_logits(mod: tvm.IRModule, names: list, prompts: list) -> tuple:
    """Logits at the valid positions of every prompt, plus compile and run seconds."""
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        vm = relax.VirtualMachine(tvm.compile(mod, TARGET), tvm.cpu())
    compiled = time.perf_counter()
    logits = []
    for prompt in prompts:
        out = vm["main"](*_inputs(mod["main"], names, prompt))
        out = out if isinstance(out, tvm.runtime.Tensor) else out[0]
        logits.append(out.numpy().reshape(-1, out.shape[-1])[: len(prompt)])
    return logits, compiled - start, time.perf_counter() - compiled


def compare(ref: list, out: list) -> dict:
    diff = np.concatenate([np.abs(r - o).ravel() for r, o in zip(ref, out)])
    agree = np.concatenate([r.argmax(-1) == o.argmax(-1) for r, o in zip(ref, out)])
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "top1_pct": 100.0 * float(agree.mean()), "positions": int(agree.size)}


def linear_weight_bytes(mod: tvm.IRModule) -> int:
    """Bytes of matmul constant weights and W4A16 kernel constants in ``main``."""
    total = 0

    def visit(expr):
        nonlocal total
        if not (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)):
            return
        if expr.op.name == "relax.matmul" and isinstance(expr.args[1], tvm.ir.expr.GenericConst):
            total += expr.args[1].value.numpy().nbytes
        elif expr.op.name == "relax.call_tir":
            func = mod[expr.args[0]]
            if func.attrs is not None and str(func.attrs.get("edgetvm.op", "")) == "linear_w4a16":
                for arg in expr.args[1].fields[1:]:
                    if isinstance(arg, tvm.ir.expr.GenericConst):
                        total += arg.value.numpy().nbytes

    relax.analysis.post_order_visit(mod["main"], visit)
    return total


def evaluate(case: ModelCase, quant_configs: list) -> list:
    print(f"\n{case.name}: {case.path} ({len(case.prompts)} prompts)", flush=True)
    imported = import_onnx(str(case.path))
    names = imported.input_names
    ref, c_s, r_s = run_logits(imported.mod, names, case.prompts)
    rows = [Row(case.name, "fp32", None, None, None, 0.0, 0.0, 100.0,
                linear_weight_bytes(imported.mod) / 1e6, sum(len(p) for p in case.prompts), c_s, r_s)]
    print(f"  fp32 built in {c_s:.1f} s, ran in {r_s:.1f} s; max |logit| {max(np.abs(r).max() for r in ref):.3f}",
          flush=True)
    for cfg in quant_configs:
        mod = QuantizeW4A16(group_size=cfg.group_size, symmetric=cfg.symmetric,
                            scale_rule=cfg.scale_rule)(imported.mod)
        out, c_s, r_s = run_logits(mod, names, case.prompts)
        metrics = compare(ref, out)
        rows.append(Row(case.name, cfg.label, cfg.group_size, cfg.symmetric,
                        cfg.scale_rule if cfg.symmetric else None,
                        weight_MB=linear_weight_bytes(mod) / 1e6, compile_s=c_s, run_s=r_s, **metrics))
        print(f"  {cfg.label:<22} top-1 {metrics['top1_pct']:6.2f} %  max {metrics['max_abs_diff']:.4f}"
              f"  ({c_s:.1f} s build, {r_s:.1f} s run)", flush=True)
    return rows


def format_table(rows: list) -> str:
    header = (f"{'model':<22} {'config':<22} {'max_abs_diff':>12} {'mean_abs_diff':>13} "
              f"{'top1_%':>7} {'weight_MB':>9} {'positions':>9}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(f"{r.model:<22} {r.config:<22} {r.max_abs_diff:>12.5f} {r.mean_abs_diff:>13.5f} "
                     f"{r.top1_pct:>7.2f} {r.weight_MB:>9.2f} {r.positions:>9}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="groups 32/128, 2 SmolLM2 prompts")
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument("--model", action="append", help="extra fixed-shape ONNX model")
    parser.add_argument("--no-smollm2", action="store_true", help="tiny Llama (and --model) only")
    args = parser.parse_args(argv)

    rows = []
    for case in model_cases(args):
        rows += evaluate(case, configs(args.quick))
    print()
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"target": str(TARGET), "rows": [asdict(r) for r in rows]},
                                              indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
