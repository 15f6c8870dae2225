"""Gradients through Scan and Loop.

Each model goes through `check_gradients` (tests/test_control_flow.py): the inner-product test with central
differences in float64, the full Jacobian on these tiny shapes, and the float32 training graph in onnxruntime.
The forms: several carries, scan inputs and outputs, axes and directions, integer carries, outputs the loss does
not read, weights read from the outer scope, an If and a Scan inside a loop, constant, runtime and bounded trip
counts, data-dependent conditions; and the refusals.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnxgrad
from onnxgrad import runtime
from onnxgrad.errors import UnsupportedError, UsageError
from test_control_flow import _make, check_gradients, const, vi


def _rng(seed=0):
    return np.random.default_rng(seed)


# -- Scan ----------------------------------------------------------------------------------------------------------
def scan_graph(*, in_axes=(0, 0), in_dirs=(0, 0), out_axes=(0, 0), out_dirs=(0, 0), S=4):
    """Two float carries (a, b), an integer counter, two scan inputs x [S,3] (or [3,S] on axis 1) and z [S,2],
    two scan outputs; the body reads w and v from outside. loss = sum(y1^2) + sum(y2 * c) + sum(aT) + sum(bT^2)."""
    def graph_fn(elem, dtype):
        body = h.make_graph([
            h.make_node("Mul", ["xs", "w"], ["xw"]), h.make_node("Add", ["a_in", "xw"], ["a1"]),
            h.make_node("Tanh", ["a1"], ["a_out"]),
            h.make_node("MatMul", ["zs", "v"], ["zv"]), h.make_node("Mul", ["b_in", "zv"], ["b1"]),
            h.make_node("Sin", ["b1"], ["b_out"]),
            h.make_node("Add", ["k_in", "one"], ["k_out"]), h.make_node("Cast", ["k_out"], ["kf"], to=elem),
            h.make_node("Mul", ["a_out", "kf"], ["y1"]), h.make_node("Mul", ["a_out", "b_out"], ["y2"]),
        ], "body", [vi("a_in", elem, [3]), vi("b_in", elem, [3]), vi("k_in", T.INT64, []), vi("xs", elem, [3]),
                    vi("zs", elem, [2])],
            [vi("a_out", elem, [3]), vi("b_out", elem, [3]), vi("k_out", T.INT64, []), vi("y1", elem, [3]),
             vi("y2", elem, [3])])
        x_shape = [S, 3] if in_axes[0] == 0 else [3, S]
        y_shape = [[S, 3] if a == 0 else [3, S] for a in out_axes]
        nodes = [h.make_node("Scan", ["a0", "b0", "k0", "x", "z"], ["aT", "bT", "kT", "y1s", "y2s"], body=body,
                             num_scan_inputs=2, scan_input_axes=list(in_axes), scan_input_directions=list(in_dirs),
                             scan_output_axes=list(out_axes), scan_output_directions=list(out_dirs), name="sweep"),
                 h.make_node("ReduceSumSquare", ["y1s"], ["l1"], keepdims=0),
                 h.make_node("Mul", ["y2s", "c"], ["y2c"]), h.make_node("ReduceSum", ["y2c"], ["l2"], keepdims=0),
                 h.make_node("ReduceSum", ["aT"], ["l3"], keepdims=0),
                 h.make_node("ReduceSumSquare", ["bT"], ["l4"], keepdims=0),
                 h.make_node("Sum", ["l1", "l2", "l3", "l4"], ["loss"])]
        c = np.linspace(-1, 1, S * 3).reshape(y_shape[1]).astype(dtype)
        return h.make_graph(nodes, "scan", [vi("x", elem, x_shape), vi("z", elem, [S, 2]), vi("a0", elem, [3]),
                                            vi("b0", elem, [3]), vi("w", elem, [3]), vi("v", elem, [2, 3])],
                            [vi("loss", elem, [])], [const("k0", 0), const("one", 1), const("c", c, dtype)],
                            value_info=[vi("aT", elem, [3]), vi("bT", elem, [3]), vi("y1s", elem, y_shape[0]),
                                        vi("y2s", elem, y_shape[1])])
    return graph_fn


def scan_feeds(in_axes=(0, 0), S=4):
    rng = _rng(1)
    x_shape = (S, 3) if in_axes[0] == 0 else (3, S)
    return {"x": rng.uniform(-1, 1, x_shape), "z": rng.uniform(-1, 1, (S, 2)), "a0": rng.uniform(-1, 1, 3),
            "b0": rng.uniform(0.5, 1, 3), "w": rng.uniform(-1, 1, 3), "v": rng.uniform(-1, 1, (2, 3))}


SCAN_FORMS = {
    "forward": {},
    "reverse-inputs": {"in_dirs": (1, 0)},
    "reverse-outputs": {"out_dirs": (0, 1)},
    "axis-1-input-and-output": {"in_axes": (1, 0), "out_axes": (1, 0)},
    "negative-axes-all-reversed": {"in_axes": (-1, 0), "in_dirs": (1, 1), "out_axes": (0, -1), "out_dirs": (1, 1)},
}


@pytest.mark.parametrize("form", list(SCAN_FORMS), ids=list(SCAN_FORMS))
def test_scan_gradients(form):
    attrs = SCAN_FORMS[form]
    check_gradients(scan_graph(**attrs), ["loss"], ["x", "z", "a0", "b0", "w", "v"],
                    scan_feeds(attrs.get("in_axes", (0, 0))))


def test_scan_outputs_the_loss_does_not_read():
    """Only the final carry a reaches the loss: b, the scan outputs and z get no gradient, and none is built."""
    def graph_fn(elem, dtype):
        g = scan_graph()(elem, dtype)
        del g.node[1:]
        g.node.append(h.make_node("ReduceSum", ["aT"], ["loss"], keepdims=0))
        return g
    check_gradients(graph_fn, ["loss"], ["x", "a0", "w"], scan_feeds())
    train = onnxgrad.build(_make(graph_fn, np.float32, 18), requires_grad=["x", "a0", "w"]).model
    back = next(n for n in train.graph.node if n.op_type == "Scan" and n.name != "sweep")
    attrs = {a.name: h.get_attribute_value(a) for a in back.attribute}
    # carried: the gradients of a and b, w's sum; scanned: x, z and the three stacked carries, no output gradient
    assert len(back.input) - attrs["num_scan_inputs"] == 3 and attrs["num_scan_inputs"] == 5
    assert len(back.output) == 3 + 1  # x's gradient is the one scan output


def test_scan_forward_output_and_residual_types():
    """The forward Scan keeps its outputs and gains one stacked carry per carry, typed; the training graph
    passes onnx's strict shape inference with every value typed (validate)."""
    train = onnxgrad.build(_make(scan_graph(), np.float32, 18), requires_grad=["w", "x"]).model
    fwd = next(n for n in train.graph.node if n.op_type == "Scan" and n.name == "sweep")
    assert list(fwd.output[:5]) == ["aT", "bT", "kT", "y1s", "y2s"] and len(fwd.output) == 8
    types = {v.name: v.type.tensor_type for v in train.graph.value_info}
    assert [[d.dim_value for d in types[o].shape.dim] for o in fwd.output[5:]] == [[4, 3], [4, 3], [4]]
    back = [n for n in train.graph.node if n.op_type == "Scan" and n.name != "sweep"]
    assert len(back) == 1
    body = next(a.g for a in back[0].attribute if a.name == "body")
    typed = {v.name for v in [*body.value_info, *body.input, *body.output] if v.type.tensor_type.HasField("shape")}
    assert {o for n in body.node for o in n.output} <= typed


