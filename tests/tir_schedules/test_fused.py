"""Fusion clusters: a chain of ops as one kernel with the intermediates in TCM, checked
against numpy, against the same ops run as separate kernels (DRAM bytes), and against a
TCM too small for it."""
import dataclasses

import numpy as np
import pytest
import tvm
from tvm import s_tir

from edgetvm.errors import CandidateRejected
from edgetvm.target.emulator import Emulator
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules import fused
from edgetvm.tir_schedules.fused import FusionCluster, Stage
from w4_cases import w4_weights

SPEC = load_spec("edge-npu-16mb")
F32 = np.float32
# SmolLM2-135M: hidden 576, 9 query heads / 3 kv heads of 64, MLP 1536
HIDDEN, N_Q, N_KV, HEAD_DIM, INTER, GROUP = 576, 9, 3, 64, 1536, 32


def _data(cluster, seed=0):
    """Random inputs; each W4 linear ``<p>_w``/``<p>_s`` (and ``<p>_z``) from its codes,
    its float weight kept as ``<p>_float`` for the reference."""
    rng = np.random.default_rng(seed)
    d = {}
    for name, (shape, dtype) in cluster.tensors.items():
        if name.endswith("_w") and dtype == "uint8":
            p = name[:-2]
            n, k = shape[0], shape[1] * 2
            group = k // cluster.tensors[f"{p}_s"][0][1]
            zeros = cluster.tensors.get(f"{p}_z", (None, "none"))[1]
            d[name], d[f"{p}_s"], z, d[f"{p}_float"] = w4_weights(rng, n, k, group, zeros)
            if z is not None:
                d[f"{p}_z"] = z
        elif name not in d:
            d[name] = rng.standard_normal(shape).astype(np.float16)
    return d


def _inputs(cluster, d):
    return {n: d[n] for n in cluster.tensors if n not in cluster.consts}


def _lower(cluster, d, spec=SPEC, seed=1, **knobs):
    sch = s_tir.Schedule(tvm.IRModule({"main": cluster.prim_func()}), seed=seed)
    fused.schedule_cluster(sch, **knobs)
    return fused.lower_cluster(cluster, sch, spec, d)


def _run(cluster, d, **knobs):
    program = _lower(cluster, d, **knobs)
    return program, Emulator(SPEC).run(program, _inputs(cluster, d))


def _r16(a):          # an fp16 intermediate, as the kernel stores it
    return a.astype(np.float16).astype(F32)


def _lin(x, d, p):
    return x @ d[f"{p}_float"].T


def _rope(t, cos, sin):
    m = t.shape[0]
    t = t.reshape(m, -1, HEAD_DIM)
    h = HEAD_DIM // 2
    rot = np.concatenate([-t[..., h:], t[..., :h]], -1)
    return (t * cos.astype(F32)[:, None] + rot * sin.astype(F32)[:, None]).reshape(m, -1)


def _qkv_ref(d):
    x = d["x"].astype(F32)
    xn = _r16(x / np.sqrt((x * x).mean(1, keepdims=True) + 1e-5) * d["norm_w"].astype(F32))
    q, k, v = (_r16(_lin(xn, d, p)) for p in "qkv")
    return {"q_rot": _rope(q, d["cos"], d["sin"]), "k_rot": _rope(k, d["cos"], d["sin"]),
            "v_lin": v}


def _mlp_ref(d):
    x = d["x"].astype(F32)
    g, u = _r16(_lin(x, d, "gate")), _r16(_lin(x, d, "up"))
    return {"down": _lin(_r16(g / (1 + np.exp(-g)) * u), d, "down")}


def _check(outputs, ref):
    for name, want in ref.items():
        got = outputs[name].astype(F32)
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * np.abs(want).max(),
                                   err_msg=name)


def _mm(names, **knobs):
    return {n: dict(knobs) for n in names}


QKV = ("q_lin", "k_lin", "v_lin")
MLP = ("gate", "up", "down")


