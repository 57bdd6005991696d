"""Position values, evaluated at build time: RoPE tables, position embeddings, the mask.

Host code between the model's inputs and its NPU kernels that depends only on the token
positions (``position_ids``, an all-ones ``attention_mask``, shapes) computes the same
rows for a position whatever the step: RoPE's cos/sin, a learned position embedding's
lookup. A phase program does not run it per step: it is compiled for the host once, here,
run for every position of the cache at once, and the result is a constant table whose
rows the kernels read at the step's runtime position ``pos``. Each table is checked
against a second evaluation at another offset (a value that depends on more than the
position is refused). The attention mask is evaluated for several (past, new) lengths
and must be the causal mask the attention kernel applies by itself, that with a sliding
window (keys ``w`` or more positions behind the query hidden too: the same ``w`` wherever
the cache is longer than it, causal where it is not), or the causal mask plus ALiBi's
bias (a slope per head times the key's distance, which the kernel adds from the slopes);
anything else (padding, another position bias) is refused at build time.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
from tvm import relax

from edgetvm.region_ops import mask_scale, mask_terms

from .graph import BuildError, PositionTableError

HOST = tvm.target.Target({"kind": "llvm", "num-cores": 2})
#: (past, new) lengths at which masks are checked and tables cross-checked
_CHECKS = ((0, 5), (3, 2), (6, 1))


def _seq_and_past_vars(main) -> tuple:
    s_var = past_var = b_var = None
    for p in main.params:
        values = getattr(getattr(p.ty, "shape", None), "values", None) or ()
        if p.name == "input_ids" and len(values) == 2:
            b_var, s_var = values
        if p.name.startswith("past_key_values") and len(values) == 4:
            past_var = values[2]
    return b_var, s_var, past_var


class PositionFunction:
    """The host code of some position values of ``main``, compiled once."""

    def __init__(self, mod, regions, targets: list):
        self.main = mod["main"]
        self.targets = list(targets)
        self.b_var, self.s_var, self.past_var = _seq_and_past_vars(self.main)
        by_symbol = {r.symbol: r for r in regions}
        defs = [(b.var, b.value) for blk in self.main.body.blocks for b in blk.bindings]
        needed = set(self.targets)
        keep = []
        for var, value in reversed(defs):
            if var not in needed:
                continue
            keep.append((var, value))
            needed |= set(relax.analysis.free_vars(value))
        keep.reverse()
        bb = relax.BlockBuilder(mod.clone())    # with the module's other functions
        bindings = []
        for var, value in keep:
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and \
                    value.op.name == "relax.call_pure_packed":
                region = by_symbol[str(value.args[0].global_symbol)]
                gv = bb.add_func(region.func, f"region_{region.index}")
                runtime = dict(zip(region.runtime_positions, value.args[1:]))
                args = [runtime[i] if i in runtime else _const(region.args[i])
                        for i in range(len(region.args))]
                value = bb.normalize(relax.Call(gv, args))
            bindings.append(relax.VarBinding(var, value))
        out = relax.Var("positions", relax.TupleType([v.ty for v in self.targets]))
        bindings.append(relax.VarBinding(out, relax.Tuple(self.targets)))
        body = relax.SeqExpr([relax.DataflowBlock(bindings)], out)
        func = relax.Function(list(self.main.params), body, out.ty)
        ir = bb.get()
        ir["main"] = func.with_attr("global_symbol", "main")
        try:
            ir = relax.transform.DeadCodeElimination(["main"])(ir)
            ir = relax.transform.DecomposeOpsForInference()(ir)
            self.vm = relax.VirtualMachine(tvm.compile(ir, HOST), tvm.cpu())
        except Exception as e:                                   # noqa: BLE001
            raise BuildError(f"the position code ({len(keep)} host ops) does not compile for "
                             f"the host: {str(e).strip().splitlines()[-1]}") from None

    def __call__(self, past: int, new: int) -> list:
        """The target values for ``new`` tokens after ``past`` (batch 1, no padding)."""
        dims = {self.b_var: 1, self.s_var: new}
        if self.past_var is not None:
            dims[self.past_var] = past
        args = []
        for p in self.main.params:
            shape = _concrete(p.ty, dims, p.name)
            dtype = str(p.ty.dtype)
            if p.name == "attention_mask":
                a = np.ones(shape, dtype)
            elif p.name == "position_ids":
                a = np.arange(past, past + new, dtype=dtype).reshape(shape)
            else:
                a = np.zeros(shape, dtype)
            args.append(tvm.runtime.tensor(a))
        out = self.vm["main"](*args)
        return [o.numpy() for o in out]

    def position_axis(self, var) -> int | None:
        values = var.ty.shape.values
        for k, e in enumerate(values):
            if self.s_var is not None and isinstance(e, tvm.tirx.Var) and e.same_as(self.s_var):
                return k
        return None


def _lookup_rows(value, by_symbol, constant) -> tuple | None:
    """(rows, row index) of the constant table ``value`` looks positions up in, if it is
    such a lookup: ``take`` or ``gather_elements`` from a float table of static rows
    computed from constants alone (``constant(expr)``; GPT-J gathers its sin/cos rows from
    a broadcast of its table), or an embedding region (index None: a slice of a table)."""
    if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
        return None
    if value.op.name in ("relax.take", "relax.gather_elements"):
        table = value.args[0]
        ty = table.ty
        if not constant(table) or not isinstance(ty, relax.TensorType) or \
                not str(ty.dtype).startswith("float") or ty.shape is None:
            return None
        axis = int(value.attrs.axis) if value.attrs.axis is not None else 0
        rows = ty.shape.values[axis]
        return (int(rows), value.args[1]) if isinstance(rows, tvm.tirx.IntImm) else None
    if value.op.name == "relax.strided_slice" and constant(value.args[0]):
        # a slice of a constant table at a bound that follows the sequence length
        # (MPT's ALiBi bias, alibi[..., 256 - kv_len:]): the table's length there
        ty = value.args[0].ty
        shape = getattr(ty, "shape", None)
        if shape is None:
            return None
        axes, begin, end = (list(value.args[k].fields) for k in (1, 2, 3))
        rows = []
        for axis, b, e in zip(axes, begin, end):
            if _symbolic(b) or _symbolic(e):
                n = shape.values[int(getattr(axis, "value", axis))]
                if isinstance(n, tvm.tirx.IntImm):
                    rows.append(int(n))
        return (min(rows), None) if rows else None
    if value.op.name == "relax.call_pure_packed":
        region = by_symbol.get(str(value.args[0].global_symbol))
        if region is not None and region.kind == "embedding":
            tables = [a for a in region.args if isinstance(a, np.ndarray) and a.ndim == 2]
            if tables:
                index = [a for a in value.args[1:] if isinstance(a, relax.Var) and
                         str(getattr(a.ty, "dtype", "")).startswith("int")]
                return int(tables[0].shape[0]), index[0] if len(index) == 1 else None
    return None


def _symbolic(e) -> bool:
    """A slice bound that is not a constant (it follows a symbolic length)."""
    e = getattr(e, "value", e)
    return not isinstance(e, (int, tvm.tirx.IntImm))


def position_limit(lookups: list) -> int | None:
    """How many positions the model can address: the rows of the smallest constant table
    it looks something other than the token ids up in (a learned position embedding, a
    precomputed sin/cos cache) or slices by a length (a precomputed ALiBi bias), or None
    when it does neither (RoPE computes its angles). ``lookups``: :func:`position_lookups`."""
    return min((rows for rows, _ in lookups), default=None)


def position_lookups(mod, regions) -> list:
    """(rows, row index) of each lookup of positions in a constant table of ``rows`` rows
    that :func:`_lookup_rows` finds in ``main``. The index is None for a slice; where it is
    a value of ``main``, :func:`evaluate_positions` evaluates it (a model may look position
    ``p`` up at row ``p + 2``, as OPT and BioGPT do)."""
    main = mod["main"]
    by_symbol = {r.symbol: r for r in regions}
    from_ids = {p for p in main.params if p.name == "input_ids"}
    from_constants = set()

    def constant(expr) -> bool:
        return isinstance(expr, tvm.ir.expr.Constant) or expr in from_constants

    found = []
    for blk in main.body.blocks:
        for b in blk.bindings:
            used = set(relax.analysis.free_vars(b.value))
            if used & from_ids:
                from_ids.add(b.var)
                continue
            # a broadcast of a table to the batch size (a symbolic dim) is still the table
            data = {v for v in used if isinstance(v.ty, (relax.TensorType, relax.TupleType))}
            if data <= from_constants and (not isinstance(b.value, relax.Call) or
                                           _pure(b.value)):
                from_constants.add(b.var)
            lookup = _lookup_rows(b.value, by_symbol, constant)
            if lookup is not None:
                found.append(lookup)
    return found


def _pure(value) -> bool:
    """A call of a Relax operator (not of a region or an extern function)."""
    return isinstance(value.op, tvm.ir.Op) and value.op.name != "relax.call_pure_packed"


def _concrete(ty, dims: dict, what: str) -> tuple:
    analyzer = tvm.sym.Analyzer()
    for var, v in dims.items():
        if var is not None:
            analyzer.bind(var, tvm.tirx.IntImm(str(var.ty.dtype), v))
    out = []
    for e in ty.shape.values:
        e = analyzer.simplify(e)
        if not isinstance(e, tvm.tirx.IntImm):
            raise BuildError(f"input {what}: dimension {e} is not known")
        out.append(int(e))
    return tuple(out)


def evaluate_positions(mod, regions, graphs: list, masks: list, positions: int,
                       limit: int | None = None, capacity: int | None = None,
                       lookups: list = ()) -> "PositionValues":
    """Fill the position tables of ``graphs`` (``PhaseGraph.position_tables``) with rows for
    ``positions`` positions and check the attention ``masks`` (as returned by
    ``extract_phase_graph``): the tables and ALiBi's slopes (:class:`PositionValues`).

    ``limit``: the positions the model can address (:func:`position_limit`); rows past it
    (the padding rows of a bucket that ends past a learned position table) are zero, never
    a lookup out of bounds. A KV capacity beyond it is refused before this
    (``compiler.resolve_max_tokens``). ``capacity``: the KV cache's tokens; the masks are
    checked at its end too. ``lookups``: the position tables' (rows, row index)
    (:func:`position_lookups`): a capacity whose last position's index is past its table
    is refused (:class:`PositionTableError`)."""
    tables = {}
    for g in graphs:
        tables.update(g.position_tables)
    mask_vars = []
    for m, index in masks:
        if not isinstance(m, relax.Var):
            raise BuildError(f"attention region {index}: a constant mask cannot follow the "
                             f"sequence length")
        if m not in mask_vars:
            mask_vars.append(m)
    table_vars = list(dict.fromkeys(tables.values()))
    targets = table_vars + mask_vars
    if not targets:
        return PositionValues({}, {}, {})
    lookups = [(i, rows) for rows, i in lookups if isinstance(i, relax.Var) and
               i not in targets] if table_vars else []
    fn = PositionFunction(mod, regions, targets + list(dict.fromkeys(i for i, _ in lookups)))
    valid = positions if limit is None else min(positions, limit)
    full = dict(zip(fn.targets, fn(0, valid)))
    for index, rows in lookups:
        at = np.asarray(full[index]).reshape(-1)
        outside = (at >= rows) | (at < 0) if at.size == valid else np.zeros(0, bool)
        if outside.any():
            # a lookup at an offset (OPT's, BioGPT's: position + 2) ends before its table
            end = int(np.argmax(outside))
            if capacity is not None and end < capacity:
                raise PositionTableError(
                    f"the model looks position {end} up at row {int(at[end])} of a table of "
                    f"{rows} rows (its positions are offset into it): a KV cache of "
                    f"{capacity} tokens would read past it (--max-tokens {end} or less)", end)
            valid = min(valid, end)      # rows past it: padding of a bucket, never read
    data = {}
    for var in table_vars:
        axis = fn.position_axis(var)
        if axis is None:
            raise BuildError(f"position value {var.name} has no position axis")
        rows = np.moveaxis(full[var], axis, 0)
        rows = rows.reshape(rows.shape[0], -1)[:valid].astype(np.float32)
        data[var] = np.concatenate([rows, np.zeros((positions - valid, rows.shape[1]),
                                                   np.float32)])
    index_of = {m: i for m, i in masks if isinstance(m, relax.Var)}
    region_heads = {r.index: int(r.attrs["edgetvm.num_heads"]) for r in regions
                    if r.kind == "attention"}
    heads_of = {m: region_heads[i] for m, i in masks if isinstance(m, relax.Var)}
    # the mask each softmax sees: times the scale, where a region scales it (CodeGen)
    region_of = {r.index: r for r in regions}
    scales = {}
    for m, i in masks:
        if isinstance(m, relax.Var):
            scales.setdefault(m, []).append(mask_scale(region_of[i]))
    scale_of = {m: min(s) for m, s in scales.items()}    # the weakest mask any softmax sees
    checks = list(_CHECKS)
    if mask_vars and capacity is not None:
        # and where the cache ends: a mask that differs from causality only far from the
        # query (a sliding window) is causal at the first positions
        checks += [(capacity - 1, 1), (max(0, capacity - 8), min(8, capacity))]
    slopes: dict = {}
    windows: dict = {}            # mask var -> its sliding window
    causal_up_to: dict = {}       # mask var -> the longest distance it was causal over
    for past, new in checks:
        if past + new > valid:
            continue
        got = dict(zip(targets, fn(past, new)))
        for var in table_vars:
            rows = np.moveaxis(got[var], fn.position_axis(var), 0).reshape(new, -1)
            if not np.allclose(rows, data[var][past:past + new], rtol=1e-5, atol=1e-6):
                raise BuildError(f"position value {var.name} is not a function of the "
                                 f"position alone (rows differ at past={past}, new={new})")
        for var in mask_vars:
            got[var] = got[var] * scale_of[var]
            region = index_of[var]
            try:
                found, window = mask_terms(got[var], past, new, heads_of[var])
            except ValueError as e:
                raise BuildError(f"attention region {region}: {e}") from None
            if window is not None:
                if windows.setdefault(var, window) != window:
                    raise BuildError(f"attention region {region}: the mask's sliding window "
                                     f"changes with the length ({windows[var]} and {window} "
                                     f"tokens)")
                continue
            if found is None:
                causal_up_to[var] = max(causal_up_to.get(var, 0), past + new - 1)
            # ALiBi's slopes, the same at every length (a single query at position 0
            # sees one key: no distance to fit, nothing to compare)
            if past + new < 2:
                continue
            before = slopes.setdefault(var, found)
            if (before is None) != (found is None) or found is not None and \
                    not np.allclose(before, found, rtol=1e-4, atol=1e-7):
                raise BuildError(f"attention region {region}: the mask's position bias "
                                 f"changes with the length (at past={past}, new={new}): "
                                 f"not ALiBi's")
    for var, w in windows.items():
        if slopes.get(var) is not None or causal_up_to.get(var, -1) >= w:
            raise BuildError(f"attention region {index_of[var]}: the mask hides keys {w} or "
                             f"more positions behind the query at some lengths and not at "
                             f"others (or with ALiBi's bias): not a sliding window")
    return PositionValues({name: data[var].astype(np.float16) for name, var in tables.items()},
                          slopes, windows)


@dataclass
class PositionValues:
    """What :func:`evaluate_positions` found: the position ``tables`` (name -> (positions,
    width) float16) and, per mask var checked, ALiBi's slope per head (as the softmax
    sees the bias; None for the causal mask alone) and, per mask var with one, its sliding
    window (keys that many or more positions behind the query hidden)."""

    tables: dict
    slopes: dict
    windows: dict


def _const(value):
    a = np.asarray(value)
    return relax.const(a, str(a.dtype))
