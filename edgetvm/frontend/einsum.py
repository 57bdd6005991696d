"""``Einsum`` of a linear, ``...k,nk->...n`` or ``...k,kn->...n``, as Relax's ``matmul``.

TVM's converter emits every ``Einsum`` as a ``call_tir`` of TOPI's einsum PrimFunc: opaque
to every pattern and to the phase programs' extractor (OpenLLaMA's tied lm_head,
``einsum("blh,vh->blv", x, embedding)``, was refused as ``cannot interpret GlobalVar
einsum``). An equation that contracts the first operand's last index with one index of a
2-D second operand, keeping every other index in order, is ``x @ W`` (or ``x @ W^T``):
the lm_head and linear patterns then see it as any exported linear. Every other equation
keeps TVM's converter.
"""
from __future__ import annotations

from tvm import relax


def _linear_form(equation: str):
    """``"transposed"`` for ``...k,nk->...n``, ``"plain"`` for ``...k,kn->...n``, else None."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    a, w = ops
    if len(w) != 2 or not a or len(set(a)) != len(a) or len(set(w)) != 2:
        return None
    k = a[-1]
    if k not in w or k in out:
        return None
    n = w[1] if w[0] == k else w[0]
    if n in a or out != a[:-1] + n:
        return None
    return "plain" if w[0] == k else "transposed"


def convert_einsum(bb, inputs, attrs, _graph, fallback):
    equation = attrs.get("equation", b"")
    equation = equation.decode() if isinstance(equation, bytes) else str(equation)
    form = _linear_form(equation)
    if form is None or len(inputs) != 2:
        return fallback()
    x, w = inputs
    if form == "transposed":
        w = bb.emit(relax.op.permute_dims(w, [1, 0]))
    return relax.op.matmul(x, w)
