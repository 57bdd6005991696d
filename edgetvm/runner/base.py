"""The runner interface: results, errors, devices and the channel a runner runs through.

:class:`Runner` is what every runner offers (:meth:`~Runner.run` on a default device with
persistent state, :meth:`~Runner.device`, :meth:`~Runner.run_many` on fresh state); a
subclass supplies the :class:`_Channel`, one session with one emulator service, either in
this process (:mod:`edgetvm.runner.local`) or behind a server (:mod:`edgetvm.runner.rpc`).

State semantics (the same for every runner):

* :meth:`Runner.run` runs on the runner's default :class:`Device`, whose persistent
  ``state`` tensors (the KV cache) carry over from one call to the next, as on a real NPU.
  :meth:`Runner.device` opens further independent devices; :meth:`Runner.reset` drops
  the default device's state.
* :meth:`Runner.run_many` runs every job on fresh state: its jobs are independent
  measurements (tuning candidates), so a result never depends on which server ran it or
  in which order.
* Over RPC a device lives in the server's per-session process (see
  :mod:`edgetvm.rpc_server`): its state survives exactly as long as the runner's session.

Errors: an edgetvm error raised on the server (e.g. :class:`~edgetvm.errors.InvalidProgramError`
with its command index) is re-raised on the client as the same class with the same
message; other server failures become :class:`RemoteError` (the server traceback is kept
in ``.remote_traceback``); connection problems and timeouts are
:class:`RunnerConnectionError` naming the address. ``run_many(jobs,
return_exceptions=True)`` returns failures in their slots instead, which is what a
MetaSchedule ``PyRunner`` needs.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from edgetvm.errors import EdgeTVMError


# ----------------------------------------------------------------------------------------
# errors and results
# ----------------------------------------------------------------------------------------
class RunnerError(EdgeTVMError):
    """A runner could not run a program (bad URL, lost session, server failure)."""


class RunnerConnectionError(RunnerError):
    """A server or tracker cannot be reached, refuses the key, or the session broke."""


class RemoteError(RunnerError):
    """An unexpected (non-edgetvm) exception on the server.

    Attributes
    ----------
    remote_type : str
        The exception's class name on the server.
    remote_traceback : str or None
        The server-side traceback, kept for debugging rather than printed.
    """

    def __init__(self, message, remote_type="", remote_traceback=None):
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class ServerInfo:
    """Where a run executed.

    Attributes
    ----------
    address : str
        ``host:port`` of the server, or ``"local"``.
    pid : int
        The server process (stable for the server's lifetime: tells servers apart).
    session_pid : int
        The process that ran the call (TVM forks one per RPC session).
    key : str or None
        The server's device key.
    """

    address: str
    pid: int
    session_pid: int
    key: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ServerInfo":
        return cls(str(d.get("address")), int(d["server_pid"]), int(d["pid"]), d.get("key"))


@dataclass
class RunResult:
    """The outcome of one run.

    Attributes
    ----------
    outputs : dict of str to numpy.ndarray
        The program's ``output`` tensors.
    counters : dict
        The emulator's counters (``total_cycles``, ``time_us``, ``dram_read_bytes``, ...)
        as JSON data, identical whichever runner executed the program.
    server : ServerInfo
        Which server (process) executed it.
    trace : list of TraceEvent or None
        Per-command timeline when requested.
    power_mw, power_window_starts : numpy.ndarray or None
        Windowed power after throttling and the windows' start cycles.
    run_s : float
        Seconds spent in the emulator.
    wall_s : float
        Seconds the client waited (serialisation and transport included).
    """

    outputs: dict
    counters: dict
    server: ServerInfo
    trace: list | None = None
    power_mw: np.ndarray | None = None
    power_window_starts: np.ndarray | None = None
    run_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class RunJob:
    """One program run for :meth:`Runner.run_many` (the arguments of :meth:`Runner.run`)."""

    program: Any
    inputs: Mapping[str, np.ndarray] = field(default_factory=dict)
    params: Mapping[str, int] | None = None
    profile: str | None = None
    trace: bool = False

    @classmethod
    def coerce(cls, job) -> "RunJob":
        """Accept a :class:`RunJob`, a mapping of its fields or a ``(program, inputs, ...)`` tuple."""
        if isinstance(job, RunJob):
            return job
        if isinstance(job, Mapping):
            return cls(**job)
        if isinstance(job, Sequence) and not isinstance(job, (str, bytes)):
            return cls(*job)
        raise RunnerError(f"not a run job: {type(job).__name__} (expected RunJob, dict or tuple)")


def _result_from(res: Mapping[str, Any], wall_s: float) -> RunResult:
    return RunResult(outputs=res["outputs"], counters=res["counters"],
                     server=ServerInfo.from_dict(res["server"]), trace=res.get("trace"),
                     power_mw=res.get("power_mw"),
                     power_window_starts=res.get("power_window_starts"),
                     run_s=float(res.get("run_s", 0.0)), wall_s=wall_s)


def _error_from_payload(payload: Mapping[str, Any], address: str) -> Exception:
    """Rebuild a server-side exception (see :func:`edgetvm.rpc_server.error_payload`).

    Only classes from edgetvm's own modules that derive from :class:`EdgeTVMError` are
    rebuilt (nothing is unpickled); the message is kept verbatim so the client sees what
    a local run would have said.
    """
    cls = _edgetvm_error_class(payload.get("module", ""), payload.get("type", ""))
    if cls is None:
        return RemoteError(f"server {address}: {payload.get('type')}: {payload.get('message')}",
                           payload.get("type", ""), payload.get("traceback"))
    exc = cls.__new__(cls)
    Exception.__init__(exc, payload.get("message", ""))
    exc.__dict__.update(payload.get("attrs") or {})
    exc.server = address
    return exc


def _edgetvm_error_class(module: str, name: str):
    if module != "edgetvm" and not module.startswith("edgetvm."):
        return None
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, EdgeTVMError) else None


def _resolve_spec(spec):
    """Resolve a preset name on the client: the full spec is then sent, and the server
    checks its hash, so client and server cannot silently emulate different devices."""
    if spec is None or not isinstance(spec, str):
        return spec
    from edgetvm.target.spec import load_spec
    return load_spec(spec)


# ----------------------------------------------------------------------------------------
# channels: one session with one emulator service (in-process or remote)
# ----------------------------------------------------------------------------------------
class _Channel:
    """The transport-independent calls a runner makes (see ``EmulatorService``)."""

    address = "?"

    def info(self) -> dict:
        raise NotImplementedError

    def open_device(self, spec, profile) -> str:
        raise NotImplementedError

    def close_device(self, handle: str) -> None:
        raise NotImplementedError

    def device_state(self, handle: str) -> dict:
        raise NotImplementedError

    def run(self, job: RunJob, spec, device: str | None) -> RunResult:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _gist(exc: BaseException) -> str:
    """The last line of an error: TVM puts its C++ context first and the reason last."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[-1] if lines else type(exc).__name__


# ----------------------------------------------------------------------------------------
# devices and runners
# ----------------------------------------------------------------------------------------
class Device:
    """One emulated NPU with persistent ``state`` tensors (e.g. the KV cache).

    Parameters
    ----------
    channel : _Channel
        The session the device lives in; its state lives as long as that session.
    spec : NPUSpec or None
        The NPU to emulate (``None``: the server's default).
    profile : str, optional
        Default power profile of this device's runs.
    """

    def __init__(self, channel: _Channel, spec=None, profile: str | None = None):
        self._channel = channel
        self.spec = spec
        self.profile = profile
        self.handle = channel.open_device(spec, profile)

    def run(self, program, inputs: Mapping[str, np.ndarray] | None = None,
            params: Mapping[str, int] | None = None, profile: str | None = None,
            trace: bool = False) -> RunResult:
        """Run ``program`` on this device; its state tensors persist to the next run.

        Parameters and return value as :meth:`Runner.run`.
        """
        if self.handle is None:
            raise RunnerError("device is closed")
        job = RunJob(program, inputs or {}, params, profile, trace)
        return self._channel.run(job, None, self.handle)

    def state(self) -> dict[str, np.ndarray]:
        """Copies of the device's persistent state tensors, by name."""
        if self.handle is None:
            raise RunnerError("device is closed")
        return self._channel.device_state(self.handle)

    def close(self) -> None:
        """Drop the device and its state (idempotent)."""
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                self._channel.close_device(handle)
            except RunnerConnectionError:  # the session is gone: so is the state
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _finish(results: list, return_exceptions: bool) -> list:
    if not return_exceptions:
        for r in results:
            if isinstance(r, BaseException):
                raise r
    return results


class Runner:
    """Common interface of every runner (subclasses supply the session).

    Parameters
    ----------
    spec : NPUSpec, str or None
        The NPU to emulate: a spec, a preset name (resolved locally, sent in full), or
        ``None`` for the server's default spec.
    """

    def __init__(self, spec=None):
        self.spec = _resolve_spec(spec)
        self._default: Device | None = None

    # -- subclass hook -------------------------------------------------------------------
    def _channel(self) -> _Channel:
        """The session used by :meth:`run`, :meth:`device` and :meth:`info`."""
        raise NotImplementedError

    # -- interface -------------------------------------------------------------------------
    def info(self) -> dict:
        """What the server reports: pids, edgetvm version, presets, default spec, devices."""
        return self._channel().info()

    def device(self, profile: str | None = None) -> Device:
        """Open a further independent device (own state) in this runner's session."""
        return Device(self._channel(), self.spec, profile)

    def run(self, program, inputs: Mapping[str, np.ndarray] | None = None,
            params: Mapping[str, int] | None = None, profile: str | None = None,
            trace: bool = False) -> RunResult:
        """Run a program on the runner's default device.

        Parameters
        ----------
        program : Program or bytes
            The command stream, or its ``program_format.dumps`` bytes (pass bytes to
            avoid re-serialising a program that runs many times).
        inputs : mapping of str to numpy.ndarray
            Values of the program's ``input`` tensors (a ``state`` tensor given here
            overwrites the device's copy).
        params : mapping of str to int, optional
            Runtime parameters.
        profile : str, optional
            Power profile name for this run (default: the spec's default profile).
        trace : bool
            Also return the per-command trace.

        Returns
        -------
        RunResult

        Raises
        ------
        InvalidProgramError
            The emulator refuses the program (message names the command index).
        RunnerConnectionError
            The server cannot be reached or the session broke.
        """
        if self._default is None:
            self._default = self.device()
        return self._default.run(program, inputs, params, profile, trace)

    def state(self) -> dict[str, np.ndarray]:
        """The default device's persistent state tensors."""
        if self._default is None:
            self._default = self.device()
        return self._default.state()

    def reset(self) -> None:
        """Forget the default device's state (the next :meth:`run` starts clean)."""
        if self._default is not None:
            self._default.close()
            self._default = None

    def run_many(self, jobs: Iterable, return_exceptions: bool = False) -> list:
        """Run independent jobs, each on fresh state; results come back in job order.

        Parameters
        ----------
        jobs : iterable of RunJob, dict or tuple
            The runs (see :meth:`RunJob.coerce`).
        return_exceptions : bool
            If true, a failed job's slot holds its exception; otherwise the first failure
            (in job order) is raised after all jobs ended.

        Returns
        -------
        list of RunResult (or exceptions)
        """
        jobs = [RunJob.coerce(j) for j in jobs]
        channel = self._channel() if jobs else None
        return _finish([_run_job(channel, job, self.spec) for job in jobs], return_exceptions)

    def close(self) -> None:
        """Close the default device and the session(s)."""
        self.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _run_job(channel: _Channel, job: RunJob, spec):
    """One stateless run; an edgetvm error becomes the job's result, not a batch abort."""
    try:
        return channel.run(job, spec, None)
    except EdgeTVMError as exc:
        return exc


