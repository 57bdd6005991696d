"""NPU kernels for the recognised regions of an LLM graph.

Each region kind maps to a fusion cluster (``tir_schedules/fused.py``: a chain of ops
compiled into ONE kernel with its intermediates in TCM), scheduled with untuned default
knobs, lowered to a command-stream program and run on the emulated NPU. Weights are packed
once, at compile time (fp16, or W4A16 when the graph carries 4-bit weights); activations
cross region boundaries in fp16, as they sit in the NPU's DRAM.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax

from edgetvm.errors import CandidateRejected, EdgeTVMError
from edgetvm.relax_passes._fusion import function_outputs
from edgetvm.tir_schedules.common import new_schedule
from edgetvm.tir_schedules.fused import (FusionCluster, Stage, knob_names, lower_cluster,
                                         schedule_cluster)

from .region_ops import (activation_input, attention_roles, bindings, depends_on, linears, op_name,
                         param_index, region_constant, rope_stage_attrs,
                         unpack_uint4_zero_points)

F16 = "float16"


def default_knobs(m: int, matmuls: dict) -> list:
    """Default (untuned) knob sets, largest tiles first; the first that fits TCM is used."""
    out, seen = [], set()
    # row tiles as tall as the TCM allows first: every row tile streams the whole weight
    # matrix once, so a prefill of m rows in tiles of 32 reads its weights m / 32 times
    for tm, scale in ((min(m, 512), 1), (min(m, 256), 1), (min(m, 128), 1), (min(m, 64), 1),
                      (min(m, 32), 1), (min(m, 16), 2), (min(m, 8), 4), (min(m, 4), 8)):
        if (tm, scale) in seen:
            continue
        seen.add((tm, scale))
        mm = {}
        for stage, (n, k, group) in matmuls.items():
            tk = k if k <= 2048 else 1024
            tk = max(group or 2, tk // scale)
            if group:
                tk -= tk % group
            mm[stage] = dict(tile_n=max(16, min(n, 256 // scale)), tile_k=min(k, tk),
                             slots_w=2, slots_c=2)
        out.append(dict(tile_m=tm, slots_in=2, slots_out=2, dma_split=1, tcm_fresh=1,
                        matmul=mm))
    return out


@dataclasses.dataclass
class Kernel:
    """A lowered program plus how to bind a region's arrays to it."""

    program: object
    inputs: tuple          # program input names, in the order of the region's runtime args
    output: str


class KernelCache:
    """Programs by (cluster structure, shapes): every layer's linear of the same shape
    shares one lowering; its weights are swapped in as the program's const tensors."""

    def __init__(self, spec):
        self.spec = spec
        self._programs: dict = {}
        self.lowered = 0

    def build(self, cluster: FusionCluster, consts: dict, matmuls: dict, m: int):
        key = (repr(cluster.tensors), repr(cluster.stages), cluster.outputs)
        base = self._programs.get(key)
        if base is None:
            zeros = {n: np.zeros(cluster.tensors[n][0], cluster.tensors[n][1])
                     for n in cluster.consts}
            err = None
            func = cluster.prim_func()
            elementwise = "tile_n" in knob_names(func)
            for knobs in default_knobs(m, matmuls):
                if elementwise:       # 2-D elementwise clusters also tile their columns
                    knobs["tile_n"] = int(cluster.tensors["x"][0][-1])
                # a fixed seed: every knob is given, and the result must not vary by run
                sch = new_schedule(func, seed=1)
                try:
                    schedule_cluster(sch, **knobs)
                    base = lower_cluster(cluster, sch, self.spec, zeros)
                    break
                except CandidateRejected as e:
                    err = e
            if base is None:
                raise EdgeTVMError(f"no default schedule of {cluster.name} fits "
                                   f"{self.spec.name}: {err}")
            self._programs[key] = base
            self.lowered += 1
        tensors = dict(base.tensors)
        for n, arr in consts.items():
            t = tensors[n]
            tensors[n] = dataclasses.replace(t, data=np.ascontiguousarray(arr, dtype=t.dtype))
        return dataclasses.replace(base, tensors=tensors)


def rows_of(shape) -> int:
    """Rows of an activation viewed as 2-D (all leading dims folded)."""
    return int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1


