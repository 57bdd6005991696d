"""Lowering of scheduled s_tir PrimFuncs to NPU command-stream programs (see lower.py)."""
from .lower import lower_primfunc
from .reorder import AUTO as LIST_SCHEDULE_AUTO

__all__ = ["LIST_SCHEDULE_AUTO", "lower_primfunc"]
