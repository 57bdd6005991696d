"""The JSON every benchmark writes: its figures plus what produced them.

Every file records the edgetvm version and the emulator model version
(``edgetvm.target.spec.EMULATOR_MODEL_VERSION``): figures measured under another model of
the device (other bursts, other energies, another governor) are not comparable."""
from __future__ import annotations

import json
import sys

from edgetvm import __version__
from edgetvm.target.spec import EMULATOR_MODEL_VERSION


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` (a dict) with the versions, then say where."""
    data = {"edgetvm_version": __version__, "emulator_model_version": EMULATOR_MODEL_VERSION,
            **payload}
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {path}")


def numerics_exit_code(rows: list, labels: tuple) -> int:
    """1 after naming on stderr every row whose logits were outside tolerance (by the
    row's ``labels`` fields), else 0: a benchmark fails when what it measured is wrong."""
    wrong = [r for r in rows if r.get("numerics_ok") is False]
    for r in wrong:
        print(f"WRONG: {' '.join(str(r[k]) for k in labels)}: max |logit diff| "
              f"{r['max_abs_diff']:.4f} > {r['tolerance']:.4f}", file=sys.stderr)
    return 1 if wrong else 0
