"""Errors edgetvm raises to its users.

Every error a user can trigger with bad input is one of these, with a message that names
the problem (the file, the op, the command index), never a traceback from inside TVM.
"""


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
