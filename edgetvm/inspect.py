"""``python -m edgetvm.inspect model.onnx``: what edgetvm recognises in a model.

Imports the ONNX model, runs the semantic annotation passes
(``edgetvm.relax_passes.AnnotateLLMSemantics``) and prints, per layer, the recognised
regions (attention, RoPE, RMSNorm, linear, MLP, KV append, ...), the FLOPs inside and
outside them, and the coverage. Ops outside every region stay on the generic Relax
path; an architecture with no known block is reported as such.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from edgetvm.errors import EdgeTVMError, ModelImportError


def load_relax_module(path: str):
    """Import ``path`` with ``edgetvm.frontend.import_onnx`` (falling back to TVM's
    importer when the front end is not available). Raises ModelImportError."""
    if not os.path.isfile(path):
        raise ModelImportError(f"{path}: no such file")
    try:
        from edgetvm.frontend import import_onnx
    except ImportError:
        import_onnx = None
    if import_onnx is not None:
        return import_onnx(path).mod
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    try:
        model = onnx.load(path)
    except Exception as err:  # onnx raises DecodeError, ValueError, ... on bad bytes
        raise ModelImportError(f"{path}: not a readable ONNX model ({err})") from None
    try:
        return from_onnx(model, keep_params_in_input=False)
    except Exception as err:  # TVM raises many types; the user needs the message only
        raise ModelImportError(f"{path}: import failed: {err}") from None


def _parse_dims(items: list[str]) -> dict:
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise EdgeTVMError(f"--dim expects NAME=INT, got {item!r}")
        dims[name.strip()] = int(value)
    return dims


def inspect_model(path: str, dims: dict | None = None):
    """Import and annotate ``path``; return (annotated module, list of SemanticReport)."""
    import tvm

    from edgetvm.relax_passes import AnnotateLLMSemantics, semantic_report
    from edgetvm.relax_passes._fusion import main_functions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = load_relax_module(path)
        try:
            annotated = AnnotateLLMSemantics()(mod)
        except (tvm.error.InternalError, ValueError) as err:
            raise EdgeTVMError(f"{path}: semantic annotation failed: {err}") from None
    reports = [
        semantic_report(annotated, gv.name_hint, dims) for gv, _ in main_functions(annotated)
    ]
    return annotated, reports


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m edgetvm.inspect",
        description="Show which LLM building blocks edgetvm recognises in an ONNX model.",
    )
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument(
        "--dim", action="append", default=[], metavar="NAME=INT",
        help="value of a symbolic dimension for FLOP counting (default 1), "
        "e.g. --dim sequence_length=128",
    )
    args = parser.parse_args(argv)
    try:
        dims = _parse_dims(args.dim)
        _, reports = inspect_model(args.model, dims)
    except EdgeTVMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from edgetvm.relax_passes import COVERAGE_DEFINITION

    print(f"model {args.model}")
    for report in reports:
        print(report.format_table())
    if dims:
        print("symbolic dimensions: " + ", ".join(f"{k}={v}" for k, v in dims.items()))
    print(COVERAGE_DEFINITION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
