"""The edgetvm RPC wire protocol, shared by :mod:`edgetvm.rpc_server` and :mod:`edgetvm.runner`.

A connection opens with TVM RPC's handshake (:data:`RPC_MAGIC`, the key ``client:<key>``;
the server answers :data:`RPC_CODE_SUCCESS` and ``server:<key>``, or
:data:`RPC_CODE_MISMATCH`) and servers register with a TVM RPC tracker in the tracker's
own JSON protocol (:class:`TrackerCode`), so ``python -m tvm.exec.rpc_tracker`` hands
edgetvm servers out unchanged. After the handshake the session is not TVM's generic RPC
session (which lets any client upload files, load shared libraries and write raw
memory): it is a sequence of frames (:func:`send_frame`, :func:`recv_frame`: a length and
the bytes), each request answered by one reply. Requests and replies are made by
:func:`pack_message`: a JSON header plus named numpy arrays, stamped with
:data:`PROTOCOL_VERSION` so that a client and a server of different edgetvm versions
refuse each other instead of misreading each other. This module also holds the
conversions of run results (:func:`encode_run_result`, :func:`decode_run_result`), NPU
specs (:func:`spec_payload`) and server-side errors (:func:`error_payload`). It needs
neither TVM nor a server, only numpy.
"""
from __future__ import annotations

import dataclasses
import io
import json
import struct
import traceback
import zipfile
from typing import Any, Mapping

import numpy as np

from edgetvm.errors import EdgeTVMError

#: bumped whenever the request / result envelopes change incompatibly
PROTOCOL_VERSION = 2
DEFAULT_PORT = 9190
DEFAULT_KEY = "edgetvm-npu"
#: the calls a session serves (request header ``{"call": name, ...}``)
CALLS = ("info", "open", "close", "state", "run")

# TVM RPC's handshake and tracker constants (tvm/rpc/base.py), spelled out so that the
# run-time side needs no TVM; a test checks they agree with TVM's
RPC_MAGIC = 0xFF271
RPC_TRACKER_MAGIC = 0x2F271
RPC_CODE_SUCCESS = RPC_MAGIC + 0
RPC_CODE_MISMATCH = RPC_MAGIC + 2
#: longest handshake key a server reads (TVM's keys are ``client:<key>:<random>``)
MAX_KEY_BYTES = 4096


class TrackerCode:
    """Request codes of TVM's RPC tracker protocol (``tvm.rpc.base.TrackerCode``)."""

    FAIL = -1
    SUCCESS = 0
    PING = 1
    STOP = 2
    PUT = 3
    REQUEST = 4
    UPDATE_INFO = 5
    SUMMARY = 6
    GET_PENDING_MATCHKEYS = 7

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


def unpack_message(blob: bytes, max_array_bytes: int | None = None
                   ) -> tuple[dict, dict[str, np.ndarray]]:
    """Inverse of :func:`pack_message`.

    Parameters
    ----------
    blob : bytes
        A message produced by :func:`pack_message` (possibly by another process).
    max_array_bytes : int, optional
        Refuse the message if its arrays would take more than this once loaded; arrays
        are then also required to be stored uncompressed (as :func:`pack_message` stores
        them), so a small message cannot inflate into a large allocation.

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
    RequestRefused
        If the arrays exceed ``max_array_bytes`` or are compressed.
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
    try:
        meta = json.loads(blob[start:start + n].decode())
        payload = io.BytesIO(blob[start + n:])
        if max_array_bytes is not None:
            _check_npz(payload, max_array_bytes)
        with np.load(payload, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (ValueError, OSError, zipfile.BadZipFile, UnicodeDecodeError) as exc:
        raise EdgeTVMError(f"malformed RPC message: {exc}") from None
    if not isinstance(meta, dict):
        raise EdgeTVMError("malformed RPC message: the header is not a JSON object")
    return meta, arrays


def _check_npz(payload: io.BytesIO, max_bytes: int) -> None:
    from edgetvm.errors import RequestRefused
    with zipfile.ZipFile(payload) as z:
        infos = z.infolist()
    if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
        raise RequestRefused("compressed arrays are not accepted")
    total = sum(i.file_size for i in infos)
    if total > max_bytes:
        raise RequestRefused(f"the request's arrays take {total} bytes, over this server's "
                             f"limit of {max_bytes} bytes (--max-tensor-mb)")
    payload.seek(0)


# ----------------------------------------------------------------------------------------
# sockets: exact reads, frames, the handshake, tracker messages
# ----------------------------------------------------------------------------------------
class ProtocolError(EdgeTVMError):
    """The peer broke the protocol: closed early, sent a bad handshake or an oversized frame."""


_FRAME = struct.Struct("<Q")
_INT = struct.Struct("<i")


def recv_exact(sock, n: int) -> bytes:
    """Read exactly ``n`` bytes (the socket's timeout applies to each read)."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_frame(sock, payload: bytes) -> None:
    """One frame: its length (8 bytes, little endian), then the bytes."""
    sock.sendall(_FRAME.pack(len(payload)) + payload)


def recv_frame(sock, max_bytes: int) -> bytes:
    """Read one frame; a frame declaring more than ``max_bytes`` is refused before any of
    it is read (:class:`~edgetvm.errors.RequestRefused`)."""
    (n,) = _FRAME.unpack(recv_exact(sock, _FRAME.size))
    if n > max_bytes:
        from edgetvm.errors import RequestRefused
        raise RequestRefused(f"request of {n} bytes exceeds this server's limit of "
                             f"{max_bytes} bytes (--max-request-mb)")
    return recv_exact(sock, n)


def send_int(sock, value: int) -> None:
    sock.sendall(_INT.pack(value))


def recv_int(sock) -> int:
    return _INT.unpack(recv_exact(sock, _INT.size))[0]


def send_key(sock, key: str) -> None:
    """A length-prefixed UTF-8 key (TVM's handshake and tracker encoding)."""
    data = key.encode("utf-8")
    sock.sendall(_INT.pack(len(data)) + data)


def recv_key(sock) -> str:
    """Inverse of :func:`send_key`; a negative, empty-but-required or oversized length, or
    bytes that are not UTF-8, are a :class:`ProtocolError` (never an IndexError)."""
    n = recv_int(sock)
    if not 0 <= n <= MAX_KEY_BYTES:
        raise ProtocolError(f"handshake key length {n} out of range 0..{MAX_KEY_BYTES}")
    try:
        return recv_exact(sock, n).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("handshake key is not UTF-8") from None


def send_json(sock, value) -> None:
    """A tracker message: length-prefixed JSON (``tvm.rpc.base.sendjson``)."""
    send_key(sock, json.dumps(value))


def recv_json(sock, max_bytes: int = 1 << 20):
    """Inverse of :func:`send_json`."""
    n = recv_int(sock)
    if not 0 <= n <= max_bytes:
        raise ProtocolError(f"tracker message of {n} bytes")
    return json.loads(recv_exact(sock, n).decode("utf-8"))


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
