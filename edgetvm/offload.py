"""OffloadToNPU: every recognised region whose kind has an NPU kernel becomes a call into
the NPU (the emulator), the rest of the graph stays on the host.

After ``AnnotateLLMSemantics`` each recognised region is a composite function
(``"Composite": "edgetvm.<kind>"``). This pass replaces a call to such a function by
``R.call_pure_packed("edgetvm.npu.<session>.<n>", *runtime_args)``; the packed function
(registered by :class:`~edgetvm.session.NPUSession`) runs the region's NPU kernels on the
emulator. The region's constant arguments (weights, eps, ...) do not travel at run time:
the region keeps them, packed once for the NPU. Regions without an NPU kernel, and the
glue between regions (reshapes, shape arithmetic), are compiled for the host CPU by the
ordinary ``tvm.compile`` pipeline: the host-fallback path.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .region_ops import rope_heads_axis

Constant = tvm.ir.expr.Constant


@dataclass
class Region:
    """One offloaded region: its kind, attributes and the composite's full argument list
    (constants as numpy arrays, runtime arguments as ``None`` placeholders)."""

    index: int
    kind: str
    attrs: dict
    args: list                      # np.ndarray for constants, None for runtime args
    param_names: list
    func: relax.Function
    symbol: str
    runtime_positions: list = field(default_factory=list)
    arg_names: list = field(default_factory=list)     # call-site names of Var arguments
    arg_sources: list = field(default_factory=list)   # the Region producing each, or None
    callees: list = field(default_factory=list)       # attrs of the PrimFuncs it call_tir's
    arg_kinds: list = field(default_factory=list)     # kind of the region computing each
                                                      # arg in the annotated graph, offloaded
                                                      # or not (None: not a region)
    cache: dict = field(default_factory=dict, repr=False)   # packed weights, made once


def _const_value(e):
    if isinstance(e, Constant):
        return e.value.numpy()
    return None


@mutator
class _Rewriter(PyExprMutator):
    def __init__(self, mod, accept, prefix):
        super().__init__(mod)
        self.mod_ = mod
        self.accept = accept
        self.prefix = prefix
        self.regions: list = []
        self.calls = 0                  # composite calls seen: a region's index
        self.kind_of = {}               # var bound to a composite call -> its kind
        for block in mod["main"].body.blocks:
            for b in block.bindings:
                kind = _composite_kind(mod, b.value)
                if kind is not None:
                    self.kind_of[b.var] = kind

    def visit_call_(self, call):
        arg_kinds = [self.kind_of.get(a) if isinstance(a, relax.Var) else None
                     for a in call.args]
        call = super().visit_call_(call)
        if not isinstance(call.op, relax.GlobalVar):
            return call
        kind = _composite_kind(self.mod_, call)
        if kind is None:
            return call
        func = self.mod_[call.op]
        args, runtime, pos = [], [], []
        for i, a in enumerate(call.args):
            v = _const_value(a)
            args.append(v)
            if v is None:
                runtime.append(a)
                pos.append(i)
        index, self.calls = self.calls, self.calls + 1
        region = Region(index, kind,
                        {k: str(v) for k, v in func.attrs.items() if k.startswith("edgetvm.")},
                        args, [p.name for p in func.params], func,
                        f"{self.prefix}.{index}", pos,
                        [a.name if isinstance(a, relax.Var) else None for a in call.args],
                        callees=_callee_attrs(self.mod_, func), arg_kinds=arg_kinds)
        if not self.accept(region):
            return call
        self.regions.append(region)
        return relax.call_pure_packed(region.symbol, *runtime,
                                      ty_args=_result_type(region, call, func))


def _composite_kind(mod, value):
    if isinstance(value, relax.TupleGetItem):
        value = value.tuple_value
    if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
        func = mod[value.op]
        if isinstance(func, relax.Function) and func.attrs is not None \
                and "Composite" in func.attrs:
            return str(func.attrs["Composite"]).removeprefix("edgetvm.")
    return None


def _callee_attrs(mod, func) -> list:
    """Attributes of the PrimFuncs ``func`` calls with ``call_tir``, in program order (the
    W4A16 kernel says there whether it has zero points and a bias)."""
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op == tvm.ir.Op.get("relax.call_tir"):
            callee = mod[e.args[0]]
            found.append({k: (v.value if hasattr(v, "value") else str(v))
                          for k, v in (callee.attrs or {}).items()})
    relax.analysis.post_order_visit(func.body, visit)
    return found


def _shaped(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return all(_shaped(f) for f in ty.fields)
    return getattr(ty, "shape", None) is not None


def _result_type(region, call, func):
    """The region's result type, with shapes wherever they can be known.

    TVM's importer loses the static shape of some symbolic-length tensors (only the rank
    survives; see relax_passes notes), and a host op without a shape cannot be legalised.
    The region's own signature, or its shape arguments, usually still know them."""
    if _shaped(call.ty):
        return call.ty
    if _shaped(func.ret_ty):
        return func.ret_ty
    dtype = call.ty.dtype if hasattr(call.ty, "dtype") else "float32"
    if region.kind == "rope":
        # (x (b, s, h * d), shape [b, s, h, d], cos, sin) -> (b, h, s, d), or (b, s, h, d)
        # when the rotation is token-major
        shape = next((a for a in call.args if isinstance(a, relax.ShapeExpr)), None)
        if shape is not None and len(shape.values) == 4:
            b, s, h, d = shape.values
            heads_major = rope_heads_axis(region) == 1
            return relax.TensorType([b, h, s, d] if heads_major else [b, s, h, d], dtype)
    if region.kind == "kv_append":
        past, new = call.args
        if _shaped(past.ty) and _shaped(new.ty):
            dims = list(past.ty.shape.values)
            dims[-2] = dims[-2] + new.ty.shape.values[-2]
            return relax.TensorType(dims, dtype)
    return call.ty


