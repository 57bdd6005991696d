"""Row-op templates (norms, softmax, activations, RoPE, residual add), the embedding gather
and the LM head: lowered, run on the emulator, checked against numpy."""
import numpy as np
import pytest
import tvm
from tvm import s_tir

from edgetvm.errors import CandidateRejected
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, Vector
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules import elementwise, embedding, fused, norm, workloads
from edgetvm.tir_schedules.search import knob_space, sampled_knobs
from w4_cases import w4_weights

SPEC = load_spec("edge-npu-16mb")
F32 = np.float32


def _rng(seed=0):
    return np.random.default_rng(seed)


def _f16(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


# -- numpy references (fp32 math on the fp16 inputs) ------------------------------------
def _rms(x, w, eps=1e-5):
    x = x.astype(F32)
    return x / np.sqrt((x * x).mean(1, keepdims=True) + eps) * w.astype(F32)


def _ln(x, w, b, eps=1e-5):
    x = x.astype(F32)
    xc = x - x.mean(1, keepdims=True)
    return xc / np.sqrt((xc * xc).mean(1, keepdims=True) + eps) * w.astype(F32) + b.astype(F32)


def _softmax(x):
    e = np.exp(x.astype(F32) - x.astype(F32).max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _gelu(x):
    from math import erf
    x = x.astype(np.float64)
    return (0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))).astype(F32)


def _rope(x, cos, sin, head_dim):
    m = x.shape[0]
    t = x.astype(F32).reshape(m, -1, head_dim)
    h = head_dim // 2
    rot = np.concatenate([-t[..., h:], t[..., :h]], -1)
    return (t * cos.astype(F32)[:, None] + rot * sin.astype(F32)[:, None]).reshape(m, -1)


# -- cases: (workload, consts, inputs, reference, template) ---------------------------
def _case(op, m, n, seed=0):
    rng = _rng(seed)
    if op == "rms_norm":
        x, w = _f16(rng, m, n), _f16(rng, n)
        return workloads.rms_norm(m, n), {"w": w}, {"x": x}, _rms(x, w), norm.schedule_rms_norm
    if op == "layer_norm":
        x, w, b = _f16(rng, m, n, scale=3.0) + np.float16(2), _f16(rng, n), _f16(rng, n)
        return (workloads.layer_norm(m, n), {"w": w, "b": b}, {"x": x}, _ln(x, w, b),
                norm.schedule_layer_norm)
    if op == "softmax":
        x = _f16(rng, m, n, scale=4.0)
        return workloads.softmax(m, n), {}, {"x": x}, _softmax(x), norm.schedule_softmax
    if op == "silu_mul":
        g, u = _f16(rng, m, n, scale=3.0), _f16(rng, m, n)
        gf = g.astype(F32)
        return (workloads.silu_mul(m, n), {}, {"g": g, "u": u},
                gf / (1 + np.exp(-gf)) * u.astype(F32), elementwise.schedule_elementwise)
    if op == "gelu":
        x = _f16(rng, m, n, scale=3.0)
        return workloads.gelu(m, n), {}, {"x": x}, _gelu(x), elementwise.schedule_elementwise
    if op == "add":
        a, b = _f16(rng, m, n), _f16(rng, m, n)
        return (workloads.residual_add(m, n), {}, {"a": a, "b": b},
                a.astype(F32) + b.astype(F32), elementwise.schedule_elementwise)
    if op == "rope":
        head_dim = 64
        x, c, s = _f16(rng, m, n), _f16(rng, m, head_dim), _f16(rng, m, head_dim)
        return (workloads.rope(m, n // head_dim, head_dim), {}, {"x": x, "cos": c, "sin": s},
                _rope(x, c, s, head_dim), elementwise.schedule_rope)
    raise AssertionError(op)


def _run(func, consts, inputs, template, seed=1, **knobs):
    sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=seed)
    template(sch, **knobs)
    program = lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts)
    return program, Emulator(SPEC).run(program, inputs), sch