def test_scan_inside_scan_and_if_inside_scan():
    """The outer body holds an inner Scan (a running sum over a row's halves) and an If on a scan input."""
    def graph_fn(elem, dtype):
        inner = h.make_graph([h.make_node("Mul", ["e", "w"], ["ew"]), h.make_node("Add", ["s_in", "ew"], ["s_out"])],
                             "inner", [vi("s_in", elem, [2]), vi("e", elem, [2])], [vi("s_out", elem, [2])])
        then = h.make_graph([h.make_node("Mul", ["s2", "s2"], ["r"])], "then", [], [vi("r", elem, [2])])
        other = h.make_graph([h.make_node("Sin", ["s2"], ["r"])], "else", [], [vi("r", elem, [2])])
        body = h.make_graph([h.make_node("Reshape", ["row", "shape2"], ["halves"]),
                             h.make_node("Scan", ["h_in", "halves"], ["s2"], body=inner, num_scan_inputs=1),
                             h.make_node("If", ["flag"], ["r"], then_branch=then, else_branch=other),
                             h.make_node("Tanh", ["r"], ["h_out"])], "body",
                            [vi("h_in", elem, [2]), vi("row", elem, [4]), vi("flag", T.BOOL, [])],
                            [vi("h_out", elem, [2])])
        nodes = [h.make_node("Scan", ["h0", "x", "flags"], ["hT"], body=body, num_scan_inputs=2, name="outer"),
                 h.make_node("ReduceSumSquare", ["hT"], ["loss"], keepdims=0)]
        return h.make_graph(nodes, "nested", [vi("x", elem, [3, 4]), vi("h0", elem, [2]), vi("w", elem, [2])],
                            [vi("loss", elem, [])],
                            [const("flags", [True, False, True], bool), const("shape2", [2, 2])],
                            value_info=[vi("hT", elem, [2])])
    rng = _rng(2)
    check_gradients(graph_fn, ["loss"], ["x", "h0", "w"],
                    {"x": rng.uniform(-1, 1, (3, 4)), "h0": rng.uniform(-1, 1, 2), "w": rng.uniform(-1, 1, 2)})


