"""Rebuild the small ONNX models under tests/data (not run by the tests: the files are
committed). Needs torch, transformers, optimum-onnx, onnxslim and onnxruntime, e.g. the venv
of the shared tiny-zoo tool (tools/models/make_tiny_zoo.sh) plus ``pip install onnxslim``.

    python tests/data/make_test_models.py ZOO_DIR

ZOO_DIR is the output of ``make_tiny_zoo.sh ZOO_DIR``: its ``<family>_tiny_with_past.onnx``
files are copied as they are; ``granite_tiny_with_past.onnx``,
``falcon_tiny_with_past.onnx``, ``opt_tiny_with_past.onnx``,
``mistral_sw24_tiny_with_past.onnx``, ``gemma2_tiny_with_past.onnx``,
``gemma2_softcap_tiny_with_past.onnx``, ``opt_proj_tiny_with_past.onnx``,
``gpt_neox_japanese_tiny_with_past.onnx``,
``gptj_tiny_with_past.onnx``, ``cohere_tiny_with_past.onnx``, ``mpt_tiny_with_past.onnx``,
``gemma3_tiny_with_past.onnx``, ``codegen_tiny_with_past.onnx``,
``bloom_tiny_with_past.onnx``, ``nemotron_tiny_with_past.onnx``,
``olmo_clip_tiny_with_past.onnx``, ``gpt_neo_tiny_with_past.onnx``,
``xglm_tiny_with_past.onnx``, ``stablelm_qk_tiny_with_past.onnx``,
``modernbert_decoder_tiny_with_past.onnx`` and ``open_llama_tiny_with_past.onnx``
(families the zoo tool does not make) are exported here the same way; and its Llama checkpoint (``.work/hf_llama``: 2
layers, hidden 64, 4 query / 2 KV heads, head_dim 16, intermediate 160, vocab 512, random
weights, ``torch.manual_seed(0)``) is exported again in the other spellings the front end
meets:

* ``llama_tiny_prefill_dynamic.onnx``: torch.onnx's TorchScript exporter, inputs
  ``input_ids`` and ``attention_mask`` of dynamic (``batch``, ``seq``), no KV inputs;
* ``llama_tiny_prefill_dynamo.onnx``: torch.onnx's dynamo exporter (``dynamo=True``, the
  default attention: SDPA, decomposed), inputs ``input_ids`` and ``attention_mask`` of
  dynamic ``seq`` (batch 1), no KV inputs;
* ``llama_tiny_prefill_s8.onnx``: optimum's ``text-generation`` export folded by onnxslim to
  sequence 8;
* ``llama_tiny_decode_p8.onnx``: the with-past export folded to sequence 1, past 8;
* ``llama_tiny_decode_p8_w4.onnx``: that fold quantized by onnxruntime's MatMulNBits quantizer
  (4 bits, block 32, symmetric);
* ``llama_tiny_decode_p8_w4_g64_zp.onnx``: the same with block 64 and uint4 zero points
  (asymmetric): the MLP's K of 160 is 2.5 blocks, so the last block is partial.
"""
import os
import shutil
import subprocess
import sys

import onnx

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ["llama", "qwen2", "gpt2", "gemma", "phi3", "gpt_neox"]


def fold(src, dst, seq, past):
    import onnxslim
    m0 = onnx.load(src)
    shapes = []
    for i in m0.graph.input:
        dims = []
        for j, d in enumerate(i.type.tensor_type.shape.dim):
            if d.dim_value > 0:
                dims.append(d.dim_value)
            elif j == 0:
                dims.append(1)
            elif i.name == "attention_mask":
                dims.append(seq + past)
            elif "past" in d.dim_param.lower():
                dims.append(past)
            else:
                dims.append(seq)
        shapes.append(i.name + ":" + ",".join(map(str, dims)))
    onnx.save(onnxslim.slim(src, input_shapes=shapes), dst)


