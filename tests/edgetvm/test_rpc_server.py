"""The emulator server under abuse: never silently dead, never a remote shell, bounded in
what a request may cost.

Every test probes a real ``python -m edgetvm.rpc_server`` on loopback the way a local
client would (raw sockets, TVM's own client, edgetvm's runner) and then checks that a
valid client is still served correctly."""
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
from rpc_helpers import (KEY, SPEC, expect_listening, free_port, gemm_inputs, gemm_program,
                         reference, start_server, start_tracker, stop,
                         wait_for_free_servers, wait_for_port)

from edgetvm import rpc_protocol
from edgetvm.errors import EdgeTVMError, RequestRefused
from edgetvm.rpc_protocol import recv_frame, send_frame, unpack_message
from edgetvm.runner import RPCRunner, RunnerConnectionError, TrackerRunner
from edgetvm.runner.rpc import _RPCChannel
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.isa import DmaLoad, DmaStore

FAST = ["--handshake-timeout", "1", "--idle-timeout", "2"]


def _server(*extra):
    port = free_port()
    proc = start_server(port, *extra)
    expect_listening(proc, port)
    return port, proc


@pytest.fixture
def server():
    port, proc = _server(*FAST, "--max-request-mb", "8", "--max-tensor-mb", "64")
    yield port, proc
    stop([proc])


def _still_serves(port, timeout=10):
    """A valid client gets a correct answer within ``timeout`` seconds."""
    inputs = gemm_inputs(7)
    t0 = time.monotonic()
    with RPCRunner("127.0.0.1", port, SPEC, key=KEY, connect_timeout=timeout) as runner:
        out = runner.run(gemm_program(), inputs).outputs["C"]
    np.testing.assert_allclose(out, reference(inputs), rtol=1e-5, atol=1e-4)
    return time.monotonic() - t0


def _raw(port, data: bytes, close=True):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(data)
    if close:
        time.sleep(0.1)
        s.close()
    return s


def _handshake(key: bytes, length=None):
    n = len(key) if length is None else length
    return struct.pack("<ii", rpc_protocol.RPC_MAGIC, n) + key


def test_protocol_constants_are_tvms():
    from tvm.rpc import base
    assert rpc_protocol.RPC_MAGIC == base.RPC_MAGIC
    assert rpc_protocol.RPC_TRACKER_MAGIC == base.RPC_TRACKER_MAGIC
    assert rpc_protocol.RPC_CODE_SUCCESS == base.RPC_CODE_SUCCESS
    assert rpc_protocol.RPC_CODE_MISMATCH == base.RPC_CODE_MISMATCH
    for name in ("FAIL", "SUCCESS", "PING", "STOP", "PUT", "REQUEST", "UPDATE_INFO",
                 "SUMMARY", "GET_PENDING_MATCHKEYS"):
        assert getattr(rpc_protocol.TrackerCode, name) == getattr(base.TrackerCode, name)


# -- silently dead -------------------------------------------------------------------------
@pytest.mark.parametrize("data", [
    _handshake(b""),                                   # empty key
    _handshake(b"   "),                                # blank key
    _handshake(b"\xff\xfe\xfa"),                       # not UTF-8
    _handshake(b"", length=-5),                        # negative key length
    _handshake(b"", length=1 << 30),                   # a 1 GiB key
    struct.pack("<i", 12345) + b"junk",                # wrong magic
    _handshake(b"client:" + KEY.encode()) [:6],        # half a handshake, then closed
], ids=["empty", "blank", "non-utf8", "negative", "huge", "magic", "torn"])
def test_malformed_handshake_closes_that_connection_only(server, data):
    port, proc = server
    _raw(port, data)
    assert _still_serves(port) < 5
    assert proc.poll() is None


def test_silent_connection_does_not_block_others(server):
    port, _ = server
    idle = _raw(port, b"", close=False)       # connects, never says anything
    try:
        assert _still_serves(port) < 5        # handshake timeout 1 s
    finally:
        idle.close()


