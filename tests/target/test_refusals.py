"""The emulator refuses invalid programs with InvalidProgramError naming the command."""
from __future__ import annotations

import numpy as np
import pytest

from edgetvm.errors import InvalidProgramError
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator
from edgetvm.target.isa import (Affine, DmaLoad, DmaStore, DramRef, EventSignal, Mma, Program,
                                TcmRef, Vector)


def refused(spec, program, inputs=None, params=None, index=None, match=""):
    with pytest.raises(InvalidProgramError, match=match) as e:
        Emulator(spec).run(program, inputs or {}, params or {})
    assert e.value.command_index == index
    if index is not None:
        assert str(e.value).startswith(f"command {index}: ")
    return str(e.value)


def loader(spec, shape=(64, 64), dtype="float16"):
    b = ProgramBuilder("t", spec)
    b.tensor("x", shape, dtype, "const", np.ones(shape))
    return b


# -- TCM -------------------------------------------------------------------------------------
def test_declared_footprint_larger_than_the_tcm(spec):
    small = spec.replace(tcm_bytes=16 * 1024)
    b = loader(small)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x")))           # 8 KB, fits
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x")))           # fits
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), channel=1))  # 24 KB
    msg = refused(small, b.build(), index=2, match="TCM overflow")
    assert "needs 24576 bytes of TCM, edge-npu-16mb has 16384" in msg


def test_command_beyond_the_spec_tcm(spec):
    small = spec.replace(tcm_bytes=16 * 1024)
    b = loader(small, (8, 64), "float32")
    b.emit(DmaLoad(dst=TcmRef(0, (8, 64), "float32"), src=b.dram("x")))
    b.emit(DmaLoad(dst=TcmRef(15 * 1024, (8, 64), "float32"), src=b.dram("x")))
    p = b.build(tcm_bytes=16 * 1024)     # the declared footprint fits; the command does not
    msg = refused(small, p, index=1, match="TCM overflow")
    assert "touches bytes up to 17408" in msg and "16384 bytes of TCM" in msg


def test_access_beyond_the_declared_footprint(spec):
    b = loader(spec, (8, 64), "float32")
    b.emit(DmaLoad(dst=TcmRef(0, (8, 64), "float32"), src=b.dram("x")))
    b.emit(Vector(op="copy", dst=TcmRef(4096, (8, 64), "float32"),
                  srcs=(TcmRef(0, (8, 64), "float32"),)))
    msg = refused(spec, b.build(tcm_bytes=4096), index=1,
                  match="out-of-bounds TCM access: vector copy dst touches bytes up to 6144")
    assert "declared TCM footprint of 4096 bytes" in msg


def test_negative_tcm_offset(spec):
    b = loader(spec, (8, 64), "float32")
    b.emit(DmaLoad(dst=TcmRef(-64, (8, 64), "float32"), src=b.dram("x")))
    refused(spec, b.build(tcm_bytes=4096), index=0,
            match="out-of-bounds TCM access: TCM operand starts at byte -64")


# -- DRAM ------------------------------------------------------------------------------------
def test_static_dram_window_out_of_bounds(spec):
    b = loader(spec, (16, 64), "float16")
    b.emit(DmaLoad(dst=b.tcm((8, 64), "float16"), src=b.dram("x", row0=4, rows=8)))   # ok
    b.emit(DmaLoad(dst=b.tcm((8, 64), "float16"), src=b.dram("x", row0=9, rows=8)))
    refused(spec, b.build(), index=1,
            match=r"out-of-bounds DRAM access: DRAM operand covers elements \[576, 1088\) "
                  r"of tensor 'x', which has 1024")


def test_runtime_offset_out_of_bounds_only_for_some_values(spec):
    b = ProgramBuilder("kv_read", spec)
    pos = b.param("pos")
    b.tensor("kv", (16, 64), "float16", "input")
    b.tensor("y", (4, 64), "float16", "output")
    t = b.tcm((4, 64), "float16")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=DramRef("kv", (4, 64), 64, pos * 64), signal=(e,)))
    b.emit(DmaStore(dst=b.dram("y"), src=t, wait=(e,)))
    p = b.build()
    kv = np.arange(16 * 64, dtype=np.float16).reshape(16, 64)
    emu = Emulator(spec)
    for ok in (0, 7, 12):            # rows pos .. pos + 3 exist
        np.testing.assert_array_equal(emu.run(p, {"kv": kv}, {"pos": ok}).outputs["y"],
                                      kv[ok:ok + 4])
    for bad in (13, -1):
        msg = refused(spec, p, {"kv": kv}, {"pos": bad}, index=0,
                      match="out-of-bounds DRAM access")
        assert f"'pos': {bad}" in msg and "tensor 'kv', which has 1024" in msg


