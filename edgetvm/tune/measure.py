"""Where candidates are measured: in this process, on a pool of local emulator processes,
or on emulator servers behind a TVM RPC tracker.

Every measurer returns, per job, the steady-state cost of the kernel (see
:mod:`edgetvm.tune.tasks`): the second of two back-to-back runs on one emulator timeline.
Locally that is two :meth:`Timeline.run` calls; a runner (``edgetvm.runner``) runs every
job on a fresh timeline, so there the kernel is linked twice into one program (a
``Launch`` before each copy, as between two runs on one timeline) and the cost is that
program's cycles minus the single copy's: the same cycle count, exactly (the tests check
it). A job that raises, times out or loses its server comes back as its exception: a
failed trial, and the tuner goes on.
"""
from __future__ import annotations

from dataclasses import dataclass

from edgetvm.target.emulator import Emulator

from .tasks import kernel_program, run_steady


@dataclass(frozen=True)
class Measurement:
    cycles: int
    dram_bytes: int
    peak_power_mw: float


@dataclass
class Job:
    """One candidate, lowered: its program (the kernel alone) and runtime parameters, and
    the kernel and phase graph it was relocated from."""

    program: object
    params: dict
    kernel: object
    graph: object


def _from_counters(c) -> Measurement:
    return Measurement(int(c.total_cycles), int(c.dram_read_bytes + c.dram_write_bytes),
                       float(c.peak_power_mw))


class LocalMeasurer:
    """In this process, one job after another."""

    def __init__(self, spec, profile):
        self.emulator = Emulator(spec, profile)

    def measure(self, jobs: list) -> list:
        out = []
        for j in jobs:
            try:
                out.append(_from_counters(run_steady(self.emulator, j.program, j.params)))
            except Exception as e:                     # noqa: BLE001 - a failed trial
                out.append(e)
        return out

    def close(self) -> None:
        pass


class PoolMeasurer:
    """``workers`` local emulator processes (spawned; each holds its own Emulator). A job
    past ``timeout`` seconds is a failed trial; its worker is stopped with the rest of the
    pool after the batch (a hung emulator holds nothing up after that)."""

    def __init__(self, spec, profile, workers: int, timeout: float):
        self.spec, self.profile = spec.to_dict(), profile
        self.workers, self.timeout = int(workers), float(timeout)
        self.pool = None

    def _start(self):
        import multiprocessing as mp
        if self.pool is None:
            self.pool = mp.get_context("spawn").Pool(self.workers, initializer=_worker_init,
                                                     initargs=(self.spec, self.profile))
        return self.pool

    def measure(self, jobs: list) -> list:
        import multiprocessing as mp
        pool = self._start()
        pending = [pool.apply_async(_worker_run, (j.program, j.params)) for j in jobs]
        out, hung = [], False
        for r in pending:
            try:
                out.append(r.get(timeout=self.timeout))
            except mp.TimeoutError:
                hung = True
                out.append(TimeoutError(f"no result after {self.timeout:g} s"))
            except Exception as e:                     # noqa: BLE001
                out.append(e)
        if hung:
            self.close()                               # the next batch gets fresh workers
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


class RunnerMeasurer:
    """An ``edgetvm.runner`` (``tracker://HOST:PORT/KEY``, ``rpc://``...): each job is two
    runs, the kernel once and twice, spread over the runner's servers by ``run_many``."""

    def __init__(self, runner, spec, profile):
        self.runner, self.spec, self.profile = runner, spec, profile

    def measure(self, jobs: list) -> list:
        from edgetvm.runner import RunJob
        runs = []
        for j in jobs:
            twice = kernel_program(j.kernel, j.graph, self.spec, copies=2)
            runs += [RunJob(j.program, {}, j.params, self.profile),
                     RunJob(twice, {}, j.params, self.profile)]
        res = self.runner.run_many(runs, return_exceptions=True)
        out = []
        for once, twice in zip(res[0::2], res[1::2]):
            bad = next((r for r in (once, twice) if isinstance(r, BaseException)), None)
            if bad is not None:
                out.append(bad)
                continue
            a, b = once.counters, twice.counters
            out.append(Measurement(
                int(b["total_cycles"] - a["total_cycles"]),
                int(b["dram_read_bytes"] + b["dram_write_bytes"]
                    - a["dram_read_bytes"] - a["dram_write_bytes"]),
                float(b["peak_power_mw"])))
        return out

    def close(self) -> None:
        self.runner.close()


_EMU = None


def _worker_init(spec: dict, profile) -> None:
    global _EMU
    from edgetvm.target.spec import spec_from_dict
    _EMU = Emulator(spec_from_dict(spec), profile)


def _worker_run(program, params) -> Measurement:
    return _from_counters(run_steady(_EMU, program, params))
