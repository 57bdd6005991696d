"""``python -m edgetvm.inspect model.onnx``: what edgetvm recognises in a model, and what
runs on the NPU.

Imports the ONNX model, runs the semantic annotation passes
(``edgetvm.relax_passes.AnnotateLLMSemantics``), decides which regions the NPU takes (the
same decision ``edgetvm.run`` makes) and prints, per layer, the recognised regions, the
FLOPs inside and outside them, the FLOPs that run on the NPU, the coverage and the NPU
share. Ops outside every region, and regions the NPU does not take, run on the host.

Last, what the compiled path makes of it (``--no-compile`` skips this): every op on the
NPU, the elementwise ops it runs on the host between kernels, or why it refuses the model.

FLOPs are counted at a stated length, never at a symbolic one: by default a decode step
at the KV cache's capacity (one new token, ``max_tokens - 1`` past tokens), or a prefill
of ``--length`` tokens with ``--phase prefill``.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from edgetvm.errors import EdgeTVMError


def _parse_dims(items: list[str]) -> dict:
    dims = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise EdgeTVMError(f"--dim expects NAME=N with N a whole number >= 0, got "
                               f"{item!r}")
        dims[name.strip()] = int(value)
    return dims


def stated_dims(imported, phase: str = "decode", length: int = 128,
                max_tokens: int = 1024) -> dict:
    """Values of the model's symbolic dimensions for one step of ``phase``: batch 1; decode
    is one token after ``max_tokens - 1`` past tokens, prefill ``length`` tokens from an
    empty cache. The names are read off the inputs (``input_ids`` is (batch, sequence),
    a ``past_key_values`` input (batch, heads, past, head_dim))."""
    import tvm

    if phase not in ("decode", "prefill"):
        raise EdgeTVMError(f"phase must be decode or prefill, got {phase!r}")
    seq, past = (1, max_tokens - 1) if phase == "decode" else (length, 0)
    dims = {}
    params = dict(zip(imported.input_names, imported.mod["main"].params))

    def bind(name, axis, value):
        p = params.get(name)
        shape = getattr(getattr(p, "ty", None), "shape", None) if p is not None else None
        values = getattr(shape, "values", None)
        if values is not None and len(values) > axis and isinstance(values[axis], tvm.tirx.Var):
            dims.setdefault(values[axis].name, value)

    bind("input_ids", 0, 1)
    bind("input_ids", 1, seq)
    for name in imported.input_names:
        if name.startswith("past_key_values"):
            bind(name, 0, 1)
            bind(name, 2, past)
    for var in imported.tir_vars:
        dims.setdefault(var, 1)
    return dims


def inspect_model(path: str, dims: dict | None = None, *, phase: str = "decode",
                  length: int = 128, max_tokens: int = 1024, quantize: int | None = None):
    """Import, annotate and plan the offload of ``path``.

    Returns (annotated module, list of SemanticReport, the dims FLOPs were counted at)."""
    import tvm

    from edgetvm.frontend import import_onnx
    from edgetvm.npu_regions import offloadable, unsound_offloads
    from edgetvm.offload import offload_regions
    from edgetvm.relax_passes import AnnotateLLMSemantics, QuantizeW4A16, semantic_report
    from edgetvm.relax_passes._fusion import main_functions

    imported = import_onnx(path)
    counted = stated_dims(imported, phase, length, max_tokens)
    unknown = sorted(set(dims or {}) - set(counted))
    if unknown:
        raise EdgeTVMError(f"--dim: the model has no symbolic dimension "
                           f"{', '.join(unknown)}; it has {', '.join(sorted(counted)) or 'none'}")
    counted.update(dims or {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = imported.mod
        if quantize:
            mod = QuantizeW4A16(group_size=quantize)(mod)
        try:
            annotated = AnnotateLLMSemantics()(mod)
        except (tvm.error.InternalError, ValueError) as err:
            raise EdgeTVMError(f"{path}: semantic annotation failed: {err}") from None
    _, regions = offload_regions(annotated, offloadable, "edgetvm.inspect",
                                 prune=unsound_offloads)
    on_npu = {r.index for r in regions}
    reports = [
        semantic_report(annotated, gv.name_hint, counted, on_npu if gv.name_hint == "main"
                        else None)
        for gv, _ in main_functions(annotated)
    ]
    return annotated, reports, counted


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code (2 on bad input)."""
    parser = argparse.ArgumentParser(
        prog="python -m edgetvm.inspect",
        description="Show which LLM building blocks edgetvm recognises in an ONNX model "
                    "and which run on the NPU.",
    )
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="the step FLOPs are counted for (default decode at KV capacity)")
    parser.add_argument("--length", type=int, default=None,
                        help="prefill tokens for --phase prefill (default 128)")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="KV cache capacity: decode is counted with max_tokens - 1 past "
                             "tokens (default: the build's, 1024 or fewer when the model "
                             "bounds it)")
    parser.add_argument("--quantize", type=int, choices=(32, 64, 128), default=None,
                        metavar="G", help="inspect the model as run with --quantize G")
    parser.add_argument(
        "--dim", action="append", default=[], metavar="NAME=INT",
        help="override the value of a symbolic dimension for FLOP counting, "
        "e.g. --dim past_sequence_length=4095",
    )
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the check of what the compiled path makes of the model")
    args = parser.parse_args(argv)
    if args.length is not None and args.phase != "prefill":
        parser.error("--length is the prefill's tokens: it goes with --phase prefill")
    length = 128 if args.length is None else args.length
    if length < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        parser.error("--length and --max-tokens must be >= 1")
    try:
        if args.model.endswith(".npu") and os.path.isfile(args.model):
            raise EdgeTVMError(f"{args.model}: a built artifact (model.npu); inspect reads "
                               f"the ONNX file it was built from (the artifact's "
                               f"manifest.json names it and its programs)")
        dims = _parse_dims(args.dim)
        from edgetvm.build.compiler import MAX_KV_TOKENS
        if args.max_tokens is not None and args.max_tokens > MAX_KV_TOKENS:
            raise EdgeTVMError(f"--max-tokens must be in 1..{MAX_KV_TOKENS}")
        # the compiled path first: it knows the KV capacity the model allows (a learned
        # position table), at which the FLOPs are counted
        compiled, capacity = (None, None) if args.no_compile else \
            compiled_path(args.model, args.quantize, args.max_tokens)
        max_tokens = args.max_tokens or capacity or 1024
        if args.phase == "prefill" and length > max_tokens:
            raise EdgeTVMError(f"--length {length} is over the KV cache of {max_tokens} "
                               f"tokens")
        _, reports, counted = inspect_model(args.model, dims, phase=args.phase,
                                            length=length, max_tokens=max_tokens,
                                            quantize=args.quantize)
    except EdgeTVMError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from edgetvm.relax_passes import COVERAGE_DEFINITION

    print(f"model {args.model}")
    for report in reports:
        print(report.format_table())
    step = (f"decode step at KV capacity {max_tokens}" if args.phase == "decode"
            else f"prefill of {length} tokens")
    if counted:
        print(f"FLOPs counted for one {step}: " +
              ", ".join(f"{k}={v}" for k, v in counted.items()))
    else:
        print("FLOPs counted at the model's fixed shapes (it has no symbolic dimensions)")
    print(COVERAGE_DEFINITION)
    if compiled is not None:
        print(compiled)
    return 0


