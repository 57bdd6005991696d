"""The list scheduler's contract, checked on the lowered ops themselves: the order it
returns is a permutation of the ops that keeps every pair touching the same TCM bytes
(one of them writing) in the loop nest's order, including buffers that the allocator
placed in the bytes of a buffer dead before them."""
import pytest
import tvm
from tvm import s_tir

from edgetvm.target.lowering.interpret import Interpreter
from edgetvm.target.lowering.lower import _assign_units, _commands
from edgetvm.target.lowering.reorder import estimated_cycles, list_schedule
from edgetvm.target.lowering.tcm_alloc import locate, plan_tcm
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules import fused

SPEC = load_spec("edge-npu-16mb")


def _ops(cluster, **knobs):
    sch = s_tir.Schedule(tvm.IRModule({"main": cluster.prim_func()}), seed=1)
    fused.schedule_cluster(sch, **knobs)
    interp = Interpreter(sch.mod["main"], (), None)
    ops = interp.run()
    kinds = interp.buffers
    tcm, _ = plan_tcm(ops, kinds, SPEC, fresh=interp.tcm_fresh)
    units = _assign_units(ops, kinds, SPEC, interp.dma_split)
    return ops, kinds, tcm, units


def _slot_bytes(tb, slot):
    lo = tb.offset + slot * tb.slot_stride
    return lo, lo + tb.slot_bytes


@pytest.mark.parametrize("tile_m,tcm_fresh", [(256, 0), (128, 1)])
def test_the_order_keeps_every_byte_conflict(tile_m, tcm_fresh):
    cluster = fused.mlp_cluster(256, 576, 1536, 32)
    knobs = dict(tile_m=tile_m, slots_in=2, slots_out=2, dma_split=1, tcm_fresh=tcm_fresh,
                 matmul={s: dict(tile_n=256, tile_k=288, slots_w=2, slots_c=2)
                         for s in ("gate", "up", "down")})
    ops, kinds, tcm, units = _ops(cluster, **knobs)
    order = list_schedule(ops, units, kinds, tcm, lambda op: estimated_cycles(
        _commands(op, units[op.index], kinds, tcm), SPEC))
    assert sorted(op.index for op in order) == [op.index for op in ops]
    at = {op.index: k for k, op in enumerate(order)}
    assert any(at[op.index] != op.index for op in ops)        # it did reorder
    # (op index, byte range, writes?) of every TCM access, from the allocation
    acc = []
    for op in ops:
        for write, boxes in ((False, op.reads), (True, op.writes)):
            for box in boxes:
                tb = tcm.get(box.buffer)
                if tb is None or box.empty:
                    continue
                _, _, slot = locate(tb, op.index, box)
                acc.append((op.index, _slot_bytes(tb, slot), write, tb.name))
    shared = 0
    for i, (a, (alo, ahi), aw, an) in enumerate(acc):
        for b, (blo, bhi), bw, bn in acc[i + 1:]:
            if a == b or not (aw or bw) or not (alo < bhi and blo < ahi):
                continue
            if an == bn:
                continue        # the same buffer: finer boxes decide (the numeric tests)
            shared += 1
            assert (at[a] < at[b]) == (a < b), (an, bn, a, b)
    assert shared > 0 or tcm_fresh