@pytest.mark.parametrize("steps,batch", [(3, 2), (5, 1)])
def test_scan_with_symbolic_length_and_batch(steps, batch):
    """One training graph for every sequence length S and batch B: the stacked carries are [S, B, 3]."""
    def graph_fn(elem, dtype):
        body = h.make_graph([h.make_node("Mul", ["xs", "w"], ["xw"]), h.make_node("Add", ["a_in", "xw"], ["a1"]),
                             h.make_node("Tanh", ["a1"], ["a_out"]), h.make_node("Mul", ["a_out", "xs"], ["y"])],
                            "body", [vi("a_in", elem, ["B", 3]), vi("xs", elem, ["B", 3])],
                            [vi("a_out", elem, ["B", 3]), vi("y", elem, ["B", 3])])
        return h.make_graph([h.make_node("Scan", ["a0", "x"], ["aT", "ys"], body=body, num_scan_inputs=1, name="s"),
                             h.make_node("ReduceSumSquare", ["ys"], ["loss"], keepdims=0)], "g",
                            [vi("x", elem, ["S", "B", 3]), vi("a0", elem, ["B", 3]), vi("w", elem, [3])],
                            [vi("loss", elem, [])])
    rng = _rng(6)
    check_gradients(graph_fn, ["loss"], ["x", "a0", "w"], {"x": rng.uniform(-1, 1, (steps, batch, 3)),
                                                           "a0": rng.uniform(-1, 1, (batch, 3)),
                                                           "w": rng.uniform(-1, 1, 3)})


def test_scan_body_with_a_random_op_is_refused():
    def graph_fn(elem, dtype):
        body = h.make_graph([h.make_node("RandomNormalLike", ["e"], ["noise"]),
                             h.make_node("Mul", ["e", "noise"], ["m"]),
                             h.make_node("Add", ["s_in", "m"], ["s_out"])], "body",
                            [vi("s_in", elem, [2]), vi("e", elem, [2])], [vi("s_out", elem, [2])])
        return h.make_graph([h.make_node("Scan", ["s0", "x"], ["sT"], body=body, num_scan_inputs=1, name="noisy"),
                             h.make_node("ReduceSum", ["sT"], ["loss"], keepdims=0)], "g",
                            [vi("s0", elem, [2]), vi("x", elem, [3, 2])], [vi("loss", elem, [])],
                            value_info=[vi("sT", elem, [2])])
    with pytest.raises(UnsupportedError, match=r"Scan node 'noisy': RandomNormalLike .* draws random numbers"):
        onnxgrad.build(_make(graph_fn, np.float32, 18), requires_grad=["x"])


