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

import concurrent.futures as cf
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
    """``workers`` local emulator processes (spawned; each holds its own Emulator)."""

    def __init__(self, spec, profile, workers: int, timeout: float):
        import multiprocessing as mp
        self.timeout = timeout
        self.pool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                           initializer=_worker_init,
                                           initargs=(spec.to_dict(), profile))

    def measure(self, jobs: list) -> list:
        futs = [self.pool.submit(_worker_run, j.program, j.params) for j in jobs]
        out = []
        for f in futs:
            try:
                out.append(f.result(timeout=self.timeout))
            except cf.TimeoutError:
                f.cancel()
                out.append(TimeoutError(f"no result after {self.timeout:.0f} s"))
            except Exception as e:                     # noqa: BLE001
                out.append(e)
        return out

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


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
