"""The emulator: runs a command stream for real and measures it.

One :class:`Emulator` is one NPU with its DRAM. :meth:`Emulator.run` executes a program;
:meth:`Emulator.timeline` runs several programs back to back on one clock, so that power
windows and throttling see one step's kernels as the device would:

* functional: every command's numpy semantics (``functional.py``) on a TCM byte array and
  the DRAM tensors, so the outputs are the real results;
* timing: a discrete-event simulation of the units (each DMA channel, matrix, vector,
  host) and the DRAM bus. A unit issues its commands in program order; a command starts
  when its unit is free and the signals it waits on have arrived (plus
  ``event_sync_cycles``). Command costs are in ``costs.py``. A DMA sets up on its channel
  (``dma_setup_cycles``), then moves its bursts over the DRAM bus, which serves the busy
  channels round robin at burst granularity: with ``k`` transfers on the bus, each moves
  ``dram_bytes_per_cycle / k`` bytes per cycle. Among the commands that could start, the
  earliest starts first (ties: the lowest command index), so overlap is exactly what the
  events allow;
* clock: the power governor (``power.py``) sets the NPU clock scale ``s`` every
  ``dvfs_interval_cycles``; compute and DMA set-up progress at ``s`` cycles per cycle,
  DRAM transfers and host ops do not slow down. Times are in nominal-clock cycles;
* hazards: vector-clock race detection (``hazards.py``) and static checks (``validate.py``);
* power: what each unit, the DRAM and the TCM draw, windowed and throttled (``power.py``).

``state`` tensors (e.g. KV cache pages) persist in :attr:`Emulator.state` across runs.
"""
from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

import numpy as np

from edgetvm.errors import EdgeTVMError, InvalidProgramError

from ..host_ops import HOST_OPS
from ..isa import (ITEMSIZE, DmaLoad, DmaStore, End, EventSignal, EventWait, HostOp, Launch,
                   Mma, Program, Vector, eval_value, holds)
from ..spec import NPUSpec, load_spec
from . import functional as F
from .costs import command_cycles, dma_tcm_traffic, dram_bursts, tcm_traffic
from .hazards import HazardChecker, Region, TcmInit, tcm_region
from .power import PowerLog, governor_scale
from .validate import check_dram_bounds, command_name, validate

_EPS = 1e-9

#: environment variables by which a user sets the BLAS library's thread count himself
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_blas_limited = False          # set once per process (a forked child inherits the limit)


def one_blas_thread() -> None:
    """Run this process's BLAS (numpy's matmul, the MMAs' functional model) on one thread,
    once per process, unless the user set a thread count (``OPENBLAS_NUM_THREADS``, ...).

    An emulator's matmuls are tiles (16-512 rows), too small for BLAS threads to pay off,
    and emulators run side by side: the tuner's forked workers, ``pytest -n 2``, servers
    on one machine. OpenBLAS's threads spin while they wait for work, so two processes
    with a thread per core each starve one another: two runs of SmolLM2's W4A16 artifact
    side by side on 2 cores took 11.8 s each, 2.4 s with one thread (alone: 2.27 s and
    2.42 s)."""
    global _blas_limited
    if _blas_limited or any(v in os.environ for v in _BLAS_THREAD_VARS):
        return
    from threadpoolctl import threadpool_limits
    threadpool_limits(1, user_api="blas")
    _blas_limited = True


@dataclass
class Counters:
    """What the emulator measured for one run (cycles at the spec's nominal clock)."""

    total_cycles: int
    time_us: float
    throttled_cycles: int            # time the governor held the clock below nominal
    min_clock_scale: float
    dram_read_bytes: int             # bytes the program asked for
    dram_write_bytes: int
    dram_bus_bytes: int              # what the bus moved: whole bursts
    tcm_read_bytes: int
    tcm_write_bytes: int
    tcm_high_water_bytes: int
    busy_cycles: dict
    stall_cycles: dict
    peak_power_mw: float             # peak of the sliding power_window_cycles average
    peak_power_demand_mw: float      # the same with the compute units at nominal clock
    avg_power_mw: float
    energy_uj: float
    energy_uj_by: dict               # static, units (matrix, vector), host, dram, tcm
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
    start: float     # cycles on the run's timeline
    end: float


