"""Linking a phase's kernels into ONE static command stream.

Every kernel was lowered position-independent, over its own tensor names. Linking:

* plans DRAM: the activations of the step share one arena (``act``), each at an offset
  reused once its last reader has run (first fit by lifetime, burst-aligned), so the
  arena's size is the step's DRAM high-water mark for activations; weights and position
  tables are ``const`` tensors (the weight pack), the KV cache pages ``state``, the
  logits the ``output``;
* relocates each kernel's DMA windows onto the tensors its bindings name, through the
  views: a reshape, a head transpose, a column slice of a fused projection is an address
  pattern here. A window whose rows do not map to one stride (or whose columns are not
  contiguous in the target) is split into as many DMAs as it takes, each paying its own
  set-up: the emulator charges what the layout costs; a layer's new K and V go through
  the page table into the KV cache pages (``kv_pages.py``: no append kernel);
* renumbers events and puts a ``Launch`` (all units idle, then the kernel's set-up cost)
  before every kernel.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator.costs import command_cycles, dma_bytes, dma_estimate
from edgetvm.target.isa import (ITEMSIZE, Affine, DmaLoad, DmaStore, DramRef, End, HostOp,
                                Launch, TcmRef, as_affine, predicates)

from .graph import BuildError, PhaseGraph
from .kv_pages import KV_PAGES, relocate_paged, token_rows
from .views import View, contiguous_strides

ARENA = "act"


@dataclasses.dataclass
class DramPlan:
    """Where each graph tensor lives in the program: ``(program tensor, element offset)``."""

    place: dict
    arena_elems: int
    lifetimes: dict


def plan_dram(graph: PhaseGraph, kernels: list, align_bytes: int = 64) -> DramPlan:
    """Arena offsets for the activations by lifetime (kernel index of the first write to the
    last read); the other tensors keep their own names."""
    first, last = {}, {}
    for k, kern in enumerate(kernels):               # tensors a kernel moves to or from DRAM
        for v in kern.bindings.values():
            first.setdefault(v.tensor, k)
            last[v.tensor] = k
    align = max(1, align_bytes // 2)          # activations are fp16
    placed: list = []                          # (start, end, offset, size)
    place = {}
    lifetimes = {}
    for name in sorted((n for n, t in graph.tensors.items() if t.kind == "activation"),
                       key=lambda n: (first.get(n, 0), n)):
        t = graph.tensors[name]
        if t.dtype != "float16":
            raise BuildError(f"activation {name} is {t.dtype}; the arena holds float16")
        if name not in first:
            continue                                # stays in a kernel's TCM
        life = (first[name], last[name])
        lifetimes[name] = life
        busy = sorted((o, o + s) for a, b, o, s in placed if not (b < life[0] or a > life[1]))
        offset = 0
        for lo, hi in busy:
            if offset + t.size <= lo:
                break
            offset = max(offset, -(-hi // align) * align)
        placed.append((life[0], life[1], offset, t.size))
        place[name] = (ARENA, offset)
    for name, t in graph.tensors.items():
        if t.kind != "activation":
            place[name] = (name, 0)
    arena = max((o + s for _, _, o, s in placed), default=0)
    return DramPlan(place, -(-arena // align) * align, lifetimes)


# -- relocation -----------------------------------------------------------------------------
def _run_length(view: View) -> int:
    """Elements of the view (row-major) that are contiguous in memory, from an aligned start."""
    run = 1
    for n, s in zip(reversed(view.shape), reversed(view.strides)):
        if n == 1:
            continue
        if s != run:
            break
        run *= n
    return run


def relocate_window(ref: DramRef, view: View, tensor: str, base: int) -> list:
    """The DMA windows of ``tensor`` (at element ``base``) that the window ``ref`` of a
    kernel tensor bound to ``view`` covers: ``[(DramRef, row0, rows, col0, cols)]`` with the
    part of ``ref`` each one moves (rows and columns of ``ref``'s window)."""
    rows, cols = ref.shape
    runtime = Affine(0, view.offset.terms)
    if view.strides == contiguous_strides(view.shape):            # flat: rename and shift
        off = as_affine(ref.offset) + view.offset + base
        return [(DramRef(tensor, ref.shape, ref.row_stride, _value(off)), 0, rows, 0, cols)]
    if as_affine(ref.offset).terms:
        raise BuildError(f"a kernel window at a runtime offset ({ref.offset}) into a strided "
                         f"view of {view.tensor}")
    off = as_affine(ref.offset).const
    run = _run_length(view)
    starts = off + np.arange(rows, dtype=np.int64) * ref.row_stride
    pieces = []
    if cols == 1 or np.all(starts % run + cols <= run):
        segments = [(0, cols)]
    elif rows == 1 or ref.row_stride % run == 0:
        first = int(starts[0])                       # every row cut at the same columns
        cuts = [0] + [c for c in range(1, cols) if (first + c) % run == 0] + [cols]
        segments = list(zip(cuts[:-1], np.diff(cuts)))
    else:                                             # rows cut differently: row by row
        for r in range(rows):
            row = DramRef(ref.tensor, (1, cols), cols, int(starts[r]))
            pieces += [(d, r, 1, c0, m) for d, _, _, c0, m in
                       relocate_window(row, view, tensor, base)]
        return pieces
    for c0, n in segments:
        t = view.offsets(starts + c0) + base
        r0 = 0
        while r0 < rows:                              # maximal runs of one row stride
            r1 = r0 + 1
            if r1 < rows:
                step = int(t[r1] - t[r0])
                while r1 + 1 < rows and int(t[r1 + 1] - t[r1]) == step:
                    r1 += 1
                r1 += 1
                stride = step
            else:
                stride = int(n)
            if r1 - r0 == 1:
                stride = int(n)
            if stride < 0:
                raise BuildError(f"a view of {view.tensor} walks rows backwards")
            pieces.append((DramRef(tensor, (r1 - r0, int(n)), max(stride, 1),
                                   _value(runtime + int(t[r0]))), r0, r1 - r0, int(c0), int(n)))
            r0 = r1
    return pieces


def _value(a: Affine):
    return a.const if not a.terms else a


def _split_dma(cmd, pieces: list) -> list:
    """``cmd`` (a load or store) as one command per relocated piece; the first keeps the
    waits, the last the signals; a piece's own predicate (a sixth field, ``kv_pages``'
    per-token slots) joins the command's."""
    load = isinstance(cmd, DmaLoad)
    tcm = cmd.dst if load else cmd.src
    if len(pieces) > 1 and cmd.valid_rows is not None:
        raise BuildError("a DMA with a runtime row count maps to a strided layout; it would "
                         "need a copy")
    out = []
    for k, (dram, r0, n, c0, m, *when) in enumerate(pieces):
        sub = tcm.rows(r0, n).cols(c0, m) if (r0, n, c0, m) != (0, tcm.shape[0], 0,
                                                                tcm.shape[1]) else tcm
        fields = {"dst": sub, "src": dram} if load else {"src": sub, "dst": dram}
        if when and when[0] is not None:              # a piece of its own predicate
            fields["when"] = predicates(cmd.when) + (when[0],)
        fields["wait"] = cmd.wait if k == 0 else ()
        fields["signal"] = cmd.signal if k == len(pieces) - 1 else ()
        out.append(dataclasses.replace(cmd, **fields))
    return out


class Linker:
    """Assembles relocated kernels into one program.

    With ``prefetch``, a kernel's first weight tiles (the const loads that wait on nothing
    at the head of each DMA channel's queue, and the first weight load behind activation
    loads: :func:`_unblock_first_weights`) are issued before its launch, under the
    previous kernel, so they move while that kernel computes; the launch ``carry``-s them.
    For that the two kernels' TCM footprints must not overlap: each kernel's TCM is placed
    at the bottom of the TCM when it fits below the previous one's, else right above it;
    when both do not fit side by side, the kernel is not prefetched.

    Where under the previous kernel: a channel runs its commands in program order and a
    launch waits for every unit, so prefetches queued at the previous kernel's end start
    only once its last load on that channel is done, and its successor's launch waits
    for them. SmolLM2's prefill attention loads K and V tiles until its last q tile: the
    next cluster's first weights (2.5 MB on one channel) started there and held the
    launch 68 k cycles past the attention's end (246 k instead of 178 k cycles a layer).
    With ``spread``, under a compute-bound kernel (:meth:`_has_dma_slack`) whose compute
    after its last DMA on the channel would not hide them (:meth:`_tail_hides`), they are
    cut into blocks (:func:`_row_blocks`) queued between its own DMAs on their channel,
    evenly from its first: each block waits behind at most the commands before it and
    holds the next of them up by one block's transfer, where a compute-bound kernel's
    channel mostly idles. Shipped logs, ``performance``: SmolLM2 fp16 prefill 512 38.36 M
    -> 37.52 M cycles (the attentions 246 k -> 214 k a layer; with default knobs 50.18 M
    -> 50.38 M), the bundled example's prefill 256 374,549 -> 364,774; its other programs,
    SmolLM2's decode and W4A16 prefill, whose prefetches their tails hide or whose kernels
    are bandwidth-bound, unchanged. Where the blocks go is estimated by the cost formulas
    (a linker measures nothing); the emulator measures what it gains, and a tune measures
    each program it spread both ways and logs which a build links
    (:func:`edgetvm.tune.cli.validate_programs`; ``spread_prefetches`` in the program's
    metadata counts the loads moved)."""

    def __init__(self, graph: PhaseGraph, plan: DramPlan, spec, name: str, prefetch=True,
                 spread: bool = True):
        self.graph, self.plan, self.spec = graph, plan, spec
        self.builder = ProgramBuilder(name, spec)
        self.prefetch = prefetch
        self.spread = spread
        #: how many prefetch loads went under the kernel before, not at its end (the
        #: program's ``spread_prefetches``; 0: it is the same program unspread)
        self.spread_loads = 0
        self.events = 0
        self.tcm_high = 0
        self.params: list = []
        self._prev = None                # (TCM base, footprint) of the previous kernel
        self._body = None                # builder indices of the previous kernel's body

    def _tcm_base(self, footprint: int):
        """Where this kernel's TCM goes, and whether it may be prefetched."""
        if self._prev is None or not self.prefetch:
            return 0, False
        base, size = self._prev
        if footprint <= base:
            return 0, True
        a = self.spec.tcm_alignment
        above = -(-(base + size) // a) * a
        if above + footprint <= self.spec.tcm_bytes:
            return above, True
        return 0, False

    def barrier(self) -> None:
        """The next kernel starts as a program's first does: nothing of it is prefetched
        under the kernel before (two chains linked as two back-to-back runs)."""
        self._prev = None
        self._body = None

    def _queue_under_previous(self, hoisted: list) -> None:
        """Queue the prefetches ``hoisted`` before the next launch: at the previous
        kernel's end, or (``spread``) in blocks between its DMAs on their channel."""
        cmds = self.builder.commands
        if not hoisted or not self.spread or self._body is None:
            cmds.extend(hoisted)
            return
        start, end = self._body
        if not self._has_dma_slack(cmds[start:end], hoisted):
            cmds.extend(hoisted)
            return
        after: dict = {}                  # builder index -> blocks queued right after it
        for channel in sorted({c.channel for c in hoisted}):
            loads = [c for c in hoisted if c.channel == channel]
            own = [i for i in range(start, end) if isinstance(cmds[i], (DmaLoad, DmaStore))
                   and cmds[i].channel == channel]
            if not own:                   # the channel idles under the previous kernel
                after.setdefault(start - 1, []).extend(loads)
                self.spread_loads += len(loads)
                continue
            if self._tail_hides(cmds[own[-1] + 1:end], loads):
                after.setdefault(end - 1, []).extend(loads)      # at the end, as before
                continue
            nbytes = sum(dma_bytes(c) for c in loads)
            per = max(1, min(len(own), -(-nbytes // SPREAD_BLOCK_BYTES)) // len(loads))
            blocks = [b for c in loads
                      for b in _row_blocks(c, per, self.spec.dram_burst_bytes)]
            self.spread_loads += len(loads)
            for k, b in enumerate(blocks):
                after.setdefault(own[k * len(own) // len(blocks)], []).append(b)
        out = []
        for i in range(start - 1, len(cmds)):
            out.append(cmds[i])
            out.extend(after.get(i, ()))
        cmds[start - 1:] = out

    def _tail_hides(self, tail: list, loads: list) -> bool:
        """Whether the compute queued after the kernel's last DMA on the channel (``tail``)
        outlasts the prefetch ``loads`` on the bus (:func:`_estimates`)."""
        return _estimates(loads, self.spec)[0] <= _estimates(tail, self.spec)[1]

    def _has_dma_slack(self, body: list, hoisted: list) -> bool:
        """Whether the bus moves the kernel's own DMAs and the prefetch in less time than
        its busiest compute unit takes (:func:`_estimates`, every command counted, the
        predicated ones too): a compute-bound kernel. A bandwidth-bound one (a decode
        GEMV) would only wait longer for its own loads behind the blocks: its prefetch
        stays at its end, where its last tile's compute hides some of it."""
        bus, compute = _estimates([*body, *hoisted], self.spec)
        return bus < compute

    def add(self, kernel) -> None:
        prog = kernel.program
        local, paged = self._bind(kernel)
        shift = self.events
        tcm_base, prefetch = self._tcm_base(prog.tcm_bytes)
        hoisted, body = [], []
        names: set = set()                # the page table entries paged stores address
        blocked = set()                   # DMA channels with a command left in the body
        edits, first_weights, extra_events = ({}, {}, 0) if not prefetch else \
            _unblock_first_weights(prog)
        for i, cmd in enumerate(prog.commands):
            if isinstance(cmd, End):
                continue
            if isinstance(cmd, HostOp):
                cmd = dataclasses.replace(cmd, inputs=tuple(_host_tensor(local, n, kernel)
                                                             for n in cmd.inputs),
                                          outputs=tuple(_host_tensor(local, n, kernel)
                                                        for n in cmd.outputs))
            if i in edits:
                cmd = dataclasses.replace(cmd, **edits[i])
            cmd = _renumber(cmd, shift)
            if tcm_base:
                cmd = _shift_tcm(cmd, tcm_base)
            out = body
            if isinstance(cmd, (DmaLoad, DmaStore)):
                ref = cmd.src if isinstance(cmd, DmaLoad) else cmd.dst
                paging = paged.get(ref.tensor)
                if paging is not None:
                    cmd = token_rows(cmd, prog.tensors[ref.tensor].shape[-1])
                    ref = cmd.src if isinstance(cmd, DmaLoad) else cmd.dst
                view, tensor, base = local[ref.tensor]
                # only a prefix of each channel's queue: a load may be ordered after an
                # earlier one by the channel's FIFO alone (one event for both)
                if prefetch and isinstance(cmd, DmaLoad) and not cmd.wait and \
                        cmd.channel not in blocked and \
                        prog.tensors[ref.tensor].kind == "const":
                    out = hoisted
                    if first_weights.get(i):
                        blocked.add(cmd.channel)   # the loads it passed wait in the body
                elif first_weights.get(i) is False:
                    pass                  # passed by the channel's first weights: own event
                else:
                    blocked.add(cmd.channel)
                if paging is None:
                    pieces = relocate_window(ref, view, tensor, base)
                else:
                    pieces = relocate_paged(
                        ref, view, paging, None if tensor is None else
                        (lambda w, v=view, t=tensor, b=base: relocate_window(w, v, t, b)))
                    names.update(n for d, *_, w in pieces
                                 for v in (d.offset, w or 0) for n in as_affine(v).names())
                out.extend(_split_dma(cmd, pieces))
            else:
                out.append(cmd)
        carry = tuple(c.dst for c in hoisted)
        self._queue_under_previous(hoisted)   # still the previous kernel's stretch of time
        self.builder.emit(Launch(name=kernel.name, carry=carry))
        start = len(self.builder.commands)
        for c in body:
            self.builder.emit(c)
        self._body = (start, len(self.builder.commands))
        self.events += _event_count(prog) + extra_events
        self.tcm_high = max(self.tcm_high, tcm_base + prog.tcm_bytes)
        self._prev = (tcm_base, prog.tcm_bytes)
        for p in prog.params:
            if p not in self.params:
                self.params.append(p)
        for p in [*(p for v in kernel.bindings.values() for p in v.offset.names()),
                  *sorted(names)]:
            if p not in self.params:
                self.params.append(p)

    def _bind(self, kernel) -> tuple:
        """``(local, paged)``: local DRAM name -> (view, program tensor, base offset), and
        -> the :class:`~.kv_pages.Paging` of a name bound to a tensor with new K/V values;
        declaring the tensors."""
        prog = kernel.program
        local, paged = {}, {}
        for name, t in prog.tensors.items():
            if name in kernel.bindings:
                v = kernel.bindings[name]
                g = self.graph.tensors[v.tensor]
                if v.size != int(np.prod(t.shape)):
                    raise BuildError(f"kernel {kernel.name}: {name} {t.shape} bound to a view "
                                     f"of {v.size} elements")
                if g.pages is not None:
                    paged[name] = g.pages
                    for target in g.pages.targets:
                        self._state(target.state, target.layout.shape, "float16")
                if g.kind == KV_PAGES:                 # no arena slot: every value is paged
                    local[name] = (v, None, 0)
                    continue
                tensor, base = self.plan.place[v.tensor]
                local[name] = (v, tensor, base)
                self._declare(tensor, g)
            elif name in kernel.state:
                glob = kernel.state[name]
                self._state(glob, t.shape, t.dtype)
                local[name] = (View.whole(glob, t.shape), glob, 0)
            elif t.kind == "const" and name in prog.metadata.get("template_consts", ()):
                # a template's own constant (a column of ones): one pack tensor per value,
                # named by its bytes, however many kernels use it (any other constant is
                # a weight the kernel must be bound to: unbound, it is refused below)
                glob = "kconst." + hashlib.sha256(
                    repr((t.shape, t.dtype)).encode() + np.ascontiguousarray(t.data).tobytes()
                ).hexdigest()[:16]
                if glob not in self.builder.tensors:
                    self.builder.tensor(glob, t.shape, t.dtype, "const", t.data)
                local[name] = (View.whole(glob, t.shape), glob, 0)
            elif t.kind == "scratch":
                glob = f"{kernel.name}.{name}"
                self.builder.tensor(glob, t.shape, t.dtype, "scratch")
                local[name] = (View.whole(glob, t.shape), glob, 0)
            else:
                raise BuildError(f"kernel {kernel.name}: tensor {name} ({t.kind}) is not bound")
        return local, paged

    def _state(self, name: str, shape, dtype: str) -> None:
        """Declare a KV cache state tensor, once however many kernels use it."""
        if name not in self.builder.tensors:
            self.builder.tensor(name, shape, dtype, "state")

    def _declare(self, tensor: str, g) -> None:
        if tensor in self.builder.tensors:
            return
        if tensor == ARENA:
            self.builder.tensor(ARENA, (max(1, self.plan.arena_elems),), "float16", "scratch")
        elif g.kind in ("const", "table"):
            self.builder.tensor(tensor, g.shape, g.dtype, "const", g.data)
        elif g.kind == "output":
            self.builder.tensor(tensor, g.shape, g.dtype, "output")
        elif g.kind in ("host", "padded"):
            self.builder.tensor(tensor, g.shape, g.dtype, "scratch")
        else:
            raise BuildError(f"tensor {tensor} of kind {g.kind} cannot be placed")

    def build(self, **metadata):
        for p in self.params:
            self.builder.param(p)
        return self.builder.build(tcm_bytes=self.tcm_high,
                                  spread_prefetches=self.spread_loads, **metadata)


def _host_tensor(local: dict, name: str, kernel) -> str:
    """The program tensor a host op's operand ``name`` is: the whole of one (the host
    reads and writes whole tensors; ``graph._host`` made sure of it)."""
    view, tensor, base = local[name]
    if tensor == ARENA or base or view.tensor != tensor:
        raise BuildError(f"kernel {kernel.name}: host operand {name} is not a tensor of its "
                         f"own")
    return tensor


#: command class -> its field names
_FIELDS: dict = {}


def _shift_tcm(cmd, base: int):
    """``cmd`` with every TCM operand (one, or a tuple of them) ``base`` bytes higher."""
    fields = _FIELDS.get(type(cmd))
    if fields is None:
        fields = _FIELDS[type(cmd)] = tuple(f.name for f in dataclasses.fields(cmd))
    changes = {}
    for name in fields:
        v = getattr(cmd, name)
        if isinstance(v, TcmRef):
            changes[name] = dataclasses.replace(v, offset=v.offset + base)
        elif isinstance(v, tuple):
            changes[name] = tuple(dataclasses.replace(r, offset=r.offset + base)
                                  if isinstance(r, TcmRef) else r for r in v)
    return dataclasses.replace(cmd, **changes) if changes else cmd


#: the prefetch of a kernel spread under the one before moves in blocks of about this size
#: (at 32 B a cycle, 2 k cycles: a DMA's 64-cycle set-up is 3 %)
SPREAD_BLOCK_BYTES = 64 << 10


def _estimates(cmds, spec) -> tuple:
    """``(bus, compute)``: cycles the DMAs of ``cmds`` take on the bus (set-up, then their
    bytes at the whole bus's rate) and the busiest compute unit's, by the emulator's cost
    formulas; an estimate for placing prefetches, never a measurement."""
    bus, busy = 0.0, {}
    for c in cmds:
        if isinstance(c, (DmaLoad, DmaStore)):
            bus += dma_estimate(c, spec)
        else:
            busy[c.unit] = busy.get(c.unit, 0) + command_cycles(c, spec)
    return bus, max(busy.values(), default=0)


def _row_blocks(cmd: DmaLoad, n: int, burst: int = 64) -> list:
    """``cmd`` as up to ``n`` loads of consecutive blocks, in order: of rows, or of a
    one-row (contiguous) load's columns in whole ``burst``-byte bursts
    (:func:`_split_dma`: the first keeps its waits, the last its signals; a channel runs
    them in order, so the last one's signal still says every block arrived)."""
    rows, cols = (int(x) for x in cmd.src.shape)
    if n <= 1 or cmd.valid_rows is not None or tuple(cmd.dst.shape) != (rows, cols):
        return [cmd]
    if rows > 1:
        step, extent = cmd.src.row_stride, rows
    else:
        step, extent = 1, cols
    unit = 1 if rows > 1 else max(1, burst // ITEMSIZE[cmd.dst.dtype])   # whole bursts
    units = -(-extent // unit)
    n = min(n, units)
    if n <= 1:
        return [cmd]
    bounds = [min(extent, units * k // n * unit) for k in range(n + 1)]
    pieces = []                       # (DRAM block, TCM rows r0, n, cols c0, m)
    for a, b in zip(bounds, bounds[1:]):
        offset = _value(as_affine(cmd.src.offset) + a * step)
        shape = (b - a, cols) if rows > 1 else (1, b - a)
        block = dataclasses.replace(cmd.src, shape=shape, offset=offset)
        pieces.append((block, a, b - a, 0, cols) if rows > 1 else (block, 0, 1, a, b - a))
    return _split_dma(cmd, pieces)


def _unblock_first_weights(prog):
    """Let each DMA channel's first weight load be prefetched past the activation loads
    queued before it.

    A channel's queue often starts with activation loads that signal nothing, then the
    first weight tile, whose event tells its consumer that all of them arrived (the FIFO
    orders them). Moving the weight load before the launch breaks that: so each such
    activation load gets an event of its own, which the weight event's consumer also
    waits on. Returns ``(edits, first_weights, new events)``: command index -> fields to
    replace; index -> True for a weight load that may move, False for a load it passes."""
    n_events = _event_count(prog)
    edits, first, new = {}, {}, 0
    queues: dict = {}
    for i, c in enumerate(prog.commands):
        if isinstance(c, (DmaLoad, DmaStore)):
            queues.setdefault(c.channel, []).append(i)
    for channel, idx in queues.items():
        passed = []
        for i in idx:
            c = prog.commands[i]
            if not isinstance(c, DmaLoad) or c.wait:
                break
            if prog.tensors[c.src.tensor].kind == "const":
                if passed and len(c.signal) == 1:
                    consumer = _consumer(prog.commands, i, c.signal[0])
                    if consumer is not None and consumer not in edits:
                        evs = tuple(range(n_events + new, n_events + new + len(passed)))
                        new += len(passed)
                        for a, e in zip(passed, evs):
                            edits[a] = {"signal": (e,)}
                            first[a] = False
                        cw = prog.commands[consumer].wait
                        edits[consumer] = {"wait": tuple(cw) + evs}
                        first[i] = True
                break
            if c.signal:
                break
            passed.append(i)
    return edits, first, new


def _consumer(commands, index: int, event: int):
    """The command whose wait consumes the signal of ``event`` by command ``index`` (the
    k-th wait on an event consumes its k-th signal)."""
    k = sum(1 for c in commands[:index] for e in c.signal if e == event)
    seen = 0
    for j, c in enumerate(commands):
        n = sum(1 for e in c.wait if e == event)
        if seen + n > k:
            return j
        seen += n
    return None


def _event_count(program) -> int:
    ids = [e for c in program.commands for e in tuple(c.wait) + tuple(c.signal)]
    return max(ids) + 1 if ids else 0


def _renumber(cmd, shift: int):
    if not shift or not (cmd.wait or cmd.signal):
        return cmd
    return dataclasses.replace(cmd, wait=tuple(e + shift for e in cmd.wait),
                               signal=tuple(e + shift for e in cmd.signal))

