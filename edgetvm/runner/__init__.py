"""Runners: execute NPU programs on the emulator, in-process or behind RPC servers.

One interface, three places to run::

    from edgetvm.runner import connect
    runner = connect("rpc://127.0.0.1:9190", spec="edge-npu-16mb")   # or "local",
    res = runner.run(program, {"A": a, "B": b})                      # "tracker://H:P/KEY"
    res.outputs["C"], res.counters["total_cycles"], res.server.pid

* :class:`LocalRunner` runs the emulator in this process (:mod:`.local`).
* :class:`RPCRunner` holds one session with one ``python -m edgetvm.rpc_server`` (:mod:`.rpc`).
* :class:`TrackerRunner` gets servers from a TVM RPC tracker; :meth:`~Runner.run_many`
  spreads jobs over as many servers as are free, one session per worker thread
  (:mod:`.tracker`).

The interface, results, errors and state semantics are in :mod:`.base`; the service that
answers the calls, locally and on a server, with its request limits, in :mod:`.service`.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from edgetvm.rpc_protocol import DEFAULT_KEY, DEFAULT_PORT

from .base import (Device, RemoteError, Runner, RunJob, RunnerConnectionError, RunnerError,
                   RunResult, ServerInfo)
from .local import LocalRunner
from .rpc import RPCRunner
from .service import EmulatorService, ServiceLimits
from .tracker import TrackerRunner

__all__ = ["RunnerError", "RunnerConnectionError", "RemoteError", "ServerInfo", "RunResult",
           "RunJob", "Device", "Runner", "LocalRunner", "RPCRunner", "TrackerRunner",
           "EmulatorService", "ServiceLimits", "connect"]


def connect(url: str, spec=None, **kwargs) -> Runner:
    """Make a runner from a URL.

    Parameters
    ----------
    url : str
        ``"local"``; ``"rpc://HOST[:PORT][/KEY]"`` (port default 9190, key default
        ``edgetvm-npu``); ``"tracker://HOST:PORT[/KEY]"``.
    spec : NPUSpec, str or None
        The NPU to emulate (``None``: the server's default; ``edge-npu-16mb`` locally).
    **kwargs
        Passed to the runner class (e.g. ``max_workers``, ``call_timeout``).

    Returns
    -------
    Runner

    Raises
    ------
    RunnerError
        The URL is malformed.
    RunnerConnectionError
        The server or tracker cannot be reached.
    """
    if url == "local":
        return LocalRunner(spec, **kwargs)
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise RunnerError(f"bad port in runner URL {url!r}") from None
    key = parts.path.strip("/") or DEFAULT_KEY
    if not parts.hostname or "/" in key or parts.query or parts.fragment:
        raise RunnerError(f"malformed runner URL {url!r}; expected 'local', "
                          "'rpc://HOST[:PORT][/KEY]' or 'tracker://HOST:PORT[/KEY]'")
    if parts.scheme == "rpc":
        return RPCRunner(parts.hostname, port or DEFAULT_PORT, spec, key=key, **kwargs)
    if parts.scheme == "tracker":
        if port is None:
            raise RunnerError(f"runner URL {url!r} needs the tracker's port")
        return TrackerRunner(parts.hostname, port, key, spec, **kwargs)
    raise RunnerError(f"unknown runner URL scheme {parts.scheme!r} in {url!r}; "
                      "expected 'local', 'rpc://' or 'tracker://'")
