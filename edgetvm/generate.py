"""Greedy generation with a text-generation-with-past ONNX model on the NPU session, and
the same loop on onnxruntime as the reference (present fed back as past)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx

from edgetvm.errors import EdgeTVMError, ModelImportError
from edgetvm.frontend.loader import read_onnx_file


@dataclass
class KVSpec:
    """The KV-cache inputs of a with-past export: layers x (key, value) of
    (batch, kv_heads, past, head_dim)."""

    names: list                 # [(key input, value input, key output, value output)]
    kv_heads: int
    head_dim: int
    dtype: str
    vocab: int | None = None    # the logits' width, where the export states it
    #: "input_ids (1, 1); past_key_values.0.key (1, 2, 8, 16)" where those lengths are
    #: fixed in the file (a single-step export; generation cannot feed it), else ""
    fixed: str = ""

    @staticmethod
    def of(model_path: str) -> "KVSpec":
        m = read_onnx_file(model_path)
        inputs = {i.name: i for i in m.graph.input}
        outputs = {o.name for o in m.graph.output}
        layers = sorted({int(g) for n in inputs for g in re.findall(r"past_key_values\.(\d+)\.key", n)})
        if not layers or "input_ids" not in inputs or "logits" not in outputs:
            raise ModelImportError(f"{model_path}: not a text-generation-with-past export "
                                   f"(inputs input_ids, past_key_values.N.key/value; outputs "
                                   f"logits, present.N.key/value)")
        names = []
        for i in layers:
            names.append((f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                          f"present.{i}.key", f"present.{i}.value"))
        t = inputs[names[0][0]].type.tensor_type
        dims = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name
        # one (kv_heads, head_dim) for every layer's K and V: the cache's pages, the
        # runtime's empty past and the attention kernels assume it
        for n in (n for quad in names for n in quad[:2]):
            if n not in inputs:
                raise ModelImportError(f"{model_path}: {n} is missing (a with-past export "
                                       f"has a key and a value input per layer)")
            d = [x.dim_value for x in inputs[n].type.tensor_type.shape.dim]
            if len(d) != 4 or d[1] != dims[1] or d[3] != dims[3]:
                shape = ", ".join(str(x.dim_value or x.dim_param or "?")
                                  for x in inputs[n].type.tensor_type.shape.dim)
                raise ModelImportError(
                    f"{model_path}: {n} is ({shape}) where {names[0][0]} is (batch, "
                    f"{dims[1]}, past, {dims[3]}): key and "
                    f"value caches of other head counts or sizes (per layer, or K against "
                    f"V as in multi-head latent attention) are not supported")
        logits = next(o for o in m.graph.output if o.name == "logits").type.tensor_type
        vocab = logits.shape.dim[-1].dim_value if logits.shape.dim else 0
        fixed = [f"{n} ({', '.join(str(x.dim_value) for x in dim)})"
                 for n in ("input_ids", names[0][0])
                 for dim in [inputs[n].type.tensor_type.shape.dim]
                 if dim and all(x.HasField("dim_value") for x in dim)]
        return KVSpec(names, dims[1], dims[3], dtype, vocab or None, "; ".join(fixed))


@dataclass
class StepRecord:
    phase: str            # prefill | decode
    token: int
    positions: int        # tokens processed in this call
    past: int             # KV length before the call
    npu_cycles: int = 0
    npu_us: float = 0.0
    dram_read_bytes: int = 0
    dram_write_bytes: int = 0
    energy_uj: float = 0.0
    avg_power_mw: float = 0.0
    peak_power_mw: float = 0.0
    throttled_cycles: int = 0
    logits: np.ndarray | None = field(default=None, repr=False)
    program: str = ""          # the phase program that ran the step (compiled artifacts)
    wall_s: float = 0.0        # host seconds the step took (emulation included)


def feeds_for(kv: KVSpec, ids, past_len: int, past: dict | None):
    s = len(ids)
    feeds = {"input_ids": np.asarray([ids], np.int64),
             "attention_mask": np.ones((1, past_len + s), np.int64),
             "position_ids": np.arange(past_len, past_len + s, dtype=np.int64)[None]}
    for k_in, v_in, k_out, v_out in kv.names:
        for name, src in ((k_in, k_out), (v_in, v_out)):
            feeds[name] = past[src] if past else np.zeros((1, kv.kv_heads, 0, kv.head_dim),
                                                           kv.dtype)
    return feeds


def check_capacity(prompt_len: int, max_new_tokens: int, max_tokens: int) -> None:
    """Refuse, before the first step, a generation whose tokens would not fit a KV cache
    of ``max_tokens`` (the last new token is never written to it)."""
    need = prompt_len + max_new_tokens - 1
    if need > max_tokens:
        raise EdgeTVMError(f"the KV cache holds {max_tokens} tokens; a prompt of {prompt_len} "
                           f"and {max_new_tokens} new token(s) need {need}")


def check_vocab(ids, vocab: int | None) -> None:
    """Refuse token ids outside a vocabulary of ``vocab`` entries (None: the export does
    not state it, nothing to check); a negative id within it indexes from the end, as in
    numpy and onnxruntime."""
    if vocab is None:
        return
    bad = [i for i in ids if not -vocab <= i < vocab]
    if bad:
        raise EdgeTVMError(f"token id(s) {bad} out of the vocabulary ({vocab})")


def greedy(run, kv: KVSpec, prompt, max_new_tokens: int, on_step=None,
           chunk: int | None = None) -> list:
    """Greedy decode with ``run(feeds) -> (outputs, meter | None)``.

    The prompt is one prefill call, or with ``chunk`` a series of calls of at most
    ``chunk`` tokens, each attending to the KV of the earlier ones (chunked prefill). A
    record is kept per call; a chunk that does not end the prompt yields no token."""
    records, past, past_len = [], None, 0
    prompt = list(prompt)
    pieces = [prompt] if not chunk else [prompt[i:i + chunk]
                                         for i in range(0, len(prompt), chunk)]
    calls = [("prefill", p) for p in pieces]
    token = None
    generated = 0
    while calls or generated < max_new_tokens:
        phase, ids = calls.pop(0) if calls else ("decode", [token])
        outs, meter = run(feeds_for(kv, ids, past_len, past))
        logits = outs["logits"][0, -1]
        token = int(np.argmax(logits))
        last_of_prompt = phase == "decode" or not calls
        rec = StepRecord(phase, token if last_of_prompt else -1, len(ids), past_len,
                         logits=logits)
        if meter is not None:
            rec.npu_cycles, rec.dram_read_bytes = meter.cycles, meter.dram_read_bytes
            rec.dram_write_bytes, rec.energy_uj = meter.dram_write_bytes, meter.energy_uj
            rec.avg_power_mw, rec.peak_power_mw = meter.avg_power_mw, meter.peak_power_mw
            rec.throttled_cycles = meter.throttled_cycles
        records.append(rec)
        if on_step is not None:
            on_step(rec)
        past = {n: outs[n] for names in kv.names for n in names[2:]}
        past_len += len(ids)
        _check_present(past, past_len)
        if last_of_prompt:
            generated += 1
            if generated >= max_new_tokens:
                break
    return records


def _check_present(present: dict, length: int) -> None:
    """Every layer's ``present`` holds the ``length`` positions seen so far (it is fed
    back as the next call's past, of one length for all layers)."""
    for name, value in present.items():
        held = np.shape(value)[2] if np.ndim(value) == 4 else None
        if held != length:
            raise EdgeTVMError(
                f"the model's {name} holds {held} positions after {length} tokens: its KV "
                f"cache does not grow with the sequence (a layer that reuses another's KV, "
                f"as Gemma-3n's do?); edgetvm needs every layer's present to be its past "
                f"plus the new tokens")


def tokens_of(records) -> list:
    return [r.token for r in records if r.token >= 0]


def onnxruntime_runner(model):
    """A step function over onnxruntime running ``model`` (a path, or a serialized
    ModelProto), with onnxruntime's basic graph optimisations only: its extended ones
    change a model's numerics (a DequantizeLinear of int8 weights and the MatMul reading
    it become an integer matmul on dynamically quantized activations: a weight-only int8
    Llama's logits moved by 0.105 against the unoptimised graph), so they would make the
    reference something other than the model."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    out_names = [o.name for o in sess.get_outputs()]
    in_names = {i.name for i in sess.get_inputs()}

    def run(feeds):
        res = sess.run(None, {k: v for k, v in feeds.items() if k in in_names})
        return dict(zip(out_names, res)), None
    return run
