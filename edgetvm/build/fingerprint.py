"""What identifies a build's inputs and its compiler: the ONNX file's hash, the
quantization's canonical description, and a hash of this edgetvm's own sources. The
artifact's manifest, the build cache and the tuning log's context are keyed by them."""
from __future__ import annotations

import hashlib
import os
import time


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    _hash_file(h, path)
    return h.hexdigest()


def _hash_file(h, path: str) -> bool:
    """Feed ``path`` to ``h``; does its content hold the marker of ONNX external data
    (the ``location`` key of a tensor's ``external_data``)?"""
    marker, tail, found = b"location", b"", False
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            found = found or marker in tail + block[:len(marker)] or marker in block
            tail = block[-len(marker):]
    return found


def model_files(onnx_path: str, what: str) -> list:
    """(what it is, path) of the files of the ONNX model ``onnx_path`` (``what``: e.g.
    "the model being built"): itself and the files of its external data, for
    :func:`~edgetvm.errors.check_not_overwriting`. A file that is not an ONNX model
    is only itself (it is refused as a model elsewhere)."""
    out = [(what, onnx_path)]
    if not onnx_path.endswith(".npu") and os.path.isfile(onnx_path):
        try:
            data = external_data_files(onnx_path)
        except Exception:                   # not ONNX: the model is refused elsewhere
            data = []
        out += [(f"the external data (weights) of {what}", f) for f in data]
    return out


def external_data_files(onnx_path: str) -> list:
    """The files (absolute paths, sorted) that hold the weights ``onnx_path`` stores
    outside itself (ONNX external data)."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors, uses_external_data
    model = onnx.load(onnx_path, load_external_data=False)
    base = os.path.dirname(os.path.abspath(onnx_path))
    files = set()
    for t in _get_all_tensors(model):
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                files.add(os.path.normpath(os.path.join(base, loc)))
    return sorted(files)


#: :func:`_stat` of each file this process hashed as a model -> (its digest, the same of
#: its external data files): ``run model.onnx`` asks four times (the cache
#: key, the manifest, the tuning log's context, ``--check-onnx``), a second each for
#: SmolLM2's 540 MB
_MODEL_HASHES: dict = {}
RACY_NS = 2_000_000_000


def model_sha256(onnx_path: str) -> str:
    """The identity of a model: the SHA-256 of its ONNX file, and, where it keeps weights
    in external data files, of those files too (a build of the same graph with other
    weights is another model). Equal to :func:`file_sha256` for a self-contained file.
    Hashed once per process while the ONNX file and its data files stay as they were."""
    key = _stat(onnx_path)
    hit = _MODEL_HASHES.get(key)
    if hit is not None and all(_stat(f[0]) == f for f in hit[1]):
        return hit[0]
    digest, files = _model_sha256(onnx_path)
    # a file written in the last seconds may change again within its clock's resolution
    # with its stat unchanged (git's "racily clean" entries): not kept
    settled = time.time_ns() - RACY_NS
    if key is not None and key == _stat(onnx_path) and None not in files and \
            all(f[4] < settled for f in (key, *files)):
        _MODEL_HASHES[key] = (digest, files)
    return digest


def _stat(path: str):
    """(path as named, the file it resolves to, size, mtime, ctime, inode) of ``path``;
    None if it cannot be read. (The ctime moves on every write and on every change of
    the mtime; a symbolic link pointed elsewhere changes the file it resolves to.)"""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (os.path.abspath(path), os.path.realpath(path), st.st_size, st.st_mtime_ns,
            st.st_ctime_ns, st.st_ino)


def _model_sha256(onnx_path: str) -> tuple:
    """(digest, :func:`_stat` of each external data file hashed before it was read)."""
    h = hashlib.sha256()
    if not _hash_file(h, onnx_path):
        return h.hexdigest(), ()
    files = external_data_files(onnx_path)
    if not files:                 # the bytes happened to hold the marker: self-contained
        return h.hexdigest(), ()
    stats = []
    for path in files:
        if not os.path.isfile(path):
            from edgetvm.errors import ModelImportError
            raise ModelImportError(f"{onnx_path}: its weights file {path} (external data) "
                                   f"is missing")
        stats.append(_stat(path))
        h.update(b"\0" + os.path.basename(path).encode() + b"\0")
        _hash_file(h, path)
    return h.hexdigest(), tuple(stats)


def compiler_fingerprint() -> str:
    """A hash of this edgetvm's own sources (compiler, schedules, emulator, presets).

    Keys build caches: a build made by other code (an edited checkout, another release
    with the same version string) is never mistaken for this one's.
    """
    import edgetvm
    import edgetvm.relax_passes
    import edgetvm.target
    import edgetvm.tir_schedules

    h = hashlib.sha256()
    for pkg in (edgetvm, edgetvm.relax_passes, edgetvm.target, edgetvm.tir_schedules):
        root = os.path.dirname(pkg.__file__)
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".json")):
                    path = os.path.join(d, name)
                    h.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()[:16]


def describe_quantize(q):
    """The quantization ``q`` (a group size or a W4A16 config) as plain data; None for
    fp16."""
    if not q:
        return None
    if isinstance(q, int):
        return {"group_size": q}
    return {"group_size": q.group_size, "zero_points": q.zero_points,
            "keep_fp16": list(q.keep_fp16), "scale_rule": q.scale_rule}
