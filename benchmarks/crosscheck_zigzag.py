"""Cross-check of the emulator's latency and energy against ZigZag, an outside model.

ZigZag (zigzag-dse 3.9.1, KU Leuven) is an analytical design-space-exploration model of
DNN accelerators: it maps a layer onto an array of MACs under a memory hierarchy and
counts cycles (ideal overlap of compute and transfers, with start-up and drain) and
dynamic energy (MACs, and accesses per memory level at a cost per access). The preset is
described to it from the :class:`NPUSpec` alone:

* operational array: ``mma_macs_per_cycle[kind]`` MACs shaped like the native tile
  ``(tm, tn, tk)``: D1 = tm rows (GEMM M), D2 = up to tn columns (N), D3 = the rest (K),
  so an M = 1 GEMV uses one row of 16, as the emulator pads rows; one MAC costs
  ``power_unit_mw["matrix"]`` at the clock: ``1000 * mW / (MACs/cycle * MHz)`` pJ;
* operand registers inside the array holding one native tile of A, B and the fp32
  accumulator, at no access cost (the emulator has no such level: its matrix power covers
  them);
* the TCM: ``tcm_bytes``, ``tcm_read_pj_per_byte`` / ``tcm_write_pj_per_byte`` converted
  to ZigZag's cost per access of a port's width; the preset gives no TCM bandwidth (the
  emulator serves every unit at full rate), so its ports are wide (``TCM_PORT_BITS``);
* DRAM: one read/write port of ``dram_bytes_per_cycle`` shared by all operands,
  ``dram_pj_per_byte`` per byte read or written.

GEMV/GEMM shapes of SmolLM2-135M run on the emulator with the schedule a short knob search
finds (``benchmarks/kernels.py``'s building blocks, fixed seed), checked against numpy;
ZigZag maps the same layer (``O[b][k] += I[b][c] * W[c][k]``, B = M, C = K, K = N; fp16
activations, fp32 partial sums, fp16 outputs) minimising latency, as the search does.
W4A16 weights are described to ZigZag as 4-bit weights; their fp16 scales (one per 32
weights) have no place in a two-operand layer and are left out, so the emulator's scale
bytes are a named difference. ZigZag's energy has no static part: the emulator's dynamic
energy (total minus static power over the run) is compared with it, and both totals are
in the JSON (ZigZag's with the preset's static power over ZigZag's latency).

A kernel agrees when latency and dynamic energy are both within 25 %; otherwise the
verdict names the modelling differences that account for the gap (the terms add up to
it; the JSON has them all), each measured on the run:

* start-up and drain: launch, set-ups, the first tiles' loads, the last tile's compute,
  cast and store, against ZigZag's on- and off-loading (its steady state overlaps
  perfectly);
* padded rows, padded K/N and issue: the matrix unit draws its power on whole native
  tiles (an M = 1 GEMV keeps 16 rows busy) and per-command issue cycles; ZigZag charges
  useful MACs;
* output buffering: fp32 partial sums in the TCM between K steps and the fp16 cast pass,
  against ZigZag's accumulator registers and its own spills;
* operand re-reads: the emulator reads ``a`` once per column and ``b`` once per row of
  native tiles an MMA command spans, ZigZag as often as its mapping's reuse needs;
* scales (W4A16), DRAM re-loads and bursts (tiles loaded more than once, whole 64-B
  bursts), DVFS throttling (ZigZag has no power budget) and stalls.

    python benchmarks/crosscheck_zigzag.py [--quick] [--json PATH] [--spec edge-npu-16mb]
                                           [--trials N] [--seed S]

zigzag-dse is an optional benchmark dependency: ``pip install zigzag-dse==3.9.1 six``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import logging
import os
import sys
import tempfile

import numpy as np

from edgetvm.target.emulator import Emulator
from edgetvm.target.emulator.costs import (dram_bursts, mma_cycles, mma_tcm_reads, tcm_bytes,
                                           tcm_traffic, vector_cycles)
from edgetvm.target.emulator.functional import valid_rows
from edgetvm.target.isa import ITEMSIZE, DmaLoad, DmaStore, Mma, Vector, eval_value
from edgetvm.target.lowering import lower_primfunc
from edgetvm.target.spec import load_spec
from edgetvm.tir_schedules.search import search
from kernels import MAX_OPS, MAX_REL_ERR, SMOLLM2, _matmul_bench
from report import write_json

ZIGZAG_VERSION = "3.9.1"
INSTALL = f"pip install zigzag-dse=={ZIGZAG_VERSION} six"
#: the two models agree when both ratios are within this of 1
TOLERANCE = 0.25
#: width of each ZigZag TCM port (bits): the preset has no TCM bandwidth and the emulator
#: serves every unit at full rate, so wide enough that ZigZag never stalls on the TCM
TCM_PORT_BITS = 8192
#: precisions (bits): fp16 activations and outputs, fp32 partial sums
ACT_BITS, PSUM_BITS = 16, 32
W_BITS = {"fp16": 16, "w4a16": 4}
#: the emulator's DRAM tensors of a GEMM bench, as ZigZag's operands (S: W4A16 scales)
ROLE = {"A": "I", "X": "I", "B": "W", "W": "W", "S": "S", "D": "O"}


def import_zigzag():
    """zigzag.api, or exit naming the install command (it is an optional dependency)."""
    try:
        api = importlib.import_module("zigzag.api")
    except ImportError as e:
        sys.exit(f"crosscheck_zigzag needs ZigZag ({e}); install it with: {INSTALL}")
    version = importlib.metadata.version("zigzag-dse")
    if version != ZIGZAG_VERSION:
        print(f"warning: zigzag-dse {version} installed, this check is written for "
              f"{ZIGZAG_VERSION} ({INSTALL})", file=sys.stderr)
    return api


# -- the preset, described to ZigZag ------------------------------------------------------
def array_dims(spec, kind: str) -> list:
    """[D1, D2, D3] sizes: tm rows, up to tn columns, the rest along K."""
    tm, tn, _ = spec.mma_tile
    macs = spec.mma_macs_per_cycle[kind]
    d2 = min(tn, macs // tm)
    if macs % (tm * d2):
        sys.exit(f"{spec.name}: {macs} MACs/cycle do not shape into native-tile rows {tm}")
    return [tm, d2, macs // (tm * d2)]


def mac_pj(spec, kind: str) -> float:
    """Energy of one MAC: the matrix unit's power at the clock over its MAC rate."""
    return 1e3 * spec.power_unit_mw["matrix"] / (spec.mma_macs_per_cycle[kind] * spec.clock_mhz)


