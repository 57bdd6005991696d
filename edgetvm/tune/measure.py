"""Where candidates are lowered and measured: in this process, in forked local worker
processes, or on emulator servers behind a TVM RPC tracker.

A measurer takes one task's knob sets and returns, per candidate, ``(result, wall_s)``:
result is a :class:`Measurement`, a :class:`CandidateRejected` (it does not lower: TCM
overflow, knobs the template refuses; never run), :class:`TooSlow` (stopped once it cost
``slow_after`` cycles: the tuner passes a multiple of the task's best, so that a hopeless
tile does not emulate for minutes) or another exception (a failed trial: an error, a
timeout, a lost server; the tuner goes on).

The measured cost is the kernel's cost **in context**
(:func:`~edgetvm.build.measure.measure_in_context`): the steady state (the second of two
back-to-back runs on one emulator timeline) of the candidate linked between its
neighbours with cross-kernel prefetch, less that of the neighbours linked alone (measured
once per task). Locally that is ``Timeline.run`` twice. A runner (``edgetvm.runner``)
runs every job on a fresh timeline, so there the chain is linked twice into one program
(a ``Launch`` before each copy, as between two runs on one timeline) and the steady cost
is that program's cycles minus the single chain's: the same cycle count (to one cycle
when the clock is throttled, whose float time each run rounds; ``test_tune_tracker.py``).
Peak power and the lowest clock are taken over both runs, as the two-copy program gives
them.

Local workers are *forked* once the tasks exist, so each inherits the compiler (its phase
graphs, weights and templates) and lowers and runs its candidates itself: only knob sets
go out and measurements come back, no program or weight crosses a pipe. (Lowering is
about 60 % of a candidate's time on SmolLM2's decode kernels, so a pool that only ran the
emulator would leave most of the work serial.)
"""
from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

from edgetvm import interrupt
from edgetvm.build.cuts import joinable
from edgetvm.build.graph import BuildError
from edgetvm.build.measure import context_programs, measurement_params, run_twice
from edgetvm.errors import CandidateRejected, EdgeTVMError
from edgetvm.runner.base import RunnerConnectionError
from edgetvm.target.emulator import CycleLimitExceeded, Emulator
from edgetvm.target.emulator.power import MIN_SCALE

from .log import PARTITION


@dataclass(frozen=True)
class Measurement:
    cycles: int                  # what the kernel adds to the step, in context
    dram_bytes: int
    peak_power_mw: float         # peak windowed power of the chain with the kernel (both runs)
    neighbours_peak_mw: float = 0.0   # ... and of its neighbours without it
    min_clock_scale: float = 1.0      # the lowest clock the governor set in the chain

    def over_budget(self, limit_mw: float) -> bool:
        """Does this kernel put the step over ``limit_mw`` (the profile's budget, see
        :meth:`~edgetvm.tune.tuner.Tuner.power_limit`) beyond what the governor can
        correct? The chain with it peaks above the limit, above its neighbours without it
        (a neighbour over on its own is not this candidate's doing), and the governor had
        the clock at its floor (``MIN_SCALE``): the power that does not scale with the
        clock (DRAM, TCM, static) alone breaks it. A window over the limit while the
        governor still had room is its reaction time (one DVFS interval), which it then
        corrects; its cost is in the measured cycles. Peaks compare at the tuning log's
        precision (1 uW): a schedule whose timing equals the defaults' (another order of
        the same float sums) is not over a limit the defaults' peak set."""
        return beyond_governor(self.peak_power_mw, limit_mw, self.neighbours_peak_mw,
                               self.min_clock_scale)


def beyond_governor(peak_mw: float, limit_mw: float, baseline_mw: float,
                    min_clock_scale: float) -> bool:
    """Is a run peaking at ``peak_mw`` over ``limit_mw`` beyond what the governor can
    correct (:meth:`Measurement.over_budget`): above the limit, above the peak of the run
    it is compared with (``baseline_mw``: a baseline over on its own is not this run's
    doing), with the clock at its floor. Peaks compare at the log's precision (1 uW)."""
    peak = round(peak_mw, 3)
    return peak > round(limit_mw, 3) and peak > round(baseline_mw, 3) and \
        min_clock_scale <= MIN_SCALE + 1e-9


@dataclass
class Job:
    """A lowered candidate: its program (its kernels between their neighbours, relocated),
    the neighbours' program without it (None: no neighbours), their runtime parameters,
    and the kernels and phase graph it came from."""

    program: object
    params: dict
    without: object
    without_params: dict
    kernels: list
    graph: object