# -- Loop ----------------------------------------------------------------------------------------------------------
def loop_graph(trip="const", cond="none", S=4):
    """h = tanh(h * w + x[i]), y_i = h^2 (a scan output), an integer counter carried; x and w read from outside.
    trip: "const" (an initializer), "input" (a graph input, known at run time only) or "none";
    cond: "none", or "data" (the body stops when sum(h) > the graph input `stop`)."""
    def graph_fn(elem, dtype):
        cond_nodes = ([h.make_node("Identity", ["cond_in"], ["cond_out"])] if cond == "none" else
                      [h.make_node("ReduceSum", ["h_out"], ["hs"], keepdims=0),
                       h.make_node("LessOrEqual", ["hs", "stop"], ["cond_out"])])
        body = h.make_graph(cond_nodes[:0] + [
            h.make_node("Gather", ["x", "i"], ["row"], axis=0),
            h.make_node("Mul", ["h_in", "w"], ["hw"]), h.make_node("Add", ["hw", "row"], ["pre"]),
            h.make_node("Tanh", ["pre"], ["h_out"]), h.make_node("Add", ["cnt_in", "one"], ["cnt_out"]),
            h.make_node("Mul", ["h_out", "h_out"], ["y"])] + cond_nodes, "body",
            [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []), vi("h_in", elem, [3]), vi("cnt_in", T.INT64, [])],
            [vi("cond_out", T.BOOL, []), vi("h_out", elem, [3]), vi("cnt_out", T.INT64, []), vi("y", elem, [3])])
        inputs = [vi("x", elem, [S, 3]), vi("h0", elem, [3]), vi("w", elem, [3])]
        inits = [const("c0", 0), const("one", 1)]
        if trip == "const":
            inits.append(const("trip", S))
        elif trip == "input":
            inputs.append(vi("trip", T.INT64, []))
        if cond == "data":
            inputs.append(vi("stop", elem, []))
        loop_inputs = ["trip" if trip != "none" else "", "go" if cond == "data" else "", "h0", "c0"]
        if cond == "data":
            inits.append(const("go", True, bool))
        nodes = [h.make_node("Loop", loop_inputs, ["hT", "cT", "ys"], body=body, name="rec"),
                 h.make_node("ReduceSumSquare", ["ys"], ["l1"], keepdims=0),
                 h.make_node("ReduceSum", ["hT"], ["l2"], keepdims=0), h.make_node("Add", ["l1", "l2"], ["loss"])]
        return h.make_graph(nodes, "loop", inputs, [vi("loss", elem, [])], inits,
                            value_info=[vi("hT", elem, [3]), vi("ys", elem, [None, 3])])
    return graph_fn


def loop_feeds(S=4, **extra):
    rng = _rng(3)
    return {"x": rng.uniform(-1, 1, (S, 3)), "h0": rng.uniform(-1, 1, 3), "w": rng.uniform(-1, 1, 3), **extra}


def test_loop_constant_trip_count():
    check_gradients(loop_graph("const"), ["loss"], ["x", "h0", "w"], loop_feeds(), opset=13)


def _untyped_in_bodies(g: onnx.GraphProto) -> list[str]:
    """Values that the nodes of g's subgraphs (nested ones too) produce and that have no shape there."""
    missing = []
    for node in g.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                typed = {v.name for v in [*a.g.value_info, *a.g.input, *a.g.output]
                         if v.type.tensor_type.HasField("shape")}
                missing += [o for n in a.g.node for o in n.output if o and o not in typed]
                missing += _untyped_in_bodies(a.g)
    return missing


