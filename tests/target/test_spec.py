"""NPUSpec: presets load, the hash is stable and covers every figure, bad files are refused."""
from __future__ import annotations

import json
import os

import pytest

from edgetvm.errors import SpecError
from edgetvm.target.spec import (MMA_DTYPES, PRESET_DIR, UNITS, VECTOR_OPS, PowerProfile,
                                 list_presets, load_spec)

PRESETS = ["edge-npu-4mb", "edge-npu-8mb", "edge-npu-16mb", "edge-npu-32mb"]
MB = 1 << 20


def test_four_presets_are_listed():
    assert list_presets() == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_loads_with_every_figure(name):
    s = load_spec(name)
    assert s.name == name
    assert s.tcm_bytes == int(name.split("-")[-1][:-2]) * MB
    assert len(s.mma_tile) == 3 and all(isinstance(x, int) and x > 0 for x in s.mma_tile)
    assert set(MMA_DTYPES) <= set(s.mma_macs_per_cycle)
    assert set(VECTOR_OPS) <= set(s.vector_op_cycles)
    assert set(UNITS) <= set(s.power_unit_mw)
    assert {"performance", "balanced", "low-battery"} <= set(s.power_profiles)
    assert s.profile().name == s.default_profile == "performance"
    assert all(p.budget_mw > s.power_static_mw for p in s.power_profiles.values())
    assert s.target_tag == f"edgetvm/{name}"
    assert s.cycles_to_us(s.clock_mhz) == pytest.approx(1.0)


def test_presets_grow_with_tcm():
    specs = [load_spec(n) for n in PRESETS]
    assert [s.tcm_bytes for s in specs] == [4 * MB, 8 * MB, 16 * MB, 32 * MB]
    assert len({s.hash() for s in specs}) == 4


def test_hash_is_stable_across_loads():
    a, b = load_spec("edge-npu-16mb"), load_spec("edge-npu-16mb")
    assert a is not b and a == b
    assert a.hash() == b.hash()
    assert len(a.hash()) == 16 and int(a.hash(), 16) >= 0


def test_hash_changes_with_any_figure_but_not_the_description():
    s = load_spec("edge-npu-16mb")
    h = s.hash()
    assert s.replace(description="another words").hash() == h
    assert s.replace(tcm_bytes=s.tcm_bytes // 2).hash() != h
    assert s.replace(dma_setup_cycles=s.dma_setup_cycles + 1).hash() != h
    assert s.replace(mma_tile=(16, 64, 32)).hash() != h
    profiles = dict(s.power_profiles)
    profiles["performance"] = PowerProfile("performance", 2400.0, 1.0)
    assert s.replace(power_profiles=profiles).hash() != h


def test_hash_is_independent_of_file_location(tmp_path):
    with open(os.path.join(PRESET_DIR, "edge-npu-8mb.json")) as f:
        d = json.load(f)
    d["description"] = "copied"
    p = tmp_path / "copy.json"
    p.write_text(json.dumps(d))
    assert load_spec(str(p)).hash() == load_spec("edge-npu-8mb").hash()


def _preset_dict(name="edge-npu-16mb"):
    with open(os.path.join(PRESET_DIR, f"{name}.json")) as f:
        return json.load(f)


def _write(tmp_path, d, text=None):
    p = tmp_path / "spec.json"
    p.write_text(text if text is not None else json.dumps(d))
    return str(p)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown NPU preset or spec file 'edge-npu-3mb'.*"
                                        r"edge-npu-16mb"):
        load_spec("edge-npu-3mb")


def test_missing_field_is_named(tmp_path):
    d = _preset_dict()
    del d["dma_setup_cycles"], d["vector_lanes"]
    with pytest.raises(SpecError, match=r"missing field\(s\): .*dma_setup_cycles.*vector_lanes"):
        load_spec(_write(tmp_path, d))


def test_unknown_field_is_named(tmp_path):
    d = _preset_dict()
    d["tcm_bytez"] = 1
    with pytest.raises(SpecError, match=r"unknown field\(s\): tcm_bytez"):
        load_spec(_write(tmp_path, d))


def test_a_spec_that_is_not_an_object_is_refused(tmp_path):
    with pytest.raises(SpecError, match="a spec is a JSON object of fields, not list"):
        load_spec(_write(tmp_path, None, text="[1, 2, 3]"))


def test_not_json_is_refused(tmp_path):
    with pytest.raises(SpecError, match="cannot read spec"):
        load_spec(_write(tmp_path, None, text='{"name": "x", '))


@pytest.mark.parametrize("field, value, message", [
    ("tcm_bytes", 0, "tcm_bytes must be > 0"),
    ("mma_tile", [16, 64], "mma_tile must be three positive ints"),
    ("default_profile", "turbo", "default_profile 'turbo' is not a power profile"),
    # figures of the wrong type or beyond what the emulator can hold: refused when the
    # spec is loaded, not as a traceback (or an allocation of 909 TiB) once a program runs
    ("clock_mhz", "fast", "not a finite number: clock_mhz"),
    ("dma_channels", True, "not a finite number: dma_channels"),
    ("tcm_bytes", 1.5, "not a finite number: tcm_bytes"),
    ("tcm_bytes", 10 ** 15, r"tcm_bytes must be <= 1073741824"),
    ("tcm_alignment", 3, "tcm_alignment must be a power of two"),
    ("vector_op_cycles", {"add": "x"}, r"not a finite number: vector_op_cycles\['add'\]"),
    ("power_profiles", [1], "power_profiles must be an object of profiles"),
    ("power_profiles", {"performance": {"budget_mw": "high", "dvfs_exponent": 1}},
     r"power_profiles\['performance'\].budget_mw"),
])
def test_inconsistent_figures_are_refused(tmp_path, field, value, message):
    d = _preset_dict()
    d[field] = value
    with pytest.raises(SpecError, match=message):
        load_spec(_write(tmp_path, d))


def test_missing_vector_op_cost_and_bad_profile(tmp_path):
    d = _preset_dict()
    del d["vector_op_cycles"]["gelu"]
    d["power_profiles"]["low-battery"]["budget_mw"] = 10   # below static power
    with pytest.raises(SpecError) as e:
        load_spec(_write(tmp_path, d))
    assert "vector_op_cycles['gelu'] missing" in str(e.value)
    assert "profile 'low-battery': budget_mw must exceed power_static_mw" in str(e.value)


def test_malformed_profile_is_refused(tmp_path):
    d = _preset_dict()
    d["power_profiles"]["balanced"] = {"budget": 5}
    with pytest.raises(SpecError, match="malformed spec"):
        load_spec(_write(tmp_path, d))


def test_unknown_profile_is_refused():
    with pytest.raises(SpecError, match="no power profile 'turbo'; known: performance"):
        load_spec("edge-npu-16mb").profile("turbo")
