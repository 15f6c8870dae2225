"""Shape-op gradients on hand-built models: symbolic batch dims, run-time shape inputs, and forms the table's
checker cannot express (Split outputs that no gradient reaches, negative pads).

Each model is built once with symbolic dims ('N', 'M'), differentiated once, and then run at several sizes:
the one training graph must serve every batch size. Gradients from onnxruntime (float64) are compared with
central finite differences of <c, f(x)> for a random direction c.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from gradcheck import Runner

DOUBLE = TensorProto.DOUBLE
INT64 = TensorProto.INT64
INT64_MIN = -2**63


@dataclass
class Spec:
    id: str
    nodes: list
    inputs: dict                  # name -> (elem type, shape with symbols)
    outputs: list                 # the heads: graph outputs, each seeded by `<y>_grad`
    wrt: list                     # float inputs to differentiate
    sizes: list                   # per run: {symbol: size}
    ints: dict = field(default_factory=dict)    # int inputs fed at run time: name -> values
    inits: dict = field(default_factory=dict)   # initializers: name -> array
    opset: int = 18
    output_shapes: dict = field(default_factory=dict)  # declared where shape inference cannot tell the rank

    def __str__(self):
        return self.id


def build(spec: Spec) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in spec.inputs.items()]
    outputs = [helper.make_tensor_value_info(n, DOUBLE, spec.output_shapes.get(n)) for n in spec.outputs]
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in spec.inits.items()]
    graph = helper.make_graph(spec.nodes, spec.id, inputs, outputs, inits)
    opsets = [helper.make_opsetid("", spec.opset)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = helper.find_min_ir_version_for(opsets)  # an IR version onnxruntime accepts
    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def check(spec: Spec, seed: int = 0, eps: float = 1e-6, tol: float = 1e-6) -> None:
    rng = np.random.default_rng(seed)
    fwd = build(spec)
    train = onnxgrad.build_gradient(fwd, loss=spec.outputs, requires_grad=spec.wrt)
    for name in spec.wrt:  # the gradient keeps the forward input's symbolic dims
        shape = [d.dim_param or d.dim_value for d in
                 next(o for o in train.graph.output if o.name == name + "_grad").type.tensor_type.shape.dim]
        assert shape == list(spec.inputs[name][1]), f"{spec}: {name}_grad has shape {shape}"
    f, b = Runner(fwd), Runner(train)
    assert f.sess is not None and b.sess is not None, f"{spec}: onnxruntime should run both graphs"

    for sizes in spec.sizes:
        x = {n: rng.uniform(-1.5, 1.5, [sizes.get(d, d) for d in s])
             for n, (t, s) in spec.inputs.items() if t == DOUBLE}
        feeds = {**x, **{n: np.asarray(v, np.int64) for n, v in spec.ints.items()}}
        ys = f(feeds)
        cs = [rng.standard_normal(y.shape) for y in ys]
        by_name = dict(zip(b.outputs, b({**feeds, **{h + "_grad": c for h, c in zip(spec.outputs, cs)}})))

        def objective(changed):
            return sum(float(np.sum(c * y)) for c, y in zip(cs, f({**feeds, **changed})))

        for n in spec.wrt:
            got = by_name[n + "_grad"]
            assert got.shape == x[n].shape, f"{spec} at {sizes}: {n}_grad has shape {got.shape}"
            want = np.zeros_like(x[n])
            for j in range(x[n].size):
                step = np.zeros_like(x[n])
                step.reshape(-1)[j] = eps
                want.reshape(-1)[j] = (objective({n: x[n] + step}) - objective({n: x[n] - step})) / (2 * eps)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"{spec} at {sizes}: {n}_grad")


def node(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, **attrs)


def i64(*values):
    return np.array(values, dtype=np.int64)


N2, N3, N4 = {"N": 2}, {"N": 3}, {"N": 4}

SYMBOLIC = [
    Spec("Transpose-N", [node("Transpose", ["x"], ["y"], perm=[2, 0, 1])],
         {"x": (DOUBLE, ["N", 2, 3])}, ["y"], ["x"], [N2, N3]),
    Spec("Reshape-N-zero-minus1", [node("Reshape", ["x", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 2, 3])}, ["y"], ["x"], [N2, N3], inits={"s": i64(0, -1)}),
    Spec("Reshape-N-flat-opset13", [node("Reshape", ["x", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 2, 3])}, ["y"], ["x"], [N2, N3], inits={"s": i64(-1)}, opset=13),
    Spec("Reshape-N-runtime-shape", [node("Reshape", ["x", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 6]), "s": (INT64, [3])}, ["y"], ["x"], [N2], ints={"s": [-1, 3, 2]}),
    Spec("Flatten-N-negative-axis", [node("Flatten", ["x"], ["y"], axis=-1)],
         {"x": (DOUBLE, ["N", 2, 3])}, ["y"], ["x"], [N2, N3]),
    Spec("Flatten-N-axis0-opset13", [node("Flatten", ["x"], ["y"], axis=0)],
         {"x": (DOUBLE, ["N", 3])}, ["y"], ["x"], [N2, N3], opset=13),
    Spec("Squeeze-Unsqueeze-N", [node("Squeeze", ["x", "a"], ["t"]), node("Unsqueeze", ["t", "b"], ["y"])],
         {"x": (DOUBLE, ["N", 1, 3])}, ["y"], ["x"], [N2, N3], inits={"a": i64(-2), "b": i64(0, -1)}),
    Spec("Expand-N-both-ways", [node("Expand", ["x", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 1])}, ["y"], ["x"], [N2, N3], inits={"s": i64(2, 1, 4)}),
    Spec("Expand-to-runtime-shape", [node("Shape", ["x"], ["s"]), node("Expand", ["w", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 3]), "w": (DOUBLE, [1, 3])}, ["y"], ["w"], [N2, N3]),
    Spec("Expand-N-opset13", [node("Expand", ["x", "s"], ["y"])],
         {"x": (DOUBLE, ["N", 1, 3])}, ["y"], ["x"], [N2, N3], inits={"s": i64(2, 1)}, opset=13),
    Spec("Slice-N-steps", [node("Slice", ["x", "s", "e", "a", "k"], ["y"])],
         {"x": (DOUBLE, ["N", 5])}, ["y"], ["x"], [N3, N4],
         inits={"s": i64(1, 0), "e": i64(-1, 5), "a": i64(0, 1), "k": i64(1, 2)}),
    Spec("Slice-N-negative-step-clamped", [node("Slice", ["x", "s", "e", "a", "k"], ["y"])],
         {"x": (DOUBLE, ["N", 2])}, ["y"], ["x"], [N2, N3, N4],
         inits={"s": i64(100), "e": i64(INT64_MIN), "a": i64(-2), "k": i64(-2)}),
    Spec("Slice-N-no-axes-opset13", [node("Slice", ["x", "s", "e"], ["y"])],
         {"x": (DOUBLE, ["N", 4])}, ["y"], ["x"], [N2, N3], inits={"s": i64(-2, 1), "e": i64(1000, -1)}, opset=13),
    Spec("Slice-runtime-starts-steps", [node("Slice", ["x", "s", "e", "a", "k"], ["y"])],
         {"x": (DOUBLE, ["N", 5]), "s": (INT64, [2]), "k": (INT64, [2])}, ["y"], ["x"], [N3, N4],
         ints={"s": [-1, 1], "k": [-1, 2]}, inits={"e": i64(0, 100), "a": i64(1, 0)}),
    Spec("Gather-N-repeated", [node("Gather", ["x", "i"], ["y"])],
         {"x": (DOUBLE, ["N", 3])}, ["y"], ["x"], [N2, N3], inits={"i": i64(0, -1, 0)}),
    Spec("Gather-N-repeated-opset13", [node("Gather", ["x", "i"], ["y"])],
         {"x": (DOUBLE, ["N", 3])}, ["y"], ["x"], [N2, N3], inits={"i": i64(0, -1, 0)}, opset=13),
    Spec("Gather-N-unique-scalar-opset13", [node("Gather", ["x", "i"], ["y"], axis=1)],
         {"x": (DOUBLE, [2, "N", 3])}, ["y"], ["x"], [N2, N3], inits={"i": np.array(1, np.int64)}, opset=13),
    Spec("Gather-N-runtime-indices-axis1", [node("Gather", ["x", "i"], ["y"], axis=-1)],
         {"x": (DOUBLE, ["N", 4]), "i": (INT64, [2, 2])}, ["y"], ["x"], [N2, N3], ints={"i": [[3, -1], [0, 1]]}),
    Spec("Gather-N-runtime-indices-opset15", [node("Gather", ["x", "i"], ["y"], axis=1)],
         {"x": (DOUBLE, ["N", 4]), "i": (INT64, [2, 2])}, ["y"], ["x"], [N2, N3], ints={"i": [[3, -1], [0, 1]]},
         opset=15),
    Spec("Gather-N-runtime-scalar", [node("Gather", ["x", "i"], ["y"], axis=1)],
         {"x": (DOUBLE, ["N", 3]), "i": (INT64, [])}, ["y"], ["x"], [N2, N3], ints={"i": -2}),
    Spec("Gather-N-runtime-scalar-opset13", [node("Gather", ["x", "i"], ["y"])],
         {"x": (DOUBLE, ["N", 3]), "i": (INT64, [])}, ["y"], ["x"], [N2, N3], ints={"i": -1}, opset=13),
    Spec("Concat-N-axis1", [node("Concat", ["a", "b"], ["y"], axis=-1)],
         {"a": (DOUBLE, ["N", 2]), "b": (DOUBLE, ["N", 3])}, ["y"], ["a", "b"], [N2, N3]),
    Spec("Concat-symbolic-offsets", [node("Concat", ["a", "b", "c"], ["y"], axis=0)],
         {"a": (DOUBLE, ["N", 3]), "b": (DOUBLE, ["M", 3]), "c": (DOUBLE, [2, 3])}, ["y"], ["b", "c"],
         [{"N": 1, "M": 2}, {"N": 3, "M": 1}]),
    Spec("Split-N-split-input-opset13", [node("Split", ["x", "s"], ["y0", "y1"], axis=1)],
         {"x": (DOUBLE, ["N", 5])}, ["y0", "y1"], ["x"], [N2, N3], inits={"s": i64(2, 3)}, opset=13),
    Spec("Split-N-num-outputs-along-N", [node("Split", ["x"], ["y0", "y1"], axis=0, num_outputs=2)],
         {"x": (DOUBLE, ["N", 2])}, ["y0", "y1"], ["x"], [N2, N3, N4]),
    Spec("Split-N-some-outputs", [node("Split", ["x"], ["y0", "y1", "y2"], axis=0, num_outputs=3)],
         {"x": (DOUBLE, ["N", 2])}, ["y1"], ["x"], [N3, {"N": 5}]),
    Spec("Tile-N", [node("Tile", ["x", "r"], ["y"])],
         {"x": (DOUBLE, ["N", 2])}, ["y"], ["x"], [N2, N3], inits={"r": i64(2, 3)}),
    Spec("Tile-N-runtime-repeats-opset13", [node("Tile", ["x", "r"], ["y"])],
         {"x": (DOUBLE, ["N", 2]), "r": (INT64, [2])}, ["y"], ["x"], [N2], ints={"r": [3, 2]}, opset=13),
    Spec("Pad-N-constant-runtime-pads", [node("Pad", ["x", "p"], ["y"])],
         {"x": (DOUBLE, ["N", 3]), "p": (INT64, [4])}, ["y"], ["x"], [N2, N3], ints={"p": [1, -1, 0, 2]}),
    Spec("Pad-N-edge", [node("Pad", ["x", "p"], ["y"], mode="edge")],
         {"x": (DOUBLE, ["N", 3])}, ["y"], ["x"], [N2, N3], inits={"p": i64(2, 1, 1, 0)}),
    Spec("Pad-N-reflect-axes", [node("Pad", ["x", "p", "", "a"], ["y"], mode="reflect")],
         {"x": (DOUBLE, ["N", 3])}, ["y"], ["x"], [N3, N4], inits={"p": i64(2, 1), "a": i64(-2)}),
    Spec("Pad-N-constant-runtime-axes", [node("Pad", ["x", "p", "", "a"], ["y"])],
         {"x": (DOUBLE, ["N", 3, 2]), "a": (INT64, [2])}, ["y"], ["x"], [N2, N3], ints={"a": [-1, 0]},
         inits={"p": i64(1, 0, -1, 2)}, output_shapes={"y": [None, 3, None]}),
    Spec("Trilu-N", [node("Trilu", ["x", "k"], ["y"], upper=0)],
         {"x": (DOUBLE, ["N", 3, 3])}, ["y"], ["x"], [N2], inits={"k": np.array(1, np.int64)}),
]

# Static shapes, but forms the table's checker cannot build or its reference evaluator cannot run.
STATIC = [
    Spec("Split13-some-outputs", [node("Split", ["x"], ["y0", "y1", "y2"], axis=-1)],
         {"x": (DOUBLE, [2, 6])}, ["y0", "y2"], ["x"], [{}], opset=13),
    Spec("Split18-middle-output-only", [node("Split", ["x"], ["y0", "y1", "y2"], axis=1, num_outputs=3)],
         {"x": (DOUBLE, [2, 5])}, ["y1"], ["x"], [{}]),
    Spec("Split18-split-input-first-outputs", [node("Split", ["x", "s"], ["y0", "y1", "y2"], axis=0)],
         {"x": (DOUBLE, [4, 2])}, ["y0", "y1"], ["x"], [{}], inits={"s": i64(1, 1, 2)}),
    Spec("Pad-constant-negative", [node("Pad", ["x", "p"], ["y"])],
         {"x": (DOUBLE, [3, 4])}, ["y"], ["x"], [{}], inits={"p": i64(-1, 1, 1, -2)}),
    Spec("Pad-edge-negative", [node("Pad", ["x", "p"], ["y"], mode="edge")],
         {"x": (DOUBLE, [3, 4])}, ["y"], ["x"], [{}], inits={"p": i64(-1, 2, 1, -2)}),
    Spec("Pad-edge-negative-opset13", [node("Pad", ["x", "p"], ["y"], mode="edge")],
         {"x": (DOUBLE, [3, 3])}, ["y"], ["x"], [{}], inits={"p": i64(1, 1, -1, 2)}, opset=13),
    Spec("Pad-reflect-negative", [node("Pad", ["x", "p"], ["y"], mode="reflect")],
         {"x": (DOUBLE, [3, 4])}, ["y"], ["x"], [{}], inits={"p": i64(1, -1, 2, 2)}),
    Spec("Pad-axes-edge-negative", [node("Pad", ["x", "p", "v", "a"], ["y"], mode="edge")],
         {"x": (DOUBLE, [2, 3, 4])}, ["y"], ["x"], [{}], inits={"p": i64(1, 0, -1, 2), "v": np.array(0.5),
                                                            "a": i64(0, -1)}),
    Spec("Pad-axes-constant-negative-opset21", [node("Pad", ["x", "p", "v", "a"], ["y"])],
         {"x": (DOUBLE, [2, 3, 4])}, ["y"], ["x"], [{}], inits={"p": i64(-1, 1), "v": np.array(-1.0), "a": i64(1)},
         opset=21),
]


@pytest.mark.parametrize("spec", SYMBOLIC, ids=str)
def test_symbolic_dims(spec):
    check(spec)


@pytest.mark.parametrize("spec", STATIC, ids=str)
def test_forms_outside_the_table(spec):
    check(spec)


def test_unnamed_split_output_is_refused():
    """A Split output left unnamed has no known size, so its zero gradient cannot be built."""
    spec = Spec("Split-unnamed", [node("Split", ["x"], ["y0", "", "y2"], axis=1)],
                {"x": (DOUBLE, [2, 6])}, ["y0", "y2"], ["x"], [{}], opset=13)
    with pytest.raises(onnxgrad.UnsupportedError, match="output 1 is unnamed"):
        onnxgrad.build_gradient(build(spec), loss=spec.outputs, requires_grad=spec.wrt)


def test_pad_reflect_with_runtime_pads_is_refused():
    spec = Spec("Pad-reflect-runtime-pads", [node("Pad", ["x", "p"], ["y"], mode="reflect")],
                {"x": (DOUBLE, [4, 5]), "p": (INT64, [4])}, ["y"], ["x"], [{}])
    with pytest.raises(onnxgrad.UnsupportedError, match="pads computed at run time"):
        onnxgrad.build_gradient(build(spec), loss=spec.outputs, requires_grad=spec.wrt)


def test_slice_with_runtime_axes_is_refused():
    spec = Spec("Slice-runtime-axes", [node("Slice", ["x", "s", "e", "a"], ["y"])],
                {"x": (DOUBLE, [4, 5]), "a": (INT64, [1])}, ["y"], ["x"], [{}], inits={"s": i64(1), "e": i64(3)})
    with pytest.raises(onnxgrad.UnsupportedError, match="axes input is computed at run time"):
        onnxgrad.build_gradient(build(spec), loss=spec.outputs, requires_grad=spec.wrt)
