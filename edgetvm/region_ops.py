"""What a recognised region computes, read off its composite function.

The annotation passes say *that* a region is a linear, an MLP or a norm; the NPU kernel
also needs to know *which* of the region's arguments is the weight, the bias, the gate
projection or the norm's gain. Argument order is first-use order after pattern fusion, so
it differs between exporters; these helpers find each role by walking the function.
"""
from __future__ import annotations

from dataclasses import dataclass

import re

import numpy as np
import tvm
from tvm import relax

from edgetvm.relax_passes._fusion import bindings_of as bindings
from edgetvm.relax_passes._fusion import depends_on

_CALL_TIR = "relax.call_tir"
#: ops that only an activation function uses inside an MLP region
ACTIVATION_OPS = frozenset({"relax.sigmoid", "relax.nn.silu", "relax.tanh", "relax.erf",
                            "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.relu"})


def op_name(value) -> str:
    return value.op.name if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) \
        else ""


def param_index(func, expr) -> int | None:
    for i, p in enumerate(func.params):
        if p.same_as(expr):
            return i
    return None


@dataclass
class Linear:
    """One projection inside a region: ``y = x @ W (+ b)`` in float, or the W4A16 kernel.

    Indices are positions in the region's argument list (``Region.args``)."""

    matmul: relax.Var        # the binding of the product (before the bias)
    out: relax.Var           # the binding of the result (after the bias, if any)
    inp: relax.Expr          # the activation operand
    weight: int              # float W (K, N), or the packed uint8 (N, blocks, G/2)
    bias: int | None = None
    scales: int | None = None
    zeros: int | None = None
    zero_kind: str = "none"  # W4A16: none | uint4 | float
    group: int = 0

    @property
    def w4(self) -> bool:
        return self.scales is not None


def linears(region) -> list:
    """The region's projections in program order; ValueError if one has a form the NPU
    kernels do not take (a weight that is not a region constant, say)."""
    func, defs = region.func, bindings(region.func)
    uses: dict = {}
    for var, value in defs.items():
        for a in getattr(value, "args", ()):
            for leaf in (a.fields if isinstance(a, relax.Tuple) else (a,)):
                if isinstance(leaf, relax.Var):
                    uses.setdefault(leaf, []).append(var)
    found = []
    w4_calls = iter(region.callees)
    for var, value in defs.items():
        name = op_name(value)
        if name == "relax.matmul":
            w = param_index(func, value.args[1])
            if w is None or region.args[w] is None or np.ndim(region.args[w]) != 2:
                continue                       # not a projection (attention's q @ k^T)
            lin = Linear(var, var, value.args[0], w)
        elif name == _CALL_TIR:
            attrs = next(w4_calls)
            if attrs.get("edgetvm.op") != "linear_w4a16":
                raise ValueError(f"call_tir to {attrs.get('edgetvm.op')!r}")
            idx = [param_index(func, a) for a in value.args[1].fields[1:]]
            if any(i is None or region.args[i] is None for i in idx):
                raise ValueError("W4A16 weights are not region constants")
            kind = str(attrs.get("edgetvm.zero_point_kind", "none"))
            lin = Linear(var, var, value.args[1].fields[0], idx[0], scales=idx[1], zero_kind=kind,
                         group=int(attrs["edgetvm.group_size"]))
            rest = idx[2:]
            if kind != "none":
                lin.zeros, rest = rest[0], rest[1:]
            if int(attrs.get("edgetvm.has_bias", 0)):
                lin.bias = rest[0]
            found.append(lin)
            continue
        else:
            continue
        # a float projection's bias: the only use of the product is ``+ b`` with b (N,)
        n = int(np.shape(region.args[lin.weight])[-1])
        users = uses.get(var, [])
        if len(users) == 1 and op_name(defs[users[0]]) == "relax.add":
            other = [a for a in defs[users[0]].args if not a.same_as(var)]
            b = param_index(func, other[0]) if len(other) == 1 else None
            if b is not None and region.args[b] is not None and \
                    np.shape(region.args[b]) in ((n,), (1, n)):
                lin.bias, lin.out = b, users[0]
        found.append(lin)
    return found


def activation_input(region):
    """The value the region's activation function is applied to: the first activation op's
    operand, through the scalings before it (GELU spelled ``x * (1 + erf(x / sqrt(2))) /
    2`` applies ``erf`` to ``x / sqrt(2)``)."""
    defs = bindings(region.func)
    for value in defs.values():
        if op_name(value) in ACTIVATION_OPS:
            x = value.args[0]
            while x in defs and op_name(defs[x]) in ("relax.divide", "relax.multiply") and \
                    region_constant(region, defs[x].args[1]) is not None:
                x = defs[x].args[0]
            return x
    raise ValueError("no activation op in the region")


