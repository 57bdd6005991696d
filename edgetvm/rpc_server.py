"""The NPU emulator behind TVM RPC: ``python -m edgetvm.rpc_server``.

Usage::

    python -m edgetvm.rpc_server --host 127.0.0.1 --port 9190
    python -m edgetvm.rpc_server --port 9190 --port-end 9200 \\
        --tracker 127.0.0.1:9191 --key edgetvm-npu --spec edge-npu-16mb

The server is a plain :class:`tvm.rpc.Server`; edgetvm adds a handful of global functions
(``edgetvm.emulator.*``, see :func:`register_functions`) that run programs on the
emulator. This module holds the emulator service (the devices of one session), the RPC
functions that expose it, the server's start-up and its command line. Clients use
:mod:`edgetvm.runner`; the wire format (request / result envelopes) is defined in
:mod:`edgetvm.rpc_protocol` and re-exported here.

How TVM RPC (0.27) serves connections, and what it means for device state
-------------------------------------------------------------------------
Read from ``tvm/rpc/server.py`` and checked by experiment:

* ``rpc.Server`` starts a ``PopenWorker`` child (``python -m tvm.exec.popen_worker``).
  ``server_init_callback`` runs in that child, which then binds the port and runs the
  listen loop in a thread. Functions registered by the *launcher* process are invisible,
  which is why this module registers its functions from the init callback.
* The listen loop is serial: it accepts one connection, then ``_serving`` forks a
  ``multiprocessing.Process`` (fork start method) that runs the RPC session loop, and
  *joins it* before accepting the next connection. So a server runs **one session at a
  time**; a second client's connect blocks until the first session ends (use a tracker
  with several servers for parallelism).
* Every session is a **fresh fork** of the listening process: it inherits the registered
  functions and whatever the init callback imported, but anything a session creates dies
  with the session. Device state (the KV cache, :attr:`Emulator.state`) therefore lives
  exactly as long as one client session: all calls on one connection reach the same
  process and see the same state; a reconnect starts from a clean device.
* A server registered with a tracker only accepts the random match key the tracker hands
  out, so it cannot be reached directly with the plain key, only through the tracker.

Consequently a device is opened per session (``edgetvm.emulator.open``) and addressed by
a handle that embeds the session's pid: a handle kept from an earlier session is refused
with a clear error instead of silently reaching another device's state.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from edgetvm.errors import EdgeTVMError, SpecError
# the wire protocol, re-exported: code written against this module imports it from here
from edgetvm.rpc_protocol import (FUNC_PREFIX, PROTOCOL_VERSION,  # noqa: F401
                                  decode_run_result, encode_run_result, error_payload,
                                  pack_message, spec_payload, to_jsonable, unpack_message)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9190
DEFAULT_KEY = "edgetvm-npu"
DEFAULT_SPEC = "edge-npu-16mb"


# ----------------------------------------------------------------------------------------
# the service: devices of one session
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Device:
    handle: str
    spec: Any
    profile: str | None
    emulator: Any


class EmulatorService:
    """The emulator devices of one RPC session (or of one :class:`~edgetvm.runner.LocalRunner`).

    Both the RPC functions and the local runner call these methods, so local and remote
    runs take the same path; only the transport differs.

    Parameters
    ----------
    default_spec : NPUSpec or str, optional
        The spec used when a request names none (the server's ``--spec``).
    server : dict, optional
        Identity reported with every result (address, key, pid of the listening server).
    """

    #: how many deserialised programs a session keeps (decode loops resend the same bytes)
    PROGRAM_CACHE = 8

    def __init__(self, default_spec=DEFAULT_SPEC, server: Mapping[str, Any] | None = None):
        self._default_spec = default_spec
        self._specs: dict[str, Any] = {}
        self._devices: dict[str, _Device] = {}
        self._handles = itertools.count(1)
        self._programs: OrderedDict[bytes, Any] = OrderedDict()
        self._server = dict(server or {})

    # -- identity ------------------------------------------------------------------------
    def server_info(self) -> dict:
        """Which process serves this call: ``pid`` (this session) and the server's identity."""
        info = {"address": None, "key": None, "server_pid": os.getpid()}
        info.update(self._server)
        info["pid"] = os.getpid()
        return info

    def info(self) -> dict:
        """What ``edgetvm.emulator.info`` reports: versions, presets, default spec, devices."""
        from edgetvm.target.spec import list_presets
        spec = self.resolve_spec(None)
        return {**self.server_info(), "edgetvm_version": _edgetvm_version(),
                "protocol": PROTOCOL_VERSION, "specs": list_presets(),
                "default_spec": spec.name, "default_spec_hash": spec.hash(),
                "devices": sorted(self._devices)}

    # -- specs ---------------------------------------------------------------------------
    def resolve_spec(self, payload: Mapping[str, Any] | str | None):
        """Turn a :func:`spec_payload` (or a preset name, or ``None``) into an NPUSpec.

        Raises
        ------
        SpecError
            If the spec cannot be built or its hash differs from the client's (the two
            sides would otherwise measure different devices under one tuning-log key).
        """
        from edgetvm.target.spec import NPUSpec, load_spec, spec_from_dict
        if payload is None:
            payload = self._default_spec
        if isinstance(payload, NPUSpec):
            return payload
        if isinstance(payload, str):
            payload = {"name": payload}
        key = payload.get("hash") or "name:" + payload["name"]
        if key not in self._specs:
            if "fields" in payload:
                spec = spec_from_dict(payload["fields"], source=f"client spec {payload['name']!r}")
            else:
                spec = load_spec(payload["name"])
            if payload.get("hash") and spec.hash() != payload["hash"]:
                raise SpecError(f"spec {payload['name']!r}: hash {spec.hash()} on the server "
                                f"!= {payload['hash']} on the client")
            self._specs[key] = spec
        return self._specs[key]

    # -- devices -------------------------------------------------------------------------
    def open_device(self, spec=None, profile: str | None = None) -> str:
        """Create an emulator with its own persistent state and return its handle.

        The handle embeds this process's pid: state lives in the session process
        (module docstring), so a handle from another session must not resolve here.
        """
        from edgetvm.target.emulator import Emulator
        spec = self.resolve_spec(spec)
        handle = f"{os.getpid()}-{next(self._handles)}"
        self._devices[handle] = _Device(handle, spec, profile, Emulator(spec, profile=profile))
        return handle

    def close_device(self, handle: str) -> None:
        """Forget a device and its state (unknown handles are ignored: closing is idempotent)."""
        self._devices.pop(handle, None)

    def device(self, handle: str) -> _Device:
        """Look up an open device; a stale or foreign handle is an :class:`EdgeTVMError`."""
        try:
            return self._devices[handle]
        except KeyError:
            raise EdgeTVMError(
                f"unknown device handle {handle!r} on server pid {os.getpid()}: device state "
                "lives only as long as the RPC session that opened it; open a new device"
            ) from None

    def device_state(self, handle: str) -> dict[str, np.ndarray]:
        """Copies of a device's persistent DRAM state tensors (e.g. the KV cache)."""
        return {k: np.array(v) for k, v in self.device(handle).emulator.state.items()}

    # -- running -------------------------------------------------------------------------
    def load_program(self, program):
        """A Program from a Program or its serialised bytes (small LRU on the bytes' digest)."""
        if not isinstance(program, (bytes, bytearray, memoryview)):
            return program
        from edgetvm.target import program_format
        digest = hashlib.blake2b(program, digest_size=16).digest()
        if digest in self._programs:
            self._programs.move_to_end(digest)
        else:
            self._programs[digest] = program_format.loads(bytes(program))
            while len(self._programs) > self.PROGRAM_CACHE:
                self._programs.popitem(last=False)
        return self._programs[digest]

    def _device_for(self, device: str, spec) -> _Device:
        dev = self.device(device)
        if spec is not None and self.resolve_spec(spec).hash() != dev.spec.hash():
            raise SpecError(f"device {device} emulates {dev.spec.name!r} "
                            f"({dev.spec.hash()}); the request names another spec")
        return dev

    def run(self, program, inputs: Mapping[str, np.ndarray], params: Mapping[str, int] | None = None,
            spec=None, profile: str | None = None, device: str | None = None,
            trace: bool = False) -> dict:
        """Run a program on a device (or on fresh state) and return JSON-able results.

        Parameters
        ----------
        program : Program or bytes
            The command stream, or its :mod:`program_format` bytes.
        inputs : mapping of str to numpy.ndarray
            The program's ``input`` tensors (a ``state`` tensor given here overwrites the
            device's copy).
        params : mapping of str to int, optional
            Runtime parameters (valid length, position, ...).
        spec : dict, str or None
            :func:`spec_payload` of the NPU to emulate; ``None`` for the default (or, with
            ``device``, the device's spec).
        profile : str, optional
            Power profile for this run; ``None`` for the device's (or the spec's default).
        device : str, optional
            Handle from :meth:`open_device`; ``None`` runs on a fresh emulator, so the run
            neither sees nor leaves persistent state.
        trace : bool
            Record the per-command trace too.

        Returns
        -------
        dict
            ``outputs`` (arrays), ``counters`` (JSON dict), ``trace`` (list of
            :class:`TraceEvent` or ``None``), ``power_mw`` / ``power_window_starts``
            (arrays), ``run_s`` (seconds inside the emulator) and ``server``
            (:meth:`server_info`).
        """
        from edgetvm.target.emulator import Emulator
        program = self.load_program(program)
        if device is None:
            emulator = Emulator(self.resolve_spec(spec), profile=profile)
            saved = emulator.profile
        else:
            emulator = self._device_for(device, spec).emulator
            saved = emulator.profile
            # the power profile is a per-run setting of one device (its state is shared)
            emulator.profile = emulator.spec.profile(profile) if profile else saved
        t0 = time.perf_counter()
        try:
            res = emulator.run(program, dict(inputs), dict(params) if params else None,
                               trace=bool(trace))
        finally:
            emulator.profile = saved
        return {"outputs": dict(res.outputs), "counters": to_jsonable(res.counters),
                "trace": list(res.trace) if trace else None,
                "power_mw": res.power_mw, "power_window_starts": res.power_window_starts,
                "run_s": time.perf_counter() - t0, "server": self.server_info()}


def _edgetvm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgetvm")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


# ----------------------------------------------------------------------------------------
# RPC functions (bytes in, bytes out)
# ----------------------------------------------------------------------------------------
def _guarded(fn):
    """Wrap a handler so every failure travels back as an error envelope, not an RPCError.

    TVM would turn a raised exception into ``RPCError: Error caught from RPC call`` with
    the type and attributes lost; the envelope keeps them (see :func:`error_payload`).
    """
    @functools.wraps(fn)
    def wrapper(*args):
        try:
            meta, arrays = fn(*args)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the client intact
            return pack_message({"error": error_payload(exc)})
        return pack_message(meta, arrays)
    return wrapper


def register_functions(service: EmulatorService) -> list[str]:
    """Register the ``edgetvm.emulator.*`` global functions for ``service``.

    Functions (all bytes are :func:`pack_message` envelopes; a failure comes back as an
    envelope with an ``error`` entry):

    ``info() -> str``
        JSON: pid, server pid, edgetvm version, presets, default spec, open devices.
    ``open(request) -> result``
        request meta ``{"spec", "profile"}``; result meta ``{"device": handle}``.
    ``close(handle: str) -> result``
        forget a device.
    ``state(handle: str) -> result``
        the device's persistent state tensors as arrays.
    ``run(program_bytes, request) -> result``
        request meta ``{"spec", "profile", "params", "device", "trace"}`` + input arrays;
        result meta ``{"counters", "trace", "run_s", "server"}`` + output arrays.

    Parameters
    ----------
    service : EmulatorService
        The object holding this process's devices.

    Returns
    -------
    list of str
        The registered function names.
    """
    import tvm_ffi

    def _info():
        return json.dumps(service.info())

    def _open(request):
        meta, _ = unpack_message(request)
        return {"device": service.open_device(meta.get("spec"), meta.get("profile"))}, None

    def _close(handle):
        service.close_device(str(handle))
        return {}, None

    def _state(handle):
        return {}, service.device_state(str(handle))

    def _run(program_bytes, request):
        meta, inputs = unpack_message(request)
        res = service.run(bytes(program_bytes), inputs, meta.get("params"), meta.get("spec"),
                          meta.get("profile"), meta.get("device"), bool(meta.get("trace")))
        return encode_run_result(res)

    funcs = {"info": _info, "open": _guarded(_open), "close": _guarded(_close),
             "state": _guarded(_state), "run": _guarded(_run)}
    for name, fn in funcs.items():
        tvm_ffi.register_global_func(FUNC_PREFIX + name, fn, override=True)
    return [FUNC_PREFIX + n for n in funcs]


def _server_init(key: str, spec_name: str) -> None:
    """``server_init_callback``: runs in TVM's server process before it binds the port.

    Every session is a fork of this process, so what is imported here is paid once, not
    per connection; the service object registered here starts empty in every session.
    """
    # Ctrl-C in a terminal reaches the whole process group; the launcher (main) stops this
    # process itself, so ignoring SIGINT here avoids a second traceback from the child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import edgetvm.target.emulator  # noqa: F401  (pre-import: sessions fork warm)
    from edgetvm.target import program_format  # noqa: F401
    spec = EmulatorService(spec_name).resolve_spec(None)  # fail early on a bad --spec
    server = {"key": key, "server_pid": os.getpid(), "address": None}
    service = _SessionService(spec, server)
    register_functions(service)


class _SessionService(EmulatorService):
    """An :class:`EmulatorService` that learns the bound port once the server listens.

    The init callback runs before TVM binds (the port may come from a range), so the
    address is read from TVM's server state, which the session process inherits.
    """

    def server_info(self) -> dict:
        info = super().server_info()
        if info.get("address") is None:
            try:
                from tvm.rpc.server import PopenRPCServerState
                state = PopenRPCServerState.current
                info["address"] = f"{state.host}:{state.port}"
            except (ImportError, AttributeError):  # internal of TVM; identity stays partial
                pass
        return info


def serve(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, port_end: int | None = None,
          key: str = DEFAULT_KEY, tracker: tuple[str, int] | None = None,
          spec: str = DEFAULT_SPEC, silent: bool = True):
    """Start an emulator RPC server (in TVM's server child process) and return it.

    Parameters
    ----------
    host : str
        Address to bind; loopback by default (TVM's own default is ``0.0.0.0``, and TVM
        RPC executes arbitrary code for whoever connects).
    port, port_end : int
        Bind the first free port in ``[port, port_end)``; ``port_end`` defaults to
        ``port + 1`` (exactly ``port``).
    key : str
        Device key, matched by clients and by the tracker.
    tracker : (str, int), optional
        Register with this RPC tracker.
    spec : str
        Default NPU spec (preset name or JSON path) for requests that name none.
    silent : bool
        Silence TVM's per-connection log lines.

    Returns
    -------
    tvm.rpc.Server
        ``.port`` is the bound port; ``.terminate()`` stops it.
    """
    from tvm import rpc

    # The callback is cloudpickled to TVM's server process. Under `python -m` this module
    # is __main__, whose functions cloudpickle copies by value (with unpicklable globals);
    # the importable module's function is pickled by reference instead.
    from edgetvm import rpc_server as importable
    init = functools.partial(importable._server_init, key, spec)
    return rpc.Server(host, port=port, port_end=port_end or port + 1, key=key,
                      tracker_addr=tracker, silent=silent, server_init_callback=init)


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
    if not text or any(c.isspace() for c in text) or ":" in text:
        raise argparse.ArgumentTypeError(f"key must be non-empty, without spaces or ':': {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m edgetvm.rpc_server`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m edgetvm.rpc_server",
        description="Serve the edgetvm NPU emulator over TVM RPC (one session at a time; "
                    "register several servers with a tracker for parallel runs).")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to bind (default %(default)s; TVM RPC runs arbitrary code "
                        "for any client, so only bind other addresses on trusted networks)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT, help="port (default %(default)s)")
    p.add_argument("--port-end", type=_port, default=None,
                   help="search free ports in [port, port-end) (default: exactly --port)")
    p.add_argument("--tracker", type=_host_port, default=None, metavar="HOST:PORT",
                   help="register with this TVM RPC tracker")
    p.add_argument("--key", type=_key, default=DEFAULT_KEY, help="device key (default %(default)s)")
    p.add_argument("--spec", default=DEFAULT_SPEC,
                   help="default NPU spec: preset name or JSON file (default %(default)s)")
    p.add_argument("--verbose", action="store_true", help="log every connection (TVM's logger)")
    return p


def _parse_args(argv) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.port_end is not None and args.port_end <= args.port:
        parser.error(f"--port-end {args.port_end} must be greater than --port {args.port}")
    try:  # validate here: a bad spec inside TVM's child would only surface as a traceback
        EmulatorService(args.spec).resolve_spec(None)
    except EdgeTVMError as exc:
        parser.error(f"--spec: {exc}")
    return args


def _tracker_reachable(addr: tuple[str, int]) -> bool:
    # TVM's server retries an unreachable tracker for 60 s in a background thread and
    # then dies silently; check once up front and fail with a message instead.
    try:
        with socket.create_connection(addr, timeout=5):
            return True
    except OSError:
        return False


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    """Entry point of ``python -m edgetvm.rpc_server``; returns the exit status."""
    args = _parse_args(argv)
    if args.tracker and not _tracker_reachable(args.tracker):
        print(f"error: cannot reach RPC tracker at {args.tracker[0]}:{args.tracker[1]}",
              file=sys.stderr)
        return 1
    # SIGTERM (e.g. the process group being stopped) takes the same clean path as Ctrl-C;
    # SIGINT is set too because a shell starts background jobs with SIGINT ignored
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    server = None
    try:
        try:
            server = serve(args.host, args.port, args.port_end, args.key, args.tracker,
                           args.spec, silent=not args.verbose)
        except (OSError, ValueError, RuntimeError) as exc:  # e.g. no free port in range
            # TVM re-raises the child's error with its traceback in the message: keep the gist
            gist = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [repr(exc)]
            print(f"error: cannot start server on {args.host}:{args.port}: {gist[0]} "
                  "(port in use? give a range with --port-end)", file=sys.stderr)
            return 1
        via = f", tracker {args.tracker[0]}:{args.tracker[1]}" if args.tracker else ""
        print(f"listening on {args.host}:{server.port} (key {args.key}, spec {args.spec}{via})",
              flush=True)
        server.proc.join()  # returns only if TVM's server process dies
        print("error: server process exited", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("stopped", flush=True)
        return 0
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    sys.exit(main())
