"""QuantizeW4A16: float linears -> the packed 4-bit W4A16 kernel of the front end."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

from edgetvm.frontend.matmul_nbits import LINEAR_W4A16, _product, linear_w4a16_primfunc

from .w4_pack import pack_zero_points
from .w4_quantize import check_w4_options, quantize_w4

_FLOAT_WEIGHTS = ("float32", "float16")
#: Names ``keep_fp16`` accepts.
KEEP_FP16_LAYERS = ("lm_head", "embedding")
# TVM 0.27 moved constants to tvm.ir (relax.const builds an ir.GenericConst).
_Constant = tvm.ir.expr.GenericConst


@tvm.transform.module_pass(opt_level=0, name="QuantizeW4A16")
class QuantizeW4A16:
    """Replace every float linear ``matmul(x, W) (+ b)`` with a constant 2-D ``W`` by the
    W4A16 ``call_tir`` the front end emits for onnxruntime's ``MatMulNBits``.

    Why: decode is a chain of GEMVs bound by weight traffic from DRAM; 4-bit weights with
    a float16 scale (and float16 zero point) per group of 32 move 4.5 (5.0) bits per weight
    instead of 32 (fp32) or 16 (fp16). Emitting exactly the front end's form (``edgetvm.op = linear_w4a16``, the
    reshapes to and from 2-D, the same kernel signature) means a quantised ONNX model and
    a float model quantised here meet the same annotation passes, schedules and lowering.

    What changes: ``W`` (K, N) becomes the constants ``packed`` uint8
    ``(N, k_blocks, group_size / 2)``, ``scales`` ``(N, k_blocks)`` in ``scale_dtype``
    and, by ``zero_points``: nothing (symmetric, zero point 8), MatMulNBits' packed uint4
    ``zero_points`` ``(N, ceil(k_blocks / 2))``, or float ``zero_points`` ``(N, k_blocks)``
    in ``scale_dtype`` (scale and zero point fitted per group, ``w4_fit.py``); a constant
    bias ``(N,)`` whose add is the matmul's only use moves into the kernel. Nothing is
    expanded back to float in the graph.

    What stays: the embedding table (a gather, not a matmul: the NPU gathers its rows in
    fp16), linears with fewer than
    ``min_features`` input or output features, weights of another dtype, batched (3-D+)
    constant matmuls, and the layers named in ``keep_fp16`` (the lm_head is the linear
    whose width is the vocabulary: the rows of a ``take`` on a 2-D float table that are
    also the width of an output, the logits). Composite /
    primitive functions are left alone: run this before ``AnnotateLLMSemantics``.
    :func:`~edgetvm.relax_passes.quant_report.quantization_report` says what became what.

    Parameters
    ----------
    group_size : int
        Weights per scale along K: 16, 32, 64 or 128. K that is not a multiple is padded
        (as MatMulNBits does).
    zero_points : {"float", "none", "uint4"}
        Zero-point form (see :func:`edgetvm.relax_passes.w4_quantize.quantize_w4`):
        ``float`` (default, the most accurate: 2 more bytes per group), ``none``
        (symmetric, the fewest bytes) or ``uint4`` (1 more byte per group on the NPU).
    min_features : int
        Smallest K and N that get quantised.
    keep_fp16 : iterable of str
        Layers that stay float: ``"embedding"`` (default: the embedding table, and the
        lm_head where it *is* that table, ``x @ permute_dims(table)`` of a tied model;
        onnxruntime's quantizer leaves it float too, and checkpoints keep it at more
        bits than 4: SmolLM2's Q4_1 GGUF stores it at ~8), ``"lm_head"`` (the vocabulary
        projection, tied or not). ``()`` quantizes every linear. Other names raise
        ValueError.
    scale_rule : str
        Symmetric scale rule of :func:`edgetvm.relax_passes.w4_quantize.quantize_w4`.
    scale_dtype : str
        Dtype of the scale (and float zero point) constants: float16 is the NPU's
        format (with float32 activations the kernel widens them in the reduction);
        float32 gives exactly onnxruntime's MatMulNBits numbers for an fp32 model.
    """

    def __init__(
        self,
        group_size: int = 32,
        zero_points: str = "float",
        min_features: int = 64,
        keep_fp16=("embedding",),
        scale_rule: str = "mse",
        scale_dtype: str = "float16",
    ):
        check_w4_options(group_size, scale_rule, scale_dtype, zero_points)
        keep = tuple(keep_fp16)
        unknown = sorted(set(keep) - set(KEEP_FP16_LAYERS))
        if unknown:
            raise ValueError(f"keep_fp16: unknown layer name(s) {unknown}; known: "
                             f"{', '.join(KEEP_FP16_LAYERS)}")
        self.group_size = group_size
        self.zero_points = zero_points
        self.min_features = min_features
        self.keep_fp16 = keep
        self.scale_rule = scale_rule
        self.scale_dtype = scale_dtype

    def quantize(self, weight_kn: np.ndarray):
        """The :class:`~edgetvm.relax_passes.w4_pack.W4Weight` this pass makes of a
        ``(K, N)`` matmul weight (benchmarks write the same numbers into ONNX)."""
        return quantize_w4(weight_kn.T, self.group_size, self.zero_points, self.scale_rule,
                           self.scale_dtype)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _LinearRewriter(mod, self)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and not _is_region(func):
                rewriter.plan(func)
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())


# -- the rewriter -----------------------------------------------------------------------


def _is_region(func: relax.Function) -> bool:
    attrs = func.attrs
    return attrs is not None and ("Composite" in attrs or "Primitive" in attrs)


def _op_name(expr) -> str:
    if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
        return expr.op.name
    return ""


def _static_shape(expr) -> tuple | None:
    shape = getattr(expr.ty, "shape", None)
    if shape is None or not hasattr(shape, "values"):
        return None
    if not all(isinstance(d, tirx.IntImm) for d in shape.values):
        return None
    return tuple(int(d) for d in shape.values)


def _const_weight(expr, bound: dict):
    """``(K, N)`` float array of a constant matmul weight, also through a binding of
    ``permute_dims`` of an ``(N, K)`` constant (a Linear exported as ``x @ W.T``);
    else None. ``bound`` maps variables to their bound values."""
    if isinstance(expr, relax.Var) and _op_name(bound.get(expr)) == "relax.permute_dims":
        transpose = bound[expr]
        axes = transpose.attrs.axes
        if axes is None or [int(a) for a in axes] == [1, 0]:
            inner = _const_weight(transpose.args[0], {})
            return None if inner is None else inner.T
        return None
    if not isinstance(expr, _Constant):
        return None
    if str(expr.ty.dtype) not in _FLOAT_WEIGHTS or len(expr.ty.shape.values) != 2:
        return None
    return expr.value.numpy()


@relax.expr_functor.mutator
class _LinearRewriter(relax.PyExprMutator):
    """Rewrites the planned bindings of one function at a time (see ``plan``)."""

    def __init__(self, mod: tvm.IRModule, options: QuantizeW4A16):
        super().__init__(mod)
        self.options = options
        self.rewrites: dict = {}  # binding var -> (x, weight (K, N), bias or None)
        self.dropped: set = set()  # matmul vars whose bias add takes them over
        self.tables = _embedding_tables(mod)
        # the vocabulary: an embedding table's rows that are also the width of an output
        # (the logits); a position table's rows (GPT-2's) may equal an MLP's width
        self.vocab_sizes = {int(t.ty.shape.values[0]) for t in self.tables} & \
            _output_widths(mod)

    # planning: which bindings become W4A16 kernels
    def plan(self, func: relax.Function) -> None:
        self.rewrites, self.dropped = {}, set()
        bindings = [b for block in func.body.blocks for b in block.bindings]
        bound = {b.var: b.value for b in bindings if isinstance(b, relax.VarBinding)}
        users: dict = {}
        for binding in bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding)
        returned = set(relax.analysis.free_vars(func.body.body))

        for binding in bindings:
            value = binding.value
            if _op_name(value) != "relax.matmul" or not isinstance(binding, relax.VarBinding):
                continue
            weight = self._weight_to_quantize(value, bound)
            if weight is None:
                continue
            bias_add = self._bias_add(binding.var, users, returned, weight.shape[1])
            if bias_add is None:
                self.rewrites[binding.var] = (value.args[0], weight, None)
            else:
                add, bias = bias_add
                self.dropped.add(binding.var)
                self.rewrites[add.var] = (value.args[0], weight, bias)

    def _weight_to_quantize(self, matmul: relax.Call, bound: dict):
        x, out = matmul.args[0], matmul
        dtype = str(x.ty.dtype)
        if dtype not in _FLOAT_WEIGHTS or str(out.ty.dtype) != dtype:
            return None
        if x.ty.shape is None or len(x.ty.shape.values) < 2:
            return None
        weight = _const_weight(matmul.args[1], bound)
        if weight is None:
            return None
        k, n = weight.shape
        if min(k, n) < self.options.min_features:
            return None
        if "lm_head" in self.options.keep_fp16 and n in self.vocab_sizes:
            return None
        if "embedding" in self.options.keep_fp16 and n in self.vocab_sizes and \
                self._is_embedding_table(weight):
            return None
        return weight

    def _is_embedding_table(self, weight: np.ndarray) -> bool:
        """Is the ``(K, N)`` weight the transpose of an embedding table (a tied lm_head:
        the importer folds ``Transpose(table)`` into a constant, or keeps
        ``permute_dims``)?"""
        return any(_static_shape(t) == weight.T.shape and np.array_equal(t.value.numpy(), weight.T)
                   for t in self.tables)

    @staticmethod
    def _bias_add(var, users, returned, n):
        """``(add binding, bias constant)`` if ``var``'s only use is ``var + bias``."""
        uses = users.get(var, [])
        if var in returned or len(uses) != 1:
            return None
        add = uses[0]
        if _op_name(add.value) != "relax.add":
            return None
        lhs, rhs = add.value.args
        bias = rhs if lhs.same_as(var) else lhs
        if not isinstance(bias, _Constant) or bias.same_as(var):
            return None
        shape = _static_shape(bias)
        if shape is None or int(np.prod(shape)) != n or (shape and shape[-1] != n):
            return None
        if str(bias.ty.dtype) != str(add.value.ty.dtype):
            return None
        if _static_shape(add.value) != _static_shape(var) or add.value.ty.shape is None:
            return None
        return add, bias

    # rewriting
    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        if binding.var in self.dropped:
            return  # its bias add emits the kernel; the matmul has no other use
        if binding.var not in self.rewrites:
            super().visit_var_binding_(binding)
            return
        x, weight, bias = self.rewrites[binding.var]
        value = self._w4a16_linear(self.visit_expr(x), weight, bias)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, self.builder_.normalize(value)))

    def _w4a16_linear(self, x: relax.Expr, weight: np.ndarray, bias) -> relax.Expr:
        """The front end's ``reshape -> call_tir(linear_w4a16) -> reshape`` for ``x @ W (+b)``."""
        opts = self.options
        k, n = weight.shape
        dtype = str(x.ty.dtype)
        w4 = opts.quantize(weight)
        args = [relax.const(w4.blocks(), "uint8"), relax.const(w4.scales, opts.scale_dtype)]
        zero_point_kind = w4.zero_point_kind
        if zero_point_kind == "uint4":
            args.append(relax.const(pack_zero_points(w4.zeros), "uint8"))
        elif zero_point_kind == "float":
            args.append(relax.const(w4.zeros, opts.scale_dtype))
        if bias is not None:
            args.append(relax.const(bias.value.numpy().reshape(n).astype(dtype), dtype))
        func = linear_w4a16_primfunc(
            k, n, opts.group_size, zero_point_kind, bias is not None, dtype, opts.scale_dtype
        )
        kernel = self.builder_.add_func(func, f"{LINEAR_W4A16}_k{k}_n{n}_g{opts.group_size}")

        lead = list(x.ty.shape.values[:-1])
        rows = _product(lead)
        x_2d = x if len(lead) == 1 else self.builder_.emit(relax.op.reshape(x, [rows, k]))
        out = relax.call_tir(kernel, [x_2d, *args], relax.TensorType([rows, n], dtype))
        if len(lead) == 1:
            return out
        return relax.op.reshape(self.builder_.emit(out), [*lead, n])


def _output_widths(mod: tvm.IRModule) -> set:
    """The static last dimensions of the tensors the entry functions return."""
    widths = set()
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and not _is_region(func):
            ty = func.body.body.ty
            for out in (ty.fields if isinstance(ty, relax.TupleType) else [ty]):
                dims = getattr(getattr(out, "shape", None), "values", None)
                if dims and isinstance(dims[-1], tirx.IntImm):
                    widths.add(int(dims[-1]))
    return widths


def _embedding_tables(mod: tvm.IRModule) -> list:
    """The 2-D float constants gathered by ``take(table, ids, axis=0)`` (embeddings)."""
    tables: list = []

    def visit(expr):
        if _op_name(expr) == "relax.take" and isinstance(expr.args[0], _Constant):
            table = expr.args[0]
            shape = _static_shape(table)
            if shape and len(shape) == 2 and str(table.ty.dtype).startswith(("float", "bfloat")):
                tables.append(table)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return tables
