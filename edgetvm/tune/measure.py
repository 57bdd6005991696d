"""Where candidates are lowered and measured: in this process, in forked local worker
processes, or on emulator servers behind a TVM RPC tracker.

A measurer takes one task's knob sets and returns, per candidate, ``(result, wall_s)``:
result is a :class:`Measurement`, a :class:`CandidateRejected` (it does not lower: TCM
overflow, knobs the template refuses; never run) or another exception (a failed trial:
an error, a timeout, a lost server; the tuner goes on).

The measured cost is the steady state of :mod:`edgetvm.tune.tasks`: the second of two
back-to-back runs on one emulator timeline. Locally that is two ``Timeline.run`` calls.
A runner (``edgetvm.runner``) runs every job on a fresh timeline, so there the kernel is
linked twice into one program (a ``Launch`` before each copy, as between two runs on one
timeline) and the cost is that program's cycles minus the single copy's: the same cycle
count, exactly (``test_tune_tracker.py`` checks it).

Local workers are *forked* once the tasks exist, so each inherits the compiler (its phase
graphs, weights and templates) and lowers and runs its candidates itself: only knob sets
go out and measurements come back, no program or weight crosses a pipe. (Lowering is
about 60 % of a candidate's time on SmolLM2's decode kernels, so a pool that only ran the
emulator would leave most of the work serial.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from edgetvm.build.graph import BuildError
from edgetvm.errors import CandidateRejected
from edgetvm.target.emulator import Emulator

from edgetvm.build.measure import kernel_program, measurement_params, run_steady


@dataclass(frozen=True)
class Measurement:
    cycles: int
    dram_bytes: int
    peak_power_mw: float


@dataclass
class Job:
    """A lowered candidate: its program (the kernel alone, relocated) and runtime
    parameters, and the kernel and phase graph it came from."""

    program: object
    params: dict
    kernel: object
    graph: object


def lower_candidate(mc, task, knobs) -> Job:
    """Lower ``knobs`` of ``task`` with compiler ``mc``; raises CandidateRejected."""
    try:
        k = mc.kernels.kernel(task.graph, list(task.group), knobs=knobs)
    except BuildError as e:
        raise CandidateRejected(str(e)) from None
    except CandidateRejected:
        raise
    except Exception as e:                             # noqa: BLE001 - a failed trial
        raise RuntimeError(f"lowering: {type(e).__name__}: {e}") from None
    program = kernel_program(k, task.graph, mc.spec)
    return Job(program, measurement_params(program, task.graph, mc.layout), k, task.graph)


def _from_counters(c) -> Measurement:
    return Measurement(int(c.total_cycles), int(c.dram_read_bytes + c.dram_write_bytes),
                       float(c.peak_power_mw))


def _lower_and_run(mc, task, knobs, emulator):
    t0 = time.time()
    try:
        job = lower_candidate(mc, task, knobs)
        res = _from_counters(run_steady(emulator, job.program, job.params))
    except CandidateRejected as e:
        res = CandidateRejected(str(e))
    except Exception as e:                             # noqa: BLE001 - a failed trial
        res = RuntimeError(f"{type(e).__name__}: {e}")
    return res, time.time() - t0


class LocalMeasurer:
    """In this process, one candidate after another (no timeout: nothing can stop an
    emulator run in its own process)."""

    def __init__(self, mc, profile):
        self.mc = mc
        self.emulator = Emulator(mc.spec, profile)

    def measure(self, task, batch: list) -> list:
        return [_lower_and_run(self.mc, task, kn, self.emulator) for kn in batch]

    def close(self) -> None:
        pass


_FORKED = None          # (compiler, tasks by workload, profile) inherited by the workers


class ForkMeasurer:
    """``workers`` forked processes, each lowering and running its candidates. A candidate
    past ``timeout`` seconds is a failed trial; the pool is then stopped (the hung worker
    with it) and forked again for the next batch."""

    def __init__(self, mc, tasks, profile, workers: int, timeout: float):
        self.state = (mc, {t.workload: t for t in tasks}, profile)
        self.workers, self.timeout = int(workers), float(timeout)
        self.pool = None

    def _start(self):
        global _FORKED
        import multiprocessing as mp
        if self.pool is None:
            _FORKED = self.state
            self.pool = mp.get_context("fork").Pool(self.workers, initializer=_fork_init)
        return self.pool

    def measure(self, task, batch: list) -> list:
        import multiprocessing as mp
        pool = self._start()
        pending = [pool.apply_async(_fork_run, (task.workload, kn)) for kn in batch]
        out, hung = [], False
        t0 = time.time()
        for r in pending:
            try:
                out.append(r.get(timeout=self.timeout))
            except mp.TimeoutError:
                hung = True
                out.append((TimeoutError(f"no result after {self.timeout:g} s"),
                            time.time() - t0))
            except Exception as e:                     # noqa: BLE001
                out.append((e, time.time() - t0))
        if hung:
            self.close()
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


def _fork_init() -> None:
    global _EMU
    _EMU = Emulator(_FORKED[0].spec, _FORKED[2])


def _fork_run(workload: str, knobs):
    mc, tasks, _ = _FORKED
    return _lower_and_run(mc, tasks[workload], knobs, _EMU)


_EMU = None


class RunnerMeasurer:
    """An ``edgetvm.runner`` (``tracker://HOST:PORT/KEY``, ``rpc://``...): candidates are
    lowered here, each run twice (the kernel once and twice), spread over the runner's
    servers by ``run_many``."""

    def __init__(self, mc, runner, profile):
        self.mc, self.runner, self.profile = mc, runner, profile

    def measure(self, task, batch: list) -> list:
        from edgetvm.runner import RunJob
        t0 = time.time()
        lowered, runs = [], []
        for kn in batch:
            try:
                j = lower_candidate(self.mc, task, kn)
            except Exception as e:                     # noqa: BLE001 - rejected or failed
                lowered.append(e)
                continue
            lowered.append(len(runs))
            twice = kernel_program(j.kernel, j.graph, self.mc.spec, copies=2)
            runs += [RunJob(j.program, {}, j.params, self.profile),
                     RunJob(twice, {}, j.params, self.profile)]
        res = self.runner.run_many(runs, return_exceptions=True) if runs else []
        wall = (time.time() - t0) / max(1, len(batch))
        out = []
        for x in lowered:
            if isinstance(x, BaseException):
                out.append((x, wall))
                continue
            once, twice = res[x], res[x + 1]
            bad = next((r for r in (once, twice) if isinstance(r, BaseException)), None)
            if bad is not None:
                out.append((bad, wall))
                continue
            a, b = once.counters, twice.counters
            out.append((Measurement(
                int(b["total_cycles"] - a["total_cycles"]),
                int(b["dram_read_bytes"] + b["dram_write_bytes"]
                    - a["dram_read_bytes"] - a["dram_write_bytes"]),
                float(b["peak_power_mw"])), wall))
        return out

    def close(self) -> None:
        self.runner.close()
