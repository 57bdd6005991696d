"""Shared machinery of the semantic annotation passes.

Every annotation pass turns the regions its patterns match into composite Relax functions
(``FuseOpsByPattern(bind_constants=False, annotate_codegen=False)``): the function carries
``"Composite": "edgetvm.<kind>"`` plus string attributes ``"edgetvm.<param>"`` with what the
pass extracted (heads, eps, group size, ...). ``Primitive=1`` stays set, so the ordinary
``tvm.compile`` pipeline legalises and fuses each region into one PrimFunc.

Patterns are run one at a time, each over the whole module, in priority order: a longer
variant (e.g. RMSNorm with a weight) must claim its bindings before the shorter variant
(without weight) claims the inner part, and ``FuseOpsByPattern`` rejects a match that
overlaps an earlier group instead of falling back to another alternative of an OrPattern.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm
from tvm import relax

COMPOSITE_PREFIX = "edgetvm."
ATTR_PREFIX = "edgetvm."


@dataclass
class RegionPattern:
    """One way a semantic region can look in the graph.

    Parameters
    ----------
    kind : str
        Region kind without prefix (``"rms_norm"``); the composite is ``edgetvm.<kind>``.
    pattern : tvm.relax.dpl.DFPattern
        The dataflow pattern, rooted at the region's last op.
    annotations : dict
        Named sub-patterns handed to ``check`` and ``attrs``.
    check : callable, optional
        ``check(matched: dict[str, Expr], ctx: PatternCheckContext) -> bool``.
    attrs : callable, optional
        ``attrs(matched: dict[str, Expr]) -> dict[str, object]``; values are stringified.
    """

    kind: str
    pattern: object
    annotations: dict = field(default_factory=dict)
    check: Callable | None = None
    attrs: Callable | None = None


def _matched(ctx) -> dict:
    return {str(k): v for k, v in ctx.annotated_expr.items()}


def fuse_regions(mod: tvm.IRModule, patterns: list[RegionPattern]) -> tvm.IRModule:
    """Group every match of ``patterns`` (in priority order) into composite functions."""
    for region in patterns:

        def check(ctx, region=region):
            if region.check is None:
                return True
            try:
                return bool(region.check(_matched(ctx), ctx))
            except (ValueError, TypeError, KeyError, IndexError, AttributeError):
                # An unexpected shape (symbolic dim, missing attr) means "not this region":
                # the ops stay on the generic path instead of failing the compile.
                return False

        def attrs_getter(matched, region=region):
            matched = {str(k): v for k, v in matched.items()}
            values = region.attrs(matched) if region.attrs is not None else {}
            return {ATTR_PREFIX + k: _attr_str(v) for k, v in values.items()}

        fusion = relax.transform.FusionPattern(
            COMPOSITE_PREFIX + region.kind, region.pattern, region.annotations, check, attrs_getter
        )
        mod = relax.transform.FuseOpsByPattern(
            [fusion], bind_constants=False, annotate_codegen=False
        )(mod)
    return mod


def _attr_str(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return repr(float(np.float32(value)))
    if isinstance(value, (list, tuple)):
        return ",".join(_attr_str(v) for v in value)
    return str(value)


# ---------------------------------------------------------------- expression helpers


def static_shape(expr: relax.Expr) -> tuple[int, ...]:
    """Static shape of a tensor expression; ValueError if any dimension is symbolic."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        raise ValueError("not a tensor with known shape")
    dims = []
    for d in ty.shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            raise ValueError("symbolic dimension")
        dims.append(int(d))
    return tuple(dims)


def dim(expr: relax.Expr, axis: int):
    """One dimension of a tensor: an int if static, else its symbolic expression as text."""
    d = expr.ty.shape.values[axis]
    return int(d) if isinstance(d, tvm.tirx.IntImm) else str(d)


def dtype_of(expr: relax.Expr) -> str:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else ""


def is_float(expr: relax.Expr) -> bool:
    return dtype_of(expr).startswith(("float", "bfloat"))


def scalar_value(expr: relax.Expr) -> float:
    """Value of a constant holding one element (any rank); ValueError otherwise."""
    if not isinstance(expr, relax.Constant):
        raise ValueError("not a constant")
    data = expr.data.numpy()
    if data.size != 1:
        raise ValueError("not a scalar constant")
    return float(data.reshape(()))


def bindings_of(func: relax.Function) -> dict:
    """Map bound var -> value for every binding of ``func``."""
    table = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            table[binding.var] = binding.value
    return table


def function_outputs(func: relax.Function) -> list:
    """Vars the function returns (fields of a returned tuple, or the returned var)."""
    body = func.body.body
    if isinstance(body, relax.Tuple):
        return list(body.fields)
    return [body]


def composite_kind(mod: tvm.IRModule, bindings: dict, expr: relax.Expr) -> str | None:
    """Kind (without prefix) of the composite that produced ``expr``, if any."""
    value = bindings.get(expr) if isinstance(expr, relax.Var) else expr
    if isinstance(value, relax.TupleGetItem):
        value = bindings.get(value.tuple_value, value.tuple_value)
    if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
        func = mod[value.op]
        name = func.attrs.get("Composite") if func.attrs is not None else None
        if name is not None and str(name).startswith(COMPOSITE_PREFIX):
            return str(name)[len(COMPOSITE_PREFIX):]
    return None


def main_functions(mod: tvm.IRModule):
    """(GlobalVar, Function) pairs of the non-composite Relax functions (entry points)."""
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and (
            func.attrs is None or "Composite" not in func.attrs
        ):
            yield gv, func
