"""TVM target tags of the presets: "npu" in the keys, the spec round-trips, code compiles."""
from __future__ import annotations

import numpy as np
import pytest

tvm = pytest.importorskip("tvm")

from edgetvm.target.spec import list_presets, load_spec  # noqa: E402
from edgetvm.target.tags import npu_target, register_npu_tags, spec_of_target  # noqa: E402


def test_every_preset_has_a_tag():
    tags = register_npu_tags()
    assert tags == [f"edgetvm/{p}" for p in list_presets()]
    assert set(tags) <= set(tvm.target.list_tags())


def test_npu_target_keys_and_round_trip():
    t = npu_target("edge-npu-16mb")
    assert "npu" in t.keys and "cpu" in t.keys
    assert t.kind.name == "llvm"
    spec = spec_of_target(t)
    assert spec == load_spec("edge-npu-16mb")
    assert spec.hash() == load_spec("edge-npu-16mb").hash()
    assert spec_of_target(npu_target(load_spec("edge-npu-4mb"))).tcm_bytes == 4 << 20


def test_spec_of_a_plain_cpu_target_is_refused():
    with pytest.raises(ValueError, match="not an edgetvm NPU target"):
        spec_of_target(tvm.target.Target({"kind": "llvm"}))


def test_prim_func_compiles_and_runs_with_the_tag():
    from tvm import te

    a = te.placeholder((64,), name="A", dtype="float32")
    b = te.compute((64,), lambda i: a[i] * 2.0 + 1.0, name="B")
    mod = tvm.IRModule({"main": te.create_prim_func([a, b])})
    ex = tvm.compile(mod, target=npu_target("edge-npu-16mb"))
    x = np.arange(64, dtype="float32")
    ta, tb = tvm.runtime.tensor(x), tvm.runtime.tensor(np.zeros(64, "float32"))
    ex["main"](ta, tb)
    np.testing.assert_array_equal(tb.numpy(), x * 2 + 1)
