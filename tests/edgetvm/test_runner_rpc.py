"""The runners against real servers started the way users start them.

Servers are ``python -m edgetvm.rpc_server`` subprocesses (own process group, stopped by
group at teardown) on free loopback ports; the tracker is TVM's ``python -m
tvm.exec.rpc_tracker``.
A server runs one session at a time, so every test closes its runner (``with``) before the
next one connects.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
from rpc_helpers import (KEY, SPEC, accumulate_program, expect_listening, free_port,
                         gemm_inputs, gemm_program, reference, start_server, start_tracker,
                         stop, wait_for_free_servers)

from edgetvm.errors import EdgeTVMError, InvalidProgramError
from edgetvm.runner import (LocalRunner, RPCRunner, RunJob, RunnerConnectionError, RunnerError,
                            TrackerRunner, connect)


@pytest.fixture(scope="module")
def cluster():
    """A standalone server, plus a tracker with two servers registered under KEY."""
    port, tport, ports = free_port(), free_port(), [free_port(), free_port()]
    procs = []
    try:
        procs.append(start_server(port))
        procs.append(start_tracker(tport))
        tracked = [start_server(p, "--tracker", f"127.0.0.1:{tport}") for p in ports]
        procs += tracked
        expect_listening(procs[0], port)
        for p, proc in zip(ports, tracked):
            expect_listening(proc, p)
        wait_for_free_servers(tport, 2)
        yield {"port": port, "tracker_port": tport, "tracked": tracked}
    finally:
        stop(procs)


# ----------------------------------------------------------------------------------------
# one server
# ----------------------------------------------------------------------------------------
def test_gemm_matches_numpy_and_local_counters(cluster):
    program, inputs = gemm_program(), gemm_inputs(0)
    local = LocalRunner(SPEC).run(program, inputs)
    with RPCRunner("127.0.0.1", cluster["port"], SPEC, key=KEY) as runner:
        info = runner.info()
        remote = runner.run(program, inputs, trace=True)
        low = runner.run(program, inputs, profile="low-battery")
        assert runner.run(program, inputs).counters == remote.counters  # profile is per run
    assert low.counters == LocalRunner(SPEC).run(program, inputs, profile="low-battery").counters
    assert low.counters["profile"] == "low-battery" != remote.counters["profile"]
    np.testing.assert_allclose(remote.outputs["C"], reference(inputs), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(remote.outputs["C"], local.outputs["C"])
    assert remote.counters == local.counters  # the emulator is deterministic
    assert remote.counters["total_cycles"] > 0 and remote.counters["macs"] == 32 * 32 * 64
    assert [e.index for e in remote.trace][:2] == [0, 1]
    assert remote.server.address == f"127.0.0.1:{cluster['port']}"
    assert remote.server.pid == info["server_pid"] != os.getpid()
    assert info["default_spec"] == SPEC.name and SPEC.name in info["specs"]
    assert info["edgetvm_version"] and info["key"] == KEY


def test_custom_spec_reaches_the_server(cluster):
    slow = SPEC.replace(clock_mhz=SPEC.clock_mhz / 2)
    program, inputs = gemm_program(), gemm_inputs(1)
    with connect(f"rpc://127.0.0.1:{cluster['port']}/{KEY}", spec=slow) as runner:
        remote = runner.run(program, inputs)
    assert remote.counters == LocalRunner(slow).run(program, inputs).counters
    assert remote.counters["time_us"] == pytest.approx(
        2 * LocalRunner(SPEC).run(program, inputs).counters["time_us"])


def test_state_persists_within_one_session_only(cluster):
    program, inputs = accumulate_program(), gemm_inputs(2, 16, 16, 32)
    once = reference(inputs)
    with RPCRunner("127.0.0.1", cluster["port"], SPEC, key=KEY) as runner:
        np.testing.assert_allclose(runner.run(program, inputs).outputs["y"], once, rtol=1e-5)
        np.testing.assert_allclose(runner.run(program, inputs).outputs["y"], 2 * once, rtol=1e-5)
        np.testing.assert_allclose(runner.state()["S"], 2 * once, rtol=1e-5)
        with runner.device() as other:  # a second device has its own state
            np.testing.assert_allclose(other.run(program, inputs).outputs["y"], once, rtol=1e-5)
        fresh = runner.run_many([RunJob(program, inputs)])[0]  # jobs run on fresh state
        np.testing.assert_allclose(fresh.outputs["y"], once, rtol=1e-5)
        old_handle = runner._default.handle
    # a new session is a new fork of the server: clean device, old handles refused
    with RPCRunner("127.0.0.1", cluster["port"], SPEC, key=KEY) as runner:
        np.testing.assert_allclose(runner.run(program, inputs).outputs["y"], once, rtol=1e-5)
        with pytest.raises(EdgeTVMError, match="unknown device handle"):
            runner._channel().run(RunJob(program, inputs), None, old_handle)


def test_refused_program_reports_command_index(cluster):
    program, inputs = gemm_program(broken=True), gemm_inputs(3)
    with pytest.raises(InvalidProgramError) as local:
        LocalRunner(SPEC).run(program, inputs)
    with RPCRunner("127.0.0.1", cluster["port"], SPEC, key=KEY) as runner:
        with pytest.raises(InvalidProgramError) as remote:
            runner.run(program, inputs)
        assert str(remote.value) == str(local.value)
        assert remote.value.command_index == 2 and str(remote.value).startswith("command 2:")
        assert "RPCError" not in str(remote.value)
        # the session survives a refused program; run_many can keep failures in their slots
        ok, bad = runner.run_many([(gemm_program(), inputs), (program, inputs)],
                                  return_exceptions=True)
    np.testing.assert_allclose(ok.outputs["C"], reference(inputs), rtol=1e-5, atol=1e-4)
    assert isinstance(bad, InvalidProgramError) and bad.command_index == 2


def test_connection_errors_name_the_address(cluster):
    port = free_port()
    with pytest.raises(RunnerConnectionError, match=f"127.0.0.1:{port}"):
        RPCRunner("127.0.0.1", port, SPEC, key=KEY)
    with pytest.raises(RunnerConnectionError, match="refused key 'wrong'"):
        RPCRunner("127.0.0.1", cluster["port"], SPEC, key="wrong")
    with pytest.raises(RunnerConnectionError, match=f"tracker at 127.0.0.1:{port}"):
        connect(f"tracker://127.0.0.1:{port}/{KEY}")
    with pytest.raises(RunnerError, match="scheme"):
        connect("http://127.0.0.1:9190")


def test_cli_rejects_bad_arguments():
    for args, message in ((["--port", "0"], "out of range"), (["--spec", "nope"], "nope"),
                          (["--tracker", "nohost"], "HOST:PORT")):
        proc = subprocess.run([sys.executable, "-m", "edgetvm.rpc_server", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ----------------------------------------------------------------------------------------
# tracker + two servers
# ----------------------------------------------------------------------------------------
def test_held_sessions_serve_batch_after_batch(cluster):
    """``hold_sessions`` (the tuner's runner): the second ``run_many`` runs on the session
    of the first, with no tracker request (opening one waits for the server to
    re-register, 0.43 s a batch); a held session that ended meanwhile is replaced by a
    fresh one and its job runs there, not failed. ``close`` frees the servers."""
    shapes = [(32, 32, 64), (64, 32, 32), (16, 16, 64)]
    jobs = [RunJob(gemm_program(*s), gemm_inputs(i, *s)) for i, s in enumerate(shapes)]
    tport = cluster["tracker_port"]
    runner = TrackerRunner("127.0.0.1", tport, KEY, SPEC, max_workers=1, hold_sessions=True)
    requests = []
    new_request = runner._new_request
    runner._new_request = lambda: requests.append(1) or new_request()
    with runner:
        first = runner.run_many(jobs)
        second = runner.run_many(jobs)
        assert len(requests) == 1
        sessions = {r.server.session_pid for r in first + second}
        assert len(sessions) == 1
        runner._held[0].close()                 # the held session ends behind its back
        third = runner.run_many(jobs)
        assert len(requests) == 2
        assert {r.server.session_pid for r in third}.isdisjoint(sessions)
        for results in (first, second, third):
            for job, res in zip(jobs, results):
                np.testing.assert_allclose(res.outputs["C"], reference(job.inputs),
                                           rtol=1e-5, atol=1e-4)
    wait_for_free_servers(tport, 2)             # close() ended the held session


def test_tracker_run_many_spreads_over_both_servers(cluster):
    shapes = [(32, 32, 64), (64, 32, 32), (32, 64, 32), (16, 16, 64)] * 2
    jobs = [RunJob(gemm_program(*s), gemm_inputs(i, *s)) for i, s in enumerate(shapes)]
    with connect(f"tracker://127.0.0.1:{cluster['tracker_port']}/{KEY}", spec=SPEC) as runner:
        assert isinstance(runner, TrackerRunner)
        assert runner.servers()["total"] == 2  # run_many opens one session per server
        results = runner.run_many(jobs)
    for job, res in zip(jobs, results):
        np.testing.assert_allclose(res.outputs["C"], reference(job.inputs), rtol=1e-5, atol=1e-4)
    assert results[0].counters == LocalRunner(SPEC).run(jobs[0].program, jobs[0].inputs).counters
    # a server's pid is its `python -m edgetvm.rpc_server` process (the listener); each
    # session is a child of it
    launchers = {p.pid for p in cluster["tracked"]}
    used = {r.server.pid for r in results}
    assert used == launchers, used
    assert {r.server.session_pid for r in results}.isdisjoint(launchers)