@dataclass
class RunResult:
    outputs: dict
    counters: Counters
    trace: list = field(default_factory=list)
    power_mw: np.ndarray | None = None           # average power per DVFS interval
    power_window_starts: np.ndarray | None = None  # start of each of those intervals


@dataclass
class _Step:
    """Per-command facts that do not depend on runtime parameters."""

    unit: str
    name: str
    waits: tuple        # ((event, count), ...)
    cycles: int         # compute cost (non-DMA); DMA cost depends on valid_rows
    tcm_reads: tuple
    tcm_writes: tuple
    tcm_pj: float       # TCM access energy of a compute command


def _plan(program: Program, spec: NPUSpec) -> list:
    steps = []
    for cmd in program.commands:
        reads, writes = (), ()
        if isinstance(cmd, DmaStore):
            reads = (tcm_region(cmd.src),)
        elif isinstance(cmd, Mma):
            ops = [cmd.a, cmd.b] + [r for r in (cmd.scales, cmd.zeros) if r is not None]
            if cmd.accumulate:
                ops.append(cmd.out)
            reads, writes = tuple(tcm_region(r) for r in ops), (tcm_region(cmd.out),)
        elif isinstance(cmd, Vector):
            reads = tuple(tcm_region(r) for r in cmd.srcs)
            writes = (tcm_region(cmd.dst),)
        rd, wr = tcm_traffic(cmd, spec)
        steps.append(_Step(cmd.unit, command_name(cmd), tuple(Counter(cmd.wait).items()),
                           command_cycles(cmd, spec), reads, writes,
                           rd * spec.tcm_read_pj_per_byte + wr * spec.tcm_write_pj_per_byte))
    return steps


class Emulator:
    """One emulated NPU (spec + power profile) with its persistent DRAM state."""

    def __init__(self, spec: NPUSpec | str = "edge-npu-16mb", profile: str | None = None):
        self.spec = load_spec(spec) if isinstance(spec, str) else spec
        self.profile = self.spec.profile(profile)
        self.units = [f"dma{c}" for c in range(self.spec.dma_channels)] + \
            ["matrix", "vector", "host"]
        one_blas_thread()
        self.tcm = np.zeros(self.spec.tcm_bytes, dtype=np.uint8)
        self.tcm_init = TcmInit(self.spec.tcm_bytes)
        self.state: dict = {}
        self._plans: dict = {}

    # -- public -----------------------------------------------------------------------
    def check(self, program: Program) -> None:
        """Run the static checks only (raises :class:`InvalidProgramError`)."""
        self._plan_for(program)

    def run(self, program: Program, inputs: dict | None = None, params: dict | None = None,
            trace: bool = False) -> RunResult:
        """Execute ``program`` on a fresh timeline (idle before it); returns its outputs,
        counters and (optionally) a trace."""
        return self.timeline().run(program, inputs, params, trace)

    def timeline(self) -> "Timeline":
        """A clock on which runs follow one another: power windows and throttling carry
        over from one run to the next (one step of a model, kernel after kernel)."""
        return Timeline(self)

    # -- helpers ----------------------------------------------------------------------
    def _plan_for(self, program: Program) -> list:
        # keyed by content: a program edited in place (commands or tensors replaced) is
        # validated and planned again, never run with the plan of what it was
        key = id(program)
        content = (tuple(program.commands),
                   tuple((n, tuple(t.shape), t.dtype, t.kind) for n, t in program.tensors.items()),
                   tuple(program.params), program.tcm_bytes)
        cached = self._plans.get(key)
        if cached is not None and cached[0] is program and _same(cached[1], content):
            return cached[2]
        validate(program, self.spec)
        steps = _plan(program, self.spec)
        if len(self._plans) > 64:
            self._plans.clear()
        self._plans[key] = (program, content, steps)
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


