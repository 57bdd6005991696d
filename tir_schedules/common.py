"""Helpers shared by the schedule templates: knobs as s_tir sampling instructions, and the
annotations the NPU lowering reads (``npu.op``, ``npu.slots``, ``npu.channel``)."""
from __future__ import annotations

import tvm
from tvm import s_tir

from edgetvm.target.lowering.lower import FILL_CONSTS, TCM_INSTANCE

TCM = "global.tcm"


class Schedule(s_tir.Schedule):
    """``s_tir.Schedule`` without the Python-side type check of every primitive's
    arguments (``s_tir.schedule._type_checker``): the FFI still checks what it converts
    and the schedule state is still verified. The check walked every list argument on every
    call and was a quarter of lowering a fused cluster (4 of 18 s of a family's ``mega``
    kernels); the templates call primitives thousands of times per phase."""


for _name, _method in list(vars(s_tir.Schedule).items()):
    if callable(_method) and hasattr(_method, "__wrapped__"):
        setattr(Schedule, _name, _method.__wrapped__)


def new_schedule(func, seed: int | None = None) -> Schedule:
    """A schedule of the PrimFunc ``func`` (or an IRModule with ``main``)."""
    mod = func if isinstance(func, tvm.IRModule) else tvm.IRModule({"main": func})
    return Schedule(mod, seed=seed)


def knob(sch, value, candidates, name: str):
    """A knob as a sampling instruction, so search can mutate it and replay can re-apply it.

    ``value`` fixes it (a one-candidate categorical keeps the trace uniform); ``None``
    samples uniformly from ``candidates``.
    """
    cands = [int(c) for c in candidates]
    if value is not None:
        cands = [int(value)]
    if not cands:
        raise ValueError(f"knob {name}: no candidate")
    return sch.sample_categorical(cands, [1.0 / len(cands)] * len(cands))


def tile_candidates(extent: int, sizes=(16, 32, 64, 128, 256, 512)) -> list:
    """Tile sizes worth trying for a loop: powers of two up to the extent, plus the extent."""
    c = [s for s in sizes if s < extent]
    return c + [extent]


def annotate_op(sch, loop, op: str, slots=None, channel=None):
    sch.annotate(loop, "npu.op", op)
    if slots is not None:
        sch.annotate(loop, "npu.slots", slots)
    if channel is not None:
        sch.annotate(loop, "npu.channel", channel)


def nest_root(sch, block, outer: int):
    """The first loop of ``block``'s own nest below its ``outer`` enclosing loops."""
    return sch.get_loops(block)[outer]


# -- explicit tile kernels ----------------------------------------------------------------
# Kernels whose loop structure is data-dependent (online softmax: a first tile that
# initialises the running max/sum, later tiles that rescale them) are written directly
# with explicit tile loops rather than derived from a TE compute by split/cache_read.
# ``TileKernel`` writes such a PrimFunc with TVM's IR builder and records, per leaf
# block, where its NPU operation starts and how to annotate it; ``apply_annotations``
# then schedules it (s_tir.Schedule.annotate), so the knobs and the NPU annotations
# live in the schedule trace like any other template's.