def region_constant(region, expr):
    """The value of a region parameter bound to a constant, or of a constant; None for
    anything else."""
    i = param_index(region.func, expr)
    if i is not None and region.args[i] is not None:
        return region.args[i]
    if isinstance(expr, tvm.ir.expr.Constant):
        return expr.data.numpy()
    return None


def unpack_uint4_zero_points(packed: np.ndarray, blocks: int) -> np.ndarray:
    """MatMulNBits' packed zero points (N, ceil(blocks / 2)) uint8, two per byte, the even
    block in the low nibble -> (N, blocks) uint8."""
    z = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    z[:, 0::2] = packed & 0x0F
    z[:, 1::2] = packed >> 4
    return np.ascontiguousarray(z[:, :blocks])


_PASS_THROUGH = {"relax.reshape", "relax.permute_dims", "relax.expand_dims",
                 "relax.broadcast_to", "relax.multiply", "relax.astype"}


def attention_roles(func) -> dict:
    """Which parameters of an attention region are q, k, v (and the additive mask, if the
    region adds one): trace the operands of its two matmuls (``q @ k^T``, then ``p @ v``)
    back through layout ops and scalings."""
    params = {p: i for i, p in enumerate(func.params)}
    defs = bindings(func)
    matmuls = [(var, v) for var, v in defs.items() if op_name(v) == "relax.matmul"]

    def tensor_arg(v):
        # the operand that carries the data (not a scalar scale, not a shape)
        for a in v.args:
            if isinstance(a, relax.Var) and getattr(a.ty, "ndim", 0) >= 2:
                return a
        raise ValueError("attention region: cannot trace its q/k/v inputs")

    def source(e, through=_PASS_THROUGH):
        while e not in params:
            v = defs.get(e)
            if op_name(v) not in through:
                raise ValueError("attention region: cannot trace its q/k/v inputs")
            e = tensor_arg(v)
        return params[e]
    if len(matmuls) != 2:
        raise ValueError(f"attention region with {len(matmuls)} matmuls (expected 2)")
    (scores, qk), (_, pv) = matmuls
    roles = {"q": source(qk.args[0]), "k": source(qk.args[1]), "v": source(pv.args[1])}
    for v in defs.values():
        if op_name(v) == "relax.add" and any(depends_on(defs, a, scores) for a in v.args):
            other = [a for a in v.args if not depends_on(defs, a, scores)]
            if other:
                roles["mask"] = source(other[0], _PASS_THROUGH | {"relax.strided_slice"})
            break
    return roles


def _trace_to_param(func, defs, expr, through) -> int:
    """The parameter ``expr`` is computed from through ``through`` ops (first tensor
    operand at each step)."""
    while param_index(func, expr) is None:
        value = defs.get(expr)
        if op_name(value) not in through:
            raise ValueError(f"cannot trace {expr} to a region parameter")
        expr = value.args[0]
    return param_index(func, expr)


def rope_roles(func) -> dict:
    """Parameters of a RoPE region: ``x`` (the tensor whose heads rotate), ``cos``, ``sin``.

    The rotation is ``x * cos + rot(x) * sin``: of the two products, the one with the
    rotated operand multiplies ``sin``. ``rot(x)`` ends in a concat (``rotate_half``) or
    in a reshape of one (``rotate_pairs``, a stack flattened)."""
    defs = bindings(func)
    layout = {"relax.reshape", "relax.permute_dims", "relax.expand_dims",
              "relax.broadcast_to", "relax.astype", "relax.strided_slice"}

    def rotated(expr) -> bool:
        value = defs.get(expr)
        if op_name(value) == "relax.reshape":
            value = defs.get(value.args[0])
        return op_name(value) == "relax.concat"

    for value in defs.values():
        if op_name(value) != "relax.add":
            continue
        prods = [defs.get(a) for a in value.args]
        if not all(op_name(p) == "relax.multiply" for p in prods):
            continue
        roles = {}
        for p in prods:
            a, b = p.args
            if rotated(b):
                a, b = b, a
            if rotated(a):
                roles["sin"] = _trace_to_param(func, defs, b, layout)
            else:
                roles["x"] = _trace_to_param(func, defs, a, layout)
                roles["cos"] = _trace_to_param(func, defs, b, layout)
        if set(roles) == {"x", "cos", "sin"}:
            return roles
    raise ValueError("no rotary rotation in the region")


def rope_stage_attrs(region) -> dict:
    """The ``rope`` stage's attributes for a RoPE region: the rotated width per head and,
    for the GPT-J form, ``pairs``."""
    attrs = {"head_dim": int(region.attrs["edgetvm.rotary_dim"])}
    if region.attrs.get("edgetvm.style") == "rotate_pairs":
        attrs["pairs"] = True
    return attrs


