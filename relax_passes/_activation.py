"""Patterns of the MLP activations (SiLU, GELU erf form, GELU tanh approximation) in the
spellings ONNX exporters produce, shared by the MLP and activation passes.

Each pattern function returns ``(pattern, annotations)``; the annotation that matched tells
which function it was (:func:`activation_name`). Relax's pattern matcher tries both operand
orders of ``add`` and ``multiply``, so ``0.5 * x`` and ``x * 0.5`` are one spelling here.
"""

from __future__ import annotations

from tvm.relax.dpl import is_const

from ._fusion import call


def silu(g):
    """``g * sigmoid(g)`` or ``nn.silu(g)``."""
    p = call("relax.multiply", g, call("relax.sigmoid", g)) | call("relax.nn.silu", g)
    return p, {"act_silu": p}


def gelu_tanh(u):
    """``0.5 * u * (1 + tanh(sqrt(2/pi) * (u + 0.044715 * u^3)))`` (GPT-2's ``gelu_new``,
    ``gelu_pytorch_tanh``), the cube as ``power(u, 3)`` or ``u * u * u``, or
    ``nn.gelu_tanh``."""
    cube = (call("relax.power", u, is_const()) | call("relax.multiply", u, call("relax.multiply", u, u))
            | call("relax.multiply", call("relax.multiply", u, u), u))
    inner = call("relax.multiply", is_const(),
                 call("relax.add", u, call("relax.multiply", is_const(), cube)))
    one_plus = call("relax.add", is_const(), call("relax.tanh", inner))
    p = (call("relax.multiply", call("relax.multiply", is_const(), u), one_plus)
         | call("relax.multiply", is_const(), call("relax.multiply", u, one_plus))
         | call("relax.nn.gelu_tanh", u))
    return p, {"act_gelu_tanh": p}


def gelu_erf(u):
    """``0.5 * u * (1 + erf(u / sqrt(2)))`` in its exported spellings, or ``nn.gelu``."""
    scaled = call("relax.divide", u, is_const()) | call("relax.multiply", u, is_const())
    one_plus = call("relax.add", call("relax.erf", scaled), is_const())
    p = (call("relax.multiply", call("relax.multiply", u, one_plus), is_const())
         | call("relax.multiply", call("relax.multiply", is_const(), u), one_plus)
         | call("relax.nn.gelu", u))
    return p, {"act_gelu": p}


def activation(x, functions=("silu", "gelu", "gelu_tanh")):
    """Any of ``functions`` applied to ``x``; returns (pattern, annotations)."""
    makers = {"silu": silu, "gelu": gelu_erf, "gelu_tanh": gelu_tanh}
    pattern, annotations = None, {}
    for name in functions:
        p, ann = makers[name](x)
        pattern = p if pattern is None else pattern | p
        annotations.update(ann)
    return pattern, annotations


def activation_name(matched: dict) -> str:
    """``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``: which activation pattern matched."""
    for key in ("act_gelu_tanh", "act_gelu", "act_silu"):
        if key in matched:
            return key[len("act_"):]
    raise ValueError("no activation in the match")
