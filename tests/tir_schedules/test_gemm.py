"""GEMM / GEMV templates (fp16 and W4A16): lowered, run on the emulator, checked with numpy."""
import dataclasses

import numpy as np
import pytest
import tvm
from tvm import s_tir

from edgetvm.errors import CandidateRejected, InvalidProgramError
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import DmaLoad, Mma
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules import gemm, workloads
from edgetvm.tir_schedules.search import knob_space, sampled_knobs
from w4_cases import w4_weights

SPEC = load_spec("edge-npu-16mb")


def _lower(func, consts, **knobs):
    sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=7)
    gemm.schedule_matmul(sch, **knobs)
    return lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts), sch


def _fp16_case(m, n, k, layout="kn", seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((k, n) if layout == "kn" else (n, k)).astype(np.float16)
    bb = b.astype(np.float32) if layout == "kn" else b.astype(np.float32).T
    return workloads.gemm_fp16(m, n, k, layout), {"B": b}, {"A": a}, \
        a.astype(np.float32) @ bb


def _w4_case(m, n, k, group, zeros="none", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float16)
    w, s, z, weight = w4_weights(rng, n, k, group, zeros, scale=(0.01, 0.06))
    consts = {"W": w, "S": s}
    if z is not None:
        consts["Z"] = z
    ref = x.astype(np.float32) @ weight.T
    return workloads.gemm_w4a16(m, n, k, group, zeros), consts, {"X": x}, ref


def _check(program, inputs, ref):
    out = Emulator(SPEC).run(program, inputs).outputs["D"].astype(np.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("m,n,k,layout,knobs", [
    (64, 128, 128, "kn", dict(tile_m=64, tile_n=64, tile_k=64, slots_a=2, slots_b=2)),
    (5, 200, 96, "kn", dict(tile_m=16, tile_n=64, tile_k=32, slots_a=2, slots_b=2)),  # ragged
    (37, 70, 48, "nk", dict(tile_m=37, tile_n=70, tile_k=48, slots_a=1, slots_b=1)),  # whole
    (130, 100, 200, "kn", dict(tile_m=64, tile_n=32, tile_k=64, slots_c=2, a_at=1)),
])
def test_gemm_fp16(m, n, k, layout, knobs):
    func, consts, inputs, ref = _fp16_case(m, n, k, layout)
    program, _ = _lower(func, consts, **{"slots_c": 1, "a_at": 0, "dma_split": 0, **knobs})
    _check(program, inputs, ref)


@pytest.mark.parametrize("m,n,k,group,zeros,knobs", [
    (1, 576, 576, 32, "none", dict(tile_m=1, tile_n=128, tile_k=576, a_at=1)),  # decode GEMV
    (1, 100, 256, 64, "uint8", dict(tile_m=1, tile_n=64, tile_k=128, a_at=0)),   # ragged N
    (3, 96, 384, 128, "none", dict(tile_m=3, tile_n=96, tile_k=384, a_at=1)),  # whole dims
    (20, 64, 192, 32, "uint8", dict(tile_m=16, tile_n=32, tile_k=96, a_at=0, dma_split=1)),
    # float16 zero points (MatMulNBits' float form): a GEMV and a ragged GEMM
    (1, 576, 576, 32, "float16", dict(tile_m=1, tile_n=128, tile_k=576, a_at=1)),
    (20, 100, 256, 64, "float16", dict(tile_m=16, tile_n=64, tile_k=128, a_at=0, dma_split=1)),
])
def test_gemm_w4a16(m, n, k, group, zeros, knobs):
    func, consts, inputs, ref = _w4_case(m, n, k, group, zeros)
    program, _ = _lower(func, consts, group=group,
                        **{"slots_a": 1, "slots_b": 2, "slots_c": 2, "dma_split": 0, **knobs})
    kinds = {c.kind for c in program.commands if isinstance(c, Mma)}
    assert kinds == {"w4a16"}                  # dequantised inside the MMA, not in DRAM
    assert all(t.dtype != "float32" for t in program.tensors.values())
    _check(program, inputs, ref)


def test_random_knob_samples_lower_and_match():
    func, consts, inputs, ref = _w4_case(4, 160, 256, 32)
    seen, checked = set(), set()
    for seed in range(1, 7):
        sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=seed)
        gemm.schedule_matmul(sch, group=32)
        knobs = tuple(sampled_knobs(sch, gemm.KNOBS).values())
        seen.add(knobs)
        try:
            program = lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts)
        except CandidateRejected:
            continue
        _check(program, inputs, ref)
        checked.add(knobs)
    assert len(seen) > 1 and len(checked) >= 2     # several distinct schedules ran


