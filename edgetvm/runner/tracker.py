"""TrackerRunner: run NPU programs on edgetvm servers handed out by a TVM RPC tracker.

Usage::

    from edgetvm.runner import connect
    runner = connect("tracker://127.0.0.1:9191/edgetvm-npu", spec="edge-npu-16mb")
    results = runner.run_many(jobs)          # one session per free server

The tracker is TVM's own (``python -m tvm.exec.rpc_tracker``), spoken to in its JSON
protocol: a request for a key answers with a free server's address and a one-time match
key, which the server accepts once. This module holds :class:`TrackerRunner`, that
request (:class:`_TrackerRequest`, which a timer or another thread can cancel) and the
worker pool that spreads :meth:`~TrackerRunner.run_many` jobs over one session per server
(:class:`_WorkerPool`).
"""
from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Iterable

from edgetvm.errors import EdgeTVMError
from edgetvm.rpc_protocol import (DEFAULT_KEY, RPC_TRACKER_MAGIC, TrackerCode, recv_int,
                                  recv_json, send_int, send_json)

from .base import Runner, RunJob, RunnerConnectionError, RunnerError, _Channel, _finish
from .rpc import CALL_TIMEOUT, CONNECT_TIMEOUT, _RPCChannel


def _connect_tracker(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A socket to the tracker, past its magic exchange."""
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
        send_int(sock, RPC_TRACKER_MAGIC)
        if recv_int(sock) != RPC_TRACKER_MAGIC:
            sock.close()
            raise RunnerConnectionError(f"{host}:{port} is not a TVM RPC tracker")
    except (OSError, EdgeTVMError) as exc:
        if isinstance(exc, RunnerConnectionError):
            raise
        raise RunnerConnectionError(f"cannot reach RPC tracker at {host}:{port}: "
                                    f"{getattr(exc, 'strerror', None) or exc}") from None
    return sock


def tracker_summary(host: str, port: int) -> dict:
    """The tracker's summary: ``queue_info`` (free / pending per key), ``server_info``."""
    sock = _connect_tracker(host, port)
    try:
        send_json(sock, [TrackerCode.SUMMARY])
        code, summary = recv_json(sock)
    except (OSError, EdgeTVMError, ValueError) as exc:
        raise RunnerConnectionError(f"tracker {host}:{port}: summary failed: {exc}") from None
    finally:
        sock.close()
    if code != TrackerCode.SUCCESS:
        raise RunnerConnectionError(f"tracker {host}:{port}: summary refused")
    return summary


class _TrackerRequest:
    """One blocking request for a server with ``key`` that another thread or a timer can
    cancel.

    The tracker holds a request until a server with the key is free, with no timeout of
    its own; shutting the socket down wakes the request (the tracker then hands the
    server to someone else).
    """

    def __init__(self, host: str, port: int, key: str, timeout: float,
                 call_timeout: float = CALL_TIMEOUT):
        self.address = f"{host}:{port}"
        self.key, self.timeout, self.call_timeout = key, timeout, call_timeout
        self.cancelled = self.timed_out = False
        self._sock = _connect_tracker(host, port)

    def cancel(self, timed_out: bool = False) -> None:
        self.timed_out = self.timed_out or timed_out
        self.cancelled = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def __call__(self) -> _RPCChannel:
        timer = threading.Timer(self.timeout, self.cancel, kwargs={"timed_out": True})
        timer.daemon = True
        timer.start()
        try:
            self._sock.settimeout(None)        # the timer bounds the wait
            send_json(self._sock, [TrackerCode.REQUEST, self.key, "", 1])
            code, value = recv_json(self._sock)
            if code != TrackerCode.SUCCESS:
                raise RunnerConnectionError(f"tracker {self.address} refused the request")
            host, port, matchkey = value
        except (OSError, EdgeTVMError, ValueError, TypeError) as exc:
            if self.timed_out:
                raise RunnerConnectionError(
                    f"no server with key {self.key!r} became free on tracker {self.address} "
                    f"within {self.timeout:g} s") from None
            if isinstance(exc, RunnerError):
                raise
            raise RunnerConnectionError(f"tracker {self.address}: request for key "
                                        f"{self.key!r} failed: {exc}") from None
        finally:
            timer.cancel()
            self._sock.close()
        return _RPCChannel.connect(host, int(port), matchkey, call_timeout=self.call_timeout,
                                   label=f"{host}:{port} (tracker {self.address}/{self.key})")


class _WorkerPool:
    """Runs jobs on up to ``n`` tracker sessions, one per worker thread.

    Workers first get their session, then wait (at most ``start_grace_s``) for each
    other, so short jobs are not all taken by the first worker to connect; then each
    takes the next job from a shared queue until it is empty. A job whose session broke
    is put back once for another worker.
    """

    def __init__(self, runner: "TrackerRunner", jobs: list, n: int):
        self.runner, self.jobs, self.n = runner, jobs, n
        self.queue = deque((i, 0) for i in range(len(jobs)))
        self.results: list = [None] * len(jobs)
        self.pending = len(jobs)
        self.active = n  # workers not yet finished (Thread.is_alive lags behind notify)
        self.barrier = threading.Barrier(n)
        self.cv = threading.Condition()
        self.requests: list[_TrackerRequest] = []
        self.last_error: Exception | None = None

    def run(self) -> list:
        threads = [threading.Thread(target=self._worker, name=f"edgetvm-runner-{w}", daemon=True)
                   for w in range(self.n)]
        for t in threads:
            t.start()
        with self.cv:
            self.cv.wait_for(lambda: self.pending == 0 or self.active == 0)
            for req in self.requests:  # all jobs done: wake workers still waiting for a server
                req.cancel()
        for t in threads:
            t.join()
        err = self.last_error or RunnerConnectionError("no session could be opened")
        return [err if r is None else r for r in self.results]

    def _worker(self) -> None:
        try:
            first = True
            while True:
                channel, held = self._open()
                if channel is None:
                    return
                if first:
                    first = False
                    try:
                        self.barrier.wait(self.runner.start_grace_s)
                    except threading.BrokenBarrierError:
                        pass
                alive = False
                try:
                    alive = self._drain(channel, held)
                finally:
                    if not (alive and self.runner._hold(channel)):
                        channel.close()
                if alive or not held:
                    return
                # a held session that had ended (the server's idle timeout, a restart):
                # its job went back on the queue; this worker opens a fresh one
        finally:
            with self.cv:  # let run() re-check whether any worker is left
                self.active -= 1
                self.cv.notify_all()

    def _open(self) -> tuple:
        """(this worker's session, whether it was held from an earlier call), or
        ``(None, False)`` (no work left, or no server: already recorded)."""
        with self.cv:
            if self.pending == 0 or not self.queue:
                self.barrier.abort()
                return None, False
            channel = self.runner._take_held()
            if channel is not None:
                return channel, True
            try:
                req = self.runner._new_request()
            except RunnerError as exc:
                self.last_error = exc
                self.barrier.abort()
                return None, False
            self.requests.append(req)
        try:
            return req(), False
        except RunnerError as exc:
            if req.timed_out or not req.cancelled:
                self.last_error = exc
            self.barrier.abort()  # do not keep the connected workers waiting
            return None, False

    def _drain(self, channel: _RPCChannel, held: bool = False) -> bool:
        """Run queued jobs on ``channel`` until the queue is empty (True) or the session
        breaks (False; the job goes back on the queue once, and for free when it was the
        first call on a held session, which may have ended while it was held)."""
        fresh = held
        while True:
            try:
                i, attempts = self.queue.popleft()
            except IndexError:
                return True
            try:
                result = channel.run(self.jobs[i], self.runner.spec, None)
            except RunnerConnectionError as exc:
                if fresh:
                    self.queue.appendleft((i, attempts))
                    return False
                self.last_error = exc
                if attempts == 0:  # the session broke: let another worker retry the job
                    self.queue.append((i, 1))
                    return False
                result = exc
            except EdgeTVMError as exc:
                result = exc
            fresh = False
            with self.cv:
                self.results[i] = result
                self.pending -= 1
                self.cv.notify_all()


class TrackerRunner(Runner):
    """Servers obtained from a TVM RPC tracker (``python -m tvm.exec.rpc_tracker``).

    :meth:`run_many` opens one session per worker thread, each requested from the tracker,
    and spreads the jobs over them; :meth:`run` / :meth:`device` use one session of their
    own, requested on first use and held (it occupies one server) until :meth:`close`.

    Parameters
    ----------
    tracker_host, tracker_port : str, int
        The tracker's address.
    key : str
        The servers' ``--key``.
    spec : NPUSpec, str or None
        The NPU to emulate (``None``: each server's ``--spec``).
    max_workers : int, optional
        Sessions for :meth:`run_many`; default: the servers registered with the key (but
        the one this runner's own :meth:`run` session holds).
    request_timeout : float
        How long to wait for a free server.
    call_timeout : float
        Seconds to wait for each call's reply.
    start_grace_s : float
        How long connected workers wait for the others before taking jobs.
    hold_sessions : bool
        Keep :meth:`run_many`'s sessions open between calls (until :meth:`close`) and
        reuse them: for a client that sends batch after batch (the tuner). Opening a
        session costs a tracker round trip and then waits for the server, which
        re-registers only once its previous session's process has exited: 0.43 s a batch
        on loopback. Held sessions keep their servers from other clients meanwhile; one
        that ended while held (the server's ``--idle-timeout``) is replaced by a fresh
        session, its job run there, not counted as a failure.

    Raises
    ------
    RunnerConnectionError
        The tracker cannot be reached.
    """

    def __init__(self, tracker_host: str, tracker_port: int, key: str = DEFAULT_KEY,
                 spec=None, max_workers: int | None = None, request_timeout: float = 60.0,
                 call_timeout: float = CALL_TIMEOUT, start_grace_s: float = 0.5,
                 hold_sessions: bool = False):
        super().__init__(spec)
        self.tracker_host, self.tracker_port, self.key = tracker_host, int(tracker_port), key
        self.max_workers = max_workers
        self.request_timeout, self.call_timeout = request_timeout, call_timeout
        self.start_grace_s = start_grace_s
        self.hold_sessions = hold_sessions
        _connect_tracker(tracker_host, self.tracker_port).close()  # fail fast
        self._own: _RPCChannel | None = None
        self._held: list[_RPCChannel] = []
        self._held_lock = threading.Lock()

    def _take_held(self) -> "_RPCChannel | None":
        with self._held_lock:
            return self._held.pop() if self._held else None

    def _hold(self, channel: _RPCChannel) -> bool:
        """Keep ``channel`` for the next :meth:`run_many` (with ``hold_sessions``)."""
        if not self.hold_sessions:
            return False
        with self._held_lock:
            self._held.append(channel)
        return True

    def _new_request(self) -> _TrackerRequest:
        return _TrackerRequest(self.tracker_host, self.tracker_port, self.key,
                               self.request_timeout, self.call_timeout)

    def _channel(self) -> _Channel:
        if self._own is None:
            self._own = self._new_request()()
        return self._own

    def servers(self) -> dict:
        """Servers registered with this runner's key: ``{"total", "free", "pending"}``.

        ``total`` counts busy servers too; ``free`` lags behind a session's end (a server
        re-registers only after its session process has exited).
        """
        summary = tracker_summary(self.tracker_host, self.tracker_port)
        queue = summary.get("queue_info", {}).get(self.key, {})
        total = sum(1 for s in summary.get("server_info", []) if s.get("key") == "server:" + self.key)
        return {"total": total, "free": int(queue.get("free", 0)),
                "pending": int(queue.get("pending", 0))}

    def run_many(self, jobs: Iterable, return_exceptions: bool = False) -> list:
        """Spread independent jobs over the tracker's servers; results in job order.

        See :meth:`Runner.run_many`; each result's ``server`` names the server that ran it.
        """
        jobs = [RunJob.coerce(j) for j in jobs]
        if not jobs:
            return []
        workers = self.max_workers
        if workers is None:  # every registered server but the one this runner holds itself
            workers = max(1, self.servers()["total"] - (self._own is not None))
        return _finish(_WorkerPool(self, jobs, min(workers, len(jobs))).run(), return_exceptions)

    def close(self) -> None:
        super().close()
        with self._held_lock:
            held, self._held = self._held, []
        for channel in held:
            channel.close()
        if self._own is not None:
            self._own.close()
            self._own = None

    def __repr__(self):
        return f"TrackerRunner({self.tracker_host!r}, {self.tracker_port}, key={self.key!r})"
