"""Helpers of the RPC tests: small programs with a numpy reference, and real server and
tracker processes (own process group, stopped by group at teardown) on free loopback ports."""
import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.isa import DmaLoad, DmaStore, Mma
from edgetvm.target.spec import load_spec

SPEC = load_spec("edge-npu-16mb")
KEY = "edgetvm-test"
START_TIMEOUT = 30


# ----------------------------------------------------------------------------------------
# programs
# ----------------------------------------------------------------------------------------
def gemm_program(m=32, n=32, k=64, broken=False):
    """C = A @ B: DMA A and B into the TCM on two channels, one MMA, DMA C back.

    ``broken`` makes the MMA (command 2) wait on an event nobody signals.
    """
    b = ProgramBuilder(f"gemm_{m}x{n}x{k}", SPEC)
    b.tensor("A", (m, k), "float16", "input")
    b.tensor("B", (k, n), "float16", "input")
    b.tensor("C", (m, n), "float32", "output")
    ta, tb, tc = b.tcm((m, k), "float16"), b.tcm((k, n), "float16"), b.tcm((m, n), "float32")
    ea, eb, ec = b.event(), b.event(), b.event()
    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=0, signal=(ea,)))
    b.emit(DmaLoad(dst=tb, src=b.dram("B"), channel=1, signal=(eb,)))
    b.emit(Mma(out=tc, a=ta, b=tb, wait=(ea, eb, 99) if broken else (ea, eb), signal=(ec,)))
    b.emit(DmaStore(dst=b.dram("C"), src=tc, wait=(ec,)))
    return b.build()


def accumulate_program(m=16, n=16, k=32):
    """S += A @ B with S a persistent ``state`` tensor (a KV-cache stand-in); y = S."""
    b = ProgramBuilder("accumulate", SPEC)
    b.tensor("A", (m, k), "float16", "input")
    b.tensor("B", (k, n), "float16", "input")
    b.tensor("S", (m, n), "float32", "state")
    b.tensor("y", (m, n), "float32", "output")
    ta, tb, ts = b.tcm((m, k), "float16"), b.tcm((k, n), "float16"), b.tcm((m, n), "float32")
    ea, eb, es, em, ew = (b.event() for _ in range(5))
    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=0, signal=(ea,)))
    b.emit(DmaLoad(dst=tb, src=b.dram("B"), channel=1, signal=(eb,)))
    b.emit(DmaLoad(dst=ts, src=b.dram("S"), channel=0, signal=(es,)))
    b.emit(Mma(out=ts, a=ta, b=tb, accumulate=True, wait=(ea, eb, es), signal=(em,)))
    b.emit(DmaStore(dst=b.dram("S"), src=ts, channel=0, wait=(em,), signal=(ew,)))
    b.emit(DmaStore(dst=b.dram("y"), src=ts, channel=0, wait=(ew,)))
    return b.build()


def gemm_inputs(seed, m=32, n=32, k=64):
    rng = np.random.default_rng(seed)
    return {"A": rng.standard_normal((m, k)).astype("float16"),
            "B": rng.standard_normal((k, n)).astype("float16")}


def reference(inputs):
    # fp16 operands, fp32 accumulation: what the matrix unit computes
    return inputs["A"].astype(np.float32) @ inputs["B"].astype(np.float32)


# ----------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, proc, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"process exited with {proc.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing answers on 127.0.0.1:{port}")


def read_line(proc, timeout=START_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            return proc.stdout.readline()
        assert proc.poll() is None, f"server exited with {proc.returncode}"
    raise TimeoutError("server printed nothing")


def stop(procs):
    for p in procs:  # only the process groups these tests created (start_new_session)
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        if p.stdout:
            p.stdout.close()


def start_server(port, *extra):
    cmd = [sys.executable, "-m", "edgetvm.rpc_server", "--host", "127.0.0.1",
           "--port", str(port), "--key", KEY, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)


def expect_listening(proc, port):
    line = read_line(proc)
    assert line.startswith(f"listening on 127.0.0.1:{port} (key {KEY}"), line
    wait_for_port(port, proc)


def wait_for_free_servers(tracker_port, n, timeout=START_TIMEOUT):
    from tvm import rpc    # TVM's own tracker client: the servers speak its protocol
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tracker = rpc.connect_tracker("127.0.0.1", tracker_port)
        free = tracker.summary()["queue_info"].get(KEY, {}).get("free", 0)
        tracker.close()
        if free >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"tracker did not see {n} free servers")


def start_tracker(port):
    proc = subprocess.Popen([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", "127.0.0.1",
                             "--port", str(port), "--port-end", str(port + 1), "--silent"],
                            start_new_session=True)
    wait_for_port(port, proc)
    return proc
