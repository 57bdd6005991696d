"""Session-wide test settings."""
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _build_cache(tmp_path_factory):
    """``edgetvm.run model.onnx`` builds into a cache: the tests' own, not the user's, and
    one for all the test processes of a run (``pytest -n 2``): a build is written whole
    and renamed into place (``edgetvm/build/package.py``), so one process reuses what
    another built instead of building it again."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGETVM_CACHE", str(root / "edgetvm-cache"))
    yield
    mp.undo()