@pytest.mark.parametrize("mirror", [None, "mxnet"])
def test_every_value_in_the_loop_bodies_is_typed(mirror):
    """The forward and backward bodies, and with recomputation the segment loops inside them, are typed as
    the rest of the graph is: every value a node there writes has its shape in the body's value_info."""
    for fwd, wrt in [(_make(loop_graph("const", S=16), np.float32, 13), ["x", "h0", "w"]),
                     (_make(scan_graph(S=16), np.float32, 18), ["x", "z", "a0", "w"])]:
        train = onnxgrad.build(fwd, requires_grad=wrt, mirror=mirror).model
        assert not _untyped_in_bodies(train.graph)


@pytest.mark.parametrize("trips", [1, 3, 4])
def test_loop_runtime_trip_count(trips):
    """One training graph serves every trip count: the stacked carries have as many rows as iterations ran."""
    check_gradients(loop_graph("input"), ["loss"], ["x", "h0", "w"], loop_feeds(trip=np.array(trips)), opset=13)


@pytest.mark.parametrize("stop", [-10.0, -0.5, 10.0], ids=["one-iteration", "stops-early", "runs-to-trip-count"])
def test_loop_data_dependent_condition(stop):
    """The loop runs 1, 3 and 4 of its 4 iterations (sum(h) after each: -0.65, -0.94, -0.42, -0.69)."""
    feeds = loop_feeds(trip=np.array(4), stop=np.array(stop))
    check_gradients(loop_graph("input", "data"), ["loss"], ["x", "h0", "w"], feeds, opset=13)


def test_loop_with_only_a_condition_needs_a_bound():
    model = _make(loop_graph("none", "data"), np.float32, 13)
    with pytest.raises(UnsupportedError, match=r"^no gradient for Loop node 'rec': the loop has no trip count, only a "
                                               r"condition.* --loop-bound rec=N"):
        onnxgrad.build(model, requires_grad=["x", "w"])
    with pytest.raises(UsageError, match=r"--loop-bound nope=4: no Loop node of that name \(Loop nodes: 'rec'\)"):
        onnxgrad.build(model, requires_grad=["x", "w"], loop_bounds={"nope": 4})


def test_loop_with_only_a_condition_and_a_bound():
    feeds = loop_feeds(stop=np.array(-10.0))  # the condition fails after the first iteration
    bounded = onnxgrad.build(_make(loop_graph("none", "data"), np.float32, 13), requires_grad=["x", "h0", "w"],
                             loop_bounds={"rec": 4}).model
    # the same loop with its trip count given: the gradients must agree
    counted = onnxgrad.build(_make(loop_graph("input", "data"), np.float32, 13), requires_grad=["x", "h0", "w"]).model
    f32 = {k: np.asarray(v, np.float32) for k, v in feeds.items()}
    a = dict(zip([o.name for o in bounded.graph.output], runtime.session(bounded).run(None, f32)))
    b = dict(zip([o.name for o in counted.graph.output],
                 runtime.session(counted).run(None, {**f32, "trip": np.array(4)})))
    for name in ("loss", "x_grad", "h0_grad", "w_grad"):
        np.testing.assert_allclose(a[name], b[name], rtol=1e-6, err_msg=name)
    assert np.abs(a["x_grad"][1:]).max() == 0 and np.abs(a["x_grad"][0]).max() > 0  # stopped early


