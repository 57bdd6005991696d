"""The edgetvm RPC wire protocol, shared by :mod:`edgetvm.rpc_server` and :mod:`edgetvm.runner`.

Every ``edgetvm.emulator.*`` call (names start with :data:`FUNC_PREFIX`) carries bytes
made by :func:`pack_message`: a JSON header plus named numpy arrays, stamped with
:data:`PROTOCOL_VERSION` so that a client and a server of different edgetvm versions
refuse each other instead of misreading each other. This module holds that envelope and
the conversions to and from it of run results (:func:`encode_run_result`,
:func:`decode_run_result`), NPU specs (:func:`spec_payload`) and server-side errors
(:func:`error_payload`). It needs neither TVM nor a server, only numpy.
"""
from __future__ import annotations

import dataclasses
import io
import json
import struct
import traceback
from typing import Any, Mapping

import numpy as np

from edgetvm.errors import EdgeTVMError

#: prefix of every global function this server registers
FUNC_PREFIX = "edgetvm.emulator."
#: bumped whenever the request / result envelopes change incompatibly
PROTOCOL_VERSION = 1

_MAGIC = b"EDGW"
_HEADER = struct.Struct("<4sIQ")  # magic, protocol version, JSON length


def pack_message(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None) -> bytes:
    """Serialise a JSON header plus named numpy arrays into one byte string.

    Parameters
    ----------
    meta : mapping
        JSON-serialisable header (parameters, counters, errors, ...).
    arrays : mapping of str to numpy.ndarray, optional
        Tensors (inputs or outputs), stored as an uncompressed ``.npz`` payload:
        compression would cost more CPU than loopback bandwidth saves.

    Returns
    -------
    bytes
        ``magic | version | len(json) | json | npz``.
    """
    header = json.dumps(meta, separators=(",", ":")).encode()
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(v) for k, v in (arrays or {}).items()})
    return _HEADER.pack(_MAGIC, PROTOCOL_VERSION, len(header)) + header + buf.getvalue()


def unpack_message(blob: bytes) -> tuple[dict, dict[str, np.ndarray]]:
    """Inverse of :func:`pack_message`.

    Parameters
    ----------
    blob : bytes
        A message produced by :func:`pack_message` (possibly by another process).

    Returns
    -------
    meta : dict
        The JSON header.
    arrays : dict of str to numpy.ndarray
        The tensors; object arrays are refused (``allow_pickle=False``), so a message
        can never execute code on the receiving side.

    Raises
    ------
    EdgeTVMError
        If the bytes are not a message of this protocol version.
    """
    blob = bytes(blob)
    if len(blob) < _HEADER.size:
        raise EdgeTVMError("RPC message truncated")
    magic, version, n = _HEADER.unpack_from(blob)
    if magic != _MAGIC:
        raise EdgeTVMError("not an edgetvm RPC message (bad magic)")
    if version != PROTOCOL_VERSION:
        raise EdgeTVMError(f"RPC protocol version {version} != {PROTOCOL_VERSION} "
                           "(client and server run different edgetvm versions)")
    start = _HEADER.size
    meta = json.loads(blob[start:start + n].decode())
    with np.load(io.BytesIO(blob[start + n:]), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return meta, arrays


def to_jsonable(obj: Any) -> Any:
    """Convert emulator results (dataclasses, numpy scalars/arrays, tuples) to JSON data.

    Parameters
    ----------
    obj : object
        Anything the emulator returns as counters or trace.

    Returns
    -------
    object
        Nested dicts / lists / JSON scalars. Objects with a ``to_dict`` method are
        converted with it, so a type can choose its own JSON form.
    """
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    return str(obj)


_OUT = "out/"
_POWER = {"power_mw": "power/mw", "power_window_starts": "power/window_starts"}


def encode_run_result(res: Mapping[str, Any]) -> tuple[dict, dict]:
    """Split :meth:`EmulatorService.run`'s result into a JSON header and named arrays.

    Outputs and the power series share one npz payload under separate prefixes, so an
    output may carry any name.
    """
    arrays = {_OUT + k: v for k, v in res["outputs"].items()}
    arrays.update({key: res[field] for field, key in _POWER.items() if res.get(field) is not None})
    trace = res.get("trace")
    meta = {"outputs": list(res["outputs"]), "counters": res["counters"],
            "trace": None if trace is None else [to_jsonable(e) for e in trace],
            "run_s": res["run_s"], "server": res["server"]}
    return meta, arrays


def decode_run_result(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> dict:
    """Inverse of :func:`encode_run_result`; trace events become ``TraceEvent`` objects again."""
    res = dict(meta)
    res["outputs"] = {k: arrays[_OUT + k] for k in meta["outputs"]}
    for field, key in _POWER.items():
        res[field] = arrays.get(key)
    if meta.get("trace") is not None:
        from edgetvm.target.emulator import TraceEvent
        res["trace"] = [TraceEvent(**e) for e in meta["trace"]]
    return res


def spec_payload(spec) -> dict | None:
    """The JSON form of an NPU spec sent with each request (``None``: server's default).

    Parameters
    ----------
    spec : NPUSpec, str or None
        A spec object (sent in full, so a modified spec reaches the server intact),
        a preset name (resolved on the server) or ``None``.

    Returns
    -------
    dict or None
        ``{"name": ...}`` for a preset name, ``{"name", "hash", "fields"}`` for a spec.
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        return {"name": spec}
    return {"name": spec.name, "hash": spec.hash(), "fields": spec.to_dict()}


def error_payload(exc: BaseException) -> dict:
    """Describe an exception so the client can re-raise it as the same edgetvm error.

    Parameters
    ----------
    exc : BaseException
        The exception caught while serving a call.

    Returns
    -------
    dict
        ``type``, ``module`` and ``message``; for edgetvm errors the JSON-scalar instance
        attributes (e.g. ``command_index``), for anything else the server traceback (a bug
        on the server: the client keeps it as an attribute instead of dumping it).
    """
    cls = type(exc)
    payload = {"type": cls.__name__, "module": cls.__module__, "message": str(exc)}
    if isinstance(exc, EdgeTVMError):
        payload["attrs"] = {k: v for k, v in vars(exc).items()
                            if v is None or isinstance(v, (bool, int, float, str))}
    else:
        payload["traceback"] = "".join(traceback.format_exception(exc))
    return payload
