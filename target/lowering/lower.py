"""Lower a scheduled s_tir PrimFunc to an NPU program.

The pipeline, in order (each step is a small module):

1. ``interpret``: run the loop structure, one :class:`TileOp` per ``npu.op`` loop nest;
2. ``tcm_alloc``: compact TCM buffers to their footprints, slots, place them by lifetime
   (reject the candidate if they do not fit);
3. ``reorder`` (when the schedule asks for it): the order each unit runs its ops in,
   list-scheduled for overlap within the ops' byte dependencies;
4. ``sync``: the events every op must wait on (RAW, WAR, WAW across units);
5. emission (here): concrete TCM addresses, DRAM windows, one or more ISA commands per op.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from tvm import tirx

from edgetvm.errors import CandidateRejected

from ..builder import ProgramBuilder
from ..isa import (VECTOR_OP_ARITY, Affine, DmaLoad, DmaStore, DramRef, Mma, TcmRef, Vector,
                   holds, predicates)
from .interpret import Interpreter
from .reorder import AUTO, estimated_cycles, in_order_makespan, list_schedule
from .sync import insert_events
from .tcm_alloc import locate, plan_tcm, row_major_strides

#: PrimFunc attribute: parameter name -> the value every element of a template constant
#: holds (a column of ones: ``TileKernel.const``); lowering ships it in the program
FILL_CONSTS = "npu.fill_consts"
#: PrimFunc attribute: TCM buffer name -> how many of the iterated loops around its
#: accesses delimit one instance (default: all that enclose every access), for a buffer
#: with an explicit slot axis that one loop iteration touches only part of
TCM_INSTANCE = "npu.tcm_instance"


def lower_primfunc(func: tirx.PrimFunc, spec, name: str = "kernel", outputs=None,
                   consts: dict | None = None, runtime=(), state=(),
                   max_ops: int | None = None, plan_params: dict | None = None):
    """Compile a scheduled PrimFunc into a :class:`~edgetvm.target.isa.Program`.

    Parameters
    ----------
    func : the scheduled PrimFunc (``sch.mod["main"]``) with ``npu.op`` loop annotations.
    spec : the NPU spec.
    outputs : names of the PrimFunc's output buffers (default: the last parameter).
    consts : name -> array for parameters that are weights (shipped in the program). A
        template constant (the PrimFunc's ``npu.fill_consts``) is filled in here and named
        in the program's ``metadata["template_consts"]`` (the linker packs those itself).
    runtime : names of buffer parameters whose elements are runtime parameters (token ids,
        page table): they become scalars the host sets per call, not DRAM tensors. Scalar
        PrimFunc parameters (valid length, position) are runtime parameters too.
    state : names of buffer parameters that persist on the device (the KV cache pages).
    max_ops : reject (``CandidateRejected``) a schedule with more tile operations, as a
        tuner's measurement budget (a tiny tile on a large workload is never worth it).
    plan_params : runtime parameter values the list schedule (root annotation
        ``npu.list_schedule``) plans the order for, e.g. the bucket's worst case: an op
        predicated off at them costs nothing in the plan. The program still serves every
        value; only the order is chosen for these. None: every op is planned as running
        (``tir_schedules/attention.py`` says what that cost a chunked prefill attention).

    The program's ``metadata["list_scheduled"]`` says which order it runs in (with
    ``npu.list_schedule`` 2, the one the plan estimated faster).
    """
    consts = dict(consts or {})
    fills = func.attrs.get(FILL_CONSTS) if func.attrs is not None else None
    template_consts = []
    for buf in func.params:
        if fills is not None and buf.name in fills and buf.name not in consts:
            consts[buf.name] = np.full([int(s) for s in buf.shape], float(fills[buf.name]),
                                       str(buf.dtype))
            template_consts.append(buf.name)
    interp = Interpreter(func, runtime, max_ops)
    ops = interp.run()
    if not ops:
        raise CandidateRejected("the schedule produced no NPU operation")
    kinds = interp.buffers
    inst = func.attrs.get(TCM_INSTANCE) if func.attrs is not None else None
    tcm, tcm_bytes = plan_tcm(ops, kinds, spec, fresh=interp.tcm_fresh,
                              instance_depth={str(k): int(v) for k, v in (inst or {}).items()})
    units = _assign_units(ops, kinds, spec, interp.dma_split)
    list_scheduled = False
    if interp.list_schedule:
        def cost(op):
            return estimated_cycles(_commands(op, units[op.index], kinds, tcm), spec) \
                if runs_at(op, plan_params) else 0.0
        planned = list_schedule(ops, units, kinds, tcm, cost)
        if interp.list_schedule != AUTO or \
                in_order_makespan(planned, units, kinds, tcm, cost, spec) <= \
                in_order_makespan(ops, units, kinds, tcm, cost, spec):
            ops, list_scheduled = planned, True
    waits, signals = insert_events(ops, units, kinds, tcm)

    b = ProgramBuilder(name, spec)
    param_bufs = list(func.params)    # TVM 0.27: buffer params are Vars of BufferType
    out_names = set(outputs or [param_bufs[-1].name])
    for buf in param_bufs:
        if kinds.get(buf) != "param":
            continue
        n = buf.name
        kind = "const" if n in consts else "state" if n in state else \
            "output" if n in out_names else "input"
        b.tensor(n, [int(s) for s in buf.shape], str(buf.dtype), kind, consts.get(n))
    for buf, k in kinds.items():
        if k == "dram_scratch":
            b.tensor(buf.name, [int(s) for s in buf.shape], str(buf.dtype), "scratch")
    for op in ops:
        cmds = _commands(op, units[op.index], kinds, tcm)
        if not cmds:
            continue
        when = _predicate(op)
        if when is not None:
            cmds = [dataclasses.replace(c, when=when) for c in cmds]
        cmds[0] = dataclasses.replace(cmds[0], wait=tuple(waits[op.index]))
        cmds[-1] = dataclasses.replace(cmds[-1], signal=tuple(signals[op.index]))
        for c in cmds:
            b.emit(c)
    for p in interp.params:
        b.param(p)
    return b.build(tcm_bytes=tcm_bytes, tile_ops=len(ops), template_consts=template_consts,
                   list_scheduled=list_scheduled,
                   tcm_buffers={t.name: {"offset": t.offset, "footprint": list(t.footprint),
                                         "slots": t.slots} for t in tcm.values()})


def _valid_start(op):
    """(runtime length parameter, this op's first index on the valid axis) or None."""
    name = op.attrs.get("valid_len")
    if name is None:
        return None
    return Affine.param(name), op.attrs["iter_min"][int(op.attrs.get("valid_axis", 0))]


def _predicate(op):
    """Ops on tiles wholly past the runtime valid length are predicated off, and ops with
    ``npu.predicates`` unless each ``coef * param - iter value > 0`` (one Affine, a tuple of
    them when several must hold)."""
    v = _valid_start(op)
    preds = [] if v is None else [v[0] - v[1]]
    for item in filter(None, str(op.attrs.get("predicates") or "").split(",")):
        name, coef, axis = item.split(":")
        preds.append(Affine.param(name, int(coef)) - op.attrs["iter_min"][int(axis)])
    if not preds:
        return None
    return preds[0] if len(preds) == 1 else tuple(preds)


def runs_at(op, params) -> bool:
    """Whether ``op`` runs at runtime parameters ``params``: each of its predicates that
    reads only parameters in ``params`` holds (the emulator's ``holds``); True when
    ``params`` is None."""
    if params is None:
        return True
    known = tuple(w for w in predicates(_predicate(op))
                  if all(name in params for name, _ in w.terms))
    return holds(known, params)


def _assign_units(ops, kinds, spec, dma_split: bool) -> dict:
    """DMA channel per op: the schedule's ``npu.channel``, else loads rotate over the
    channels (one transfer's setup hides behind another's data) and stores go to the last
    channel; with ``dma_split`` loads keep off the store channel."""
    units = {}
    n = spec.dma_channels
    load_channels = n - 1 if dma_split and n > 1 else n
    load_ch = 0
    for op in ops:
        if op.kind == "mma":
            units[op.index] = "matrix"
        elif op.kind == "vector":
            units[op.index] = "vector"
        else:
            store = kinds.get(op.writes[0].buffer) != "tcm"
            ch = op.attrs.get("channel")
            if ch is None:
                if store:
                    ch = n - 1
                else:
                    ch = load_ch % load_channels
                    load_ch += 1
            if not 0 <= int(ch) < n:
                raise CandidateRejected(f"DMA channel {ch} does not exist ({spec.name} has {n})")
            units[op.index] = f"dma{int(ch)}"
    return units


# -- emission ---------------------------------------------------------------------------
def _pieces(extents, strides_a, strides_b, keep_rows: bool = False):
    """Split a box copy into 2-D pieces valid on both sides.

    ``keep_rows``: never merge the outermost non-unit axis into the next one, so that the
    rows of the copy are that axis (a runtime ``valid_rows`` count is a count of them).
    Returns (rows, cols, row_stride_a, row_stride_b, [(elem_off_a, elem_off_b), ...])."""
    dims = [(e, sa, sb) for e, sa, sb in zip(extents, strides_a, strides_b) if e > 1]
    merged = []
    for n, (e, sa, sb) in enumerate(dims):
        if merged and not (keep_rows and n == 1) and merged[-1][1] == e * sa \
                and merged[-1][2] == e * sb:
            pe, _, _ = merged[-1]
            merged[-1] = (pe * e, sa, sb)
        else:
            merged.append((e, sa, sb))
    if not merged or merged[-1][1] != 1 or merged[-1][2] != 1:
        merged.append((1, 1, 1))
    cols = merged[-1][0]
    rows, rsa, rsb = merged[-2] if len(merged) >= 2 else (1, cols, cols)
    outer = merged[:-2]
    offsets = [(0, 0)]
    for e, sa, sb in outer:
        offsets = [(oa + i * sa, ob + i * sb) for oa, ob in offsets for i in range(e)]
    return rows, cols, rsa, rsb, offsets


def _commands(op, unit, kinds, tcm) -> list:
    if op.kind == "dma":
        return _dma(op, unit, kinds, tcm)
    if op.kind == "mma":
        return [_mma(op, tcm)]
    return [_vector(op, tcm)]


def _paired_axes(dbox, tbox, d_strides, t_strides):
    """The copy's axes as (extents, DRAM strides, TCM strides), in DRAM axis order.

    A DRAM axis is paired with the TCM axis that moves with the same loop, so a DMA may
    change the axis order (e.g. token-major staging -> the cache's head-major page). When
    the loops do not tell (no iteration info), axes pair by position."""
    if not dbox.axes or not tbox.axes:
        return dbox.extents, d_strides, t_strides
    ext, ds, ts = [], [], []
    used = set()
    for dd, e in enumerate(dbox.extents):
        if e == 1:
            continue
        td = next((t for t, te in enumerate(tbox.extents) if te == e and t not in used
                   and tbox.axes[t] & dbox.axes[dd]), None)
        if td is None:
            return dbox.extents, d_strides, t_strides
        used.add(td)
        ext.append(e)
        ds.append(d_strides[dd])
        ts.append(t_strides[td])
    return tuple(ext), tuple(ds), tuple(ts)


def _dma(op, unit, kinds, tcm):
    src, dst = op.reads[0], op.writes[0]
    load = kinds.get(dst.buffer) == "tcm"
    tbox, dbox = (dst, src) if load else (src, dst)
    tb = tcm[tbox.buffer]
    t_off, rel, _ = locate(tb, op.index, tbox)
    dshape = [int(s) for s in dbox.buffer.shape]
    dst_strides = row_major_strides(dshape)
    d_off = sum(l * s for l, s in zip(dbox.lo, dst_strides))
    v = _valid_start(op)
    extents, d_str, t_str = _paired_axes(dbox, tbox, dst_strides, tb.strides())
    rows, cols, rs_d, rs_t, offs = _pieces(extents, d_str, t_str, keep_rows=v is not None)
    ch = int(unit[3:])
    # the runtime repeat count: rows past the valid length are not transferred (unless
    # the op is predicated as a whole: ``npu.valid_whole``)
    valid = None if v is None or len(offs) > 1 or op.attrs.get("valid_whole") else v[0] - v[1]
    cmds = []
    for od, ot in offs:
        tref = TcmRef(t_off + ot * tb.itemsize, (rows, cols), tb.dtype, rs_t)
        dref = DramRef(dbox.buffer.name, (rows, cols), rs_d, d_off + od)
        cmds.append(DmaLoad(dst=tref, src=dref, channel=ch, valid_rows=valid) if load
                    else DmaStore(dst=dref, src=tref, channel=ch, valid_rows=valid))
    return cmds


def _tcm_2d(tcm, op_index, box) -> TcmRef:
    """An MMA operand: the box's last two dims as (rows, cols); leading dims must be unit."""
    tb = tcm.get(box.buffer)
    if tb is None:
        raise CandidateRejected(f"operand {box.buffer.name!r} of an NPU compute op is not in "
                                f"TCM (cache it into 'global.tcm' in the schedule)")
    off, _, _ = locate(tb, op_index, box)
    ext, st = box.extents, tb.strides()
    if len(ext) == 1:
        return TcmRef(off, (1, ext[0]), tb.dtype, 0)
    if any(e != 1 for e in ext[:-2]):
        raise CandidateRejected(f"MMA operand {box.buffer.name!r} box {ext} is not a 2-D tile")
    return TcmRef(off, (ext[-2], ext[-1]), tb.dtype, st[-2])


def _mma(op, tcm) -> Mma:
    out = _tcm_2d(tcm, op.index, op.writes[0])
    reads = [_tcm_2d(tcm, op.index, r) for r in op.reads]
    packed = [k for k, r in enumerate(op.reads) if str(r.buffer.dtype) == "uint8"]
    if packed:
        # W4A16 (workloads.dequant_w4_expr): reads x, scales, packed[, zeros]; uint8 zero
        # points are the second uint8 read, float16 ones the float read after the scales.
        w = reads[packed[0]]
        floats = [r for k, r in enumerate(reads) if k not in packed]
        a, scales = floats[0], floats[1]
        zeros = reads[packed[1]] if len(packed) > 1 else floats[2] if len(floats) > 2 else None
        if len(packed) + len(floats) > 4:
            raise CandidateRejected(f"W4A16 MMA on block {op.block!r} reads "
                                    f"{len(op.reads)} buffers (x, scales, packed, zeros)")
        k = a.shape[1]
        group = k // scales.shape[1]
        return Mma(out=out, a=a, b=w, scales=scales, zeros=zeros, group_size=group,
                   transpose_b=True, accumulate=op.attrs["accumulate"])
    a, bb = reads[0], reads[1]
    return Mma(out=out, a=a, b=bb, transpose_b=op.attrs["transpose_b"],
               accumulate=op.attrs["accumulate"])


def _vector(op, tcm) -> Vector:
    """Vector operands as (rows, cols) of the op's iteration space: rows = the outer
    non-unit iter var, cols = the inner one (the reduced one for reductions)."""
    ext = op.attrs["iter_ext"]
    live = [p for p, e in enumerate(ext) if e > 1]
    if len(live) > 2:
        raise CandidateRejected(f"vector op {op.op!r} on block {op.block!r} spans "
                                f"{len(live)} non-unit loops; tile it to 2-D in the schedule")
    row_var = live[0] if len(live) == 2 else None
    col_var = live[-1] if live else None

    def ref(box):
        tb = tcm.get(box.buffer)
        if tb is None:
            raise CandidateRejected(f"operand {box.buffer.name!r} of vector op {op.op!r} is "
                                    f"not in TCM")
        off, _, _ = locate(tb, op.index, box)
        st = tb.strides()
        rows = cols = 1
        rs = cs = None
        for d, moves in enumerate(box.axes):
            if row_var is not None and row_var in moves and box.extents[d] > 1:
                rows, rs = box.extents[d], st[d]
            elif col_var is not None and col_var in moves and box.extents[d] > 1:
                cols, cs = box.extents[d], st[d]
        if cs not in (None, 1):
            if cols > 1 and rows == 1:
                return TcmRef(off, (cols, 1), tb.dtype, cs)   # a column vector
            raise CandidateRejected(f"vector operand {box.buffer.name!r}: columns are not "
                                    f"contiguous in TCM")
        return TcmRef(off, (rows, cols), tb.dtype, rs or cols)

    dst = ref(op.writes[0])
    srcs = tuple(ref(r) for r in op.reads)
    if VECTOR_OP_ARITY.get(op.op) == 2 and len(srcs) == 1 and op.attrs.get("imm") is None:
        if op.attrs.get("loads", 2) < 2:
            # x * 1.0 or x + 0.0 simplified to x: neither x * x nor a constant to take
            raise CandidateRejected(f"vector {op.op} on {op.writes[0].buffer.name!r} has one "
                                    f"operand and no constant (folded away?)")
        srcs = srcs * 2          # x * x: the block reads one buffer twice
    if op.op.startswith("reduce_"):
        rows = srcs[0].shape[0]
        dst = TcmRef(dst.offset, (rows, 1), dst.dtype,
                     dst.stride if dst.shape == (rows, 1) else 1)
    else:
        srcs = tuple(_broadcast(s, dst.shape) for s in srcs)
    limit = causal = origin = floor = window_offset = None
    # a mask or alibi op iterates (..., query row, key, outer loops...) (the attention
    # template's order): its row is the iter var before the key's, also in a tile of one
    # row; in a tile of one key (the last of a whole prompt's keys) its one non-unit loop
    # runs down a column, and that loop is the row, the key the iter var after it
    at_row, at_key = row_var, col_var
    if row_var is None and col_var is not None:
        if dst.shape[1] == 1 and dst.shape[0] > 1 and op.op in ("mask", "alibi"):
            at_row, at_key = col_var, col_var + 1
        elif col_var > 0:
            at_row = col_var - 1
    r0 = op.attrs["iter_min"][at_row] if at_row is not None else 0
    c0 = op.attrs["iter_min"][at_key] if at_key is not None else 0
    if op.op == "alibi":
        # the bias is 0 at the key of the first row's query: the runtime parameter
        # ``alibi_query`` (or 0) plus ``alibi_offset``, plus the row where rows are
        # consecutive queries (prefill), as a column of this command's tile
        query = op.attrs.get("alibi_query", "")
        origin = (Affine.param(query) if query else Affine(0)) + \
            int(op.attrs.get("alibi_offset", 0)) + \
            (r0 if op.attrs.get("alibi_rows", 0) else 0) - c0
    if op.op == "mask":
        if op.attrs.get("mask_len"):
            limit = Affine.param(op.attrs["mask_len"]) - c0       # keys >= length: -inf
        if op.attrs.get("mask_pos") is not None:
            # causal: key position c0 + c > query position pos + r0 + r
            pos = op.attrs["mask_pos"]
            causal = (Affine.param(pos) if pos else Affine(0)) + (r0 - c0)
        w = op.attrs.get("mask_window")
        if w is not None:
            # a sliding window of w keys: key <= query - w is hidden; the query is pos + r0
            # + r (rows of consecutive queries), or with a length mask alone (decode) the
            # last valid key, mask_len - 1
            if causal is not None:
                window_offset = causal - (int(w) - 1)
            elif limit is not None:
                floor = limit - int(w)
            else:
                raise CandidateRejected("a sliding-window mask needs the causal or the "
                                        "length mask's query position")
    return Vector(op=op.op, dst=dst, srcs=srcs, imm=op.attrs.get("imm"),
                  limit=limit, causal_offset=causal, origin=origin, floor=floor,
                  window_offset=window_offset)


def _broadcast(src: TcmRef, shape) -> TcmRef:
    rows, cols = shape
    if src.shape == (1, rows) and rows != cols:     # a row-indexed vector laid out flat
        return TcmRef(src.offset, (rows, 1), src.dtype, 1)
    return src
