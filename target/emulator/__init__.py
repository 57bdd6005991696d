"""The NPU emulator: functional + timing + power model of a command stream (see device.py)."""
from .device import Counters, Emulator, RunResult, TraceEvent, command_cycles
from .trace import chrome_trace, write_chrome_trace

__all__ = ["Emulator", "RunResult", "Counters", "TraceEvent", "command_cycles", "chrome_trace",
           "write_chrome_trace"]
