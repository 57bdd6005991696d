"""The NPU emulator: functional + timing + power model of a command stream (see device.py)."""
from .costs import command_cycles
from .device import Counters, CycleLimitExceeded, Emulator, RunResult, Timeline, TraceEvent
from .trace import chrome_trace, write_chrome_trace

__all__ = ["Emulator", "Timeline", "RunResult", "Counters", "TraceEvent", "command_cycles",
           "CycleLimitExceeded",
           "chrome_trace", "write_chrome_trace"]
