"""TVM target tags for the NPU presets.

TVM 0.27 cannot register a new target kind from Python (notes/tvm-0.27.md), so each preset
gets a tag on an ``llvm`` base whose keys contain ``"npu"``: passes and schedule rules
dispatch on ``"npu" in target.keys``, and the host-side code (fallback ops, the driver)
still compiles for the CPU. NPU figures stay in the :class:`NPUSpec`, not in target
attributes (unknown attributes are rejected).
"""
from __future__ import annotations

from .spec import NPUSpec, list_presets, load_spec

_REGISTERED: set = set()


def register_npu_tags() -> list[str]:
    """Register ``edgetvm/<preset>`` for every preset; returns the tag names."""
    return [_register(load_spec(preset)) for preset in list_presets()]


def _register(spec: NPUSpec) -> str:
    from tvm.target import register_tag

    if spec.target_tag not in _REGISTERED:
        register_tag(spec.target_tag, {"kind": "llvm", "keys": ["npu", "cpu"],
                                       "device": "edge_npu", "model": spec.name,
                                       "num-cores": 2}, override=True)
        _REGISTERED.add(spec.target_tag)
    return spec.target_tag


def npu_target(spec: NPUSpec | str = "edge-npu-16mb"):
    """The ``tvm.target.Target`` of a preset (or spec), registering the tags on first use."""
    import tvm

    return tvm.target.Target(_register(load_spec(spec)))


def spec_of_target(target) -> NPUSpec:
    """The spec a target tag stands for (``model`` attribute), for passes that get a target."""
    if "npu" not in target.keys:
        raise ValueError(f"{target} is not an edgetvm NPU target (no 'npu' in its keys)")
    return load_spec(str(target.attrs["model"]))
