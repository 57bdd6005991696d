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

import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm
from tvm.relax.dpl import is_op, rewrite_call
from tvm import relax

# TVM 0.27 moved constants to tvm.ir (relax.const builds an ir.GenericConst).
Constant = tvm.ir.expr.Constant

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
        fused = relax.transform.FuseOpsByPattern(
            [fusion], bind_constants=False, annotate_codegen=False
        )(mod)
        try:
            relax.analysis.well_formed(fused)  # 0.27: raises instead of returning False
        except Exception as err:  # noqa: BLE001 (0.27 raises ValueError or InternalError)
            # Matches that share a binding make FuseOpsByPattern emit a use before its
            # definition. Keep the region unrecognised rather than break the module.
            warnings.warn(f"edgetvm: skipped pattern {region.kind}: {str(err)[:300]}")
            continue
        mod = fused
    return _inline_shape_params(mod)


@relax.expr_functor.mutator
class _ShapeParamInliner(relax.PyExprMutator):
    def __init__(self, substitutions: dict):
        super().__init__()
        self.substitutions = substitutions

    def visit_var_(self, var):
        if var in self.substitutions:
            return self.substitutions[var]
        return super().visit_var_(var)


def _inline_shape_params(mod: tvm.IRModule) -> tvm.IRModule:
    """Use the shape value, not the lifted shape parameter, inside composite functions.

    ``FuseOpsByPattern`` lifts a symbolic ``R.shape([batch, seq, 8, 32])`` operand (of a
    reshape / broadcast_to absorbed into a region) to a function parameter; legalisation
    of reshape needs the ShapeExpr itself. The parameter's type carries the values, so
    uses are rewritten to an equal ShapeExpr and the parameter stays (it defines the
    symbolic variables).
    """
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function) or func.attrs is None or "Composite" not in func.attrs:
            continue
        substitutions = {
            p: relax.ShapeExpr(p.ty.values)
            for p in func.params
            if isinstance(p.ty, relax.ShapeType) and p.ty.values is not None
        }
        if substitutions:
            updates[gv] = _ShapeParamInliner(substitutions).visit_expr(func)
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod.update_func(gv, func)
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


def static_shape(expr: relax.Expr) -> tuple:
    """Shape of a tensor expression: ints for static dimensions, the symbolic expression
    as text (e.g. ``"seq_len"``) for dynamic ones, ``"?"`` for each dimension when only
    the rank is known (a tuple item of a fused region with symbolic shapes).
    ValueError if the rank is unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or ty.ndim < 0:
        raise ValueError("not a tensor of known rank")
    values = getattr(ty.shape, "values", None) if ty.shape is not None else None
    if values is None:
        return ("?",) * ty.ndim
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in values)


def depends_on(defs: dict, expr, target) -> bool:
    """True if ``expr`` is computed from ``target`` (through ``defs``)."""
    seen, stack = set(), [expr]
    while stack:
        e = stack.pop()
        if e.same_as(target):
            return True
        if isinstance(e, relax.Tuple):
            stack.extend(e.fields)
            continue
        if not isinstance(e, relax.Var) or e in seen:
            continue
        seen.add(e)
        value = defs.get(e)
        if isinstance(value, relax.Call):
            stack.extend(a for a in value.args if isinstance(a, relax.Expr))
        elif isinstance(value, relax.Tuple):
            stack.extend(value.fields)
        elif isinstance(value, relax.TupleGetItem):
            stack.append(value.tuple_value)
    return False


def dtype_of(expr: relax.Expr) -> str:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else ""


def is_float(expr: relax.Expr) -> bool:
    return dtype_of(expr).startswith(("float", "bfloat"))


def scalar_value(expr: relax.Expr) -> float:
    """Value of a constant holding one element (any rank); ValueError otherwise."""
    data = const_array(expr)
    if data.size != 1:
        raise ValueError("not a scalar constant")
    return float(data.reshape(()))


def const_array(expr: relax.Expr) -> np.ndarray:
    """Value of a bound constant as numpy; ValueError if ``expr`` is not a constant."""
    if not isinstance(expr, Constant):
        raise ValueError("not a constant")
    return expr.value.numpy()


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


def rewrite_main_functions(mod: tvm.IRModule, rewrites) -> tvm.IRModule:
    """Apply ``rewrite_call(pattern, fn)`` for each ``(pattern, fn)`` of ``rewrites``, in
    order, to every entry function of ``mod``; canonicalise the bindings where anything
    changed (the aliases a rewrite leaves behind). ``mod`` itself when nothing did."""
    updates = {}
    for gv, func in main_functions(mod):
        new_func = func
        for pattern, fn in rewrites:
            new_func = rewrite_call(pattern, fn, new_func)
        if not new_func.same_as(func):
            updates[gv] = new_func
    if not updates:
        return mod
    mod = mod.clone()
    for gv, func in updates.items():
        mod.update_func(gv, func)
    return relax.transform.CanonicalizeBindings()(mod)


def call(op_name: str, *args):
    """Pattern of a call to ``op_name`` whose leading arguments match ``args``.

    Trailing arguments are wildcards: several 0.27 ops carry their parameters as
    arguments (``strided_slice`` axes/begin/end, ``reshape``/``broadcast_to`` shapes).
    """
    return is_op(op_name)(*args, varg_default_wildcard=True)


def head_split(t):
    """``t`` optionally split into heads: ``permute_dims(reshape(t))`` (batch, heads, seq,
    head_dim) or, when seq is 1 and the exporter dropped the transpose, ``reshape(t)``.
    Absorbing the split keeps this layout glue inside the region that consumes it."""
    split = call("relax.reshape", t)
    return call("relax.permute_dims", split) | split | t
