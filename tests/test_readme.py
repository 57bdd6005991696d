"""README.md is the user's manual and .ci/run runs it: the quick start's set-up, main job
and test commands are the commands CI runs, line for line."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quick_start_commands() -> list:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    return [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip()]


def test_ci_runs_the_readme_quick_start():
    cmds = _quick_start_commands()
    # set-up (two), the main job (one), the tests (one)
    assert len(cmds) == 4, cmds
    assert cmds[-1].startswith("python -m pytest")
    assert "edgetvm.tune" in cmds[2] and "edgetvm.build" in cmds[2] and \
        "edgetvm.run" in cmds[2]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "set -euo pipefail" in ci
    for cmd in cmds:
        # `set -e` does not stop at a failure inside an && list: such a line must say so
        want = cmd + " || exit 1" if "&&" in cmd else cmd
        assert want in ci, f"README's {cmd!r} is not what .ci/run runs (as {want!r})"