def test_idle_session_ends_after_the_idle_timeout(server):
    port, _ = server
    holder = RPCRunner("127.0.0.1", port, SPEC, key=KEY)    # a session that does nothing
    try:
        t = _still_serves(port, timeout=15)                  # waits for the 2 s idle timeout
        assert 1.5 < t < 10
        with pytest.raises(RunnerConnectionError):           # the idle session was closed
            holder.run(gemm_program(), gemm_inputs(1))
    finally:
        holder.close()


def test_killed_session_is_reaped_and_the_server_goes_on(server):
    port, proc = server
    runner = RPCRunner("127.0.0.1", port, SPEC, key=KEY)
    session = runner.run(gemm_program(), gemm_inputs(2)).server.session_pid
    assert psutil.Process(session).ppid() == proc.pid
    os.kill(session, signal.SIGKILL)
    with pytest.raises(RunnerConnectionError, match=f"127.0.0.1:{port}"):
        runner.run(gemm_program(), gemm_inputs(2))
    runner.close()
    for _ in range(2):                        # twice: the listener survived, not just once
        assert _still_serves(port) < 5
    assert proc.poll() is None


def test_frozen_session_times_out_on_the_client(server):
    port, _ = server
    runner = RPCRunner("127.0.0.1", port, SPEC, key=KEY, call_timeout=1.5)
    session = runner.run(gemm_program(), gemm_inputs(3)).server.session_pid
    os.kill(session, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunnerConnectionError, match="within 1.5 s"):
            runner.run(gemm_program(), gemm_inputs(3))
        assert time.monotonic() - t0 < 5
    finally:
        os.kill(session, signal.SIGKILL)
        runner.close()
    assert _still_serves(port) < 5


def test_sessions_end_with_the_launcher():
    port, proc = _server(*FAST)
    try:
        runner = RPCRunner("127.0.0.1", port, SPEC, key=KEY)
        session = runner.run(gemm_program(), gemm_inputs(4)).server.session_pid
        os.kill(proc.pid, signal.SIGKILL)                    # the launcher, not its group
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(session) and psutil.Process(session).status() != "zombie":
            assert time.monotonic() < deadline, "the session outlived its launcher"
            time.sleep(0.1)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        runner.close()
    finally:
        stop([proc])


def test_a_dead_tracker_does_not_kill_its_servers():
    tport, port = free_port(), free_port()
    tracker = start_tracker(tport)
    srv = start_server(port, *FAST, "--tracker", f"127.0.0.1:{tport}")
    try:
        expect_listening(srv, port)
        wait_for_free_servers(tport, 1)
        stop([tracker])                                # the tracker goes away ...
        time.sleep(3)
        assert srv.poll() is None                      # ... the server stays up
        tracker = start_tracker(tport)                 # and registers again when it is back
        wait_for_free_servers(tport, 1)
        with TrackerRunner("127.0.0.1", tport, KEY, SPEC) as runner:
            inputs = gemm_inputs(5)
            np.testing.assert_allclose(runner.run(gemm_program(), inputs).outputs["C"],
                                       reference(inputs), rtol=1e-5, atol=1e-4)
    finally:
        stop([srv, tracker])


# -- not a remote shell ----------------------------------------------------------------------
def test_tvm_generic_rpc_is_not_served(server):
    # TVM's own client: upload, download, remove, load_module and any global function go
    # through TVM's session protocol, which this server does not speak
    from tvm import rpc
    port, proc = server
    reached = []
    try:
        sess = rpc.connect("127.0.0.1", port, key=KEY, session_timeout=5)
        for call in (lambda: sess.upload(b"x", "../../../tmp/evil"),
                     lambda: sess.download("/etc/hostname"),
                     lambda: sess.remove("/tmp"), lambda: sess.load_module("x.so"),
                     lambda: sess.get_function("runtime.GetDeviceAttr")):
            try:
                call()
                reached.append(call)
            except Exception:  # noqa: BLE001 - any failure is the expected refusal
                pass
    except Exception:  # noqa: BLE001 - the session could not even start: refused
        pass
    assert not reached
    assert not os.path.exists("/tmp/evil")
    assert proc.poll() is None and _still_serves(port) < 5


