"""Errors edgetvm raises to its users.

Every error a user can trigger with bad input is one of these, with a message that names
the problem (the file, the op, the command index), never a traceback from inside TVM.
"""
import os


class EdgeTVMError(Exception):
    """Base class of every error edgetvm raises on purpose."""


class ModelImportError(EdgeTVMError):
    """An ONNX file cannot be read or imported (missing, truncated, malformed)."""


class UnsupportedOpsError(ModelImportError):
    """The model uses ONNX ops edgetvm cannot compile; the message lists all of them."""


class SpecError(EdgeTVMError):
    """An NPU spec or preset file is missing, malformed or inconsistent."""


class ProgramFormatError(EdgeTVMError):
    """A program file is of another format version, damaged or not a program at all."""


class InvalidProgramError(EdgeTVMError):
    """The emulator refuses a program; ``command_index`` names the offending command."""

    def __init__(self, message, command_index=None):
        self.command_index = command_index
        if command_index is not None:
            message = f"command {command_index}: {message}"
        super().__init__(message)


class CandidateRejected(EdgeTVMError):
    """A schedule candidate cannot run on the NPU (e.g. its TCM buffers do not fit)."""


class RequestRefused(EdgeTVMError):
    """An emulator server refuses a request: over its size limits, arguments of the wrong
    type or dtype, a spec given as a path, an unknown call."""


def check_output_file(path: str, option: str) -> None:
    """Refuse, before any work, an output file that cannot be written: ``path`` (given by
    ``option``, e.g. ``-o``) is empty, a directory, something other than a regular file (a
    device, a pipe: writing it would replace it), or its directory is missing or refuses
    a new file (tried, not judged from permission bits: root passes those on read-only
    file systems such as /sys)."""
    import tempfile
    if not path:
        raise EdgeTVMError(f"{option}: an empty path; name the file to write")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise EdgeTVMError(f"{option} {path}: is a directory; name the file to write")
    if not os.path.isdir(parent):
        raise EdgeTVMError(f"{option} {path}: no directory {parent}")
    if os.path.exists(path) and not os.path.isfile(path):
        raise EdgeTVMError(f"{option} {path}: exists and is not a regular file; name a file "
                           f"to write")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".edgetvm-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise EdgeTVMError(f"{option} {path}: not writable ({e.strerror})") from None
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise EdgeTVMError(f"{option} {path}: not writable")


def check_not_overwriting(path: str, option: str, inputs: list, suggestion: str) -> None:
    """Refuse, before any work, an output ``path`` (given by ``option``) that is a file the
    command reads: ``inputs`` are (what it is, its path) pairs, e.g. ("the model being
    built", "m.onnx"); writing ``path`` would destroy it."""
    if not path or not os.path.exists(path):
        return
    for what, other in inputs:
        if other and os.path.exists(other) and os.path.samefile(path, other):
            raise EdgeTVMError(f"{option} {path} is {what}; name another file ({suggestion})")


def check_input_file(path: str, what: str = "an .onnx file") -> None:
    """Refuse, before any work, an input file that is missing or a directory."""
    if os.path.isdir(path):
        raise EdgeTVMError(f"{path}: is a directory, expected {what}")
    if not os.path.isfile(path):
        raise EdgeTVMError(f"{path}: no such file")
