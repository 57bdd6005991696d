"""The NPU: spec + presets, command-stream ISA, program format, emulator, TVM target tags."""
from .spec import NPUSpec, PowerProfile, list_presets, load_spec

__all__ = ["NPUSpec", "PowerProfile", "list_presets", "load_spec"]
