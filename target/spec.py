"""The NPU spec: one frozen description of the device, loaded from a preset file.

Everything that describes the hardware lives here (VTA's ``Environment`` is the model):
the compiler reads capacities and costs from it, the emulator reads timing and power
from it, and its :meth:`NPUSpec.hash` is part of every tuning-log key, so a log measured
on one device is never replayed on another.

Units: cycles are NPU clock cycles, bytes are bytes, power is milliwatts (``_mw``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from edgetvm.errors import SpecError

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")

#: dtype keys of the matrix unit: fp16 x fp16, int8 x int8, fp16 x 4-bit weights.
MMA_DTYPES = ("fp16", "int8", "w4a16")
#: vector ops with a per-op cost (cycles per ``vector_lanes`` elements).
VECTOR_OPS = ("add", "sub", "mul", "max", "div", "reduce_max", "reduce_sum", "exp", "rsqrt",
              "silu", "gelu", "gelu_tanh", "rope", "mask", "cast", "copy")
#: units that draw power while busy (DMA and memories are charged per byte moved)
UNITS = ("matrix", "vector", "host")
#: emulator model version: bumped whenever the functional, timing or power model changes;
#: it is stamped on every program file, benchmark JSON and tuning-log key
#: (4: the governor counts the TCM power of compute commands as following the clock)
EMULATOR_MODEL_VERSION = 4


@dataclass(frozen=True)
class PowerProfile:
    """A power envelope: a budget on windowed average power and how it is enforced.

    Throttling rule (DVFS, see ``emulator/power.py``): every ``dvfs_interval_cycles`` a
    governor looks at the average power of the last ``power_window_cycles`` and sets the
    NPU clock scale ``s <= 1`` for the next interval so that the window's power, with the
    NPU units' dynamic power scaled by ``s ** dvfs_exponent`` and their commands' TCM
    traffic by ``s``, meets ``budget_mw``. DRAM
    is not slowed (its energy per byte stays), so a budget below the DRAM power of a
    bandwidth-bound phase cannot be met by throttling. ``dvfs_exponent`` 1 models
    frequency scaling at fixed voltage, 3 the usual ``f * V^2`` with voltage tracking
    frequency.
    """

    name: str
    budget_mw: float
    dvfs_exponent: float = 1.0


@dataclass(frozen=True)
class NPUSpec:
    """A frozen description of one edge NPU (see ``presets/*.json`` for the figures)."""

    name: str
    description: str
    clock_mhz: float
    # tightly coupled memory
    tcm_bytes: int
    tcm_alignment: int
    tcm_read_pj_per_byte: float
    tcm_write_pj_per_byte: float
    # DMA between DRAM (LPDDR) and TCM
    dma_channels: int
    dram_bytes_per_cycle: float
    dram_burst_bytes: int
    dram_pj_per_byte: float
    dma_setup_cycles: int
    # matrix unit: native tile (m, n, k), MACs per cycle per dtype, per-command latency
    mma_tile: tuple
    mma_macs_per_cycle: Mapping[str, int]
    mma_issue_cycles: int
    w4a16_dequant_weights_per_cycle: int
    # vector unit
    vector_lanes: int
    vector_op_cycles: Mapping[str, int]
    # control
    launch_cycles: int
    event_sync_cycles: int
    # host CPU fallback
    host_flops_per_cycle: float
    host_switch_cycles: int
    # power
    power_static_mw: float
    power_unit_mw: Mapping[str, float]
    power_window_cycles: int
    dvfs_interval_cycles: int
    power_profiles: Mapping[str, PowerProfile]
    default_profile: str = "performance"
    source: str = field(default="", compare=False)

    # -- derived figures -------------------------------------------------------------
    @property
    def cycle_ns(self) -> float:
        return 1e3 / self.clock_mhz

    def cycles_to_us(self, cycles: float) -> float:
        return cycles / self.clock_mhz

    def profile(self, name: str | None = None) -> PowerProfile:
        name = name or self.default_profile
        try:
            return self.power_profiles[name]
        except KeyError:
            raise SpecError(f"{self.name}: no power profile {name!r}; "
                            f"known: {', '.join(self.power_profiles)}") from None

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        d["mma_tile"] = list(self.mma_tile)
        d["mma_macs_per_cycle"] = dict(self.mma_macs_per_cycle)
        d["vector_op_cycles"] = dict(self.vector_op_cycles)
        d["power_unit_mw"] = dict(self.power_unit_mw)
        d["power_profiles"] = {k: {"budget_mw": p.budget_mw, "dvfs_exponent": p.dvfs_exponent}
                               for k, p in self.power_profiles.items()}
        return d

    def hash(self) -> str:
        """A stable 16-hex-digit hash of every figure (not the description)."""
        d = self.to_dict()
        d.pop("description")
        blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes) -> "NPUSpec":
        """A copy with some figures changed (e.g. a smaller TCM in a test)."""
        return dataclasses.replace(self, **changes)

    @property
    def target_tag(self) -> str:
        return f"edgetvm/{self.name}"


_REQUIRED = [f.name for f in dataclasses.fields(NPUSpec)
             if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def spec_from_dict(d: dict, source: str = "<dict>") -> NPUSpec:
    """Build and validate an :class:`NPUSpec` from a preset's JSON object."""
    if not isinstance(d, dict):
        raise SpecError(f"{source}: a spec is a JSON object of fields, not "
                        f"{type(d).__name__}")
    d = {k: v for k, v in d.items() if not k.startswith("_")}  # "_comment" keys document figures
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise SpecError(f"{source}: missing field(s): {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(NPUSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SpecError(f"{source}: unknown field(s): {', '.join(unknown)}")
    # every figure a finite number (a bool or a string is not one), every table of them too
    bad = [k for k, f in _FIELD_TYPES.items() if k in d and f in ("int", "float") and
           not _finite_number(d[k], f == "int")]
    bad += [f"{k}[{e!r}]" for k in ("mma_macs_per_cycle", "vector_op_cycles", "power_unit_mw")
            if isinstance(d.get(k), dict) for e, v in d[k].items() if not _finite_number(v)]
    if not isinstance(d.get("power_profiles"), dict) or not all(
            isinstance(v, dict) for v in d["power_profiles"].values()):
        raise SpecError(f"{source}: power_profiles must be an object of profiles, each an "
                        f"object of fields")
    bad += [f"power_profiles[{n!r}].{k}" for n, v in d["power_profiles"].items()
            for k, x in v.items() if not _finite_number(x)]
    if bad:
        raise SpecError(f"{source}: not a finite number: {', '.join(bad)}")
    try:
        profiles = {k: PowerProfile(name=k, **v) for k, v in d["power_profiles"].items()}
        spec = NPUSpec(**{**d,
                          "mma_tile": tuple(int(x) for x in d["mma_tile"]),
                          "mma_macs_per_cycle": MappingProxyType(dict(d["mma_macs_per_cycle"])),
                          "vector_op_cycles": MappingProxyType(dict(d["vector_op_cycles"])),
                          "power_unit_mw": MappingProxyType(dict(d["power_unit_mw"])),
                          "power_profiles": MappingProxyType(profiles),
                          "source": source})
    except (TypeError, ValueError, AttributeError) as e:
        raise SpecError(f"{source}: malformed spec: {e}") from None
    _validate(spec)
    return spec


#: NPUSpec field -> "int" / "float" / other (what a JSON value of it must be)
_FIELD_TYPES = {f.name: f.type if f.type in ("int", "float") else "other"
                for f in dataclasses.fields(NPUSpec)}

#: the largest TCM a spec may declare: the emulator holds it in memory (edge NPUs have
#: 1-32 MB; 1 GiB is far past any)
MAX_TCM_BYTES = 1 << 30


def _finite_number(v, integral: bool = False) -> bool:
    import math
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return math.isfinite(v) and (not integral or float(v).is_integer())


def _validate(s: NPUSpec) -> None:
    problems = []
    if s.tcm_bytes > MAX_TCM_BYTES:
        problems.append(f"tcm_bytes must be <= {MAX_TCM_BYTES} (1 GiB)")
    if s.tcm_alignment > 0 and s.tcm_alignment & (s.tcm_alignment - 1):
        problems.append("tcm_alignment must be a power of two")
    for name in ("clock_mhz", "tcm_bytes", "tcm_alignment", "dma_channels",
                 "dram_bytes_per_cycle", "dram_burst_bytes", "vector_lanes",
                 "power_window_cycles", "dvfs_interval_cycles", "host_flops_per_cycle",
                 "w4a16_dequant_weights_per_cycle"):
        if not getattr(s, name) > 0:
            problems.append(f"{name} must be > 0")
    for name in ("dram_pj_per_byte", "tcm_read_pj_per_byte", "tcm_write_pj_per_byte",
                 "mma_issue_cycles", "dma_setup_cycles", "event_sync_cycles", "launch_cycles"):
        if getattr(s, name) < 0:
            problems.append(f"{name} must be >= 0")
    if len(s.mma_tile) != 3 or min(s.mma_tile) <= 0:
        problems.append("mma_tile must be three positive ints (m, n, k)")
    for k in MMA_DTYPES:
        if s.mma_macs_per_cycle.get(k, 0) <= 0:
            problems.append(f"mma_macs_per_cycle[{k!r}] missing or not > 0")
    for op in VECTOR_OPS:
        if s.vector_op_cycles.get(op, 0) <= 0:
            problems.append(f"vector_op_cycles[{op!r}] missing or not > 0")
    for u in UNITS:
        if u not in s.power_unit_mw:
            problems.append(f"power_unit_mw[{u!r}] missing")
    if s.default_profile not in s.power_profiles:
        problems.append(f"default_profile {s.default_profile!r} is not a power profile")
    for p in s.power_profiles.values():
        if p.budget_mw <= s.power_static_mw:
            problems.append(f"profile {p.name!r}: budget_mw must exceed power_static_mw")
        if p.dvfs_exponent <= 0:
            problems.append(f"profile {p.name!r}: dvfs_exponent must be > 0")
    if problems:
        raise SpecError(f"{s.source}: " + "; ".join(problems))


def list_presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_spec(name_or_path: str) -> NPUSpec:
    """Load a preset by name (``edge-npu-16mb``) or a spec JSON file by path."""
    if isinstance(name_or_path, NPUSpec):
        return name_or_path
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PRESET_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise SpecError(f"unknown NPU preset or spec file {name_or_path!r}; "
                        f"presets: {', '.join(list_presets())}")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SpecError(f"{path}: cannot read spec: {e}") from None
    return spec_from_dict(d, source=path)