def test_store_to_const_tensor(spec):
    b = loader(spec)
    t = b.tcm((64, 64), "float16")
    b.emit(DmaStore(dst=b.dram("x"), src=t))
    refused(spec, b.build(), index=0, match="DmaStore writes const tensor 'x'")


# -- races -------------------------------------------------------------------------------------
def test_raw_race_mma_reads_a_tile_another_channel_still_loads(spec):
    b = ProgramBuilder("raw", spec)
    b.tensor("a", (64, 64), "float16", "const", np.ones((64, 64)))
    b.tensor("w", (64, 64), "float16", "const", np.ones((64, 64)))
    ta, tw, out = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16"), \
        b.tcm((64, 64), "float32")
    ea = b.event()
    b.emit(DmaLoad(dst=ta, src=b.dram("a"), channel=0, signal=(ea,)))
    b.emit(DmaLoad(dst=tw, src=b.dram("w"), channel=1))                 # no event
    b.emit(Mma(out=out, a=ta, b=tw, wait=(ea,)))
    msg = refused(spec, b.build(), index=2, match="race: Mma reads TCM bytes")
    assert f"[{tw.offset}, {tw.end})" in msg
    assert "written by command 1 (DmaLoad on dma1)" in msg


def test_war_race_dma_overwrites_the_buffer_the_mma_reads(spec):
    b = ProgramBuilder("war", spec)
    b.tensor("w", (128, 64), "float16", "const", np.ones((128, 64)))
    a, buf, out = b.tcm((16, 64), "float16"), b.tcm((64, 64), "float16"), \
        b.tcm((16, 64), "float32")
    e_mma, e_next = b.event(), b.event()
    b.emit(DmaLoad(dst=buf, src=b.dram("w", rows=64), signal=(e_mma, e_next)))
    b.emit(Mma(out=out, a=a, b=buf, wait=(e_mma,)))
    # the next tile into the same buffer: ordered after the first load, not after the MMA
    b.emit(DmaLoad(dst=buf, src=b.dram("w", row0=64, rows=64), wait=(e_next,)))
    msg = refused(spec, b.build(), index=2, match="race: DmaLoad overwrites TCM bytes")
    assert "that command 1 (Mma on matrix) still reads without an event ordering the two" in msg


def test_waw_race_two_units_write_one_region(spec):
    b = loader(spec, (8, 64), "float32")
    t = b.tcm((8, 64), "float32")
    b.emit(DmaLoad(dst=t, src=b.dram("x")))
    b.emit(Vector(op="copy", dst=t, srcs=(b.tcm((8, 64), "float32"),)))
    msg = refused(spec, b.build(), index=1, match="race: Vector.copy overwrites TCM bytes")
    assert "command 0 (DmaLoad on dma0) writes" in msg


def test_dram_race_between_a_store_and_a_load(spec):
    b = ProgramBuilder("dram_race", spec)
    b.tensor("scratch", (8, 64), "float32", "scratch")
    t, u = b.tcm((8, 64), "float32"), b.tcm((8, 64), "float32")
    b.emit(DmaStore(dst=b.dram("scratch"), src=t, channel=0))
    b.emit(DmaLoad(dst=u, src=b.dram("scratch"), channel=1))
    refused(spec, b.build(), index=1, match="race: DmaLoad reads DRAM tensor 'scratch'")


def test_timing_never_hides_a_race(spec):
    """The load finishes long before the vector op starts, but nothing orders them."""
    b = loader(spec, (1, 64), "float32")
    t, big = b.tcm((1, 64), "float32"), b.tcm((512, 512), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), channel=0))
    b.emit(Vector(op="exp", dst=big, srcs=(big,), signal=(e,)))            # long
    b.emit(Vector(op="exp", dst=b.tcm((1, 64), "float32"), srcs=(t,)))
    refused(spec, b.build(), index=2, match="race: Vector.exp reads")