@pytest.mark.parametrize("m,knobs", [
    (1, dict(tile_m=1, slots_in=1, slots_out=2, dma_split=1,           # decode
             matmul=_mm(QKV, tile_n=192, tile_k=576, slots_w=2, slots_c=2))),
    (3, dict(tile_m=2, slots_in=2, slots_out=2, dma_split=0,           # ragged rows, ragged N
             matmul=_mm(QKV, tile_n=128, tile_k=192, slots_w=2, slots_c=1))),
])
def test_norm_qkv_rope_cluster(m, knobs):
    cluster = fused.norm_qkv_rope_cluster(m, HIDDEN, N_Q, N_KV, HEAD_DIM, GROUP)
    d = _data(cluster)
    program, r = _run(cluster, d, **knobs)
    _check(r.outputs, _qkv_ref(d))
    assert {t.name for t in program.tensors_of("output")} == \
        {"q_rot", "k_rot", "v_lin"}
    # xn and the projections never reach DRAM
    assert not {"xn", "q_lin", "k_lin"} & set(program.tensors)


@pytest.mark.parametrize("m,knobs", [
    (1, dict(tile_m=1, slots_in=1, slots_out=2, dma_split=1,           # decode
             matmul=_mm(MLP, tile_n=256, tile_k=512, slots_w=2, slots_c=2))),
    (5, dict(tile_m=5, slots_in=1, slots_out=1, dma_split=0,           # whole rows, whole K
             matmul={"gate": dict(tile_n=1536, tile_k=576, slots_w=1, slots_c=1),
                     "up": dict(tile_n=200, tile_k=288, slots_w=2, slots_c=2),
                     "down": dict(tile_n=576, tile_k=1536, slots_w=1, slots_c=1)})),
])
def test_mlp_cluster(m, knobs):
    cluster = fused.mlp_cluster(m, HIDDEN, INTER, GROUP)
    d = _data(cluster)
    _, r = _run(cluster, d, **knobs)
    _check(r.outputs, _mlp_ref(d))


@pytest.mark.parametrize("zeros", ["float16", "uint8"])
def test_mlp_cluster_with_zero_points(zeros):
    """W4 zero points DMA'd per weight tile beside the scales; float16 ones fractional."""
    cluster = fused.mlp_cluster(3, HIDDEN, INTER, GROUP, zeros=zeros)
    d = _data(cluster)
    program, r = _run(cluster, d, tile_m=3, slots_in=1, slots_out=2, dma_split=1,
                      matmul=_mm(MLP, tile_n=256, tile_k=512, slots_w=2, slots_c=2))
    _check(r.outputs, _mlp_ref(d))
    z_bytes = sum(t.nbytes for t in program.tensors_of("const") if t.name.endswith("_z"))
    assert z_bytes == 3 * HIDDEN * INTER // GROUP * (2 if zeros == "float16" else 1)


def test_generic_chain_layer_norm_linear_gelu_residual():
    """Any chain of PIECES fuses: LayerNorm -> fp16 linear -> GELU -> residual add."""
    m, h = 6, 128
    t = {"x": ((m, h), "float16"), "ln_w": ((h,), "float16"), "ln_b": ((h,), "float16"),
         "fc_w": ((h, h), "float16")}
    stages = [Stage("layer_norm", ("x", "ln_w", "ln_b"), "xn"),
              Stage("linear_fp16", ("xn", "fc_w"), "fc"),
              Stage("gelu", ("fc",), "act"),
              Stage("add", ("act", "x"), "out")]
    cluster = FusionCluster("ln_fc_gelu_res", t, stages, ("out",), ("ln_w", "ln_b", "fc_w"))
    d = _data(cluster)
    d["fc_w"] = (d["fc_w"] * np.float16(0.1)).astype(np.float16)
    _, r = _run(cluster, d, tile_m=4, slots_in=2, slots_out=2, dma_split=0,
                matmul={"fc": dict(tile_n=64, tile_k=64, slots_w=2, slots_c=2)})
    from math import erf
    x = d["x"].astype(F32)
    xc = x - x.mean(1, keepdims=True)
    xn = _r16(xc / np.sqrt((xc * xc).mean(1, keepdims=True) + 1e-5) * d["ln_w"].astype(F32)
              + d["ln_b"].astype(F32))
    fc = _r16(xn @ d["fc_w"].astype(F32).T)
    act = _r16(0.5 * fc * (1 + np.vectorize(erf)(fc / np.sqrt(2))))
    _check(r.outputs, {"out": act + x})


