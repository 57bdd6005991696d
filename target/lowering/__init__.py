"""Lowering of scheduled s_tir PrimFuncs to NPU command-stream programs (see lower.py)."""
from .lower import lower_primfunc

__all__ = ["lower_primfunc"]