def test_event_never_signalled(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x")))
    b.emit(Mma(out=b.tcm((64, 64), "float32"), a=b.tcm((64, 64), "float16"),
               b=b.tcm((64, 64), "float16"), wait=(7,)))
    refused(spec, b.build(), index=1, match="Mma waits on event 7, which is never signalled")


def test_event_waited_more_often_than_signalled(spec):
    b = loader(spec)
    e = b.event()
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), signal=(e,)))
    b.emit(EventSignal(on="vector", wait=(e,)))
    b.emit(EventSignal(on="vector", wait=(e,)))
    refused(spec, b.build(), index=2, match="waits on event 0 for the 2th time, but it is "
                                            r"signalled only 1 time\(s\)")


def test_deadlock_signal_after_wait_on_one_unit(spec):
    b = loader(spec)
    e = b.event()
    b.emit(EventSignal(on="vector", wait=(e,)))        # waits for itself, below
    b.emit(EventSignal(on="vector", signal=(e,)))
    refused(spec, b.build(), index=0, match=r"deadlock: EventSignal waits on event\(s\) \[0\]")


# -- operands ------------------------------------------------------------------------------------
def test_dma_dtype_mismatch(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float32"), src=b.dram("x")))
    refused(spec, b.build(), index=0, match="DMA copies bytes: DRAM tensor 'x' is float16, "
                                            "TCM operand is float32")


def test_dma_shape_mismatch(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((32, 64), "float16"), src=b.dram("x")))
    refused(spec, b.build(), index=0,
            match=r"DMA shapes differ: DRAM window \(64, 64\) vs TCM \(32, 64\)")


def test_dma_channel_that_does_not_exist(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), channel=2))
    refused(spec, b.build(), index=0, match=r"DMA channel 2 does not exist \(edge-npu-16mb has 2\)")


def test_mma_dtype_mismatch(spec):
    b = ProgramBuilder("mma_dtype", spec)
    b.emit(Mma(out=b.tcm((16, 64), "float32"), a=b.tcm((16, 64), "float16"),
               b=b.tcm((64, 64), "int8")))
    refused(spec, b.build(), index=0,
            match="MMA operands must both be float16 or both int8, got float16 x int8")


def test_mma_accumulator_dtype(spec):
    b = ProgramBuilder("mma_acc_dtype", spec)
    b.emit(Mma(out=b.tcm((16, 64), "float16"), a=b.tcm((16, 64), "float16"),
               b=b.tcm((64, 64), "float16")))
    refused(spec, b.build(), index=0, match="MMA accumulates in float32; out is float16")


@pytest.mark.parametrize("a, w, out, match", [
    ((16, 64), (32, 64), (16, 64), "K differs"),
    ((16, 64), (64, 64), (16, 32), r"out \(16, 32\) != \(M, N\) = \(16, 64\)"),
])
def test_mma_shape_mismatch(spec, a, w, out, match):
    b = ProgramBuilder("mma_shape", spec)
    b.emit(Mma(out=b.tcm(out, "float32"), a=b.tcm(a, "float16"), b=b.tcm(w, "float16")))
    refused(spec, b.build(), index=0, match=match)


def test_w4a16_bad_group_size(spec):
    b = ProgramBuilder("w4", spec)
    b.emit(Mma(out=b.tcm((1, 64), "float32"), a=b.tcm((1, 64), "float16"),
               b=b.tcm((64, 32), "uint8"), scales=b.tcm((64, 2), "float16"),
               transpose_b=True, group_size=24))
    refused(spec, b.build(), index=0, match="group_size 24 must be even and divide K=64")


@pytest.mark.parametrize("dtype, shape", [("float32", (64, 2)), ("float16", (64, 1)),
                                          ("int8", (64, 2))])
def test_w4a16_zero_points_of_another_type_or_shape(spec, dtype, shape):
    b = ProgramBuilder("w4z", spec)
    b.emit(Mma(out=b.tcm((1, 64), "float32"), a=b.tcm((1, 64), "float16"),
               b=b.tcm((64, 32), "uint8"), scales=b.tcm((64, 2), "float16"),
               zeros=b.tcm(shape, dtype), transpose_b=True, group_size=32))
    refused(spec, b.build(), index=0,
            match=r"zeros must be uint8 or float16 shaped like scales \(64, 2\), got "
                  + dtype)