def _port(name, kind, bits, allocation, min_bits=None):
    return {"name": name, "type": kind, "bandwidth_min": min_bits or bits,
            "bandwidth_max": bits, "allocation": allocation}


def _register(bits, operand, served, width):
    """An operand register inside the array: no access cost (the matrix unit's power)."""
    if operand == "O":
        ports = [_port("r_port_1", "read", width, ["O, tl"]),
                 _port("r_port_2", "read", width, ["O, th"]),
                 _port("w_port_1", "write", width, ["O, fh"]),
                 _port("w_port_2", "write", width, ["O, fl"])]
    else:
        ports = [_port("r_port_1", "read", width, [f"{operand}, tl"]),
                 _port("w_port_1", "write", width, [f"{operand}, fh"])]
    return {"size": int(bits), "r_cost": 0.0, "w_cost": 0.0, "area": 0.0, "latency": 1,
            "operands": [operand], "ports": ports, "served_dimensions": served}


def zigzag_accelerator(spec, kind: str) -> dict:
    """The preset as a ZigZag accelerator (the data of its YAML file), lowest level first."""
    tm, tn, tk = spec.mma_tile
    d1, d2, d3 = array_dims(spec, kind)
    dims = ["D1", "D2", "D3"]
    tcm_bytes_per_access = TCM_PORT_BITS / 8
    dram_bits = int(spec.dram_bytes_per_cycle * 8)
    # one native tile of each operand, spread over the register instances (a register
    # serves the array dimension its operand is broadcast along)
    memories = {
        "reg_O": _register(tm * tn * PSUM_BITS / (d1 * d2), "O", ["D3"], PSUM_BITS),
        "reg_W": _register(tk * tn * ACT_BITS / (d2 * d3), "I2", ["D1"], ACT_BITS),
        "reg_I": _register(tm * tk * ACT_BITS / (d1 * d3), "I1", ["D2"], ACT_BITS),
        "tcm": {"size": spec.tcm_bytes * 8,
                "r_cost": spec.tcm_read_pj_per_byte * tcm_bytes_per_access,
                "w_cost": spec.tcm_write_pj_per_byte * tcm_bytes_per_access,
                "area": 0.0, "latency": 1, "operands": ["I1", "I2", "O"],
                # 8-bit minimum access: TCM energy is per byte, as the emulator's
                "ports": [_port("r_port_1", "read", TCM_PORT_BITS,
                                ["I1, tl", "I2, tl", "O, tl"], 8),
                          _port("r_port_2", "read", TCM_PORT_BITS, ["O, th"], 8),
                          _port("w_port_1", "write", TCM_PORT_BITS,
                                ["I1, fh", "I2, fh", "O, fh"], 8),
                          _port("w_port_2", "write", TCM_PORT_BITS, ["O, fl"], 8)],
                "served_dimensions": dims},
        "dram": {"size": 1 << 40,
                 "r_cost": spec.dram_pj_per_byte * dram_bits / 8,
                 "w_cost": spec.dram_pj_per_byte * dram_bits / 8,
                 "area": 0.0, "latency": 1, "operands": ["I1", "I2", "O"],
                 "ports": [_port("rw_port_1", "read_write", dram_bits,
                                 [f"{op}, {d}" for op in ("I1", "I2") for d in ("fh", "tl")]
                                 + [f"O, {d}" for d in ("fh", "tl", "fl", "th")], 8)],
                 "served_dimensions": dims},
    }
    return {"name": f"{spec.name}-{kind}", "memories": memories,
            "operational_array": {"unit_energy": mac_pj(spec, kind), "unit_area": 1.0,
                                  "dimensions": dims, "sizes": [d1, d2, d3]}}