def rope_heads_axis(region) -> int:
    """1 when the region's output is (b, h, s, d), 2 when it is token-major (b, s, h, d)
    (``AnnotateRoPE``)."""
    return int(region.attrs.get("edgetvm.heads_axis", "1"))


def rope_dims(region, out_shape) -> tuple:
    """(b, heads, s, d) of a RoPE region's output shape, in either layout."""
    b, x, y, d = out_shape
    return (b, x, y, d) if rope_heads_axis(region) == 1 else (b, y, x, d)


def bind_dims(func, positions, args) -> dict:
    """Symbolic dimension -> value, read off the runtime arguments' shapes (tensors and
    shape values) against the parameter types of ``func``."""
    env = {}
    for pos, arg in zip(positions, args):
        ty = func.params[pos].ty
        values = getattr(ty, "values", None) if isinstance(ty, relax.ShapeType) else \
            (getattr(ty.shape, "values", None) if isinstance(ty, relax.TensorType) and
             ty.shape is not None else None)
        actual = tuple(arg.shape) if hasattr(arg, "shape") else tuple(int(v) for v in arg)
        if values is None or len(values) != len(actual):
            continue
        for expr, v in zip(values, actual):
            if isinstance(expr, tvm.tirx.Var):
                env[expr] = int(v)
    return env


def eval_shape(values, env) -> tuple:
    """A Relax shape (tirx expressions) with the symbolic dimensions of ``env``."""
    analyzer = tvm.sym.Analyzer()
    for var, v in env.items():
        analyzer.bind(var, tvm.tirx.IntImm(str(var.ty.dtype), v))
    out = []
    for e in values:
        e = analyzer.simplify(e)
        if not isinstance(e, tvm.tirx.IntImm):
            raise ValueError(f"dimension {e} is not known from the region's inputs")
        out.append(int(e))
    return tuple(out)


def result_shapes(func, positions, args) -> list:
    """Shapes of the region's results for these runtime arguments (one per tuple field)."""
    env = bind_dims(func, positions, args)
    ret = func.ret_ty
    fields = ret.fields if isinstance(ret, relax.TupleType) else [ret]
    return [eval_shape(f.shape.values, env) for f in fields]


def result_dtypes(func) -> list:
    """Dtypes of the region's results (one per tuple field): the model's own float
    width (float32, or float16 in a float16 export), whatever the NPU computed in."""
    ret = func.ret_ty
    fields = ret.fields if isinstance(ret, relax.TupleType) else [ret]
    return [str(f.dtype) for f in fields]


def past_input(region) -> tuple:
    """(layer, "key" | "value", runtime arg position) of a KV-append region's past input
    (``past_key_values_<n>_key`` at the call site)."""
    for k, pos in enumerate(region.runtime_positions):
        m = re.fullmatch(r"past_key_values_(\d+)_(key|value)", region.arg_names[pos] or "")
        if m:
            return int(m.group(1)), m.group(2), k
    raise ValueError(f"KV append region {region.index} does not read a past_key_values input")


def mask_scale(region) -> float:
    """What an attention region multiplies its additive mask by (CodeGen adds the mask
    before it scales the scores: the mask the softmax sees is the mask times the scale)."""
    return float(region.attrs.get("edgetvm.mask_scale", "1"))


def softcap(region) -> float | None:
    """The cap of an attention region's soft-capped scores, ``cap * tanh(scale * q @
    k^T)`` (Gemma-2), or None where the scores are not capped."""
    cap = region.attrs.get("edgetvm.softcap")
    return None if cap is None else float(cap)


def causal_mask_problem(mask, pos: int, s: int) -> str | None:
    """What is wrong with an additive attention ``mask`` (..., s, pos + s) as the causal
    mask of queries at ``pos..pos + s - 1`` (0 where key j <= the query's position, <= -1e4
    elsewhere), or None when it is that mask."""
    total = pos + s
    if np.shape(mask)[-2:] != (s, total):
        return f"mask of shape {np.shape(mask)}, expected (..., {s}, {total})"
    m, behind = _rows_and_distances(mask, pos, s)
    visible = behind >= 0
    if np.all(m[:, visible] == 0) and np.all(m[:, ~visible] <= -1e4):
        return None
    window = sliding_window(m, behind)
    if window is not None:
        return (f"the model masks keys more than {window - 1} positions behind the query (a "
                f"sliding window of {window} tokens), not the causal mask alone")
    return ("the model adds a bias that is not the causal mask (padding, or a position "
            "bias other than ALiBi's); the NPU attention kernel masks by causality and adds "
            "ALiBi's bias only")


