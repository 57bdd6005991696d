"""Emulator servers behind a TVM RPC tracker: measured jobs per second with 1 and N servers.

Starts TVM's tracker (``python -m tvm.exec.rpc_tracker``) and ``python -m
edgetvm.rpc_server`` processes on loopback, runs the same batch of independent jobs
(matrix-unit-heavy programs: the emulator's MMAs are numpy matmuls, so BLAS threads
matter) with ``TrackerRunner.run_many`` against 1 server and against N, and prints jobs
per second, the speed-up, and which servers ran the jobs. Every output is checked against
numpy; the script exits 1 on a wrong result.

    python benchmarks/rpc_throughput.py [--quick] [--json PATH] [--servers N] [--jobs J]

On a machine with N free cores, N servers should give about N times one server's rate;
each server pins its math library to one thread so they do not oversubscribe the cores.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import signal
import socket
import subprocess
import sys
import time

from pathlib import Path

import numpy as np

from edgetvm.runner import RunJob, TrackerRunner
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.isa import DmaLoad, DmaStore, Mma
from edgetvm.target.spec import load_spec
from report import write_json

SPEC = load_spec("edge-npu-16mb")
KEY = "edgetvm-bench"


def mma_program(n: int, repeats: int):
    """C = A @ B computed ``repeats`` times over: one load of each operand, many MMAs."""
    b = ProgramBuilder(f"mma_{n}x{repeats}", SPEC)
    b.tensor("A", (n, n), "float16", "input")
    b.tensor("B", (n, n), "float16", "input")
    b.tensor("C", (n, n), "float32", "output")
    ta, tb, tc = b.tcm((n, n), "float16"), b.tcm((n, n), "float16"), b.tcm((n, n), "float32")
    ea, eb = b.event(), b.event()
    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=0, signal=(ea,)))
    b.emit(DmaLoad(dst=tb, src=b.dram("B"), channel=1, signal=(eb,)))
    done = None
    for i in range(repeats):
        e = b.event()
        b.emit(Mma(out=tc, a=ta, b=tb, wait=(ea, eb) if i == 0 else (done,), signal=(e,)))
        done = e
    b.emit(DmaStore(dst=b.dram("C"), src=tc, wait=(done,)))
    return b.build()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def _start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True)


def _stop(procs) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        p.wait(timeout=20)


@contextlib.contextmanager
def tracker_with(n_servers: int):
    """A TVM tracker on loopback with ``n_servers`` registered emulator servers; yields
    the tracker's port."""
    tport = _free_port()
    procs = [_start([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                     "--port", str(tport), "--port-end", str(tport + 1), "--silent"])]
    try:
        _wait_port(tport)
        for _ in range(n_servers):
            port = _free_port()
            procs.append(_start([sys.executable, "-m", "edgetvm.rpc_server", "--port",
                                 str(port), "--key", KEY, "--tracker", f"127.0.0.1:{tport}"]))
            _wait_port(port)
        with TrackerRunner("127.0.0.1", tport, KEY, SPEC) as runner:
            deadline = time.monotonic() + 30
            while runner.servers()["free"] < n_servers:
                if time.monotonic() > deadline:
                    raise TimeoutError("servers did not register with the tracker")
                time.sleep(0.2)
        yield tport
    finally:
        _stop(procs)


def measure(n_servers: int, jobs: list) -> dict:
    with tracker_with(n_servers) as tport:
        with TrackerRunner("127.0.0.1", tport, KEY, SPEC) as runner:
            t0 = time.perf_counter()
            results = runner.run_many(jobs)
            wall = time.perf_counter() - t0
    wrong = 0
    for job, res in zip(jobs, results):
        ref = job.inputs["A"].astype(np.float32) @ job.inputs["B"].astype(np.float32)
        wrong += not np.allclose(res.outputs["C"], ref, rtol=1e-4, atol=1e-3)
    return {"servers": n_servers, "jobs": len(jobs), "wall_s": round(wall, 2),
            "jobs_per_s": round(len(jobs) / wall, 3),
            "servers_used": len({r.server.pid for r in results}),
            "emulator_s_per_job": round(float(np.mean([r.run_s for r in results])), 3),
            "wrong_results": wrong}