def zigzag_mapping(spec, kind: str) -> list:
    """Rows of the native tile on D1, its columns on D2, the reduction on D3."""
    d1, d2, d3 = array_dims(spec, kind)
    return [{"name": "default",
             "spatial_mapping": {"D1": [f"B, {d1}"], "D2": [f"K, {d2}"], "D3": [f"C, {d3}"]},
             "memory_operand_links": {"O": "O", "W": "I2", "I": "I1"}}]


def zigzag_layer(name: str, m: int, n: int, k: int, kind: str) -> dict:
    return {"id": 0, "name": name, "operator_type": "Gemm",
            "equation": "O[b][k]+=I[b][c]*W[c][k]", "loop_dims": ["B", "C", "K"],
            "loop_sizes": [m, k, n],
            "operand_precision": {"I": ACT_BITS, "W": W_BITS[kind], "O": PSUM_BITS,
                                  "O_final": ACT_BITS},
            "operand_source": {"I": 0, "W": 0}}


def run_zigzag(api, spec, kind: str, name: str, m: int, n: int, k: int) -> dict:
    """ZigZag's best-latency mapping of the layer: cycles and dynamic energy (pJ) by part."""
    import yaml  # a dependency of zigzag-dse
    accelerator = zigzag_accelerator(spec, kind)
    with tempfile.TemporaryDirectory(prefix="zigzag-") as tmp:
        acc_path = os.path.join(tmp, "accelerator.yaml")
        map_path = os.path.join(tmp, "mapping.yaml")
        with open(acc_path, "w") as f:     # memories must stay lowest level first
            yaml.safe_dump(accelerator, f, sort_keys=False)
        with open(map_path, "w") as f:
            yaml.safe_dump(zigzag_mapping(spec, kind), f, sort_keys=False)
        _, _, cmes = api.get_hardware_performance_zigzag(
            [zigzag_layer(name, m, n, k, kind)], acc_path, map_path, opt="latency",
            dump_folder=os.path.join(tmp, "out"), loma_show_progress_bar=False)
    cme = cmes[0][1][0][0]
    by_level = {"reg": 0.0, "tcm": 0.0, "dram": 0.0}
    by_operand = {}
    for layer_op, energies in cme.mem_energy_breakdown.items():
        mem_op = cme.memory_operand_links.layer_to_mem_op(layer_op)
        levels = cme.accelerator.memory_hierarchy.get_memory_levels(mem_op)
        for level, pj in zip(levels, energies):
            part = level.name.split("_")[0]
            by_level[part] += pj
            by_operand[f"{layer_op}_{part}"] = pj
    return {"cycles": float(cme.latency_total2), "ideal_cycles": float(cme.ideal_cycle),
            "temporal_cycles": float(cme.ideal_temporal_cycle),
            "stall_cycles": float(cme.stall_slack_comb),
            "onloading_cycles": float(cme.data_onloading_cycle),
            "offloading_cycles": float(cme.data_offloading_cycle),
            "energy_pj": float(cme.energy_total), "mac_pj": float(cme.mac_energy),
            "tcm_pj": by_level["tcm"], "dram_pj": by_level["dram"], "reg_pj": by_level["reg"],
            "operand_pj": by_operand,
            "spatial_mapping": str(cme.layer.spatial_mapping),
            "temporal_mapping": str(cme.temporal_mapping)}