def mask_window(mask, pos: int, s: int) -> int | None:
    """The sliding window of an additive attention ``mask`` (..., s, pos + s) of queries at
    ``pos..``: ``w`` when it is causal and hides every key ``w`` or more positions behind
    its query, else None (causal, another bias, or not a mask of that shape)."""
    if np.shape(mask)[-2:] != (s, pos + s):
        return None
    return sliding_window(*_rows_and_distances(mask, pos, s))


def _rows_and_distances(mask, pos: int, s: int):
    """The mask as (..., s, pos + s) rows and each (query, key)'s query - key."""
    m = np.asarray(mask).reshape(-1, np.shape(mask)[-2], np.shape(mask)[-1])
    behind = (pos + np.arange(s))[:, None] - np.arange(pos + s)[None, :]
    return m, behind


def sliding_window(m, behind) -> int | None:
    """The window ``w`` when the mask ``m`` (..., s, total) is causal with every key ``w`` or
    more positions behind its query masked too (``behind``: query - key), else None."""
    hidden = behind < 0
    if not np.all(m[:, hidden] <= -1e4):
        return None
    masked = np.all(m <= -1e4, axis=0) & ~hidden
    if not masked.any():
        return None
    w = int(behind[masked].min())
    if np.all(m[:, (behind >= 0) & (behind < w)] == 0) and np.all(m[:, behind >= w] <= -1e4):
        return w
    return None


def alibi_slopes(mask, pos: int, s: int) -> np.ndarray | None:
    """ALiBi's slope per head when the additive ``mask`` (..., heads or 1, s, pos + s) of
    queries at ``pos..`` is the causal mask plus ``slope[h] * (key - query)`` (Press et al.
    2022: MPT, BLOOM), up to a constant per row, which the softmax cancels (MPT's bias is
    0 at the last key, BLOOM's at the first); else None. Hidden keys must be at least 1e4
    below the row's visible maximum; visible ones within fp32 rounding of the line. The
    slopes are fitted on the key distances this mask has (with one key, any fits: 0)."""
    total = pos + s
    if np.shape(mask)[-2:] != (s, total):
        return None
    m, behind = _rows_and_distances(np.asarray(mask, np.float64), pos, s)
    visible = behind >= 0
    if not np.all(np.isfinite(m[:, visible])):
        return None
    if total < 2:               # one key: any bias on it is a constant, any slope fits
        return np.zeros(m.shape[0], np.float32)
    diag = m[:, np.arange(s), pos + np.arange(s)][:, :, None]       # behind == 0
    rel = np.where(visible, m - diag, 0.0)                            # slope * (key - query)
    dist = np.where(visible, -behind, 0).astype(np.float64)
    slopes = (rel * dist).sum(axis=(1, 2)) / (dist * dist).sum()
    fit = slopes[:, None, None] * dist
    tol = 1e-5 * max(1.0, float(np.abs(m[:, visible]).max()))
    if np.abs(np.where(visible, rel - fit, 0.0)).max() > tol:
        return None
    top = np.where(visible, m, -np.inf).max(axis=2, keepdims=True)
    if not np.all(np.where(visible, -np.inf, m - top) <= -1e4):
        return None
    # a leading batch axis of 1: one slope per head (or one for every head)
    heads = np.shape(mask)[-3] if np.ndim(mask) >= 3 else 1
    if slopes.size != heads:
        return None
    return slopes.astype(np.float32)


def mask_terms(mask, pos: int, s: int, heads: int) -> tuple:
    """What the attention kernel adds to causality for the additive ``mask`` (..., s,
    pos + s) of queries at ``pos..``: ``(slopes, window)``, ALiBi's slope per head
    (:func:`mask_bias`) or None, and the sliding window (:func:`mask_window`) or None;
    raises ValueError naming what else the mask is."""
    try:
        return mask_bias(mask, pos, s, heads), None
    except ValueError:
        window = mask_window(mask, pos, s)
        if window is None:
            raise
        return None, window


def mask_bias(mask, pos: int, s: int, heads: int) -> np.ndarray | None:
    """What the attention kernel must do for the additive ``mask`` (..., s, pos + s) of
    queries at ``pos..``: None when it is the causal mask, ALiBi's slope per head (``heads``
    of them) when it is the causal mask plus ALiBi's bias; raises ValueError naming what
    else it is (:func:`causal_mask_problem`)."""
    problem = causal_mask_problem(mask, pos, s)
    if problem is None:
        return None
    slopes = alibi_slopes(mask, pos, s)
    if slopes is None or sliding_window(*_rows_and_distances(mask, pos, s)) is not None:
        raise ValueError(problem)
    if slopes.size not in (1, heads):
        raise ValueError(f"the mask has {slopes.size} heads, the attention {heads}")
    if not slopes.any():        # a constant per row only: the causal mask to the softmax
        return None
    return np.broadcast_to(slopes, (heads,)).astype(np.float32)
