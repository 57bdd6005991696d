"""Whole-phase programs: every decoder family, every fusion strategy, token-exact against
onnxruntime.

One static command stream per phase and bucket runs the whole forward pass (``edgetvm/
build``): the glue between kernels is addressing (relocated DMA windows), RoPE tables and
position embeddings are build-time tables read at the runtime position, the mask is
checked at build time. The reference is the onnxruntime loop of ``reference_loop.py`` (its
own greedy choice, its own ``present`` fed back); the NPU side runs ``ModelRunner`` with
the KV pages handed out in a shuffled order. Every call's last-position logits are
compared, so a wrong kernel shows even where greedy ids happen to agree.

Tolerance as in test_families.py: ``0.01 + 0.01 * max|reference logits|`` per step.
"""
import pathlib

import numpy as np
import pytest
from reference_loop import greedy_loop, onnxruntime_model

from edgetvm.build.compiler import ModelCompiler
from edgetvm.runner import LocalRunner
from edgetvm.runtime.model import ModelInfo, ModelRunner

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
PROMPT = [5, 17, 42, 7]
NEW_TOKENS = 16               # 4 + 16 tokens: the cache crosses its first 16-token page
MAX_TOKENS = 128
FAMILIES = ("llama", "qwen2", "gpt2", "gemma", "phi3", "gpt_neox")

_compilers: dict = {}


def _compiler(family, strategy):
    key = (family, strategy)
    if key not in _compilers:
        _compilers[key] = ModelCompiler(str(DATA / f"{family}_tiny_with_past.onnx"),
                                        max_tokens=MAX_TOKENS, strategy=strategy, max_rows=16)
    return _compilers[key]


def _runner(mc):
    g = mc.graph("decode", 1, 1)
    info = ModelInfo(g.layers, g.kv_heads, g.head_dim, mc.page_tokens, mc.max_tokens,
                     int(g.tensors["logits"].shape[-1]))
    pool = [int(p) for p in np.random.default_rng(3).permutation(mc.num_pages)]
    return ModelRunner(lambda key: mc.program(*key), mc.phase_keys((4, 8, 16), chunked=True),
                       info, LocalRunner(mc.spec), page_pool=pool)


def _check(family, strategy, chunk=None):
    mc = _compiler(family, strategy)
    ref_run, names, kv = onnxruntime_model(DATA / f"{family}_tiny_with_past.onnx")
    want, calls = greedy_loop(ref_run, names, kv, PROMPT, NEW_TOKENS, chunk)
    recs = _runner(mc).generate(PROMPT, NEW_TOKENS, chunk=chunk)
    got = [r.token for r in recs if r.token >= 0]
    assert got == want, (family, strategy)
    assert len(recs) == len(calls)
    for step, (rec, call) in enumerate(zip(recs, calls)):
        ref = call["logits"][0, -1]
        diff = float(np.abs(rec.logits - ref).max())
        assert diff <= 0.01 + 0.01 * float(np.abs(ref).max()), (family, strategy, step, diff)
    return recs


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_token_exact_with_region_kernels(family):
    recs = _check(family, "regions")
    assert all(r.npu_cycles > 0 and r.dram_read_bytes > 0 for r in recs)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_token_exact_with_mega_kernels(family):
    _check(family, "mega")


@pytest.mark.parametrize("family,strategy", [("llama", "op-library"), ("llama", "local"),
                                             ("gpt_neox", "op-library"), ("gpt2", "local")])
def test_op_library_and_local_partitions(family, strategy):
    _check(family, strategy)


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_chunked_prefill(family):
    # chunks of 2 at positions 0 and 2: the second attends to the first's KV pages
    recs = _check(family, "regions", chunk=2)
    assert [r.token for r in recs[:2]][0] == -1 and recs[1].past == 2


def test_fusion_changes_kernels_and_traffic_not_answers():
    mc = _compiler("llama", "regions")
    progs = {s: mc.program("prefill", 16, 1, strategy=s)
             for s in ("op-library", "regions", "local", "mega")}
    kernels = {s: len(p.metadata["kernels"]) for s, p in progs.items()}
    assert kernels["op-library"] > kernels["local"] > kernels["mega"]
    assert kernels["regions"] > kernels["mega"]
    # a fused cluster keeps its intermediates in TCM: fewer activation bytes in DRAM
    assert progs["mega"].metadata["arena_bytes"] <= progs["op-library"].metadata["arena_bytes"]