@pytest.mark.parametrize("m,knobs", [
    (1, dict(tile_m=1, slots_in=1, slots_out=2, dma_split=1,
             matmul={"gate": dict(tile_n=512, tile_k=576, slots_w=2, slots_c=2)})),
    (7, dict(tile_m=4, slots_in=2, slots_out=1, dma_split=0,           # ragged row tile
             matmul={"gate": dict(tile_n=384, tile_k=192, slots_w=1, slots_c=2)})),
])
def test_results_read_inside_the_kernel_and_after_it(m, knobs):
    """A layer boundary cut after the gate projection: the residual sum and the norm's
    output are outputs (the next residual add and the up projection read them after the
    kernel) that ops inside also read. Those read the TCM copy the store writes from; a
    schedule whose ops read the DRAM output (never written yet, or written by the store
    of the same tile) fails here or gives garbage."""
    t = {"a": ((m, HIDDEN), "float16"), "b": ((m, HIDDEN), "float16"),
         "norm_w": ((HIDDEN,), "float16")}
    t.update(fused.w4_tensors("gate", INTER, HIDDEN, GROUP))
    stages = [Stage("add", ("a", "b"), "res"),
              Stage("rms_norm", ("res", "norm_w"), "xn", {"eps": 1e-5}),
              Stage("linear_w4a16", ("xn", "gate_w", "gate_s"), "gate")]
    cluster = FusionCluster("add_norm_gate", t, stages, ("res", "xn", "gate"),
                            ("norm_w", "gate_w", "gate_s"))
    d = _data(cluster, seed=3)
    program, r = _run(cluster, d, **knobs)
    res = _r16(d["a"].astype(F32) + d["b"].astype(F32))
    xn = _r16(res / np.sqrt((res * res).mean(1, keepdims=True) + 1e-5)
              * d["norm_w"].astype(F32))
    _check(r.outputs, {"res": res, "xn": xn, "gate": _lin(xn, d, "gate")})
    assert {t.name for t in program.tensors_of("output")} == {"res", "xn", "gate"}


def _separate(cluster, d, knobs):
    """Run the cluster's ops as separate kernels; returns (outputs, list of counters)."""
    env = dict(d)
    counters = []
    for k in cluster.split():
        mm = {s: v for s, v in knobs.get("matmul", {}).items() if s == k.stages[0].output}
        program = _lower(k, env, **{**knobs, "matmul": mm})
        r = Emulator(SPEC).run(program, _inputs(k, env))
        env.update(r.outputs)
        counters.append(r.counters)
    return env, counters


def _bytes(names, d):
    return sum(d[n].nbytes for n in names)


