"""Fast evaluation of TIR index expressions with concrete loop values.

The interpreter evaluates the same index expressions for every tile; translating each one
to a Python closure once is ~100x faster than substituting into TIR and simplifying.
"""
from __future__ import annotations

from tvm import tirx
from tvm.ir.expr import TensorLoad   # TVM 0.27: what tirx.BufferLoad(...) builds

from ..isa import Affine

_BIN = {tirx.Add: "({} + {})", tirx.Sub: "({} - {})", tirx.Mul: "({} * {})",
        tirx.FloorDiv: "({} // {})", tirx.FloorMod: "({} % {})",
        tirx.Min: "min({}, {})", tirx.Max: "max({}, {})",
        tirx.LT: "({} < {})", tirx.LE: "({} <= {})", tirx.GT: "({} > {})",
        tirx.GE: "({} >= {})", tirx.EQ: "({} == {})", tirx.NE: "({} != {})",
        tirx.And: "({} and {})", tirx.Or: "({} or {})"}


#: source text -> code object of the index expressions compiled in this process
_CODE: dict = {}
_CODE_MAX = 1 << 16


def var_key(v) -> int:
    """The key of a TIR variable in an ``env``: its object's address. Two Python wrappers of
    one variable are not one Python object, and comparing TVM objects with ``==`` builds
    expressions: dict lookups keyed by them are ~20x slower than by an int."""
    return v.__chandle__()


class ExprCompiler:
    """Compiles integer PrimExprs into ``f(env) -> int`` where ``env`` maps
    ``var_key(Var)`` -> int.

    ``runtime`` names buffers whose elements are runtime parameters (token ids, page table
    entries): a load ``ids[i]`` evaluates to ``Affine.param("ids.<i>")``, so an index that
    depends on it becomes an affine DRAM offset the host sets per call. Scalar PrimFunc
    parameters bound in ``env`` to an :class:`Affine` work the same way.
    """

    def __init__(self, runtime=()):
        self.runtime = set(runtime)
        self.used_params: set = set()

    def _src(self, e, keys: dict) -> str:
        """Python source of ``e``; its variables are ``env[_v<n>]``, ``keys`` maps each
        variable's :func:`var_key` to its ``n`` (the source is the expression's
        structure, the same text wherever it recurs)."""
        if isinstance(e, (tirx.IntImm, int)):
            return str(int(e.value if isinstance(e, tirx.IntImm) else e))
        if isinstance(e, tirx.Var):
            return f"env[_v{keys.setdefault(var_key(e), len(keys))}]"
        fmt = _BIN.get(type(e))
        if fmt is not None:
            return fmt.format(self._src(e.a, keys), self._src(e.b, keys))
        if isinstance(e, tirx.Cast):
            return self._src(e.value, keys)
        if isinstance(e, tirx.Not):
            return f"(not {self._src(e.a, keys)})"
        if isinstance(e, TensorLoad) and e.source.name in self.runtime:
            idx = ", ".join(self._src(i, keys) for i in e.indices)
            return f"_P({e.source.name!r}, {[int(s) for s in e.source.shape]!r}, ({idx},))"
        raise NotImplementedError(f"index expression {type(e).__name__}: {e}")

    def compile(self, e):
        keys: dict = {}
        src = "lambda env: " + self._src(e, keys)
        code = _CODE.get(src)
        if code is None:
            # Python's compile() was most of a kernel's interpretation and the same index
            # shapes recur in every kernel: compiled once per process
            if len(_CODE) >= _CODE_MAX:                # a long tuning run: start over
                _CODE.clear()
            code = _CODE[src] = compile(src, "<npu index>", "eval")
        scope = {"min": min, "max": max, "_P": self._param}
        scope.update((f"_v{n}", key) for key, n in keys.items())
        return eval(code, scope)

    def _param(self, name, shape, idx) -> Affine:
        flat = 0
        for i, s in zip(idx, shape):
            flat = flat * s + i
        pname = f"{name}.{flat}"
        self.used_params.add(pname)
        return Affine.param(pname)
