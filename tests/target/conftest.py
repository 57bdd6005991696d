"""Shared fixtures of the NPU target tests: the reference spec and a fresh emulator."""
from __future__ import annotations

import pytest

from edgetvm.target.emulator import Emulator
from edgetvm.target.spec import load_spec


@pytest.fixture(scope="session")
def spec():
    """The source study's reference device (16 MB TCM, 2 DMA channels)."""
    return load_spec("edge-npu-16mb")


@pytest.fixture
def emu(spec):
    return Emulator(spec)


# -- a double-buffered GEMM loop, shared by the timing and refusal tests -------------------------
import numpy as np  # noqa: E402

from edgetvm.target.builder import ProgramBuilder  # noqa: E402
from edgetvm.target.isa import DmaLoad, DmaStore, Mma  # noqa: E402


def build_double_buffered(spec, m, steps, kt=64, n=64, drop=None, seed=0):
    """``y (m, n) = A (m, steps*kt) @ B (steps*kt, n)``, fp16 in, fp32 accumulate.

    A is loaded once; the B tiles stream through two TCM buffers on DMA channel 0 while
    the matrix unit works on the other buffer. Events per buffer: ``full[b]`` (DMA -> MMA)
    and ``empty[b]`` (MMA -> the DMA that reuses the buffer). ``drop`` removes one wait to
    make a broken program: ``("empty", k)`` from the load of tile k, ``("full", k)`` from
    the MMA of tile k. Returns ``(program, inputs, reference)``.
    """
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, steps * kt)).astype(np.float16)
    w = rng.standard_normal((steps * kt, n)).astype(np.float16)
    b = ProgramBuilder(f"double_buffered_{m}x{steps}", spec)
    b.tensor("A", a.shape, "float16", "input")
    b.tensor("B", w.shape, "float16", "const", w)
    b.tensor("y", (m, n), "float32", "output")
    ta = b.tcm(a.shape, "float16")
    bufs = [b.tcm((kt, n), "float16"), b.tcm((kt, n), "float16")]
    out = b.tcm((m, n), "float32")
    loaded_a, done = b.event(), b.event()
    full, empty = [b.event(), b.event()], [b.event(), b.event()]

    def load(k):
        wait = (empty[k % 2],) if k >= 2 and drop != ("empty", k) else ()
        b.emit(DmaLoad(dst=bufs[k % 2], src=b.dram("B", row0=k * kt, rows=kt), channel=0,
                       wait=wait, signal=(full[k % 2],)))

    b.emit(DmaLoad(dst=ta, src=b.dram("A"), channel=0, signal=(loaded_a,)))
    load(0)
    for k in range(steps):
        if k + 1 < steps:
            load(k + 1)
        wait = () if drop == ("full", k) else (full[k % 2],)
        if k == 0:
            wait += (loaded_a,)
        signal = (empty[k % 2],) if k + 2 < steps else ()
        if k == steps - 1:
            signal += (done,)
        b.emit(Mma(out=out, a=ta.cols(k * kt, kt), b=bufs[k % 2], accumulate=k > 0,
                   wait=wait, signal=signal))
    b.emit(DmaStore(dst=b.dram("y"), src=out, channel=0, wait=(done,)))
    ref = a.astype(np.float32) @ w.astype(np.float32)
    return b.build(), {"A": a}, ref


@pytest.fixture
def double_buffered():
    return build_double_buffered
