"""The lowering's index expressions: compiled once per shape of expression, each closure
reading its own variables.

``ExprCompiler.compile`` caches Python code by the expression's source with its variables
numbered by first appearance; the closures differ only in which variables they read. A
cache keyed wrongly (by structure alone, its variables bound from the first expression
compiled) or a numbering that depends on anything but the order of appearance gives
another variable's value: the references here are the expressions' own arithmetic."""
from tvm import tirx

from edgetvm.target.isa import Affine
from edgetvm.target.lowering.exprs import ExprCompiler, var_key


def test_one_shape_two_sets_of_variables():
    i, j, k, m = (tirx.Var(n, "int32") for n in "ijkm")
    ec = ExprCompiler()
    f = ec.compile(i * 16 + j)
    g = ec.compile(k * 16 + m)             # the same source shape, other variables
    h = ec.compile(m * 16 + k)             # ... in the other order of appearance
    env = {var_key(i): 1, var_key(j): 2, var_key(k): 3, var_key(m): 5}
    assert (f(env), g(env), h(env)) == (1 * 16 + 2, 3 * 16 + 5, 5 * 16 + 3)


def test_a_variable_used_twice_and_the_operators():
    i, j = tirx.Var("i", "int32"), tirx.Var("j", "int32")
    ec = ExprCompiler()
    e = ec.compile(tirx.floordiv(i, 4) * j + tirx.floormod(i, 4) - tirx.min(i, j))
    for a, b in ((0, 1), (7, 3), (9, 12)):
        env = {var_key(i): a, var_key(j): b}
        assert e(env) == (a // 4) * b + a % 4 - min(a, b)


def test_runtime_parameters_are_recorded_by_the_compiler_that_reads_them():
    ids = tirx.decl_buffer((8,), "int32", "ids")
    i = tirx.Var("i", "int32")
    one, two = ExprCompiler(runtime=["ids"]), ExprCompiler(runtime=["ids"])
    f = one.compile(ids[i] * 64)
    g = two.compile(ids[i] * 64)           # one cached code, two compilers' _P
    assert f({var_key(i): 3}) == Affine.param("ids.3") * 64
    assert g({var_key(i): 5}) == Affine.param("ids.5") * 64
    assert one.used_params == {"ids.3"} and two.used_params == {"ids.5"}
