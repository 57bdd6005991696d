"""The phase graph: one forward pass of a model, for one phase and bucket, as NPU ops over
device tensors.

:func:`extract_phase_graph` walks the offloaded Relax ``main`` (``offload.py``: every
recognised region a call into the NPU, the rest host code) once per phase and bucket and
gives every value an abstract meaning:

* a **device view** (:class:`~edgetvm.build.views.View`) of a DRAM tensor: region
  outputs, and the glue on them (reshape, transpose, slice, split, squeeze, casts), which
  moves no data;
* a **position value**: host code that depends only on the positions of the step's tokens
  (RoPE's cos/sin, the causal mask, a learned position embedding): it is evaluated at
  build time (``positions.py``) into a table indexed by the runtime position ``pos``, or,
  for the mask, checked to be the causal mask the attention kernel applies by itself;
* the **token ids** (``input_ids``): the embedding kernel reads them as runtime parameters;
* the **KV cache** of a layer: persistent paged state, appended to and attended over.

Each region becomes ops: a row-local region (norm, linear, MLP, activation, residual add,
RoPE) becomes the :class:`~edgetvm.tir_schedules.fused.Stage` ops of its fusion cluster,
so a partition (``relax_passes/partition.py``) may cut or merge them across regions;
embedding, KV append and attention are ops of their own templates. Host arithmetic on
device values that has an NPU stage (an add, a scaling) becomes that stage; elementwise
arithmetic that has none (Gemma-2's ``tanh`` soft-capping of the logits) becomes a
``host`` op: a ``HostOp`` command the CPU runs on whole DRAM tensors, between kernels, at
its switch cost (``PhaseGraph.host_notes`` lists them). Anything else is refused with an
error naming the op, never silently run somewhere it cannot be.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from edgetvm.errors import EdgeTVMError
from edgetvm.npu_regions import (build_cluster, keeps_heads, missing_activation_kernel,
                                  passthrough_outputs)
from edgetvm.region_ops import (activation_input, attention_roles, op_name, param_index,
                                past_input, rope_dims, rope_heads_axis, rope_roles,
                                rope_stage_attrs, softcap)
from edgetvm.target.host_ops import HOST_BINARY, HOST_UNARY, shape_attr
from edgetvm.target.isa import Affine
from edgetvm.tir_schedules.fused import Stage

from .views import View

Constant = tvm.ir.expr.Constant

F16 = "float16"


class BuildError(EdgeTVMError):
    """The model cannot be compiled into a phase program (the message names the op)."""


class PositionTableError(BuildError):
    """The model looks positions up in a table whose rows end at position ``limit`` (its
    indices offset, as OPT's and BioGPT's by 2): a longer KV cache would read past it."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


# -- the graph ---------------------------------------------------------------------------
@dataclass
class Tensor:
    """A DRAM tensor of the phase program.

    ``kind``: ``activation`` (written and read within a step: planned into the arena),
    ``const`` (weights: the weight pack), ``table`` (a build-time table indexed by the
    position: in the pack too), ``state`` (the KV cache pages), ``output`` (returned),
    ``host`` (read or written by a host op: a DRAM tensor of its own, not in the arena),
    ``padded`` (an activation widened to whole quantization groups: a tensor of its own
    whose padding columns stay zero), ``kv_pages`` (every value a layer's new K or V,
    which its producers store into the KV cache pages only: ``kv_pages.py``; an activation
    with some such values, a fused QKV projection's, has ``pages`` too)."""

    name: str
    shape: tuple
    dtype: str = F16
    kind: str = "activation"
    data: np.ndarray | None = field(default=None, repr=False)
    pages: object = None             # where its new K/V values go: a kv_pages.Paging

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass
class Op:
    """One NPU op of the phase.

    ``kind`` ``stage``: ``stage`` is a row-local op of ``fused.PIECES`` whose inputs name
    keys of ``inputs``; fusable with its neighbours. ``embedding`` / ``kv_append`` /
    ``attention``: a kernel of its own template (``attrs`` say which and how). ``host``:
    an elementwise op the host CPU runs (``attrs["op"]``, inputs ``x0``, ``x1``, output
    ``y``), whole tensors in, a whole tensor out.
    ``inputs`` / ``outputs``: role -> :class:`View` of a graph tensor, in the shape the
    op's kernel declares for that role."""

    kind: str
    name: str
    inputs: dict
    outputs: dict
    stage: Stage | None = None
    attrs: dict = field(default_factory=dict)
    region: int | None = None
    layer: int | None = None

    @property
    def rows(self) -> int:
        """Rows the op's kernel tiles over (stage ops)."""
        return int(next(iter(self.outputs.values())).shape[0])


@dataclass
class PhaseGraph:
    """The ops of one phase program, in program order, over ``tensors``."""

    phase: str                       # prefill | decode
    rows: int                        # token rows of the program (the bucket)
    pages: int                       # KV pages the attention kernels can read
    ops: list
    tensors: dict
    logits: str                      # the output tensor
    logits_rows: str                 # all | last
    kv_heads: int
    head_dim: int
    layers: int
    position_tables: dict = field(default_factory=dict)   # table name -> var name
    host_notes: list = field(default_factory=list)        # what stays on the host, why

    def worst_case_lengths(self, layout) -> dict:
        """``pos`` and ``valid_len`` at the bucket's worst case: its ``rows`` at the end
        of its KV capacity (within the cache the state tensors hold: a 1,040-token build
        has 65 pages and a 128-page decode bucket)."""
        cap = min(self.pages, layout.num_pages) * layout.page_tokens
        pos = max(0, cap - self.rows)
        return {"pos": pos, "valid_len": pos + self.rows}

    def consumers(self) -> dict:
        """tensor name -> indices of the ops that read it."""
        out: dict = {}
        for i, op in enumerate(self.ops):
            for v in op.inputs.values():
                out.setdefault(v.tensor, []).append(i)
        return out

    def producers(self) -> dict:
        out: dict = {}
        for i, op in enumerate(self.ops):
            for v in op.outputs.values():
                out.setdefault(v.tensor, []).append(i)
        return out


#: where a refusal of the phase program sends the user
_REFERENCE_PATH = ("the region-by-region reference path can: python -m edgetvm.run "
                   "model.onnx --reference")
#: the end of a refusal of what the phase program cannot run
_REFERENCE_CAN = f"the phase program cannot run it ({_REFERENCE_PATH})"


# -- abstract values ---------------------------------------------------------------------
@dataclass(frozen=True)
class Dev:
    view: View


@dataclass(frozen=True)
class Pos:
    """A host value that depends only on the token positions (evaluated at build time)."""

    var: relax.Var


@dataclass(frozen=True)
class Tok:
    """The token ids (``input_ids``), viewed with this shape."""

    shape: tuple


@dataclass(frozen=True)
class KV:
    layer: int


@dataclass(frozen=True)
class Shape:
    pass


@dataclass(frozen=True)
class Const:
    value: np.ndarray


@dataclass(frozen=True)
class Tup:
    items: tuple


#: glue ops that only re-address their first operand
_GLUE = {"relax.reshape", "relax.permute_dims", "relax.strided_slice", "relax.expand_dims",
         "relax.squeeze", "relax.astype", "relax.split", "relax.flatten"}
#: elementwise host ops on device values that have an NPU stage
_ELEMENTWISE = {"relax.add", "relax.multiply", "relax.subtract", "relax.divide"}
_POSITION_INPUTS = ("position_ids", "attention_mask")
#: elementwise Relax ops the host runs when no NPU stage takes them (a ``host`` op)
_HOST_OPS = {f"relax.{n}" for n in (*HOST_UNARY, *HOST_BINARY)}


