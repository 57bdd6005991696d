"""The emulator: runs a command stream for real and measures it.

One :class:`Emulator` is one NPU with its DRAM. :meth:`Emulator.run` executes a program:

* functional: every command's numpy semantics (``functional.py``) on a TCM byte array and
  the DRAM tensors, so the outputs are the real results;
* timing: one timeline per unit (each DMA channel, matrix, vector, host). A unit issues its
  commands in program order; a command starts when its unit is free and every event it
  waits on has been signalled (plus ``event_sync_cycles``). A DMA pays
  ``dma_setup_cycles`` on its channel, then moves its bytes over the DRAM bus
  (``dram_bytes_per_cycle``, shared by all channels). ``Launch`` and ``End`` wait for all
  units. Among the commands that could start, the earliest starts first (a discrete-event
  simulation), so overlap is exactly what the events allow;
* hazards: vector-clock race detection (``hazards.py``) and static checks (``validate.py``);
* power: windowed power and DVFS throttling (``power.py``).

``state`` tensors (e.g. KV cache pages) persist in :attr:`Emulator.state` across runs.
"""
from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from edgetvm.errors import InvalidProgramError

from ..host_ops import HOST_OPS
from ..isa import (ITEMSIZE, DmaLoad, DmaStore, End, EventSignal, EventWait, HostOp, Launch, Mma,
                   Program, TcmRef, Vector, eval_value)
from ..spec import NPUSpec, load_spec
from . import functional as F
from .hazards import HazardChecker, Region
from .power import power_report
from .validate import check_dram_bounds, command_name, validate


@dataclass
class Counters:
    """What the emulator measured for one run (cycles at the spec's clock)."""

    total_cycles: int
    time_us: float
    unthrottled_cycles: int
    throttled_cycles: int
    dram_read_bytes: int
    dram_write_bytes: int
    tcm_high_water_bytes: int
    busy_cycles: dict
    stall_cycles: dict
    peak_power_mw: float
    peak_power_demand_mw: float
    avg_power_mw: float
    energy_uj: float
    macs: int
    commands: int
    commands_skipped: int
    launches: int
    profile: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TraceEvent:
    unit: str
    name: str
    index: int
    start: float     # cycles, throttled timeline
    end: float


@dataclass
class RunResult:
    outputs: dict
    counters: Counters
    trace: list = field(default_factory=list)
    power_mw: np.ndarray | None = None           # per window, after throttling
    power_window_starts: np.ndarray | None = None  # cycles, throttled timeline


@dataclass
class _Step:
    """Per-command facts that do not depend on runtime parameters."""

    unit: str
    name: str
    waits: tuple        # ((event, count), ...)
    cycles: int         # compute cost (non-DMA); DMA cost depends on valid_rows
    tcm_reads: tuple
    tcm_writes: tuple


def _tcm_region(ref: TcmRef, rows: int | None = None) -> Region:
    isz = ITEMSIZE[ref.dtype]
    return Region("tcm", ref.offset, ref.shape[0] if rows is None else rows,
                  ref.shape[1] * isz, ref.stride * isz)