def _w4_consts(region, lin, n_to: int | None = None) -> dict:
    """MatMulNBits (N, blocks, block/2) uint8 + (N, blocks) scales [+ zero points] -> the
    NPU's W (N, K'/2), S (N, K'/G) fp16 [, Z (N, K'/G): uint8 for uint4 zero points,
    fp16 for float ones] with K' = blocks * G (a partial last block is padded by the
    quantizer; the activation is padded with zeros to match). ``n_to`` pads output rows
    with zero scales (their outputs are 0)."""
    a = region.args
    packed = a[lin.weight]
    n, blocks = packed.shape[0], packed.shape[1]
    out = {"w": np.ascontiguousarray(packed.reshape(n, -1)),
           "s": np.asarray(a[lin.scales], np.float32).reshape(n, blocks).astype(F16)}
    if lin.zero_kind == "uint4":
        out["z"] = unpack_uint4_zero_points(np.asarray(a[lin.zeros]), blocks)
    elif lin.zero_kind == "float":
        out["z"] = np.asarray(a[lin.zeros], np.float32).reshape(n, blocks).astype(F16)
    if n_to is not None and n_to > n:
        out = {k: np.concatenate([v, np.zeros((n_to - n,) + v.shape[1:], v.dtype)])
               for k, v in out.items()}
    return out


def _fits_fp16(values) -> bool:
    """Float zero points that keep their value within fp16 rounding (|z| < 65504)."""
    v = np.asarray(values, np.float32)
    return bool(np.isfinite(v).all() and np.abs(v).max(initial=0.0) < np.finfo(F16).max)


def _memo(region, key, make):
    """A region's packed weights, made once (every length bucket's kernel uses them)."""
    hit = region.cache.get(key)
    if hit is None:
        hit = region.cache[key] = make()
    return hit


def _bias(region, lin, n: int) -> np.ndarray | None:
    if lin.bias is None:
        return None
    b = np.asarray(region.args[lin.bias], np.float32).reshape(-1)
    return np.concatenate([b, np.zeros(n - b.size, np.float32)]).astype(F16)


def _linear_stages(region, lin, x: str, out: str, t: dict, consts: dict, mm: dict,
                   n_to: int | None = None) -> list:
    """Stages (and tensors, consts, matmul shapes) of one projection ``x -> out``: the
    matmul, then the bias add when there is a bias."""
    has_bias = lin.bias is not None
    acc = f"{out}_mm" if has_bias else out
    if lin.w4:
        w4 = _memo(region, ("w4", lin.weight, n_to), lambda: _w4_consts(region, lin, n_to))
        names = {k: f"{out}_{k}" for k in w4}
        for k, v in w4.items():
            consts[names[k]] = v
            t[names[k]] = (v.shape, str(v.dtype))
        n, kp = w4["w"].shape[0], w4["w"].shape[1] * 2
        stages = [Stage("linear_w4a16", (x,) + tuple(names[k] for k in ("w", "s", "z")
                                                     if k in names), acc)]
        mm[acc] = (n, kp, lin.group)
    else:
        def fp16_weight():
            w = np.asarray(region.args[lin.weight], np.float32)
            if n_to is not None and n_to > w.shape[1]:
                w = np.concatenate([w, np.zeros((w.shape[0], n_to - w.shape[1]), np.float32)],
                                   axis=1)
            return np.ascontiguousarray(w.T.astype(F16))
        consts[f"{out}_w"] = _memo(region, ("fp16", lin.weight, n_to), fp16_weight)
        n, k = consts[f"{out}_w"].shape
        t[f"{out}_w"] = ((n, k), F16)
        stages = [Stage("linear_fp16", (x, f"{out}_w"), acc)]
        mm[acc] = (n, k, 0)
    if has_bias:
        consts[f"{out}_b"] = _bias(region, lin, mm[acc][0])
        t[f"{out}_b"] = ((mm[acc][0],), F16)
        stages.append(Stage("bias_add", (acc, f"{out}_b"), out))
    return stages


def _input_width(lin, region) -> int:
    """K of a projection as the NPU kernel sees it (W4A16: whole quantization groups)."""
    if lin.w4:
        packed = region.args[lin.weight]
        return int(packed.shape[1] * packed.shape[2] * 2)
    return int(np.shape(region.args[lin.weight])[0])