def test_loop_with_if_and_scan_in_its_body():
    """A Loop whose body holds an If on the iteration's parity and a Scan over the row's elements."""
    def graph_fn(elem, dtype):
        inner = h.make_graph([h.make_node("Mul", ["s_in", "e"], ["se"]), h.make_node("Add", ["se", "e"], ["s_out"])],
                             "inner", [vi("s_in", elem, [1]), vi("e", elem, [1])], [vi("s_out", elem, [1])])
        then = h.make_graph([h.make_node("Mul", ["h_in", "w"], ["r"])], "then", [], [vi("r", elem, [3])])
        other = h.make_graph([h.make_node("Sin", ["h_in"], ["r"])], "else", [], [vi("r", elem, [3])])
        body = h.make_graph([
            h.make_node("Identity", ["cond_in"], ["cond_out"]),
            h.make_node("Mod", ["i", "two"], ["par"]), h.make_node("Equal", ["par", "zero"], ["even"]),
            h.make_node("If", ["even"], ["r"], then_branch=then, else_branch=other),
            h.make_node("Gather", ["x", "i"], ["row"], axis=0), h.make_node("Unsqueeze", ["row", "ax1"], ["col"]),
            h.make_node("Scan", ["s0", "col"], ["acc"], body=inner, num_scan_inputs=1),
            h.make_node("Add", ["r", "acc"], ["pre"]), h.make_node("Tanh", ["pre"], ["h_out"])], "body",
            [vi("i", T.INT64, []), vi("cond_in", T.BOOL, []), vi("h_in", elem, [3])],
            [vi("cond_out", T.BOOL, []), vi("h_out", elem, [3])])
        nodes = [h.make_node("Loop", ["trip", "", "h0"], ["hT"], body=body, name="rec"),
                 h.make_node("ReduceSumSquare", ["hT"], ["loss"], keepdims=0)]
        return h.make_graph(nodes, "loop_nested", [vi("x", elem, [3, 3]), vi("h0", elem, [3]), vi("w", elem, [3])],
                            [vi("loss", elem, [])],
                            [const("trip", 3), const("two", 2), const("zero", 0), const("ax1", [1]),
                             const("s0", [0.5], dtype)], value_info=[vi("hT", elem, [3])])
    rng = _rng(5)
    check_gradients(graph_fn, ["loss"], ["x", "h0", "w"],
                    {"x": rng.uniform(-1, 1, (3, 3)), "h0": rng.uniform(-1, 1, 3), "w": rng.uniform(-1, 1, 3)},
                    opset=13)


def test_loop_bound_from_the_command_line(tmp_path):
    path = tmp_path / "loop.onnx"
    onnx.save(_make(loop_graph("none", "data"), np.float32, 13), str(path))
    out = tmp_path / "train.onnx"

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "onnxgrad", "build-grad", str(path), "-o", str(out), *args],
                              capture_output=True, text=True)
        return proc.returncode, proc.stderr

    code, err = cli("--requires-grad", "x,w")
    assert code == 4 and err.startswith("onnxgrad: error: no gradient for Loop node 'rec'")
    assert "--loop-bound rec=N" in err and len(err.strip().splitlines()) == 1
    assert cli("--requires-grad", "x,w", "--loop-bound", "rec=x") == (2, "onnxgrad: error: --loop-bound 'rec=x': "
                                                                         "expected NAME=N, e.g. decode=64\n")
    code, err = cli("--requires-grad", "x,w", "--loop-bound", "rec=4")
    assert code == 0, err
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feeds = {k: np.asarray(v, np.float32) for k, v in loop_feeds(stop=np.array(10.0)).items()}
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert np.abs(out["x_grad"][-1]).max() > 0  # a condition that stays true: the loop runs to the bound


def test_mirrored_loop_runs_as_segments_with_the_same_gradients():
    """With recomputation asked for, a 16-step Loop with a scan output becomes 4 segments of 4: the forward
    stores 4 carries, the scan output is the segments' rows in order, and every output equals the plain graph's
    (whose gradients the tests above check against finite differences)."""
    fwd = _make(loop_graph("const", S=16), np.float32, 13)
    plain = onnxgrad.build(fwd, requires_grad=["x", "h0", "w"], also_grad=["ys"])
    mirrored = onnxgrad.build(fwd, requires_grad=["x", "h0", "w"], also_grad=["ys"], mirror="mxnet")
    assert mirrored.report["loop_segments"] == {"rec": 4}
    loops = [n for n in mirrored.model.graph.node if n.op_type == "Loop"]
    forward = next(n for n in loops if n.name == "rec")
    types = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in mirrored.model.graph.value_info}
    assert [types[o][0] for o in forward.output[2:]] == [4, 4, 4, 4]  # ys by segment, iterations, h, counter
    feeds = {k: np.asarray(v, np.float32) for k, v in loop_feeds(S=16).items()}
    a = runtime.session(plain.model).run(None, feeds)
    b = runtime.session(mirrored.model).run(None, feeds)
    assert [o.name for o in plain.model.graph.output] == [o.name for o in mirrored.model.graph.output]
    for name, x, y in zip([o.name for o in plain.model.graph.output], a, b):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("form", list(SCAN_FORMS), ids=list(SCAN_FORMS))