def _export(work, family, config, seed=0, onnx_config=None, **export_options):
    """``config`` as the zoo tool makes its families: random weights from
    ``torch.manual_seed(seed)``, optimum's with-past export, as
    ``<family>_tiny_with_past.onnx``; ``onnx_config(model.config)``: the export's config
    (see :func:`_save_and_export`)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _save_and_export(work, family, model,
                     onnx_config(model.config) if onnx_config else None, **export_options)


def _save_and_export(work, family, model, onnx_config=None, **export_options):
    """Save ``model`` and export it with past as ``<family>_tiny_with_past.onnx``: with
    optimum-cli, or in this process through ``main_export`` when given ``onnx_config`` (a
    family optimum-onnx 0.1 has no config for) or ``export_options``."""
    hf = os.path.join(work, f"hf_{family}")
    out = os.path.join(work, f"onnx_{family}")
    model.save_pretrained(hf)
    if onnx_config is None and not export_options:
        cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
        subprocess.run([cli, "export", "onnx", "-m", hf, "--task",
                        "text-generation-with-past", out], check=True)
    else:
        from optimum.exporters.onnx import main_export
        custom = {"custom_onnx_configs": {"model": onnx_config}} if onnx_config else {}
        main_export(hf, out, task="text-generation-with-past", **custom, **export_options)
    onnx.save(onnx.load(os.path.join(out, "model.onnx")),
              os.path.join(HERE, f"{family}_tiny_with_past.onnx"))


def _random_vectors(model, biases: bool = True) -> None:
    """Norm gains from N(1, 0.2) and (with ``biases``) biases from N(0, 0.2): the init's
    ones and zeros hide a dropped or swapped one."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.normal_(1.0, 0.2)
            elif biases and name.endswith("bias"):
                p.normal_(0.0, 0.2)


def _llama_onnx_config(config, kv_heads: str = "num_attention_heads"):
    """optimum's Llama config for ``config`` (a family optimum-onnx 0.1 has no config
    for), its KV heads read from the config's ``kv_heads`` (default: the attention heads,
    a multi-head family)."""
    from optimum.exporters.onnx.model_configs import LlamaOnnxConfig
    from optimum.utils import NormalizedTextConfig

    class FamilyOnnxConfig(LlamaOnnxConfig):
        NORMALIZED_CONFIG_CLASS = NormalizedTextConfig.with_args(
            num_key_value_heads=kv_heads, allow_new=True)
    return FamilyOnnxConfig(config, task="text-generation", use_past=True,
                            use_past_in_inputs=True)


def export_granite(work):
    """Granite: Llama's shape (2 layers, hidden 64, 4 query / 2 KV heads) with its four
    multipliers, untied lm_head."""
    import transformers
    _export(work, "granite", transformers.GraniteConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, embedding_multiplier=4.0, residual_multiplier=0.5,
        attention_multiplier=0.125, logits_scaling=2.0))


def export_falcon(work):
    """Falcon (the 7B's layout): multi-query attention, parallel attention and MLP from one
    LayerNorm, rotary, no biases."""
    import transformers
    _export(work, "falcon", transformers.FalconConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, new_decoder_architecture=False, multi_query=True,
        parallel_attn=True, alibi=False, bias=False, bos_token_id=1, eos_token_id=2))


def export_opt(work):
    """OPT: learned positions (offset 2) added to the embeddings, LayerNorm before each
    block, q scaled before q @ k^T, a ReLU MLP with biases, rows flattened to
    (batch * seq, hidden) around the MLP."""
    import transformers
    _export(work, "opt", transformers.OPTConfig(
        init_std=0.2, vocab_size=512, hidden_size=64, ffn_dim=160, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=64,
        pad_token_id=1, bos_token_id=2, eos_token_id=2))


def export_opt_proj(work):
    """OPT-350m's layout: word embeddings narrower than the model (32 of 64), widened by
    ``project_in`` before the learned positions are added (so the position embedding
    meets NPU data in a residual add) and narrowed by ``project_out`` before the lm_head;
    LayerNorm after each block (``do_layer_norm_before=False``)."""
    import transformers
    _export(work, "opt_proj", transformers.OPTConfig(
        init_std=0.2, vocab_size=512, hidden_size=64, ffn_dim=160, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
        do_layer_norm_before=False, pad_token_id=1, bos_token_id=2, eos_token_id=2))


