"""The NPU emulator as a server: ``python -m edgetvm.rpc_server``.

Usage::

    python -m edgetvm.rpc_server --port 9190
    python -m edgetvm.rpc_server --port 9200 --port-end 9300 \\
        --tracker 127.0.0.1:9191 --key edgetvm-npu --spec edge-npu-16mb

What a client can do, and what it cannot
----------------------------------------
A client that reaches the port and knows the key can: ask for the server's info (versions,
presets, limits), open and close emulated devices, read a device's state tensors, and run
programs (data: a command stream, input arrays, integer parameters, a spec by preset name
or by its fields) within the server's limits (``--max-request-mb``, ``--max-tensor-mb``).
Nothing else: no files are read or written for a client (a spec is never a path), no code
is loaded, no other function is reachable. Connections speak TVM RPC's handshake (so TVM's
tracker can hand servers out) but not TVM's generic session protocol, which would let any
client upload files, load shared libraries and write raw memory. The server binds
127.0.0.1 unless ``--allow-remote`` is given, which prints what it exposes.

How it serves
-------------
The launcher process is the listener: it accepts a connection, reads the handshake within
``--handshake-timeout`` seconds (a malformed or silent handshake closes that connection
and nothing else), and forks one session process per accepted client. A session answers
requests until the client closes it, stays idle for ``--idle-timeout`` seconds or lasts
``--session-timeout`` seconds; its devices and their state live exactly as long. Sessions
run at most ``--max-sessions`` at a time (default 1: the tracker's model, one session per
server; more servers give more throughput). A session that crashes or is killed is
reaped and the listener goes on; if the listener itself fails, the process exits non-zero
and its sessions die with it (they ask the kernel for that). Each process uses one
math-library thread, so N servers on N cores give about N times one server's throughput.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import select
import signal
import socket
import sys
import time
import traceback

from edgetvm.collector import fewer_collections
from edgetvm.errors import EdgeTVMError, RequestRefused
from edgetvm.rpc_protocol import (CALLS, DEFAULT_KEY, DEFAULT_PORT, MAX_KEY_BYTES,
                                  RPC_CODE_MISMATCH, RPC_CODE_SUCCESS, RPC_MAGIC,
                                  RPC_TRACKER_MAGIC, ProtocolError, TrackerCode,
                                  encode_run_result, error_payload, pack_message,
                                  recv_frame, recv_int, recv_json, recv_key, send_frame,
                                  send_int, send_json, send_key, unpack_message)
from edgetvm.runner.service import DEFAULT_SPEC, MB, EmulatorService, ServiceLimits

DEFAULT_HOST = "127.0.0.1"
_LOOPBACK = ("127.", "::1", "localhost")


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """How long a connection may take, how many sessions run, what a request may cost."""

    handshake_timeout_s: float = 5.0
    idle_timeout_s: float = 120.0
    session_timeout_s: float = 3600.0
    max_sessions: int = 1
    limits: ServiceLimits = ServiceLimits()


# ----------------------------------------------------------------------------------------
# a session: one client, one forked process
# ----------------------------------------------------------------------------------------
def _dispatch(service: EmulatorService, request: bytes) -> bytes:
    """Answer one request frame; every failure becomes an error reply."""
    try:
        meta, arrays = unpack_message(request, service.limits.max_tensor_bytes)
        call = meta.get("call")
        if call not in CALLS:
            raise RequestRefused(f"unknown call {call!r}; this server answers {', '.join(CALLS)}")
        if call == "info":
            return pack_message({"info": service.info()})
        if call == "open":
            return pack_message({"device": service.open_device(meta.get("spec"),
                                                               meta.get("profile"))})
        if call == "close":
            service.close_device(meta.get("device"))
            return pack_message({})
        if call == "state":
            return pack_message({}, service.device_state(meta.get("device")))
        program = arrays.pop("program", None)
        if program is None or program.dtype.kind != "u" or program.itemsize != 1 or \
                program.ndim != 1:
            raise RequestRefused("run: the program travels as one 1-D uint8 array 'program'")
        inputs = {k[3:]: v for k, v in arrays.items() if k.startswith("in/")}
        res = service.run(program.tobytes(), inputs, meta.get("params"), meta.get("spec"),
                          meta.get("profile"), meta.get("device"), meta.get("trace", False))
        return pack_message(*encode_run_result(res))
    except Exception as exc:  # noqa: BLE001 - every failure must reach the client intact
        return pack_message({"error": error_payload(exc)})


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (the listener) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):          # not Linux: the session checks its parent
        pass


def _session(conn: socket.socket, service: EmulatorService, options: ServerOptions,
             listener_pid: int) -> None:
    deadline = time.monotonic() + options.session_timeout_s
    while time.monotonic() < deadline and os.getppid() == listener_pid:
        conn.settimeout(min(options.idle_timeout_s, max(0.1, deadline - time.monotonic())))
        try:
            request = recv_frame(conn, options.limits.max_request_bytes)
        except RequestRefused as exc:      # over the size limit: answer, then hang up
            send_frame(conn, pack_message({"error": error_payload(exc)}))
            return
        except (socket.timeout, OSError, ProtocolError):
            return                         # idle too long, or the client went away
        reply = _dispatch(service, request)
        try:
            conn.settimeout(options.idle_timeout_s)
            send_frame(conn, reply)
        except OSError:
            return                         # the client went away while its call ran


def _session_main(conn, listen_sock, service, options, listener_pid) -> None:
    """Entry point of a forked session process; never returns."""
    code = 0
    try:
        listen_sock.close()
        _die_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _session(conn, service, options, listener_pid)
    except Exception:  # noqa: BLE001 - a broken session must not take the listener along
        traceback.print_exc()
        code = 1
    finally:
        try:
            conn.close()
        finally:
            os._exit(code)


# ----------------------------------------------------------------------------------------
# the tracker link
# ----------------------------------------------------------------------------------------
class _TrackerLink:
    """The server's registration with a TVM RPC tracker (TVM's own server protocol).

    The server offers itself with a one-time match key while it has room for a session;
    the tracker hands that key to one client. If nobody comes with it for a while (the
    client gave up), the server offers a fresh key."""

    PING_S = 2.0
    UNMATCHED_S = 6.0

    def __init__(self, addr: tuple, key: str, port: int):
        self.addr, self.key, self.port = addr, key, port
        self.sock = None
        self.matchkey = None
        self.unmatched_since = None
        self.last_ping = 0.0

    def _connect(self) -> None:
        sock = socket.create_connection(self.addr, timeout=10)
        send_int(sock, RPC_TRACKER_MAGIC)
        if recv_int(sock) != RPC_TRACKER_MAGIC:
            raise ProtocolError(f"{self.addr[0]}:{self.addr[1]} is not a TVM RPC tracker")
        send_json(sock, [TrackerCode.UPDATE_INFO, {"key": "server:" + self.key,
                                                   "addr": [None, self.port]}])
        if recv_json(sock) != TrackerCode.SUCCESS:
            raise ProtocolError("the tracker refused the server's info")
        self.sock = sock

    def offer(self) -> str:
        """Register a fresh match key; returns it."""
        if self.sock is None:
            self._connect()
        self.matchkey = f"{self.key}:{os.urandom(8).hex()}"
        send_json(self.sock, [TrackerCode.PUT, self.key, [self.port, self.matchkey], None])
        if recv_json(self.sock) != TrackerCode.SUCCESS:
            raise ProtocolError("the tracker refused the server's registration")
        self.unmatched_since, self.last_ping = None, time.monotonic()
        return self.matchkey

    def tick(self) -> None:
        """While idle: if the offered key was taken but never used, offer a new one."""
        now = time.monotonic()
        if now - self.last_ping < self.PING_S:
            return
        self.last_ping = now
        send_json(self.sock, [TrackerCode.GET_PENDING_MATCHKEYS])
        pending = recv_json(self.sock)
        if self.matchkey in pending:
            self.unmatched_since = None
        elif self.unmatched_since is None:
            self.unmatched_since = now
        elif now - self.unmatched_since > self.UNMATCHED_S:
            self.offer()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


# ----------------------------------------------------------------------------------------
# the listener
# ----------------------------------------------------------------------------------------
class EmulatorServer:
    """The listening side of ``python -m edgetvm.rpc_server`` (see the module docstring).

    Parameters
    ----------
    host : str
        Address to bind.
    port, port_end : int
        Bind the first free port in ``[port, port_end)`` (``port_end`` default ``port + 1``).
    key : str
        The key clients must present (with a tracker: the key servers register under).
    tracker : (str, int), optional
        Register with this TVM RPC tracker.
    spec : str
        Default NPU spec (preset name or JSON file of the operator's) of requests naming none.
    options : ServerOptions
        Timeouts, session count, request limits.
    """

    def __init__(self, host=DEFAULT_HOST, port=DEFAULT_PORT, port_end=None, key=DEFAULT_KEY,
                 tracker=None, spec=DEFAULT_SPEC, options: ServerOptions = ServerOptions()):
        self.host, self.key, self.options = host, key, options
        self.default_spec = EmulatorService(spec).resolve_spec(None)  # fail early
        self.sock = self._bind(host, port, port_end or port + 1)
        self.port = self.sock.getsockname()[1]
        self.tracker = _TrackerLink(tracker, key, self.port) if tracker else None
        self.sessions: dict[int, float] = {}           # pid -> start time
        self.pid = os.getpid()

    @staticmethod
    def _bind(host, port, port_end) -> socket.socket:
        last = None
        for p in range(port, port_end):
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                 socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, p))
                sock.listen(64)
                return sock
            except OSError as exc:
                sock.close()
                last = exc
        raise OSError(f"no free port in [{port}, {port_end}) on {host}: {last}")

    # -- the loop ----------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept and serve until interrupted; raises if the listener itself fails."""
        matchkey = self.key
        while True:
            self._reap()
            room = len(self.sessions) < self.options.max_sessions
            if self.tracker is not None and room:
                matchkey = self._tracker_key()
            ready, _, _ = select.select([self.sock] if room else [], [], [], 0.5)
            if not ready:
                continue
            conn, addr = self.sock.accept()
            if self._handshake(conn, matchkey):
                if self.tracker is not None:
                    self.tracker.matchkey = None       # offer a fresh key once there is room
                self._spawn(conn)
            conn.close()

    def _tracker_key(self) -> str | None:
        """The match key the tracker hands out for this server (offered while there is room
        for a session). A lost tracker is reconnected on later rounds; meanwhile no client
        can come through it, and the server goes on serving the sessions it has."""
        link = self.tracker
        try:
            if link.matchkey is None:
                link.offer()
            else:
                link.tick()
        except (OSError, EdgeTVMError, ValueError) as exc:
            if link.sock is not None:
                print(f"warning: lost RPC tracker {link.addr[0]}:{link.addr[1]} ({exc}); "
                      "reconnecting", file=sys.stderr, flush=True)
            link.close()
            link.matchkey = None
            time.sleep(1.0)
        return link.matchkey

    def _handshake(self, conn: socket.socket, matchkey: str | None) -> bool:
        """TVM's handshake, within the handshake timeout; anything malformed closes this
        connection only."""
        try:
            conn.settimeout(self.options.handshake_timeout_s)
            if recv_int(conn) != RPC_MAGIC:
                return False
            fields = recv_key(conn).split()
            if not fields or matchkey is None or fields[0] != "client:" + matchkey:
                send_int(conn, RPC_CODE_MISMATCH)
                return False
            send_int(conn, RPC_CODE_SUCCESS)
            send_key(conn, "server:" + self.key)
            return True
        except (OSError, ProtocolError, EdgeTVMError):
            return False

    def _spawn(self, conn: socket.socket) -> None:
        info = {"key": self.key, "server_pid": self.pid,
                "address": f"{self.host}:{self.port}"}
        service = EmulatorService(self.default_spec, info, self.options.limits)
        pid = os.fork()
        if pid == 0:
            _session_main(conn, self.sock, service, self.options, self.pid)
        self.sessions[pid] = time.monotonic()

    def _reap(self) -> None:
        """Collect ended sessions; kill one that outlived its session timeout (stuck in
        a long run: the session checks its deadline only between requests)."""
        for pid, start in list(self.sessions.items()):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                del self.sessions[pid]
            elif time.monotonic() - start > self.options.session_timeout_s + 10:
                os.kill(pid, signal.SIGKILL)

    def close(self) -> None:
        for pid in self.sessions:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.sessions.clear()
        if self.tracker is not None:
            self.tracker.close()
        self.sock.close()


# ----------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------
def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} out of range 1..65535")
    return port


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, _port(port)


