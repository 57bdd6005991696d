"""The JSON every benchmark writes: its figures plus what produced them.

Every file records the edgetvm version and the emulator model version
(``edgetvm.target.spec.EMULATOR_MODEL_VERSION``): figures measured under another model of
the device (other bursts, other energies, another governor) are not comparable."""
from __future__ import annotations

import json

from edgetvm import __version__
from edgetvm.target.spec import EMULATOR_MODEL_VERSION


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` (a dict) with the versions, then say where."""
    data = {"edgetvm_version": __version__, "emulator_model_version": EMULATOR_MODEL_VERSION,
            **payload}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")