def lower_candidate(mc, task, knobs, copies: int = 1) -> Job:
    """Lower ``knobs`` of ``task`` with compiler ``mc`` into its measuring programs (the
    chains ``copies`` times over); raises CandidateRejected."""
    return chain_job(mc, task, lower_kernels(mc, task, knobs), copies)


def lower_kernels(mc, task, knobs) -> list:
    """The candidate's kernels: the kernel lowered with ``knobs``, or for a partition task
    the run's clusters under the cuts ``knobs``, with their tuned knobs where the task has
    some (:attr:`~edgetvm.tune.tasks.PartitionTask.tiles`), else the defaults (raises
    CandidateRejected; another error: RuntimeError)."""
    try:
        if task.kind == PARTITION:
            groups = task.groups(knobs)
            bad = next((g for g in groups if not joinable(task.graph, g)), None)
            if bad is not None:
                raise CandidateRejected(f"cuts {knobs['cuts']}: ops "
                                        f"{[task.graph.ops[i].name for i in bad]} may not "
                                        f"share a kernel")
            cons = task.graph.consumers()
            return [mc.kernels.kernel(task.graph, g, cons, knobs=task.tiles_of(g))
                    for g in groups]
        return [mc.kernels.kernel(task.graph, list(task.group), knobs=knobs)]
    except BuildError as e:
        raise CandidateRejected(str(e)) from None
    except CandidateRejected:
        raise
    except Exception as e:                             # noqa: BLE001 - a failed trial
        interrupt.check()                # unless it was Ctrl-C, which TVM can disguise
        raise RuntimeError(f"lowering: {type(e).__name__}: {e}") from None


def chain_job(mc, task, kernels: list, copies: int = 1) -> Job:
    """The measuring programs of a candidate's ``kernels`` of ``task``: chains ``copies``
    times over."""
    before, after = task.context_kernels(mc)
    with_it, without = context_programs(kernels, before, after, task.graph, mc.spec, copies)
    params = measurement_params(with_it, task.graph, mc.layout)
    wparams = None if without is None else \
        measurement_params(without, task.graph, mc.layout)
    return Job(with_it, params, without, wparams, kernels, task.graph)


def in_context(with_it: dict, without: dict | None) -> Measurement:
    """The candidate's Measurement from the steady figures (:func:`_steady_local`,
    :func:`_steady`) of the chain with it and of its neighbours alone (None: no
    neighbours). Peak power is the chain's. A difference below one cycle (a kernel that
    costs nothing in context) counts as 1."""
    def total(c, names):
        return 0 if c is None else sum(int(c[n]) for n in names)
    cyc = ("total_cycles",)
    dram = ("dram_read_bytes", "dram_write_bytes")
    return Measurement(max(1, total(with_it, cyc) - total(without, cyc)),
                       total(with_it, dram) - total(without, dram),
                       float(with_it["peak_power_mw"]),
                       0.0 if without is None else float(without["peak_power_mw"]),
                       float(with_it["min_clock_scale"]))


#: how the error of a stopped candidate's record begins
STOPPED = "stopped"


class TooSlow(Exception):
    """A candidate stopped once it had cost ``cycles`` (more than ``slow_after``): far
    slower than the best, its exact figure is not worth the emulation time."""

    def __init__(self, cycles: int):
        super().__init__(int(cycles))       # args = (cycles,): it pickles back to itself
        self.cycles = int(cycles)

    def __str__(self) -> str:
        return f"{STOPPED}: slower than {self.cycles:,} cycles in context"


def measure_candidate(mc, task, knobs, emulator, slow_after: int | None = None
                      ) -> Measurement:
    """Lower one candidate in this process and measure it on ``emulator`` (raises
    CandidateRejected, and TooSlow once it has cost ``slow_after`` cycles), or on a
    :class:`RunnerDevice`'s server (``slow_after`` not applied: a server runs every
    candidate to its end)."""
    if isinstance(emulator, RunnerDevice):
        return emulator.measure(mc, task, knobs)
    job = lower_candidate(mc, task, knobs)
    alone = _neighbours_alone(task, job, emulator)
    limit = None
    if slow_after is not None:
        limit = slow_after + (0 if alone is None else alone["total_cycles"])
    try:
        chain = _steady_local(emulator, job.program, job.params, limit)
    except CycleLimitExceeded:
        raise TooSlow(int(slow_after)) from None
    return in_context(chain, alone)