def export_gpt_neox_japanese(work):
    """GPT-NeoX-Japanese: the attention's output bias kept apart from its dense layer and
    added in the residual, broadcast to the tokens by an ``Expand`` (a value of the
    positions' shape that meets NPU data), rotary over the whole head, multi-head;
    exported with optimum's Llama config, the KV heads read from the attention heads."""
    import transformers
    _export(work, "gpt_neox_japanese", transformers.GPTNeoXJapaneseConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_multiple_size=2, rotary_pct=1.0,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2),
        onnx_config=_llama_onnx_config, do_validation=False)


def export_mistral(work):
    """Mistral: Llama's shape with a sliding window of 24 tokens, which the export's
    attention mask applies: past 24 tokens of KV cache it is not the causal mask."""
    import transformers
    _export(work, "mistral_sw24", transformers.MistralConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, sliding_window=24, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2))


def export_gemma2(work):
    """Gemma-2: Gemma's layout with norms after attention and MLP too, and the logits
    soft-capped, cap * tanh(logits / cap) (a cap of 5, far below the logits' range, so a
    wrong tanh shows); the export's attention has no soft-capping (SDPA) and its window
    (4096) is longer than any cache here."""
    import transformers
    _export(work, "gemma2", transformers.Gemma2Config(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256,
        final_logit_softcapping=5.0, attn_logit_softcapping=None, query_pre_attn_scalar=16,
        sliding_window=4096, pad_token_id=0, bos_token_id=2, eos_token_id=1,
        tie_word_embeddings=True))


def export_gemma2_softcap(work):
    """Gemma-2 with its attention's soft-capping, ``cap * tanh(scores / cap)`` before the
    mask, exported eagerly (optimum loads the model with the eager attention: SDPA drops
    the soft-cap); a cap of 2, small enough for the tanh to saturate (its argument reaches
    2.9 and 4.5 in the two layers on the tests' prompt); logits soft-capped at 5 as in
    ``gemma2``."""
    import torch
    import transformers
    from optimum.exporters.tasks import TasksManager
    config = transformers.Gemma2Config(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256,
        final_logit_softcapping=5.0, attn_logit_softcapping=2.0, query_pre_attn_scalar=16,
        sliding_window=4096, pad_token_id=0, bos_token_id=2, eos_token_id=1,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager").eval()
    load = TasksManager.get_model_from_task    # in this process (export options: not the CLI)
    TasksManager.get_model_from_task = staticmethod(
        lambda *a, **k: load(*a, **{**k, "attn_implementation": "eager"}))
    try:
        _save_and_export(work, "gemma2_softcap", model, do_validation=False)
    finally:
        TasksManager.get_model_from_task = load


def export_gptj(work):
    """GPT-J: interleaved (rotate-every-two) partial rotary (8 of 16), its sin/cos table
    gathered by position and tiled over the batch (a ``Tile`` by a shape), parallel
    attention and MLP, no q/k/v biases."""
    import transformers
    _export(work, "gptj", transformers.GPTJConfig(
        initializer_range=0.2, vocab_size=512, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
        n_positions=256, bos_token_id=0, eos_token_id=0))


def export_cohere(work):
    """Cohere (Command-R+'s layout): LayerNorm without bias computed in float, q and k
    LayerNorm-ed per head with a gain per head ((heads, d)), interleaved rotary, parallel
    attention and MLP, logits scaled; its rotary table's shape is computed through
    ``ReduceMax`` of a constant."""
    import transformers
    _export(work, "cohere", transformers.CohereConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, use_qk_norm=True, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def export_mpt(work):
    """MPT: ALiBi position bias (no rotary, no learned positions), sliced from a 256-long
    table by ``Slice(start = 256 - kv_len, end = INT64_MAX)``; LayerNorm without bias."""
    import transformers
    _export(work, "mpt", transformers.MptConfig(
        initializer_range=0.2, vocab_size=512, d_model=64, n_layers=2, n_heads=4,
        max_seq_len=256))


def export_bloom(work):
    """BLOOM: ALiBi (6 heads: not a power of two, so its slopes interleave two series),
    added to (batch * heads, seq, keys) scores before the heads split out, the causal
    mask after; LayerNorm after the embedding; a GELU spelled with the inner polynomial
    factored. Seed 1 and ``initializer_range=0.25``: from seed 0 (at 0.2 to 0.35) greedy
    decoding repeats one token; wider (0.5, 1.0), the activations grow so large that the
    fp16 kernels' logits drift past the tests' tolerance, on the reference path as on the
    compiled one, whatever runs on the NPU."""
    import transformers
    _export(work, "bloom", transformers.BloomConfig(
        initializer_range=0.25, vocab_size=512, hidden_size=96, n_layer=2, n_head=6,
        bos_token_id=1, eos_token_id=2), seed=1)


def export_codegen(work):
    """CodeGen: GPT-J's interleaved partial rotary (4 of 8), with its qkv projection split
    in four groups of two heads each, so its q, k and v are (batch, seq, 4, 2, d): not
    evenly strided over the 8 heads; the mask added before the scores are scaled."""
    import transformers
    _export(work, "codegen", transformers.CodeGenConfig(
        initializer_range=0.2, vocab_size=512, n_embd=64, n_layer=2, n_head=8, rotary_dim=4,
        n_positions=256, n_ctx=256, bos_token_id=0, eos_token_id=0))


def export_gemma3(work):
    """Gemma-3 (text): Gemma's layout with q and k RMS-normalised per head after the heads
    move before the tokens (rows (head, token) of a (token, head, d) projection), norms
    after attention and MLP, local layers with a sliding window (512, longer than the
    caches here), multi-query attention."""
    import transformers
    _export(work, "gemma3", transformers.Gemma3TextConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=256, sliding_window=512, pad_token_id=0, bos_token_id=2,
        eos_token_id=1))


def export_nemotron(work):
    """Nemotron: a squared-ReLU MLP (``relu(x) * relu(x)``, no gate), LayerNorm with
    ``1 + weight`` (folded by the export), partial rotary (half of each 16-wide head), GQA
    (4 query / 2 KV heads), untied lm_head."""
    import transformers
    _export(work, "nemotron", transformers.NemotronConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, max_position_embeddings=256, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False))