def test_mirrored_scan_runs_as_segments_with_the_same_gradients(form):
    """With recomputation asked for, a 16-step Scan becomes 4 segments of 4 in every form of axes and
    directions, and every output equals the plain graph's."""
    attrs = SCAN_FORMS[form]
    fwd = _make(scan_graph(S=16, **attrs), np.float32, 18)
    wrt = ["x", "z", "a0", "b0", "w", "v"]
    plain = onnxgrad.build(fwd, requires_grad=wrt, also_grad=["y1s"])
    mirrored = onnxgrad.build(fwd, requires_grad=wrt, also_grad=["y1s"], mirror="mxnet")
    assert mirrored.report["loop_segments"] == {"sweep": 4}
    forward = next(n for n in mirrored.model.graph.node if n.name == "sweep")
    types = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in mirrored.model.graph.value_info}
    assert [types[o][0] for o in forward.output[5:]] == [4, 4, 4]  # one stored carry per segment
    feeds = {k: np.asarray(v, np.float32) for k, v in scan_feeds(attrs.get("in_axes", (0, 0)), S=16).items()}
    a = runtime.session(plain.model).run(None, feeds)
    b = runtime.session(mirrored.model).run(None, feeds)
    for name, x, y in zip([o.name for o in plain.model.graph.output], a, b):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=name)


def test_loop_schemes_from_the_least_recomputation_up():
    """Unsegmented, √T segments, then each level the equal segments with the fewest carries alive, while a level
    lowers that count; the retry steps the loop holding the most carries first (ties: the one with fewer levels)."""
    from onnxgrad.segments import LoopScheme, next_schemes, schemes
    assert [(s.lengths, s.segments, s.carries, s.extra_passes) for s in schemes(256)] == [
        ((), 256, 256, 0), ((16,), 16, 32, 1), ((8, 8), 4, 20, 2), ((4, 4, 4), 4, 16, 3)]
    assert [s.lengths for s in schemes(64)] == [(), (8,), (4, 4)]
    assert [s.lengths for s in schemes(7)] == [()] and [s.lengths for s in schemes(12)] == [(), (3,)]
    assert schemes(256)[2].describe() == "256 iterations as 4 segments of 8 segments of 8"
    assert schemes(256)[2].record() == {"trips": 256, "segments": [4, 8, 8], "carries": 20, "extra_passes": 2}
    steps = [{"a": LoopScheme(64), "b": LoopScheme(16)}]
    while (step := next_schemes(steps[-1])) is not None:
        steps.append(step)
    assert [(s["a"].lengths, s["b"].lengths) for s in steps] == [((), ()), ((8,), ()), ((8,), (4,)),
                                                                 ((4, 4), (4,))]


@pytest.mark.parametrize("kind", ["Loop", "Scan"])
def test_two_levels_of_segments_give_the_same_outputs(kind):
    """A 16-step Loop (with a scan output) and Scan (every form of output) run as 4 segments of 2 of 2: the stored
    carries are one per outer segment, and every output equals the plain graph's."""
    if kind == "Loop":
        fwd, wrt, also, name = _make(loop_graph("const", S=16), np.float32, 13), ["x", "h0", "w"], ["ys"], "rec"
        feeds = loop_feeds(S=16)
    else:
        fwd, wrt, also, name = (_make(scan_graph(S=16), np.float32, 18), ["x", "z", "a0", "b0", "w", "v"], ["y1s"],
                                "sweep")
        feeds = scan_feeds(S=16)
    plain = onnxgrad.build(fwd, requires_grad=wrt, also_grad=also)
    nested = onnxgrad.build(fwd, requires_grad=wrt, also_grad=also, mirror="budget",
                            mirror_options={"budget": "1e12", "loops": {name: [2, 2]}})
    assert nested.report["loop_schemes"][name]["segments"] == [4, 2, 2]
    assert not _untyped_in_bodies(nested.model.graph)
    feeds = {k: np.asarray(v, np.float32) for k, v in feeds.items()}
    a = runtime.session(plain.model).run(None, feeds)
    b = runtime.session(nested.model).run(None, feeds)
    for out, x, y in zip([o.name for o in plain.model.graph.output], a, b):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=out)


