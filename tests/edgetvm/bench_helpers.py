"""Loading a benchmark script as a module, as ``python benchmarks/NAME.py`` runs it."""
import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def load_benchmark(monkeypatch, name: str):
    """``benchmarks/NAME.py`` as a module, with benchmarks/ first on the path (its
    ``from report import ...`` resolves as when the script runs)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    path = REPO / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