def _activation_stage(attrs, gate: str, up: str | None, out: str) -> Stage:
    act = attrs.get("edgetvm.activation")
    if not _has_activation_kernel(act, up is not None):
        raise EdgeTVMError(f"no NPU kernel for {'a gated' if up else 'an ungated'} {act!r} "
                           f"activation")
    approx = {"approximate": "tanh" if act == "gelu_tanh" else "none"}
    if act in ("relu", "relu2"):
        return Stage(act if up is None else f"{act}_mul", (gate,) + ((up,) if up else ()), out)
    if up is None:
        return Stage("gelu", (gate,), out, approx)
    if act == "silu":
        return Stage("silu_mul", (gate, up), out)
    return Stage("gelu_mul", (gate, up), out, approx)


def _mlp_roles(region, lins):
    """(gate, up, down) Linears of an MLP region (gate None when ungated)."""
    defs = bindings(region.func)
    act_in = activation_input(region)
    down = next(lin for lin in lins
                if any(depends_on(defs, lin.inp, o.out) for o in lins if o is not lin))
    rest = [l for l in lins if l is not down]
    if len(rest) == 1:
        return None, rest[0], down
    gate = next(l for l in rest if depends_on(defs, act_in, l.out))
    return gate, next(l for l in rest if l is not gate), down


def build_cluster(region, shapes: list):
    """FusionCluster + consts + matmul shapes for a region, given its runtime arg shapes.

    Only called for regions :func:`offloadable` accepted."""
    kind, attrs = region.kind, region.attrs
    x_shape = shapes[0]
    m, h = rows_of(x_shape), int(x_shape[-1])
    t = {"x": ((m, h), F16)}
    consts, mm = {}, {}
    if kind in ("linear", "lm_head"):
        (lin,) = linears(region)
        t["x"] = ((m, _input_width(lin, region)), F16)
        stages = _linear_stages(region, lin, "x", "y", t, consts, mm)
        return FusionCluster(kind, t, stages, ("y",), tuple(consts)), consts, mm, m
    if kind == "mlp":
        gate, up, down = _mlp_roles(region, linears(region))
        t["x"] = ((m, _input_width(up, region)), F16)
        inter = _input_width(down, region)       # the down projection's (padded) K
        stages = []
        if gate is not None:
            stages += _linear_stages(region, gate, "x", "g", t, consts, mm, n_to=inter)
        stages += _linear_stages(region, up, "x", "u", t, consts, mm, n_to=inter)
        stages.append(_activation_stage(attrs, "g" if gate is not None else "u",
                                        "u" if gate is not None else None, "a"))
        stages += _linear_stages(region, down, "a", "y", t, consts, mm)
        return FusionCluster("mlp", t, stages, ("y",), tuple(consts)), consts, mm, m
    if kind == "activation":
        gated = attrs.get("edgetvm.gated") == "1"
        if gated:
            t["x2"] = ((m, h), F16)
        stage = _activation_stage(attrs, "x", "x2" if gated else None, "y")
        return FusionCluster("activation", t, [stage], ("y",), ()), {}, {}, m
    if kind == "rms_norm":
        eps = float(attrs.get("edgetvm.eps", "1e-5"))
        w = rms_norm_weight(region, h)
        t["nw"] = ((h,), F16)
        stages = [Stage("rms_norm", ("x", "nw"), "y", {"eps": eps})]
        return FusionCluster("rms_norm", t, stages, ("y",), ("nw",)), {"nw": w}, {}, m
    if kind == "layer_norm":
        gamma, beta, eps = layer_norm_params(region)
        consts = {"nw": _per_column(gamma, h, "LayerNorm gain"),
                  "nb": _per_column(beta, h, "LayerNorm bias")}
        t.update({"nw": ((h,), F16), "nb": ((h,), F16)})
        stages = [Stage("layer_norm", ("x", "nw", "nb"), "y", {"eps": eps})]
        return FusionCluster("layer_norm", t, stages, ("y",), ("nw", "nb")), consts, {}, m
    if kind == "residual_add":
        t["x2"] = ((m, h), F16)
        return FusionCluster("residual_add", t, [Stage("add", ("x", "x2"), "y")], ("y",), ()), \
            {}, {}, m
    if kind == "rope":
        # x (m, heads * rotary_dim) rotated with per-row cos/sin (m, rotary_dim)
        hd = int(shapes[1][-1])
        t.update({"cos": ((m, hd), F16), "sin": ((m, hd), F16)})
        stages = [Stage("rope", ("x", "cos", "sin"), "y",
                        {**rope_stage_attrs(region), "head_dim": hd})]
        return FusionCluster("rope", t, stages, ("y",), ()), {}, {}, m
    raise EdgeTVMError(f"no NPU kernel for region kind {kind!r}")


