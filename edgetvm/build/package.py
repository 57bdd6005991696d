"""Writing a model.npu (the format is ``edgetvm/runtime/artifact.py``'s)."""
from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, replace

import numpy as np

from edgetvm import __version__
from edgetvm.runtime.artifact import (ALIGN, FORMAT, FORMAT_VERSION, MANIFEST, MANIFEST_DIGEST,
                                      WEIGHTS, program_file, sha256)
from edgetvm.target import program_format
from edgetvm.target.spec import EMULATOR_MODEL_VERSION

from .graph import BuildError

_EPOCH = (1980, 1, 1, 0, 0, 0)


def _strip_weights(program, pack: dict):
    """The program without its const data; the data goes to ``pack`` (one copy per name)."""
    tensors = {}
    for name, t in program.tensors.items():
        if t.kind == "const":
            data = np.ascontiguousarray(t.data, dtype=t.dtype)
            prev = pack.get(name)
            if prev is None:
                pack[name] = data
            else:
                check_same_weight(name, prev, data)
            t = replace(t, data=None)
        tensors[name] = t
    return replace(program, tensors=tensors)


def check_same_weight(name: str, a: np.ndarray, b: np.ndarray) -> None:
    """Two programs name one weight: it must be the same array."""
    if a is not b and (a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b)):
        raise BuildError(f"two programs carry different weights named {name!r}")


@dataclass(frozen=True)
class EncodedProgram:
    """A program as the artifact stores it: its file's bytes, without weights, and its
    line of the manifest."""
    data: bytes
    summary: dict


def encode_program(program, pack: dict) -> EncodedProgram:
    """``program`` encoded; its weights go to ``pack`` (see :func:`_strip_weights`)."""
    prog = _strip_weights(program, pack)
    summary = {"commands": len(prog.commands), "tcm_bytes": prog.tcm_bytes,
               "params": len(prog.params),
               **{k: prog.metadata[k] for k in ("strategy", "arena_bytes", "kernels")
                  if k in prog.metadata}}
    return EncodedProgram(program_format.dumps(prog), summary)


def _entry(name: str, deflate: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    info.create_system = 3
    return info


def write_artifact(path: str, programs: dict, manifest: dict, pack: dict | None = None
                   ) -> dict:
    """Write ``programs`` (key -> Program, or key -> :class:`EncodedProgram` whose weights
    are in ``pack``) and their weights to ``path`` (atomically: a failed build leaves any
    earlier file in place); ``manifest`` carries the build's description (model shape,
    options, source hash). Returns the full manifest."""
    pack = {} if pack is None else pack
    files: dict = {}
    entries = []
    for key in sorted(programs):
        enc = programs[key]
        if not isinstance(enc, EncodedProgram):
            enc = encode_program(enc, pack)
        name = program_file(key)
        files[name] = sha256(enc.data)
        entries.append((name, enc, key))
    blob = io.BytesIO()
    index = {}
    stored: dict = {}                 # identical bytes are stored once (a tied lm_head)
    for name in sorted(pack):
        a = pack[name]
        raw = a.tobytes()
        digest = sha256(raw)
        if digest not in stored:
            blob.write(b"\0" * (-blob.tell() % ALIGN))
            stored[digest] = blob.tell()
            blob.write(raw)
        index[name] = [stored[digest], list(a.shape), str(a.dtype)]
    weights = blob.getvalue()
    files[WEIGHTS] = sha256(weights)
    full = dict(manifest)
    full.update({
        "format": FORMAT, "format_version": FORMAT_VERSION, "edgetvm_version": __version__,
        "emulator_model": EMULATOR_MODEL_VERSION,
        "programs": [{"key": list(key), "file": name, **enc.summary}
                     for name, enc, key in entries],
        "weights": {"file": WEIGHTS, "bytes": len(weights), "tensors": index},
        "files": files,
    })
    body = json.dumps(full, indent=1, sort_keys=True).encode()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".npu.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w") as z:
            z.writestr(_entry(MANIFEST, True), body, compresslevel=6)
            z.writestr(_entry(MANIFEST_DIGEST, False), sha256(body).encode())
            for name, enc, _ in entries:
                z.writestr(_entry(name, True), enc.data, compresslevel=6)
            z.writestr(_entry(WEIGHTS, False), weights)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return full