def measure_tuner(n_servers: int, trials: int, batch: int) -> dict:
    """The tuner measuring ``trials`` kernel candidates (``cuts=False``: the same tasks
    for every server count) of the bundled example's decode program on the tracker's
    servers: with N > 1 servers, N local workers (``--workers N``) each lower their
    candidates and run them on a server session of their own; candidates per minute of
    tuning (after the front end, which is the same for any number of servers). Every
    seventh logged measurement is checked against a local one."""
    from edgetvm.build.compiler import ModelCompiler
    from edgetvm.target.emulator import Emulator
    from edgetvm.tune.cli import tune
    from edgetvm.tune.log import FAILED, TuningLog
    from edgetvm.tune.measure import measure_candidate
    from edgetvm.tune.tasks import extract_tasks

    model = str(Path(__file__).resolve().parent.parent / "examples" /
                "llama_tiny_with_past.onnx")
    phases = ["decode_1x64p"]
    with tempfile.TemporaryDirectory() as d, tracker_with(n_servers) as tport:
        rep = tune(model, phases=phases, trials=trials, log_dir=d, batch=batch,
                   rpc_tracker=f"127.0.0.1:{tport}", rpc_key=KEY, validate=False,
                   progress=False, seed=0, workers=n_servers, cuts=False)
        wall = rep["seconds"]            # the tuning, not the front end before it
        recs = TuningLog(d).records()
    mc = ModelCompiler(model)
    tasks = {t.workload: t for t in extract_tasks(mc, [("decode", 1, 64)])}
    emu = Emulator(mc.spec)
    wrong = sum(measure_candidate(mc, tasks[r.workload], r.knobs, emu).cycles != r.cycles
                for r in recs[::7] if r.cycles is not None)
    return {"servers": n_servers, "jobs": rep["measured"], "wall_s": round(wall, 2),
            "jobs_per_s": round(rep["measured"] / wall, 3),
            "candidates_per_min": round(60 * rep["measured"] / wall, 1),
            "failed": sum(r.status == FAILED for r in recs), "wrong_results": wrong}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true", help="fewer, shorter jobs")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--servers", type=int, default=2, help="the N of the comparison")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--tuner", action="store_true",
                    help="tuner candidates per minute (the bundled example's decode "
                         "kernels, lowered here, run on the servers) instead of raw jobs")
    args = ap.parse_args(argv)
    if args.tuner:
        return main_tuner(args)
    n_jobs = args.jobs or (8 if args.quick else 24)
    program = mma_program(512, 16 if args.quick else 48)
    rng = np.random.default_rng(0)
    jobs = [RunJob(program, {"A": rng.standard_normal((512, 512)).astype(np.float16),
                             "B": rng.standard_normal((512, 512)).astype(np.float16)})
            for _ in range(n_jobs)]
    print(f"{n_jobs} jobs, each {len(program.commands) - 3} MMAs of 512x512x512; "
          f"{os.cpu_count()} CPUs")
    return compare(
        args, lambda n: measure(n, jobs),
        f"{'servers':>7} {'wall_s':>7} {'jobs/s':>7} {'used':>5} {'emu_s/job':>9} {'wrong':>5}",
        lambda r: f"{r['servers']:>7} {r['wall_s']:>7} {r['jobs_per_s']:>7} "
                  f"{r['servers_used']:>5} {r['emulator_s_per_job']:>9} {r['wrong_results']:>5}",
        "throughput", "an output differs from numpy", {})


def compare(args, measure_one, header: str, line, what: str, wrong: str, extra: dict) -> int:
    """Measure with 1 and ``args.servers`` servers, print the rows and the ratio, write
    the JSON; 1 when a row has a wrong result."""
    print(header)
    rows = []
    for n in (1, args.servers):
        rows.append(measure_one(n))
        print(line(rows[-1]), flush=True)
    speedup = rows[1]["jobs_per_s"] / rows[0]["jobs_per_s"]
    print(f"{what} with {args.servers} servers / 1 server: {speedup:.2f}x")
    if args.json:
        write_json(args.json, {**extra, "rows": rows, "speedup": round(speedup, 3),
                               "cpus": os.cpu_count()})
    if any(r["wrong_results"] for r in rows):
        print(f"WRONG RESULT: {wrong}", file=sys.stderr)
        return 1
    return 0


def main_tuner(args) -> int:
    trials = args.jobs or (32 if args.quick else 96)
    print(f"tuner: {trials} candidates of the bundled example's decode kernels, batches of "
          f"{4 * args.servers}; {os.cpu_count()} CPUs")
    return compare(
        args, lambda n: measure_tuner(n, trials, 4 * args.servers),
        f"{'servers':>7} {'wall_s':>7} {'cand/min':>8} {'failed':>6} {'wrong':>5}",
        lambda r: f"{r['servers']:>7} {r['wall_s']:>7} {r['candidates_per_min']:>8} "
                  f"{r['failed']:>6} {r['wrong_results']:>5}",
        "candidates per minute", "a logged measurement differs from a local one",
        {"mode": "tuner"})


if __name__ == "__main__":
    sys.exit(main())