def offload_regions(mod: tvm.IRModule, accept, prefix: str, prune=None):
    """Rewrite the regions ``accept(region)`` takes; returns (new module, [Region]).

    ``prune(regions)``, if given, sees the accepted regions with their sources recorded
    and returns the indices of those that must stay on the host after all: decisions that
    are sound one region at a time but not as a whole (an NPU kernel reading device state
    that a host region was to produce). The rewrite is then redone without them."""
    new_mod, regions = _rewrite(mod, accept, prefix)
    drop = set(prune(regions)) if prune is not None else set()
    if drop:
        new_mod, regions = _rewrite(mod, lambda r: r.index not in drop and accept(r), prefix)
    return new_mod, regions


def _rewrite(mod, accept, prefix):
    rw = _Rewriter(mod, accept, prefix)
    main = rw.visit_expr(mod["main"])
    mod = mod.clone()
    mod["main"] = main
    mod = relax.transform.DeadCodeElimination(["main"])(mod)
    _record_sources(mod["main"], rw.regions)
    return mod, rw.regions


def _record_sources(main, regions) -> None:
    """For each offloaded call, which of its arguments another offloaded region produced
    (e.g. attention's K/V come from KV-append regions): ``arg_sources[i]`` is that Region."""
    by_symbol = {r.symbol: r for r in regions}
    producer: dict = {}
    for block in main.body.blocks:
        for b in block.bindings:
            v = b.value
            if not (isinstance(v, relax.Call) and v.args and
                    isinstance(v.args[0], relax.ExternFunc)):
                continue
            region = by_symbol.get(str(v.args[0].global_symbol))
            if region is None:
                continue
            producer[b.var] = region
            runtime = list(v.args[1:])
            sources = [None] * len(region.args)
            for pos, a in zip(region.runtime_positions, runtime):
                sources[pos] = producer.get(a) if isinstance(a, relax.Var) else None
            region.arg_sources = sources
