"""RemoveIdentityCasts: drop ``astype`` to the dtype the tensor already has."""

from __future__ import annotations

import tvm
from tvm.relax.dpl import is_op, wildcard

from ._fusion import dtype_of, rewrite_main_functions


@tvm.transform.module_pass(opt_level=0, name="RemoveIdentityCasts")
class RemoveIdentityCasts:
    """Rewrite ``astype(x, dtype)`` to ``x`` when ``x`` already has ``dtype``.

    torch exports of fp32 models cast to the input dtype around every norm and RoPE
    (``hidden_states.to(input_dtype)``): float32 -> float32 casts that compute nothing
    but sit between the ops the semantic patterns look for. Removing them is exact; the
    alias bindings left behind are folded by ``CanonicalizeBindings``.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        x = wildcard()
        cast = is_op("relax.astype")(x)

        def rewrite(expr, matches):
            source = matches[x]
            return source if dtype_of(source) == str(expr.attrs.dtype) else expr

        return rewrite_main_functions(mod, [(cast, rewrite)])