def export_olmo_clip(work):
    """OLMo with ``clip_qkv=0.5``: q, k and v clamped by an ONNX ``Clip`` (a max and a min)
    after their projections; non-parametric LayerNorm, GQA (4 query / 2 KV heads)."""
    import transformers
    _export(work, "olmo_clip", transformers.OlmoConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        clip_qkv=0.5))


def export_gpt_neo(work):
    """GPT-Neo: attention without any scaling, hidden scores filled by ``where`` from a
    causal buffer and the padding mask added after; global and local layers (a window of
    256, the position table's length, so it hides no key of a cache here); LayerNorm,
    GELU (tanh) MLP with biases, learned positions."""
    import transformers
    _export(work, "gpt_neo", transformers.GPTNeoConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, num_layers=2,
        attention_types=[[["global", "local"], 1]], num_heads=4, window_size=256,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2))


def export_stablelm_qk(work):
    """StableLM with ``qk_layernorm``: q and k LayerNorm-ed per head by one LayerNorm per
    head (split, norm, concat), after the heads move before the tokens; partial rotary
    (25 %), qkv bias, GQA (4 query / 2 KV heads), LayerNorm. Norm gains and biases random
    (the init's ones and zeros hide a dropped or swapped one; the per-head norms have no
    bias). Seed 3: from seed 0 the 16th token is a near tie (logits 2.4e-3 apart), which
    fp16 tips. transformers 4.57's init zeroes those norms' missing bias and fails, so the
    per-head norms are initialised here."""
    import torch
    import transformers
    from transformers.models.stablelm import modeling_stablelm

    init = modeling_stablelm.StableLmPreTrainedModel._init_weights

    def init_weights(self, module):
        if isinstance(module, torch.nn.LayerNorm) and module.bias is None:
            module.weight.data.fill_(1.0)
        else:
            init(self, module)
    modeling_stablelm.StableLmPreTrainedModel._init_weights = init_weights
    torch.manual_seed(3)
    config = transformers.StableLmConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2, qk_layernorm=True, use_qkv_bias=True,
        partial_rotary_factor=0.25, bos_token_id=1, eos_token_id=2)
    model = transformers.StableLmForCausalLM(config).eval()
    _random_vectors(model)
    _save_and_export(work, "stablelm_qk", model)