@pytest.mark.parametrize("call", ["upload", "download", "remove", "load_module",
                                  "tvm.rpc.server.upload", "runtime.GetDeviceAttr", None, 7])
def test_only_emulator_calls_are_answered(server, call):
    port, _ = server
    channel = _RPCChannel.connect("127.0.0.1", port, KEY)
    try:
        with pytest.raises(RequestRefused, match="unknown call"):
            channel._call({"call": call, "path": "/etc/hostname"})
        assert channel.info()["key"] == KEY          # the session goes on after a refusal
    finally:
        channel.close()


def test_a_host_that_does_not_resolve_is_named(capsys):
    from edgetvm.rpc_server import _parse_args
    with pytest.raises(SystemExit):
        _parse_args(["--host", "nosuchhost.invalid", "--port", "9"])
    assert "--host nosuchhost.invalid: cannot resolve it" in capsys.readouterr().err


def test_binding_a_reachable_address_needs_a_flag():
    proc = subprocess.run([sys.executable, "-m", "edgetvm.rpc_server", "--host", "0.0.0.0",
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--allow-remote" in proc.stderr
    port = free_port()
    srv = subprocess.Popen([sys.executable, "-m", "edgetvm.rpc_server", "--host", "0.0.0.0",
                            "--port", str(port), "--allow-remote", "--key", KEY],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        wait_for_port(port, srv)
        assert _still_serves(port) < 5
    finally:
        stop([srv])
        err = srv.stderr.read()
        srv.stderr.close()
    assert "reachable from other machines" in err and "no files, no code" in err


# -- bounded requests --------------------------------------------------------------------------
def _big_output_program(mib):
    b = ProgramBuilder("big", SPEC)
    b.tensor("A", (4, 64), "float16", "input")
    b.tensor("Y", (mib * 1024, 512), "float16", "output")       # mib MiB
    t, e = b.tcm((4, 64), "float16"), b.event()
    b.emit(DmaLoad(dst=t, src=b.dram("A"), channel=0, signal=(e,)))
    b.emit(DmaStore(dst=b.dram("Y", rows=4, cols=64), src=t, wait=(e,)))
    return b.build()


def _refused(port, match, **kwargs):
    channel = _RPCChannel.connect("127.0.0.1", port, KEY)
    try:
        with pytest.raises(RequestRefused, match=match):
            channel._call(**kwargs)
    finally:
        channel.close()


def test_declared_tensors_over_the_limit_are_refused_unrun(server):
    port, proc = server
    with RPCRunner("127.0.0.1", port, SPEC, key=KEY) as runner:
        with pytest.raises(RequestRefused, match="declares .* bytes of DRAM tensors"):
            runner.run(_big_output_program(512), {"A": np.zeros((4, 64), np.float16)})
    assert psutil.Process(proc.pid).memory_info().rss < 400 << 20
    assert _still_serves(port) < 5


def test_arguments_are_type_checked(server):
    port, _ = server
    _refused(port, "program travels", meta={"call": "run"})
    _refused(port, "program travels", meta={"call": "run"},
             arrays={"program": np.array([2 ** 30], np.int64)})
    _refused(port, "runtime parameters must be integers",
             meta={"call": "run", "params": {"n": "1e9"}},
             arrays={"program": np.frombuffer(_program_bytes(), np.uint8)})


def _program_bytes():
    from edgetvm.target import program_format
    return program_format.dumps(gemm_program())


@pytest.mark.parametrize("dtype", ["float64", "complex128", "float32", "int16"])
def test_inputs_of_another_dtype_are_refused_not_cast(server, dtype):
    port, _ = server
    inputs = {k: v.astype(dtype) for k, v in gemm_inputs(6).items()}
    with RPCRunner("127.0.0.1", port, SPEC, key=KEY) as runner:
        with pytest.raises(RequestRefused, match="inputs are not cast"):
            runner.run(gemm_program(), inputs)


@pytest.mark.parametrize("spec", [{"name": "/dev/zero"}, {"name": "/etc/hostname"},
                                  {"name": "../target/presets/edge-npu-16mb"}, "edge-npu-16mb",
                                  {"name": 5}])
def test_specs_are_presets_or_fields_never_paths(server, spec):
    port, _ = server
    _refused(port, "spec|preset", meta={"call": "open", "spec": spec})


def test_client_spec_fields_are_bounded(server):
    port, _ = server
    # over this server's --max-tensor-mb 64 (a valid spec: its TCM is under 1 GiB)
    huge = SPEC.replace(tcm_bytes=1 << 28)
    with pytest.raises(RequestRefused, match="tcm_bytes"):
        RPCRunner("127.0.0.1", port, huge, key=KEY).run(gemm_program(), gemm_inputs(0))
    # past what any spec may declare: refused as a spec
    with pytest.raises(EdgeTVMError, match="tcm_bytes must be <= 1073741824"):
        RPCRunner("127.0.0.1", port, SPEC.replace(tcm_bytes=1 << 40), key=KEY).run(
            gemm_program(), gemm_inputs(0))
    tiny_windows = SPEC.replace(power_window_cycles=1)
    with pytest.raises(RequestRefused, match="power_window_cycles"):
        RPCRunner("127.0.0.1", port, tiny_windows, key=KEY).run(gemm_program(),
                                                                 gemm_inputs(0))


def test_oversized_request_is_refused_before_it_is_read(server):
    port, proc = server
    channel = _RPCChannel.connect("127.0.0.1", port, KEY)
    sock = channel._sock
    # declare a 2 GiB frame and send nothing more: the server answers at once and hangs up
    sock.sendall(struct.pack("<Q", 2 << 30))
    meta, _ = unpack_message(recv_frame(sock, 1 << 20))
    assert meta["error"]["type"] == "RequestRefused" and "--max-request-mb" in \
        meta["error"]["message"]
    channel.close()
    assert psutil.Process(proc.pid).memory_info().rss < 400 << 20
    assert _still_serves(port) < 5


def test_compressed_arrays_are_refused(server):
    # a small request whose arrays are stored compressed would inflate on the server
    port, _ = server
    buf = io.BytesIO()
    np.savez_compressed(buf, **{"in/A": np.zeros((1 << 22,), np.float16)})   # 8 MiB of zeros
    header = json.dumps({"call": "info"}).encode()
    crafted = rpc_protocol._HEADER.pack(b"EDGW", rpc_protocol.PROTOCOL_VERSION,
                                        len(header)) + header + buf.getvalue()
    assert len(crafted) < 100_000
    channel = _RPCChannel.connect("127.0.0.1", port, KEY)
    try:
        channel._sock.settimeout(10)
        send_frame(channel._sock, crafted)
        meta, _ = unpack_message(recv_frame(channel._sock, 1 << 20))
        assert meta["error"]["type"] == "RequestRefused"
        assert "compressed" in meta["error"]["message"]
    finally:
        channel.close()


def test_twenty_clients_five_runs_each_through_a_tracker():
    tport, ports = free_port(), [free_port(), free_port()]
    tracker = start_tracker(tport)
    servers = [start_server(p, "--tracker", f"127.0.0.1:{tport}") for p in ports]
    errors, done = [], []
    try:
        for p, s in zip(ports, servers):
            expect_listening(s, p)
        wait_for_free_servers(tport, 2)

        def client(c):
            try:
                with TrackerRunner("127.0.0.1", tport, KEY, SPEC, request_timeout=120) as r:
                    for i in range(5):
                        inputs = gemm_inputs(100 * c + i)
                        out = r.run(gemm_program(), inputs).outputs["C"]
                        np.testing.assert_allclose(out, reference(inputs), rtol=1e-5,
                                                   atol=1e-4)
                        done.append((c, i))
            except Exception as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
        threads = [threading.Thread(target=client, args=(c,)) for c in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors[:3]
        assert len(done) == 100
    finally:
        stop(servers + [tracker])