def test_budget_loop_scheme_on_the_command_line(tmp_path):
    """`mirror --budget` logs and reports the scheme each loop got; plain `mirror` keeps √T segments."""
    import json
    path, out, report = tmp_path / "loop.onnx", tmp_path / "train.onnx", tmp_path / "report.json"
    onnx.save(_make(loop_graph("const", S=64), np.float32, 13), str(path))

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "onnxgrad", "mirror", str(path), "-o", str(out),
                               "--requires-grad", "x,h0,w", "--report", str(report), *args],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr, json.loads(report.read_text())

    err, r = cli("--budget", "1.0x")
    assert "loops: rec 64 iterations unsegmented (about 64 carries alive, 0 extra forward passes of the loop)" in err
    assert r["loop_schemes"] == {"rec": {"trips": 64, "segments": [64], "carries": 64, "extra_passes": 0}}
    assert r["loop_segments"] == {}
    err, r = cli()
    assert "loops: rec 64 iterations as 8 segments of 8 (about 16 carries alive, 1 extra forward pass of the " \
           "loop)" in err
    assert r["loop_segments"] == {"rec": 8} and r["loop_schemes"]["rec"]["segments"] == [8, 8]


@pytest.mark.parametrize("stored, peak_carries", [(None, 4), ("h_in", 17), ("h_out", 19)])
def test_simulated_loop_holds_what_onnxruntime_holds(stored, peak_carries):
    """An 8-step Loop over an 8 MiB carry (h_out = h_in * a + x[i] * a) with nothing, Identity(h_in) or
    Identity(h_out) as its scan output, simulated in carries as `memory.measure` measured it in onnxruntime (32.0,
    136.1 and 152.2 MiB). Without scan outputs the last iteration is the peak: the carry it was fed and the body's
    three temporaries. onnxruntime allocates the outputs only after the last iteration and then copies the last
    carry into them, with the carries of the last two iterations still held, and concatenates the kept scan
    outputs. Identity(h_in) is the carry the iteration before returned (for iteration 0, the Loop's input): 7
    carries kept, the last one, and 1 + 8 in the outputs. Identity(h_out) is a copy: 8 kept, 2 carries, 9 outputs."""
    from onnxgrad.api import load_graph
    from onnxgrad.memory.simulate import simulate
    n, steps = 2 * 1024 * 1024, 8
    nodes = [h.make_node("Mul", ["h_in", "a"], ["m1"]), h.make_node("Gather", ["x", "i"], ["g"], axis=0),
             h.make_node("Mul", ["g", "a"], ["m2"]), h.make_node("Add", ["m1", "m2"], ["h_out"]),
             h.make_node("Identity", ["c_in"], ["c_out"])]
    outs = [vi("c_out", T.BOOL, []), vi("h_out", T.FLOAT, [n])]
    if stored:
        nodes.append(h.make_node("Identity", [stored], ["s"]))
        outs.append(vi("s", T.FLOAT, [n]))
    body = h.make_graph(nodes, "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("h_in", T.FLOAT, [n])], outs)
    loop = h.make_node("Loop", ["steps", "", "h0"], ["h_last"] + (["hs"] if stored else []), body=body, name="rec")
    graph = h.make_graph([loop], "g", [vi("h0", T.FLOAT, [n]), vi("x", T.FLOAT, [steps, n]), vi("a", T.FLOAT, [n])],
                         [vi("h_last", T.FLOAT, [n])] + ([vi("hs", T.FLOAT, [steps, n])] if stored else []),
                         [h.make_tensor("steps", T.INT64, [], [steps])])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    assert simulate(load_graph(model)).dynamic_peak == peak_carries * n * 4
