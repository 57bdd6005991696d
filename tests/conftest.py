"""Session-wide test settings."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _build_cache(tmp_path_factory):
    """``edgetvm.run model.onnx`` builds into a cache: the tests' own, not the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("EDGETVM_CACHE", str(tmp_path_factory.mktemp("edgetvm-cache")))
    yield
    mp.undo()
