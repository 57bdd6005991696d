"""Fast evaluation of TIR index expressions with concrete loop values.

The interpreter evaluates the same index expressions for every tile; translating each one
to a Python closure once is ~100x faster than substituting into TIR and simplifying.
"""
from __future__ import annotations

from tvm import tirx

_BIN = {tirx.Add: "({} + {})", tirx.Sub: "({} - {})", tirx.Mul: "({} * {})",
        tirx.FloorDiv: "({} // {})", tirx.FloorMod: "({} % {})",
        tirx.Min: "min({}, {})", tirx.Max: "max({}, {})",
        tirx.LT: "({} < {})", tirx.LE: "({} <= {})", tirx.GT: "({} > {})",
        tirx.GE: "({} >= {})", tirx.EQ: "({} == {})", tirx.NE: "({} != {})",
        tirx.And: "({} and {})", tirx.Or: "({} or {})"}


class ExprCompiler:
    """Compiles integer PrimExprs into ``f(env) -> int`` where ``env`` maps Var -> int."""

    def __init__(self):
        self._vars: list = []
        self._index: dict = {}

    def _src(self, e) -> str:
        if isinstance(e, (tirx.IntImm, int)):
            return str(int(e.value if isinstance(e, tirx.IntImm) else e))
        if isinstance(e, tirx.Var):
            k = self._index.get(e)
            if k is None:
                k = self._index[e] = len(self._vars)
                self._vars.append(e)
            return f"env[_V[{k}]]"
        fmt = _BIN.get(type(e))
        if fmt is not None:
            return fmt.format(self._src(e.a), self._src(e.b))
        if isinstance(e, tirx.Cast):
            return self._src(e.value)
        if isinstance(e, tirx.Not):
            return f"(not {self._src(e.a)})"
        raise NotImplementedError(f"index expression {type(e).__name__}: {e}")

    def compile(self, e):
        src = self._src(e)
        return eval("lambda env: " + src, {"_V": self._vars, "min": min, "max": max})