# -- the emulator -------------------------------------------------------------------------
def operand_energy(program, spec) -> dict:
    """pJ the program's commands draw per operand and memory (``I_tcm``, ``W_dram``, ...),
    from the emulator's own cost functions, plus the matrix and vector units' energy at
    nominal clock (``matrix``, ``vector``); the TCM and DRAM sums equal the emulator's
    energy parts."""
    out: dict = {}

    def add(key, pj):
        out[key] = out.get(key, 0.0) + pj
    rd, wr = spec.tcm_read_pj_per_byte, spec.tcm_write_pj_per_byte
    mw_cycle_pj = 1e3 / spec.clock_mhz        # pJ of 1 mW over one cycle
    for cmd in program.commands:
        if isinstance(cmd, (DmaLoad, DmaStore)):
            load = isinstance(cmd, DmaLoad)
            tref, dref = (cmd.dst, cmd.src) if load else (cmd.src, cmd.dst)
            rows = valid_rows(cmd, {})        # these kernels take no runtime parameters
            role = ROLE[dref.tensor]
            add(f"{role}_tcm", tcm_bytes(tref, rows) * (wr if load else rd))
            isz = ITEMSIZE[tref.dtype]         # as the emulator's _dma counts them
            start = eval_value(dref.offset, {}) * ITEMSIZE[program.tensors[dref.tensor].dtype]
            bursts = dram_bursts(start, rows, tref.shape[1] * isz, dref.row_stride * isz,
                                 spec.dram_burst_bytes)
            add(f"{role}_dram", bursts * spec.dram_burst_bytes * spec.dram_pj_per_byte)
        elif isinstance(cmd, Mma):
            reads = mma_tcm_reads(cmd, spec)
            add("I_tcm", reads["a"] * rd)
            add("W_tcm", reads["b"] * rd)
            add("S_tcm", reads["scales"] * rd)
            add("O_tcm", reads["out"] * rd + tcm_bytes(cmd.out) * wr)
            add("matrix", mma_cycles(cmd, spec) * spec.power_unit_mw["matrix"] * mw_cycle_pj)
        elif isinstance(cmd, Vector):
            r, w = tcm_traffic(cmd, spec)
            add("O_tcm", r * rd + w * wr)
            add("vector", vector_cycles(cmd, spec) * spec.power_unit_mw["vector"] * mw_cycle_pj)
    return out


