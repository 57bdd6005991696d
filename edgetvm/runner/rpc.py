"""RPCRunner: one session with one ``python -m edgetvm.rpc_server``.

The session opens with TVM RPC's handshake (so a TVM tracker can hand the server out) and
then exchanges :mod:`edgetvm.rpc_protocol` frames: one request, one reply. Every socket
operation has a timeout: ``connect_timeout`` for reaching the server and its handshake
answer, ``call_timeout`` for each call's reply. A server that does not answer in time
(frozen, overloaded, lost) is a :class:`~edgetvm.runner.RunnerConnectionError` naming it,
never a hang; the session is closed then, as its state is unknown.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np

from edgetvm.errors import EdgeTVMError
from edgetvm.rpc_protocol import (DEFAULT_KEY, DEFAULT_PORT, PROTOCOL_VERSION,
                                  RPC_CODE_MISMATCH, RPC_CODE_SUCCESS,
                                  RPC_MAGIC, decode_run_result, pack_message, recv_frame,
                                  recv_int, recv_key, send_frame, send_int, send_key,
                                  spec_payload, unpack_message)

from .base import (Runner, RunJob, RunnerConnectionError, RunnerError, RunResult, _Channel,
                   _error_from_payload, _result_from)

#: seconds to reach a server and get its handshake answer
CONNECT_TIMEOUT = 10.0
#: seconds to wait for one call's reply (a long program on a slow machine takes minutes)
CALL_TIMEOUT = 600.0
#: largest reply a client reads (outputs, state, traces)
MAX_REPLY_BYTES = 4 << 30


class _RPCChannel(_Channel):
    """One session with an edgetvm RPC server (a connected, handshaken socket)."""

    def __init__(self, sock: socket.socket, address: str, call_timeout: float = CALL_TIMEOUT):
        self._sock = sock
        self._lock = threading.Lock()  # one request / reply at a time on the socket
        self.address = address
        self.call_timeout = call_timeout
        try:  # fail fast on a foreign server or protocol skew, and free the server then
            self.server_info = self.info()
            if self.server_info.get("protocol") != PROTOCOL_VERSION:
                raise RunnerConnectionError(
                    f"server {address} speaks edgetvm RPC protocol "
                    f"{self.server_info.get('protocol')}, this client {PROTOCOL_VERSION}: "
                    "run the same edgetvm version on both sides")
        except EdgeTVMError:
            self.close()
            raise
        if self.server_info.get("address"):
            self.address = self.server_info["address"]

    @classmethod
    def connect(cls, host: str, port: int, key: str, connect_timeout: float = CONNECT_TIMEOUT,
                call_timeout: float = CALL_TIMEOUT, label: str | None = None) -> "_RPCChannel":
        """Open a session with the server at ``host:port`` that accepts ``key``."""
        address = label or f"{host}:{port}"
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as exc:
            raise RunnerConnectionError(
                f"cannot connect to edgetvm RPC server at {address}: "
                f"{exc.strerror or exc} (is `python -m edgetvm.rpc_server` running there?)"
            ) from None
        try:
            sock.settimeout(connect_timeout)
            send_int(sock, RPC_MAGIC)
            send_key(sock, "client:" + key)
            code = recv_int(sock)
            if code == RPC_CODE_MISMATCH:
                raise RunnerConnectionError(
                    f"cannot connect to edgetvm RPC server at {address}: it refused key "
                    f"{key!r} (wrong --key, or the server is registered with a tracker and "
                    "only accepts sessions the tracker hands out)")
            if code != RPC_CODE_SUCCESS:
                raise RunnerConnectionError(f"{address} is not an edgetvm RPC server "
                                            f"(handshake answer {code:#x})")
            recv_key(sock)  # the server's own key
        except socket.timeout:
            sock.close()
            raise RunnerConnectionError(
                f"edgetvm RPC server at {address} did not answer the handshake within "
                f"{connect_timeout:g} s (busy with another session?)") from None
        except EdgeTVMError as exc:
            sock.close()
            if isinstance(exc, RunnerError):
                raise
            raise RunnerConnectionError(f"handshake with {address} failed: {exc}") from None
        except OSError as exc:
            sock.close()
            raise RunnerConnectionError(f"handshake with {address} failed: {exc}") from None
        return cls(sock, address, call_timeout)

    def _call(self, meta: dict, arrays: dict | None = None) -> tuple[dict, dict]:
        if self._sock is None:
            raise RunnerConnectionError(f"session with {self.address} is closed")
        with self._lock:
            try:
                self._sock.settimeout(self.call_timeout)
                send_frame(self._sock, pack_message(meta, arrays))
                reply = recv_frame(self._sock, MAX_REPLY_BYTES)
            except socket.timeout:
                self.close()
                raise RunnerConnectionError(
                    f"no answer to {meta['call']!r} from {self.address} within "
                    f"{self.call_timeout:g} s (call_timeout); the session is closed") from None
            except (OSError, EdgeTVMError) as exc:
                self.close()
                raise RunnerConnectionError(
                    f"call {meta['call']!r} to {self.address} failed: {exc} (the server "
                    "closed the session or its process died)") from None
        out, out_arrays = unpack_message(reply)
        if "error" in out:
            raise _error_from_payload(out["error"], self.address)
        return out, out_arrays

    def info(self) -> dict:
        return self._call({"call": "info"})[0]["info"]

    def open_device(self, spec, profile) -> str:
        return self._call({"call": "open", "spec": spec_payload(spec), "profile": profile}
                          )[0]["device"]

    def close_device(self, handle: str) -> None:
        if self._sock is not None:
            self._call({"call": "close", "device": handle})

    def device_state(self, handle: str) -> dict:
        return self._call({"call": "state", "device": handle})[1]

    def run(self, job: RunJob, spec, device: str | None) -> RunResult:
        from edgetvm.target import program_format
        t0 = time.perf_counter()
        program = job.program
        if not isinstance(program, (bytes, bytearray)):
            program = program_format.dumps(program)
        arrays = {"in/" + k: np.asarray(v) for k, v in job.inputs.items()}
        arrays["program"] = np.frombuffer(bytes(program), np.uint8)
        meta, out = self._call({"call": "run", "spec": spec_payload(spec),
                                "profile": job.profile,
                                "params": dict(job.params) if job.params else None,
                                "device": device, "trace": bool(job.trace)}, arrays)
        res = decode_run_result(meta, out)
        if not res["server"].get("address"):  # the server could not tell its own port
            res["server"]["address"] = self.address
        return _result_from(res, time.perf_counter() - t0)

    def close(self) -> None:
        """End the session: the server's session process exits and (with a tracker) the
        server becomes free again."""
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass


class RPCRunner(Runner):
    """One session with one ``python -m edgetvm.rpc_server``.

    Jobs of :meth:`run_many` run one after the other on this session; use a tracker with
    several servers to run them in parallel.

    Parameters
    ----------
    host, port : str, int
        The server's address.
    spec : NPUSpec, str or None
        The NPU to emulate (``None``: the server's ``--spec``).
    key : str
        The server's ``--key``.
    connect_timeout : float
        Seconds to reach the server and get its handshake answer.
    call_timeout : float
        Seconds to wait for each call's reply.

    Raises
    ------
    RunnerConnectionError
        The server cannot be reached, refuses the key, does not answer in time or is not
        an edgetvm server.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, spec=None,
                 key: str = DEFAULT_KEY, connect_timeout: float = CONNECT_TIMEOUT,
                 call_timeout: float = CALL_TIMEOUT):
        super().__init__(spec)
        self.host, self.port, self.key = host, int(port), key
        self._rpc = _RPCChannel.connect(host, self.port, key, connect_timeout, call_timeout)

    def _channel(self) -> _Channel:
        if self._rpc is None:
            raise RunnerConnectionError(f"runner for {self.host}:{self.port} is closed")
        return self._rpc

    def close(self) -> None:
        super().close()
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None

    def __repr__(self):
        return f"RPCRunner({self.host!r}, {self.port})"
