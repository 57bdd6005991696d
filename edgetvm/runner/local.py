"""LocalRunner: the emulator in this process, through the same service a server runs."""
from __future__ import annotations

import time

from .base import Runner, RunJob, RunResult, _Channel, _result_from
from .service import DEFAULT_SPEC, EmulatorService


class _LocalChannel(_Channel):
    """The service in this process: same code path as a server, no serialisation."""

    address = "local"

    def __init__(self, spec):
        self._service = EmulatorService(spec, server={"address": "local", "key": None})

    def info(self) -> dict:
        return self._service.info()

    def open_device(self, spec, profile) -> str:
        return self._service.open_device(spec, profile)

    def close_device(self, handle: str) -> None:
        self._service.close_device(handle)

    def device_state(self, handle: str) -> dict:
        return self._service.device_state(handle)

    def run(self, job: RunJob, spec, device: str | None) -> RunResult:
        t0 = time.perf_counter()
        res = self._service.run(job.program, job.inputs, job.params, spec, job.profile,
                                device, job.trace)
        res["counters"] = dict(res["counters"])
        return _result_from(res, time.perf_counter() - t0)


class LocalRunner(Runner):
    """The emulator in this process (the reference every remote run must agree with).

    Parameters
    ----------
    spec : NPUSpec or str
        The NPU to emulate (default ``edge-npu-16mb``).
    """

    def __init__(self, spec=DEFAULT_SPEC):
        super().__init__(DEFAULT_SPEC if spec is None else spec)
        self._local = _LocalChannel(self.spec)

    def _channel(self) -> _Channel:
        return self._local

    def __repr__(self):
        return f"LocalRunner({self.spec.name!r})"
