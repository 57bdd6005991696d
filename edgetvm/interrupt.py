"""Ctrl-C that TVM cannot swallow.

tvm_ffi turns an exception raised in Python while C++ code is on the stack (a pass written
in Python, or the FFI's own check for signals inside a long C++ call) into a
``RuntimeError`` with no message: a ``KeyboardInterrupt`` becomes one too. Code that takes
any ``Exception`` of a candidate for a failed trial would then log the candidate as failed
and go on tuning. :func:`watching` makes SIGINT remember itself as well as raise, and
:func:`check` (called where an exception is taken for a failed trial, and between a tuner's
batches) raises ``KeyboardInterrupt`` again once it was pressed.
"""
from __future__ import annotations

import contextlib
import signal
import threading

_PRESSED = threading.Event()


@contextlib.contextmanager
def watching():
    """Within: SIGINT raises ``KeyboardInterrupt`` as Python's own handler does, and is
    remembered; any exception leaving the block after it was pressed leaves it as
    ``KeyboardInterrupt``. Outside the main thread (where no handler can be set) it only yields."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum, frame):
        _PRESSED.set()
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except Exception:
        if _PRESSED.is_set():            # the error TVM made of a Ctrl-C is the Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal(signal.SIGINT, before)
        _PRESSED.clear()


def check() -> None:
    """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed within :func:`watching`, even where
    TVM turned it into another exception."""
    if _PRESSED.is_set():
        raise KeyboardInterrupt