@pytest.mark.parametrize("which", ["norm_qkv_rope", "mlp"])
def test_fused_kernel_moves_fewer_dram_bytes_than_separate_kernels(which):
    if which == "mlp":
        cluster, ref_fn = fused.mlp_cluster(1, HIDDEN, INTER, GROUP), _mlp_ref
        mm = _mm(MLP, tile_n=256, tile_k=512, slots_w=2, slots_c=2)
    else:
        cluster, ref_fn = fused.norm_qkv_rope_cluster(1, HIDDEN, N_Q, N_KV, HEAD_DIM,
                                                      GROUP), _qkv_ref
        mm = _mm(QKV, tile_n=192, tile_k=576, slots_w=2, slots_c=2)
    knobs = dict(tile_m=1, slots_in=1, slots_out=2, dma_split=1, matmul=mm)
    d = _data(cluster)
    _, fused_run = _run(cluster, d, **knobs)
    env, separate = _separate(cluster, d, knobs)
    ref = ref_fn(d)
    _check(fused_run.outputs, ref)
    _check({n: env[n] for n in cluster.outputs}, ref)

    fused_bytes = fused_run.counters.dram_read_bytes + fused_run.counters.dram_write_bytes
    split_bytes = sum(c.dram_read_bytes + c.dram_write_bytes for c in separate)
    # every kernel moves each of its operands exactly once (decode: one row block) ...
    assert fused_bytes == _bytes(cluster.tensors, d) + _bytes(cluster.outputs, env)
    assert split_bytes == sum(_bytes(k.tensors, env) + _bytes(k.outputs, env)
                              for k in cluster.split())
    # ... so fusing saves exactly the intermediates' round trips and the re-read inputs
    assert fused_bytes < split_bytes
    inter = [s.output for s in cluster.stages if s.output not in cluster.outputs]
    assert split_bytes - fused_bytes >= 2 * _bytes(inter, env)
    assert fused_run.counters.total_cycles < sum(c.total_cycles for c in separate)


def test_cluster_that_does_not_fit_the_tcm_is_rejected_naming_its_buffers():
    cluster = fused.mlp_cluster(1, HIDDEN, INTER, GROUP)
    d = _data(cluster)
    knobs = dict(tile_m=1, slots_in=1, slots_out=2, dma_split=1,
                 matmul=_mm(MLP, tile_n=512, tile_k=576, slots_w=2, slots_c=2))
    assert _lower(cluster, d, **knobs).tcm_bytes > 96 * 1024      # fits the 16 MB TCM
    small = SPEC.replace(tcm_bytes=96 * 1024)
    with pytest.raises(CandidateRejected,
                       match=r"fusion cluster 'mlp': TCM overflow.*gate_w_global\.tcm") as e:
        _lower(cluster, d, spec=small, **knobs)
    assert "act_global.tcm" in str(e.value) and "x_global.tcm" in str(e.value)


@pytest.mark.parametrize("which", ["norm_qkv_rope", "mlp"])
def test_random_knob_samples_lower_and_match(which):
    m = 3
    if which == "mlp":
        cluster, ref_fn = fused.mlp_cluster(m, HIDDEN, INTER, GROUP), _mlp_ref
    else:
        cluster, ref_fn = fused.norm_qkv_rope_cluster(m, HIDDEN, N_Q, N_KV, HEAD_DIM,
                                                      GROUP), _qkv_ref
    d = _data(cluster, seed=4)
    func = cluster.prim_func()
    names = fused.knob_names(func)
    streamed = ["slots_x"] if which == "mlp" else ["slots_x", "slots_cos", "slots_sin"]
    stages = MLP if which == "mlp" else QKV
    assert names == tuple(["tile_m"] + streamed + ["slots_out", "dma_split", "tcm_fresh",
                                                   "list_schedule", "resident_w"] +
                          [f"{s}.{k}" for s in stages for k in fused.MATMUL_KNOBS])
    lowered = 0
    for seed in (21, 22, 23, 24):
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=seed)
        fused.schedule_cluster(sch, tcm_fresh=None, list_schedule=None, resident_w=None)
        try:
            program = fused.lower_cluster(cluster, sch, SPEC, d)
        except CandidateRejected:
            continue
        _check(Emulator(SPEC).run(program, _inputs(cluster, d)).outputs, ref_fn(d))
        lowered += 1
    assert lowered >= 1