def _same(a: tuple, b: tuple) -> bool:
    cmds_a, rest_a = a[0], a[1:]
    cmds_b, rest_b = b[0], b[1:]
    return len(cmds_a) == len(cmds_b) and all(x is y for x, y in zip(cmds_a, cmds_b)) \
        and rest_a == rest_b


class Timeline:
    """The clock of one emulated device across runs: time, the governor's clock scale and
    the power log. Each :meth:`run` starts when the previous one ended."""

    def __init__(self, emu: Emulator):
        self.emu, self.spec = emu, emu.spec
        self.now = 0.0
        self.scale = 1.0
        self.next_dvfs = float(self.spec.dvfs_interval_cycles)
        self.log = PowerLog(self.spec.power_static_mw)
        self.throttled = 0.0
        self.min_scale = 1.0

    def run(self, program: Program, inputs: dict | None = None, params: dict | None = None,
            trace: bool = False, cycle_limit: float | None = None) -> RunResult:
        """Run ``program`` after whatever ran on this timeline before. ``cycle_limit``:
        stop with :class:`CycleLimitExceeded` once the run has taken that many cycles (a
        search's candidate that is already far slower than the best; the timeline is
        then mid-run and not to be used again)."""
        emu = self.emu
        steps = emu._plan_for(program)
        params = emu._check_params(program, params or {})
        dram = emu._bind_dram(program, inputs or {})
        run = _Run(self, program, steps, dram, params, trace)
        run.limit = None if cycle_limit is None else self.now + float(cycle_limit)
        return run.execute()

    def counters(self, start: float = 0.0) -> dict:
        """Time, energy and peak windowed power of the timeline since ``start``."""
        spec = self.spec
        peak, demand = self.log.peaks(start, self.now, spec.power_window_cycles)
        energy = self.log.energy(start, self.now)
        total = self.now - start
        return {"total_cycles": int(np.ceil(total - _EPS)) if total > 0 else 0,
                "time_us": spec.cycles_to_us(total), "peak_power_mw": peak,
                "peak_power_demand_mw": demand,
                "avg_power_mw": energy / total if total > 0 else 0.0,
                "energy_uj": energy / spec.clock_mhz * 1e-3}

    # -- the clock --------------------------------------------------------------------
    def power_now(self, active, sharers: int) -> tuple:
        """(power parts in mW, compute units' power at nominal clock, the TCM power of
        the NPU's compute commands and the same at nominal clock) for the current
        activities (``sharers``: transfers on the bus)."""
        spec, e = self.spec, self.emu.profile.dvfs_exponent
        mhz = spec.clock_mhz / 1000.0
        parts = {"static": spec.power_static_mw, "units": 0.0, "dram": 0.0, "tcm": 0.0,
                 "host": 0.0}
        nominal = tcm_nominal = 0.0
        for act in active.values():
            if act.phase == "compute":
                p = spec.power_unit_mw[act.unit]
                if act.unit == "host":
                    parts["host"] += p
                else:
                    nominal += p
                    parts["units"] += p * self.scale ** e
                    # its TCM bytes per cycle follow its progress: the clock
                    tcm_nominal += act.tcm_pj / act.work * mhz if act.tcm_pj else 0.0
            if act.tcm_pj and act.phase in ("compute", "transfer"):
                parts["tcm"] += act.tcm_pj / act.work * act.rate(self, sharers) * mhz
        if sharers:
            parts["dram"] = spec.dram_bytes_per_cycle * spec.dram_pj_per_byte * mhz
        return parts, nominal, tcm_nominal * self.scale, tcm_nominal


