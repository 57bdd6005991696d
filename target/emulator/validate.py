"""Static checks of a program against a spec, before anything runs.

Everything that does not depend on runtime parameters is checked here once per program:
operand shapes and dtypes, TCM bounds, DRAM bounds of fixed windows, DMA channels, the
event protocol. Parameter-dependent DRAM windows are checked when they execute.
"""
from __future__ import annotations

from collections import Counter
from numbers import Integral

from edgetvm.errors import InvalidProgramError

from ..host_ops import HOST_OPS
from .hazards import overlaps, tcm_region
from ..isa import (DTYPES, ITEMSIZE, VECTOR_OP_ARITY, Affine, DmaLoad, DmaStore, DramRef, End,
                   EventSignal, EventWait, HostOp, Launch, Mma, Program, TcmRef, Vector, predicates)

UNIT_NAMES = ("matrix", "vector", "host")


def command_name(cmd) -> str:
    if isinstance(cmd, Vector):
        return f"Vector.{cmd.op}"
    if isinstance(cmd, HostOp):
        return f"HostOp.{cmd.fn}"
    return type(cmd).__name__


def validate(program: Program, spec) -> None:
    """Raise :class:`InvalidProgramError` naming the first offending command."""
    if program.tcm_bytes > spec.tcm_bytes:
        first = next((i for i, c in enumerate(program.commands)
                      if any(r.end > spec.tcm_bytes for r in tcm_refs(c))), None)
        raise InvalidProgramError(
            f"TCM overflow: program {program.name!r} needs {program.tcm_bytes} bytes of TCM, "
            f"{spec.name} has {spec.tcm_bytes}", first)
    if not program.commands or not isinstance(program.commands[-1], End):
        raise InvalidProgramError("the program does not end with End", len(program.commands))
    for name in program.params:
        if not isinstance(name, str):
            raise InvalidProgramError(f"runtime parameter names must be strings, got {name!r}")
    for i, cmd in enumerate(program.commands):
        try:
            _check_command(cmd, program, spec)
        except InvalidProgramError as e:
            raise InvalidProgramError(str(e), i) from None
    _check_events(program)


def tcm_refs(cmd) -> list:
    refs = []
    for f in ("dst", "src", "out", "a", "b", "scales", "zeros"):
        r = getattr(cmd, f, None)
        if isinstance(r, TcmRef):
            refs.append(r)
    if isinstance(cmd, Vector):
        refs.extend(cmd.srcs)
    return refs


def _fail(msg):
    raise InvalidProgramError(msg)


def _is_int(x) -> bool:
    # ``type(x) is int`` first: validation checks every operand of every command, and the
    # ABC check of ``Integral`` (numpy integers) costs ten times as much
    return type(x) is int or (isinstance(x, Integral) and not isinstance(x, bool))


def _check_ints(what: str, **values) -> None:
    """Fields that count bytes, rows, channels or flops are integers (a float or a bool
    there would index the wrong thing, or fail deep in the emulator)."""
    for name, v in values.items():
        if not _is_int(v):
            _fail(f"{what}: {name} must be an integer, got {v!r}")


def _check_tcm(ref, program, spec, what):
    if not isinstance(ref, TcmRef):
        _fail(f"{what} must be a TcmRef, got {type(ref).__name__}")
    if ref.dtype not in DTYPES:
        _fail(f"{what}: unknown dtype {ref.dtype!r}")
    if len(ref.shape) != 2:
        _fail(f"{what}: shape must be (rows, cols) > 0, got {ref.shape}")
    rows, cols = ref.shape
    if not (type(ref.offset) is type(rows) is type(cols) is type(ref.stride) is int):
        _check_ints(what, offset=ref.offset, rows=rows, cols=cols, row_stride=ref.stride)
    if min(ref.shape) <= 0:
        _fail(f"{what}: shape must be (rows, cols) > 0, got {ref.shape}")
    if ref.stride < ref.shape[1]:
        _fail(f"{what}: row stride {ref.stride} < cols {ref.shape[1]}")
    if ref.offset < 0:
        _fail(f"out-of-bounds TCM access: {what} starts at byte {ref.offset}")
    if ref.offset % ITEMSIZE[ref.dtype]:
        _fail(f"misaligned TCM access: {what} starts at byte {ref.offset}, not a multiple of "
              f"its {ref.dtype} element size {ITEMSIZE[ref.dtype]}")
    if ref.end > spec.tcm_bytes:
        _fail(f"TCM overflow: {what} touches bytes up to {ref.end}, {spec.name} has "
              f"{spec.tcm_bytes} bytes of TCM")
    if ref.end > program.tcm_bytes:
        _fail(f"out-of-bounds TCM access: {what} touches bytes up to {ref.end}, beyond the "
              f"program's declared TCM footprint of {program.tcm_bytes} bytes")