@pytest.mark.parametrize("list_schedule,tcm_fresh,dma_split", [(0, 0, 1), (1, 1, 1), (1, 0, 0)])
def test_resident_weights_are_read_from_dram_once(list_schedule, tcm_fresh, dma_split):
    """``resident_w=1``: every weight tensor (codes, scales, zero points) is one DMA of its
    whole self, before the row loop, and each MMA reads its tile out of it. Three row tiles
    (the last ragged), several K tiles per stage: the same numbers as the weights streamed
    per tile, and the DRAM reads are the input rows plus each weight exactly once, where
    streaming reads the weights once per row tile. A weight loaded after its MMAs, a tile
    read at the wrong offset of the resident buffer, or resident buffers sharing bytes
    with the row tiles' would each give other numbers."""
    from edgetvm.target.isa import DmaLoad
    m = 40
    cluster = fused.mlp_cluster(m, HIDDEN, INTER, GROUP, zeros="uint8")
    d = _data(cluster, seed=6)
    knobs = dict(tile_m=16, slots_in=2, slots_out=2, dma_split=dma_split,
                 tcm_fresh=tcm_fresh, list_schedule=list_schedule,
                 matmul={"gate": dict(tile_n=512, tile_k=192, slots_w=2, slots_c=2),
                         "up": dict(tile_n=384, tile_k=288, slots_w=1, slots_c=1),
                         "down": dict(tile_n=192, tile_k=512, slots_w=2, slots_c=1)})
    runs = {}
    for rw in (0, 1):
        program = _lower(cluster, d, resident_w=rw, **knobs)
        runs[rw] = program, Emulator(SPEC).run(program, _inputs(cluster, d))
        _check(runs[rw][1].outputs, _mlp_ref(d))
    np.testing.assert_allclose(runs[1][1].outputs["down"].astype(F32),
                               runs[0][1].outputs["down"].astype(F32), rtol=0, atol=0)
    program, r = runs[1]
    consts = {t.name: t.nbytes for t in program.tensors_of("const")}
    loads = [c for c in program.commands if isinstance(c, DmaLoad) and c.src.tensor in consts]
    assert sorted(c.src.tensor for c in loads) == sorted(consts)      # one DMA each
    weights = sum(consts.values())
    x_bytes = m * HIDDEN * 2
    assert r.counters.dram_read_bytes == x_bytes + weights
    assert runs[0][1].counters.dram_read_bytes == x_bytes + 3 * weights
    if not list_schedule:         # the loop nest's order: the weights in stage order
        order = [c.src.tensor for c in loads]
        assert order.index("gate_w") < order.index("up_w") < order.index("down_w")


def test_resident_weights_that_do_not_fit_are_refused_naming_them():
    cluster, d = _fp16_mlp(64)
    knobs = dict(tile_m=16, slots_in=2, slots_out=2, dma_split=1,
                 matmul=_mm(MLP, tile_n=256, tile_k=576, slots_w=2, slots_c=2))
    knobs["matmul"]["down"]["tile_k"] = 512
    small = SPEC.replace(tcm_bytes=4 << 20)        # 3 x 1.7 MB of fp16 weights do not fit
    _lower(cluster, d, spec=small, resident_w=0, **knobs)
    with pytest.raises(CandidateRejected, match=r"TCM overflow.*gate_w_global\.tcm"):
        _lower(cluster, d, spec=small, resident_w=1, **knobs)


def _fp16_mlp(m):
    """SmolLM2's MLP with fp16 weights: gate, up, silu(gate) * up, down."""
    t = {"x": ((m, HIDDEN), "float16"), "gate_w": ((INTER, HIDDEN), "float16"),
         "up_w": ((INTER, HIDDEN), "float16"), "down_w": ((HIDDEN, INTER), "float16")}
    stages = [Stage("linear_fp16", ("x", "gate_w"), "gate"),
              Stage("linear_fp16", ("x", "up_w"), "up"),
              Stage("silu_mul", ("gate", "up"), "act"),
              Stage("linear_fp16", ("act", "down_w"), "down")]
    cluster = FusionCluster("mlp16", t, stages, ("down",), ("gate_w", "up_w", "down_w"))
    d = _data(cluster, seed=5)
    for p in MLP:
        d[f"{p}_w"] = (d[f"{p}_w"] * np.float16(0.05)).astype(np.float16)
        d[f"{p}_float"] = d[f"{p}_w"].astype(F32)
    return cluster, d