def _per_column(v, h: int, what: str) -> np.ndarray:
    """A norm's gain or bias as ``h`` fp16 values: one per column, or one for all (a scalar
    or a one-element constant broadcasts, as it does in the graph)."""
    v = np.asarray(v, F16)
    if v.size == 1:
        return np.full(h, v.reshape(()), F16)
    if v.size != h:
        raise EdgeTVMError(f"a {what} of shape {v.shape} over {h} columns has no NPU kernel")
    return v.reshape(h)


def rms_norm_weight(region, h: int) -> np.ndarray:
    """The RMSNorm region's weight as ``h`` fp16 values: the constant parameter its result
    is multiplied by (ones where the exporter folded a weight of ones away)."""
    if region.attrs.get("edgetvm.has_weight") != "1":
        return np.ones(h, F16)
    func = region.func
    defs = bindings(func)
    (out,) = function_outputs(func)
    last = defs.get(out)
    consts = [c for c in (region_constant(region, v) for v in last.args) if c is not None] \
        if op_name(last) == "relax.multiply" else []
    if len(consts) != 1:
        raise EdgeTVMError(f"RMSNorm region {region.index}: its weight is not the one "
                           f"constant its last multiply reads")
    return _per_column(consts[0], h, "RMSNorm weight")


def layer_norm_params(region) -> tuple:
    """(gamma, beta, eps) of a layer-norm region over the last axis with constant gain and
    bias: ``relax.nn.layer_norm``, or the decomposed ``(x - mean(x)) / sqrt(mean(c * c) + eps)
    [* gamma] [+ beta]`` (older GPT-2 exports; Cohere's bias-free LayerNorm), whose absent
    gain and bias are ones and zeros. ValueError otherwise."""
    func = region.func
    defs = bindings(func)
    for value in defs.values():
        if op_name(value) == "relax.nn.layer_norm":
            idx = [param_index(func, v) for v in value.args[1:3]]
            if any(i is None or region.args[i] is None for i in idx) or \
                    [int(x) for x in value.attrs.axes] not in ([-1],) or \
                    not (value.attrs.center and value.attrs.scale):
                break
            return region.args[idx[0]], region.args[idx[1]], float(value.attrs.epsilon)
    else:
        return _decomposed_layer_norm_params(region, defs)
    raise ValueError("not a last-axis nn.layer_norm with constant gain and bias")


def _decomposed_layer_norm_params(region, defs) -> tuple:
    """Gain and bias of a decomposed layer norm (``AnnotateLayerNorm`` checked the rest):
    read from the output back, ``add(multiply(normed, gamma), beta)``."""
    h = int(region.attrs["edgetvm.hidden_size"])
    eps = float(region.attrs["edgetvm.eps"])
    params = {"gamma": np.ones(h, np.float32), "beta": np.zeros(h, np.float32)}
    (value,) = [defs[v] for v in function_outputs(region.func)]
    for key, op, present in (("beta", "relax.add", "edgetvm.has_bias"),
                             ("gamma", "relax.multiply", "edgetvm.has_weight")):
        if region.attrs.get(present) != "1":
            continue
        if op_name(value) != op:
            raise ValueError(f"layer norm {key}: not a {op}")
        inner = [a for a in value.args if a in defs]
        outer = [a for a in value.args if a not in defs]
        if len(inner) != 1 or len(outer) != 1:
            raise ValueError(f"layer norm {key}: not one constant operand")
        const = region_constant(region, outer[0])
        if const is None:
            raise ValueError(f"layer norm {key}: not a constant")
        vec = np.asarray(const, np.float32).reshape(-1)
        if vec.size not in (1, h):
            raise ValueError(f"layer norm {key} of {vec.size} values for {h} columns")
        params[key] = np.broadcast_to(vec, (h,))
        value = defs[inner[0]]
    return params["gamma"], params["beta"], eps


