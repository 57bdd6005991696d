"""Tensor-expression definitions of the ops edgetvm schedules onto the NPU.

Each returns a PrimFunc (``te.create_prim_func``) whose block names the templates look up.
Matmuls accumulate in fp32 (block ``C``) and cast to fp16 on the way out (block ``D``);
W4A16 weights stay packed: the dequantisation is part of the matmul block's expression,
so a kernel never writes a dequantised copy of the weights anywhere.
"""
from __future__ import annotations

from tvm import te, tirx


def gemm_fp16(m: int, n: int, k: int, b_layout: str = "kn"):
    """D (m, n) fp16 = A (m, k) fp16 @ B; B is (k, n) or, with ``b_layout="nk"``, (n, k)."""
    a = te.placeholder((m, k), "float16", name="A")
    shape_b = (k, n) if b_layout == "kn" else (n, k)
    b = te.placeholder(shape_b, "float16", name="B")
    r = te.reduce_axis((0, k), name="k")
    if b_layout == "kn":
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") *
                                                   b[r, j].astype("float32"), axis=r), name="C")
    else:
        c = te.compute((m, n), lambda i, j: te.sum(a[i, r].astype("float32") *
                                                   b[j, r].astype("float32"), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype("float16"), name="D")
    return te.create_prim_func([a, b, d])


def dequant_w4_expr(w, s, z, n, kk, group: int):
    """fp32 value of 4-bit weight (n, kk) in MatMulNBits packing (low nibble = even k):
    ``scale * (q - zero)``, zero point ``z`` (uint8 or float16, one per group) or 8.

    The scale is read before the packed byte and the zero point, so a block's reads are
    ``x, scales, packed[, zeros]``: the lowering tells float zero points from the scales
    by that order (they have the same shape and dtype)."""
    scale = s[n, tirx.floordiv(kk, group)].astype("float32")
    byte = w[n, tirx.floordiv(kk, 2)]
    q = tirx.bitwise_and(tirx.shift_right(byte, (tirx.floormod(kk, 2) * 4).astype("uint8")),
                         tirx.const(15, "uint8"))
    zero = z[n, tirx.floordiv(kk, group)].astype("float32") if z is not None \
        else tirx.const(8.0, "float32")
    return scale * (q.astype("float32") - zero)


#: ``gemm_w4a16`` zero-point forms -> dtype of ``Z`` (None: no zero points, 8).
W4_ZERO_DTYPES = {"none": None, "uint8": "uint8", "float16": "float16"}


def gemm_w4a16(m: int, n: int, k: int, group: int = 32, zeros: str = "none"):
    """D (m, n) fp16 = X (m, k) fp16 @ dequant(W (n, k/2) uint8, S (n, k/group) fp16
    [, Z (n, k/group) uint8 or float16])^T; ``zeros`` is a key of :data:`W4_ZERO_DTYPES`."""
    if k % group or group % 2:
        raise ValueError(f"K={k} must be a multiple of the (even) group size {group}")
    if zeros not in W4_ZERO_DTYPES:
        raise ValueError(f"zeros={zeros!r}: one of {tuple(W4_ZERO_DTYPES)}")
    x = te.placeholder((m, k), "float16", name="X")
    w = te.placeholder((n, k // 2), "uint8", name="W")
    s = te.placeholder((n, k // group), "float16", name="S")
    z_dtype = W4_ZERO_DTYPES[zeros]
    z = te.placeholder((n, k // group), z_dtype, name="Z") if z_dtype else None
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(
        x[i, r].astype("float32") * dequant_w4_expr(w, s, z, j, r, group), axis=r), name="C")
    d = te.compute((m, n), lambda i, j: c[i, j].astype("float16"), name="D")
    args = [x, w, s] + ([z] if z is not None else []) + [d]
    return te.create_prim_func(args)


# -- row-wise ops (norms, activations, RoPE, softmax) as chains of NPU instructions -------
#
# Every te.compute below is ONE NPU instruction: its ``npu.op`` attribute (copied into the
# block's annotations by ``te.create_prim_func``) names the ISA op the schedule annotates
# its loop nest with. Row ``i`` of every result depends only on row ``i`` of the inputs, so
# a chain of them can be tiled over rows as one kernel (``fused.py``). Intermediates are
# fp32: the vector unit computes in fp32 and rounds to the destination dtype on store, so
# only the last op of a piece writes fp16.

F32 = "float32"


def _op(op: str, **extra) -> dict:
    return {"npu.op": op, **extra}


def rms_norm_te(x, w, eps: float = 1e-5, name: str = "rms"):
    """``x * rsqrt(mean(x^2) + eps) * w`` over the last axis of ``x`` (m, h); w (h,)."""
    m, h = (int(s) for s in x.shape)
    k = te.reduce_axis((0, h), name="k")
    sq = te.compute((m, h), lambda i, j: x[i, j].astype(F32) * x[i, j].astype(F32),
                    name=f"{name}_sq", attrs=_op("vector:mul"))
    ss = te.compute((m,), lambda i: te.sum(sq[i, k], axis=k), name=f"{name}_ss",
                    attrs=_op("vector:reduce_sum"))
    mean = te.compute((m,), lambda i: ss[i] * tirx.const(1.0 / h, F32), name=f"{name}_mean",
                      attrs=_op("vector:mul"))
    rstd = te.compute((m,), lambda i: tirx.rsqrt(mean[i] + tirx.const(eps, F32)),
                      name=f"{name}_rstd", attrs=_op("vector:rsqrt"))
    y = te.compute((m, h), lambda i, j: x[i, j].astype(F32) * rstd[i], name=f"{name}_y",
                   attrs=_op("vector:mul"))
    return te.compute((m, h), lambda i, j: (y[i, j] * w[j].astype(F32)).astype(x.dtype),
                      name=name, attrs=_op("vector:mul"))


def layer_norm_te(x, w, b, eps: float = 1e-5, name: str = "ln"):
    """``(x - mean) * rsqrt(var + eps) * w + b`` over the last axis of ``x`` (m, h)."""
    m, h = (int(s) for s in x.shape)
    k1 = te.reduce_axis((0, h), name="k")
    k2 = te.reduce_axis((0, h), name="k")
    inv_h = tirx.const(1.0 / h, F32)
    s = te.compute((m,), lambda i: te.sum(x[i, k1].astype(F32), axis=k1), name=f"{name}_sum",
                   attrs=_op("vector:reduce_sum"))
    mean = te.compute((m,), lambda i: s[i] * inv_h, name=f"{name}_mean", attrs=_op("vector:mul"))
    xc = te.compute((m, h), lambda i, j: x[i, j].astype(F32) - mean[i], name=f"{name}_xc",
                    attrs=_op("vector:sub"))
    sq = te.compute((m, h), lambda i, j: xc[i, j] * xc[i, j], name=f"{name}_sq",
                    attrs=_op("vector:mul"))
    ss = te.compute((m,), lambda i: te.sum(sq[i, k2], axis=k2), name=f"{name}_ss",
                    attrs=_op("vector:reduce_sum"))
    var = te.compute((m,), lambda i: ss[i] * inv_h, name=f"{name}_var", attrs=_op("vector:mul"))
    rstd = te.compute((m,), lambda i: tirx.rsqrt(var[i] + tirx.const(eps, F32)),
                      name=f"{name}_rstd", attrs=_op("vector:rsqrt"))
    y = te.compute((m, h), lambda i, j: xc[i, j] * rstd[i], name=f"{name}_y",
                   attrs=_op("vector:mul"))
    yw = te.compute((m, h), lambda i, j: y[i, j] * w[j].astype(F32), name=f"{name}_yw",
                    attrs=_op("vector:mul"))
    return te.compute((m, h), lambda i, j: (yw[i, j] + b[j].astype(F32)).astype(x.dtype),
                      name=name, attrs=_op("vector:add"))


def rope_te(x, cos, sin, head_dim: int, name: str = "rope", pairs: bool = False):
    """RoPE of every head of ``x`` (m, heads * head_dim); cos/sin (m, head_dim).

    ``out = x * cos + rot(x) * sin`` per head, where ``rot`` is ``rotate_half(x) = [-x2,
    x1]`` (Llama, NeoX) or, with ``pairs``, ``rotate_pairs``: each (even, odd) pair
    ``(a, b)`` becomes ``(-b, a)`` (GPT-J, Cohere; cos/sin then repeat per pair).
    The block carries ``npu.head_dim``: the vector unit's rope op rotates the columns it
    is given, so the schedule issues one op per head.
    """
    m, n = (int(s) for s in x.shape)
    if n % head_dim or head_dim % 2:
        raise ValueError(f"rope: {n} columns are not whole heads of (even) size {head_dim}")
    half = head_dim // 2

    def f(i, c):
        d = tirx.floormod(c, head_dim)
        if pairs:
            odd = tirx.floormod(d, 2)
            xr = x[i, c + 1 - 2 * odd].astype(F32)
            rot = tirx.Select(odd == 0, -xr, xr)
        else:
            xr = x[i, c - d + tirx.floormod(d + half, head_dim)].astype(F32)
            rot = tirx.Select(d < half, -xr, xr)
        return (x[i, c].astype(F32) * cos[i, d].astype(F32) +
                rot * sin[i, d].astype(F32)).astype(x.dtype)
    op = "vector:rope_pairs" if pairs else "vector:rope"
    return te.compute((m, n), f, name=name, attrs=_op(op, **{"npu.head_dim": head_dim}))


def silu_mul_te(g, u, name: str = "silu_mul"):
    """``silu(g) * u`` (the gated MLP's activation); fp32 between the two ops."""
    m, n = (int(s) for s in g.shape)
    s = te.compute((m, n), lambda i, j: g[i, j].astype(F32) * tirx.sigmoid(g[i, j].astype(F32)),
                   name=f"{name}_silu", attrs=_op("vector:silu"))
    return te.compute((m, n), lambda i, j: (s[i, j] * u[i, j].astype(F32)).astype(g.dtype),
                      name=name, attrs=_op("vector:mul"))


def _gelu(v, approximate: str):
    """GELU of the fp32 value ``v``: erf form or tanh approximation; (expression, op)."""
    half, one = tirx.const(0.5, F32), tirx.const(1.0, F32)
    if approximate == "tanh":
        inner = tirx.const(0.7978845608028654, F32) * (v + tirx.const(0.044715, F32) * v * v * v)
        return half * v * (one + tirx.tanh(inner)), "vector:gelu_tanh"
    if approximate == "none":
        return half * v * (one + tirx.erf(v * tirx.const(0.7071067811865476, F32))), "vector:gelu"
    raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def gelu_te(x, approximate: str = "none", name: str = "gelu"):
    """GELU as one vector op, fp32 inside: the erf form ``0.5 * x * (1 + erf(x / sqrt(2)))``
    (``approximate="none"``, op ``gelu``) or the tanh approximation
    ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`` (``"tanh"``, op
    ``gelu_tanh``: GPT-2's ``gelu_new``, Gemma's ``gelu_pytorch_tanh``)."""
    m, n = (int(s) for s in x.shape)
    op = _gelu(tirx.const(0.0, F32), approximate)[1]
    return te.compute((m, n), lambda i, j: _gelu(x[i, j].astype(F32), approximate)[0]
                      .astype(x.dtype), name=name, attrs=_op(op))


def relu_te(x, name: str = "relu"):
    """``max(x, 0)`` (OPT's MLP): one vector ``max`` with the immediate 0."""
    m, n = (int(s) for s in x.shape)
    return te.compute((m, n), lambda i, j: tirx.max(x[i, j], tirx.const(0.0, x.dtype)),
                      name=name, attrs=_op("vector:max"))


def relu2_te(x, name: str = "relu2"):
    """Squared ReLU ``max(x, 0) ** 2`` (Nemotron's MLP): a vector ``max`` with the
    immediate 0, then a ``mul`` of the result by itself; fp32 between the two ops."""
    m, n = (int(s) for s in x.shape)
    r = te.compute((m, n), lambda i, j: tirx.max(x[i, j].astype(F32), tirx.const(0.0, F32)),
                   name=f"{name}_relu", attrs=_op("vector:max"))
    return te.compute((m, n), lambda i, j: (r[i, j] * r[i, j]).astype(x.dtype), name=name,
                      attrs=_op("vector:mul"))


def relu_mul_te(g, u, name: str = "relu_mul", squared: bool = False):
    """``relu(g) * u`` (a ReGLU MLP), or with ``squared`` ``relu(g) ** 2 * u`` (BitNet's
    gated squared ReLU): a vector ``max`` with the immediate 0, the square's ``mul``, the
    product's ``mul``; fp32 between the ops."""
    m, n = (int(s) for s in g.shape)
    r = te.compute((m, n), lambda i, j: tirx.max(g[i, j].astype(F32), tirx.const(0.0, F32)),
                   name=f"{name}_relu", attrs=_op("vector:max"))
    a = r if not squared else te.compute((m, n), lambda i, j: r[i, j] * r[i, j],
                                         name=f"{name}_square", attrs=_op("vector:mul"))
    return te.compute((m, n), lambda i, j: (a[i, j] * u[i, j].astype(F32)).astype(g.dtype),
                      name=name, attrs=_op("vector:mul"))


def relu2_mul_te(g, u, name: str = "relu2_mul"):
    """``relu(g) ** 2 * u``: :func:`relu_mul_te` squared."""
    return relu_mul_te(g, u, name, squared=True)


def gelu_mul_te(g, u, approximate: str = "none", name: str = "gelu_mul"):
    """``gelu(g) * u`` (GeGLU, Gemma's gated MLP); fp32 between the two ops."""
    m, n = (int(s) for s in g.shape)
    op = _gelu(tirx.const(0.0, F32), approximate)[1]
    a = te.compute((m, n), lambda i, j: _gelu(g[i, j].astype(F32), approximate)[0],
                   name=f"{name}_gelu", attrs=_op(op))
    return te.compute((m, n), lambda i, j: (a[i, j] * u[i, j].astype(F32)).astype(g.dtype),
                      name=name, attrs=_op("vector:mul"))


def softmax_te(x, name: str = "softmax"):
    """Softmax over the last axis of ``x`` (m, n): reduce_max, sub, exp, reduce_sum, div."""
    m, n = (int(s) for s in x.shape)
    k1 = te.reduce_axis((0, n), name="k")
    k2 = te.reduce_axis((0, n), name="k")
    mx = te.compute((m,), lambda i: te.max(x[i, k1].astype(F32), axis=k1), name=f"{name}_max",
                    attrs=_op("vector:reduce_max"))
    xs = te.compute((m, n), lambda i, j: x[i, j].astype(F32) - mx[i], name=f"{name}_sub",
                    attrs=_op("vector:sub"))
    e = te.compute((m, n), lambda i, j: tirx.exp(xs[i, j]), name=f"{name}_exp",
                   attrs=_op("vector:exp"))
    s = te.compute((m,), lambda i: te.sum(e[i, k2], axis=k2), name=f"{name}_sum",
                   attrs=_op("vector:reduce_sum"))
    return te.compute((m, n), lambda i, j: (e[i, j] / s[i]).astype(x.dtype), name=name,
                      attrs=_op("vector:div"))


def add_te(a, b, name: str = "add"):
    """``a + b`` (the residual add)."""
    m, n = (int(s) for s in a.shape)
    return te.compute((m, n), lambda i, j: (a[i, j].astype(F32) + b[i, j].astype(F32))
                      .astype(a.dtype), name=name, attrs=_op("vector:add"))


def scale_te(x, imm: float, name: str = "scale"):
    """``x * imm`` with a constant ``imm`` (Gemma's embedding scale)."""
    m, n = (int(s) for s in x.shape)
    if float(imm) == 1.0:          # x * 1 folds to x: no constant left for the mul's imm
        return copy_te(x, name=name)
    return te.compute((m, n), lambda i, j: (x[i, j].astype(F32) * tirx.const(imm, F32))
                      .astype(x.dtype), name=name, attrs=_op("vector:mul"))


def copy_te(x, name: str = "copy"):
    """``x`` itself: moves rows from one layout into another (partial RoPE's pass-through
    dimensions)."""
    m, n = (int(s) for s in x.shape)
    return te.compute((m, n), lambda i, j: x[i, j], name=name, attrs=_op("vector:copy"))


def bias_add_te(x, b, name: str = "bias_add"):
    """``x + b`` with a row-invariant ``b`` (n,): a linear's bias."""
    m, n = (int(s) for s in x.shape)
    return te.compute((m, n), lambda i, j: (x[i, j].astype(F32) + b[j].astype(F32))
                      .astype(x.dtype), name=name, attrs=_op("vector:add"))


def mul_vec_te(x, w, name: str = "mul_vec"):
    """``x * w`` with a row-invariant ``w`` (n,): a gain per column (Cohere's per-head q/k
    norm gains, applied after the norm)."""
    m, n = (int(s) for s in x.shape)
    return te.compute((m, n), lambda i, j: (x[i, j].astype(F32) * w[j].astype(F32))
                      .astype(x.dtype), name=name, attrs=_op("vector:mul"))


def linear_w4a16_te(x, w, s, z=None, name: str = "linear"):
    """``x @ dequant(w, s[, z])^T`` as one MMA reduction (fp32, block ``<name>_acc``) and a
    cast to fp16 (block ``<name>``); the group size is ``k // s.shape[1]``."""
    m, k = (int(v) for v in x.shape)
    n = int(w.shape[0])
    group = k // int(s.shape[1])
    r = te.reduce_axis((0, k), name="k")
    acc = te.compute((m, n), lambda i, j: te.sum(
        x[i, r].astype(F32) * dequant_w4_expr(w, s, z, j, r, group), axis=r),
        name=f"{name}_acc", attrs=_op("mma"))
    return te.compute((m, n), lambda i, j: acc[i, j].astype(x.dtype), name=name,
                      attrs=_op("vector:cast"))


def linear_fp16_te(x, w, name: str = "linear"):
    """``x @ w^T`` with fp16 ``w`` (n, k) (ONNX/torch Linear layout), fp32 accumulation."""
    m, k = (int(v) for v in x.shape)
    n = int(w.shape[0])
    r = te.reduce_axis((0, k), name="k")
    acc = te.compute((m, n), lambda i, j: te.sum(x[i, r].astype(F32) * w[j, r].astype(F32),
                                                 axis=r), name=f"{name}_acc", attrs=_op("mma"))
    return te.compute((m, n), lambda i, j: acc[i, j].astype(x.dtype), name=name,
                      attrs=_op("vector:cast"))


def embedding_te(ids, table, name: str = "embed"):
    """``table[ids[i], :]``: a row gather whose DRAM offsets are runtime parameters."""
    s = int(ids.shape[0])
    h = int(table.shape[1])
    return te.compute((s, h), lambda i, j: table[ids[i], j], name=name, attrs=_op("dma"))


#: the vector unit's rotations (``rope_te``)
ROPE_OPS = ("vector:rope", "vector:rope_pairs")


def row_prim_func(inputs, outputs):
    """``te.create_prim_func`` plus the declared access of rope blocks.

    A rope op reads its whole head row; TVM's region of the rotated read is a loose hull
    that spills into the neighbouring heads. Declaring the element the block writes
    (``x[i, c]``) instead makes the box of one op over a head exactly that head's row.
    """
    func = te.create_prim_func(list(inputs) + list(outputs))
    return _declare_rope_reads(func)


def _declare_rope_reads(func):
    from tvm import ir, s_tir  # noqa: PLC0415  (only this rewrite needs them)

    def rebuild(stmt):
        if isinstance(stmt, tirx.For):
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, rebuild(stmt.body),
                            stmt.thread_binding, stmt.annotations)
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([rebuild(s) for s in stmt.seq])
        if isinstance(stmt, s_tir.SBlockRealize):
            blk = stmt.block
            reads = list(blk.reads)
            if str(blk.annotations.get("npu.op", "")) in ROPE_OPS:
                point = [ir.Range.from_min_extent(r.min, 1) for r in blk.writes[0].region]
                reads[0] = tirx.BufferRegion(reads[0].source, point)
            new = s_tir.SBlock(blk.iter_vars, reads, blk.writes, blk.name_hint, rebuild(blk.body),
                               blk.init, blk.alloc_buffers, blk.match_buffers, blk.annotations)
            return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, new)
        return stmt
    return func.with_body(rebuild(func.body))


def rms_norm(m: int, h: int, eps: float = 1e-5):
    """out (m, h) fp16 = RMSNorm(x (m, h) fp16) * w (h,) fp16."""
    x = te.placeholder((m, h), "float16", name="x")
    w = te.placeholder((h,), "float16", name="w")
    return row_prim_func([x, w], [rms_norm_te(x, w, eps, name="out")])


def layer_norm(m: int, h: int, eps: float = 1e-5):
    """out (m, h) fp16 = LayerNorm(x) * w + b."""
    x = te.placeholder((m, h), "float16", name="x")
    w = te.placeholder((h,), "float16", name="w")
    b = te.placeholder((h,), "float16", name="b")
    return row_prim_func([x, w, b], [layer_norm_te(x, w, b, eps, name="out")])


def rope(m: int, n_heads: int, head_dim: int, pairs: bool = False):
    """out (m, heads * head_dim) = RoPE(x) with cos/sin (m, head_dim) given as inputs."""
    x = te.placeholder((m, n_heads * head_dim), "float16", name="x")
    cos = te.placeholder((m, head_dim), "float16", name="cos")
    sin = te.placeholder((m, head_dim), "float16", name="sin")
    return row_prim_func([x, cos, sin], [rope_te(x, cos, sin, head_dim, name="out", pairs=pairs)])


def silu_mul(m: int, n: int):
    g = te.placeholder((m, n), "float16", name="g")
    u = te.placeholder((m, n), "float16", name="u")
    return row_prim_func([g, u], [silu_mul_te(g, u, name="out")])


def gelu(m: int, n: int, approximate: str = "none"):
    x = te.placeholder((m, n), "float16", name="x")
    return row_prim_func([x], [gelu_te(x, approximate, name="out")])


def softmax(m: int, n: int):
    x = te.placeholder((m, n), "float16", name="x")
    return row_prim_func([x], [softmax_te(x, name="out")])


def residual_add(m: int, n: int):
    a = te.placeholder((m, n), "float16", name="a")
    b = te.placeholder((m, n), "float16", name="b")
    return row_prim_func([a, b], [add_te(a, b, name="out")])


def embedding(seq: int, vocab: int, hidden: int):
    """out (seq, hidden) = E (vocab, hidden)[ids (seq,)]; ids are runtime parameters."""
    ids = te.placeholder((seq,), "int32", name="ids")
    table = te.placeholder((vocab, hidden), "float16", name="E")
    return te.create_prim_func([ids, table, embedding_te(ids, table, name="out")])
