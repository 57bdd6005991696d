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
from tvm import s_tir

from edgetvm.errors import CandidateRejected, EdgeTVMError
from edgetvm.tir_schedules.fused import (FusionCluster, Stage, knob_names, lower_cluster,
                                         schedule_cluster)

F16 = "float16"


def _fit_knobs(m: int, matmuls: dict) -> list:
    """Default (untuned) knob sets, largest tiles first; the first that fits TCM is used."""
    out = []
    for tm, scale in ((min(m, 32), 1), (min(m, 16), 2), (min(m, 8), 4), (min(m, 4), 8)):
        mm = {}
        for stage, (n, k, group) in matmuls.items():
            tk = k if k <= 2048 else 1024
            tk = max(group or 2, tk // scale)
            if group:
                tk -= tk % group
            mm[stage] = dict(tile_n=max(16, min(n, 256 // scale)), tile_k=min(k, tk),
                             slots_w=2, slots_c=2)
        out.append(dict(tile_m=tm, slots_in=2, slots_out=2, dma_split=1, matmul=mm))
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
            for knobs in _fit_knobs(m, matmuls):
                if elementwise:       # 2-D elementwise clusters also tile their columns
                    knobs["tile_n"] = int(cluster.tensors["x"][0][-1])
                # a fixed seed: every knob is given, and the result must not vary by run
                sch = s_tir.Schedule(tvm.IRModule({"main": func}), seed=1)
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


def _w4_pack(packed, scales, n_to: int | None = None):
    """MatMulNBits (N, blocks, block/2) uint8 + (N, blocks) scales -> the NPU's W (N, K'/2)
    and S (N, K'/G) fp16 with K' = blocks * G (a partial last block is zero-padded by the
    quantizer; the activation is padded with zeros to match). ``n_to`` pads output rows
    with zero scales (their outputs are exactly 0)."""
    n = packed.shape[0]
    w = np.ascontiguousarray(packed.reshape(n, -1))
    sc = np.asarray(scales, np.float32).reshape(n, -1).astype(F16)
    if n_to is not None and n_to > n:
        w = np.concatenate([w, np.zeros((n_to - n, w.shape[1]), np.uint8)])
        sc = np.concatenate([sc, np.zeros((n_to - n, sc.shape[1]), F16)])
    return w, sc


def _w4_group(attrs, prefix="") -> int:
    return int(attrs.get(f"edgetvm.{prefix}group_size", "0") or 0)


def build_cluster(region, shapes: list):
    """FusionCluster + consts + matmul shapes for a region, given its runtime arg shapes.

    Only called for regions :func:`offloadable` accepted."""
    kind, a, attrs = region.kind, region.args, region.attrs
    x_shape = shapes[0]
    m, h = rows_of(x_shape), int(x_shape[-1])
    t = {"x": ((m, h), F16)}
    if kind in ("linear", "lm_head") and _is_w4(attrs):
        g = _w4_group(attrs)
        w, sc = _w4_pack(*_w4_pairs(a)[0])
        n, kp = w.shape[0], w.shape[1] * 2
        t = {"x": ((m, kp), F16), "w": (w.shape, "uint8"), "s": (sc.shape, F16)}
        stages = [Stage("linear_w4a16", ("x", "w", "s"), "y")]
        return FusionCluster(kind, t, stages, ("y",), ("w", "s")), {"w": w, "s": sc}, \
            {"y": (n, kp, g)}, m
    if kind in ("linear", "lm_head"):
        w = np.asarray(a[1], dtype=np.float32)
        k, n = w.shape
        t["w"] = ((n, k), F16)
        stages = [Stage("linear_fp16", ("x", "w"), "y")]
        return FusionCluster(kind, t, stages, ("y",), ("w",)), \
            {"w": np.ascontiguousarray(w.T.astype(F16))}, {"y": (n, k, 0)}, m
    if kind == "mlp" and _is_w4(attrs, "gate_"):
        g = _w4_group(attrs, "gate_")
        (pg, qg), (pu, qu), (pd, qd) = _w4_pairs(a)
        wd, sd = _w4_pack(pd, qd)
        inter = wd.shape[1] * 2                      # the down projection's padded K
        wg, sg = _w4_pack(pg, qg, inter)
        wu, su = _w4_pack(pu, qu, inter)
        consts = {"wg": wg, "sg": sg, "wu": wu, "su": su, "wd": wd, "sd": sd}
        t.update({n: (v.shape, str(v.dtype)) for n, v in consts.items()})
        stages = [Stage("linear_w4a16", ("x", "wg", "sg"), "gt"),
                  Stage("linear_w4a16", ("x", "wu", "su"), "up"),
                  Stage("silu_mul", ("gt", "up"), "act"),
                  Stage("linear_w4a16", ("act", "wd", "sd"), "y")]
        mm = {"gt": (inter, h, g), "up": (inter, h, g), "y": (wd.shape[0], inter, g)}
        return FusionCluster("mlp_w4a16", t, stages, ("y",), tuple(consts)), consts, mm, m
    if kind == "mlp":
        consts = {}
        for name, idx in (("wg", 1), ("wu", 2), ("wd", 3)):
            w = np.asarray(a[idx], dtype=np.float32)
            consts[name] = np.ascontiguousarray(w.T.astype(F16))
            t[name] = (consts[name].shape, F16)
        inter = consts["wg"].shape[0]
        stages = [Stage("linear_fp16", ("x", "wg"), "g"), Stage("linear_fp16", ("x", "wu"), "u"),
                  Stage("silu_mul", ("g", "u"), "a"), Stage("linear_fp16", ("a", "wd"), "y")]
        mm = {"g": (inter, h, 0), "u": (inter, h, 0), "y": (h, inter, 0)}
        return FusionCluster("mlp", t, stages, ("y",), ("wg", "wu", "wd")), consts, mm, m
    if kind == "rms_norm":
        eps = float(attrs.get("edgetvm.eps", "1e-5"))
        w = a[-1] if attrs.get("edgetvm.has_weight") == "1" else None
        w = np.ones(h, F16) if w is None or np.ndim(w) == 0 else np.asarray(w, F16).reshape(h)
        t["nw"] = ((h,), F16)
        stages = [Stage("rms_norm", ("x", "nw"), "y", {"eps": eps})]
        return FusionCluster("rms_norm", t, stages, ("y",), ("nw",)), {"nw": w}, {}, m
    if kind == "residual_add":
        t["x2"] = ((m, h), F16)
        return FusionCluster("residual_add", t, [Stage("add", ("x", "x2"), "y")], ("y",), ()), \
            {}, {}, m
    if kind == "rope":
        # x (m, heads * head_dim) rotated with per-row cos/sin (m, head_dim)
        hd = int(shapes[1][-1])
        t.update({"cos": ((m, hd), F16), "sin": ((m, hd), F16)})
        stages = [Stage("rope", ("x", "cos", "sin"), "y", {"head_dim": hd})]
        return FusionCluster("rope", t, stages, ("y",), ()), {}, {}, m
    raise EdgeTVMError(f"no NPU kernel for region kind {kind!r}")


def _is_w4(attrs, prefix="") -> bool:
    return attrs.get(f"edgetvm.{prefix}weight_format") == "w4a16"


def _w4_pairs(args) -> list | None:
    """The region's MatMulNBits weights as (packed uint8 (N, blocks, block/2), scales)
    pairs in argument order; None if there is anything else among its constants (zero
    points, a bias, a float weight). Shape arguments of the glue reshapes are skipped."""
    consts = [a for a in args[1:] if a is not None and np.ndim(a) > 0]
    if len(consts) % 2:
        return None
    pairs = []
    for w, sc in zip(consts[0::2], consts[1::2]):
        if w.dtype != np.uint8 or w.ndim != 3 or sc.dtype.kind != "f" or \
                sc.size != w.shape[0] * w.shape[1]:
            return None
        pairs.append((w, sc))
    return pairs


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
    kind, a, attrs = region.kind, region.args, region.attrs
    if kind in ("linear", "lm_head", "mlp", "residual_add", "rms_norm") and \
            passthrough_outputs(region.func) is None:
        return False
    if kind in ("linear", "lm_head") and _is_w4(attrs):
        return len(_w4_pairs(a) or ()) == 1
    if kind == "mlp" and all(_is_w4(attrs, p) for p in ("gate_", "up_", "down_")):
        return attrs.get("edgetvm.gated") == "1" and attrs.get("edgetvm.activation") == \
            "silu" and len(_w4_pairs(a) or ()) == 3
    if kind in ("linear", "lm_head"):
        return attrs.get("edgetvm.weight_format", "float32") in ("float32", "float16") and \
            len(a) == 2 and a[1] is not None and np.ndim(a[1]) == 2
    if kind == "mlp":
        return attrs.get("edgetvm.gated") == "1" and attrs.get("edgetvm.activation") == "silu" \
            and len(a) == 4 and all(v is not None and np.ndim(v) == 2 for v in a[1:]) \
            and "w4a16" not in {attrs.get(f"edgetvm.{p}_weight_format") for p in
                                ("gate", "up", "down")}
    if kind == "rms_norm":
        return len(region.runtime_positions) == 1
    if kind == "residual_add":
        return len(region.runtime_positions) == 2
    if kind == "embedding":
        tables = [v for v in a if v is not None and np.ndim(v) == 2 and v.dtype.kind == "f"]
        return len(tables) == 1
    if kind == "kv_append":            # must read a past_key_values input (with-past export)
        return any(n and n.startswith("past_key_values_") for n in region.arg_names)
    if kind == "rope":
        return region.attrs.get("edgetvm.style") == "rotate_half"
    if kind == "attention":
        return region.attrs.get("edgetvm.merges_heads") == "1"
    return False
