"""AnnotateActivation: MLP activations outside a recognised MLP block."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import wildcard

from ._activation import activation, activation_constants_ok, activation_name
from ._fusion import RegionPattern, call, fuse_regions, is_float, static_shape


def activation_patterns() -> list[RegionPattern]:
    """``act(a) * b`` (gated) and ``act(a)``, act SiLU, GELU (erf), GELU (tanh), ReLU or
    squared ReLU."""
    a, b = wildcard(), wildcard()
    act, ann = activation(a)
    gated = call("relax.multiply", act, b)

    def check(m, ctx):
        shape = static_shape(ctx.matched_expr)
        if "b" in m and any(m["b"].same_as(m[k]) for k in ("act_relu", "act_silu")
                            if k in m):
            return False            # relu(a) * relu(a) squares one ReLU: relu2, not gated
        return is_float(ctx.matched_expr) and activation_constants_ok(m) and ("b" not in m or static_shape(m["b"]) == shape
                                                == static_shape(m["a"]))

    def attrs(m, is_gated):
        return {"activation": activation_name(m), "gated": is_gated,
                "width": static_shape(m["a"])[-1]}

    return [
        RegionPattern("activation", gated, {"a": a, "b": b, **ann}, check,
                      lambda m: attrs(m, True)),
        RegionPattern("activation", act, {"a": a, **ann}, check, lambda m: attrs(m, False)),
    ]


@tvm.transform.module_pass(opt_level=0, name="AnnotateActivation")
class AnnotateActivation:
    """Group activations that no MLP region claimed into ``edgetvm.activation`` composites.

    Architectures whose MLP the block pattern does not see (Phi-3 computes gate and up in
    one projection and slices them apart) still get their activation on the vector unit.
    Attributes: ``activation`` (``silu``, ``gelu``, ``gelu_tanh``, ``relu``, ``relu2``),
    ``gated``
    (``act(a) * b``), ``width``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return fuse_regions(mod, activation_patterns())
