"""Import the tiny Llama with-past export, compile it once, generate greedily.

One compiled module serves the prefill (sequence 6, past 0) and every decode step
(sequence 1, past 6, 7, ...) because edgetvm's front end keeps the lengths symbolic.
The tokens are checked against onnxruntime running the same ONNX file.

    python examples/import_llama_tiny.py [model.onnx] [--steps N]
"""

import argparse
import pathlib
import time

import numpy as np
import tvm
from tvm import relax

from edgetvm.frontend import import_onnx

HERE = pathlib.Path(__file__).resolve().parent


def generate(step, prompt, steps, kv_heads, head_dim, layers):
    """Greedy decoding; ``step(feeds) -> [logits, present.0.key, ...]``."""
    past = [np.zeros((1, kv_heads, 0, head_dim), "float32") for _ in range(2 * layers)]
    ids = np.asarray([prompt], np.int64)
    length, tokens = 0, []
    for _ in range(steps):
        seq = ids.shape[1]
        feeds = {
            "input_ids": ids,
            "attention_mask": np.ones((1, length + seq), np.int64),
            "position_ids": np.arange(length, length + seq, dtype=np.int64)[None],
        }
        for layer in range(layers):
            feeds[f"past_key_values.{layer}.key"] = past[2 * layer]
            feeds[f"past_key_values.{layer}.value"] = past[2 * layer + 1]
        logits, *past = step(feeds)
        length += seq
        tokens.append(int(logits[0, -1].argmax()))
        ids = np.asarray([[tokens[-1]]], np.int64)
    return tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=HERE / "llama_tiny_with_past.onnx")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    start = time.perf_counter()
    imported = import_onnx(args.model)
    seconds = time.perf_counter() - start
    print(f"imported in {seconds:.2f} s; symbolic dims: {sorted(imported.tir_vars)}")
    start = time.perf_counter()
    mod = relax.transform.DecomposeOpsForInference()(imported.mod)
    executable = tvm.compile(mod, target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))
    vm = relax.VirtualMachine(executable, tvm.cpu())
    print(f"compiled in {time.perf_counter() - start:.2f} s")

    def tvm_step(feeds):
        outputs = vm["main"](*[tvm.runtime.tensor(feeds[name]) for name in imported.input_names])
        return [output.numpy() for output in outputs]

    layers = sum(name.endswith(".key") for name in imported.input_names)
    kv_param = imported.mod["main"].params[imported.input_names.index("past_key_values.0.key")]
    _, kv_heads, _, head_dim = kv_param.ty.shape.values  # (batch, kv heads, past, head dim)
    kv_heads, head_dim = int(kv_heads), int(head_dim)
    prompt = [1, 504, 3, 282, 464, 31]
    tokens = generate(tvm_step, prompt, args.steps, kv_heads, head_dim, layers)
    print("TVM tokens:        ", tokens)
    try:
        import onnxruntime as ort
    except ImportError:
        return
    session = ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"])
    reference = generate(
        lambda feeds: session.run(None, feeds), prompt, args.steps, kv_heads, head_dim, layers
    )
    print("onnxruntime tokens:", reference, "(match)" if reference == tokens else "(MISMATCH)")


if __name__ == "__main__":
    main()