def passthrough_outputs(func) -> list | None:
    """For a region that returns ``(reshape(x), y)`` (a linear whose input reshape other
    regions share, as the W4A16 quantizer writes them): [True, False]; for a plain
    single-output region: []; None for any other tuple."""
    from tvm import relax

    ret = func.ret_ty
    if not isinstance(ret, relax.TupleType):
        return []
    defs = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
    out = func.body.body
    flags = []
    for f in getattr(out, "fields", ()):
        v = defs.get(f)
        flags.append(isinstance(v, relax.Call) and getattr(v.op, "name", "") ==
                     "relax.reshape" and v.args[0].same_as(func.params[0]))
    return flags if flags.count(False) == 1 and len(flags) == len(ret.fields) else None


def offloadable(region) -> bool:
    """Can this region run on the NPU? Decided from kind, attributes and constants only
    (shapes may be symbolic); everything else stays on the host."""
    try:
        return _offloadable(region)
    except (ValueError, StopIteration, KeyError, IndexError):
        return False          # a form the kernel builders do not know: the host runs it


def _offloadable(region) -> bool:
    kind, a, attrs = region.kind, region.args, region.attrs
    if kind in ("linear", "lm_head", "mlp", "residual_add", "rms_norm", "layer_norm",
                "activation") and passthrough_outputs(region.func) is None:
        return False
    if kind in ("linear", "lm_head", "mlp"):
        lins = linears(region)
        if len(lins) != {"mlp": 3 if attrs.get("edgetvm.gated") == "1" else 2}.get(kind, 1):
            return False
        if any(lin.zero_kind not in ("none", "uint4", "float") for lin in lins):
            return False
        if any(lin.zero_kind == "float" and not _fits_fp16(a[lin.zeros]) for lin in lins):
            return False       # float32 zero points the NPU's fp16 cannot hold: host
        if any(not lin.w4 and str(np.asarray(a[lin.weight]).dtype) not in
               ("float32", "float16") for lin in lins):
            return False
        if kind == "mlp":
            _mlp_roles(region, lins)
            return _has_activation_kernel(attrs.get("edgetvm.activation"),
                                          attrs.get("edgetvm.gated") == "1")
        return True
    if kind == "activation":
        gated = attrs.get("edgetvm.gated") == "1"
        # gated: the kernel reads the activation's input and the multiplier as two
        # tensors (not one fused projection the region slices in two, as ModernBERT's)
        return _tensor_inputs(region) == (2 if gated else 1) and \
            _has_activation_kernel(attrs.get("edgetvm.activation"), gated) and \
            (not gated or param_index(region.func, activation_input(region)) is not None)
    if kind == "rms_norm":
        return _tensor_inputs(region) == 1
    if kind == "layer_norm":
        layer_norm_params(region)
        return _tensor_inputs(region) == 1
    if kind == "residual_add":
        return _tensor_inputs(region) == 2
    if kind == "embedding":
        # one result: Gemma-3n gathers a second table by the same ids, whose wrap of
        # negative ids the first lookup's region then also returns
        tables = [v for v in a if v is not None and np.ndim(v) == 2 and v.dtype.kind == "f"]
        return len(tables) == 1 and passthrough_outputs(region.func) == []
    if kind == "kv_append":            # must read a past_key_values input (with-past export)
        return any(n and n.startswith("past_key_values_") for n in region.arg_names) and \
            _new_tokens_fit_the_cache(region)
    if kind == "rope":
        return region.attrs.get("edgetvm.style") in ("rotate_half", "rotate_pairs")
    if kind == "attention":
        # the kernel masks by causality: a region without a mask is causal only when it
        # has one query (decode); with a mask, the session checks the mask it is given
        return (merges_heads(region) or keeps_heads(region)) and _softmax_last_axis(region) \
            and ("mask" in attention_roles(region.func) or attrs.get("edgetvm.q_len") == "1")
    return False


#: gated -> the activations with an NPU stage (:func:`_activation_stage`): SiLU only
#: gated (SwiGLU), GELU, ReLU and squared ReLU either way
ACTIVATION_STAGES = {True: ("silu", "gelu", "gelu_tanh", "relu", "relu2"),
                     False: ("gelu", "gelu_tanh", "relu", "relu2")}


def _has_activation_kernel(act, gated: bool) -> bool:
    """Is there an NPU stage for activation ``act`` (:data:`ACTIVATION_STAGES`)?"""
    return act in ACTIVATION_STAGES[bool(gated)]


