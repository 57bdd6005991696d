"""Fusion clusters: a chain of ops compiled as ONE NPU kernel, intermediates kept in TCM.

A :class:`FusionCluster` is flat data: declared input tensors and a list of
:class:`Stage` (one op of :data:`PIECES` applied to named tensors). ``prim_func()``
builds one PrimFunc out of the per-op TE pieces of ``workloads.py``, where every
``te.compute`` is one NPU instruction (its ``npu.op`` block annotation).

:func:`schedule_cluster` schedules any such PrimFunc, one stage or many. Every piece is
row-local (row ``i`` of a result depends only on row ``i`` of its inputs), so the whole
chain is tiled over rows as one loop: each block's row loop is split by ``tile_m`` and
the outer loops of all blocks are merged (``sch.merge``). Inside one row block:

* activations ("row" inputs) are DMA'd in once, row-invariant vectors (norm weights)
  once per kernel, matmul weights per ``(j0, k0)`` tile;
* every intermediate lives in ``global.tcm`` (``set_scope``): nothing round-trips DRAM;
* each block's loop nest becomes its instruction; matmuls are tiled ``j0, k0 | i1, j1,
  k1`` as in ``gemm.schedule_matmul`` with their cast (and store, for an output)
  computed per ``j0`` tile;
* outputs are written to TCM and stored by DMA.

If the live TCM buffers do not fit, lowering raises ``CandidateRejected`` naming them
(:func:`lower_cluster` prefixes the cluster's name).

Knobs (sampling instructions; ``None`` samples):

``tile_m``
    rows per tile (any size; the edge tile is clipped);
``tile_n``
    columns per tile, only for clusters of 2-D elementwise ops (no reduction, no matmul);
``slots_in``
    TCM copies of each streamed activation tile (2 = double buffering), one knob per input;
``slots_out``
    TCM copies of each output tile, so its store overlaps the next tile's compute;
``dma_split``
    1 reserves the last DMA channel for stores (root annotation ``npu.dma_split``, as in
    ``gemm.schedule_matmul``), 0 lets loads use every channel;
``tcm_fresh``
    1 gives every TCM buffer bytes of its own while they all fit (root annotation
    ``npu.tcm_fresh``), 0 lets buffers never live at once share bytes. Sharing orders a
    buffer's first write after the last read of the one it replaces: a stage's first
    weight tile then waits for the previous stage's epilogue (SmolLM2's prefill-128 MLP:
    its up projection's first tile waited 18 k cycles for the gate's silu, its down
    projection's 28 k for the product). A knob set without it (a log record from before
    it) lowers as it did then: 0 (:data:`KNOBS_SINCE`);
``list_schedule``
    1 lets the lowering reorder each unit's ops for overlap within their dependencies
    (root annotation ``npu.list_schedule``, ``target/lowering/reorder.py``): with
    several row tiles the matrix unit starts tile ``r + 1``'s projection while the
    vector unit normalises tile ``r``; 0 (and a knob set from before it) keeps the loop
    nest's order. A build's default knobs take the order the lowering's plan estimates
    faster (2, ``LIST_SCHEDULE_AUTO``) and record it as 0 or 1;
``resident_w`` (clusters with matmuls)
    1 loads every matmul's weights (packed codes, scales, zero points) whole, once per
    kernel, into TCM buffers that stay for the whole kernel; each MMA reads its
    ``(j0, k0)`` tile out of them. 0 streams each weight tile into ``slots_w`` copies per
    row tile, so a kernel of ``r`` row tiles reads its weights ``r`` times from DRAM.
    Resident weights take the TCM of all of them at once, and a stage's first MMA waits
    for its whole weight (list-scheduled, the next stages' weights load under the first
    stage's MMAs); in exchange every row tile after the first moves no weight byte, which
    saves the DRAM energy of the re-reads as well as their bus time (SmolLM2's W4A16
    prefill-512 layer at 128-row tiles: 11.7 MB of DRAM traffic, 8 MB of it weights read
    four times). ``slots_w`` does not apply to resident weights. A knob set without it
    lowers with 0 (:data:`KNOBS_SINCE`);
``<stage>.tile_n``, ``<stage>.tile_k``, ``<stage>.slots_w``, ``<stage>.slots_c``
    per matmul stage: output/reduction tile, weight-tile copies, accumulator-tile copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te
from tvm.tirx.analysis import undefined_vars
from tvm.tirx.buffer import BufferType

from edgetvm.errors import CandidateRejected
from edgetvm.target.lowering import lower_primfunc

from . import workloads as W
from .common import TCM, annotate_op, knob, new_schedule, tile_candidates

ROW_TILES = (1, 2, 4, 8, 16, 32, 64, 128)
MATMUL_KNOBS = ("tile_n", "tile_k", "slots_w", "slots_c")

#: op name -> TE piece ``f(*input tensors, name=..., **attrs) -> te.Tensor``
PIECES = {
    "rms_norm": W.rms_norm_te,
    "layer_norm": W.layer_norm_te,
    "rope": W.rope_te,
    "silu_mul": W.silu_mul_te,
    "gelu": W.gelu_te,
    "relu": W.relu_te,
    "relu2": W.relu2_te,
    "gelu_mul": W.gelu_mul_te,
    "relu_mul": W.relu_mul_te,
    "relu2_mul": W.relu2_mul_te,
    "bias_add": W.bias_add_te,
    "mul_vec": W.mul_vec_te,
    "softmax": W.softmax_te,
    "add": W.add_te,
    "scale": W.scale_te,
    "copy": W.copy_te,
    "linear_w4a16": W.linear_w4a16_te,
    "linear_fp16": W.linear_fp16_te,
}


@dataclass(frozen=True)
class Stage:
    """``output = PIECES[op](*inputs, **attrs)``; tensors are referred to by name."""

    op: str
    inputs: tuple
    output: str
    attrs: dict = field(default_factory=dict)


@dataclass
class FusionCluster:
    """Ops scheduled as one kernel.

    ``tensors``: name -> (shape, dtype) of the cluster's inputs, in parameter order;
    ``consts``: which of them are weights (shipped in the program); ``outputs``: names of
    stage results the kernel returns (every other stage result stays in TCM).
    """

    name: str
    tensors: dict
    stages: list
    outputs: tuple
    consts: tuple = ()

    def _graph(self):
        env = {n: te.placeholder(tuple(s), d, name=n) for n, (s, d) in self.tensors.items()}
        for st in self.stages:
            if st.op not in PIECES:
                raise ValueError(f"cluster {self.name}: unknown op {st.op!r}")
            env[st.output] = PIECES[st.op](*(env[i] for i in st.inputs), name=st.output,
                                           **st.attrs)
        return env

    def prim_func(self):
        env = self._graph()
        return W.row_prim_func([env[n] for n in self.tensors], [env[n] for n in self.outputs])

    def split(self) -> list:
        """The same ops as separate kernels (one per stage), intermediates in DRAM: the
        baseline a fused kernel is measured against."""
        env = self._graph()
        kernels = []
        for st in self.stages:
            tensors = {n: (tuple(int(s) for s in env[n].shape), env[n].dtype) for n in st.inputs}
            kernels.append(FusionCluster(f"{self.name}.{st.output}", tensors, [st],
                                         (st.output,), tuple(c for c in self.consts
                                                             if c in tensors)))
        return kernels


def lower_cluster(cluster: FusionCluster, sch, spec, consts: dict):
    """Lower a scheduled cluster (``consts``: name -> array for at least its weights); a
    rejection (e.g. a TCM overflow, which lists the buffers) names the cluster."""
    try:
        return lower_primfunc(sch.mod["main"], spec, cluster.name, outputs=list(cluster.outputs),
                              consts={k: consts[k] for k in cluster.consts})
    except CandidateRejected as e:
        raise CandidateRejected(f"fusion cluster {cluster.name!r}: {e}") from None


# -- the schedule -----------------------------------------------------------------------
def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in undefined_vars(expr))


def _op_of(block) -> str:
    return str(block.annotations["npu.op"]) if "npu.op" in block.annotations else ""


def _input_roles(func, blocks) -> dict:
    """param name -> ("row" | "const" | "weight", first consumer block rv, read index)."""
    roles = {}
    written = {w.source.name for b in blocks for w in b[1].writes}
    for p in func.params:
        if not isinstance(p.ty, BufferType) or p.name in written:
            continue
        role, first = "const", None
        for rv, blk in blocks:
            for idx, r in enumerate(blk.reads):
                if r.source.name != p.name:
                    continue
                first = first or (rv, idx)
                if _op_of(blk) == "mma" and idx > 0:
                    role = "weight"
                elif _uses(r.region[0].min, blk.iter_vars[0].var) and role == "const":
                    role = "row"
        if first is not None:
            roles[p.name] = (role, *first)
    return roles


def _analyse(func, blocks) -> tuple:
    """(output names, row count, elementwise?, input roles) of a row-local PrimFunc."""
    out_names = [p.name for p in func.params if isinstance(p.ty, BufferType) and
                 any(w.source.name == p.name for _, b in blocks for w in b.writes)]
    m_ext = int(blocks[-1][1].iter_vars[0].dom.extent)
    elementwise = all(_op_of(b) not in ("mma",) + W.ROPE_OPS and len(b.iter_vars) == 2 and
                      all(iv.iter_type == 0 for iv in b.iter_vars) for _, b in blocks)
    return out_names, m_ext, elementwise, _input_roles(func, blocks)


#: knobs added after logs were written, and the value a knob set without one lowers with
#: (as it was lowered before the knob existed): a log's old records replay unchanged
KNOBS_SINCE = {"tcm_fresh": 0, "list_schedule": 0, "resident_w": 0}


def knob_names(func) -> tuple:
    """The knobs :func:`schedule_cluster` samples for ``func``, in sampling order (the
    ``KNOBS`` of a template, for ``search.knob_space``)."""
    sch = new_schedule(func)
    blocks = [(rv, sch.get(rv)) for rv in sch.get_child_blocks(sch.get_sblock("root"))]
    _, _, elementwise, roles = _analyse(func, blocks)
    names = ["tile_m"] + (["tile_n"] if elementwise else [])
    names += [f"slots_{n}" for n, (role, _, _) in roles.items() if role == "row"]
    names += ["slots_out", "dma_split", "tcm_fresh", "list_schedule"]
    stages = [b.name_hint[:-len("_acc")] for _, b in blocks if _op_of(b) == "mma"]
    if stages:
        names.append("resident_w")
    for stage in stages:
        names += [f"{stage}.{k}" for k in MATMUL_KNOBS]
    return tuple(names)


def schedule_cluster(sch, *, tile_m=None, tile_n=None, slots_in=None, slots_out=None,
                     dma_split=None, tcm_fresh=KNOBS_SINCE["tcm_fresh"],
                     list_schedule=KNOBS_SINCE["list_schedule"],
                     resident_w=KNOBS_SINCE["resident_w"], matmul=None):
    """Schedule a row-local PrimFunc (``FusionCluster.prim_func()`` or a
    ``workloads`` row op) in place; see the module docstring for the knobs
    (:func:`knob_names` lists them in sampling order).

    ``slots_in``: one value for every streamed input, or a dict name -> value;
    ``matmul``: dict stage name -> dict(tile_n=, tile_k=, slots_w=, slots_c=);
    ``tcm_fresh``, ``list_schedule``, ``resident_w``: 0 unless given (None samples them,
    as the others).
    """
    func = sch.mod["main"]
    root = sch.get_sblock("root")
    blocks = [(rv, sch.get(rv)) for rv in sch.get_child_blocks(root)]
    out_names, m_ext, elementwise, roles = _analyse(func, blocks)
    if tile_n is not None and not elementwise:
        raise ValueError("tile_n tiles columns: only for clusters of 2-D elementwise ops")
    tm = knob(sch, tile_m, tile_candidates(m_ext, ROW_TILES), "tile_m")
    tn = None
    if elementwise:
        n_ext = int(blocks[-1][1].iter_vars[1].dom.extent)
        tn = knob(sch, tile_n, tile_candidates(n_ext), "tile_n")
    slots_in = slots_in if isinstance(slots_in, dict) else {n: slots_in for n in roles}
    row_inputs = [n for n, (role, _, _) in roles.items() if role == "row"]
    slot_knobs = {n: knob(sch, slots_in.get(n), [1, 2], f"slots_{n}") for n in row_inputs}
    so = knob(sch, slots_out, [1, 2], "slots_out")
    sch.annotate(root, "npu.dma_split", knob(sch, dma_split, [0, 1], "dma_split"))
    sch.annotate(root, "npu.tcm_fresh", knob(sch, tcm_fresh, [0, 1], "tcm_fresh"))
    sch.annotate(root, "npu.list_schedule", knob(sch, list_schedule, [0, 1], "list_schedule"))
    resident = False
    if any(_op_of(b) == "mma" for _, b in blocks):          # a knob of matmul clusters only
        resident = bool(int(sch.get(knob(sch, resident_w, [0, 1], "resident_w"))))

    # 1. TCM placement: inputs DMA'd in, intermediates in TCM, outputs staged in TCM.
    # A load block lands at the head of the root: resident weights are read last, in
    # reverse, so that they come first and in stage order (each load's DMA issues in the
    # order its MMAs need it)
    order = list(roles.items())
    if resident:
        order = [r for r in order if r[1][0] != "weight"] + \
            [r for r in reversed(order) if r[1][0] == "weight"]
    loads = {}                                   # load block name -> (param, role)
    for name, (role, rv, idx) in order:
        ld = sch.cache_read(rv, idx, TCM)
        loads[sch.get(ld).name_hint] = (name, role)
    stores = {}                                  # store block name -> producer block name
    for rv, blk in blocks:
        dst = blk.writes[0].source.name
        if dst in out_names:
            # a result read after the kernel and inside it (a residual sum the norm reads,
            # a norm output one of the projections after the cut reads): the ops inside
            # read the TCM copy the store reads too, never the DRAM output
            inside = list(sch.get_consumers(rv))
            st = sch.cache_write(rv, 0, TCM, consumer_blocks=inside or None)
            stores[sch.get(st).name_hint] = blk.name_hint
        else:
            sch.set_scope(rv, 0, TCM)

    # 2. one row loop (and column loop) for every block
    outer_i, outer_j = [], []
    for rv in sch.get_child_blocks(root):
        if loads.get(sch.get(rv).name_hint, ("", "row"))[1] != "row":
            continue                              # weights / row-invariant vectors
        loops = sch.get_loops(rv)
        i0, i1 = sch.split(loops[0], [None, tm])
        if tn is not None:
            j0, j1 = sch.split(loops[1], [None, tn])
            sch.reorder(i0, j0, i1, j1)
            outer_j.append(j0)
        outer_i.append(i0)
    if len(outer_i) > 1:
        sch.merge(*outer_i)
    if len(outer_j) > 1:
        sch.merge(*outer_j)
    depth = 1 if tn is None else 2

    # 3. one NPU instruction per block nest
    matmul = matmul or {}
    done = set()
    for rv in sch.get_child_blocks(root):
        blk = sch.get(rv)
        name = blk.name_hint
        if name in done:
            continue
        loops = sch.get_loops(rv)
        op = _op_of(blk)
        if name in loads:
            param, role = loads[name]
            if role == "row":
                annotate_op(sch, loops[depth], "dma", slots=slot_knobs[param])
            elif role == "const":
                annotate_op(sch, loops[0], "dma")
            continue                              # weights: placed with their matmul
        if name in stores:
            annotate_op(sch, loops[depth], "dma")
            continue
        writes_output = name in stores.values()
        if op == "mma":
            done |= _schedule_matmul_stage(sch, rv, loops[depth:], loads, stores,
                                           matmul.get(name[:-len("_acc")], {}), so,
                                           resident)
        elif op in W.ROPE_OPS:
            head_dim = int(blk.annotations["npu.head_dim"])
            h, d = sch.split(loops[depth + 1], [None, head_dim])
            sch.reorder(h, loops[depth], d)
            annotate_op(sch, loops[depth], op, slots=so if writes_output else None)
        elif op.startswith("vector:"):
            annotate_op(sch, loops[depth], op, slots=so if writes_output else None)
        else:
            raise CandidateRejected(f"block {name!r} has no npu.op annotation")
    return sch


def _first_loop_below(sch, block, anchor):
    """The outermost loop of ``block``'s own nest under ``anchor`` (compute_at drops
    unit loops, so the nest's depth is not fixed)."""
    loops = sch.get_loops(block)
    at = next(k for k, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(anchor)))
    return loops[at + 1]


