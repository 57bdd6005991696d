"""The deployable artifact, ``model.npu``: phase programs, one weight pack, a manifest.

A ``model.npu`` is a zip archive (entries in a fixed order with fixed timestamps, so
building twice gives identical bytes):

``manifest.json``
    what was built and how: the ONNX file's SHA-256, the target spec (name and hash), the
    power profile, the fusion strategy, the quantization, the edgetvm and emulator-model
    versions, the model's shape (layers, KV heads, head size, page size, KV capacity,
    vocabulary), every program (its key ``(phase, rows, pages)``, file, size, kernels with
    their ops and knobs), the weight pack's index, and the SHA-256 of every other file;
``programs/<phase>_<rows>x<pages>p.npuprog``
    the linked command streams (``target/program_format.py``), their weights left out;
``weights.bin``
    every weight and position table, each at a 64-byte aligned offset;
``manifest.sha256``
    the manifest's own SHA-256 (hex), so that an edited manifest is refused too.

:func:`load_artifact` checks the format and every file's hash before anything runs, and
attaches the weights to a program when it is first used.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from dataclasses import dataclass, field, replace

import numpy as np

from edgetvm.errors import EdgeTVMError

from .model import ModelInfo, program_name

FORMAT = "edgetvm-model"
FORMAT_VERSION = 2                  # 2: manifest.sha256
MANIFEST = "manifest.json"
MANIFEST_DIGEST = "manifest.sha256"
WEIGHTS = "weights.bin"
ALIGN = 64


class ArtifactError(EdgeTVMError):
    """A model.npu that cannot be used: not one, another version, damaged or altered."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def program_file(key) -> str:
    return f"programs/{program_name(key)}.npuprog"


@dataclass
class Artifact:
    """A loaded model.npu (programs are decoded when first asked for)."""

    path: str
    manifest: dict
    _zip: object = field(repr=False, default=None)
    _weights: dict = field(repr=False, default_factory=dict)
    _programs: dict = field(repr=False, default_factory=dict)

    @property
    def keys(self) -> list:
        return [tuple(p["key"]) for p in self.manifest["programs"]]

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(**self.manifest["model"])

    def program(self, key):
        key = tuple(key)
        p = self._programs.get(key)
        if p is None:
            from edgetvm.target import program_format
            entry = next((e for e in self.manifest["programs"] if tuple(e["key"]) == key), None)
            if entry is None:
                raise ArtifactError(f"{self.path}: no program {program_name(key)}")
            p = program_format.loads(self._read(entry["file"]), source=f"{self.path}:{entry['file']}")
            tensors = {}
            for name, t in p.tensors.items():
                if t.kind == "const" and t.data is None:
                    if name not in self._weights:
                        raise ArtifactError(f"{self.path}: weight {name!r} of {entry['file']} "
                                            f"is not in the weight pack")
                    t = replace(t, data=self._weights[name])
                tensors[name] = t
            p = self._programs[key] = replace(p, tensors=tensors)
        return p

    def _read(self, name: str) -> bytes:
        data = _entry_bytes(self._zip, name, self.path)
        if sha256(data) != self.manifest["files"].get(name):
            raise ArtifactError(f"{self.path}: {name} does not match its SHA-256 in the "
                                f"manifest (the file was altered or damaged)")
        return data


def _entry_bytes(z, name: str, path: str) -> bytes:
    """An entry of the zip; a damaged one (bad CRC, bad deflate data) is an ArtifactError."""
    try:
        return z.read(name)
    except KeyError:
        raise ArtifactError(f"{path}: no {name}") from None
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as e:
        raise ArtifactError(f"{path}: {name} is damaged ({e})") from None


def load_artifact(path: str) -> Artifact:
    """Open and verify a model.npu (format, version, the hash of every file)."""
    try:
        z = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile, ValueError) as e:
        raise ArtifactError(f"{path}: not a model.npu ({e})") from None
    body = _entry_bytes(z, MANIFEST, path)
    try:
        manifest = json.loads(body)
    except ValueError as e:
        raise ArtifactError(f"{path}: no readable {MANIFEST} ({e})") from None
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}: {MANIFEST} is not an object")
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not an edgetvm model (format {manifest.get('format')!r})")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{path}: model format version {manifest.get('format_version')}; "
                            f"this edgetvm reads version {FORMAT_VERSION}. Rebuild it.")
    if _entry_bytes(z, MANIFEST_DIGEST, path).decode("ascii", "replace") != sha256(body):
        raise ArtifactError(f"{path}: {MANIFEST} does not match its SHA-256 "
                            f"({MANIFEST_DIGEST}): the manifest was altered or damaged")
    names = set(z.namelist()) - {MANIFEST, MANIFEST_DIGEST}
    listed = set(manifest.get("files", {}))
    if names != listed:
        raise ArtifactError(f"{path}: files {sorted(names ^ listed)} are not what the "
                            f"manifest lists")
    art = Artifact(path, manifest, z)
    blob = art._read(WEIGHTS)
    for name, (offset, shape, dtype) in manifest["weights"]["tensors"].items():
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if offset + n > len(blob):
            raise ArtifactError(f"{path}: weight {name!r} runs past the end of the pack")
        arr = np.frombuffer(blob, dtype=dtype, count=n // np.dtype(dtype).itemsize,
                            offset=offset).reshape(shape)
        art._weights[name] = arr
    from edgetvm.target.spec import EMULATOR_MODEL_VERSION
    if manifest.get("emulator_model") != EMULATOR_MODEL_VERSION:
        raise ArtifactError(f"{path}: built for emulator model {manifest.get('emulator_model')}, "
                            f"this edgetvm emulates model {EMULATOR_MODEL_VERSION}; rebuild it")
    return art