def missing_activation_kernel(attrs) -> str:
    """What an activation or MLP region with these attributes lacks for an NPU kernel
    (its activation has no stage of the gating it needs), or ''."""
    act = attrs.get("edgetvm.activation")
    if act is None:
        return ""
    act, gated = str(act), str(attrs.get("edgetvm.gated", "")) == "1"
    if _has_activation_kernel(act, gated):
        return ""
    return (f"its {'gated' if gated else 'ungated'} {act!r} activation has no NPU kernel "
            f"(gated: {', '.join(ACTIVATION_STAGES[True])}; "
            f"ungated: {', '.join(ACTIVATION_STAGES[False])})")


def _tensor_inputs(region) -> int:
    """How many runtime inputs of the region are tensors (not the shape values of symbolic
    dimensions: OPT's (batch * seq, hidden) rows pass ``tir_vars``)."""
    return sum(isinstance(region.func.params[p].ty, tvm.relax.TensorType)
               for p in region.runtime_positions)


def _new_tokens_fit_the_cache(region) -> bool:
    """The KV append's new tokens are (b, s, heads * d), (b, s, heads, d), (b, heads, s,
    d) or (b, s, a, c, d) with a * c = heads (CodeGen's heads in ``mp_num`` groups, merged
    by the region's reshape) of the cache's heads and d (what the kernel appends); anything
    else stays on the host, which concatenates it as the model does."""
    tensors = [(static_shape_of(p.ty), bool(n and n.startswith("past_key_values_")))
               for p, n in zip(region.func.params, region.arg_names)
               if isinstance(p.ty, relax.TensorType)]
    past = [sh for sh, is_past in tensors if is_past]
    new = [sh for sh, is_past in tensors if not is_past]
    if len(past) != 1 or len(new) != 1 or len(past[0]) != 4:
        return False
    (_, hk, _, d), new = past[0], new[0]
    if not (isinstance(hk, int) and isinstance(d, int)):
        return False
    if len(new) == 3:
        return new[2] == hk * d
    if len(new) == 5:
        return isinstance(new[2], int) and isinstance(new[3], int) and \
            new[2] * new[3] == hk and new[4] == d
    return len(new) == 4 and new[3] == d and hk in (new[1], new[2])


def static_shape_of(ty) -> list:
    """A tensor type's dims: ints where static, the symbolic expression elsewhere."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return []
    return [int(v) if isinstance(v, tvm.tirx.IntImm) else v for v in shape.values]


def merges_heads(region) -> bool:
    """The attention region's output is (batch, seq, heads * d): heads merged."""
    return region.attrs.get("edgetvm.merges_heads") == "1"


def keeps_heads(region) -> bool:
    """The attention region's output is heads-major (batch, heads, seq, d): the heads are
    merged after it, if at all (Falcon reshapes ``out`` to that same shape first). The
    kernel writes (seq, heads * d); this output is that, transposed (a view in a phase
    program, a transpose on the reference path)."""
    if merges_heads(region):
        return False
    ty = region.func.ret_ty
    shape = getattr(ty, "shape", None)
    values = list(shape.values) if isinstance(shape, relax.ShapeExpr) else None
    if values is None or len(values) != 4:
        return False
    heads, d = (region.attrs.get(f"edgetvm.{a}") for a in ("num_heads", "head_dim"))
    return all(isinstance(v, tvm.tirx.IntImm) for v in (values[1], values[3])) and \
        (str(int(values[1])), str(int(values[3]))) == (str(heads), str(d))


def _softmax_last_axis(region) -> bool:
    return all(int(v.attrs.axis) in (-1, 3) for v in bindings(region.func).values()
               if op_name(v) == "relax.nn.softmax")


def unsound_offloads(regions) -> set:
    """Indices of accepted regions that must stay on the host because of another region's
    decision: an NPU attention reads the KV cache from the device pages, which only NPU
    KV-append regions write; if its K/V come from a KV append that runs on the host, the
    attention runs on the host too (a NPU KV append's ``present`` output carries its data,
    so host consumers of it are sound)."""
    drop = set()
    for r in regions:
        if r.kind != "attention":
            continue
        try:
            roles = attention_roles(r.func)
        except ValueError:
            drop.add(r.index)
            continue
        on_npu = [getattr(r.arg_sources[roles[x]], "kind", None) == "kv_append" for x in "kv"]
        from_append = [r.arg_kinds[roles[x]] == "kv_append" for x in "kv"]
        if from_append != on_npu or len(set(from_append)) != 1:
            drop.add(r.index)
    return drop
