"""AnnotateResidual: the residual-stream additions of a transformer layer."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import wildcard

from ._fusion import (
    RegionPattern,
    bindings_of,
    call,
    composite_kind,
    fuse_regions,
    is_float,
    main_functions,
    static_shape,
)

# A residual add closes a block whose output comes from one of these regions.
_BLOCK_OUTPUTS = ("linear", "mlp", "attention")


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
        kinds = (composite_kind(mod, bindings, lhs), composite_kind(mod, bindings, rhs))
        return any(kind in _BLOCK_OUTPUTS for kind in kinds)

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
        return fuse_regions(mod, residual_patterns(mod))