def _check_before(sch, load, consumer) -> None:
    """A resident weight's load block must precede the MMA that reads it among the root's
    blocks (program order): the lowering orders DMAs and their readers by it."""
    names = [sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))]
    ld, mma = sch.get(load).name_hint, sch.get(consumer).name_hint
    if ld not in names or mma not in names or names.index(ld) > names.index(mma):
        raise CandidateRejected(f"resident weights: the load {ld} does not precede {mma}")


def _schedule_matmul_stage(sch, blk, loops, loads, stores, knobs: dict, slots_out,
                           resident: bool = False) -> set:
    """Tile one matmul of a cluster (``i1, j, k`` under the row loop) like
    ``gemm.schedule_matmul``; returns the names of the blocks it scheduled. ``resident``:
    its weight loads stay at the root (one DMA each, before the row loop)."""
    info = sch.get(blk)
    i1, j, k = loops
    n_ext, k_ext = int(sch.get(j).extent), int(sch.get(k).extent)
    stage = info.name_hint[:-len("_acc")]
    scales = [r.source for r in info.reads[1:] if str(r.source.dtype) != "uint8"]
    group = k_ext // int(scales[0].shape[1]) if any(
        str(r.source.dtype) == "uint8" for r in info.reads) else 0
    k_cands = tile_candidates(k_ext)
    if group:
        k_cands = [c for c in k_cands if c % group == 0] or [k_ext]
    tn = knob(sch, knobs.get("tile_n"), tile_candidates(n_ext), f"{stage}.tile_n")
    tk = knob(sch, knobs.get("tile_k"), k_cands, f"{stage}.tile_k")
    sw = knob(sch, knobs.get("slots_w"), [1, 2], f"{stage}.slots_w")
    sc = knob(sch, knobs.get("slots_c"), [1, 2], f"{stage}.slots_c")
    j0, j1 = sch.split(j, [None, tn])
    k0, k1 = sch.split(k, [None, tk])
    sch.reorder(j0, k0, i1, j1, k1)
    scheduled = {info.name_hint}
    for r in info.reads[1:]:
        ld = sch.get_producers(blk)
        ld = [b for b in ld if sch.get(b).name_hint in loads and
              sch.get(b).writes[0].source.same_as(r.source)]
        if not ld:
            continue
        if resident:
            _check_before(sch, ld[0], blk)
            annotate_op(sch, sch.get_loops(ld[0])[0], "dma")
            scheduled.add(sch.get(ld[0]).name_hint)
            continue
        sch.compute_at(ld[0], k0)
        annotate_op(sch, _first_loop_below(sch, ld[0], k0), "dma", slots=sw)
        scheduled.add(sch.get(ld[0]).name_hint)
    annotate_op(sch, i1, "mma", slots=sc)     # the accumulator tile: cast j overlaps mma j+1
    (cast,) = sch.get_consumers(blk)
    sch.reverse_compute_at(cast, j0)
    cast_name = sch.get(cast).name_hint
    store = [s for s, p in stores.items() if p == cast_name]
    annotate_op(sch, _first_loop_below(sch, cast, j0), "vector:cast",
                slots=slots_out if store else None)
    scheduled.add(cast_name)
    if store:
        st = sch.get_sblock(store[0])
        sch.reverse_compute_at(st, j0)
        annotate_op(sch, _first_loop_below(sch, st, j0), "dma")
        scheduled.add(store[0])
    return scheduled