def test_vector_shape_mismatch(spec):
    b = ProgramBuilder("vec_shape", spec)
    x = b.tcm((8, 64), "float32")
    b.emit(Vector(op="add", dst=b.tcm((8, 64), "float32"), srcs=(x, b.tcm((8, 2), "float32"))))
    refused(spec, b.build(), index=0,
            match=r"vector add: src1 \(8, 2\) does not broadcast to \(8, 64\)")


def test_unknown_vector_op(spec):
    b = ProgramBuilder("vec_op", spec)
    x = b.tcm((8, 64), "float32")
    b.emit(Vector(op="tanh", dst=x, srcs=(x,)))
    refused(spec, b.build(), index=0, match="unknown vector op 'tanh'")


def test_binary_op_without_second_operand_or_imm(spec):
    b = ProgramBuilder("vec_arity", spec)
    x = b.tcm((8, 64), "float32")
    b.emit(Vector(op="mul", dst=x, srcs=(x,)))
    refused(spec, b.build(), index=0, match=r"vector mul takes 2 TCM source\(s\), got 1")


def test_undeclared_parameter_in_a_command(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"),
                   valid_rows=Affine.param("len")))
    refused(spec, b.build(), index=0, match=r"valid_rows uses undeclared runtime parameter\(s\) "
                                            r"\['len'\]")


def test_missing_runtime_parameter(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), valid_rows=b.param("len")))
    refused(spec, b.build(), match=r"needs runtime parameter\(s\) \['len'\]; got \[\]")
    refused(spec, b.build(), params={"len": 3, "pos": 1},
            match=r"has no runtime parameter\(s\) \['pos'\]")
    refused(spec, b.build(), params={"len": 2.5}, match="must be integers")


def test_wrong_input_shape_and_missing_input(spec):
    b = ProgramBuilder("inputs", spec)
    b.tensor("x", (4, 64), "float16", "input")
    b.emit(DmaLoad(dst=b.tcm((4, 64), "float16"), src=b.dram("x")))
    p = b.build()
    refused(spec, p, {"x": np.zeros((4, 32))},
            match=r"input 'x': shape \(4, 32\), program expects \(4, 64\)")
    refused(spec, p, {}, match=r"input 'x' float16\[4, 64\] not given")
    refused(spec, p, {"x": np.zeros((4, 64)), "z": 1}, match=r"has no input\(s\) \['z'\]")


def test_program_without_end(spec):
    p = Program("no_end", [EventSignal(on="vector")], {}, (), 0)
    refused(spec, p, index=1, match="the program does not end with End")


def test_unknown_host_op(spec):
    from edgetvm.target.isa import HostOp
    b = loader(spec)
    b.tensor("y", (64, 64), "float16", "output")
    b.emit(HostOp(fn="topk", inputs=("x",), outputs=("y",)))
    refused(spec, b.build(), index=0, match="unknown host op 'topk'; known: add, argmax")


@pytest.mark.parametrize("flops, match", [(-10 ** 9, r"flops -1000000000 < 0"),
                                           (2.5, r"flops must be an integer, got 2.5")])
def test_a_host_op_cannot_declare_its_work_away(spec, flops, match):
    """A HostOp's CPU time is charged from the flops it declares: negative flops made the
    op (its switch cost too) free."""
    from edgetvm.target.isa import HostOp
    b = loader(spec)
    b.tensor("y", (64, 64), "float16", "output")
    b.emit(HostOp(fn="copy", inputs=("x",), outputs=("y",), flops=flops))
    refused(spec, b.build(), index=0, match=match)


@pytest.mark.parametrize("operand", ["a", "b"])
def test_an_mma_writing_over_its_own_operand_is_refused(spec, operand):
    """The matrix array writes each output tile as it finishes while the next tiles still
    read the operands: an out over ``a`` (or ``b``) computes garbage on hardware; the
    emulator, working on whole operands, gave the exact product."""
    b = loader(spec, (32, 64))
    a, w = b.tcm((32, 64), "float16"), b.tcm((64, 64), "float16")
    over = a if operand == "a" else w
    out = TcmRef(over.offset, (32, 64), "float32")       # 8 KB from the operand's start
    b.emit(Mma(out=out, a=a, b=w))
    refused(spec, b.build(), index=0, match=f"MMA: out overlaps its operand {operand}")
    # beside them, not over them: runs
    ok = loader(spec, (32, 64))
    a, w = ok.tcm((32, 64), "float16"), ok.tcm((64, 64), "float16")
    ok.emit(Mma(out=ok.tcm((32, 64), "float32"), a=a, b=w))
    Emulator(spec).run(ok.build())