def export_modernbert_decoder(work):
    """ModernBERT-decoder: a GLU MLP whose one fused projection is sliced in two, GELU
    spelled with ``erf`` of its input over sqrt(2) (the activation's input is found through
    that scaling), LayerNorm without bias, rotary; global layers only (the export masks its
    local layers' keys 64 positions back whatever the window, shorter than the tests'
    caches: a clear refusal there). optimum-onnx 0.1 has no config for it:
    exported with its Llama config, reading the KV heads from the attention heads. Norm
    gains random (the init's ones hide a dropped one)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.ModernBertDecoderConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
        layer_types=["full_attention"] * 2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _random_vectors(model, biases=False)
    _save_and_export(work, "modernbert_decoder", model, _llama_onnx_config(model.config),
                     do_validation=False)


def export_open_llama(work):
    """OpenLLaMA: the masked scores clamped by ``Max(scores, finfo.min)`` before the
    softmax, the tied lm_head an ``Einsum("blh,vh->blv")`` with the embedding table (both
    imported as the ops the patterns know: an elementwise maximum, a matmul), RMSNorm,
    SwiGLU, rotary, multi-head attention. Exported with optimum's Llama config, the KV
    heads read from the attention heads; norm gains random."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.OpenLlamaConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _random_vectors(model, biases=False)
    _save_and_export(work, "open_llama", model, _llama_onnx_config(model.config),
                     do_validation=False)