def test_tcm_fresh_buffers_let_the_next_stage_prefetch_and_change_nothing_else():
    """``tcm_fresh=1``: every TCM buffer in bytes of its own (more TCM, as the plan says),
    so the up projection's first weight tile is not held back until the gate's epilogue
    has read the bytes it would reuse: fewer cycles, the same numbers. A knob set without
    the knob (a log record older than it) lowers exactly as ``tcm_fresh=0``; and where the
    fresh bytes do not fit, the buffers share them as before instead of being refused."""
    from edgetvm.target import program_format
    m = 128
    cluster, d = _fp16_mlp(m)
    knobs = dict(tile_m=m, slots_in=2, slots_out=2, dma_split=1,
                 matmul=_mm(MLP, tile_n=256, tile_k=1536, slots_w=2, slots_c=2))
    shared = _lower(cluster, d, tcm_fresh=0, **knobs)
    fresh = _lower(cluster, d, tcm_fresh=1, **knobs)
    assert fresh.tcm_bytes > shared.tcm_bytes
    runs = {}
    for name, prog in (("shared", shared), ("fresh", fresh)):
        runs[name] = Emulator(SPEC).run(prog, _inputs(cluster, d))
        _check(runs[name].outputs, _mlp_ref(d))
    assert runs["fresh"].counters.total_cycles < 0.9 * runs["shared"].counters.total_cycles
    np.testing.assert_array_equal(runs["fresh"].outputs["down"], runs["shared"].outputs["down"])
    assert program_format.dumps(_lower(cluster, d, **knobs)) == program_format.dumps(shared)
    tight = SPEC.replace(tcm_bytes=shared.tcm_bytes)
    assert program_format.dumps(_lower(cluster, d, spec=tight, tcm_fresh=1, **knobs)) == \
        program_format.dumps(_lower(cluster, d, spec=tight, tcm_fresh=0, **knobs))


def _unit_order(program, unit_type):
    return [i for i, c in enumerate(program.commands) if isinstance(c, unit_type)]


@pytest.mark.parametrize("slots_in,tcm_fresh", [(2, 1), (1, 1), (2, 0)])
def test_list_schedule_overlaps_row_tiles_and_changes_no_number(slots_in, tcm_fresh):
    """``list_schedule=1``: the matrix unit runs row tile r + 1's projections while the
    vector unit normalises tile r, instead of waiting in the loop nest's order. The same
    commands, reordered within their byte dependencies: the same numbers bit for bit, in
    fewer cycles. With one TCM copy of the input (``slots_in=1``) the next tile's load
    must still wait for every read of the one it overwrites; with ``tcm_fresh=0`` a buffer
    placed in the bytes of one dead before it must follow all of that one's accesses. A
    knob set without the knob lowers as ``list_schedule=0``."""
    from edgetvm.target import program_format
    m = 256
    cluster = fused.norm_qkv_rope_cluster(m, HIDDEN, N_Q, N_KV, HEAD_DIM, GROUP)
    d = _data(cluster, seed=6)
    knobs = dict(tile_m=128, slots_in=slots_in, slots_out=2, dma_split=1, tcm_fresh=tcm_fresh,
                 matmul=_mm(QKV, tile_n=192, tile_k=576, slots_w=2, slots_c=2))
    plain = _lower(cluster, d, list_schedule=0, **knobs)
    listed = _lower(cluster, d, list_schedule=1, **knobs)
    assert program_format.dumps(_lower(cluster, d, **knobs)) == program_format.dumps(plain)
    assert sorted(repr(_no_sync(c)) for c in listed.commands) == \
        sorted(repr(_no_sync(c)) for c in plain.commands)
    assert listed.tcm_bytes == plain.tcm_bytes
    runs = {n: Emulator(SPEC).run(p, _inputs(cluster, d))
            for n, p in (("plain", plain), ("listed", listed))}
    _check(runs["listed"].outputs, _qkv_ref(d))
    for name in ("q_rot", "k_rot", "v_lin"):
        np.testing.assert_array_equal(runs["listed"].outputs[name], runs["plain"].outputs[name])
    # the same commands in another order (a pass that kept the order would fail here)
    assert [repr(_no_sync(c)) for c in listed.commands] != \
        [repr(_no_sync(c)) for c in plain.commands]
    assert runs["listed"].counters.total_cycles < 0.95 * runs["plain"].counters.total_cycles