class _Extractor:
    def __init__(self, mod, regions, phase: str, rows: int, pages: int, logits_rows: str):
        self.main = mod["main"]
        self.mod = mod
        self.params = {p.name: p for p in self.main.params}
        self.regions = {r.symbol: r for r in regions}
        self.phase, self.rows, self.pages = phase, rows, pages
        self.logits_rows = logits_rows
        self.env: dict = {}
        self.ops: list = []
        self.tensors: dict = {}
        self.position_vars: dict = {}        # table tensor name -> relax var
        self.masks: list = []                # (mask var, region index)
        self.kv_pending: dict = {}           # layer -> {"key": view, "value": view}
        self.kv_layout = None
        self.attention_layers: list = []
        self.host_notes: list = []
        self._region_nodes = None            # ONNX node -> regions whose function names it
        self.dims = self._bind_dims()
        self.defs = {b.var: b.value for blk in self.main.body.blocks for b in blk.bindings}

    # -- shapes ----------------------------------------------------------------------------
    def _bind_dims(self) -> dict:
        """Symbolic dimension -> value for this bucket: batch 1, ``rows`` new tokens, and a
        past of 0 (no device tensor's shape may depend on the past: the KV cache is paged
        state and the mask is checked, not computed)."""
        env = {}
        self.seq_var = None
        for p in self.main.params:
            shape = getattr(getattr(p.ty, "shape", None), "values", None)
            if shape is None:
                continue
            name = p.name
            if name == "input_ids" and len(shape) == 2:
                self.seq_var = shape[1]
                for expr, v in zip(shape, (1, self.rows)):
                    if isinstance(expr, tvm.tirx.Var):
                        env[expr] = v
            if name.startswith("past_key_values") and len(shape) == 4:
                for i, v in ((0, 1), (2, 0)):
                    if isinstance(shape[i], tvm.tirx.Var):
                        env[shape[i]] = v
        return env

    def shape(self, ty, what: str) -> tuple:
        values = getattr(getattr(ty, "shape", None), "values", None)
        if values is None:
            raise BuildError(f"{what}: the importer lost its shape; a phase program needs "
                             f"static shapes per bucket")
        analyzer = tvm.sym.Analyzer()
        for var, v in self.dims.items():
            analyzer.bind(var, tvm.tirx.IntImm(str(var.ty.dtype), v))
        out = []
        for e in values:
            e = analyzer.simplify(e)
            if not isinstance(e, tvm.tirx.IntImm):
                raise BuildError(f"{what}: dimension {e} is not known for a bucket of "
                                 f"{self.rows} rows")
            out.append(int(e))
        return tuple(out)

    # -- tensors -----------------------------------------------------------------------------
    def new_tensor(self, name: str, shape, kind="activation", dtype=F16, data=None) -> View:
        base, k = name, 1
        while name in self.tensors:
            k += 1
            name = f"{base}~{k}"
        self.tensors[name] = Tensor(name, tuple(int(s) for s in shape), dtype, kind, data)
        return View.whole(name, shape)

    def _last(self, view: View, last: bool) -> View:
        """``view`` (a new tensor), noted as holding the last row only when ``last``."""
        if last:
            self.last_tensors.add(view.tensor)
        return view

    def const(self, name: str, array: np.ndarray) -> View:
        a = np.ascontiguousarray(array)
        return self.new_tensor(name, a.shape, "const", str(a.dtype), a)

    # -- the walk ------------------------------------------------------------------------------
    def run(self) -> PhaseGraph:
        for p in self.main.params:
            self.env[p] = self._param_value(p)
        logits_var = self._logits_var()
        self.last_vars = self._last_row_vars(logits_var)
        self.last_tensors: set = set()       # tensors of the ops in last_vars: one row
        for blk in self.main.body.blocks:
            for b in blk.bindings:
                self._current = b
                try:
                    self.env[b.var] = self._binding(b.var, b.value)
                except BuildError as e:
                    node = _onnx_node(b.value)
                    if type(e) is BuildError and node and "ONNX node" not in str(e):
                        raise BuildError(f"{e}{node}") from None     # where, for the user
                    raise
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    raise BuildError(f"binding {b.var.name} = {_describe(b.value)}: {e}") from e
        if self.kv_pending:
            raise BuildError(f"layer(s) {sorted(self.kv_pending)} append only one of K and V")
        logits = self.env[logits_var]
        if not isinstance(logits, Dev):
            raise BuildError("the logits are not computed on the NPU")
        name = logits.view.tensor
        t = self.tensors[name]
        if t.kind not in ("activation", "host") or not logits.view.is_whole(t.shape):
            raise BuildError("the logits are not the whole output of a kernel")
        self._rename(name, "logits")
        self.tensors["logits"].kind = "output"
        if self.kv_layout is None:
            raise BuildError("the model has no KV cache on the NPU (a text-generation-with-"
                             "past export is needed)")
        hk, d = self.kv_layout
        return PhaseGraph(self.phase, self.rows, self.pages, self.ops, self.tensors, "logits",
                          self.logits_rows, hk, d, len(self.attention_layers),
                          dict(self.position_vars), list(self.host_notes))

    def _rename(self, old: str, new: str) -> None:
        t = self.tensors.pop(old)
        t.name = new
        self.tensors[new] = t
        for op in self.ops:
            for views in (op.inputs, op.outputs):
                for role, v in views.items():
                    if v.tensor == old:
                        views[role] = View(new, v.shape, v.strides, v.offset)

    def _logits_var(self):
        body = self.main.body.body
        out = self.defs.get(body, body) if isinstance(body, relax.Var) else body
        fields = out.fields if isinstance(out, relax.Tuple) else [out]
        return fields[0]

    def _last_row_vars(self, logits_var) -> set:
        """The vars of which only the last prompt row is read, when the caller reads only
        the last row's logits (prefill): a backward pass from the logits through row-local
        ops (linears, norms, MLPs, residual adds, elementwise ops: row ``i`` of the result
        reads row ``i`` of each input), stopping at ops that mix rows (attention), keep
        them all (the KV append, the present K/V outputs) or re-address them (glue). A var
        is in the set when every op that reads it is a row-local op computing the last
        row only: so the last layer's output projection, MLP and residual adds, the final
        norm and the lm_head run on that row alone, as llama.cpp's graphs skip the unused
        rows in their last layer (``inp_out_ids``). The last layer's attention is in the
        set too when its result is read at the last row only
        (:meth:`_attention_of_rows`): it attends for the last query alone. Its q, K and V
        are demanded whole: the cache keeps every row's K and V."""
        if self.logits_rows != "last" or self.rows <= 1:
            return set()
        body = self.main.body.body
        out = self.defs.get(body, body) if isinstance(body, relax.Var) else body
        wants: dict = {}                     # var -> demands of the ops that read it
        for v in _vars_in(out):              # the outputs: the logits and the present K/V
            wants.setdefault(v, set()).add("last" if v.same_as(logits_var) else "all")
        last = set()
        bindings = [b for blk in self.main.body.blocks for b in blk.bindings]
        for b in reversed(bindings):
            if b.var.same_as(body):
                continue                     # the output tuple: its fields are seeded
            mine = wants.get(b.var)
            row_local = mine == {"last"} and self._row_local(b.var, b.value)
            if row_local or (mine == {"last"} and self._attention_of_rows(b.var, b.value)):
                last.add(b.var)
            rows = self._rows_of(b.var) if row_local else None
            for a in _vars_in(b.value):
                same = row_local and self._rows_of(a) == rows
                wants.setdefault(a, set()).add("last" if same else "all")
        return last

    def _row_local(self, var, value) -> bool:
        """Is row ``i`` of ``var`` computed from row ``i`` of each input alone?"""
        if not isinstance(getattr(var, "ty", None), relax.TensorType):
            return False
        if isinstance(value, relax.Var):
            return True
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return False
        name = value.op.name
        if name == "relax.call_pure_packed":
            region = self.regions.get(str(value.args[0].global_symbol))
            # row-local: the kinds :meth:`_region` lowers as row-wise clusters (a kind with
            # a handler of its own, such as attention or RoPE, is not, unless proven so)
            return region is not None and \
                getattr(self, f"_region_{region.kind}", None) is None and \
                not any(passthrough_outputs(region.func))
        return name in _ELEMENTWISE | _HOST_OPS | {"relax.astype"}

    def _attention_of_rows(self, var, value) -> bool:
        """Is ``var`` an attention region's result over the bucket's rows, token-major
        ((b, s, heads * d))? Its last row is the last query's attention
        alone: a decode attention over the pages (:meth:`_region_attention`). Its q, K and
        V are still demanded whole (the cache keeps every row's K and V)."""
        if self.phase != "prefill" or not isinstance(value, relax.Call) or \
                not isinstance(value.op, tvm.ir.Op) or value.op.name != "relax.call_pure_packed":
            return False
        region = self.regions.get(str(value.args[0].global_symbol))
        return region is not None and region.kind == "attention" and \
            not keeps_heads(region) and self._rows_of(var) == self.rows

    def _rows_of(self, var):
        """The product of a tensor var's leading dimensions in this bucket (None: not a
        tensor of known shape)."""
        if not isinstance(getattr(var, "ty", None), relax.TensorType):
            return None
        try:
            shape = self.shape(var.ty, var.name)
        except BuildError:
            return None
        return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1

    def _row_input(self, view: View, rows: int, cols: int, what: str,
                   full_rows: int | None = None) -> View:
        """A (rows, cols) view of an op's input. ``full_rows``: the op computes only the last
        row of a result of that many rows (:meth:`_last_row_vars`); an input that is not
        already one row of the same (:attr:`last_tensors`) must then hold every row, ``full_rows
        x cols`` as the op would read them computing every row, and is read at the runtime
        row ``last_row``. Decided by the shapes, not by a size: a (rows, 1) column under a
        ``cols``-wide op is not one row of ``cols`` when rows == cols; it raises BuildError,
        as it does where the op computes every row (a gain then stays on the host)."""
        if full_rows and full_rows > 1 and view.tensor not in self.last_tensors:
            if full_rows != self.rows:
                raise BuildError(f"{what}: the last row of {full_rows} rows, not of the "
                                 f"bucket's {self.rows}")
            v = self.rows_view(view, full_rows, cols, what)
            return View(v.tensor, (1, cols), v.strides, v.offset).shifted(
                Affine.param("last_row", v.strides[0]))
        return self.rows_view(view, rows, cols, what)

    def _full_rows(self, var) -> int | None:
        """The rows of ``var`` computing every row, when only its last is computed."""
        return self._rows_of(var) if var in self.last_vars else None

    def _param_value(self, p):
        name = p.name
        if name == "input_ids":
            return Tok(self.shape(p.ty, "input_ids"))
        if name in _POSITION_INPUTS:
            return Pos(p)
        if name.startswith("past_key_values"):
            return KV(-1)              # the past: its layer is read off the KV append
        raise BuildError(f"model input {name!r}: a phase program takes input_ids, "
                         f"attention_mask, position_ids and past_key_values.* only")

    def value(self, e):
        if isinstance(getattr(e, "ty", None), tvm.ir.PrimType):
            return Shape()                   # a symbolic dimension or scalar as an operand
        if isinstance(e, Constant):
            return Const(e.value.numpy())
        if isinstance(e, relax.ShapeExpr):
            return Shape()
        if isinstance(e, relax.Tuple):
            return Tup(tuple(self.value(f) for f in e.fields))
        if isinstance(e, relax.Var):
            return self.env[e]
        b = getattr(self, "_current", None)
        where = f"binding {b.var.name} = {_describe(b.value)}: " if b is not None else ""
        raise BuildError(f"{where}cannot interpret {type(e).__name__} {e} (the phase program "
                         f"has no NPU kernel or host op for it; the region-by-region reference "
                         f"path runs it: python -m edgetvm.run model.onnx --reference)")

    def _binding(self, var, value):
        if isinstance(value, relax.Var):
            return self.value(value)
        if isinstance(value, relax.Tuple):
            return self.value(value)
        if isinstance(value, relax.TupleGetItem):
            tup = self.value(value.tuple_value)
            if isinstance(tup, Pos):
                return Pos(var)
            if not isinstance(tup, Tup):
                raise BuildError(f"{var.name}: item of a non-tuple value")
            return tup.items[value.index]
        if isinstance(value, Constant):
            return self.value(value)
        if not isinstance(value, relax.Call):
            return Shape()
        op = value.op
        if _is_packed_call(value):
            region = self.regions.get(str(value.args[0].global_symbol))
            if region is None:
                raise BuildError(f"{var.name}: call to unknown packed function "
                                 f"{value.args[0].global_symbol}")
            return self._region(var, region, [self.value(a) for a in value.args[1:]])
        name = op.name if isinstance(op, tvm.ir.Op) else str(op)
        if name == "relax.shape_of":
            return Shape()
        args = [self.value(a) for a in value.args]
        if all(_host_only(a) for a in args):
            return Pos(var)                 # host code on positions and constants only
        devs = [a for a in args if isinstance(a, Dev)]
        if isinstance(op, tvm.ir.Op) and name in _GLUE and devs and args[0] is devs[0]:
            return self._glue(var, value, name, devs[0].view)
        if name == "relax.take" and len(devs) == 1 and args[0] is devs[0] and \
                isinstance(args[1], Const):
            return self._take(var, value, devs[0].view, args[1].value)
        if isinstance(op, tvm.ir.Op) and name in _GLUE and isinstance(args[0], Tok):
            return Tok(self.shape(var.ty, var.name))
        if isinstance(op, tvm.ir.Op) and name in _ELEMENTWISE and devs:
            return self._elementwise(var, name, args)
        if isinstance(op, tvm.ir.Op) and name in _HOST_OPS and devs and \
                all(isinstance(a, (Dev, Const)) for a in args):
            return self._host(var, name, args)
        kinds = ", ".join(type(a).__name__ for a in args)
        where = _onnx_node(value)
        if isinstance(op, relax.GlobalVar):   # a recognised region no NPU kernel takes
            func = self.mod[op]
            kind = str((func.attrs or {}).get("Composite", "")).removeprefix("edgetvm.")
            name = f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind} region" if kind else \
                op.name_hint
            where = self._region_where(var, func)
            missing = missing_activation_kernel(func.attrs or {})
            if missing:
                raise BuildError(f"{var.name} = {name}({kinds}){where}: {missing}; " +
                                 _REFERENCE_CAN)
        unrecognised = unrecognised_attention(self.defs, var)
        kv = [a.layer for a in args if isinstance(a, KV)]
        whose = "a" if kv and kv[0] < 0 else f"layer {kv[0]}'s" if kv else ""
        what = "host code on NPU data with no NPU kernel" if not kv or unrecognised else (
            f"the model computes with {whose} KV cache "
            f"outside attention (a bias or mask computed from the cache, values split or "
            f"tiled before the attention): on the NPU the cache is pages only the attention "
            f"kernel reads")
        raise BuildError((f"{unrecognised}; it stopped at " if unrecognised else "") +
                         f"{var.name} = {name}({kinds}){where}: {what}; " + _REFERENCE_CAN)

    # -- glue ---------------------------------------------------------------------------------
    def _glue(self, var, call, name, view: View):
        if name == "relax.astype":
            return Dev(view)                 # activations are fp16 on the device
        if name == "relax.split":
            axis = int(call.attrs.axis) % view.ndim
            n = view.shape[axis]
            ios = call.attrs.indices_or_sections
            if isinstance(ios, (int, tvm.tirx.IntImm)):
                k = int(ios)
                cuts = [n // k * i for i in range(1, k)]
            else:
                cuts = [int(i) for i in ios]
            bounds = [0] + cuts + [n]
            return Tup(tuple(Dev(view.slice(axis, b, e)) for b, e in zip(bounds, bounds[1:])))
        out_shape = self.shape(var.ty, var.name)
        if name == "relax.permute_dims":
            axes = call.attrs.axes
            axes = list(range(view.ndim))[::-1] if axes is None else [int(a) for a in axes]
            v = view.permute(axes)
        elif name == "relax.strided_slice":
            v = view
            axes, begin, end = (_ints(a) for a in call.args[1:4])
            strides = _ints(call.args[4]) if len(call.args) > 4 else [1] * len(axes)
            for a, b, e, s in zip(axes, begin, end, strides):
                v = v.slice(a, b, min(e, v.shape[a % v.ndim]), s)
        elif name == "relax.expand_dims":
            v = view.expand_dims([int(a) for a in call.attrs.axis])
        elif name == "relax.squeeze":
            axes = call.attrs.axis
            v = view.squeeze(None if axes is None else [int(a) for a in axes])
        else:                                 # reshape, flatten
            v = view.reshape(out_shape)
            if v is None:                     # its strides cannot say it: a copy kernel
                v = self._contiguous(view, f"{var.name}.contiguous").reshape(out_shape)
        if v.shape != out_shape:
            raise BuildError(f"{var.name}: {name} gives {v.shape}, the graph says {out_shape}")
        return Dev(v)

    def _take(self, var, call, view: View, index: np.ndarray):
        """``take(x, c, axis)`` at constant indices ``c`` that step evenly (one index, or
        a strided run): a slice of the view (Falcon picks K and V out of its fused qkv by
        index); other index sets would need a gather kernel and are refused."""
        axis = int(call.attrs.axis) % view.ndim if call.attrs.axis is not None else None
        flat = np.asarray(index, np.int64).reshape(-1)
        n = view.shape[axis] if axis is not None else 0
        steps = np.diff(flat)
        if axis is None or flat.size == 0 or (flat < 0).any() or (flat >= n).any() or \
                (flat.size > 1 and (steps[0] <= 0 or (steps != steps[0]).any())):
            raise BuildError(f"{var.name} = relax.take{_onnx_node(call)}: indices "
                             f"{flat.tolist()} on axis {axis} are not a strided run; the "
                             f"phase program has no gather kernel")
        step = int(steps[0]) if flat.size > 1 else 1
        v = view.slice(axis, int(flat[0]), int(flat[-1]) + 1, step)
        if np.ndim(index) == 0:
            v = v.squeeze([axis])
        elif np.ndim(index) > 1:
            raise BuildError(f"{var.name} = relax.take{_onnx_node(call)}: a "
                             f"{np.ndim(index)}-D index")
        out_shape = self.shape(var.ty, var.name)
        if v.shape != out_shape:
            raise BuildError(f"{var.name}: take gives {v.shape}, the graph says {out_shape}")
        return Dev(v)

    # -- host arithmetic with an NPU stage ---------------------------------------------------
    def _elementwise(self, var, name, args):
        out_shape = self.shape(var.ty, var.name)
        last = var in self.last_vars
        full = self._full_rows(var)
        if last:
            out_shape = (1,) * (len(out_shape) - 1) + (out_shape[-1],)   # the last row's
        rows = int(np.prod(out_shape[:-1], dtype=np.int64)) if len(out_shape) > 1 else 1
        cols = out_shape[-1]
        if name != "relax.add":
            dev = [a for a in args if isinstance(a, Dev)]
            const = [a for a in args if isinstance(a, Const)]
            scalar = len(dev) == 1 and len(const) == 1 and const[0].value.size == 1
            # x * c, c * x and x / c (Granite's multipliers and logits_scaling) scale x
            if scalar and (name == "relax.multiply" or
                           (name == "relax.divide" and args[0] is dev[0])):
                c = float(const[0].value.reshape(()))
                if name == "relax.divide":
                    if c == 0.0:
                        raise BuildError(f"{var.name} = divide by the constant 0")
                    c = 1.0 / c
                x = self._row_input(dev[0].view, rows, cols, var.name, full)
                if c == 1.0:                          # x * 1 (a multiplier set to 1)
                    same = x.reshape(out_shape)
                    if same is not None:
                        return Dev(same)
                out = self._last(self.new_tensor(f"{var.name}", (rows, cols)), last)
                self._stage(Stage("scale", ("x",), "y", {"imm": c}), {"x": x}, out, var.name)
                return Dev(out.reshape(out_shape))
            gain = self._row_gain(var, name, dev, const, out_shape)
            if gain is not None:
                return gain
            if name in _HOST_OPS and all(isinstance(a, (Dev, Const)) for a in args):
                return self._host(var, name, args)
            raise BuildError(f"{var.name} = {name}: only a scaling by a scalar constant has an "
                             f"NPU stage")
        views = []
        for a in args:
            if isinstance(a, Dev):
                views.append(self._row_input(a.view, rows, cols, var.name, full))
            elif isinstance(a, Pos):
                v = self.position_view(a.var, rows, cols)
                views.append(v.shifted(Affine.param("last_row", cols)) if last else v)
            else:
                raise BuildError(f"{var.name} = add of a {type(a).__name__}: no NPU stage")
        out = self._last(self.new_tensor(f"{var.name}", (rows, cols)), last)
        self._stage(Stage("add", ("x", "x2"), "y"), {"x": views[0], "x2": views[1]}, out,
                    var.name)
        return Dev(out.reshape(out_shape))

    def _row_gain(self, var, name, dev, const, out_shape):
        """``x * w`` with a constant ``w`` over the trailing axes of ``x`` (a gain per column
        once those axes are the columns: Cohere's per-head q/k norm gains, (heads, d) over
        (b, s, heads, d)) as an NPU ``mul_vec`` stage; None for any other operands."""
        if name != "relax.multiply" or len(dev) != 1 or len(const) != 1:
            return None
        w = np.asarray(const[0].value)
        while w.ndim and w.shape[0] == 1:
            w = w.reshape(w.shape[1:])
        k = w.ndim
        last = var in self.last_vars
        if k == 0 or k > len(out_shape) or tuple(out_shape[-k:]) != w.shape or \
                (not last and tuple(dev[0].view.shape) != tuple(out_shape)):
            return None
        cols = int(np.prod(w.shape))
        rows = int(np.prod(out_shape[:-k], dtype=np.int64))
        try:
            x = self._row_input(dev[0].view, rows, cols, var.name, self._full_rows(var))
        except BuildError:                    # not one strided window: the host op takes it
            return None
        weights = self.const(f"{var.name}.w", w.reshape(cols).astype(np.float16))
        out = self._last(self.new_tensor(f"{var.name}", (rows, cols)), last)
        self._stage(Stage("mul_vec", ("x", "w"), "y"), {"x": x, "w": weights}, out, var.name)
        return Dev(out.reshape(out_shape))

    # -- elementwise host ops ------------------------------------------------------------------
    def _host(self, var, name, args):
        """``var = name(*args)`` run by the host: its device inputs as whole DRAM tensors of
        their own (a view that is not one is copied into one by an NPU stage first), its
        constants from the weight pack, its result a new tensor."""
        out_shape = self.shape(var.ty, var.name)
        last = var in self.last_vars
        if last:
            out_shape = (1,) * (len(out_shape) - 1) + (out_shape[-1],)   # the last row's
        inputs, shapes = {}, {}
        for i, a in enumerate(args):
            if isinstance(a, Const):
                v = self.const(f"{var.name}.c{i}", np.asarray(a.value, np.float16))
            else:
                v = a.view
                if last and v.tensor not in self.last_tensors and v.size != v.shape[-1]:
                    cols = v.shape[-1]            # not one row: a row per row of var
                    v = self._row_input(v, 1, cols, var.name, self._full_rows(var)).reshape(
                        (1,) * (v.ndim - 1) + (cols,))
                v = self._whole(v, f"{var.name}.x{i}")
                self.tensors[v.tensor].kind = "host"
            inputs[f"x{i}"] = v
            shapes[f"shape{i}"] = shape_attr(v.shape)
        op, vname = str(name).split(".", 1)[1], str(var.name)
        out = self._last(self.new_tensor(vname, out_shape, kind="host"), last)
        table = HOST_UNARY if len(args) == 1 else HOST_BINARY
        flops = out.size * table[op][1]
        self.ops.append(Op("host", vname, inputs, {"y": out},
                           attrs={"op": op, "out": shape_attr(out_shape), "flops": flops,
                                  **shapes}))
        self.host_notes.append(f"{vname} = {name}{tuple(out_shape)}: on the host (no NPU "
                               f"kernel), {flops} FLOPs")
        return Dev(out)

    def _whole(self, view: View, name: str) -> View:
        """``view`` as the whole of one tensor: itself, or a copy made by an NPU stage."""
        t = self.tensors[view.tensor]
        if t.kind in ("activation", "host") and view.is_whole(t.shape):
            return view
        cols = view.shape[-1] if view.ndim else 1
        rows = view.size // max(1, cols)
        src = self.rows_view(view, rows, cols, name)
        out = self.new_tensor(name, (rows, cols))
        self._stage(Stage("copy", ("x",), "y"), {"x": src}, out, name)
        return out.reshape(view.shape)

    def _padded(self, view: View, want: tuple, name: str, region) -> View:
        """``view`` (rows, K) as the (rows, K') a W4A16 kernel reads when K is not a whole
        number of quantization groups (the quantizer padded the weights to K' with groups
        of zeros): copied by an NPU stage into the first K columns of a tensor of its own,
        whose last K' - K columns nothing writes (scratch is zeroed per call)."""
        if len(want) != 2 or want[0] != view.shape[0] or want[1] < view.shape[1]:
            raise BuildError(f"{region.kind} region {region.index}: its kernel reads {name} "
                             f"as {want}, the graph has {view.shape}")
        rows, k = view.shape
        pad = self.new_tensor(f"{name}.padded", want, kind="padded")
        window = View(pad.tensor, (rows, k), (want[1], 1), Affine(0))
        # a kernel of its own (region None): the kernel reading the whole padded tensor
        # cannot be the one writing its window
        self._stage(Stage("copy", ("x",), "y"), {"x": view}, window, f"{name}.pad")
        return pad

    def rows_view(self, view: View, rows: int, cols: int, what: str) -> View:
        v = view.reshape((rows, cols)) if view.size == rows * cols else None
        if v is None:
            raise BuildError(f"{what}: the input {view.shape} is not a ({rows}, {cols}) "
                             f"strided window of one tensor")
        return v

    def position_view(self, var, rows: int, cols: int) -> View:
        """A (rows, cols) view of the position table of ``var`` from row ``pos``."""
        name = f"table.{var.name}"
        if name not in self.tensors:
            shape = self.shape(var.ty, var.name)
            axes = [k for k, e in enumerate(var.ty.shape.values)
                    if isinstance(e, tvm.tirx.Var) and e.same_as(self.seq_var)]
            if len(axes) != 1:
                raise BuildError(f"position value {var.name} of shape {shape} has no single "
                                 f"axis along the new tokens")
            width = int(np.prod([d for k, d in enumerate(shape) if k != axes[0]]))
            self.position_vars[name] = var
            # rows filled in by positions.py: the table covers every position of the cache
            self.tensors[name] = Tensor(name, (0, width), F16, "table")
        width = self.tensors[name].shape[1]
        if width != cols:
            raise BuildError(f"position value {var.name}: {width} columns per position, the "
                             f"kernel reads {cols}")
        return View(name, (rows, cols), (cols, 1), Affine.param("pos", cols))

    def _position_input(self, value: "Pos"):
        """A position-only value that a row-local kernel reads as a tensor (OPT's learned
        position embedding, added to the embeddings after its ``project_in``): its table's
        rows from the runtime position, in the value's layout, where that layout is the
        table's (no axis of more than one element before the positions'); else the value
        as it was (refused by the caller)."""
        var = value.var
        if not isinstance(var.ty, relax.TensorType) or self.seq_var is None:
            return value
        dims = var.ty.shape.values if var.ty.shape is not None else ()
        axes = [k for k, e in enumerate(dims)
                if isinstance(e, tvm.tirx.Var) and e.same_as(self.seq_var)]
        shape = self.shape(var.ty, var.name)
        if len(axes) != 1 or any(d != 1 for d in shape[:axes[0]]):
            return value
        width = int(np.prod(shape[axes[0] + 1:], dtype=np.int64))
        view = self.position_view(var, self.rows, width).reshape(shape)
        return value if view is None else Dev(view)

    def _stage(self, stage: Stage, inputs: dict, out: View, name: str, region=None,
               layer=None) -> Op:
        op = Op("stage", name, dict(inputs), {stage.output: out}, stage, {}, region, layer)
        self.ops.append(op)
        return op

    # -- regions ------------------------------------------------------------------------------
    def _region(self, var, region, args):
        runtime = dict(zip(region.runtime_positions, args))
        if all(_host_only(a) for a in args):
            return Pos(var)                   # e.g. a position embedding lookup
        kind = region.kind
        handler = getattr(self, f"_region_{kind}", None)
        if handler is None:
            handler = self._region_rowlocal
        try:
            return handler(var, region, runtime)
        except BuildError as e:
            if type(e) is not BuildError or "ONNX node" in str(e):
                raise
            where = self._region_where(var, region.func)
            raise BuildError(f"{e}{where}; the phase program cannot run this {kind} region "
                             f"({_REFERENCE_PATH})") from None

    def _region_where(self, var, func) -> str:
        """Where the region ``var`` calls is, for a message: the ONNX node its function
        was made from, unless another region's function names the same node (regions of
        one structure in every layer may carry the first layer's node names); then the
        ONNX nodes that compute its inputs, which are its own layer's."""
        node = _first_onnx_node(func)
        if self._region_nodes is None:
            self._region_nodes = Counter(_first_onnx_node(r.func)
                                         for r in self.regions.values())
        if node and self._region_nodes[node] == 1:
            return node
        call = self.defs.get(var)
        inputs = [] if call is None else call.args[1:] if _is_packed_call(call) else call.args
        names = [_onnx_name(self.defs.get(a)) for a in inputs
                 if isinstance(a, relax.Var) and a in self.defs]
        names = list(dict.fromkeys(repr(n) for n in names if n))
        return f" (reading ONNX node(s) {', '.join(names)})" if names else node

    def _result_shapes(self, var) -> list:
        ty = var.ty
        fields = ty.fields if isinstance(ty, relax.TupleType) else [ty]
        return [self.shape(f, var.name) for f in fields]

    def _region_embedding(self, var, region, runtime):
        table = next(v for v in region.args if v is not None and np.ndim(v) == 2)
        ids = [a for a in runtime.values() if isinstance(a, Tok)]
        if len(ids) != 1:
            raise BuildError(f"embedding region {region.index} does not read input_ids")
        (shape,) = self._result_shapes(var)
        vocab, hidden = table.shape
        rows = int(np.prod(ids[0].shape))
        e16 = region.cache.get("E16")        # the fp16 table, converted once per model
        if e16 is None:
            e16 = region.cache["E16"] = np.ascontiguousarray(table, np.float16)
        t = self.const(f"r{region.index}.E", e16)
        out = self.new_tensor(f"r{region.index}.out", (rows, hidden))
        self.ops.append(Op("embedding", f"r{region.index}", {"E": t}, {"out": out},
                           attrs={"vocab": vocab, "hidden": hidden}, region=region.index))
        return Dev(out.reshape(shape))

    def _region_kv_append(self, var, region, runtime):
        layer, which, past_at = past_input(region)
        new = [a for i, a in enumerate(runtime.values()) if i != past_at and isinstance(a, Dev)]
        if len(new) != 1:
            raise BuildError(f"KV append region {region.index}: new tokens are not NPU data")
        past_name = region.arg_names[region.runtime_positions[past_at]]
        past_shape = self.shape(self.params[past_name].ty, past_name)
        _, hk, _, d = past_shape
        view = new[0].view
        if view.ndim == 5 and view.reshape(view.shape[:2] + (hk, d)) is None:
            view = self._contiguous(view, f"r{region.index}.heads", region.index)
        tok = _token_major(view, hk, d, self.rows, f"KV append region {region.index}")
        if self.kv_layout is None:
            self.kv_layout = (hk, d)
        elif self.kv_layout != (hk, d):
            raise BuildError("layers with different KV shapes are not supported")
        pend = self.kv_pending.setdefault(layer, {})
        pend[which] = tok.reshape((self.rows, hk, 1, d))
        if len(pend) == 2:
            del self.kv_pending[layer]
            self.ops.append(Op("kv_append", f"L{layer}.kv_append",
                               {"k_new": pend["key"], "v_new": pend["value"]}, {},
                               attrs={"kv_heads": hk, "head_dim": d}, region=region.index,
                               layer=layer))
        return KV(layer)

    def _contiguous(self, view: View, name: str, index=None) -> View:
        """A contiguous copy of ``view`` (for a reshape that its strides cannot express:
        CodeGen splits q, k and v out of each group of heads of its fused qkv, so the
        (b, s, groups, heads per group, d) result is not evenly strided over all heads).

        Copy kernels move (rows, cols) windows: the trailing axes that merge into one
        contiguous run are the columns, the longest other axis the rows, and each index
        of the remaining axes (CodeGen: the groups) one copy."""
        out = self.new_tensor(name, view.shape)
        src = view.squeeze()
        dst = out.reshape(src.shape)
        if src.ndim == 0 or src.strides[-1] != 1:
            raise BuildError(f"{name}: {view.shape} strided {view.strides} has no contiguous "
                             f"rows to copy")
        first = src.ndim - 1                  # the columns: axes first.. are one block
        while first > 0 and src.strides[first - 1] == src.shape[first] * src.strides[first]:
            first -= 1
        width = int(np.prod(src.shape[first:]))
        lead = list(range(first))
        if not lead:                          # one contiguous block: one row
            src, dst, lead = src.expand_dims([0]), dst.expand_dims([0]), [0]
        row_axis = max(lead, key=lambda a: src.shape[a])
        others = [a for a in lead if a != row_axis]
        count = int(np.prod([src.shape[a] for a in others]))
        if count > 64:
            raise BuildError(f"{name}: copying {view.shape} strided {view.strides} takes "
                             f"{count} kernels")
        for k, idx in enumerate(np.ndindex(*[src.shape[a] for a in others])):
            pieces = []
            for v in (src, dst):
                for a, i in zip(others, idx):
                    v = v.slice(a, i, i + 1)
                v = v.squeeze(others).reshape((src.shape[row_axis], width))
                if v is None:
                    raise BuildError(f"{name}: {view.shape} strided {view.strides} is not a "
                                     f"set of strided windows")
                pieces.append(v)
            self._stage(Stage("copy", ("x",), "y"), {"x": pieces[0]}, pieces[1],
                        f"{name}.copy{k}", index)
        return out

    def _region_attention(self, var, region, runtime):
        roles = attention_roles(region.func)
        hq = int(region.attrs["edgetvm.num_heads"])
        d = int(region.attrs["edgetvm.head_dim"])
        scale = float(region.attrs.get("edgetvm.scale", "nan"))
        scale = scale if scale == scale else d ** -0.5
        q, k, v = (runtime.get(roles[r]) for r in ("q", "k", "v"))
        if not (isinstance(k, KV) and isinstance(v, KV) and k.layer == v.layer >= 0):
            raise BuildError(f"attention region {region.index}: K/V do not come from the "
                             f"layer's KV cache (a with-past export is needed)")
        if not isinstance(q, Dev):
            raise BuildError(f"attention region {region.index}: q is not NPU data")
        if "mask" in roles:
            mask = runtime.get(roles["mask"]) if roles["mask"] in runtime else \
                Const(region.args[roles["mask"]])
            if isinstance(mask, Pos):
                self.masks.append((mask.var, region.index))
            elif not isinstance(mask, Const):
                raise BuildError(f"attention region {region.index}: its mask is computed from "
                                 f"NPU data; the kernel masks by causality only")
            else:
                self.masks.append((mask.value, region.index))
        qv = _token_major(q.view, hq, d, self.rows, f"attention region {region.index}")
        (shape,) = self._result_shapes(var)
        cap = softcap(region)
        attrs = {"q_heads": hq, "head_dim": d, "scale": scale,
                 **({"softcap": cap} if cap else {})}
        paged = {v.tensor for op in self.ops if op.kind == "kv_append" and op.layer == k.layer
                 for v in op.inputs.values()}
        if var in self.last_vars and qv.tensor not in paged:
            # only the last row is read (the last layer, before the lm_head): the query at
            # runtime row ``last_row``, position valid_len - 1, over the keys before it in
            # the pages (written by this step's KV append), as a decode step attends. (Not
            # when q shares a tensor with the new K and V, which go straight into the
            # pages: a window at a runtime row of that tensor is not addressed; the
            # consumers then read the last row of every row's attention.)
            q_last = qv.slice(0, 0, 1).shifted(Affine.param("last_row", qv.strides[0]))
            out = self._last(self.new_tensor(f"L{k.layer}.attn", (1, hq * d)), True)
            self.ops.append(Op("attention", f"L{k.layer}.attention",
                               {"q": q_last.squeeze([0])}, {"out": out.reshape((hq, d))},
                               attrs={**attrs, "last_row": True},
                               region=region.index, layer=k.layer))
            self.attention_layers.append(k.layer)
            return Dev(out.reshape((1,) * (len(shape) - 1) + (shape[-1],)))
        qshape = (hq, d) if self.phase == "decode" else (self.rows, hq, d)
        out = self.new_tensor(f"L{k.layer}.attn", (self.rows, hq * d))
        outv = out.reshape(qshape)
        result = out.reshape(shape) if not keeps_heads(region) else \
            out.reshape((1, self.rows, hq, d)).permute((0, 2, 1, 3))   # (b, h, s, d)
        self.ops.append(Op("attention", f"L{k.layer}.attention", {"q": qv.reshape(qshape)},
                           {"out": outv}, attrs=attrs, region=region.index, layer=k.layer))
        self.attention_layers.append(k.layer)
        if tuple(result.shape) != tuple(shape):
            raise BuildError(f"attention region {region.index}: output {shape}, the kernel "
                             f"writes {result.shape}")
        return Dev(result)

    def _region_rope(self, var, region, runtime):
        roles = rope_roles(region.func)
        rotary = int(region.attrs["edgetvm.rotary_dim"])
        heads_major = rope_heads_axis(region) == 1
        (out_shape,) = self._result_shapes(var)          # (b, h, s, d) or (b, s, h, d)
        b, h, s, d = rope_dims(region, out_shape)
        x = runtime.get(roles["x"])
        if not isinstance(x, Dev):
            raise BuildError(f"RoPE region {region.index}: x is not NPU data")
        xv = x.view
        if xv.ndim == 4:                                       # laid out as the output
            xv = xv.permute((0, 2, 1, 3)) if heads_major else xv
        else:
            xv = xv.reshape((b, s, h, d))
        if xv is None or xv.shape != (b, s, h, d):
            raise BuildError(f"RoPE region {region.index}: cannot address x as (b, s, h, d)")
        xv = xv.squeeze([0])                                  # (s, h, d)
        cos_sin = {}
        for r in ("cos", "sin"):
            val = runtime.get(roles[r])
            if not isinstance(val, Pos):
                raise BuildError(f"RoPE region {region.index}: {r} is not a function of the "
                                 f"positions")
            cos_sin[r] = self.position_view(val.var, s, rotary)
        out = self.new_tensor(f"r{region.index}.rope", (s, h * d))
        ov = out.reshape((s, h, d))
        rot_in = xv.slice(2, 0, rotary)
        rot_out = ov.slice(2, 0, rotary)
        self._stage(Stage("rope", ("x", "cos", "sin"), "y", rope_stage_attrs(region)),
                    {"x": rot_in, **cos_sin}, rot_out, f"r{region.index}.rope",
                    region.index)
        if rotary < d:                        # the dimensions that do not rotate: a copy
            self._stage(Stage("copy", ("x",), "y"), {"x": xv.slice(2, rotary, d)},
                        ov.slice(2, rotary, d), f"r{region.index}.pass", region.index)
        out_view = ov.expand_dims([0])                        # (1, s, h, d)
        return Dev(out_view.permute((0, 2, 1, 3)) if heads_major else out_view)

    def _region_rowlocal(self, var, region, runtime):
        """Norms, linears, MLPs, activations, residual adds: the stages of the region's
        fusion cluster, its inputs bound to the views of the region's runtime tensors."""
        shapes = self._result_shapes(var)
        passthrough = passthrough_outputs(region.func)
        tensors = [(pos, a) for pos, a in sorted(runtime.items())
                   if isinstance(region.func.params[pos].ty, relax.TensorType)]
        order = _kernel_order(region, [p for p, _ in tensors])
        values = [self._position_input(a) if isinstance(a, Pos) else a
                  for a in (tensors[i][1] for i in order)]
        if not all(isinstance(a, Dev) for a in values):
            bad = sorted({_HOST_VALUES.get(type(a).__name__, "a value the host computes")
                          for a in values if not isinstance(a, Dev)})
            raise BuildError(f"{region.kind} region {region.index}: its kernel reads NPU "
                             f"tensors, and an input is {' and '.join(bad)}")
        y_shape = shapes[passthrough.index(False)] if passthrough else shapes[0]
        rows = int(np.prod(y_shape[:-1], dtype=np.int64)) if len(y_shape) > 1 else 1
        last = var in self.last_vars        # prefill: the last token's row only
        in_views = [a.view for a in values]
        order = None if last else _row_order(in_views, y_shape)
        if order is not None:                 # rows in the order memory holds them
            in_views = [v.permute(order) for v in in_views]
            y_shape = tuple(y_shape[a] for a in order)
        if last:
            rows = 1
        full = self._full_rows(var)
        views = [self._row_input(v, rows, v.shape[-1], f"{region.kind} region "
                                 f"{region.index}", full) for v in in_views]
        cluster, consts, _, _ = build_cluster(region, [(rows, v.shape[1]) for v in views])
        names = {}
        inputs = [n for n in cluster.tensors if n not in cluster.consts]
        for n, v in zip(inputs, views):
            want = tuple(cluster.tensors[n][0])
            if want != v.shape:
                v = self._padded(v, want, f"r{region.index}.{n}", region)
            names[n] = v
        for n in cluster.consts:
            names[n] = self.const(f"r{region.index}.{n}", consts[n])
        prefix = f"r{region.index}"
        for st in cluster.stages:
            shape, _ = _stage_shape(cluster, st)
            out = self._last(self.new_tensor(f"{prefix}.{st.output}", shape), last)
            names[st.output] = out
            self.ops.append(Op("stage", f"{prefix}.{st.output}",
                               {i: names[i] for i in st.inputs}, {st.output: out}, st, {},
                               region.index))
        y = names[cluster.outputs[0]]
        if last:
            y_shape = (1,) * (len(y_shape) - 1) + (y_shape[-1],)
        yv = y.reshape(y_shape)
        if order is not None:
            yv = yv.permute(np.argsort(order))
        if not passthrough:
            return Dev(yv)
        return Tup(tuple(Dev(values[0].view.reshape(shp)) if p else Dev(yv)
                         for p, shp in zip(passthrough, shapes)))


# -- helpers ---------------------------------------------------------------------------------
def _row_order(views, y_shape):
    """A row-local region (each output row a function of the same row of every input) may
    take its rows in any order. When an input's rows are not one strided window in the
    model's order (Gemma-3 normalises q and k per head after moving the heads before the
    tokens: rows (h, s) of a (s, h, d) tensor), this is the permutation of the leading axes
    that reads them in memory order; None when the model's order works or no reordering
    does (inputs whose leading shapes differ from the output's)."""
    lead = tuple(y_shape[:-1])
    if len(lead) < 2 or any(tuple(v.shape[:-1]) != lead for v in views):
        return None
    rows = int(np.prod(lead, dtype=np.int64))
    if all(v.reshape((rows, v.shape[-1])) is not None for v in views):
        return None
    first = next(v for v in views if v.reshape((rows, v.shape[-1])) is None)
    axes = sorted(range(len(lead)), key=lambda a: -first.strides[a] if lead[a] > 1 else 0)
    order = tuple(axes) + (len(lead),)
    if all(v.permute(order).reshape((rows, v.shape[-1])) is not None for v in views):
        return order
    return None


def _vars_in(e) -> list:
    """The relax Vars an expression reads directly (through tuples)."""
    if isinstance(e, relax.Var):
        return [e]
    if isinstance(e, relax.Tuple):
        return [v for f in e.fields for v in _vars_in(f)]
    if isinstance(e, relax.TupleGetItem):
        return _vars_in(e.tuple_value)
    if isinstance(e, relax.Call):
        return [v for a in e.args for v in _vars_in(a)]
    return []


def _host_only(a) -> bool:
    """Is this value computed on the host from positions, constants and shapes alone?"""
    if isinstance(a, Tup):
        return all(_host_only(x) for x in a.items)
    return isinstance(a, (Pos, Const, Shape))


def _ints(e) -> list:
    if isinstance(e, relax.Tuple):
        return [int(f.value) for f in e.fields]
    if isinstance(e, relax.ShapeExpr):
        return [int(v) for v in e.values]
    raise BuildError(f"expected constant integers, got {type(e).__name__}")


def _describe(value) -> str:
    op = getattr(value, "op", None)
    return getattr(op, "name", type(value).__name__) + _onnx_node(value)


#: what a region input that is not NPU data is, for a user
_HOST_VALUES = {"Pos": "a value the host computes from constants and the token positions "
                       "alone (a position embedding, a bias broadcast to a runtime shape)",
                "Tok": "the token ids", "Const": "a constant"}

#: ops that only move or retype data: left out of what an attention computes
_LAYOUT = {"relax.reshape", "relax.permute_dims", "relax.broadcast_to", "relax.astype",
           "relax.expand_dims", "relax.squeeze"}


def unrecognised_attention(defs: dict, var, reach: int = 80) -> str | None:
    """Why the host code at ``var`` stops the program, when it feeds a softmax that no
    attention region took (the attention pattern did not recognise what the model computes
    between its scores and its softmax): those ops, with their ONNX nodes. None when
    ``var`` reaches no such softmax within ``reach`` bindings."""
    users: dict = {}
    for v, value in defs.items():
        for a in getattr(value, "args", ()):
            if isinstance(a, relax.Var):
                users.setdefault(a, []).append(v)
    frontier, seen, softmax = [var], {var}, None
    for _ in range(reach):
        nxt = []
        for v in frontier:
            for u in users.get(v, ()):
                if u in seen:
                    continue
                seen.add(u)
                if op_name(defs[u]) == "relax.nn.softmax":
                    softmax = u
                    break
                nxt.append(u)
            if softmax is not None:
                break
        if softmax is not None or not nxt:
            break
        frontier = nxt
    if softmax is None:
        return None
    upstream, stack, scores = set(), [defs[softmax].args[0]], None
    while stack:                      # what the softmax's input is computed from
        v = stack.pop()
        if not isinstance(v, relax.Var) or v not in defs or v in upstream:
            continue
        upstream.add(v)
        value = defs[v]
        if op_name(value) == "relax.matmul" and \
                all(isinstance(a, relax.Var) for a in value.args[:2]):
            scores = v if scores is None else scores
            continue                  # q @ k^T: where the scores start
        stack.extend(a for a in getattr(value, "args", ()) if isinstance(a, relax.Var))
    if scores is None:
        return None
    path, stack = set(), [scores]       # ... and on a path from the scores
    while stack:
        v = stack.pop()
        for u in users.get(v, ()):
            if u in upstream and u not in path:
                path.add(u)
                stack.append(u)
    ops = [f"{op_name(defs[v]).removeprefix('relax.')}{_onnx_node(defs[v])}"
           for v in defs if v in path and op_name(defs[v]) not in _LAYOUT | {""}]
    return (f"an attention the NPU kernel does not take: between its scores "
            f"q @ k^T{_onnx_node(defs[scores])} and its softmax"
            f"{_onnx_node(defs[softmax])} the model computes {', '.join(ops) or 'nothing'} "
            f"(the kernel takes one scaling, a soft-cap cap * tanh(scores * c), an added mask "
            f"and a clamp at -1e4 or below)")


def _first_onnx_node(func) -> str:
    """:func:`_onnx_node` of the first binding of ``func`` that has one."""
    return next((_onnx_node(b.value) for blk in func.body.blocks for b in blk.bindings
                 if _onnx_node(b.value)), "")


def _is_packed_call(call) -> bool:
    return isinstance(getattr(call, "op", None), tvm.ir.Op) and \
        call.op.name == "relax.call_pure_packed"


def _onnx_name(value) -> str:
    """The name of the ONNX node the importer converted a call from (its span,
    ``EdgeONNXImporter``), else ``""``."""
    span = getattr(value, "span", None)
    source = getattr(span, "source_name", None) if span is not None else None
    return getattr(source, "name", "") if source is not None else ""


def _onnx_node(value) -> str:
    """`` (ONNX node 'NAME')`` for a call converted from a named node, else ``""``."""
    name = _onnx_name(value)
    return f" (ONNX node {name!r})" if name else ""


def _token_major(view: View, heads: int, head_dim: int, rows: int, what: str) -> View:
    """``(rows, heads, head_dim)`` view of per-head values (b, s, heads * d), (b, s, heads,
    d), heads-major (b, heads, s, d) or (b, s, a, c, d) with heads in groups (``a * c =
    heads``), as the reference session reads them."""
    v = view
    if v.ndim in (3, 5):
        v = v.reshape((v.shape[0], v.shape[1], heads, head_dim))
    elif v.ndim == 4 and not (v.shape[1] != heads and v.shape[2] == heads):
        v = v.permute((0, 2, 1, 3))       # heads-major (b, heads, s, d), as exported
    if v is None or v.shape != (1, rows, heads, head_dim):
        raise BuildError(f"{what}: cannot address {view.shape} as ({rows} tokens, {heads} "
                         f"heads, {head_dim})")
    return v.squeeze([0])


def _kernel_order(region, positions) -> list:
    """Order of the region's runtime tensors as its kernel reads them (a gated activation:
    the activation's input first)."""
    if region.kind == "activation" and region.attrs.get("edgetvm.gated") == "1":
        gate = param_index(region.func, activation_input(region))
        first = positions.index(gate)
        return [first] + [i for i in range(len(positions)) if i != first]
    return list(range(len(positions)))


def _stage_shape(cluster, stage) -> tuple:
    """(shape, dtype) of a stage's result: rows of its first input, columns from the op."""
    env = {n: s for n, (s, _) in cluster.tensors.items()}
    for st in cluster.stages:
        first = env[st.inputs[0]]
        if st.op.startswith("linear"):
            n = cluster.tensors[st.inputs[1]][0][0]
            env[st.output] = (first[0], n)
        else:
            env[st.output] = tuple(first)
        if st is stage:
            return env[st.output], F16
    raise KeyError(stage.output)


def add_alibi_slopes(graph: PhaseGraph, slopes: dict) -> None:
    """Give the attention ops of the regions in ``slopes`` (region index -> ALiBi's slope
    per query head, as the softmax sees the bias) their kernel's ``slopes`` input: a
    constant (heads, 1) float32 in unscaled-score units (over the softmax scale: the
    kernel folds the scale into its exponent)."""
    for op in graph.ops:
        if op.kind != "attention" or op.region not in slopes:
            continue
        if op.attrs.get("softcap"):
            raise BuildError(f"attention region {op.region}: soft-capped scores with ALiBi's "
                             f"bias: the NPU attention kernel does not take both")
        hq, scale = op.attrs["q_heads"], op.attrs["scale"]
        data = (np.asarray(slopes[op.region], np.float64) / scale).astype(np.float32)
        name = f"L{op.layer}.alibi_slopes"
        graph.tensors[name] = Tensor(name, (hq, 1), "float32", "const", data.reshape(hq, 1))
        op.inputs["slopes"] = View.whole(name, (hq, 1))
        op.attrs["alibi"] = True


def add_sliding_windows(graph: PhaseGraph, windows: dict) -> None:
    """Give the attention ops of the regions in ``windows`` (region index -> the mask's
    sliding window) their kernel's ``window``: keys that many or more positions behind
    the query are hidden."""
    for op in graph.ops:
        if op.kind == "attention" and op.region in windows:
            if op.attrs.get("alibi"):
                raise BuildError(f"attention region {op.region}: a sliding window with "
                                 f"ALiBi's bias: the NPU attention kernel does not take both")
            op.attrs["window"] = int(windows[op.region])


def extract_phase_graph(mod, regions, phase: str, rows: int, pages: int,
                        logits_rows: str = "last") -> tuple:
    """The :class:`PhaseGraph` of one phase and bucket, and the position-only values it
    needs evaluated (``positions.py``): ``(graph, masks)`` where ``masks`` lists the
    attention masks to check, as (relax var or constant array, region index)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be prefill or decode, not {phase!r}")
    ex = _Extractor(mod, regions, phase, rows, pages, logits_rows)
    return ex.run(), ex.masks
