"""Patterns of the MLP activations (SiLU, GELU erf form, GELU tanh approximation, ReLU,
squared ReLU) in
the spellings ONNX exporters produce, shared by the MLP and activation passes.

Each pattern function returns ``(pattern, annotations)``; the annotation that matched tells
which function it was (:func:`activation_name`). Relax's pattern matcher tries both operand
orders of ``add`` and ``multiply``, so ``0.5 * x`` and ``x * 0.5`` are one spelling here.
"""

from __future__ import annotations

import math

from tvm.relax.dpl import is_const

from ._fusion import call, scalar_value


def silu(g):
    """``g * sigmoid(g)`` or ``nn.silu(g)``."""
    p = call("relax.multiply", g, call("relax.sigmoid", g)) | call("relax.nn.silu", g)
    return p, {"act_silu": p}


def relu(u):
    """``nn.relu(u)`` (OPT's MLP)."""
    p = call("relax.nn.relu", u)
    return p, {"act_relu": p}


def relu2(u):
    """Squared ReLU ``relu(u) * relu(u)`` or ``relu(u) ** 2`` (Nemotron's and Arcee's
    ``relu2``; Primer). One pattern node used for both factors matches one expression: the
    square of one ReLU, not the product of two (a gated ReLU). The exponent is annotated
    for :func:`activation_constants_ok`."""
    r = call("relax.nn.relu", u)
    two = is_const()
    p = call("relax.multiply", r, r) | call("relax.power", r, two)
    return p, {"act_relu2": p, "relu2_two": two}


def gelu_tanh(u):
    """``0.5 * u * (1 + tanh(sqrt(2/pi) * (u + 0.044715 * u^3)))`` (GPT-2's ``gelu_new``,
    ``gelu_pytorch_tanh``), the cube as ``power(u, 3)`` or ``u * u * u``, the inner
    polynomial factored (BLOOM's ``sqrt(2/pi) * u * (1 + 0.044715 * u * u)``), or
    ``nn.gelu_tanh``. Its constants are annotated for :func:`activation_constants_ok`."""
    half, one, one2, c1, c2, three = (is_const() for _ in range(6))
    cube = (call("relax.power", u, three) | call("relax.multiply", u, call("relax.multiply", u, u))
            | call("relax.multiply", call("relax.multiply", u, u), u))
    inner = call("relax.multiply", c1, call("relax.add", u, call("relax.multiply", c2, cube)))
    # BLOOM factors u out: (sqrt(2/pi) * u) * (1 + 0.044715 * u * u)
    inner = inner | call("relax.multiply", call("relax.multiply", c1, u), call(
        "relax.add", one2, call("relax.multiply", call("relax.multiply", c2, u), u)))
    one_plus = call("relax.add", one, call("relax.tanh", inner))
    p = (call("relax.multiply", call("relax.multiply", half, u), one_plus)
         | call("relax.multiply", half, call("relax.multiply", u, one_plus))
         | call("relax.nn.gelu_tanh", u))
    return p, {"act_gelu_tanh": p, "tanh_half": half, "tanh_one": one, "tanh_one2": one2,
               "tanh_c1": c1, "tanh_c2": c2, "tanh_three": three}


def gelu_erf(u):
    """``0.5 * u * (1 + erf(u / sqrt(2)))`` in its exported spellings, or ``nn.gelu``."""
    half, one, root2, inv_root2 = (is_const() for _ in range(4))
    scaled = call("relax.divide", u, root2) | call("relax.multiply", u, inv_root2)
    one_plus = call("relax.add", call("relax.erf", scaled), one)
    p = (call("relax.multiply", call("relax.multiply", u, one_plus), half)
         | call("relax.multiply", call("relax.multiply", half, u), one_plus)
         | call("relax.nn.gelu", u))
    return p, {"act_gelu": p, "erf_half": half, "erf_one": one, "erf_root2": root2,
               "erf_inv_root2": inv_root2}


#: the value each annotated activation constant must have (fp32 as exported)
_CONSTANTS = {"tanh_half": 0.5, "tanh_one": 1.0, "tanh_one2": 1.0,
              "tanh_c1": math.sqrt(2 / math.pi), "tanh_c2": 0.044715, "tanh_three": 3.0,
              "erf_half": 0.5, "erf_one": 1.0, "erf_root2": math.sqrt(2),
              "erf_inv_root2": 1 / math.sqrt(2), "relu2_two": 2.0}


def activation_constants_ok(matched: dict) -> bool:
    """True if every constant of the matched activation has its value (GELU's, the
    square's 2): a pattern of the right shape with other constants is another function."""
    for name, want in _CONSTANTS.items():
        if name in matched and not math.isclose(scalar_value(matched[name]), want,
                                                rel_tol=1e-6):
            return False
    return True


def activation(x, functions=("silu", "gelu", "gelu_tanh", "relu2", "relu")):
    """Any of ``functions`` applied to ``x`` (tried in that order: ``relu2`` before
    ``relu``, whose match would stop at the ReLU); returns (pattern, annotations)."""
    makers = {"silu": silu, "gelu": gelu_erf, "gelu_tanh": gelu_tanh, "relu2": relu2,
              "relu": relu}
    pattern, annotations = None, {}
    for name in functions:
        p, ann = makers[name](x)
        pattern = p if pattern is None else pattern | p
        annotations.update(ann)
    return pattern, annotations


def activation_name(matched: dict) -> str:
    """``"silu"``, ``"gelu"`` (erf), ``"gelu_tanh"``, ``"relu2"`` or ``"relu"``: which
    activation pattern matched."""
    for key in ("act_gelu_tanh", "act_gelu", "act_silu", "act_relu2", "act_relu"):
        if key in matched:
            return key[len("act_"):]
    raise ValueError("no activation in the match")
