"""Interpret a scheduled s_tir PrimFunc into a flat list of tile operations.

Loops are executed with concrete values; a loop annotated ``"npu.op"`` is not iterated:
the loop nest under it, with its single leaf block, is ONE NPU operation whose operand
regions are the boxes its leaf block touches over the nest's iteration space. The
schedule templates (``edgetvm.tir_schedules``) put the annotation on the loops they tile
into TCM-sized pieces:

* ``"dma"``: a copy block between a DRAM buffer and a ``global.tcm`` buffer;
* ``"mma"``: a matmul reduction block (fp16/int8 operands, or fp16 x packed 4-bit weights
  with group scales dequantised inside the block);
* ``"vector:<op>"``: an elementwise/reduction block on the vector unit (``isa.Vector``).

Optional loop annotations: ``"npu.slots"`` (how many TCM copies the written buffer gets:
2 = double buffering), ``"npu.channel"`` (DMA channel). Root block annotation
``"npu.dma_split"``: 1 reserves the last DMA channel for stores (so a store waiting for
compute never holds up a prefetch queued behind it), 0 lets loads use every channel.
Predicates (the op runs only for some runtime parameter values): ``"npu.valid_len"``
names a parameter ``L`` and ``"npu.valid_axis"`` an iter var ``v`` of the leaf block (bound
to a value of the enclosing loops, extent 1): the op runs iff ``L - v > 0`` (a tile past the
valid length is skipped; a DMA moves only the valid rows unless ``"npu.valid_whole"``).
``"npu.predicates"``: ``"name:coef:axis,..."``, more conditions ``coef * name - v > 0`` that
must all hold as well (a causal mask only on the tiles the diagonal crosses).
Root block annotation ``"npu.tcm_fresh"``: 1 gives every TCM buffer bytes no other buffer
uses while they all fit (``tcm_alloc.plan_tcm``), 0 (and no annotation) lets buffers that
are never live at once share bytes. Root block annotation ``"npu.list_schedule"``: 1
reorders the ops for overlap within their dependencies (``reorder.list_schedule``), 0
(and no annotation) keeps the loop nest's order, 2 (``reorder.AUTO``) takes whichever of
the two the lowering's plan estimates faster (``reorder.in_order_makespan``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tvm import s_tir, tirx
from tvm.ir.expr import TensorLoad   # TVM 0.27: what tirx.BufferLoad(...) builds
from tvm.tirx.buffer import BufferType

from edgetvm.errors import CandidateRejected

from ..isa import Affine
from .exprs import ExprCompiler, var_key

TCM_SCOPE = "global.tcm"


@dataclass
class Box:
    """A region ``[lo, hi)`` per dimension of one buffer (global index space)."""

    buffer: object
    lo: tuple
    hi: tuple
    axes: tuple = ()      # per dim: the leaf block's iter var positions its index moves with

    @property
    def extents(self) -> tuple:
        out = []
        for l, h in zip(self.lo, self.hi):
            e = h - l
            if isinstance(e, Affine):
                if e.terms:
                    raise CandidateRejected(f"the extent of a box of {self.buffer.name!r} "
                                            f"depends on a runtime parameter ({e})")
                e = e.const
            out.append(e)
        return tuple(out)

    @property
    def empty(self) -> bool:
        return any(not isinstance(l, Affine) and not isinstance(h, Affine) and h <= l
                   for l, h in zip(self.lo, self.hi))


@dataclass
class TileOp:
    index: int
    kind: str                 # dma | mma | vector
    op: str                   # vector op name ("" otherwise)
    reads: list
    writes: list
    path: tuple               # ((loop uid, value), ...) of the enclosing iterated loops
    block: str
    attrs: dict = field(default_factory=dict)


def _ann(annotations, key, default=None):
    if key not in annotations:
        return default
    v = annotations[key]
    if isinstance(v, (tirx.IntImm,)):
        return int(v.value)
    if hasattr(v, "value") and not isinstance(v, str):
        return v.value
    return str(v) if not isinstance(v, (int, float)) else v


def _leaves(node) -> tuple:
    """(float constants, number of buffer loads) of a leaf block's body, the constants in
    expression order (the vector op's imm)."""
    found, loads = [], []

    def visit(e):
        if isinstance(e, tirx.FloatImm):
            found.append(float(e.value))
        elif isinstance(e, TensorLoad):
            loads.append(e)
        elif isinstance(e, tirx.BufferStore):
            visit(e.value)
        elif isinstance(e, tirx.SeqStmt):
            for s in e.seq:
                visit(s)
        else:
            for attr in ("a", "b", "value", "condition", "true_value", "false_value"):
                if hasattr(e, attr) and not isinstance(e, (tirx.IntImm, tirx.Var)):
                    visit(getattr(e, attr))
            for arg in getattr(e, "args", ()) or ():
                visit(arg)
    visit(node)
    return found, len(loads)


class Interpreter:
    """Runs the loop structure of a scheduled PrimFunc and records its NPU operations."""

    def __init__(self, func: tirx.PrimFunc, runtime=(), max_ops: int | None = None):
        self.func = func
        self.max_ops = max_ops
        self.exprs = ExprCompiler(runtime)
        self._compiled: dict = {}
        self.loop_ids: dict = {}
        self.ops: list = []
        self.buffers: dict = {}   # buffer var -> "param" | "runtime" | "tcm" | "dram_scratch"
        self.scalars: dict = {}   # var_key(scalar parameter) -> Affine runtime parameter
        self.dma_split = False    # root block "npu.dma_split": stores get their own channel
        self.tcm_fresh = False    # root block "npu.tcm_fresh": TCM bytes of its own per buffer
        self.list_schedule = 0      # root block "npu.list_schedule": 1 reorder, 2 auto
        for p in func.params:          # TVM 0.27: buffer params are Vars of BufferType
            if isinstance(p.ty, BufferType):
                self.buffers[p] = "runtime" if p.name in self.exprs.runtime else "param"
            else:
                self.scalars[var_key(p)] = Affine.param(p.name)

    @property
    def params(self) -> list:
        """Names of the runtime parameters the program uses."""
        return sorted(self.exprs.used_params | {a.names()[0] for a in self.scalars.values()})

    def _f(self, e):
        key = var_key(e)
        f = self._compiled.get(key)
        if f is None:
            f = self._compiled[key] = (self.exprs.compile(e), e)   # e: keeps the key valid
        return f[0]

    def run(self) -> list:
        self._walk(self.func.body, dict(self.scalars), ())
        return self.ops

    # -- the walk ---------------------------------------------------------------------
    def _walk(self, stmt, env, path):
        if isinstance(stmt, tirx.For):
            if "npu.op" in stmt.annotations:
                self._emit(stmt, env, path)
                return
            var = var_key(stmt.loop_var)
            uid = self.loop_ids.setdefault(var, len(self.loop_ids))
            lo = self._f(stmt.min)(env)
            for v in range(lo, lo + self._f(stmt.extent)(env)):
                env[var] = v
                self._walk(stmt.body, env, path + ((uid, v),))
            env.pop(var, None)
        elif isinstance(stmt, tirx.SeqStmt):
            for s in stmt.seq:
                self._walk(s, env, path)
        elif isinstance(stmt, s_tir.SBlockRealize):
            block = stmt.block
            if "npu.dma_split" in block.annotations:
                self.dma_split = bool(_ann(block.annotations, "npu.dma_split"))
            if "npu.tcm_fresh" in block.annotations:
                self.tcm_fresh = bool(_ann(block.annotations, "npu.tcm_fresh"))
            if "npu.list_schedule" in block.annotations:
                self.list_schedule = int(_ann(block.annotations, "npu.list_schedule"))
            for buf in block.alloc_buffers:
                self.buffers[buf] = "tcm" if buf.scope() == TCM_SCOPE else "dram_scratch"
            for iv, val in zip(block.iter_vars, stmt.iter_values):
                env[var_key(iv.var)] = self._f(val)(env)
            if not self._true(stmt.predicate, env):
                return
            if _is_leaf(block):
                raise CandidateRejected(
                    f"block {block.name_hint!r} is not mapped to an NPU instruction: annotate "
                    f"the loop nest around it with 'npu.op' in the schedule")
            self._walk(block.body, env, path)
        elif isinstance(stmt, tirx.IfThenElse):
            if self._true(stmt.condition, env):
                self._walk(stmt.then_case, env, path)
            elif stmt.else_case is not None:
                self._walk(stmt.else_case, env, path)
        elif isinstance(stmt, (tirx.Evaluate,)):
            return
        elif hasattr(stmt, "body"):
            self._walk(stmt.body, env, path)
        else:
            raise CandidateRejected(f"cannot lower statement {type(stmt).__name__} to the NPU")

    def _true(self, cond, env) -> bool:
        if isinstance(cond, (bool, int)):
            return bool(cond)
        if isinstance(cond, tirx.IntImm):
            return bool(cond.value)
        return bool(self._f(cond)(env))

    # -- one NPU operation --------------------------------------------------------------
    def _emit(self, loop, env, path):
        kind_ann = _ann(loop.annotations, "npu.op")
        ranges = []           # (var, lo, hi_inclusive)
        stmt = loop
        while isinstance(stmt, tirx.For):
            lo = self._f(stmt.min)(env)
            ranges.append([var_key(stmt.loop_var), lo, lo + self._f(stmt.extent)(env) - 1])
            stmt = stmt.body
        if not isinstance(stmt, s_tir.SBlockRealize) or not _is_leaf(stmt.block):
            raise CandidateRejected(f"the loop nest annotated npu.op={kind_ann!r} must be a "
                                    f"perfect nest around one leaf block")
        realize, block = stmt, stmt.block
        inner = dict(env)
        if not self._clamp(realize, ranges, inner):
            return          # every iteration is predicated off (a tile past the edge)
        env_min = dict(inner)
        env_max = dict(inner)
        for var, lo, hi in ranges:
            env_min[var], env_max[var] = lo, hi
        for iv, val in zip(block.iter_vars, realize.iter_values):
            f = self._f(val)
            k = var_key(iv.var)
            env_min[k], env_max[k] = f(env_min), f(env_max)

        axes = self._axes(block, env_min)

        def box(region):
            buf = region.source
            lo, hi = [], []
            for d, r in enumerate(region.region):
                f = self._f(r.min)
                ext = self._f(r.extent)(env_min)
                a, b = f(env_min), f(env_max) + ext
                size = int(buf.shape[d])
                if isinstance(a, Affine) or isinstance(b, Affine):
                    lo.append(a)          # a runtime-parameter index: bounds checked on device
                    hi.append(b)
                    continue
                lo.append(max(0, min(a, size)))
                hi.append(max(0, min(b, size)))
            return Box(buf, tuple(lo), tuple(hi), axes[id_of(region)])

        def id_of(region):
            return next(k for k, r in enumerate(regions) if r.same_as(region))

        regions = list(block.writes) + list(block.reads)
        writes = [box(r) for r in block.writes]
        write_bufs = {w.buffer for w in writes}
        kind, _, vop = str(kind_ann).partition(":")
        # an output read back is the accumulator of an MMA or a reduction (not a source);
        # an elementwise vector op may read its output in place (O = O * c)
        in_place = kind == "vector" and block.init is None
        reads = [box(r) for r in block.reads if in_place or r.source not in write_bufs]
        keys = [var_key(iv.var) for iv in block.iter_vars]
        attrs = {"iter_ext": tuple(env_max[k] - env_min[k] + 1 for k in keys),
                 "slots": int(_ann(loop.annotations, "npu.slots", 1)),
                 "channel": _ann(loop.annotations, "npu.channel", None)}
        attrs["iter_min"] = tuple(env_min[k] for k in keys)
        for key in ("npu.valid_len", "npu.valid_axis", "npu.valid_whole", "npu.mask_len",
                    "npu.mask_pos", "npu.mask_window", "npu.predicates", "npu.alibi_query",
                    "npu.alibi_offset", "npu.alibi_rows"):
            if key in loop.annotations:
                attrs[key[4:]] = _ann(loop.annotations, key)
        if kind == "mma":
            attrs["accumulate"] = self._accumulates(block, env_min)
            attrs["transpose_b"] = self._b_is_nk(block, reads, env_min)
        if kind == "vector":
            imms, attrs["loads"] = _leaves(block.body)
            attrs["imm"] = imms[0] if imms else None
            if "npu.imm" in loop.annotations:        # when the body has several constants
                attrs["imm"] = float(_ann(loop.annotations, "npu.imm"))
        if kind not in ("dma", "mma", "vector"):
            raise CandidateRejected(f"unknown npu.op {kind_ann!r} on block {block.name_hint!r}")
        if self.max_ops is not None and len(self.ops) >= self.max_ops:
            raise CandidateRejected(f"the schedule needs more than {self.max_ops} NPU "
                                    f"operations (tiles too small for this workload)")
        self.ops.append(TileOp(len(self.ops), kind, vop, reads, writes, path, block.name_hint,
                               attrs))

    def _clamp(self, realize, ranges, env) -> bool:
        """Shrink the inner loop ranges to the iterations the block predicate keeps."""
        pred = realize.predicate
        if isinstance(pred, tirx.IntImm) and pred.value:
            return True
        block = realize.block
        vals = [(var_key(iv.var), self._f(v))
                for iv, v in zip(block.iter_vars, realize.iter_values)]
        fpred = self._f(pred)

        def holds(assign):
            e = dict(env)
            e.update(assign)
            for var, f in vals:
                e[var] = f(e)
            return fpred(e)

        mins = {var: lo for var, lo, _ in ranges}
        if not holds(mins):
            return False
        for r in ranges:
            var, lo, hi = r
            a, b = lo, hi          # largest v in [a, b] with the predicate true
            while a < b:
                mid = (a + b + 1) // 2
                if holds({**mins, var: mid}):
                    a = mid
                else:
                    b = mid - 1
            r[2] = a
        return True

    def _axes(self, block, env_min) -> list:
        """For each region (writes, then reads) and dim: iter var positions it moves with."""
        key = ("axes", var_key(block))
        cached = self._compiled.get(key)
        if cached is not None:
            return cached
        regions = list(block.writes) + list(block.reads)
        base = [[self._f(r.min)(env_min) for r in reg.region] for reg in regions]
        result = [[set() for _ in reg.region] for reg in regions]
        used = set(self.exprs.used_params)   # probes may read ids past the op: not params
        for p, iv in enumerate(block.iter_vars):
            probe = dict(env_min)
            probe[var_key(iv.var)] = env_min[var_key(iv.var)] + 2
            for k, reg in enumerate(regions):
                for d, r in enumerate(reg.region):
                    if self._f(r.min)(probe) != base[k][d]:
                        result[k][d].add(p)
        self.exprs.used_params = used
        result = [tuple(frozenset(s) for s in dims) for dims in result]
        self._compiled[key] = result
        return result

    def _b_is_nk(self, block, reads, env_min) -> bool:
        """Is the weight operand laid out (N, K)? Probe: does its first index move with k?"""
        weights = [r for r in reads if str(r.buffer.dtype) == "uint8"] or reads[1:2]
        if not weights:
            return False
        region = next(r for r in block.reads if r.source.same_as(weights[0].buffer))
        red = [iv for iv in block.iter_vars if iv.iter_type == 2]
        if len(region.region) < 2 or not red:
            return False
        probe = dict(env_min)
        f0 = self._f(region.region[-2].min)
        base = f0(probe)
        for iv in red:
            # +2: a packed 4-bit index moves by k // 2
            probe[var_key(iv.var)] = env_min[var_key(iv.var)] + 2
        return f0(probe) == base

    def _accumulates(self, block, env_min) -> bool:
        if block.init is None:
            return True
        for iv in block.iter_vars:
            if iv.iter_type == 2:        # CommReduce
                if env_min[var_key(iv.var)] != self._f(iv.dom.min)(env_min):
                    return True
        return False


def _is_leaf(block) -> bool:
    def has_block(s) -> bool:
        if isinstance(s, s_tir.SBlockRealize):
            return True
        if isinstance(s, tirx.SeqStmt):
            return any(has_block(x) for x in s.seq)
        if isinstance(s, tirx.IfThenElse):
            return has_block(s.then_case) or (s.else_case is not None and
                                              has_block(s.else_case))
        return isinstance(s, tirx.For) and has_block(s.body)
    return not has_block(block.body)
