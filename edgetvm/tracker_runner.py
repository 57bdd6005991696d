"""TrackerRunner: run NPU programs on edgetvm servers handed out by a TVM RPC tracker.

Usage::

    from edgetvm.runner import connect
    runner = connect("tracker://127.0.0.1:9191/edgetvm-npu", spec="edge-npu-16mb")
    results = runner.run_many(jobs)          # one session per free server

This module holds :class:`TrackerRunner` and what only it needs: a tracker request that
can be cancelled or timed out (:class:`_TrackerRequest`) and the worker pool that spreads
:meth:`~TrackerRunner.run_many` jobs over one session per server (:class:`_WorkerPool`).
The runner interface, results, errors and RPC sessions are in :mod:`edgetvm.runner`,
which re-exports :class:`TrackerRunner`.
"""
from __future__ import annotations

import socket
import threading
from collections import deque
from typing import Iterable

from edgetvm.errors import EdgeTVMError
from edgetvm.rpc_server import DEFAULT_KEY
from edgetvm.runner import (Runner, RunJob, RunnerConnectionError, RunnerError, _Channel,
                            _finish, _gist, _RPCChannel)


class _TrackerRequest:
    """One blocking ``tracker.request(key)`` that another thread or a timer can cancel.

    TVM's tracker holds a request until a server with the key is free, with no timeout;
    shutting the tracker socket down wakes the request, and the tracker then hands the
    server to someone else (its callback sees the closed connection).
    """

    def __init__(self, host: str, port: int, key: str, session_timeout: float, timeout: float):
        self.address = f"{host}:{port}"
        self.key, self.session_timeout, self.timeout = key, session_timeout, timeout
        self.cancelled = self.timed_out = False
        self._tracker = _connect_tracker(host, port)

    def cancel(self, timed_out: bool = False) -> None:
        self.timed_out = self.timed_out or timed_out
        self.cancelled = True
        sock = getattr(self._tracker, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __call__(self) -> _RPCChannel:
        timer = threading.Timer(self.timeout, self.cancel, kwargs={"timed_out": True})
        timer.daemon = True
        timer.start()
        try:
            session = self._tracker.request(self.key, priority=1,
                                            session_timeout=self.session_timeout, max_retry=1)
        except Exception as exc:  # noqa: BLE001 - TVM wraps everything in RuntimeError
            if self.timed_out:
                raise RunnerConnectionError(
                    f"no server with key {self.key!r} became free on tracker {self.address} "
                    f"within {self.timeout:g} s") from None
            raise RunnerConnectionError(f"tracker {self.address}: request for key "
                                        f"{self.key!r} failed: {_gist(exc)}") from None
        finally:
            timer.cancel()
            self._tracker.close()
        return _RPCChannel(session, f"tracker {self.address}/{self.key}")


def _connect_tracker(host: str, port: int, probe_timeout: float = 5.0):
    from tvm import rpc

    # TVM retries a refused tracker connection for 60 s (base.connect_with_retry); one
    # plain probe first turns "no tracker there" into an immediate, clear error.
    try:
        socket.create_connection((host, port), timeout=probe_timeout).close()
    except OSError as exc:
        raise RunnerConnectionError(f"cannot reach RPC tracker at {host}:{port}: "
                                    f"{exc.strerror or exc}") from None
    try:
        return rpc.connect_tracker(host, port)
    except Exception as exc:  # noqa: BLE001 - ConnectionRefusedError, RuntimeError, ...
        raise RunnerConnectionError(f"cannot reach RPC tracker at {host}:{port}: "
                                    f"{_gist(exc)}") from None


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
            channel = self._open()
            if channel is not None:
                try:
                    self.barrier.wait(self.runner.start_grace_s)
                except threading.BrokenBarrierError:
                    pass
                try:
                    self._drain(channel)
                finally:
                    channel.close()
        finally:
            with self.cv:  # let run() re-check whether any worker is left
                self.active -= 1
                self.cv.notify_all()

    def _open(self) -> "_RPCChannel | None":
        """This worker's session, or ``None`` (no work left, or no server: already recorded)."""
        with self.cv:
            if self.pending == 0:
                self.barrier.abort()
                return None
            try:
                req = self.runner._new_request()
            except RunnerError as exc:
                self.last_error = exc
                self.barrier.abort()
                return None
            self.requests.append(req)
        try:
            return req()
        except RunnerError as exc:
            if req.timed_out or not req.cancelled:
                self.last_error = exc
            self.barrier.abort()  # do not keep the connected workers waiting
            return None

    def _drain(self, channel: _RPCChannel) -> None:
        while True:
            try:
                i, attempts = self.queue.popleft()
            except IndexError:
                return
            try:
                result = channel.run(self.jobs[i], self.runner.spec, None)
            except RunnerConnectionError as exc:
                self.last_error = exc
                if attempts == 0:  # the session broke: let another worker retry the job
                    self.queue.append((i, 1))
                    return
                result = exc
            except EdgeTVMError as exc:
                result = exc
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
    session_timeout : float
        Seconds after which a server ends a session (0: never).
    request_timeout : float
        How long to wait for a free server.
    start_grace_s : float
        How long connected workers wait for the others before taking jobs.

    Raises
    ------
    RunnerConnectionError
        The tracker cannot be reached.
    """

    def __init__(self, tracker_host: str, tracker_port: int, key: str = DEFAULT_KEY,
                 spec=None, max_workers: int | None = None, session_timeout: float = 0,
                 request_timeout: float = 60.0, start_grace_s: float = 0.5):
        super().__init__(spec)
        self.tracker_host, self.tracker_port, self.key = tracker_host, int(tracker_port), key
        self.max_workers = max_workers
        self.session_timeout, self.request_timeout = session_timeout, request_timeout
        self.start_grace_s = start_grace_s
        _connect_tracker(tracker_host, self.tracker_port).close()  # fail fast
        self._own: _RPCChannel | None = None

    def _new_request(self) -> _TrackerRequest:
        return _TrackerRequest(self.tracker_host, self.tracker_port, self.key,
                               self.session_timeout, self.request_timeout)

    def _channel(self) -> _Channel:
        if self._own is None:
            self._own = self._new_request()()
        return self._own

    def servers(self) -> dict:
        """Servers registered with this runner's key: ``{"total", "free", "pending"}``.

        ``total`` counts busy servers too; ``free`` lags behind a session's end (a server
        re-registers only after its session process has exited).
        """
        tracker = _connect_tracker(self.tracker_host, self.tracker_port)
        try:
            summary = tracker.summary()
        finally:
            tracker.close()
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
        if self._own is not None:
            self._own.close()
            self._own = None

    def __repr__(self):
        return f"TrackerRunner({self.tracker_host!r}, {self.tracker_port}, key={self.key!r})"