def run_emulator(bench, spec, trials: int, seed: int) -> dict:
    """The fastest schedule a short knob search finds, its counters, parts and phases."""
    emu = Emulator(spec)

    def lower(f):
        return lower_primfunc(f, spec, bench.kernel, consts=bench.consts, max_ops=MAX_OPS)

    def run(program):
        return emu.run(program, bench.inputs).counters

    res = search(bench.func, bench.schedule_fn, bench.knob_names, lower, run, trials=trials,
                 seed=seed, fixed=bench.fixed)
    if res.best is None:
        raise RuntimeError(f"{bench.kernel} {bench.shape}: every candidate was rejected: "
                           f"{res.candidates[0].rejected}")
    result = emu.run(res.best.program, bench.inputs, trace=True)
    got = result.outputs[bench.output].astype(np.float32)
    rel_err = float(np.abs(got - bench.reference).max()
                    / max(1e-6, np.abs(bench.reference).max()))
    c = result.counters
    mma = [e for e in result.trace if e.unit == "matrix"]
    nominal = sum(mma_cycles(cmd, spec) for cmd in res.best.program.commands
                  if isinstance(cmd, Mma))
    first, last = min(e.start for e in mma), max(e.end for e in mma)
    parts = operand_energy(res.best.program, spec)
    for mem in ("tcm", "dram"):
        mine = sum(v for key, v in parts.items() if key.endswith(mem)) * 1e-6
        if not np.isclose(mine, c.energy_uj_by[mem], rtol=1e-6):
            raise RuntimeError(f"{bench.kernel}: per-operand {mem} energy {mine:.6f} uJ != the "
                               f"emulator's {c.energy_uj_by[mem]:.6f} uJ")
    return {"knobs": res.best.knobs, "candidates_measured": len(res.measured),
            "cycles": c.total_cycles, "startup_cycles": first,
            "compute_cycles": last - first, "drain_cycles": c.total_cycles - last,
            "throttled_cycles": c.throttled_cycles, "min_clock_scale": c.min_clock_scale,
            "busy_cycles": c.busy_cycles, "matrix_nominal_cycles": nominal,
            "mma_commands": len(mma),
            "dram_bus_bytes": c.dram_bus_bytes, "tcm_read_bytes": c.tcm_read_bytes,
            "tcm_write_bytes": c.tcm_write_bytes, "energy_uj": c.energy_uj,
            "energy_uj_by": c.energy_uj_by, "operand_pj": parts, "max_rel_err": rel_err}


# -- the comparison -----------------------------------------------------------------------
def latency_terms(emu: dict, zz: dict, spec, kind: str) -> dict:
    """Cycles by which the emulator's latency exceeds ZigZag's, by named modelling
    difference; they add up to the whole gap. A kernel whose DRAM bus is busier than its
    matrix unit is split by bus time, the others by matrix time."""
    p, bw = emu["operand_pj"], spec.dram_bytes_per_cycle
    bus_pj = bw * spec.dram_pj_per_byte                          # one cycle on the bus
    emu_bus, zz_bus = emu["dram_bus_bytes"] / bw, zz["dram_pj"] / bus_pj
    if emu_bus >= emu["busy_cycles"]["matrix"]:
        terms = {"scales": p.get("S_dram", 0.0) / bus_pj} if kind == "w4a16" else {}
        terms["DRAM re-loads and bursts"] = (sum(p.get(f"{op}_dram", 0.0) for op in "IWO")
                                             - zz["dram_pj"]) / bus_pj
        # the bus idle: launch, set-ups, the first loads' wait, the last tile's compute,
        # cast and store vs ZigZag's cycles beyond its transfers
        terms["start-up and drain"] = (emu["cycles"] - emu_bus) - (zz["cycles"] - zz_bus)
        return terms
    nominal, busy = emu["matrix_nominal_cycles"], emu["busy_cycles"]["matrix"]
    issue = emu["mma_commands"] * spec.mma_issue_cycles
    return {"issue cycles": issue,
            "padded tiles": nominal - issue - zz["temporal_cycles"],
            "DVFS throttling": busy - nominal,
            "start-up and drain": (emu["startup_cycles"] + emu["drain_cycles"])
            - (zz["onloading_cycles"] + zz["offloading_cycles"]),
            "stalls": (emu["compute_cycles"] - busy) - zz["stall_cycles"]}


