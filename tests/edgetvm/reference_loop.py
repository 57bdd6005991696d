"""Greedy generation written for the tests, independent of ``edgetvm.generate``: the
reference side of every end-to-end comparison."""
import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper


def greedy_loop(run, input_names, kv_inputs, prompt, steps, chunk=None):
    """``run(feeds) -> {output name: array}``; the prompt in one call (or chunks of
    ``chunk``), then one token per call, each call's ``present.*`` fed back as the next
    call's past. Returns (tokens, [outputs of every call])."""
    past = {n: np.zeros(shape, np.float32) for n, shape in kv_inputs.items()}
    pieces = [list(prompt)] if chunk is None else [list(prompt[i:i + chunk])
                                                   for i in range(0, len(prompt), chunk)]
    length, tokens, calls = 0, [], []
    while len(tokens) < steps:
        ids = pieces.pop(0) if pieces else [tokens[-1]]
        feeds = {"input_ids": np.array([ids], np.int64),
                 "attention_mask": np.ones((1, length + len(ids)), np.int64),
                 "position_ids": np.arange(length, length + len(ids), dtype=np.int64)[None]}
        feeds.update(past)
        out = run({k: v for k, v in feeds.items() if k in input_names})
        calls.append(out)
        for n in kv_inputs:
            past[n] = out[n.replace("past_key_values", "present")]
        length += len(ids)
        if not pieces:
            tokens.append(int(np.argmax(out["logits"][0, -1])))
    return tokens, calls


def onnxruntime_model(path):
    """(run, input names, {past input: empty shape}) of an ONNX with-past export."""
    # basic graph optimisations only: the extended ones change a model's numerics (a
    # DequantizeLinear of int8 weights and its MatMul become an integer matmul on
    # dynamically quantized activations), and the reference is the model's own
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    inputs = {i.name: i for i in sess.get_inputs()}
    kv = {n: (1, i.shape[1], 0, i.shape[3]) for n, i in inputs.items()
          if n.startswith("past_key_values")}
    # float feeds in the width each input takes (a float16 export's KV cache is float16)
    width = {n: np.float16 if i.type == "tensor(float16)" else np.float32
             for n, i in inputs.items() if i.type in ("tensor(float16)", "tensor(float)")}

    def run(feeds):
        feeds = {k: v.astype(width[k]) if k in width else v for k, v in feeds.items()}
        return dict(zip(names, sess.run(None, feeds)))
    return run, set(inputs), kv


def assert_outputs_close(got_calls, want_calls, label=""):
    """Every output (logits, present.*) of every call within 0.01 + 0.01 * max|want|."""
    for step, (a, b) in enumerate(zip(got_calls, want_calls)):
        for name, want in b.items():
            allowed = 0.01 + 0.01 * float(np.abs(want).max())
            assert a[name].shape == want.shape, (label, step, name)
            diff = float(np.abs(a[name] - want).max())
            assert diff <= allowed, (label, step, name, diff, allowed)


def with_random_vectors(src, dst, seed=3) -> int:
    """Save ``src`` as ``dst`` with every 1-D float initializer (biases, norm gains) made
    random, one draw per use (value + N(0, 0.3)); returns the number of draws. The tiny
    exports share one all-zero bias and one all-ones gain through Identity nodes, so a
    kernel that drops a bias or a gain, or swaps gain and bias, is exact on them."""
    model = onnx.load(str(src))
    rng = np.random.default_rng(seed)
    vectors = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer
               if len(i.dims) == 1 and i.data_type == onnx.TensorProto.FLOAT}
    drawn = 0
    for node in model.graph.node:
        for k, name in enumerate(node.input):
            if name in vectors:
                value = vectors[name] + rng.normal(0, 0.3, vectors[name].shape)
                fresh = f"{name}.random{drawn}"
                model.graph.initializer.append(numpy_helper.from_array(
                    value.astype(np.float32), fresh))
                node.input[k] = fresh
                drawn += 1
    onnx.save(model, str(dst))
    return drawn