def _steady_local(emulator, program, params, cycle_limit=None) -> dict:
    """The figures :func:`_steady` gives a runner's two programs, from two runs on one
    timeline: cycles and bytes of the second run, peak power and lowest clock of both."""
    a, b = run_twice(emulator, program, params, cycle_limit)
    out = {k: getattr(b, k) for k in ("total_cycles", "dram_read_bytes", "dram_write_bytes")}
    out["peak_power_mw"] = max(a.peak_power_mw, b.peak_power_mw)
    out["min_clock_scale"] = min(a.min_clock_scale, b.min_clock_scale)
    return out


#: (task workload, neighbours, emulator id) -> Counters of the neighbours linked alone;
#: the same for every candidate of a task, so measured once per process
_ALONE: dict = {}


def _neighbours_alone(task, job, emulator):
    if job.without is None:
        return None
    key = (task.workload, task.context, id(emulator))
    if key not in _ALONE:
        _ALONE[key] = (emulator, _steady_local(emulator, job.without, job.without_params))
    return _ALONE[key][1]


class RunnerDevice:
    """Candidates lowered here, run on an ``edgetvm.runner`` (a session of a tracker's
    server): the chain linked once and twice, and the neighbours alone once per task, as
    :class:`RunnerMeasurer` runs them (see the module docstring)."""

    def __init__(self, runner, profile):
        self.runner, self.profile = runner, profile
        self.alone: dict = {}            # (task workload, context) -> steady figures

    def measure(self, mc, task, knobs) -> Measurement:
        once, twice = _lower_chains(mc, task, knobs, reraise=True)
        key = (task.workload, task.context)
        alone_now = once.without is not None and key not in self.alone
        res = self.runner.run_many(_chain_runs(once, twice, self.profile, alone_now),
                                   return_exceptions=True)
        if alone_now:
            alone = _steady(res[2], res[3])
            if isinstance(alone, BaseException):
                raise alone
            self.alone[key] = alone
        chain = _steady(res[0], res[1])
        if isinstance(chain, BaseException):
            raise chain
        return in_context(chain, self.alone.get(key) if once.without is not None else None)


def _lower_and_run(mc, task, knobs, emulator, slow_after=None):
    t0 = time.time()
    try:
        res = measure_candidate(mc, task, knobs, emulator, slow_after)
    except CandidateRejected as e:
        res = CandidateRejected(str(e))
    except TooSlow as e:
        res = e
    except RunnerConnectionError as e:                 # a lost server (RunnerDevice)
        res = RunnerConnectionError(str(e))            # (its message only: it pickles)
    except Exception as e:                             # noqa: BLE001 - a failed trial
        interrupt.check()
        res = RuntimeError(f"{type(e).__name__}: {e}")
    return res, time.time() - t0


class Measurer:
    """What a tuner measures with. :meth:`measure` lowers and runs a batch of one task's
    candidates, returning per candidate ``(Measurement or the exception, wall seconds)``;
    :meth:`measure_many` the same for ``(task, knobs)`` pairs of several tasks (the
    tuner's baselines). :attr:`workers`: how many candidates it runs at once;
    :attr:`tasks_at_once`: whether :meth:`measure_many` runs several tasks' candidates
    at once (else one after another)."""

    workers = 1
    tasks_at_once = False

    def measure(self, task, batch: list, slow_after: int | None = None) -> list:
        raise NotImplementedError

    def measure_many(self, pairs: list, slow_after: int | None = None) -> list:
        return [self.measure(task, [kn], slow_after)[0] for task, kn in pairs]

    def close(self) -> None:
        pass


class LocalMeasurer(Measurer):
    """In this process, one candidate after another (no timeout: nothing can stop an
    emulator run in its own process)."""

    def __init__(self, mc, profile):
        self.mc = mc
        self.emulator = Emulator(mc.spec, profile)

    def measure(self, task, batch: list, slow_after: int | None = None) -> list:
        return [_lower_and_run(self.mc, task, kn, self.emulator, slow_after) for kn in batch]


_FORKED = None          # (compiler, tasks by workload, profile) inherited by the workers


def _fork_pool(state: tuple, workers: int, initializer=None):
    """``workers`` processes forked now, inheriting ``state`` as :data:`_FORKED` (the
    compiler, its phase graphs and weights: only knob sets and results cross a pipe)."""
    global _FORKED
    import multiprocessing as mp
    _FORKED = state
    return mp.get_context("fork").Pool(workers, initializer=_quiet_init,
                                       initargs=(initializer,))