def compiled_path(model: str, quantize=None, max_tokens=None) -> tuple:
    """What the compiled path (``edgetvm.build``, ``edgetvm.run`` without
    ``--reference``) makes of the model: the ops it runs on the host, or why it refuses;
    and its KV capacity (None if refused)."""
    from edgetvm.build.compiler import ModelCompiler
    head = "compiled path (edgetvm.build; edgetvm.run without --reference):"
    try:
        mc = ModelCompiler(model, quantize=quantize, max_rows=16, max_tokens=max_tokens)
        notes = sorted({n for key in (("decode", 1, 1), ("prefill", 16, 1))
                        for n in mc.graph(*key).host_notes})
    except EdgeTVMError as err:
        return f"{head} refused: {err}", None
    except Exception as err:         # noqa: BLE001 - inspect reports, it does not crash
        lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
        return f"{head} fails to compile ({type(err).__name__}: " \
               f"{lines[-1] if lines else ''}): please report it", None
    if mc.capacity_bound and max_tokens is None:
        head += f" KV cache capacity {mc.max_tokens} tokens by default ({mc.capacity_bound});"
    if mc.sliding_windows:
        head += f" sliding window{'s' if len(mc.sliding_windows) > 1 else ''} of " \
                f"{', '.join(map(str, mc.sliding_windows))} tokens (masked by the " \
                f"attention kernel);"
    if not notes:
        return f"{head} every op on the NPU", mc.max_tokens
    return "\n  ".join([f"{head} {len(notes)} op(s) on the host between NPU kernels:"] +
                       notes), mc.max_tokens


if __name__ == "__main__":
    sys.exit(main())