@pytest.mark.parametrize("field, value", [("channel", True), ("channel", 1.0),
                                          ("valid_rows", 2.5)])
def test_a_dma_field_that_is_not_an_integer_is_refused(spec, field, value):
    """A bool or float channel failed as KeyError 'dmaTrue' deep in the emulator; a float
    valid_rows as AttributeError."""
    b = loader(spec)
    kw = {field: value}
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=b.dram("x"), **kw))
    refused(spec, b.build(), index=0, match=f"DMA: {field} must be an integer, got {value!r}")


def test_tcm_and_dram_windows_with_float_sizes_are_refused(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=TcmRef(0, (64, 64), "float16", 64.0), src=b.dram("x")))
    refused(spec, b.build(), index=0, match="row_stride must be an integer, got 64.0")
    b = loader(spec)
    b.emit(DmaLoad(dst=b.tcm((64, 64), "float16"), src=DramRef("x", (64, 64), 64.5)))
    refused(spec, b.build(), index=0, match="row_stride must be an integer, got 64.5")


# -- double buffering ------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [64, 256])
def test_correct_double_buffering_passes_and_a_missing_event_is_caught(spec, double_buffered, m):
    prog, inputs, ref = double_buffered(spec, m, 6)
    np.testing.assert_allclose(Emulator(spec).run(prog, inputs).outputs["y"], ref,
                               rtol=1e-4, atol=1e-3)
    # tile 2's load no longer waits until the MMA of tile 0 is done with buffer 0
    broken, _, _ = double_buffered(spec, m, 6, drop=("empty", 2))
    load2 = next(i for i, c in enumerate(broken.commands) if isinstance(c, DmaLoad)
                 and c.src.offset == 2 * 64 * 64)
    mma0 = next(i for i, c in enumerate(broken.commands) if isinstance(c, Mma))
    msg = refused(spec, broken, inputs, index=load2, match="race: DmaLoad overwrites TCM bytes")
    assert f"command {mma0} (Mma on matrix) still reads" in msg
    # the MMA of tile 3 no longer waits for its tile
    broken, _, _ = double_buffered(spec, m, 6, drop=("full", 3))
    mma3 = [i for i, c in enumerate(broken.commands) if isinstance(c, Mma)][3]
    refused(spec, broken, inputs, index=mma3, match="race: Mma reads TCM bytes")


def test_interleaved_column_halves_are_not_a_race(spec):
    """Matrix writes the left half of a tile, vector the right half, with no event between:
    strided regions that interleave without overlapping are independent."""
    b = ProgramBuilder("halves", spec)
    b.tensor("y", (16, 64), "float32", "output")
    tile = b.tcm((16, 64), "float32")
    a, w = b.tcm((16, 64), "float16"), b.tcm((64, 32), "float16")
    src = b.tcm((16, 32), "float32")
    em, ev = b.event(), b.event()
    b.emit(Mma(out=tile.cols(0, 32), a=a, b=w, signal=(em,)))
    b.emit(Vector(op="add", dst=tile.cols(32, 32), srcs=(src,), imm=2.0, signal=(ev,)))
    b.emit(DmaStore(dst=b.dram("y"), src=tile, wait=(em, ev)))
    y = Emulator(spec).run(b.build()).outputs["y"]
    assert not y[:, :32].any() and (y[:, 32:] == 2).all()
    # one column of overlap is a race
    b.commands[1] = Vector(op="add", dst=tile.cols(31, 33), srcs=(b.tcm((16, 33), "float32"),),
                           imm=2.0, signal=(ev,))
    refused(spec, b.build(), index=1, match="race: Vector.add overwrites TCM bytes")


def test_interleaved_rows_of_two_strided_regions_are_not_a_race(spec):
    # even rows written by one DMA channel, odd rows by the other
    b = ProgramBuilder("rows", spec)
    b.tensor("x", (8, 64), "float16", "const", np.ones((8, 64)))
    b.tensor("y", (16, 64), "float16", "output")
    tile = b.tcm((16, 64), "float16")
    even = TcmRef(tile.offset, (8, 64), "float16", row_stride=128)
    odd = TcmRef(tile.offset + 128, (8, 64), "float16", row_stride=128)
    e0, e1 = b.event(), b.event()
    b.emit(DmaLoad(dst=even, src=b.dram("x"), channel=0, signal=(e0,)))
    b.emit(DmaLoad(dst=odd, src=b.dram("x"), channel=1, signal=(e1,)))
    b.emit(DmaStore(dst=b.dram("y"), src=tile, wait=(e0, e1)))
    assert (Emulator(spec).run(b.build()).outputs["y"] == 1).all()