def check_dram_bounds(ref: DramRef, decl, offset: int, what: str, rows: int | None = None) -> None:
    """The elements the window's first ``rows`` rows (all if None) cover are in the tensor:
    what moves is checked, not the window a ``valid_rows`` DMA does not fill."""
    size = _numel(decl.shape)
    rows = ref.shape[0] if rows is None else rows
    last = offset + (rows - 1) * ref.row_stride + ref.shape[1]
    if offset < 0 or last > size:
        raise InvalidProgramError(
            f"out-of-bounds DRAM access: {what} covers elements [{offset}, {last}) of tensor "
            f"{ref.tensor!r}, which has {size}")


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _check_dram(ref, program, what, rows=None):
    if not isinstance(ref, DramRef):
        _fail(f"{what} must be a DramRef, got {type(ref).__name__}")
    decl = program.tensors.get(ref.tensor)
    if decl is None:
        _fail(f"{what}: no DRAM tensor {ref.tensor!r} in the program's tensor table")
    if len(ref.shape) != 2:
        _fail(f"{what}: bad window shape {ref.shape} / row stride {ref.row_stride}")
    _check_ints(what, rows=ref.shape[0], cols=ref.shape[1], row_stride=ref.row_stride)
    if not isinstance(ref.offset, Affine):
        _check_ints(what, offset=ref.offset)
    if min(ref.shape) <= 0 or ref.row_stride < 0:
        _fail(f"{what}: bad window shape {ref.shape} / row stride {ref.row_stride}")
    if isinstance(ref.offset, Affine):
        unknown = [n for n in ref.offset.names() if n not in program.params]
        if unknown:
            _fail(f"{what}: offset uses undeclared runtime parameter(s) {unknown}")
    elif rows is not None:        # a runtime valid_rows: checked when the DMA runs
        check_dram_bounds(ref, decl, ref.offset, what, rows)
    return decl


def _check_params(value, program, what):
    if isinstance(value, Affine):
        unknown = [n for n in value.names() if n not in program.params]
        if unknown:
            _fail(f"{what} uses undeclared runtime parameter(s) {unknown}")


def _check_command(cmd, program, spec):
    for w in predicates(cmd.when):
        if not isinstance(w, Affine):
            _fail(f"predicate {w!r} is not an affine value of runtime parameters")
        _check_params(w, program, "when")
    if isinstance(cmd, (DmaLoad, DmaStore)):
        _check_ints("DMA", channel=cmd.channel)
        if cmd.valid_rows is not None and not isinstance(cmd.valid_rows, Affine):
            _check_ints("DMA", valid_rows=cmd.valid_rows)
        if not 0 <= cmd.channel < spec.dma_channels:
            _fail(f"DMA channel {cmd.channel} does not exist ({spec.name} has "
                  f"{spec.dma_channels})")
        tcm, dram = (cmd.dst, cmd.src) if isinstance(cmd, DmaLoad) else (cmd.src, cmd.dst)
        _check_tcm(tcm, program, spec, "TCM operand")
        vr = cmd.valid_rows
        rows = tcm.shape[0] if vr is None else (min(max(vr, 0), tcm.shape[0])
                                                 if isinstance(vr, int) else None)
        decl = _check_dram(dram, program, "DRAM operand", rows)
        if decl.dtype != tcm.dtype:
            _fail(f"DMA copies bytes: DRAM tensor {dram.tensor!r} is {decl.dtype}, TCM operand "
                  f"is {tcm.dtype}")
        if tuple(dram.shape) != tuple(tcm.shape):
            _fail(f"DMA shapes differ: DRAM window {dram.shape} vs TCM {tcm.shape}")
        _check_params(cmd.valid_rows, program, "valid_rows")
    elif isinstance(cmd, Mma):
        _check_mma(cmd, program, spec)
    elif isinstance(cmd, Vector):
        _check_vector(cmd, program, spec)
    elif isinstance(cmd, HostOp):
        if cmd.fn not in HOST_OPS:
            _fail(f"unknown host op {cmd.fn!r}; known: {', '.join(sorted(HOST_OPS))}")
        # the CPU's time is charged from the flops the op declares
        _check_ints(f"host op {cmd.fn!r}", flops=cmd.flops)
        if cmd.flops < 0:
            _fail(f"host op {cmd.fn!r}: flops {cmd.flops} < 0")
        for t in tuple(cmd.inputs) + tuple(cmd.outputs):
            if t not in program.tensors:
                _fail(f"host op {cmd.fn!r}: no DRAM tensor {t!r}")
    elif isinstance(cmd, (EventWait, EventSignal)):
        if cmd.on not in UNIT_NAMES and not (cmd.on.startswith("dma") and
                                             cmd.on[3:].isdigit() and
                                             int(cmd.on[3:]) < spec.dma_channels):
            _fail(f"no unit {cmd.on!r}")
    elif isinstance(cmd, Launch):
        for r in cmd.carry:
            if not isinstance(r, TcmRef):
                _fail("Launch carries TCM regions (TcmRef)")
            _check_tcm(r, program, spec, "carried TCM region")
    elif not isinstance(cmd, End):
        _fail(f"not a command: {type(cmd).__name__}")