def test_knob_space_is_read_from_the_trace():
    sch = s_tir.Schedule(tvm.IRModule({"main": workloads.gemm_fp16(8, 100, 64)}), seed=1)
    gemm.schedule_matmul(sch)
    space = knob_space(sch, gemm.KNOBS)
    assert space["tile_n"] == [16, 32, 64, 100] and space["slots_b"] == [1, 2, 3]


def test_double_buffering_overlaps_dma_with_compute():
    func, consts, inputs, _ = _w4_case(1, 1536, 576, 32)
    base = dict(tile_m=1, tile_n=128, tile_k=576, slots_a=1, slots_c=2, a_at=1, dma_split=1)
    single, _ = _lower(func, consts, group=32, slots_b=1, **base)
    double, _ = _lower(func, consts, group=32, slots_b=2, **base)
    emu = Emulator(SPEC)
    c1, c2 = emu.run(single, inputs).counters, emu.run(double, inputs).counters
    assert c1.dram_read_bytes == c2.dram_read_bytes
    assert c2.total_cycles < 0.85 * c1.total_cycles
    # the weight tiles now take two TCM slots
    assert double.metadata["tcm_buffers"]["W_global.tcm"]["slots"] == 2


def test_wrong_double_buffering_is_caught_by_the_race_check():
    func, consts, inputs, ref = _w4_case(1, 512, 256, 32)
    program, _ = _lower(func, consts, group=32, tile_m=1, tile_n=64, tile_k=256, slots_a=1,
                        slots_b=2, slots_c=1, a_at=1, dma_split=0)
    _check(program, inputs, ref)
    # drop the WAR event: the DMA refilling a weight slot no longer waits for the MMA
    # that reads the slot's previous tile
    k = next(i for i, c in enumerate(program.commands)
             if isinstance(c, DmaLoad) and c.src.tensor in ("W", "S") and c.wait)
    broken = dataclasses.replace(program, commands=list(program.commands))
    broken.commands[k] = dataclasses.replace(program.commands[k], wait=())
    with pytest.raises(InvalidProgramError, match="race"):
        Emulator(SPEC).run(broken, inputs)


def test_tcm_overflow_is_rejected_before_the_emulator():
    func, consts, _, _ = _fp16_case(256, 256, 256)
    small = SPEC.replace(tcm_bytes=64 * 1024)
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    gemm.schedule_matmul(sch, tile_m=256, tile_n=256, tile_k=256, slots_a=2, slots_b=2,
                         slots_c=1, a_at=0, dma_split=0)
    with pytest.raises(CandidateRejected, match="TCM overflow.*A_global.tcm"):
        lower_primfunc(sch.mod["main"], small, "k", consts=consts)


def test_operation_budget_rejects_tiny_tiles():
    func, consts, _, _ = _fp16_case(64, 256, 256)
    sch = s_tir.Schedule(tvm.IRModule({"main": func}))
    gemm.schedule_matmul(sch, tile_m=16, tile_n=16, tile_k=16, slots_a=1, slots_b=1,
                         slots_c=1, a_at=0, dma_split=0)
    with pytest.raises(CandidateRejected, match="more than 100 NPU operations"):
        lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts, max_ops=100)
    assert len(lower_primfunc(sch.mod["main"], SPEC, "k", consts=consts).commands) > 100
