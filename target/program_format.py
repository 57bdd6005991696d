"""The on-disk format of a program (``.npuprog``), versioned and checksummed.

Layout (little endian)::

    magic      8 bytes   b"EDGENPU\\0"
    version    u32       FORMAT_VERSION
    json_len   u64
    json       json_len bytes, UTF-8: {"name", "params", "emulator_model", "tcm_bytes",
               "spec_hash", "metadata", "tensors": [{name, shape, dtype, kind, data_offset?,
               data_nbytes?}], "commands": [{"command": <command type>, <fields>}]}
    blob_len   u64
    blob       const tensor data, each at its data_offset (C order)
    sha256     32 bytes  over everything before it

Operands encode as ``{"tcm": [offset, rows, cols, dtype, row_stride]}`` and
``{"dram": [tensor, rows, cols, row_stride, offset]}``; an affine value as
``{"affine": [const, [[param, coef], ...]]}``. Loading another version, a truncated or
altered file, or something that is not a program raises :class:`ProgramFormatError`.
``emulator_model`` is the emulator model version the program was written under
(``Program.emulator_model``, ``spec.EMULATOR_MODEL_VERSION`` for a new program; files
without it predate the field: model 1).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import struct

import numpy as np

from edgetvm.errors import ProgramFormatError

from .isa import COMMAND_TYPES, Affine, DramRef, Program, TcmRef, TensorDecl

MAGIC = b"EDGENPU\0"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sIQ")


def _enc(v):
    if isinstance(v, TcmRef):
        return {"tcm": [v.offset, v.shape[0], v.shape[1], v.dtype, v.row_stride]}
    if isinstance(v, DramRef):
        return {"dram": [v.tensor, v.shape[0], v.shape[1], v.row_stride, _enc(v.offset)]}
    if isinstance(v, Affine):
        return {"affine": [v.const, [list(t) for t in v.terms]]}
    if isinstance(v, tuple):
        return [_enc(x) for x in v]
    if isinstance(v, (np.integer, np.floating)):
        return v.item()
    return v


def _dec(v):
    if isinstance(v, dict):
        if "tcm" in v:
            off, r, c, dt, st = v["tcm"]
            return TcmRef(off, (r, c), dt, st)
        if "dram" in v:
            t, r, c, st, off = v["dram"]
            return DramRef(t, (r, c), st, _dec(off))
        if "affine" in v:
            const, terms = v["affine"]
            return Affine(const, tuple((n, c) for n, c in terms))
        raise ValueError(f"unknown operand {sorted(v)}")
    if isinstance(v, list):
        return tuple(_dec(x) for x in v)
    return v


def dumps(program: Program) -> bytes:
    blob = bytearray()
    tensors = []
    for t in program.tensors.values():
        d = {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "kind": t.kind}
        if t.data is not None:
            raw = np.ascontiguousarray(t.data, dtype=t.dtype).tobytes()
            d["data_offset"], d["data_nbytes"] = len(blob), len(raw)
            blob += raw
        tensors.append(d)
    cmds = []
    for c in program.commands:
        d = {"command": type(c).__name__}   # not "op": Vector has a field named op
        for f in dataclasses.fields(c):
            d[f.name] = _enc(getattr(c, f.name))
        cmds.append(d)
    header = {"name": program.name, "params": list(program.params),
              "emulator_model": program.emulator_model,
              "tcm_bytes": program.tcm_bytes, "spec_hash": program.spec_hash,
              "metadata": program.metadata, "tensors": tensors, "commands": cmds}
    js = json.dumps(header, separators=(",", ":")).encode()
    body = _HEAD.pack(MAGIC, FORMAT_VERSION, len(js)) + js + struct.pack("<Q", len(blob)) + blob
    return body + hashlib.sha256(body).digest()


def loads(data: bytes, source: str = "<bytes>") -> Program:
    data = bytes(data)
    if len(data) < _HEAD.size + 8 + 32 or data[:8] != MAGIC:
        raise ProgramFormatError(f"{source}: not an edgetvm NPU program (bad magic or too short)")
    _, version, jlen = _HEAD.unpack_from(data)
    if version != FORMAT_VERSION:
        raise ProgramFormatError(f"{source}: program format version {version}; this edgetvm "
                                 f"reads version {FORMAT_VERSION}. Recompile the model.")
    body, digest = data[:-32], data[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise ProgramFormatError(f"{source}: checksum mismatch: the file is truncated or damaged")
    try:
        js = json.loads(body[_HEAD.size:_HEAD.size + jlen])
        (blen,) = struct.unpack_from("<Q", body, _HEAD.size + jlen)
        blob = body[_HEAD.size + jlen + 8:]
        if len(blob) != blen:
            raise ValueError("blob length mismatch")
        tensors = {}
        for t in js["tensors"]:
            data_arr = None
            if "data_offset" in t:
                raw = blob[t["data_offset"]:t["data_offset"] + t["data_nbytes"]]
                data_arr = np.frombuffer(raw, dtype=t["dtype"]).reshape(t["shape"]).copy()
            tensors[t["name"]] = TensorDecl(t["name"], tuple(t["shape"]), t["dtype"], t["kind"],
                                            data_arr)
        cmds = []
        for c in js["commands"]:
            cls = COMMAND_TYPES[c.pop("command")]
            cmds.append(cls(**{k: _dec(v) for k, v in c.items()}))
        return Program(js["name"], cmds, tensors, tuple(js["params"]), js["tcm_bytes"],
                       js["spec_hash"], js["metadata"], js.get("emulator_model", 1))
    except (KeyError, ValueError, TypeError, json.JSONDecodeError, struct.error) as e:
        raise ProgramFormatError(f"{source}: malformed program: {e}") from None


def save(program: Program, path: str) -> None:
    with open(path, "wb") as f:
        f.write(dumps(program))


def load(path: str) -> Program:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ProgramFormatError(f"{path}: cannot read program: {e}") from None
    return loads(data, source=path)