class TileKernel:
    """Builds an s_tir PrimFunc with explicit tile loops, one leaf block per NPU op.

    Every :meth:`op` writes a perfect loop nest (local tile extents) around one leaf
    block whose iter vars are bound to global indices; the op's annotations (``npu.op``
    and friends) are recorded in :attr:`ops` as ``(block name, loop depth, annotations)``
    and put on the nest's outermost loop by :func:`apply_annotations`.
    """

    def __init__(self, name: str):
        from tvm.script.ir_builder import IRBuilder
        from tvm.tirx.script.builder import ir as T

        self.T = T
        self.name = name
        self.ops: list = []
        self._ib = IRBuilder()
        self._frames: list = []
        self._depth = 0
        self._outer: list = []      # iterated loop vars around the current point
        self._names: dict = {}
        self._fills: dict = {}      # template constants: buffer name -> fill value
        self._instances: dict = {}  # TCM buffer name -> loops delimiting an instance

    # -- function frame ---------------------------------------------------------------
    def __enter__(self):
        T = self.T
        self._ib.__enter__()
        self._push(T.prim_func(s_tir=True))
        T.func_name("main")
        T.func_attr({"tirx.noalias": True})
        return self

    def begin_body(self):
        """Call after the arguments: opens the root block that holds the TCM buffers."""
        self._push(self.T.sblock("root"))

    def __exit__(self, *exc):
        while self._frames:
            self._frames.pop().__exit__(*exc)
        self._ib.__exit__(*exc)

    def func(self):
        f = self._ib.get()
        if self._fills:
            f = f.with_attr(FILL_CONSTS, {k: float(v) for k, v in self._fills.items()})
        if self._instances:
            f = f.with_attr(TCM_INSTANCE, dict(self._instances))
        return f

    def _push(self, frame):
        self._frames.append(frame)
        return frame.__enter__()

    # -- declarations -----------------------------------------------------------------
    def buffer(self, name: str, shape, dtype: str):
        from tvm.script.ir_builder import IRBuilder
        buf = self.T.arg(name, self.T.buffer(tuple(int(s) for s in shape), dtype))
        IRBuilder.name(name, buf)
        return buf

    def const(self, name: str, shape, dtype: str, value: float):
        """A constant DRAM parameter of the template itself, every element ``value`` (a
        column of ones for an MMA that sums rows): lowering ships it in the program
        (``npu.fill_consts``), so callers do not provide it."""
        self._fills[name] = value
        return self.buffer(name, shape, dtype)

    def scalar(self, name: str):
        from tvm.script.ir_builder import IRBuilder
        v = self.T.arg(name, self.T.int32())
        IRBuilder.name(name, v)
        return v

    def tcm(self, name: str, shape, dtype: str, instance_loops: int | None = None):
        """A TCM buffer declared with its global shape; lowering compacts it to the tile.
        ``instance_loops``: one instance of it spans one iteration of the first this many
        iterated loops (``TCM_INSTANCE``), not of every loop around all its accesses."""
        if instance_loops is not None:
            self._instances[name] = int(instance_loops)
        from tvm.script.ir_builder import IRBuilder
        buf = self.T.sblock_alloc_buffer(tuple(int(s) for s in shape), dtype, scope=TCM)
        IRBuilder.name(name, buf)
        return buf

    # -- control ------------------------------------------------------------------------
    def loop(self, extent, name: str, start=0):
        """``with kb.loop(n, "t") as t:`` an iterated (not NPU-op) loop."""
        kb = self

        class _Loop:
            def __enter__(self_):
                from tvm.script.ir_builder import IRBuilder
                self_.frame = kb.T.serial(start, start + extent)
                v = self_.frame.__enter__()
                IRBuilder.name(name, v)
                kb._depth += 1
                kb._outer.append(v)
                return v

            def __exit__(self_, *exc):
                kb._depth -= 1
                kb._outer.pop()
                return self_.frame.__exit__(*exc)
        return _Loop()

    def when(self, cond):
        """``with kb.when(t == 0):`` a compile-time or loop-dependent condition."""
        T = self.T

        class _If:
            def __enter__(self_):
                self_.f_if = T.If(cond)
                self_.f_if.__enter__()
                self_.f_then = T.Then()
                self_.f_then.__enter__()

            def __exit__(self_, *exc):
                self_.f_then.__exit__(*exc)
                return self_.f_if.__exit__(*exc)
        return _If()

    # -- one NPU operation ----------------------------------------------------------------
    def op(self, name: str, npu_op: str, extents, iters, body, where=None, ann=None):
        """One NPU operation: a nest over ``extents`` around one leaf block.

        ``iters(loop_vars)`` -> ``[(kind "S"/"R", (lo, hi), binding), ...]``;
        ``body(iter_vars)`` -> ``(dst_buffer, dst_indices, value, reads, init)`` where
        ``reads`` lists loads (operands in the order the NPU op takes them) and ``init``
        is the reduction's initial value or None; ``where(loop_vars)`` clips edge tiles.
        Returns the block's unique name.
        """
        from tvm.script.ir_builder import IRBuilder
        T = self.T
        k = self._names.get(name, 0)
        self._names[name] = k + 1
        bname = name if k == 0 else f"{name}_{k}"
        frames, lvs = [], []
        for n, e in enumerate(extents):
            f = T.serial(0, int(e))
            v = f.__enter__()
            IRBuilder.name(f"{name}_l{n}", v)
            frames.append(f)
            lvs.append(v)
        with T.sblock(bname):
            ivs = []
            for kind, dom, binding in iters(lvs):
                ax = T.axis.spatial if kind == "S" else T.axis.reduce
                ivs.append(ax(list(dom), binding))
            # s_tir blocks see outer loop vars only through iter vars: bind each iterated
            # loop as an extent-1 iter var after the op's own (which keep their positions)
            sub = {}
            for v in self._outer:
                sub[v] = T.axis.spatial([0, 1 << 20], v)
            if where is not None:
                T.where(where(lvs))
            dst, idx, value, reads, init = body(ivs)
            idx = [substitute(x, sub) for x in idx]
            reads = [substitute(r, sub) for r in reads]
            T.reads(*reads)
            T.writes(dst[tuple(idx)])
            if init is not None:
                with T.init():
                    T.buffer_store(dst, init, list(idx))
            T.buffer_store(dst, substitute(value, sub), list(idx))
        for f in reversed(frames):
            f.__exit__(None, None, None)
        a = {"npu.op": npu_op}
        a.update({k: v for k, v in (ann or {}).items() if v is not None})
        self.ops.append((bname, self._depth, a))
        return bname


def substitute(e, vmap: dict):
    """``e`` with the Vars of ``vmap`` replaced (the index/value expressions of an op)."""
    from tvm import tirx
    from tvm.ir.expr import Call, TensorLoad
    if not vmap or isinstance(e, (int, float, tirx.IntImm, tirx.FloatImm)):
        return e
    if isinstance(e, tirx.Var):
        return vmap.get(e, e)
    if isinstance(e, TensorLoad):
        return e.source[tuple(substitute(i, vmap) for i in e.indices)]
    if isinstance(e, tirx.Cast):
        return substitute(e.value, vmap).astype(str(e.ty))
    if isinstance(e, Call):          # intrinsics such as tirx.exp, rebuilt by name
        return getattr(tirx, str(e.op.name).rsplit(".", 1)[-1])(
            *(substitute(a, vmap) for a in e.args))
    if isinstance(e, tirx.Select):
        return tirx.Select(*(substitute(x, vmap) for x in (e.condition, e.true_value,
                                                            e.false_value)))
    if isinstance(e, tirx.Not):
        return tirx.Not(substitute(e.a, vmap))
    if hasattr(e, "a") and hasattr(e, "b"):
        return type(e)(substitute(e.a, vmap), substitute(e.b, vmap))
    raise NotImplementedError(f"substitute: {type(e).__name__}")


def apply_annotations(sch, ops) -> None:
    """Put each recorded op's annotations on the outermost loop of its nest."""
    for bname, depth, ann in ops:
        loop = sch.get_loops(sch.get_sblock(bname))[depth]
        for key, value in ann.items():
            sch.annotate(loop, key, value)