def export_bitnet(work):
    """BitNet (its float weights: transformers' model as it computes before any ternary
    packing): a gated squared-ReLU MLP, ``relu(gate) ** 2 * up``, RMS-normalised
    (``ffn_sub_norm``) before the down projection, and the attention output RMS-normalised
    (``attn_sub_norm``) before the output projection; rotary, GQA (4 q / 2 kv heads);
    random norm gains; exported with optimum's Llama config."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.BitNetConfig(
        initializer_range=0.2, vocab_size=512, hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    _random_vectors(model, biases=False)
    _save_and_export(work, "bitnet", model,
                     _llama_onnx_config(model.config, kv_heads="num_key_value_heads"),
                     do_validation=False)


def export_xglm(work):
    """XGLM: q scaled before its head split, attention on (batch * heads)-row 3-D tensors
    with the mask added to the scores reshaped back to 4-D and clamped by ``Max(scores,
    finfo.min)`` before a 3-D softmax; sinusoidal positions gathered at ``p + 2``;
    embeddings scaled by sqrt(hidden); LayerNorm, GELU MLP with biases. optimum-onnx 0.1
    has no XGLM config, so it is exported with a custom decoder config. Biases and norm
    gains random (the init's zeros and ones hide a dropped one) and the lm_head untied
    (tied, greedy decoding repeats one token from any seed)."""
    import torch
    import transformers
    from optimum.exporters.onnx.config import TextDecoderOnnxConfig
    from optimum.utils import NormalizedTextConfig

    class XGLMOnnxConfig(TextDecoderOnnxConfig):
        DEFAULT_ONNX_OPSET = 14
        NORMALIZED_CONFIG_CLASS = NormalizedTextConfig.with_args(
            num_layers="num_layers", num_attention_heads="attention_heads",
            hidden_size="d_model", allow_new=True)

    torch.manual_seed(0)
    config = transformers.XGLMConfig(
        vocab_size=512, d_model=64, ffn_dim=160, num_layers=2, attention_heads=4,
        max_position_embeddings=256, init_std=0.2, scale_embedding=True,
        tie_word_embeddings=False)
    model = transformers.XGLMForCausalLM(config).eval()
    _random_vectors(model)
    _save_and_export(work, "xglm", model,
                     XGLMOnnxConfig(config, task="text-generation", use_past=True,
                                    use_past_in_inputs=True), no_post_process=True)


def _logits_only(model):
    """``model`` as a module of (input_ids, attention_mask) -> logits, without a cache."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits

    return Logits(model)


def export_llama_dynamo(hf):
    """The Llama checkpoint through torch.onnx's dynamo exporter (before the mask patch
    below: it traces transformers' own mask functions)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    model.eval()
    model.config.use_cache = False

    ids = torch.tensor([[5, 17, 42, 7, 9, 11]])
    seq = torch.export.Dim("seq", min=2, max=128)
    program = torch.onnx.export(_logits_only(model), (ids, torch.ones_like(ids)), dynamo=True,
                                dynamic_shapes={"input_ids": {1: seq},
                                                "attention_mask": {1: seq}},
                                input_names=["input_ids", "attention_mask"],
                                output_names=["logits"])
    program.save(os.path.join(HERE, "llama_tiny_prefill_dynamo.onnx"))


def main(zoo):
    import torch
    import transformers
    for fam in FAMILIES:
        shutil.copy(os.path.join(zoo, f"{fam}_tiny_with_past.onnx"),
                    os.path.join(HERE, f"{fam}_tiny_with_past.onnx"))
    export_granite(os.path.join(zoo, ".work"))
    export_falcon(os.path.join(zoo, ".work"))
    export_opt(os.path.join(zoo, ".work"))
    export_opt_proj(os.path.join(zoo, ".work"))
    export_gpt_neox_japanese(os.path.join(zoo, ".work"))
    export_mistral(os.path.join(zoo, ".work"))
    export_gemma2(os.path.join(zoo, ".work"))
    export_gemma2_softcap(os.path.join(zoo, ".work"))
    export_gptj(os.path.join(zoo, ".work"))
    export_cohere(os.path.join(zoo, ".work"))
    export_mpt(os.path.join(zoo, ".work"))
    export_gemma3(os.path.join(zoo, ".work"))
    export_codegen(os.path.join(zoo, ".work"))
    export_bloom(os.path.join(zoo, ".work"))
    export_nemotron(os.path.join(zoo, ".work"))
    export_olmo_clip(os.path.join(zoo, ".work"))
    export_gpt_neo(os.path.join(zoo, ".work"))
    export_xglm(os.path.join(zoo, ".work"))
    export_stablelm_qk(os.path.join(zoo, ".work"))
    export_modernbert_decoder(os.path.join(zoo, ".work"))
    export_open_llama(os.path.join(zoo, ".work"))
    export_bitnet(os.path.join(zoo, ".work"))
    hf = os.path.join(zoo, ".work", "hf_llama")
    work = os.path.join(zoo, ".work", "test_models")
    os.makedirs(work, exist_ok=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
    model.eval()
    model.config.use_cache = False
    export_llama_dynamo(hf)
    # transformers builds the causal mask with torch.vmap, which the TorchScript exporter
    # cannot trace; optimum exports with its vmap-free mask functions, and so does this
    import transformers.masking_utils as masking
    from optimum.exporters.onnx.model_patcher import (eager_mask_without_vmap,
                                                      find_packed_sequence_indices_patched,
                                                      sdpa_mask_without_vmap)
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", sdpa_mask_without_vmap)
    masking.ALL_MASK_ATTENTION_FUNCTIONS.register("eager", eager_mask_without_vmap)
    masking.find_packed_sequence_indices = find_packed_sequence_indices_patched

    ids = torch.tensor([[5, 17, 42, 7, 9, 11]], dtype=torch.int64)
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(_logits_only(model), (ids, torch.ones_like(ids)),
                      os.path.join(HERE, "llama_tiny_prefill_dynamic.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      opset_version=17, dynamo=False,
                      dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})
    cli = os.path.join(os.path.dirname(sys.executable), "optimum-cli")
    no_past = os.path.join(work, "no_past")
    subprocess.run([cli, "export", "onnx", "-m", hf, "--task", "text-generation", no_past],
                   check=True)
    fold(os.path.join(no_past, "model.onnx"), os.path.join(HERE, "llama_tiny_prefill_s8.onnx"), 8, 0)
    fold(os.path.join(HERE, "llama_tiny_with_past.onnx"),
         os.path.join(HERE, "llama_tiny_decode_p8.onnx"), 1, 8)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    for name, block, symmetric in (("llama_tiny_decode_p8_w4.onnx", 32, True),
                                   ("llama_tiny_decode_p8_w4_g64_zp.onnx", 64, False)):
        q = MatMulNBitsQuantizer(onnx.load(os.path.join(HERE, "llama_tiny_decode_p8.onnx")),
                                 block_size=block, is_symmetric=symmetric)
        q.process()
        q.model.save_model_to_file(os.path.join(HERE, name))
    for f in sorted(os.listdir(HERE)):
        if f.endswith(".onnx"):
            print(f"{f}: {os.path.getsize(os.path.join(HERE, f)) / 1e6:.2f} MB")


if __name__ == "__main__":
    main(sys.argv[1])