def test_race_with_an_old_access_survives_pruning(spec):
    """The vector unit writes a tile once and retires; 200 commands (many pruning rounds)
    later the matrix unit reads it without an event: still a race."""
    b = ProgramBuilder("late_race", spec)
    b.tensor("w", (64, 64), "float16", "const", np.ones((64, 64)))
    a, x = b.tcm((16, 64), "float16"), b.tcm((16, 64), "float16")
    bufs = [b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16")]
    out = b.tcm((16, 64), "float32")
    full, empty = [b.event(), b.event()], [b.event(), b.event()]
    b.emit(Vector(op="copy", dst=a, srcs=(b.tcm((16, 64), "float16"),)))
    for k in range(100):
        s = k % 2
        b.emit(DmaLoad(dst=bufs[s], src=b.dram("w"), channel=s,
                       wait=(empty[s],) if k >= 2 else (), signal=(full[s],)))
        b.emit(Mma(out=out, a=x, b=bufs[s], wait=(full[s],), signal=(empty[s],)))
    last = b.emit(Mma(out=out, a=a, b=bufs[0]))
    p = b.build()
    msg = refused(spec, p, index=last, match="race: Mma reads TCM bytes")
    assert "written by command 0 (Vector.copy on vector)" in msg
    # ordered by an event from the vector unit, the same program is fine
    e = b.event()
    b.commands[0] = Vector(op="copy", dst=a, srcs=(b.tcm((16, 64), "float16"),), signal=(e,))
    b.commands[last] = Mma(out=out, a=a, b=bufs[0], wait=(e,))
    assert Emulator(spec).run(b.build()).counters.macs == 101 * 16 * 64 * 64


def test_race_names_the_latest_unordered_writer(spec):
    b = loader(spec, (8, 64), "float32")
    t = b.tcm((8, 64), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), signal=(e,)))        # 0
    b.emit(EventSignal(on="dma0"))                              # 1
    b.emit(DmaLoad(dst=t, src=b.dram("x")))                     # 2: nobody waits for this one
    b.emit(Vector(op="exp", dst=b.tcm((8, 64), "float32"), srcs=(t,), wait=(e,)))   # 3
    msg = refused(spec, b.build(), index=3, match="race: Vector.exp reads")
    assert "written by command 2 (DmaLoad on dma0)" in msg


def test_broadcast_dram_row_stride_0_race_is_caught(spec):
    """A zero DRAM row stride (one row broadcast to every TCM row) is a dense region."""
    b = ProgramBuilder("broadcast", spec)
    b.tensor("kv", (4, 64), "float32", "state")
    t, u = b.tcm((8, 64), "float32"), b.tcm((1, 64), "float32")
    b.emit(DmaLoad(dst=t, src=DramRef("kv", (8, 64), 0, 64), channel=0))
    b.emit(DmaStore(dst=DramRef("kv", (1, 64), 64, 64), src=u, channel=1))
    refused(spec, b.build(), index=1, match="race: DmaStore overwrites DRAM tensor 'kv' bytes "
                                            r"\[256, 512\) that command 0")


