"""Patterns for one weight projection ``y = x @ W (+ b)``, shared by linear, MLP and lm_head.

Two weight formats are recognised:

- ``f32``/``f16``: ``R.matmul(x, W)`` with ``W`` a bound 2-D constant (the ONNX importer
  binds initializers as constants with ``keep_params_in_input=False``);
- ``w4a16``: ``R.call_tir(f, (x, packed, scales, ...))`` where the PrimFunc ``f`` carries
  ``{"edgetvm.op": "linear_w4a16", "edgetvm.group_size": G}`` (what
  ``edgetvm.frontend.import_onnx`` emits for com.microsoft MatMulNBits).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_gv, is_op, is_tuple, wildcard

from ._fusion import Constant, call, dtype_of, static_shape

W4A16_OP = "linear_w4a16"
# call_tir argument tuples of MatMulNBits-style kernels: x, packed weight, scales,
# optionally zero points and a bias.
_W4A16_ARITIES = (3, 4, 5)


def w4a16_call(inp):
    """Pattern of a W4A16 call_tir on ``inp`` (the callee is checked by ``call_tir_ok``).

    The front end flattens the activation to 2-D for the kernel; that reshape belongs
    to the projection. Returns the call pattern (its result is still 2-D).
    """
    flat = call("relax.reshape", inp) | inp
    alternatives = [
        is_op("relax.call_tir")(
            is_gv(""), is_tuple([flat] + [wildcard() for _ in range(n - 1)]), add_constraint=False
        )
        for n in _W4A16_ARITIES
    ]
    pattern = alternatives[0]
    for alt in alternatives[1:]:
        pattern = pattern | alt
    return pattern


def matmul_const(inp):
    """Pattern of ``matmul(inp, W)`` with a constant weight."""
    return call("relax.matmul", inp, is_const())


def projection_variants(inp, name: str = "", reshaped_input: bool = False) -> list:
    """The spellings of one projection of ``inp``, longest first, for a pattern root.

    ``FuseOpsByPattern`` does not fall back from a longer to a shorter alternative of an
    OrPattern at the root, so each spelling is its own root pattern: ``x @ W + b``,
    ``reshape(w4a16(x))`` (back to the activation's rank), then the bare
    ``x @ W`` / ``w4a16(x)``. ``reshaped_input`` also accepts ``reshape(x) @ W``
    (exporters flatten the activation to 2-D for a GEMM, GPT-2's Conv1D).

    Returns
    -------
    list of DFPattern
    dict
        Annotations shared by all variants: ``<name>dense`` (the matmul) or
        ``<name>w4`` (the call_tir), and ``<name>bias`` where present.
    """
    dense_inp = call("relax.reshape", inp) | inp if reshaped_input else inp
    dense, w4, bias = matmul_const(dense_inp), w4a16_call(inp), is_const()
    variants = [call("relax.add", dense, bias), call("relax.reshape", w4), dense | w4]
    return variants, {name + "dense": dense, name + "w4": w4, name + "bias": bias}


def projection(inp, name: str = "", reshaped: bool = False):
    """All spellings of a projection as one pattern, for use inside a larger pattern;
    ``reshaped`` also accepts a reshape of the input and of the result (the flattening
    around a 2-D GEMM)."""
    variants, annotations = projection_variants(inp, name, reshaped_input=reshaped)
    pattern = variants[0]
    for alt in variants[1:]:
        pattern = pattern | alt
    if reshaped:
        pattern = call("relax.reshape", pattern) | pattern
    return pattern, annotations


def is_w4a16(mod: tvm.IRModule, call: relax.Expr) -> bool:
    """True if ``call`` is a call_tir to a PrimFunc tagged ``edgetvm.op = linear_w4a16``."""
    if not (isinstance(call, relax.Call) and call.op == tvm.ir.Op.get("relax.call_tir")):
        return False
    func = mod[call.args[0]]
    return func.attrs is not None and str(func.attrs.get("edgetvm.op", "")) == W4A16_OP


def w4a16_group_size(mod: tvm.IRModule, call: relax.Call) -> int:
    return int(mod[call.args[0]].attrs["edgetvm.group_size"])


def call_tir_ok(mod: tvm.IRModule, ctx) -> bool:
    """Every call_tir inside the match is a W4A16 linear (the check of a projection)."""
    for value in ctx.matched_bindings.values():
        if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.call_tir"):
            if not is_w4a16(mod, value):
                return False
    return True


def weight_is_2d(ctx) -> bool:
    """Every constant-weight matmul in the match has a 2-D weight (a projection, not bmm)."""
    for value in ctx.matched_bindings.values():
        if isinstance(value, relax.Call) and value.op == tvm.ir.Op.get("relax.matmul"):
            if isinstance(value.args[1], Constant) and len(static_shape(value.args[1])) != 2:
                return False
    return True


def projection_attrs(mod: tvm.IRModule, matched: dict, name: str = "") -> dict:
    """Attributes (features, bias, weight format, group size) of a matched projection."""
    if name + "w4" in matched:
        core = matched[name + "w4"]
        attrs = {
            "weight_format": "w4a16",
            "group_size": w4a16_group_size(mod, core),
            "in_features": static_shape(core.args[1].fields[0])[-1],
        }
    else:
        core = matched[name + "dense"]
        weight = core.args[1]
        attrs = {"weight_format": dtype_of(weight), "in_features": static_shape(weight)[0]}
    attrs["out_features"] = static_shape(core)[-1]
    attrs["bias"] = (name + "bias") in matched
    return {name + k: v for k, v in attrs.items()}