def _down_residual(m):
    """SmolLM2's down projection and residual add (``local``'s cluster), fp16."""
    t = {"x": ((m, INTER), "float16"), "down_w": ((HIDDEN, INTER), "float16"),
         "r": ((m, HIDDEN), "float16")}
    stages = [Stage("linear_fp16", ("x", "down_w"), "lin"), Stage("add", ("lin", "r"), "out")]
    cluster = FusionCluster("down_residual", t, stages, ("out",), ("down_w",))
    d = _data(cluster, seed=8)
    d["down_w"] = (d["down_w"] * np.float16(0.03)).astype(np.float16)
    ref = {"out": _r16(d["x"].astype(F32) @ d["down_w"].astype(F32).T) + d["r"].astype(F32)}
    return cluster, d, ref, dict(tile_m=m, slots_in=2, slots_out=2, dma_split=1, tcm_fresh=1,
                                 matmul={"lin": dict(tile_n=256, tile_k=INTER, slots_w=2,
                                                     slots_c=2)})


def _qkv_row_tiles(m):
    cluster = fused.norm_qkv_rope_cluster(m, HIDDEN, N_Q, N_KV, HEAD_DIM, GROUP)
    d = _data(cluster, seed=6)
    return cluster, d, _qkv_ref(d), dict(
        tile_m=m // 2, slots_in=2, slots_out=2, dma_split=1, tcm_fresh=1,
        matmul=_mm(QKV, tile_n=192, tile_k=576, slots_w=2, slots_c=2))


@pytest.mark.parametrize("case,listed_faster", [(_qkv_row_tiles, True),
                                                (_down_residual, False)])
def test_the_auto_order_is_the_one_the_emulator_measures_faster(case, listed_faster):
    """``list_schedule=2`` (``LIST_SCHEDULE_AUTO``, a build's default) lowers to exactly
    the program of whichever of the two orders the lowering's plan estimates faster, and
    says which in ``metadata["list_scheduled"]``. Two clusters where the emulator ranks
    the orders oppositely: two row tiles of the QKV prologue overlap list-scheduled; the
    128-row down projection with its residual add runs slower list-scheduled (the plan
    front-loads weight DMAs on both channels, which share one bus). A choice that ignored
    the estimate, or inverted it, takes the slower program in one of them."""
    from edgetvm.target import program_format
    from edgetvm.target.lowering import LIST_SCHEDULE_AUTO
    cluster, d, ref, knobs = case(128)
    progs = {ls: _lower(cluster, d, list_schedule=ls, **knobs) for ls in (0, 1)}
    cycles = {ls: Emulator(SPEC).run(p, _inputs(cluster, d)).counters.total_cycles
              for ls, p in progs.items()}
    if listed_faster:
        assert cycles[1] < 0.95 * cycles[0]
    else:
        assert cycles[1] > 1.05 * cycles[0]
    auto = _lower(cluster, d, list_schedule=LIST_SCHEDULE_AUTO, **knobs)
    want = 1 if listed_faster else 0
    assert auto.metadata["list_scheduled"] is bool(want)
    assert program_format.dumps(auto) == program_format.dumps(progs[want])
    _check(Emulator(SPEC).run(auto, _inputs(cluster, d)).outputs, ref)


def _no_sync(cmd):
    """A command without its events (the order changes them, not what it does)."""
    return dataclasses.replace(cmd, wait=(), signal=())