def energy_terms(emu: dict, zz: dict, m: int, spec) -> dict:
    """uJ by which the emulator's dynamic energy exceeds ZigZag's, by named modelling
    difference; they add up to the whole gap."""
    p, z = emu["operand_pj"], zz["operand_pj"]
    tm = spec.mma_tile[0]
    rows = zz["mac_pj"] * (-(-m // tm) * tm / m - 1)    # the matrix unit's padded rows
    terms = {
        "padded rows": rows,
        "padded K/N and issue": p.get("matrix", 0.0) - zz["mac_pj"] - rows,
        "output buffering": p.get("O_tcm", 0.0) + p.get("vector", 0.0) - z.get("O_tcm", 0.0),
        "operand re-reads": sum(p.get(f"{op}_tcm", 0.0) - z.get(f"{op}_tcm", 0.0)
                                for op in "IW"),
        "scales": p.get("S_tcm", 0.0) + p.get("S_dram", 0.0),
        "DRAM re-loads and bursts": sum(p.get(f"{op}_dram", 0.0) for op in "IWO")
        - zz["dram_pj"],
    }
    return {k: v * 1e-6 for k, v in terms.items()}


def _named(terms: dict, gap: float, unit: str, fmt: str) -> str:
    big = sorted((kv for kv in terms.items() if abs(kv[1]) >= 0.2 * abs(gap)),
                 key=lambda kv: -abs(kv[1]))[:4]
    return ", ".join(f"{name} {value:+{fmt}} {unit}" for name, value in big)


def verdict(row: dict) -> str:
    lat_ok = abs(row["cycles_ratio"] - 1) <= TOLERANCE
    en_ok = abs(row["energy_ratio"] - 1) <= TOLERANCE
    notes = []
    if not lat_ok:
        gap = row["emu_cycles"] - row["zz_cycles"]
        notes.append(f"latency {gap:+.0f} cy: "
                     + _named(row["latency_terms"], gap, "cy", ".0f"))
    if not en_ok:
        gap = row["emu_dyn_uj"] - row["zz_uj"]
        notes.append(f"energy {gap:+.2f} uJ: " + _named(row["energy_terms"], gap, "uJ", ".2f"))
    if notes:
        return "; ".join(notes)
    # within 25 %, but say so when parts that do not agree (a tenth of the total or more)
    # cancel out
    offsets = {k: v for k, v in row["energy_terms"].items() if abs(v) >= 0.1 * row["zz_uj"]}
    if offsets:
        return "within 25 % (energy parts offset: " + ", ".join(
            f"{k} {v:+.1f} uJ" for k, v in offsets.items()) + ")"
    return "within 25 %"


def compare(bench, kind: str, m: int, n: int, k: int, spec, api, trials, seed) -> dict:
    emu = run_emulator(bench, spec, trials, seed)
    zz = run_zigzag(api, spec, kind, f"{bench.kernel}_{bench.shape}", m, n, k)
    by = emu["energy_uj_by"]
    static_uj = by["static"]
    emu_dyn = emu["energy_uj"] - static_uj
    zz_uj = zz["energy_pj"] * 1e-6
    zz_static_uj = spec.power_static_mw * zz["cycles"] / spec.clock_mhz * 1e-3
    row = {"kernel": bench.kernel, "shape": bench.shape, "model": bench.model,
           "emu_cycles": emu["cycles"], "zz_cycles": zz["cycles"],
           "cycles_ratio": emu["cycles"] / zz["cycles"],
           "emu_uj": emu["energy_uj"], "emu_dyn_uj": emu_dyn, "emu_uj_by": by,
           "zz_uj": zz_uj, "zz_uj_by": {"dram": zz["dram_pj"] * 1e-6,
                                         "tcm": zz["tcm_pj"] * 1e-6,
                                         "mac": zz["mac_pj"] * 1e-6,
                                         "reg": zz["reg_pj"] * 1e-6},
           "energy_ratio": emu_dyn / zz_uj,
           "zz_uj_with_static": zz_uj + zz_static_uj,
           "energy_ratio_with_static": emu["energy_uj"] / (zz_uj + zz_static_uj),
           "latency_terms": latency_terms(emu, zz, spec, kind),
           "energy_terms": energy_terms(emu, zz, m, spec),
           "max_rel_err": emu["max_rel_err"],
           "correct": emu["max_rel_err"] <= MAX_REL_ERR,
           "emulator": emu, "zigzag": zz}
    for key, gap in (("latency_terms", emu["cycles"] - zz["cycles"]),
                     ("energy_terms", emu_dyn - zz_uj)):
        rest = gap - sum(row[key].values())
        if abs(rest) > 1e-3 * abs(gap):      # what no named difference accounts for
            row[key]["other"] = rest
    row["verdict"] = verdict(row)
    return row


def kernels(quick: bool) -> list:
    """(kind, m, n, k) of SmolLM2-135M's linears: decode GEMVs, a prefill GEMM."""
    h, f, p = SMOLLM2["hidden"], SMOLLM2["mlp"], SMOLLM2["prefill"]
    if quick:
        return [("fp16", 1, f, h), ("w4a16", 1, f, h), ("fp16", 128, h, h)]
    gemv = [(kind, 1, n, k) for kind in ("fp16", "w4a16") for n, k in ((h, h), (f, h), (h, f))]
    return gemv + [("fp16", p, f, h), ("w4a16", p, f, h)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--quick", action="store_true",
                    help="two GEMVs and a small GEMM, a shorter search")
    ap.add_argument("--json", metavar="PATH", help="write the rows here")
    ap.add_argument("--spec", default="edge-npu-16mb")
    ap.add_argument("--trials", type=int, default=None, help="candidates per kernel")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    api = import_zigzag()
    # ZigZag logs every mapping decision at INFO and WARNING (clipped unrollings of M = 1)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("zigzag").setLevel(logging.ERROR)
    spec = load_spec(args.spec)
    trials = args.trials or (24 if args.quick else 64)
    rng = np.random.default_rng(args.seed)
    print(f"emulator vs ZigZag {ZIGZAG_VERSION} on {spec.name} ({trials} candidates per "
          f"kernel); energy: dynamic (ZigZag has no static part), uJ")
    print(f"{'kernel':<11} {'shape':<12} {'emu cy':>8} {'zz cy':>8} {'ratio':>5}  "
          f"{'emu uJ = dram + tcm + units (+static)':<40} "
          f"{'zz uJ = dram + tcm + mac':<30} {'ratio':>5}  verdict")
    rows, wrong = [], []
    for kind, m, n, k in kernels(args.quick):
        bench = _matmul_bench(kind, SMOLLM2["model"], m, n, k, rng)
        r = compare(bench, kind, m, n, k, spec, api, trials, args.seed)
        rows.append(r)
        if not r["correct"]:
            wrong.append(f"{r['kernel']} {r['shape']} (max rel err {r['max_rel_err']:.1e})")
            r["verdict"] = "WRONG RESULT; " + r["verdict"]
        e, z = r["emu_uj_by"], r["zz_uj_by"]
        emu_s = (f"{r['emu_dyn_uj']:.2f} = {e['dram']:.2f} + {e['tcm']:.2f} + {e['units']:.2f}"
                 f" (+{e['static']:.2f})")
        zz_s = f"{r['zz_uj']:.2f} = {z['dram']:.2f} + {z['tcm']:.2f} + {z['mac']:.2f}"
        print(f"{r['kernel']:<11} {r['shape']:<12} {r['emu_cycles']:>8} {r['zz_cycles']:>8.0f} "
              f"{r['cycles_ratio']:>5.2f}  {emu_s:<40} {zz_s:<30} {r['energy_ratio']:>5.2f}  "
              f"{r['verdict']}", flush=True)
    agree = [r for r in rows if r["verdict"].startswith("within")]
    print(f"within {TOLERANCE:.0%} on latency and dynamic energy: {len(agree)} of {len(rows)} "
          f"kernels")
    if args.json:
        write_json(args.json, {"spec": spec.name, "zigzag_version": ZIGZAG_VERSION,
                               "trials": trials, "seed": args.seed, "tolerance": TOLERANCE,
                               "zigzag_accelerator": {kind: zigzag_accelerator(spec, kind)
                                                      for kind in W_BITS},
                               "zigzag_mapping": zigzag_mapping(spec, "fp16"),
                               "rows": rows})
    if wrong:
        print(f"WRONG RESULT (max relative error > {MAX_REL_ERR}): " + "; ".join(wrong),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
