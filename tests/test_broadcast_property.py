"""Property tests of broadcasting: random broadcast-compatible shapes through the one gradient checker.

The checker sees static shapes only, so `unbroadcast` takes its static path there; each example also runs the
training graph of the same model with every input dimension symbolic, which takes the run-time Shape path, and
compares the two. That run also checks every gradient's shape: the checker compares full Jacobians on tiny
shapes only, and its inner-product test cannot see a gradient left at the broadcast shape (numpy broadcasts
it against the direction and sums the same numbers).
"""
import copy

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import onnxgrad
from gradcheck import Case, _model, check_case
from onnxgrad import runtime
from onnxgrad.errors import UnsupportedError

EXAMPLES = settings(max_examples=40, deadline=None)


@st.composite
def broadcast_shapes(draw, n: int):
    """n shapes that broadcast together: suffixes of one shape (rank 0-4, dims 1-3), some dims set to 1."""
    rank = draw(st.integers(0, 4))
    full = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    shapes = []
    for _ in range(n):
        r = draw(st.integers(0, rank))
        shapes.append(tuple(d if draw(st.booleans()) else 1 for d in full[rank - r:]))
    return shapes


def _symbolic(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every graph input dimension a symbol and the output dimensions unknown."""
    model = copy.deepcopy(model)
    for vi in model.graph.input:
        for j, d in enumerate(vi.type.tensor_type.shape.dim):
            d.dim_param = f"{vi.name}_{j}"
    for vi in model.graph.output:
        for d in vi.type.tensor_type.shape.dim:
            d.Clear()
    del model.graph.value_info[:]
    return model


def assert_symbolic_agrees(case: Case) -> None:
    """The static-shape and symbolic-shape training graphs give the same gradients, each of its input's shape."""
    fwd, wrt = _model(case, np.float32)
    heads = [o.name for o in fwd.graph.output]
    rng = np.random.default_rng(0)
    feeds = {f"in{i}": rng.uniform(0.5, 1.5, spec).astype(np.float32)
             for i, spec in enumerate(case.inputs) if isinstance(spec, tuple)}
    for o in fwd.graph.output:
        dims = [d.dim_value for d in o.type.tensor_type.shape.dim]
        if dims:
            feeds[o.name + "_grad"] = rng.standard_normal(dims).astype(np.float32)
    names = [n + "_grad" for n in wrt]
    results = []
    for model in (fwd, _symbolic(fwd)):
        train = onnxgrad.build_gradient(model, loss=heads, requires_grad=wrt)
        results.append(runtime.session(train).run(names, feeds))
    for n, static, symbolic in zip(wrt, *results):
        assert static.shape == symbolic.shape == feeds[n].shape, \
            f"{case}: gradient of {n} has shape {static.shape} (static) / {symbolic.shape} (symbolic)"
        np.testing.assert_allclose(symbolic, static, rtol=1e-6, atol=1e-6, err_msg=f"{case}: {n}")


@EXAMPLES
@given(op=st.sampled_from(["Add", "Sub", "Mul", "Div"]), shapes=broadcast_shapes(2))
def test_binary_broadcast(op, shapes):
    case = Case(op, shapes, id=f"{op}{shapes}")
    check_case(case)
    assert_symbolic_agrees(case)


@EXAMPLES
@given(shapes=broadcast_shapes(3), seed=st.integers(0, 2**16))
def test_where_broadcast(shapes, seed):
    condition = np.random.default_rng(seed).random(shapes[0]) < 0.5
    case = Case("Where", [condition, shapes[1], shapes[2]], id=f"Where{shapes}")
    check_case(case)
    assert_symbolic_agrees(case)


# Reductions whose axes are computed at run time: with keepdims=1 the output keeps the input's rank, so the
# gradient broadcasts back without knowing the axes. The checker feeds every int64 input as an initializer
# (a known constant), so these tests build the graph themselves and compare it with the constant-axes graph,
# whose gradient the checker proves (tests/cases/reduction.py).
RUNTIME_AXES_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2",
                    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ReduceProd"]


def _reduce_model(op: str, axes: list[int], runtime_axes: bool, **attrs) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3, 2])
    axes_value = np.array(axes, dtype=np.int64)
    inputs, inits = [x], []
    if runtime_axes:
        inputs.append(helper.make_tensor_value_info("axes", onnx.TensorProto.INT64, [len(axes)]))
    else:
        inits.append(numpy_helper.from_array(axes_value, "axes"))
    node = helper.make_node(op, ["x", "axes"], ["y"], **attrs)
    out_rank = 3 if attrs.get("keepdims", 1) else 3 - len(axes)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None] * out_rank)
    graph = helper.make_graph([node], "reduce", inputs, [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("axes,noop", [([-1, 0], 0), ([1], 0), ([], 0), ([], 1)],
                         ids=["neg-axes", "axis1", "empty-all", "empty-noop"])
@pytest.mark.parametrize("op", RUNTIME_AXES_OPS)
def test_reduce_runtime_axes_keepdims(op, axes, noop):
    rng = np.random.default_rng(0)
    x = (0.5 + 0.1 * rng.permutation(12) + rng.uniform(0, 0.01, 12)).reshape(2, 3, 2).astype(np.float32)
    reduced = {a % 3 for a in axes} if axes or noop else {0, 1, 2}
    y_grad = rng.standard_normal([1 if a in reduced else d for a, d in enumerate(x.shape)]).astype(np.float32)
    grads = []
    for runtime_axes in (True, False):
        model = _reduce_model(op, axes, runtime_axes, keepdims=1, noop_with_empty_axes=noop)
        train = onnxgrad.build_gradient(model, loss="y", requires_grad=["x"])
        feeds = {"x": x, "y_grad": y_grad}
        if runtime_axes:
            feeds["axes"] = np.array(axes, dtype=np.int64)
        grads.append(runtime.session(train).run(["x_grad"], feeds)[0])
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_reduce_runtime_axes_keepdims0_refused():
    model = _reduce_model("ReduceMean", [1], runtime_axes=True, keepdims=0)
    with pytest.raises(UnsupportedError, match="axes computed at run time need keepdims=1"):
        onnxgrad.build_gradient(model, loss="y", requires_grad=["x"])
