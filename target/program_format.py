"""The on-disk format of a program (``.npuprog``), versioned and checksummed.

Layout (little endian)::

    magic      8 bytes   b"EDGENPU\\0"
    version    u32       FORMAT_VERSION
    json_len   u64
    json       json_len bytes, UTF-8: {"name", "params", "emulator_model", "tcm_bytes",
               "spec_hash", "metadata", "tensors": [{name, shape, dtype, kind, data_offset?,
               data_nbytes?}], "classes": [[command type, [field, ...]], ...],
               "operands": [operand, ...], "commands": [[class index, field values...]]}
    blob_len   u64
    blob       const tensor data, each at its data_offset (C order)
    sha256     32 bytes  over everything before it

Each command is a list: its class (an index into ``classes``) and its field values in
that class's field order. Operands are written once each, in ``operands``, and referred
to as the string ``"@<index>"`` (a literal string starting with ``@`` gets one more
``@``): ``{"tcm": [offset, rows, cols, dtype, row_stride]}``,
``{"dram": [tensor, rows, cols, row_stride, offset]}``, an affine value
``{"affine": [const, [[param, coef], ...]]}``; tuples are lists. A kernel reuses a few
buffers for thousands of tiles, so the table keeps files small and fast to read. Version
1 files (commands as ``{"command": type, field: value}`` objects, operands inline) are
still read. Loading another version, a truncated or altered file, or something that is
not a program raises :class:`ProgramFormatError`.
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
FORMAT_VERSION = 2
#: versions this edgetvm reads (1: commands as JSON objects, one per command)
READABLE_VERSIONS = (1, 2)
_HEAD = struct.Struct("<8sIQ")


class _Encoder:
    """Commands as positional lists; every distinct operand (TCM / DRAM window, affine
    value) once in the operand table, referred to as ``"@<index>"`` (a literal string
    that starts with ``@`` is written with one more ``@``)."""

    def __init__(self):
        self.operands: list = []
        self.index: dict = {}

    def operand(self, v) -> str:
        k = self.index.get(v)
        if k is None:
            if type(v) is TcmRef:
                enc = {"tcm": [v.offset, v.shape[0], v.shape[1], v.dtype, v.row_stride]}
            elif type(v) is DramRef:       # its offset (an affine value) goes in first
                enc = {"dram": [v.tensor, v.shape[0], v.shape[1], v.row_stride,
                                self.value(v.offset)]}
            else:
                enc = {"affine": [v.const, [list(x) for x in v.terms]]}
            k = self.index[v] = len(self.operands)
            self.operands.append(enc)
        return f"@{k}"

    def value(self, v):
        t = type(v)
        if t is int or t is bool or t is float or v is None:
            return v
        if t is str:
            return "@" + v if v.startswith("@") else v
        if t is TcmRef or t is DramRef or t is Affine:
            return self.operand(v)
        if t is tuple:
            return [self.value(x) for x in v]
        if isinstance(v, (np.integer, np.floating)):
            return v.item()
        raise TypeError(f"cannot encode {t.__name__}")


#: command classes in a fixed order with their field names (positional encoding)
_CLASSES = tuple(COMMAND_TYPES.values())
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _CLASSES}


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
    enc = _Encoder()
    class_id = {cls: k for k, cls in enumerate(_CLASSES)}
    value, index, operand = enc.value, enc.index, enc.operand
    cmds = []
    for c in program.commands:           # hot: ~10^5..10^6 commands per program
        cls = type(c)
        row = [class_id[cls]]
        for f in _FIELDS[cls]:
            v = getattr(c, f)
            t = type(v)
            if t is int or v is None or t is bool:
                row.append(v)
            elif t is TcmRef or t is DramRef:
                k = index.get(v)
                row.append(f"@{k}" if k is not None else operand(v))
            elif t is tuple and not v:
                row.append([])
            else:
                row.append(value(v))
        cmds.append(row)
    header = {"name": program.name, "params": list(program.params),
              "emulator_model": program.emulator_model,
              "tcm_bytes": program.tcm_bytes, "spec_hash": program.spec_hash,
              "metadata": program.metadata, "tensors": tensors,
              "classes": [[cls.__name__, list(_FIELDS[cls])] for cls in _CLASSES],
              "operands": enc.operands, "commands": cmds}
    js = json.dumps(header, separators=(",", ":")).encode()
    body = _HEAD.pack(MAGIC, FORMAT_VERSION, len(js)) + js + struct.pack("<Q", len(blob)) + blob
    return body + hashlib.sha256(body).digest()


class _Decoder:
    def __init__(self, operands):
        self.table: list = []
        for o in operands:                   # an operand refers only to earlier ones
            self.table.append(self._operand(o))

    def _operand(self, o):
        return _operand(o, self.value)

    def value(self, v):
        t = type(v)
        if t is str:
            if v.startswith("@@"):
                return v[1:]
            if v.startswith("@"):
                return self.table[int(v[1:])]
            return v
        if t is list:
            return tuple(self.value(x) for x in v)
        return v


def _operand(o: dict, value):
    """A TCM / DRAM reference or an affine value from its JSON object (``value``
    decodes a DRAM offset)."""
    if "tcm" in o:
        off, r, c, dt, st = o["tcm"]
        return TcmRef(off, (r, c), dt, st)
    if "dram" in o:
        t, r, c, st, off = o["dram"]
        return DramRef(t, (r, c), st, value(off))
    if "affine" in o:
        const, terms = o["affine"]
        return Affine(const, tuple((n, c) for n, c in terms))
    raise ValueError(f"unknown operand {sorted(o)}")


def _dec_v1(v):
    """Operands of format version 1 (commands as name -> value objects)."""
    if isinstance(v, dict):
        return _operand(v, _dec_v1)
    if isinstance(v, list):
        return tuple(_dec_v1(x) for x in v)
    return v


def _commands(js, version: int) -> list:
    if version == 1:
        cmds = []
        for c in js["commands"]:
            cls = COMMAND_TYPES[c.pop("command")]
            cmds.append(cls(**{k: _dec_v1(v) for k, v in c.items()}))
        return cmds
    classes = [(COMMAND_TYPES[name], fields) for name, fields in js["classes"]]
    dec = _Decoder(js["operands"])
    value, table = dec.value, dec.table
    cmds = []
    for c in js["commands"]:             # hot: ~10^5..10^6 commands per program
        cls, fields = classes[c[0]]
        kw = {}
        for f, v in zip(fields, c[1:]):
            t = type(v)
            if t is int or v is None or t is bool:
                kw[f] = v
            elif t is str and v[:1] == "@" and v[1:2] != "@":
                kw[f] = table[int(v[1:])]
            elif t is list and not v:
                kw[f] = ()
            else:
                kw[f] = value(v)
        cmds.append(cls(**kw))
    return cmds


def loads(data: bytes, source: str = "<bytes>") -> Program:
    data = bytes(data)
    if len(data) < _HEAD.size + 8 + 32 or data[:8] != MAGIC:
        raise ProgramFormatError(f"{source}: not an edgetvm NPU program (bad magic or too short)")
    _, version, jlen = _HEAD.unpack_from(data)
    if version not in READABLE_VERSIONS:
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
        cmds = _commands(js, version)
        return Program(js["name"], cmds, tensors, tuple(js["params"]), js["tcm_bytes"],
                       js["spec_hash"], js["metadata"], js.get("emulator_model", 1))
    except (KeyError, ValueError, TypeError, IndexError, json.JSONDecodeError,
            struct.error) as e:
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