@pytest.mark.parametrize("imm", [1.0, 0.5, -3.0])
def test_scale_by_a_constant_including_one(imm):
    # TVM folds x * 1.0 to x: a mul with one operand and no constant left would lower as
    # x * x (how a square reads one buffer twice); Granite's multipliers may be 1
    c = FusionCluster("scale", {"x": ((5, 96), "float16")},
                      [Stage("scale", ("x",), "y", {"imm": imm})], ("y",), ())
    d = {"x": np.random.default_rng(3).standard_normal((5, 96)).astype(np.float16)}
    _, res = _run(c, d, tile_m=2, slots_in=2, slots_out=2, dma_split=0)
    np.testing.assert_array_equal(res.outputs["y"].astype(F32),
                                  (d["x"].astype(F32) * imm).astype(np.float16).astype(F32))


def test_a_vector_op_whose_constant_folded_away_is_refused_not_squared(monkeypatch):
    from tvm import te, tirx

    def mul_by_one(x, imm, name="scale"):
        m, n = (int(s) for s in x.shape)
        one = tirx.const(1.0, "float32")
        return te.compute((m, n), lambda i, j: (x[i, j].astype("float32") * one)
                          .astype(x.dtype), name=name, attrs={"npu.op": "vector:mul"})

    monkeypatch.setitem(fused.PIECES, "scale", mul_by_one)
    c = FusionCluster("scale", {"x": ((4, 64), "float16")},
                      [Stage("scale", ("x",), "y", {"imm": 1.0})], ("y",), ())
    d = {"x": np.ones((4, 64), np.float16)}
    with pytest.raises(CandidateRejected, match="no constant"):
        _lower(c, d, tile_m=1, slots_in=1, slots_out=1, dma_split=0)


def test_relu_cluster():
    # OPT's MLP activation: max(x, 0) as one vector op with the immediate 0
    c = FusionCluster("relu", {"x": ((6, 80), "float16")}, [Stage("relu", ("x",), "y")],
                      ("y",), ())
    d = {"x": np.random.default_rng(4).standard_normal((6, 80)).astype(np.float16)}
    _, res = _run(c, d, tile_m=4, slots_in=2, slots_out=2, dma_split=1)
    np.testing.assert_array_equal(res.outputs["y"], np.where(d["x"] > 0, d["x"], 0))


def test_relu2_cluster():
    # Nemotron's MLP activation: max(x, 0) squared (a max with the immediate 0, then a mul),
    # fp32 between the two; numpy from the definition, rounded to fp16 once at the end
    c = FusionCluster("relu2", {"x": ((6, 80), "float16")}, [Stage("relu2", ("x",), "y")],
                      ("y",), ())
    x = (np.random.default_rng(5).standard_normal((6, 80)) * 3).astype(np.float16)
    _, res = _run(c, {"x": x}, tile_m=4, slots_in=2, slots_out=2, dma_split=1)
    r = np.maximum(x.astype(np.float32), 0)
    want = (r * r).astype(np.float16)
    assert (x < 0).any() and (want > 4).any()
    np.testing.assert_array_equal(res.outputs["y"], want)


@pytest.mark.parametrize("op", ["relu_mul", "relu2_mul"])
def test_gated_relu_clusters(op):
    # ReGLU relu(g) * u and BitNet's relu(g)^2 * u: numpy from the definition, fp32 between
    # the ops, rounded to fp16 once at the end
    c = FusionCluster(op, {"g": ((6, 80), "float16"), "u": ((6, 80), "float16")},
                      [Stage(op, ("g", "u"), "y")], ("y",), ())
    rng = np.random.default_rng(6)
    g = (rng.standard_normal((6, 80)) * 3).astype(np.float16)
    u = (rng.standard_normal((6, 80)) * 2).astype(np.float16)
    _, res = _run(c, {"g": g, "u": u}, tile_m=4, slots_in=2, slots_out=2, dma_split=1)
    r = np.maximum(g.astype(np.float32), 0)
    if op == "relu2_mul":
        r = r * r
    want = (r * u.astype(np.float32)).astype(np.float16)
    assert (g < 0).any() and (np.abs(want) > 4).any()
    np.testing.assert_array_equal(res.outputs["y"], want)
