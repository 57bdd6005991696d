"""Spellings of LayerNorm and rotary embedding that families export, on the NPU: the
kernel computes the function the graph spells, and a look-alike that computes another
function stays on the host.

References: numpy from the definitions; the graphs are built here with onnx.helper."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgetvm.session import NPUSession

RNG = np.random.default_rng(11)


def _const(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _save(path, nodes, inputs, output_shape, inits):
    graph = helper.make_graph(
        nodes, path.stem, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                           for n, s in inputs],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


# -- LayerNorm spelled out -----------------------------------------------------------------
def _layer_norm_model(path, spelling, gamma, beta, mean_axis=-1):
    """(x - mean(x)) / sqrt(mean((x - mean)^2) + eps) [* gamma] [+ beta]; the reciprocal as
    ``Div(centred, root)`` or ``centred * (1 / root)`` (Cohere's rsqrt, exported)."""
    inits = [_const("two", 2.0), _const("eps", 1e-5), _const("one", 1.0)]
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[mean_axis], keepdims=1),
             helper.make_node("Sub", ["x", "mu"], ["c"]),
             helper.make_node("Pow", ["c", "two"], ["c2"]),
             helper.make_node("ReduceMean", ["c2"], ["var"], axes=[mean_axis], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["root"])]
    if spelling == "div":
        nodes.append(helper.make_node("Div", ["c", "root"], ["n"]))
    else:
        nodes += [helper.make_node("Div", ["one", "root"], ["inv"]),
                  helper.make_node("Mul", ["c", "inv"], ["n"])]
    last = "n"
    if gamma is not None:
        inits.append(_const("gamma", gamma))
        nodes.append(helper.make_node("Mul", ["gamma", last], ["ng"]))     # weight * x
        last = "ng"
    if beta is not None:
        inits.append(_const("beta", beta))
        nodes.append(helper.make_node("Add", [last, "beta"], ["nb"]))
        last = "nb"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    _save(path, nodes, [("x", [1, 8, 64])], [1, 8, 64], inits)


def _layer_norm(x, gamma, beta, axis=-1):
    mu = x.mean(axis, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis, keepdims=True) + 1e-5)
    return y * (1 if gamma is None else gamma) + (0 if beta is None else beta)


@pytest.mark.parametrize("spelling", ["div", "reciprocal"])
@pytest.mark.parametrize("affine", ["gain and bias", "gain", "neither"])
def test_spelled_out_layer_norm_runs_on_the_npu(tmp_path, spelling, affine):
    # before, the reciprocal spelling was claimed as an RMSNorm of the centred input, the
    # centring left on the host; and a spelled-out LayerNorm had no NPU kernel at all
    gamma = RNG.normal(1, 0.5, 64).astype(np.float32) if affine != "neither" else None
    beta = RNG.normal(0, 0.5, 64).astype(np.float32) if affine == "gain and bias" else None
    path = tmp_path / f"ln_{spelling}.onnx"
    _layer_norm_model(path, spelling, gamma, beta)
    session = NPUSession(str(path))
    assert [r.kind for r in session.regions] == ["layer_norm"]
    x = RNG.normal(0.5, 2, (1, 8, 64)).astype(np.float32)
    out, meter = session({"x": x})
    assert meter.kernels == 1
    np.testing.assert_allclose(out["y"], _layer_norm(x, gamma, beta), rtol=1e-2, atol=1e-2)


def test_a_norm_over_another_axis_is_not_a_layer_norm(tmp_path):
    # the means run over the 8 rows, not the 64 columns: a row kernel would compute
    # another function, so the ops stay on the host, and the answer is still right
    gamma = RNG.normal(1, 0.5, 64).astype(np.float32)
    path = tmp_path / "ln_axis1.onnx"
    _layer_norm_model(path, "reciprocal", gamma, None, mean_axis=1)
    session = NPUSession(str(path))
    assert {r.kind for r in session.regions} & {"layer_norm", "rms_norm"} == set()
    x = RNG.normal(0.5, 2, (1, 8, 64)).astype(np.float32)
    out, _ = session({"x": x})
    np.testing.assert_allclose(out["y"], _layer_norm(x, gamma, None, axis=1), rtol=1e-4,
                               atol=1e-4)


