"""Writing a model.npu (the format is ``edgetvm/runtime/artifact.py``'s)."""
from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from dataclasses import replace

import numpy as np

from edgetvm import __version__
from edgetvm.runtime.artifact import (ALIGN, FORMAT, FORMAT_VERSION, MANIFEST, WEIGHTS,
                                      program_file, sha256)
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
            elif prev is not data and (prev.shape != data.shape or prev.dtype != data.dtype
                                       or not np.array_equal(prev, data)):
                raise BuildError(f"two programs carry different weights named {name!r}")
            t = replace(t, data=None)
        tensors[name] = t
    return replace(program, tensors=tensors)


def _entry(name: str, deflate: bool) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    info.create_system = 3
    return info


def write_artifact(path: str, programs: dict, manifest: dict) -> dict:
    """Write ``programs`` (key -> Program) and their weights to ``path`` (atomically: a
    failed build leaves any earlier file in place); ``manifest`` carries the build's
    description (model shape, options, source hash). Returns the full manifest."""
    pack: dict = {}
    files: dict = {}
    entries = []
    for key in sorted(programs):
        prog = _strip_weights(programs[key], pack)
        data = program_format.dumps(prog)
        name = program_file(key)
        files[name] = sha256(data)
        entries.append((name, data, True, key, prog))
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
        "programs": [{"key": list(key), "file": name, "commands": len(prog.commands),
                      "tcm_bytes": prog.tcm_bytes, "params": len(prog.params),
                      **{k: prog.metadata[k] for k in ("strategy", "arena_bytes", "kernels")
                         if k in prog.metadata}}
                     for name, _, _, key, prog in entries],
        "weights": {"file": WEIGHTS, "bytes": len(weights), "tensors": index},
        "files": files,
    })
    body = json.dumps(full, indent=1, sort_keys=True).encode()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".model-", suffix=".npu.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f, zipfile.ZipFile(f, "w") as z:
            z.writestr(_entry(MANIFEST, True), body, compresslevel=6)
            for name, data, deflate, _, _ in entries:
                z.writestr(_entry(name, deflate), data, compresslevel=6)
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