# -- the clusters of a transformer layer ------------------------------------------------
def w4_tensors(name: str, n: int, k: int, group: int, zeros: str | None = None) -> dict:
    """The packed weight and group scales (and zero points of dtype ``zeros``: "uint8" or
    "float16") of an (n, k) W4A16 linear."""
    t = {f"{name}_w": ((n, k // 2), "uint8"), f"{name}_s": ((n, k // group), "float16")}
    if zeros is not None:
        t[f"{name}_z"] = ((n, k // group), zeros)
    return t


def norm_qkv_rope_cluster(m: int, hidden: int, n_q: int, n_kv: int, head_dim: int,
                          group: int = 32, eps: float = 1e-5) -> FusionCluster:
    """RMSNorm -> q/k/v projections (W4A16) -> RoPE on q and k: the attention prologue."""
    t = {"x": ((m, hidden), "float16"), "norm_w": ((hidden,), "float16"),
         "cos": ((m, head_dim), "float16"), "sin": ((m, head_dim), "float16")}
    for p, heads in (("q", n_q), ("k", n_kv), ("v", n_kv)):
        t.update(w4_tensors(p, heads * head_dim, hidden, group))
    stages = [Stage("rms_norm", ("x", "norm_w"), "xn", {"eps": eps})]
    stages += [Stage("linear_w4a16", ("xn", f"{p}_w", f"{p}_s"), f"{p}_lin") for p in "qkv"]
    stages += [Stage("rope", (f"{p}_lin", "cos", "sin"), f"{p}_rot", {"head_dim": head_dim})
               for p in "qk"]
    consts = ("norm_w",) + tuple(n for n in t if n[:2] in ("q_", "k_", "v_"))
    return FusionCluster("norm_qkv_rope", t, stages, ("q_rot", "k_rot", "v_lin"), consts)


def mlp_cluster(m: int, hidden: int, inter: int, group: int = 32,
                zeros: str | None = None) -> FusionCluster:
    """gate/up projections (W4A16) -> SiLU(gate) * up -> down projection; ``zeros``: the
    dtype of the W4 zero points ("uint8", "float16"), None for none (8)."""
    t = {"x": ((m, hidden), "float16")}
    t.update(w4_tensors("gate", inter, hidden, group, zeros))
    t.update(w4_tensors("up", inter, hidden, group, zeros))
    t.update(w4_tensors("down", hidden, inter, group, zeros))

    def w4(p):
        return tuple(n for n in (f"{p}_w", f"{p}_s", f"{p}_z") if n in t)
    stages = [Stage("linear_w4a16", ("x",) + w4("gate"), "gate"),
              Stage("linear_w4a16", ("x",) + w4("up"), "up"),
              Stage("silu_mul", ("gate", "up"), "act"),
              Stage("linear_w4a16", ("act",) + w4("down"), "down")]
    return FusionCluster("mlp", t, stages, ("down",), tuple(n for n in t if n != "x"))