# -- the event protocol: no timing decides which signal a wait consumes ----------------------
def _two_signaller_program(spec, vec_rows, n=None):
    """A DMA (writes T) and a vector op (writes U) both signal event e; an MMA reads T
    waiting on e once. Whether the DMA's signal is the one consumed would depend on which
    finishes first: the vector op's length, or the DMA's valid_rows."""
    b = ProgramBuilder("two_signallers", spec)
    b.tensor("x", (64, 64), "float16", "const", np.ones((64, 64)))
    rows = b.param("n") if n is not None else None
    t = b.tcm((64, 64), "float16")
    src, dst = b.tcm((vec_rows, 64), "float32"), b.tcm((vec_rows, 64), "float32")
    out = b.tcm((64, 64), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x"), valid_rows=rows, signal=(e,)))
    b.emit(Vector(op="copy", dst=dst, srcs=(src,), signal=(e,)))
    b.emit(Mma(out=out, a=t, b=t, wait=(e,)))
    return b.build()


@pytest.mark.parametrize("vec_rows", [1, 256])
def test_an_event_signalled_from_two_units_is_refused(spec, vec_rows):
    refused(spec, _two_signaller_program(spec, vec_rows), index=1,
            match="signals event 0, which command 0 on dma0 signals too")


@pytest.mark.parametrize("n", [64, 4096 // 64])
def test_two_signallers_refused_whatever_the_runtime_rows(spec, n):
    refused(spec, _two_signaller_program(spec, 1, n=n), params={"n": n}, index=1,
            match="one signalling unit")


@pytest.mark.parametrize("mma_first", [False, True])
def test_an_event_waited_on_from_two_units_is_refused(spec, mma_first):
    # one channel loads T1 then T2, both signalling e; a vector op reads T1, an MMA reads
    # T2, each waiting once: which wait gets which signal would depend on timing
    b = ProgramBuilder("two_waiters", spec)
    b.tensor("x", (64, 64), "float16", "const", np.ones((64, 64)))
    t1, t2 = b.tcm((64, 64), "float16"), b.tcm((64, 64), "float16")
    out, v = b.tcm((64, 64), "float32"), b.tcm((64, 64), "float32")
    e = b.event()
    b.emit(DmaLoad(dst=t1, src=b.dram("x"), signal=(e,)))
    b.emit(DmaLoad(dst=t2, src=b.dram("x"), signal=(e,)))
    waits = [Vector(op="cast", dst=v, srcs=(t1,), wait=(e,)), Mma(out=out, a=t2, b=t2, wait=(e,))]
    for cmd in (waits[::-1] if mma_first else waits):
        b.emit(cmd)
    refused(spec, b.build(), index=3, match="waits on event 0, which command 2 on .* waits "
                                            "on too")


def test_misaligned_tcm_operand_is_refused(spec):
    b = loader(spec)
    b.emit(DmaLoad(dst=TcmRef(3, (64, 64), "float16"), src=b.dram("x")))
    refused(spec, b.build(tcm_bytes=1 << 20), index=0,
            match="misaligned TCM access: TCM operand starts at byte 3")


def _partial_window(spec, runtime, valid):
    """An 8-row window from row 4 of a 10-row tensor that moves ``valid`` rows (a runtime
    parameter or a constant)."""
    b = ProgramBuilder("partial", spec)
    rows = b.param("n") if runtime else valid
    b.tensor("x", (10, 64), "float16", "input")
    b.tensor("y", (8, 64), "float16", "output")
    t = b.tcm((8, 64), "float16")
    e = b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("x", row0=4, rows=8), valid_rows=rows, signal=(e,)))
    b.emit(DmaStore(dst=b.dram("y"), src=t, wait=(e,)))
    return b.build()


@pytest.mark.parametrize("runtime", [False, True])
def test_bounds_are_checked_on_the_rows_that_move(spec, runtime):
    x = np.arange(640, dtype=np.float16).reshape(10, 64)
    for valid, ok in ((6, True), (7, False)):
        params = {"n": valid} if runtime else {}
        program = _partial_window(spec, runtime, valid)
        if ok:      # rows 4..9: the last two rows of the window do not move
            y = Emulator(spec).run(program, {"x": x}, params).outputs["y"]
            np.testing.assert_array_equal(y[:6], x[4:10])
        else:
            refused(spec, program, {"x": x}, params, index=0, match="out-of-bounds DRAM")


def test_a_program_edited_in_place_is_checked_again(spec):
    b = loader(spec)
    t = b.tcm((64, 64), "float16")
    b.emit(DmaLoad(dst=t, src=b.dram("x")))
    p = b.build()
    emu = Emulator(spec)
    emu.run(p)
    # replace the load by one that reads past the tensor: the cached plan must not be used
    p.commands[0] = DmaLoad(dst=t, src=DramRef("x", (64, 64), 64, 64))
    with pytest.raises(InvalidProgramError, match="out-of-bounds DRAM"):
        emu.run(p)
    p.commands[0] = DmaLoad(dst=t, src=DramRef("x", (64, 64), 64, 0))
    assert emu.run(p).counters.dram_read_bytes == 8192