def command_cycles(cmd, spec: NPUSpec) -> int:
    """Cycles a non-DMA command occupies its unit (DMA: see the emulator docstring)."""
    if isinstance(cmd, Mma):
        m, n, k = cmd.mnk
        tm, tn, tk = spec.mma_tile
        tiles = -(-m // tm) * -(-n // tn) * -(-k // tk)
        return -(-tiles * tm * tn * tk // spec.mma_macs_per_cycle[cmd.kind])
    if isinstance(cmd, Vector):
        elems = max(cmd.dst.shape[0] * cmd.dst.shape[1],
                    cmd.srcs[0].shape[0] * cmd.srcs[0].shape[1])
        return -(-elems // spec.vector_lanes) * spec.vector_op_cycles[cmd.op]
    if isinstance(cmd, HostOp):
        return spec.host_switch_cycles + -(-cmd.flops // max(1, int(spec.host_flops_per_cycle)))
    return 0


def _plan(program: Program, spec: NPUSpec) -> list:
    steps = []
    for cmd in program.commands:
        reads, writes = (), ()
        if isinstance(cmd, DmaStore):
            reads = (_tcm_region(cmd.src),)
        elif isinstance(cmd, Mma):
            ops = [cmd.a, cmd.b] + [r for r in (cmd.scales, cmd.zeros) if r is not None]
            if cmd.accumulate:
                ops.append(cmd.out)
            reads, writes = tuple(_tcm_region(r) for r in ops), (_tcm_region(cmd.out),)
        elif isinstance(cmd, Vector):
            reads = tuple(_tcm_region(r) for r in cmd.srcs)
            writes = (_tcm_region(cmd.dst),)
        steps.append(_Step(cmd.unit, command_name(cmd), tuple(Counter(cmd.wait).items()),
                           command_cycles(cmd, spec), reads, writes))
    return steps


class Emulator:
    """One emulated NPU (spec + power profile) with its persistent DRAM state."""

    def __init__(self, spec: NPUSpec | str = "edge-npu-16mb", profile: str | None = None):
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.profile = self.spec.profile(profile)
        self.units = [f"dma{c}" for c in range(self.spec.dma_channels)] + \
            ["matrix", "vector", "host"]
        self.tcm = np.zeros(self.spec.tcm_bytes, dtype=np.uint8)
        self.state: dict = {}
        self._plans: dict = {}

    # -- public -----------------------------------------------------------------------
    def check(self, program: Program) -> None:
        """Run the static checks only (raises :class:`InvalidProgramError`)."""
        self._plan_for(program)

    def run(self, program: Program, inputs: dict | None = None, params: dict | None = None,
            trace: bool = False) -> RunResult:
        """Execute ``program``; returns its outputs, counters and (optionally) a trace."""
        steps = self._plan_for(program)
        params = self._check_params(program, params or {})
        dram = self._bind_dram(program, inputs or {})
        run = _Run(self, program, steps, dram, params, trace)
        return run.execute()

    # -- helpers ----------------------------------------------------------------------
    def _plan_for(self, program: Program) -> list:
        key = id(program)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is program:
            return cached[1]
        validate(program, self.spec)
        steps = _plan(program, self.spec)
        if len(self._plans) > 64:
            self._plans.clear()
        self._plans[key] = (program, steps)
        return steps

    @staticmethod
    def _check_params(program: Program, params: dict) -> dict:
        missing = [p for p in program.params if p not in params]
        if missing:
            raise InvalidProgramError(f"program {program.name!r} needs runtime parameter(s) "
                                      f"{missing}; got {sorted(params)}")
        extra = [p for p in params if p not in program.params]
        if extra:
            raise InvalidProgramError(f"program {program.name!r} has no runtime parameter(s) "
                                      f"{extra}; it takes {list(program.params)}")
        bad = [p for p, v in params.items() if not isinstance(v, (int, np.integer))]
        if bad:
            raise InvalidProgramError(f"runtime parameters must be integers: {bad}")
        return {k: int(v) for k, v in params.items()}

    def _bind_dram(self, program: Program, inputs: dict) -> dict:
        unknown = [n for n in inputs if n not in program.tensors
                   or program.tensors[n].kind not in ("input", "state")]
        if unknown:
            raise InvalidProgramError(f"program {program.name!r} has no input(s) {unknown}; "
                                      f"inputs: {[t.name for t in program.tensors_of('input')]}")
        dram = {}
        for t in program.tensors.values():
            if t.kind == "input":
                if t.name not in inputs:
                    raise InvalidProgramError(f"program {program.name!r}: input {t.name!r} "
                                              f"{t.dtype}{list(t.shape)} not given")
                arr = np.asarray(inputs[t.name])
                if tuple(arr.shape) != tuple(t.shape):
                    raise InvalidProgramError(f"input {t.name!r}: shape {arr.shape}, program "
                                              f"expects {tuple(t.shape)}")
                arr = np.array(arr, dtype=t.dtype, copy=True)
            elif t.kind == "const":
                arr = t.data.reshape(t.shape)
            elif t.kind == "state":
                if t.name in inputs:
                    self.state[t.name] = np.array(inputs[t.name], dtype=t.dtype).reshape(t.shape)
                arr = self.state.get(t.name)
                if arr is None or arr.shape != tuple(t.shape) or arr.dtype != np.dtype(t.dtype):
                    arr = np.zeros(t.shape, dtype=t.dtype)
                    self.state[t.name] = arr
            else:
                arr = np.zeros(t.shape, dtype=t.dtype)
            dram[t.name] = np.ascontiguousarray(arr)
        return dram


class _Run:
    """One execution of one program (the discrete-event loop)."""

    def __init__(self, emu: Emulator, program: Program, steps, dram, params, trace):
        self.emu, self.spec, self.program, self.steps = emu, emu.spec, program, steps
        self.dram, self.params, self.want_trace = dram, params, trace
        self.flat = {k: v.reshape(-1) for k, v in dram.items()}
        self.names = [s.name for s in steps]
        self.hazards = HazardChecker(emu.units)
        self.unit_free = {u: 0.0 for u in emu.units}
        self.dram_free = 0.0
        self.signals: dict = {}          # event -> heap of (time, tiebreak, vc, unit)
        self.tiebreak = 0
        self.busy = {u: ([], []) for u in emu.units}
        self.stall = Counter()
        self.trace: list = []
        self.read_bytes = self.write_bytes = self.macs = 0
        self.skipped = self.launches = 0
        self.tcm_high = 0
        emu.tcm[:program.tcm_bytes] = 0   # deterministic: no data from an earlier run

    def execute(self) -> RunResult:
        cmds = self.program.commands
        segment: list = []
        end_time = 0.0
        for i, cmd in enumerate(cmds):
            if isinstance(cmd, (Launch, End)):
                self._run_segment(segment)
                segment = []
                end_time = self._barrier(i, cmd)
                if isinstance(cmd, End):
                    break
            else:
                segment.append(i)
        return self._result(end_time)

    # -- scheduling -------------------------------------------------------------------
    def _run_segment(self, indices) -> None:
        queues = {u: deque() for u in self.emu.units}
        for i in indices:
            queues[self.steps[i].unit].append(i)
        queues = {u: q for u, q in queues.items() if q}
        sync = self.spec.event_sync_cycles
        while queues:
            best = None
            for u, q in queues.items():
                i = q[0]
                start, cause = self.unit_free[u], None
                ready = True
                for e, k in self.steps[i].waits:
                    heap = self.signals.get(e)
                    if heap is None or len(heap) < k:
                        ready = False
                        break
                    sig = heap[0] if k == 1 else heapq.nsmallest(k, heap)[-1]
                    if sig[0] + sync > start:
                        start, cause = sig[0] + sync, sig[3]
                if ready and (best is None or (start, i) < (best[0], best[1])):
                    best = (start, i, u, cause)
            if best is None:
                blocked = min(q[0] for q in queues.values())
                ev = [e for e, k in self.steps[blocked].waits]
                raise InvalidProgramError(
                    f"deadlock: {self.names[blocked]} waits on event(s) {ev} that no runnable "
                    f"command can signal", blocked)
            start, i, u, cause = best
            queues[u].popleft()
            if not queues[u]:
                del queues[u]
                self.hazards.retire(u)
            if cause is not None and start > self.unit_free[u]:
                kind = "dma" if cause.startswith("dma") else cause
                self.stall[f"wait_{kind}"] += start - self.unit_free[u]
            joined = []
            for e, k in self.steps[i].waits:
                for _ in range(k):
                    joined.append(heapq.heappop(self.signals[e])[2])
            self._issue(i, u, start, joined)

    def _issue(self, i, unit, start, joined) -> None:
        cmd, step = self.program.commands[i], self.steps[i]
        vc = self.hazards.begin(unit, joined)
        active = cmd.when is None or cmd.when.eval(self.params) > 0
        end = start
        if not active:
            self.skipped += 1
        elif isinstance(cmd, (DmaLoad, DmaStore)):
            end = self._dma(i, cmd, step, vc, start)
        elif not isinstance(cmd, (EventWait, EventSignal)):
            self._compute(i, cmd, step, vc)
            end = start + step.cycles
        if end > start:
            self.busy[unit][0].append(start)
            self.busy[unit][1].append(end)
            if self.want_trace:
                self.trace.append(TraceEvent(unit, step.name, i, start, end))
        self.unit_free[unit] = end
        for e in cmd.signal:
            self.tiebreak += 1
            heapq.heappush(self.signals.setdefault(e, []), (end, self.tiebreak, vc, unit))

    def _barrier(self, i, cmd) -> float:
        t = max(max(self.unit_free.values()), self.dram_free)
        if isinstance(cmd, Launch):
            self.launches += 1
            if self.want_trace:
                self.trace.append(TraceEvent("control", f"Launch {cmd.name}".strip(), i, t,
                                             t + self.spec.launch_cycles))
            t += self.spec.launch_cycles
        for u in self.unit_free:
            self.unit_free[u] = t
        self.dram_free = t
        self.hazards.barrier()
        return t

    # -- execution --------------------------------------------------------------------
    def _dram_window(self, i, ref, rows):
        decl = self.program.tensors[ref.tensor]
        off = eval_value(ref.offset, self.params)
        if not isinstance(ref.offset, int):
            try:
                check_dram_bounds(ref, decl, off, "DRAM operand")
            except InvalidProgramError as e:
                raise InvalidProgramError(str(e) + f" (runtime parameters {self.params})", i) \
                    from None
        isz = ITEMSIZE[decl.dtype]
        region = Region("dram:" + ref.tensor, off * isz, rows, ref.shape[1] * isz,
                        ref.row_stride * isz)
        return F.dram_view(self.flat[ref.tensor], ref, off), region

    def _dma(self, i, cmd, step, vc, start) -> float:
        rows = F.valid_rows(cmd, self.params)
        load = isinstance(cmd, DmaLoad)
        tcm_ref, dram_ref = (cmd.dst, cmd.src) if load else (cmd.src, cmd.dst)
        if rows == 0:
            self.skipped += 1
            return start
        if not load and self.program.tensors[dram_ref.tensor].kind == "const":
            raise InvalidProgramError(f"DmaStore writes const tensor {dram_ref.tensor!r}", i)
        view, dram_region = self._dram_window(i, dram_ref, rows)
        tcm_region = _tcm_region(tcm_ref, rows)
        if load:
            # const tensors are never written (stores and host ops to them are refused), so
            # reading one cannot race: not recorded, which keeps the race tables short
            const = self.program.tensors[dram_ref.tensor].kind == "const"
            self.hazards.check(i, step.unit, vc, () if const else (dram_region,),
                               (tcm_region,), self.names)
        else:
            self.hazards.check(i, step.unit, vc, (tcm_region,), (dram_region,), self.names)
        F.dma(cmd, self.emu.tcm, view, rows)
        nbytes = rows * tcm_ref.shape[1] * ITEMSIZE[tcm_ref.dtype]
        if load:
            self.read_bytes += nbytes
        else:
            self.write_bytes += nbytes
        self.tcm_high = max(self.tcm_high, tcm_ref.end)
        data_start = max(start + self.spec.dma_setup_cycles, self.dram_free)
        self.stall["dram_bus"] += data_start - (start + self.spec.dma_setup_cycles)
        self.dram_free = data_start + math.ceil(nbytes / self.spec.dram_bytes_per_cycle)
        return self.dram_free

    def _compute(self, i, cmd, step, vc) -> None:
        if isinstance(cmd, HostOp):
            self._host(i, cmd, step, vc)
            return
        self.hazards.check(i, step.unit, vc, step.tcm_reads, step.tcm_writes, self.names)
        for r in step.tcm_writes + step.tcm_reads:
            self.tcm_high = max(self.tcm_high, r.end)
        if isinstance(cmd, Mma):
            F.mma(cmd, self.emu.tcm)
            m, n, k = cmd.mnk
            self.macs += m * n * k
        else:
            F.vector(cmd, self.emu.tcm, self.params)

    def _host(self, i, cmd, step, vc) -> None:
        def whole(name):
            d = self.dram[name]
            return Region("dram:" + name, 0, 1, d.nbytes, d.nbytes)
        for t in cmd.outputs:
            if self.program.tensors[t].kind == "const":
                raise InvalidProgramError(f"host op {cmd.fn!r} writes const tensor {t!r}", i)
        self.hazards.check(i, "host", vc, tuple(whole(t) for t in cmd.inputs),
                           tuple(whole(t) for t in cmd.outputs), self.names)
        results = HOST_OPS[cmd.fn]([self.dram[t] for t in cmd.inputs], dict(cmd.attrs))
        if len(results) != len(cmd.outputs):
            raise InvalidProgramError(f"host op {cmd.fn!r} returned {len(results)} arrays for "
                                      f"{len(cmd.outputs)} outputs", i)
        for t, r in zip(cmd.outputs, results):
            dst = self.dram[t]
            if r.size != dst.size:
                raise InvalidProgramError(f"host op {cmd.fn!r}: result of {r.size} elements for "
                                          f"tensor {t!r} of {dst.size}", i)
            # host writes go through the CPU's caches, not the NPU's DMA: not DRAM counters
            dst[...] = np.asarray(r).reshape(dst.shape).astype(dst.dtype)

    # -- result -----------------------------------------------------------------------
    def _result(self, end_time) -> RunResult:
        spec = self.spec
        intervals = {u: (np.asarray(s, dtype=np.float64), np.asarray(e, dtype=np.float64))
                     for u, (s, e) in self.busy.items()}
        pr = power_report(spec, self.emu.profile, intervals, end_time)
        total = math.ceil(pr.total_cycles - 1e-9) if end_time > 0 else 0
        energy_mw_cycles = float((pr.power_mw * pr.duration_cycles).sum()) if end_time > 0 else 0.0
        trace = []
        if self.want_trace:
            for ev in self.trace:
                s, e = pr.stretch([ev.start, ev.end])
                trace.append(TraceEvent(ev.unit, ev.name, ev.index, float(s), float(e)))
        outputs = {t.name: self.dram[t.name] for t in self.program.tensors_of("output")}
        busy = {u: float(sum(e) - sum(s)) for u, (s, e) in self.busy.items()}
        counters = Counters(
            total_cycles=int(total),
            time_us=spec.cycles_to_us(total),
            unthrottled_cycles=int(math.ceil(end_time)),
            throttled_cycles=int(total - math.ceil(end_time)),
            dram_read_bytes=int(self.read_bytes),
            dram_write_bytes=int(self.write_bytes),
            tcm_high_water_bytes=int(self.tcm_high),
            busy_cycles={u: int(v) for u, v in busy.items()},
            stall_cycles={k: int(v) for k, v in sorted(self.stall.items())},
            peak_power_mw=float(pr.power_mw.max()) if end_time > 0 else 0.0,
            peak_power_demand_mw=float(pr.demand_mw.max()) if end_time > 0 else 0.0,
            avg_power_mw=energy_mw_cycles / total if total else 0.0,
            energy_uj=energy_mw_cycles / spec.clock_mhz * 1e-3,
            macs=int(self.macs),
            commands=len(self.program.commands),
            commands_skipped=int(self.skipped),
            launches=int(self.launches),
            profile=self.emu.profile.name,
        )
        starts = np.concatenate([[0.0], np.cumsum(pr.duration_cycles)[:-1]])
        return RunResult(outputs, counters, trace, pr.power_mw, starts)