def _check(out, ref):
    np.testing.assert_allclose(out.astype(F32), ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


ROW_OPS = ["rms_norm", "layer_norm", "softmax"]
EW_OPS = ["silu_mul", "gelu", "add"]


@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("m,n,knobs", [
    (5, 96, dict(tile_m=2, slots_x=2, slots_out=2, dma_split=1)),    # ragged row tiles
    (3, 576, dict(tile_m=3, slots_x=1, slots_out=1, dma_split=0)),   # tile = whole dim
    (64, 200, dict(tile_m=16, slots_x=2, slots_out=1, dma_split=0)),
])
def test_row_reductions(op, m, n, knobs):
    func, consts, inputs, ref, template = _case(op, m, n)
    program, r, _ = _run(func, consts, inputs, template, **knobs)
    _check(r.outputs["out"], ref)
    # intermediates are fp32 in TCM, the DRAM traffic is the input, weights and output once
    assert all(t.dtype == "float16" for t in program.tensors.values())
    io = m * n * 2 * 2 + sum(c.nbytes for c in consts.values())
    assert r.counters.dram_read_bytes + r.counters.dram_write_bytes == io


@pytest.mark.parametrize("op", EW_OPS)
@pytest.mark.parametrize("m,n,knobs", [
    (5, 200, dict(tile_m=2, tile_n=64, slots_in=2, slots_out=2, dma_split=1)),  # ragged both
    (4, 96, dict(tile_m=4, tile_n=96, slots_in=1, slots_out=1, dma_split=0)),   # whole dims
    (1, 1536, dict(tile_m=1, tile_n=512, slots_in=2, slots_out=2, dma_split=0)),
])
def test_elementwise(op, m, n, knobs):
    func, consts, inputs, ref, template = _case(op, m, n)
    _, r, _ = _run(func, consts, inputs, template, **knobs)
    _check(r.outputs["out"], ref)


@pytest.mark.parametrize("m,heads,knobs", [
    (5, 3, dict(tile_m=2, slots_x=2, slots_cs=2, slots_out=2, dma_split=1)),   # ragged rows
    (1, 9, dict(tile_m=1, slots_x=1, slots_cs=1, slots_out=1, dma_split=0)),   # decode, whole
    (16, 2, dict(tile_m=16, slots_x=1, slots_cs=1, slots_out=2, dma_split=0)),
])
def test_rope(m, heads, knobs):
    func, consts, inputs, ref, template = _case("rope", m, heads * 64)
    program, r, _ = _run(func, consts, inputs, template, **knobs)
    _check(r.outputs["out"], ref)
    ropes = [c for c in program.commands if isinstance(c, Vector) and c.op == "rope"]
    assert all(c.dst.shape[1] == 64 for c in ropes)          # one op per head row
    assert len(ropes) == heads * -(-m // knobs["tile_m"])


def test_gelu_is_the_erf_form():
    # tanh-approximation GELU differs from erf GELU by up to ~1e-3 around |x| = 2
    x = np.linspace(-4, 4, 256, dtype=F32).astype(np.float16).reshape(2, 128)
    _, r, _ = _run(workloads.gelu(2, 128), {}, {"x": x}, elementwise.schedule_elementwise,
                   tile_m=2, tile_n=128, slots_in=1, slots_out=1, dma_split=0)
    np.testing.assert_allclose(r.outputs["out"].astype(F32), _gelu(x), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("op", ROW_OPS + EW_OPS + ["rope"])
def test_random_knob_samples_lower_and_match(op):
    m, n = (6, 192) if op != "rope" else (6, 128)
    func, consts, inputs, ref, template = _case(op, m, n, seed=3)
    names = fused.knob_names(func)
    # row ops tile rows only; 2-D elementwise ops also tile columns; one slots knob per
    # streamed input
    tail = ("slots_out", "dma_split", "tcm_fresh", "list_schedule")
    row = ("tile_m", "slots_x") + tail
    expected = {"rms_norm": row, "layer_norm": row, "softmax": row,
                "silu_mul": ("tile_m", "tile_n", "slots_g", "slots_u") + tail,
                "gelu": ("tile_m", "tile_n", "slots_x") + tail,
                "add": ("tile_m", "tile_n", "slots_a", "slots_b") + tail,
                "rope": ("tile_m", "slots_x", "slots_cos", "slots_sin") + tail}
    assert names == expected[op]
    assert norm.KNOBS == row and elementwise.SILU_MUL_KNOBS == expected["silu_mul"]
    assert elementwise.ROPE_KNOBS == expected["rope"]
    seen = set()
    for seed in (11, 12, 13):
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=seed)
        template(sch)
        seen.add(tuple(sampled_knobs(sch, names).values()))
        program = lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts)
        _check(Emulator(SPEC).run(program, inputs).outputs["out"], ref)
    assert len(seen) > 1
    assert len(knob_space(sch, names)["tile_m"]) > 1


def test_double_buffering_overlaps_loads_with_compute():
    func, consts, inputs, ref, template = _case("rms_norm", 64, 576)
    base = dict(tile_m=8, slots_out=2, dma_split=1)
    _, single, _ = _run(func, consts, inputs, template, slots_x=1, **base)
    _, double, _ = _run(func, consts, inputs, template, slots_x=2, **base)
    _check(double.outputs["out"], ref)
    assert single.counters.dram_read_bytes == double.counters.dram_read_bytes
    assert double.counters.total_cycles < single.counters.total_cycles


# -- embedding gather ---------------------------------------------------------------------
@pytest.mark.parametrize("seq,tile_m", [(5, 2), (5, 5), (1, 1)])
def test_embedding_gather_with_runtime_ids(seq, tile_m):
    vocab, hidden = 300, 64
    table = _f16(_rng(), vocab, hidden)
    sch = s_tir.Schedule(tvm.IRModule({"main": workloads.embedding(seq, vocab, hidden)}))
    embedding.schedule_embedding(sch, tile_m=tile_m, slots_out=2, dma_split=1)
    program = lower_primfunc(sch.mod["main"], SPEC, "embed", consts={"E": table},
                             runtime=["ids"])
    assert set(program.params) == {f"ids.{i}" for i in range(seq)}
    emu = Emulator(SPEC)
    for ids in ([0, vocab - 1, 7, 7, 123][:seq], [42] * seq):    # one program, any ids
        r = emu.run(program, {}, params={f"ids.{i}": v for i, v in enumerate(ids)})
        assert np.array_equal(r.outputs["out"], table[ids])
        assert r.counters.dram_read_bytes == seq * hidden * 2     # only the rows asked for


def test_embedding_random_knobs():
    seq, vocab, hidden = 7, 50, 32
    table = _f16(_rng(1), vocab, hidden)
    sch = s_tir.Schedule(tvm.IRModule({"main": workloads.embedding(seq, vocab, hidden)}), seed=5)
    embedding.schedule_embedding(sch)
    assert len(knob_space(sch, embedding.KNOBS)["tile_m"]) > 1
    program = lower_primfunc(sch.mod["main"], SPEC, "embed", consts={"E": table},
                             runtime=["ids"])
    ids = [3, 1, 4, 1, 5, 9, 2]
    r = Emulator(SPEC).run(program, {}, params={f"ids.{i}": v for i, v in enumerate(ids)})
    assert np.array_equal(r.outputs["out"], table[ids])


# -- LM head --------------------------------------------------------------------------------
def _lm_head_case(m, vocab, hidden, quant, group=32, seed=0):
    rng = _rng(seed)
    x = _f16(rng, m, hidden)
    if quant == "w4a16":
        w, s, _, weight = w4_weights(rng, vocab, hidden, group)
        return {"W": w, "S": s}, {"X": x}, x.astype(F32) @ weight.T
    b = _f16(rng, vocab, hidden, scale=0.05)
    return {"B": b}, {"A": x}, x.astype(F32) @ b.astype(F32).T


@pytest.mark.parametrize("m,vocab,quant,knobs", [
    (1, 2048, "w4a16", dict(tile_m=1, tile_n=512, tile_k=576, a_at=1)),
    (1, 49152, "w4a16", dict(tile_m=1, tile_n=2048, tile_k=576, a_at=1)),   # SmolLM2 vocab
    (3, 2000, "fp16", dict(tile_m=3, tile_n=384, tile_k=576, a_at=1)),     # tied, ragged N
])
def test_lm_head(m, vocab, quant, knobs):
    hidden, group = 576, 32
    consts, inputs, ref = _lm_head_case(m, vocab, hidden, quant)
    sch = s_tir.Schedule(tvm.IRModule({"main": embedding.lm_head(m, vocab, hidden, quant)}))
    embedding.schedule_lm_head(sch, group=group if quant == "w4a16" else 0, slots_a=1,
                               slots_b=2, slots_c=2, dma_split=1, **knobs)
    program = lower_primfunc(sch.mod["main"], SPEC, "lm_head", consts=consts)
    r = Emulator(SPEC).run(program, inputs)
    _check(r.outputs["D"], ref)
    # the weights stream through TCM exactly once
    weight_bytes = sum(c.nbytes for c in consts.values())
    loads = sum(c.dst.nbytes for c in program.commands if isinstance(c, DmaLoad))
    assert loads == weight_bytes + inputs[next(iter(inputs))].nbytes
    assert program.tcm_bytes < SPEC.tcm_bytes


def test_lm_head_random_knobs():
    consts, inputs, ref = _lm_head_case(1, 2048, 576, "w4a16", seed=2)
    func = embedding.lm_head(1, 2048, 576)
    lowered = 0
    for seed in range(1, 6):
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=seed)
        embedding.schedule_lm_head(sch, group=32)
        try:
            program = lower_primfunc(sch.mod["main"], SPEC, "lm_head", consts=consts)
        except CandidateRejected:
            continue
        _check(Emulator(SPEC).run(program, inputs).outputs["D"], ref)
        lowered += 1
    assert lowered >= 1