def _key(text: str) -> str:
    # TVM's handshake splits the key on whitespace and the tracker appends ":<random>"
    if not text or any(c.isspace() for c in text) or ":" in text or \
            len(text.encode()) > MAX_KEY_BYTES // 2:
        raise argparse.ArgumentTypeError(f"key must be non-empty, without spaces or ':': {text!r}")
    return text


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m edgetvm.rpc_server`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m edgetvm.rpc_server",
        description="Serve the edgetvm NPU emulator (programs are data: a client can run "
                    "them and read results, nothing else). Register several servers with a "
                    "TVM RPC tracker for parallel runs.")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to bind (default %(default)s; others need --allow-remote)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow binding an address other machines can reach")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port (default %(default)s)")
    p.add_argument("--port-end", type=_port, default=None,
                   help="search free ports in [port, port-end) (default: exactly --port)")
    p.add_argument("--tracker", type=_host_port, default=None, metavar="HOST:PORT",
                   help="register with this TVM RPC tracker")
    p.add_argument("--key", type=_key, default=DEFAULT_KEY, help="device key (default %(default)s)")
    p.add_argument("--spec", default=DEFAULT_SPEC,
                   help="default NPU spec: preset name or JSON file (default %(default)s)")
    d = ServerOptions()
    p.add_argument("--max-sessions", type=_positive(int), default=d.max_sessions,
                   help="sessions served at once (default %(default)s)")
    p.add_argument("--handshake-timeout", type=_positive(float), default=d.handshake_timeout_s,
                   metavar="S", help="seconds a connection has for its handshake "
                   "(default %(default)s)")
    p.add_argument("--idle-timeout", type=_positive(float), default=d.idle_timeout_s,
                   metavar="S", help="seconds a session may wait between requests "
                   "(default %(default)s)")
    p.add_argument("--session-timeout", type=_positive(float), default=d.session_timeout_s,
                   metavar="S", help="longest session in seconds (default %(default)s)")
    p.add_argument("--max-request-mb", type=_positive(float),
                   default=d.limits.max_request_bytes / MB, metavar="MB",
                   help="largest request (default %(default)g MiB)")
    p.add_argument("--max-tensor-mb", type=_positive(float),
                   default=d.limits.max_tensor_bytes / MB, metavar="MB",
                   help="largest total of a program's DRAM tensors, of a request's arrays and "
                        "of a client spec's TCM (default %(default)g MiB)")
    return p


def _is_loopback(host: str) -> bool:
    return host.startswith(_LOOPBACK)


def _parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.port_end is not None and args.port_end <= args.port:
        parser.error(f"--port-end {args.port_end} must be greater than --port {args.port}")
    import socket
    try:
        socket.getaddrinfo(args.host, None)
    except (socket.gaierror, UnicodeError) as exc:
        parser.error(f"--host {args.host}: cannot resolve it ({exc})")
    if not _is_loopback(args.host) and not args.allow_remote:
        parser.error(f"--host {args.host} can be reached from other machines; a client that "
                     "connects can run programs on this machine's CPU and memory within the "
                     "request limits. Pass --allow-remote to bind it anyway.")
    try:  # validate here, before anything listens
        EmulatorService(args.spec).resolve_spec(None)
    except EdgeTVMError as exc:
        parser.error(f"--spec: {exc}")
    return args


def _options(args) -> ServerOptions:
    return ServerOptions(args.handshake_timeout, args.idle_timeout, args.session_timeout,
                         args.max_sessions,
                         ServiceLimits(int(args.max_request_mb * MB), int(args.max_tensor_mb * MB)))


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _one_math_thread() -> None:
    """One BLAS/OpenMP thread per process: N servers on N cores then scale N-fold instead
    of oversubscribing the cores."""
    from threadpoolctl import threadpool_limits
    threadpool_limits(1)


def main(argv=None) -> int:
    """Entry point of ``python -m edgetvm.rpc_server``; returns the exit status."""
    args = _parse_args(argv)
    _one_math_thread()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        server = EmulatorServer(args.host, args.port, args.port_end, args.key, args.tracker,
                                args.spec, _options(args))
    except OSError as exc:
        print(f"error: cannot start server on {args.host}:{args.port}: {exc} "
              "(port in use? give a range with --port-end)", file=sys.stderr)
        return 1
    if args.allow_remote and not _is_loopback(args.host):
        print(f"warning: listening on {args.host}, reachable from other machines: any client "
              f"with key {args.key!r} can run emulator programs here (no files, no code)",
              file=sys.stderr, flush=True)
    try:
        if server.tracker is not None:
            try:
                server.tracker.offer()
            except (OSError, EdgeTVMError) as exc:
                print(f"error: cannot register with RPC tracker at "
                      f"{args.tracker[0]}:{args.tracker[1]}: {exc}", file=sys.stderr)
                return 1
        via = f", tracker {args.tracker[0]}:{args.tracker[1]}" if args.tracker else ""
        print(f"listening on {args.host}:{server.port} (key {args.key}, spec {args.spec}{via})",
              flush=True)
        with fewer_collections():          # inherited by the forked sessions
            server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - a dead listener must say so and exit non-zero
        print(f"error: the listener failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        server.close()
    return 1


if __name__ == "__main__":
    sys.exit(main())