class _Activity:
    """What a busy unit is doing: ``setup`` (DMA, NPU clock), ``transfer`` (DMA bursts on
    the bus) or ``compute`` (NPU clock; the host at its own)."""

    __slots__ = ("index", "unit", "phase", "remaining", "work", "tcm_pj", "start",
                 "bus_bytes", "alone", "vc")

    def __init__(self, index, unit, phase, remaining, tcm_pj, start, vc):
        self.index, self.unit, self.phase, self.remaining = index, unit, phase, remaining
        self.work, self.tcm_pj, self.start, self.vc = remaining, tcm_pj, start, vc
        self.bus_bytes = self.alone = 0.0

    def rate(self, clock: Timeline, sharers: int = 1) -> float:
        if self.phase == "transfer":
            return clock.spec.dram_bytes_per_cycle / max(1, sharers)
        if self.unit == "host":
            return 1.0
        return clock.scale


class CycleLimitExceeded(EdgeTVMError):
    """A run passed the ``cycle_limit`` it was given (:meth:`Timeline.run`)."""

    def __init__(self, program: str, limit: float):
        super().__init__(program, limit)    # args as given: it pickles back to itself
        self.program, self.limit = program, limit

    def __str__(self) -> str:
        return f"{self.program}: over {self.limit:,.0f} cycles, stopped"