def _quiet_init(initializer=None) -> None:
    """A worker leaves Ctrl-C to the tuner, which stops the pool: a worker killed by it
    while holding the pool's queue lock left the tuner's ``terminate`` waiting forever."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if initializer is not None:
        initializer()


def _stop_pool(pool) -> None:
    """Stop a pool (and a hung worker with it)."""
    if pool is not None:
        pool.terminate()
        pool.join()


class ForkMeasurer(Measurer):
    """``workers`` forked processes, each lowering and running its candidates. A candidate
    past ``timeout`` seconds is a failed trial (the i-th of a batch is given until
    ``timeout * (i // workers + 1)`` after the batch started: the candidates queued before
    it take their turn first); the pool is then stopped (the hung worker with it) and
    forked again for the next batch.

    ``device``: what each worker runs its candidates on, made in the worker once forked
    (a zero-argument callable): by default a local emulator; for a tracker, a
    :class:`RunnerDevice` holding one server session of the worker's own (``runner``:
    the tracker, asked whether any server is left when a whole batch lost its servers).
    Each of N workers then lowers a candidate and waits on its server while the others
    do the same, so N servers measure N candidates at once, and only knob sets and
    measurements cross the pool's pipes, no program."""

    tasks_at_once = True

    def __init__(self, mc, tasks, profile, workers: int, timeout: float, device=None,
                 runner=None):
        self.state = (mc, {t.workload: t for t in tasks}, profile)
        self.workers, self.timeout = int(workers), float(timeout)
        self.device, self.runner = device, runner
        self.pool = None

    def _start(self):
        if self.pool is None:
            self.pool = _fork_pool(self.state, self.workers,
                                   functools.partial(_fork_init, self.device))
        return self.pool

    def measure(self, task, batch: list, slow_after: int | None = None) -> list:
        return self.measure_many([(task, kn) for kn in batch], slow_after)

    def measure_many(self, pairs: list, slow_after: int | None = None) -> list:
        """``measure`` for (task, knobs) pairs of any tasks (the baselines of several
        tasks at once)."""
        import multiprocessing as mp
        pool = self._start()
        out: list = [None] * len(pairs)
        todo = list(range(len(pairs)))
        while todo:
            pending = [(i, pool.apply_async(_fork_run, (pairs[i][0].workload, pairs[i][1],
                                                         slow_after)))
                       for i in todo]
            t0, todo = time.time(), []
            for n, (i, r) in enumerate(pending):
                # the n-th starts once the workers are through the ones before it
                deadline = t0 + self.timeout * (n // self.workers + 1)
                try:
                    out[i] = r.get(timeout=max(0.0, deadline - time.time()))
                except mp.TimeoutError:
                    # a hung candidate: it fails; those queued behind it that never got
                    # a worker go to a fresh pool (the hung worker is stopped with this one)
                    out[i] = (TimeoutError(f"no result after {self.timeout:g} s"),
                              time.time() - t0)
                    todo = [j for j, q in pending[n + 1:] if not q.ready()]
                    for j, q in pending[n + 1:]:
                        if q.ready():
                            out[j] = _result(q, t0)
                    self.close()
                    if todo:
                        pool = self._start()
                    break
                except Exception as e:                 # noqa: BLE001
                    out[i] = (e, time.time() - t0)
        _stop_if_no_server(self.runner, [r for r, _ in out])
        return out

    def close(self) -> None:
        _stop_pool(self.pool)
        self.pool = None
        if self.runner is not None:
            self.runner.close()


def _result(r, t0):
    try:
        return r.get(timeout=0)
    except Exception as e:                             # noqa: BLE001
        return (e, time.time() - t0)


def _fork_init(device=None) -> None:
    global _EMU
    _EMU = device() if device is not None else Emulator(_FORKED[0].spec, _FORKED[2])


def _fork_run(workload: str, knobs, slow_after=None):
    mc, tasks, _ = _FORKED
    return _lower_and_run(mc, tasks[workload], knobs, _EMU, slow_after)


_EMU = None


class RunnerMeasurer(Measurer):
    """An ``edgetvm.runner`` (``tracker://HOST:PORT/KEY``, ``rpc://``...): a batch's
    candidates are lowered here, one after another, then each run twice (the chain once
    and twice), spread over the runner's servers by ``run_many``. (With more than one
    worker, ``tune`` uses a :class:`ForkMeasurer` of :class:`RunnerDevice` workers
    instead: lowering is most of a small candidate's time, and there it overlaps the
    servers' runs.)"""

    def __init__(self, mc, runner, profile, tasks=()):
        self.mc, self.runner, self.profile = mc, runner, profile
        self._alone: dict = {}       # task workload -> steady counters of the neighbours

    @property
    def workers(self) -> int:
        """Candidates the runner measures at once (its servers)."""
        w = getattr(self.runner, "max_workers", None)
        if w:
            return int(w)
        try:
            return max(1, int(self.runner.servers()["total"]))
        except Exception:                              # noqa: BLE001 - not a tracker
            return 1

    def measure(self, task, batch: list, slow_after: int | None = None) -> list:
        """(``slow_after`` is not applied: a server runs every candidate to its end.)"""
        t0 = time.time()
        lowered, runs = [], []
        for pair in (_lower_chains(self.mc, task, kn) for kn in batch):
            if isinstance(pair, BaseException):        # rejected or failed
                lowered.append(pair)
                continue
            j, twice = pair
            lowered.append(len(runs))
            alone_now = self._alone.get(task.workload) is None and j.without is not None
            if alone_now:
                self._alone[task.workload] = len(runs) + 2
            runs += _chain_runs(j, twice, self.profile, alone_now)
        res = self.runner.run_many(runs, return_exceptions=True) if runs else []
        _stop_if_no_server(self.runner, res)
        wall = (time.time() - t0) / max(1, len(batch))
        alone = self._alone.get(task.workload)
        if isinstance(alone, int):           # measured in this batch
            alone = self._alone[task.workload] = _steady(res[alone], res[alone + 1])
            if isinstance(alone, BaseException):
                self._alone[task.workload] = None      # try again with the next batch
        out = []
        for x in lowered:
            if isinstance(x, BaseException):
                out.append((x, wall))
                continue
            chain = _steady(res[x], res[x + 1])
            bad = next((r for r in (chain, alone) if isinstance(r, BaseException)), None)
            out.append((bad, wall) if bad is not None else (in_context(chain, alone), wall))
        return out

    def close(self) -> None:
        self.runner.close()


def _chain_runs(once, twice, profile, alone: bool) -> list:
    """The runner jobs of a candidate's chain linked once and twice (:func:`_steady`
    takes their difference), then, with ``alone``, its neighbours' once and twice."""
    from edgetvm.runner import RunJob
    runs = [RunJob(j.program, {}, j.params, profile) for j in (once, twice)]
    if alone:
        runs += [RunJob(j.without, {}, j.without_params, profile) for j in (once, twice)]
    return runs


def _stop_if_no_server(runner, results: list) -> None:
    """Stop the tune when every run of a batch found no server and the tracker has none
    left under the key (each trial would wait its request timeout, for ever)."""
    if runner is None or not results or \
            not all(isinstance(r, RunnerConnectionError) for r in results):
        return
    servers = getattr(runner, "servers", None)
    if servers is not None and servers()["total"] == 0:
        raise EdgeTVMError(f"{runner!r}: no emulator server is registered under "
                           f"the key any more ({results[0]}); the trials so far are in "
                           f"the log: start servers and rerun to resume")


def _lower_chains(mc, task, knobs, reraise: bool = False):
    """(chain once, chain twice) Jobs of a candidate, its kernel lowered once; or the
    exception (CandidateRejected: does not lower; another: a failed trial), which
    ``reraise`` raises instead."""
    try:
        ks = lower_kernels(mc, task, knobs)
        return tuple(dataclasses.replace(chain_job(mc, task, ks, c), kernels=None, graph=None)
                     for c in (1, 2))
    except CandidateRejected as e:
        if reraise:
            raise
        return CandidateRejected(str(e))
    except Exception as e:                             # noqa: BLE001 - one that pickles
        if reraise:
            raise
        return RuntimeError(f"{type(e).__name__}: {e}")


def _steady(once, twice):
    """Counters (a dict) of the second copy: ``twice`` less ``once``; an exception when
    either run failed. Peak power and the lowest clock are the two-copy run's."""
    bad = next((r for r in (once, twice) if isinstance(r, BaseException)), None)
    if bad is not None:
        return bad
    a, b = once.counters, twice.counters
    out = {k: b[k] - a[k] for k in ("total_cycles", "dram_read_bytes", "dram_write_bytes")}
    out["peak_power_mw"] = b["peak_power_mw"]          # the two-copy run's: both copies
    out["min_clock_scale"] = b["min_clock_scale"]
    return out