def _check_mma(cmd, program, spec):
    for f in ("out", "a", "b"):
        _check_tcm(getattr(cmd, f), program, spec, f"MMA operand {f}")
    m, k = cmd.a.shape
    kind = cmd.kind
    if kind == "w4a16":
        _check_tcm(cmd.scales, program, spec, "MMA scales")
        if cmd.a.dtype != "float16" or cmd.b.dtype != "uint8" or not cmd.transpose_b:
            _fail("W4A16 MMA needs a float16, b uint8 (N, K/2) packed with transpose_b=True")
        if cmd.group_size <= 0 or k % cmd.group_size or cmd.group_size % 2:
            _fail(f"W4A16 MMA: group_size {cmd.group_size} must be even and divide K={k}")
        n = cmd.b.shape[0]
        if cmd.b.shape[1] * 2 != k:
            _fail(f"W4A16 MMA: packed b {cmd.b.shape} does not hold K={k} 4-bit weights per row")
        if tuple(cmd.scales.shape) != (n, k // cmd.group_size):
            _fail(f"W4A16 MMA: scales {cmd.scales.shape} != (N, K/group) = "
                  f"{(n, k // cmd.group_size)}")
        if cmd.zeros is not None:
            _check_tcm(cmd.zeros, program, spec, "MMA zeros")
            if tuple(cmd.zeros.shape) != tuple(cmd.scales.shape) or \
                    cmd.zeros.dtype not in ("uint8", "float16"):
                _fail(f"W4A16 MMA: zeros must be uint8 or float16 shaped like scales "
                      f"{tuple(cmd.scales.shape)}, got {cmd.zeros.dtype} {tuple(cmd.zeros.shape)}")
    else:
        want = "int8" if kind == "int8" else "float16"
        if cmd.a.dtype != want or cmd.b.dtype != want:
            _fail(f"MMA operands must both be float16 or both int8, got {cmd.a.dtype} x "
                  f"{cmd.b.dtype}")
        kb, n = (cmd.b.shape[1], cmd.b.shape[0]) if cmd.transpose_b else cmd.b.shape
        if kb != k:
            _fail(f"MMA: a is {cmd.a.shape}, b is {cmd.b.shape}: K differs")
    n = cmd.mnk[1]
    acc = "int32" if kind == "int8" else "float32"
    if cmd.out.dtype != acc:
        _fail(f"MMA accumulates in {acc}; out is {cmd.out.dtype}")
    if tuple(cmd.out.shape) != (m, n):
        _fail(f"MMA: out {cmd.out.shape} != (M, N) = {(m, n)}")
    # the array writes each output tile as it finishes while later tiles still read the
    # operands: an output over its own operands would read what it has just written
    out = tcm_region(cmd.out)
    for f in ("a", "b", "scales", "zeros"):
        r = getattr(cmd, f, None)
        if isinstance(r, TcmRef) and overlaps(out, tcm_region(r)):
            _fail(f"MMA: out overlaps its operand {f} in the TCM")


def _check_vector(cmd, program, spec):
    if cmd.op not in VECTOR_OP_ARITY:
        _fail(f"unknown vector op {cmd.op!r}")
    arity = VECTOR_OP_ARITY[cmd.op]
    srcs = tuple(cmd.srcs)
    # a binary op's second operand may be the immediate; exp_sub's imm is its scale
    binary_imm = arity == 2 and len(srcs) == 1 and cmd.imm is not None and cmd.op != "exp_sub"
    if len(srcs) != arity and not binary_imm:
        _fail(f"vector {cmd.op} takes {arity} TCM source(s), got {len(srcs)}")
    _check_tcm(cmd.dst, program, spec, f"vector {cmd.op} dst")
    for j, s in enumerate(srcs):
        _check_tcm(s, program, spec, f"vector {cmd.op} src{j}")
    rows, cols = srcs[0].shape
    want = (rows, 1) if cmd.op.startswith("reduce_") else (rows, cols)
    if tuple(cmd.dst.shape) != want:
        _fail(f"vector {cmd.op}: dst {cmd.dst.shape} != {want}")
    if cmd.op == "alibi":
        if tuple(srcs[1].shape) not in ((rows, 1), (1, 1)) or cmd.origin is None:
            _fail(f"vector alibi: slopes {srcs[1].shape} are not one per row of {(rows, cols)}, "
                  f"or no origin")
        _check_params(cmd.origin, program, "alibi origin")
    elif arity == 2 and len(srcs) == 2 and tuple(srcs[1].shape) not in \
            ((rows, cols), (rows, 1), (1, cols)):
        _fail(f"vector {cmd.op}: src1 {srcs[1].shape} does not broadcast to {(rows, cols)}")
    if cmd.op in ("rope", "rope_pairs"):
        if cols % 2 or any(tuple(s.shape) != (rows, cols) for s in srcs[1:]):
            _fail(f"vector {cmd.op}: cos/sin must match x, and x must have an even number of cols")
    if cmd.op == "mask":
        _check_params(cmd.limit, program, "mask limit")
        _check_params(cmd.causal_offset, program, "mask causal_offset")
        _check_params(cmd.floor, program, "mask floor")
        _check_params(cmd.window_offset, program, "mask window_offset")


def _check_events(program):
    """The event protocol (``isa.py``): an event links one signalling unit to one waiting
    unit, and is never waited on more often than it is signalled.

    With one signaller and one waiter, the k-th wait in the waiter's program order consumes
    the k-th signal in the signaller's program order whatever the timing, so the order an
    event establishes, and the race check built on it, never depends on timing."""
    signals = Counter()
    for cmd in program.commands:
        signals.update(cmd.signal)
    signallers: dict = {}
    waiters: dict = {}
    waits = Counter()
    for i, cmd in enumerate(program.commands):
        for e in set(cmd.signal):
            first = signallers.setdefault(e, (cmd.unit, i))
            if first[0] != cmd.unit:
                raise InvalidProgramError(
                    f"{command_name(cmd)} on {cmd.unit} signals event {e}, which command "
                    f"{first[1]} on {first[0]} signals too: an event has one signalling unit "
                    "(use one event per unit)", i)
        for e in set(cmd.wait):
            first = waiters.setdefault(e, (cmd.unit, i))
            if first[0] != cmd.unit:
                raise InvalidProgramError(
                    f"{command_name(cmd)} on {cmd.unit} waits on event {e}, which command "
                    f"{first[1]} on {first[0]} waits on too: an event has one waiting unit "
                    "(signal one event per waiting unit)", i)
        waits.update(cmd.wait)
        for e in set(cmd.wait):
            if waits[e] > signals[e]:
                if signals[e] == 0:
                    msg = f"{command_name(cmd)} waits on event {e}, which is never signalled"
                else:
                    msg = (f"{command_name(cmd)} waits on event {e} for the {waits[e]}th time, "
                           f"but it is signalled only {signals[e]} time(s)")
                raise InvalidProgramError(msg, i)
