"""The emulator service: the devices of one session and the calls they answer.

Both an RPC session (:mod:`edgetvm.rpc_server`) and :class:`~edgetvm.runner.LocalRunner`
call these methods, so local and remote runs take the same path; only the transport
differs. Every argument is checked here before anything is allocated for it: a request is
data (a program, arrays, integers, a spec by preset name or by fields), and one that does
not fit the :class:`ServiceLimits` is refused with a :class:`~edgetvm.errors.RequestRefused`
naming the limit.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import time
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from edgetvm.errors import EdgeTVMError, RequestRefused, SpecError
from edgetvm.rpc_protocol import PROTOCOL_VERSION, to_jsonable

DEFAULT_SPEC = "edge-npu-16mb"
MB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ServiceLimits:
    """What one request may cost a server.

    Attributes
    ----------
    max_request_bytes : int
        Largest request frame (program, inputs and header together).
    max_tensor_bytes : int
        Largest total of a program's declared DRAM tensors (inputs, outputs, state,
        scratch, weights), of a request's arrays, and of a client spec's TCM.
    max_devices : int
        Devices one session may hold open (each keeps its state tensors).
    """

    max_request_bytes: int = 256 * MB
    max_tensor_bytes: int = 1024 * MB
    max_devices: int = 16


@dataclasses.dataclass
class _Device:
    handle: str
    spec: Any
    profile: str | None
    emulator: Any


# client specs: fields bounded so that a few bytes of spec cannot make a small program
# allocate or simulate without end (the power trace has one entry per window of cycles)
_SPEC_BOUNDS = {"power_window_cycles": (100, None), "dram_bytes_per_cycle": (1e-3, None),
                "clock_mhz": (1e-3, 1e6), "dma_channels": (1, 64), "vector_lanes": (1, 1 << 16),
                "dma_setup_cycles": (0, 1 << 20), "launch_cycles": (0, 1 << 20),
                "event_sync_cycles": (0, 1 << 20), "host_switch_cycles": (0, 1 << 24),
                "host_flops_per_cycle": (1e-3, None)}


class EmulatorService:
    """The emulator devices of one RPC session (or of one local runner).

    Parameters
    ----------
    default_spec : NPUSpec or str, optional
        The spec used when a request names none (the server's ``--spec``).
    server : dict, optional
        Identity reported with every result (address, key, pid of the listening server).
    limits : ServiceLimits, optional
        What a request may cost (default :class:`ServiceLimits`).
    """

    #: how many deserialised programs a session keeps (decode loops resend the same bytes)
    PROGRAM_CACHE = 8

    def __init__(self, default_spec=DEFAULT_SPEC, server: Mapping[str, Any] | None = None,
                 limits: ServiceLimits | None = None):
        self._default_spec = default_spec
        self._specs: dict[str, Any] = {}
        self._devices: dict[str, _Device] = {}
        self._handles = itertools.count(1)
        self._programs: OrderedDict[bytes, Any] = OrderedDict()
        self._server = dict(server or {})
        self.limits = limits or ServiceLimits()

    # -- identity ------------------------------------------------------------------------
    def server_info(self) -> dict:
        """Which process serves this call: ``pid`` (this session) and the server's identity."""
        info = {"address": None, "key": None, "server_pid": os.getpid()}
        info.update(self._server)
        info["pid"] = os.getpid()
        return info

    def info(self) -> dict:
        """Versions, presets, default spec, open devices and the request limits."""
        from edgetvm.target.spec import list_presets
        spec = self.resolve_spec(None)
        return {**self.server_info(), "edgetvm_version": _edgetvm_version(),
                "protocol": PROTOCOL_VERSION, "specs": list_presets(),
                "default_spec": spec.name, "default_spec_hash": spec.hash(),
                "devices": sorted(self._devices), "limits": dataclasses.asdict(self.limits)}

    # -- specs ---------------------------------------------------------------------------
    def resolve_spec(self, payload):
        """Turn a :func:`~edgetvm.rpc_protocol.spec_payload` into an NPUSpec.

        ``None`` is the default spec; a client names a preset (``{"name": preset}``) or
        sends the fields (``{"name", "hash", "fields"}``), never a path: a server does not
        read files for its clients, nor tells them which exist.

        Raises
        ------
        RequestRefused
            The payload is neither form, names no preset, or its fields are out of bounds.
        SpecError
            The fields do not make a valid spec, or their hash differs from the client's
            (the two sides would otherwise measure different devices under one key).
        """
        from edgetvm.target.spec import NPUSpec, list_presets, load_spec, spec_from_dict
        if payload is None:
            payload = self._default_spec
            if isinstance(payload, NPUSpec):
                return payload
            key = "default"
            if key not in self._specs:
                self._specs[key] = load_spec(payload)     # the operator's own choice
            return self._specs[key]
        if isinstance(payload, NPUSpec):            # in-process callers
            return payload
        if not isinstance(payload, Mapping) or not isinstance(payload.get("name"), str):
            raise RequestRefused("spec must be {'name': preset} or {'name', 'hash', 'fields'}")
        if "fields" not in payload:
            if payload["name"] not in list_presets():
                raise RequestRefused(f"unknown spec preset {payload['name']!r}; presets: "
                                     f"{', '.join(list_presets())} (send other specs by fields)")
            key = "preset:" + payload["name"]
            if key not in self._specs:
                self._specs[key] = load_spec(payload["name"])
            return self._specs[key]
        if not isinstance(payload["fields"], Mapping) or not isinstance(payload.get("hash"), str):
            raise RequestRefused("spec fields must be an object, with the client's spec hash")
        key = "hash:" + payload["hash"]
        if key not in self._specs:
            spec = spec_from_dict(dict(payload["fields"]),
                                  source=f"client spec {payload['name']!r}")
            self._check_client_spec(spec)
            if spec.hash() != payload["hash"]:
                raise SpecError(f"spec {payload['name']!r}: hash {spec.hash()} on the server "
                                f"!= {payload['hash']} on the client")
            self._specs[key] = spec
        return self._specs[key]

    def _check_client_spec(self, spec) -> None:
        if spec.tcm_bytes > self.limits.max_tensor_bytes:
            raise RequestRefused(f"client spec {spec.name!r}: tcm_bytes {spec.tcm_bytes} over "
                                 f"this server's limit of {self.limits.max_tensor_bytes}")
        for name, (lo, hi) in _SPEC_BOUNDS.items():
            value = getattr(spec, name)
            if value < lo or (hi is not None and value > hi):
                raise RequestRefused(f"client spec {spec.name!r}: {name} = {value} outside "
                                     f"[{lo}, {hi if hi is not None else 'inf'}]")
        if max(spec.vector_op_cycles.values()) > (1 << 20):
            raise RequestRefused(f"client spec {spec.name!r}: a vector op over 2^20 cycles")

    # -- devices -------------------------------------------------------------------------
    def open_device(self, spec=None, profile: str | None = None) -> str:
        """Create an emulator with its own persistent state and return its handle.

        The handle embeds this process's pid: state lives in the session process, so a
        handle from another session must not resolve here.
        """
        from edgetvm.target.emulator import Emulator
        if len(self._devices) >= self.limits.max_devices:
            raise RequestRefused(f"this session already holds {len(self._devices)} devices "
                                 f"(limit {self.limits.max_devices}); close one first")
        spec = self.resolve_spec(spec)
        profile = _check_profile(spec, profile)
        handle = f"{os.getpid()}-{next(self._handles)}"
        self._devices[handle] = _Device(handle, spec, profile, Emulator(spec, profile=profile))
        return handle

    def close_device(self, handle: str) -> None:
        """Forget a device and its state (unknown handles are ignored: closing is idempotent)."""
        self._devices.pop(_check_str(handle, "device handle"), None)

    def device(self, handle: str) -> _Device:
        """Look up an open device; a stale or foreign handle is an :class:`EdgeTVMError`."""
        try:
            return self._devices[_check_str(handle, "device handle")]
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
        """A Program from a Program or its serialised bytes (small LRU on the bytes' digest),
        refused if its declared DRAM tensors exceed the limit."""
        if not isinstance(program, (bytes, bytearray, memoryview)):
            from edgetvm.target.isa import Program
            if not isinstance(program, Program):
                raise RequestRefused(f"a program is bytes (program_format.dumps) or a Program, "
                                     f"not {type(program).__name__}")
            self._check_program(program)
            return program
        from edgetvm.target import program_format
        digest = hashlib.blake2b(program, digest_size=16).digest()
        if digest in self._programs:
            self._programs.move_to_end(digest)
        else:
            loaded = program_format.loads(bytes(program))
            self._check_program(loaded)
            self._programs[digest] = loaded
            while len(self._programs) > self.PROGRAM_CACHE:
                self._programs.popitem(last=False)
        return self._programs[digest]

    def _check_program(self, program) -> None:
        total = sum(t.nbytes for t in program.tensors.values())
        if total > self.limits.max_tensor_bytes:
            raise RequestRefused(f"program {program.name!r} declares {total} bytes of DRAM "
                                 f"tensors, over this server's limit of "
                                 f"{self.limits.max_tensor_bytes} (--max-tensor-mb)")

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
            device's copy), each of exactly the declared shape and dtype: nothing is cast.
        params : mapping of str to int, optional
            Runtime parameters (valid length, position, ...).
        spec : dict or None
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
            ``TraceEvent`` or ``None``), ``power_mw`` / ``power_window_starts``
            (arrays), ``run_s`` (seconds inside the emulator) and ``server``.
        """
        from edgetvm.target.emulator import Emulator
        program = self.load_program(program)
        _check_inputs(program, inputs)
        params = _check_params(params)
        if not isinstance(trace, bool):
            raise RequestRefused(f"trace must be true or false, not {type(trace).__name__}")
        if device is None:
            spec = self.resolve_spec(spec)
            emulator = Emulator(spec, profile=_check_profile(spec, profile))
            saved = emulator.profile
        else:
            emulator = self._device_for(device, spec).emulator
            saved = emulator.profile
            # the power profile is a per-run setting of one device (its state is shared)
            profile = _check_profile(emulator.spec, profile)
            emulator.profile = emulator.spec.profile(profile) if profile else saved
        t0 = time.perf_counter()
        try:
            res = emulator.run(program, dict(inputs), params, trace=trace)
        finally:
            emulator.profile = saved
        return {"outputs": dict(res.outputs), "counters": to_jsonable(res.counters),
                "trace": list(res.trace) if trace else None,
                "power_mw": res.power_mw, "power_window_starts": res.power_window_starts,
                "run_s": time.perf_counter() - t0, "server": self.server_info()}


def _check_str(value, what: str) -> str:
    if not isinstance(value, str):
        raise RequestRefused(f"{what} must be a string, not {type(value).__name__}")
    return value


def _check_profile(spec, profile):
    if profile is None:
        return None
    _check_str(profile, "profile")
    if profile not in spec.power_profiles:
        raise RequestRefused(f"{spec.name}: no power profile {profile!r}; known: "
                             f"{', '.join(spec.power_profiles)}")
    return profile


def _check_params(params):
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise RequestRefused(f"params must map names to integers, not {type(params).__name__}")
    bad = [k for k, v in params.items()
           if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, np.integer))]
    if bad:
        raise RequestRefused(f"runtime parameters must be integers: {bad}")
    return {k: int(v) for k, v in params.items()}


def _check_inputs(program, inputs) -> None:
    """Inputs by name, each a numeric array of exactly the declared shape and dtype."""
    if not isinstance(inputs, Mapping):
        raise RequestRefused(f"inputs must map names to arrays, not {type(inputs).__name__}")
    for name, arr in inputs.items():
        decl = program.tensors.get(name)
        if decl is None or decl.kind not in ("input", "state"):
            continue                     # the emulator names unknown inputs itself
        if not isinstance(arr, np.ndarray):
            raise RequestRefused(f"input {name!r} must be an array, not {type(arr).__name__}")
        if arr.dtype != np.dtype(decl.dtype) or tuple(arr.shape) != tuple(decl.shape):
            raise RequestRefused(f"input {name!r}: {arr.dtype}{list(arr.shape)}, the program "
                                 f"declares {decl.dtype}{list(decl.shape)} (inputs are not cast)")


def _edgetvm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("edgetvm")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"
