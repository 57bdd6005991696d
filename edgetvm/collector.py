"""Python's cyclic garbage collector, tuned for edgetvm's commands.

A build allocates millions of small objects that live until the end (lowered commands,
their operands, the encoded program), and a run holds a program of up to a million
commands while the emulator allocates its own; none of them forms a reference cycle
worth collecting early. Under the default thresholds (700, 10, 10) the collector runs a
full pass over every live object again and again as they accumulate. Measured on
SmolLM2-135M: ``python -m edgetvm.build`` 59.5 s -> 43.5 s with the thresholds below
(identical bytes out, the same peak memory), ``python -m edgetvm.run model.npu
--max-new-tokens 8`` 7.9 s -> 6.0 s, and a 60-second tune of the bundled example
measured 528 candidates instead of 371.
"""
from __future__ import annotations

import contextlib
import gc

#: young-generation allocations between passes, and passes between older-generation ones
#: (a full pass only after 50 x 1000 middle ones: in practice, once per build)
THRESHOLDS = (100_000, 50, 1000)


@contextlib.contextmanager
def fewer_collections():
    """Collect less often inside the block, or the decorated function (garbage is still
    collected, later); the previous thresholds come back after it. Child processes
    forked inside (measuring workers) inherit the thresholds."""
    old = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)
