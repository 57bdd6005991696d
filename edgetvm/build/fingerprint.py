"""What identifies a build's inputs and its compiler: the ONNX file's hash, the
quantization's canonical description, and a hash of this edgetvm's own sources. The
artifact's manifest, the build cache and the tuning log's context are keyed by them."""
from __future__ import annotations

import hashlib
import os


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