def test_a_gain_per_head_stays_out_of_the_norm_region(tmp_path):
    # (heads, d) gains over (b, s, heads, d): the row kernel has one gain for all rows, so
    # the region is the norm alone and the multiply stays outside it
    gamma = RNG.normal(1, 0.5, (4, 16)).astype(np.float32)
    inits = [_const("two", 2.0), _const("eps", 1e-5), _const("one", 1.0), _const("gamma", gamma)]
    nodes = [helper.make_node("ReduceMean", ["x"], ["mu"], axes=[-1], keepdims=1),
             helper.make_node("Sub", ["x", "mu"], ["c"]),
             helper.make_node("Pow", ["c", "two"], ["c2"]),
             helper.make_node("ReduceMean", ["c2"], ["var"], axes=[-1], keepdims=1),
             helper.make_node("Add", ["var", "eps"], ["ve"]),
             helper.make_node("Sqrt", ["ve"], ["root"]),
             helper.make_node("Div", ["one", "root"], ["inv"]),
             helper.make_node("Mul", ["c", "inv"], ["n"]),
             helper.make_node("Mul", ["gamma", "n"], ["y"])]
    path = tmp_path / "ln_heads.onnx"
    _save(path, nodes, [("x", [1, 8, 4, 16])], [1, 8, 4, 16], inits)
    session = NPUSession(str(path))
    (region,) = session.regions
    assert region.kind == "layer_norm" and region.attrs["edgetvm.has_weight"] == "0"
    x = RNG.normal(0.5, 2, (1, 8, 4, 16)).astype(np.float32)
    out, _ = session({"x": x})
    np.testing.assert_allclose(out["y"], _layer_norm(x, gamma, None), rtol=1e-2, atol=1e-2)


# -- rotary embedding that rotates neighbouring pairs (GPT-J, Cohere, CodeGen) -------------
S, H, D = 8, 4, 16


def _rope_pairs_model(path, heads_major, odd_first=True):
    """x * cos + rotate_pairs(x) * sin with rotate_pairs = stack([-x[..., 1::2],
    x[..., 0::2]], -1).flatten(-2), spelled as torch exports it (Slice with step 2, Neg,
    Unsqueeze, Concat, Reshape). ``odd_first=False`` stacks [-x[..., 0::2], x[..., 1::2]],
    another function that looks alike."""
    shape = [1, H, S, D] if heads_major else [1, S, H, D]
    table = [1, 1, S, D] if heads_major else [1, S, 1, D]
    i64 = lambda name, v: _const(name, v, np.int64)                    # noqa: E731
    first, second = ("one", "zero") if odd_first else ("zero", "one")
    inits = [i64("zero", [0]), i64("one", [1]), i64("end", [D]), i64("last", [-1]),
             i64("two", [2]), i64("shape", shape)]
    nodes = [helper.make_node("Slice", ["x", first, "end", "last", "two"], ["a"]),
             helper.make_node("Slice", ["x", second, "end", "last", "two"], ["b"]),
             helper.make_node("Neg", ["a"], ["na"]),
             helper.make_node("Unsqueeze", ["na", "last"], ["ua"]),
             helper.make_node("Unsqueeze", ["b", "last"], ["ub"]),
             helper.make_node("Concat", ["ua", "ub"], ["st"], axis=-1),
             helper.make_node("Reshape", ["st", "shape"], ["rot"]),
             helper.make_node("Mul", ["x", "cos"], ["xc"]),
             helper.make_node("Mul", ["rot", "sin"], ["rs"]),
             helper.make_node("Add", ["xc", "rs"], ["y"])]
    _save(path, nodes, [("x", shape), ("cos", table), ("sin", table)], shape, inits)
    return shape, table


def _rotate_pairs(x, cos, sin):
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    y = np.empty_like(x)
    y[..., 0::2] = even * c - odd * s
    y[..., 1::2] = odd * c + even * s
    return y


@pytest.mark.parametrize("heads_major", [True, False], ids=["b,h,s,d", "b,s,h,d"])
def test_pairwise_rotary_runs_on_the_npu(tmp_path, heads_major):
    path = tmp_path / "rope_pairs.onnx"
    shape, table = _rope_pairs_model(path, heads_major)
    session = NPUSession(str(path))
    (region,) = session.regions
    assert region.kind == "rope" and region.attrs["edgetvm.style"] == "rotate_pairs"
    assert region.attrs["edgetvm.heads_axis"] == ("1" if heads_major else "2")
    x = RNG.normal(0, 1, shape).astype(np.float32)
    ang = RNG.uniform(-3, 3, table[:-1] + [D // 2]).astype(np.float32)
    cos, sin = np.repeat(np.cos(ang), 2, -1), np.repeat(np.sin(ang), 2, -1)
    out, meter = session({"x": x, "cos": cos, "sin": sin})
    assert meter.kernels == 1
    np.testing.assert_allclose(out["y"], _rotate_pairs(x, cos, sin), rtol=5e-3, atol=5e-3)


def test_pairs_stacked_the_other_way_round_are_not_rotary(tmp_path):
    # [-x_even, x_odd] is a reflection, not the rotation: it stays on the host and the
    # answer is the graph's
    path = tmp_path / "rope_swapped.onnx"
    shape, table = _rope_pairs_model(path, heads_major=True, odd_first=False)
    session = NPUSession(str(path))
    assert "rope" not in {r.kind for r in session.regions}
    x = RNG.normal(0, 1, shape).astype(np.float32)
    cos, sin = (RNG.normal(0, 1, table).astype(np.float32) for _ in range(2))
    out, _ = session({"x": x, "cos": cos, "sin": sin})
    rot = np.stack([-x[..., 0::2], x[..., 1::2]], -1).reshape(shape)
    np.testing.assert_allclose(out["y"], x * cos + rot * sin, rtol=1e-5, atol=1e-5)
