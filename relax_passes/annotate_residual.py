"""AnnotateResidual: the residual-stream additions of a transformer layer."""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import wildcard

from ._fusion import (
    RegionPattern,
    bindings_of,
    call,
    composite_kind,
    depends_on,
    fuse_regions,
    is_float,
    main_functions,
    static_shape,
)

# A residual add closes a block whose output comes from one of these regions (a residual
# add itself: GPT-NeoX's parallel residual adds attention and MLP outputs, then the stream).
_BLOCK_OUTPUTS = ("linear", "mlp", "attention", "residual_add")


def _producer_kind(mod, bindings, expr):
    """Kind of the region producing ``expr``, looking through reshapes (an exporter's
    flattening around a 2-D GEMM)."""
    while True:
        kind = composite_kind(mod, bindings, expr)
        value = bindings.get(expr)
        if kind is not None or not (isinstance(value, relax.Call) and
                                    getattr(value.op, "name", "") == "relax.reshape"):
            return kind
        expr = value.args[0]


def residual_patterns(mod: tvm.IRModule) -> list[RegionPattern]:
    """``add(stream, block_out)``: same-shape float add of two activations, one of them
    produced by a linear / MLP / attention region."""
    bindings = {}
    for _, func in main_functions(mod):
        bindings.update(bindings_of(func))
    a, b = wildcard(), wildcard()
    add = call("relax.add", a, b)

    def check(m, ctx):
        lhs, rhs = ctx.matched_expr.args
        shape = static_shape(ctx.matched_expr)
        if not (is_float(ctx.matched_expr) and static_shape(lhs) == shape == static_shape(rhs)):
            return False
        kinds = (_producer_kind(mod, bindings, lhs), _producer_kind(mod, bindings, rhs))
        for block_out, stream, kind in ((lhs, rhs, kinds[0]), (rhs, lhs, kinds[1])):
            # the stream bypasses the block: an add of the block output with something
            # computed from it (GELU's x + 0.044715 x^3) is not a residual connection
            if kind in _BLOCK_OUTPUTS and not depends_on(bindings, stream, block_out):
                return True
        return False

    def attrs(m):
        return {"hidden_size": static_shape(m["a"])[-1]}

    return [RegionPattern("residual_add", add, {"a": a}, check, attrs)]


@tvm.transform.module_pass(opt_level=0, name="AnnotateResidual")
class AnnotateResidual:
    """Group residual adds into ``edgetvm.residual_add`` composites.

    Runs last: by then the adds inside norms, RoPE, attention and projections are taken,
    and what remains next to a block output is the residual connection, which the fusion
    partitioner folds into the epilogue of the producing GEMM. Attributes:
    ``hidden_size``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        # a residual add of a residual add's output is recognised once the first one is a
        # region: repeat until nothing new is found (two rounds for a parallel residual)
        for _ in range(4):
            before = _region_count(mod)
            mod = fuse_regions(mod, residual_patterns(mod))
            if _region_count(mod) == before:
                break
        return mod


def _region_count(mod: tvm.IRModule) -> int:
    return sum(1 for _, f in mod.functions_items()
               if isinstance(f, relax.Function) and f.attrs is not None and "Composite" in f.attrs)
