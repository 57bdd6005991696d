"""``python -m edgetvm.demo``: build a double-buffered GEMV program, run it on the emulator.

The smallest end-to-end look at the device: a W4A16 GEMV (1 x 576 activations times a
576 x 576 4-bit weight, group 32, 64-wide tiles) whose weight tiles stream through two TCM
slots on two DMA channels while the matrix unit works on the previous tile. The result is
checked against numpy and the emulator's counters are printed.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from edgetvm.errors import EdgeTVMError
from edgetvm.target.builder import ProgramBuilder
from edgetvm.target.emulator import Emulator, write_chrome_trace
from edgetvm.target.emulator.functional import dequant_w4
from edgetvm.target.isa import DmaLoad, DmaStore, Mma
from edgetvm.target.spec import load_spec


def gemv_w4a16_program(spec, k=576, n=576, tile=64, group=32, seed=0):
    """A double-buffered W4A16 GEMV; returns (program, inputs, numpy reference)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, k)).astype(np.float16)
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scales = (rng.random((n, k // group)) * 0.02 + 0.01).astype(np.float16)
    ref = x.astype(np.float32) @ dequant_w4(packed, scales, None, group).T

    b = ProgramBuilder("demo_gemv_w4a16", spec)
    b.tensor("x", x.shape, "float16", "input")
    b.tensor("w", packed.shape, "uint8", "const", packed)
    b.tensor("s", scales.shape, "float16", "const", scales)
    b.tensor("y", (1, n), "float32", "output")
    tx = b.tcm((1, k), "float16")
    slots = [(b.tcm((tile, k // 2), "uint8"), b.tcm((tile, k // group), "float16"))
             for _ in range(2)]
    acc = b.tcm((1, n), "float32")
    x_ready, done = b.event(), b.event()
    loaded, freed = [b.event(), b.event()], [b.event(), b.event()]
    b.emit(DmaLoad(dst=tx, src=b.dram("x"), channel=0, signal=(x_ready,)))
    steps = n // tile
    for j in range(steps):
        slot = j % 2
        tw, ts = slots[slot]
        wait = (freed[slot],) if j >= 2 else ()
        b.emit(DmaLoad(dst=tw, src=b.dram("w", j * tile, 0, tile), channel=slot % spec.dma_channels,
                       wait=wait))
        b.emit(DmaLoad(dst=ts, src=b.dram("s", j * tile, 0, tile), channel=slot % spec.dma_channels,
                       signal=(loaded[slot],)))
        b.emit(Mma(out=acc.cols(j * tile, tile), a=tx, b=tw, scales=ts, group_size=group,
                   transpose_b=True, wait=(loaded[slot],) + ((x_ready,) if j == 0 else ()),
                   signal=(freed[slot],) if j + 2 < steps else ((done,) if j == steps - 1 else ())))
    b.emit(DmaStore(dst=b.dram("y"), src=acc, channel=0, wait=(done,)))
    return b.build(), {"x": x}, ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgetvm.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="edge-npu-16mb", help="NPU preset or spec file")
    ap.add_argument("--profile", default=None, help="power profile (default: the spec's)")
    ap.add_argument("--trace", metavar="PATH", help="write a Chrome trace (Perfetto) here")
    args = ap.parse_args(argv)
    try:
        spec = load_spec(args.target)
        program, inputs, ref = gemv_w4a16_program(spec)
        emu = Emulator(spec, args.profile)
        res = emu.run(program, inputs, trace=bool(args.trace))
    except EdgeTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    err = float(np.abs(res.outputs["y"] - ref).max())
    c = res.counters
    print(f"{program.name} on {spec.name} ({c.profile}): {len(program)} commands, "
          f"max abs error vs numpy {err:.2e}")
    rows = [("total_cycles", c.total_cycles), ("time_us", f"{c.time_us:.2f}"),
            ("dram_read_bytes", c.dram_read_bytes), ("dram_write_bytes", c.dram_write_bytes),
            ("tcm_high_water_bytes", c.tcm_high_water_bytes),
            ("peak_power_mw", f"{c.peak_power_mw:.0f}"), ("energy_uj", f"{c.energy_uj:.3f}"),
            ("throttled_cycles", c.throttled_cycles)]
    rows += [(f"busy_cycles[{u}]", v) for u, v in c.busy_cycles.items() if v]
    rows += [(f"stall_cycles[{k}]", v) for k, v in c.stall_cycles.items() if v]
    for k, v in rows:
        print(f"  {k:<28} {v:>12}")
    if args.trace:
        write_chrome_trace(res, spec, args.trace)
        print(f"trace written to {args.trace}")
    return 0 if err < 1e-2 * max(1.0, float(np.abs(ref).max())) else 1


if __name__ == "__main__":
    sys.exit(main())
