"""Timeline export in Chrome-trace JSON (open in https://ui.perfetto.dev or chrome://tracing).

One track per unit (each DMA channel, matrix, vector, host, control for launches) and a
power counter track, so the overlap of DMA and compute is visible at a glance.
"""
from __future__ import annotations

import json

_TRACK_ORDER = ["control", "dma0", "dma1", "dma2", "dma3", "matrix", "vector", "host"]


def chrome_trace(result, spec) -> dict:
    """The trace of a :class:`RunResult` run with ``trace=True`` as a Chrome-trace dict."""
    us = 1.0 / spec.clock_mhz
    units = sorted({e.unit for e in result.trace},
                   key=lambda u: (_TRACK_ORDER.index(u) if u in _TRACK_ORDER else 99, u))
    tid = {u: k + 1 for k, u in enumerate(units)}
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": spec.name}}]
    for u, t in tid.items():
        events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": u}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": t,
                       "args": {"sort_index": t}})
    for e in result.trace:
        events.append({"ph": "X", "name": e.name, "cat": e.unit, "pid": 1, "tid": tid[e.unit],
                       "ts": e.start * us, "dur": (e.end - e.start) * us,
                       "args": {"command": e.index, "start_cycle": e.start,
                                "end_cycle": e.end}})
    if result.power_mw is not None:
        for t, p in zip(result.power_window_starts, result.power_mw):
            events.append({"ph": "C", "name": "power_mw", "pid": 1, "ts": float(t) * us,
                           "args": {"mW": float(p)}})
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"spec": spec.name, "counters": _counters(result.counters)}}


def write_chrome_trace(result, spec, path: str) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(result, spec), f)


def _counters(c) -> dict:
    return c.to_dict() if hasattr(c, "to_dict") else dict(c)