class _Run:
    """One execution of one program on a timeline (the discrete-event loop)."""

    def __init__(self, clock: Timeline, program: Program, steps, dram, params, trace):
        emu = clock.emu
        self.clock, self.emu, self.spec = clock, emu, emu.spec
        self.program, self.steps, self.dram, self.params = program, steps, dram, params
        self.want_trace = trace
        self.flat = {k: v.reshape(-1) for k, v in dram.items()}
        self.names = [s.name for s in steps]
        self.hazards = HazardChecker(emu.units)
        self.t0 = clock.now
        self.limit: float | None = None        # absolute time to stop at (Timeline.run)
        self.unit_free = {u: clock.now for u in emu.units}
        self.active: dict = {}                 # unit -> _Activity
        self._cached = None                    # see _load
        self.signals: dict = {}                # event -> deque of (time, vc, unit)
        self.busy = Counter()
        self.stall = Counter()
        self.trace: list = []
        self.read_bytes = self.write_bytes = self.bus_bytes = self.macs = 0
        self.tcm_read = self.tcm_write = 0
        self.skipped = self.launches = 0
        self.tcm_high = 0
        self.throttled, self.min_scale = 0.0, clock.scale
        self.parts0 = dict(clock.log.parts)
        emu.tcm[:program.tcm_bytes] = 0   # deterministic: no data from an earlier run
        emu.tcm_init.start_run()

    def execute(self) -> RunResult:
        segment: list = []
        for i, cmd in enumerate(self.program.commands):
            if isinstance(cmd, (Launch, End)):
                self._run_segment(segment)
                segment = []
                self._barrier(i, cmd)
                if isinstance(cmd, End):
                    break
            else:
                segment.append(i)
        return self._result()

    # -- the clock ----------------------------------------------------------------------
    def _transfers(self) -> int:
        return self._load()[0]

    def _load(self) -> tuple:
        """(transfers on the bus, power parts, nominal unit power) of the current
        activities; cached until an activity starts, changes phase or ends, or the clock
        scale changes (``self._cached = None``)."""
        if self._cached is None:
            sharers = sum(a.phase == "transfer" for a in self.active.values())
            self._cached = (sharers,) + self.clock.power_now(self.active, sharers)
        return self._cached

    def _advance(self, t: float) -> None:
        """Move the clock to ``t``: activities progress, power is logged, the governor
        acts at every DVFS boundary crossed."""
        clock = self.clock
        while True:
            # at a DVFS boundary (or within _EPS of it, however the clock got there) the
            # governor acts first: the boundary is always ahead of the clock afterwards,
            # so every loop below makes progress
            while clock.now >= clock.next_dvfs - _EPS:
                clock.scale = governor_scale(clock.log, clock.now, self.spec, self.emu.profile)
                self._cached = None
                clock.min_scale = min(clock.min_scale, clock.scale)
                clock.next_dvfs += self.spec.dvfs_interval_cycles
            if clock.now >= t - _EPS:
                break
            t1 = min(t, clock.next_dvfs)
            dt = t1 - clock.now
            sharers, parts, nominal, tcm, tcm_nominal = self._load()
            clock.log.add(t1, parts, nominal, tcm, tcm_nominal)
            for act in self.active.values():
                act.remaining -= act.rate(clock, sharers) * dt
            if clock.scale < 1.0:
                clock.throttled += dt
                self.throttled += dt
            self.min_scale = min(self.min_scale, clock.scale)
            clock.now = t1
        clock.now = max(clock.now, t)

    def _next_completion(self):
        sharers = self._transfers()
        best = None
        for act in self.active.values():
            t = self.clock.now + max(act.remaining, 0.0) / act.rate(self.clock, sharers)
            if best is None or (t, act.index) < (best[0], best[1].index):
                best = (t, act)
        return best

    # -- scheduling ---------------------------------------------------------------------
    def _ready_start(self, u, i):
        """(start time, cause unit) of queue head ``i`` on ``u``, or None if a signal it
        waits on has not arrived yet."""
        start, cause = self.unit_free[u], None
        sync = self.spec.event_sync_cycles
        for e, k in self.steps[i].waits:
            q = self.signals.get(e)
            if q is None or len(q) < k:
                return None
            t = q[k - 1][0] + sync
            if t > start:
                start, cause = t, q[k - 1][2]
        return start, cause

    def _run_segment(self, indices) -> None:
        queues = {u: deque() for u in self.emu.units}
        for i in indices:
            queues[self.steps[i].unit].append(i)
        queues = {u: q for u, q in queues.items() if q}
        while queues or self.active:
            if self.limit is not None and self.clock.now > self.limit:
                raise CycleLimitExceeded(self.program.name, self.limit - self.t0)
            best = None
            for u, q in queues.items():
                if u in self.active:
                    continue
                ready = self._ready_start(u, q[0])
                if ready is not None and (best is None or (ready[0], q[0]) < (best[0], best[1])):
                    best = (max(ready[0], self.clock.now), q[0], u, ready[1])
            done = self._next_completion()
            nxt = min(x[0] for x in (done, best) if x is not None) if (done or best) else None
            if nxt is not None and self.clock.next_dvfs < nxt - _EPS:
                # the governor acts first: activities' rates change, so look again after
                self._advance(self.clock.next_dvfs)
                continue
            if done is not None and (best is None or done[0] <= best[0] + _EPS):
                self._advance(done[0])
                self._complete(done[1])
                continue
            if best is None:
                blocked = min(q[0] for q in queues.values())
                ev = [e for e, k in self.steps[blocked].waits]
                raise InvalidProgramError(
                    f"deadlock: {self.names[blocked]} waits on event(s) {ev} that no runnable "
                    f"command can signal", blocked)
            start, i, u, cause = best
            self._advance(start)
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
                    joined.append(self.signals[e].popleft()[1])
            self._issue(i, u, joined)

    def _issue(self, i, unit, joined) -> None:
        cmd, step = self.program.commands[i], self.steps[i]
        now = self.clock.now
        vc = self.hazards.begin(unit, joined)
        active = cmd.when is None or holds(cmd.when, self.params)
        act = None
        if not active:
            self.skipped += 1
        elif isinstance(cmd, (DmaLoad, DmaStore)):
            act = self._dma(i, cmd, step, vc, now)
        elif not isinstance(cmd, (EventWait, EventSignal)):
            self._compute(i, cmd, step, vc)
            if step.cycles > 0:
                act = _Activity(i, unit, "compute", float(step.cycles), step.tcm_pj, now, vc)
        if act is None:
            self._finish(i, unit, now, now, vc)
        else:
            self.active[unit] = act
            self._cached = None

    def _complete(self, act: _Activity) -> None:
        now = self.clock.now
        self._cached = None
        if act.phase == "setup":
            act.phase, act.remaining, act.work = "transfer", act.bus_bytes, act.bus_bytes
            if act.bus_bytes > 0:
                return
        if act.phase == "transfer":
            self.stall["dram_bus"] += max(0.0, now - act.start - self.spec.dma_setup_cycles
                                          - act.alone)
        del self.active[act.unit]
        self._finish(act.index, act.unit, act.start, now, act.vc)

    def _finish(self, i, unit, start, end, vc) -> None:
        if end > start:
            self.busy[unit] += end - start
            if self.want_trace:
                self.trace.append(TraceEvent(unit, self.steps[i].name, i, start - self.t0,
                                             end - self.t0))
        self.unit_free[unit] = end
        for e in self.program.commands[i].signal:
            self.signals.setdefault(e, deque()).append((end, vc, unit))

    def _barrier(self, i, cmd) -> None:
        self._advance(max(self.unit_free.values()))
        if isinstance(cmd, Launch):
            self.launches += 1
            start = self.clock.now
            # reconfiguration on the NPU clock: no unit busy, static power only
            remaining = float(self.spec.launch_cycles)
            while remaining > _EPS:
                t = self.clock.now + remaining / self.clock.scale
                if t < self.clock.next_dvfs:          # ends at this clock scale
                    self._advance(t)
                    break
                # at the boundary the governor may change the scale (each pass crosses
                # one, so the loop ends however small a float step gets at a late clock)
                remaining -= (self.clock.next_dvfs - self.clock.now) * self.clock.scale
                self._advance(self.clock.next_dvfs)
            if self.want_trace:
                self.trace.append(TraceEvent("control", f"Launch {cmd.name}".strip(), i,
                                             start - self.t0, self.clock.now - self.t0))
        for u in self.unit_free:
            self.unit_free[u] = self.clock.now
        self.hazards.barrier()
        if isinstance(cmd, Launch) and not cmd.keep_tcm:
            self.emu.tcm_init.launch(tuple(tcm_region(r) for r in cmd.carry))

    # -- execution --------------------------------------------------------------------
    def _dram_window(self, i, ref, rows):
        decl = self.program.tensors[ref.tensor]
        off = eval_value(ref.offset, self.params)
        try:
            check_dram_bounds(ref, decl, off, "DRAM operand", rows)
        except InvalidProgramError as e:
            raise InvalidProgramError(str(e) + f" (runtime parameters {self.params})", i) \
                from None
        isz = ITEMSIZE[decl.dtype]
        region = Region("dram:" + ref.tensor, off * isz, rows, ref.shape[1] * isz,
                        ref.row_stride * isz)
        return F.dram_view(self.flat[ref.tensor], ref, off), region, off * isz

    def _dma(self, i, cmd, step, vc, now):
        rows = F.valid_rows(cmd, self.params)
        load = isinstance(cmd, DmaLoad)
        tcm_ref, dram_ref = (cmd.dst, cmd.src) if load else (cmd.src, cmd.dst)
        if rows == 0:
            self.skipped += 1
            return None
        if not load and self.program.tensors[dram_ref.tensor].kind == "const":
            raise InvalidProgramError(f"DmaStore writes const tensor {dram_ref.tensor!r}", i)
        view, dram_region, start_byte = self._dram_window(i, dram_ref, rows)
        tcm_win = tcm_region(tcm_ref, rows)
        if load:
            # const tensors are never written (stores and host ops to them are refused), so
            # reading one cannot race: not recorded, which keeps the race tables short
            const = self.program.tensors[dram_ref.tensor].kind == "const"
            self.hazards.check(i, step.unit, vc, () if const else (dram_region,),
                               (tcm_win,), self.names)
            self.emu.tcm_init.write((tcm_win,))
        else:
            self.hazards.check(i, step.unit, vc, (tcm_win,), (dram_region,), self.names)
            self.emu.tcm_init.check(i, (tcm_win,), self.names)
        F.dma(cmd, self.emu.tcm, view, rows)
        isz = ITEMSIZE[tcm_ref.dtype]
        nbytes = rows * tcm_ref.shape[1] * isz
        burst = self.spec.dram_burst_bytes
        bus = dram_bursts(start_byte, rows, tcm_ref.shape[1] * isz, dram_ref.row_stride * isz,
                          burst) * burst
        rd, wr = dma_tcm_traffic(cmd, rows)
        if load:
            self.read_bytes += nbytes
        else:
            self.write_bytes += nbytes
        self.bus_bytes += bus
        self.tcm_read += rd
        self.tcm_write += wr
        self.tcm_high = max(self.tcm_high, tcm_ref.end)
        pj = rd * self.spec.tcm_read_pj_per_byte + wr * self.spec.tcm_write_pj_per_byte
        act = _Activity(i, step.unit, "setup", float(self.spec.dma_setup_cycles), pj, now, vc)
        act.bus_bytes = float(bus)
        act.alone = bus / self.spec.dram_bytes_per_cycle
        if act.remaining <= 0:
            act.phase, act.remaining, act.work = "transfer", act.bus_bytes, act.bus_bytes
        return act

    def _compute(self, i, cmd, step, vc) -> None:
        if isinstance(cmd, HostOp):
            self._host(i, cmd, step, vc)
            return
        self.hazards.check(i, step.unit, vc, step.tcm_reads, step.tcm_writes, self.names)
        self.emu.tcm_init.check(i, step.tcm_reads, self.names)
        self.emu.tcm_init.write(step.tcm_writes)
        for r in step.tcm_writes + step.tcm_reads:
            self.tcm_high = max(self.tcm_high, r.end)
        rd, wr = tcm_traffic(cmd, self.spec)
        self.tcm_read += rd
        self.tcm_write += wr
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
    def _result(self) -> RunResult:
        spec, clock, log = self.spec, self.clock, self.clock.log
        summary = clock.counters(self.t0)
        total = summary["total_cycles"]
        starts, power = log.trace(self.t0, clock.now, spec.dvfs_interval_cycles)
        mhz = spec.clock_mhz
        by = {k: v - self.parts0.get(k, 0.0) for k, v in log.parts.items()}
        outputs = {t.name: self.dram[t.name] for t in self.program.tensors_of("output")}
        counters = Counters(
            total_cycles=total,
            time_us=spec.cycles_to_us(total),
            throttled_cycles=int(round(self.throttled)),
            min_clock_scale=float(self.min_scale),
            dram_read_bytes=int(self.read_bytes),
            dram_write_bytes=int(self.write_bytes),
            dram_bus_bytes=int(self.bus_bytes),
            tcm_read_bytes=int(self.tcm_read),
            tcm_write_bytes=int(self.tcm_write),
            tcm_high_water_bytes=int(self.tcm_high),
            busy_cycles={u: int(round(self.busy.get(u, 0))) for u in self.emu.units},
            stall_cycles={k: int(round(v)) for k, v in sorted(self.stall.items())},
            peak_power_mw=summary["peak_power_mw"],
            peak_power_demand_mw=summary["peak_power_demand_mw"],
            avg_power_mw=summary["avg_power_mw"],
            energy_uj=summary["energy_uj"],
            energy_uj_by={k: v / mhz * 1e-3 for k, v in by.items()},
            macs=int(self.macs),
            commands=len(self.program.commands),
            commands_skipped=int(self.skipped),
            launches=int(self.launches),
            profile=self.emu.profile.name,
        )
        return RunResult(outputs, counters, self.trace, power, starts - self.t0)
