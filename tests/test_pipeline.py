"""The pass pipeline and the graph it works on: every written value typed, phases kept through a write and a
read, graph editing, and the pipeline's own checks."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper as h, numpy_helper

import onnxgrad
from onnxgrad import pipeline
from onnxgrad.builder import Builder, Names
from onnxgrad.contract import BACKWARD, FORWARD, OPTIMIZER, PHASES_KEY, RECOMPUTE
from onnxgrad.errors import InternalError, InvalidModelError
from onnxgrad.ir import Graph, Node, Value, from_model
from onnxgrad.protos import decode_phases, encode_phases
from onnxgrad.passes.schedule import is_topological, stable_topological_order

MODELS = Path(__file__).resolve().parent.parent / "models"


def assert_typed(model: onnx.ModelProto) -> None:
    """Every value a node writes has an element type and a shape of known rank in the file: in value_info, or
    as a graph output."""
    g = model.graph
    typed = {vi.name: vi.type.tensor_type for vi in list(g.value_info) + list(g.output) + list(g.input)}
    missing = []
    for n in g.node:
        for name in n.output:
            t = typed.get(name)
            if name and (t is None or not t.elem_type or not t.HasField("shape")):
                missing.append(f"{n.op_type}:{name}")
    assert not missing, f"{len(missing)} values without a type and shape, e.g. {missing[:5]}"


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("optimizer", [None, "adamw"])
def test_every_value_of_the_shipped_models_training_graphs_is_typed(name, optimizer):
    result = onnxgrad.build(MODELS / f"{name}.onnx", dims={"N": 4}, optimizer=optimizer)
    assert_typed(result.model)
    phases = decode_phases({p.key: p.value for p in result.model.metadata_props}[PHASES_KEY],
                           len(result.model.graph.node))
    assert phases[0] == FORWARD and BACKWARD in phases and (OPTIMIZER in phases) == (optimizer is not None)
    # the phases come in the order a step runs them
    order = [FORWARD, BACKWARD, OPTIMIZER]
    assert [order.index(p) for p in phases] == sorted(order.index(p) for p in phases)


def test_symbolic_dims_stay_symbols():
    result = onnxgrad.build(MODELS / "mlp.onnx")
    assert_typed(result.model)
    dims = {d.dim_param for vi in result.model.graph.value_info for d in vi.type.tensor_type.shape.dim}
    assert "N" in dims


def test_phases_survive_a_write_and_a_read():
    train = onnxgrad.build(MODELS / "mlp.onnx", dims={"N": 4}, optimizer="sgd").model
    graph = from_model(onnx.shape_inference.infer_shapes(train))
    again = graph.to_model()
    meta = lambda m: {p.key: p.value for p in m.metadata_props}  # noqa: E731
    assert meta(again)[PHASES_KEY] == meta(train)[PHASES_KEY]
    assert {n.phase for n in graph.nodes} == {FORWARD, BACKWARD, OPTIMIZER}


def test_phase_runs_round_trip_and_reject_a_wrong_count():
    phases = [FORWARD] * 3 + [RECOMPUTE, BACKWARD, BACKWARD, RECOMPUTE, OPTIMIZER]
    text = encode_phases(phases)
    assert decode_phases(text, len(phases)) == phases
    with pytest.raises(InvalidModelError, match="covers 8 nodes, the graph has 9"):
        decode_phases(text, len(phases) + 1)
    with pytest.raises(InvalidModelError, match="not a JSON list"):
        decode_phases("not json", 3)


# -- graph editing ----------------------------------------------------------------------------------------
def chain_graph() -> Graph:
    """x -> Sigmoid -> a -> Tanh -> b -> Mul(b, a) -> y"""
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    nodes = [h.make_node("Sigmoid", ["x"], ["a"], name="s"), h.make_node("Tanh", ["a"], ["b"], name="t"),
             h.make_node("Mul", ["b", "a"], ["y"], name="m")]
    model = h.make_model(h.make_graph(nodes, "g", [x], [y]), opset_imports=[h.make_opsetid("", 18)])
    return from_model(onnx.shape_inference.infer_shapes(model))


def run(graph: Graph, x: np.ndarray) -> np.ndarray:
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(graph.to_model()).run(None, {"x": x})[0]


def test_clone_insert_and_replace_uses_keep_the_result():
    graph = chain_graph()
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    expected = run(graph, x)
    s, _, m = graph.nodes
    copy = graph.clone(s, "s_mirror", ["a_mirror"], phase=RECOMPUTE)
    assert copy.outputs[0].shape == (2, 3) and copy.outputs[0].elem_type == TensorProto.FLOAT
    assert copy.inputs[0] is s.inputs[0] and (copy, 0) in s.inputs[0].uses
    graph.insert_before(m, [copy])
    assert graph.replace_all_uses(s.outputs[0], copy.outputs[0], where=lambda n: n is m) == 1
    assert [n.name for n in graph.nodes] == ["s", "t", "s_mirror", "m"]
    assert m.inputs[1] is copy.outputs[0] and (m, 1) not in s.outputs[0].uses
    np.testing.assert_array_equal(run(graph, x), expected)
    assert graph.to_model().graph.node[2].name == "s_mirror"


def test_insert_after_and_remove_dead():
    graph = chain_graph()
    s, t, m = graph.nodes
    extra = Builder(graph, Names(list(graph.values)), prefix="unused").Neg(s.outputs[0]).producer
    graph.nodes.remove(extra)
    graph.insert_after(s, [extra])
    assert graph.nodes.index(extra) == 1
    assert graph.remove_dead() == 1
    assert extra not in graph.nodes and (extra, 0) not in s.outputs[0].uses
    assert extra.outputs[0].name not in graph.values


def test_remove_refuses_a_node_whose_output_is_read():
    graph = chain_graph()
    with pytest.raises(InternalError, match="still used"):
        graph.remove([graph.nodes[0]])
    s, t, m = graph.nodes
    with pytest.raises(InternalError, match="'y' is still used"):  # a graph output
        graph.remove([m, t])
    graph.outputs[:] = [s.outputs[0]]
    graph.remove([m, t])  # t's reader goes with it
    assert graph.nodes == [s] and s.outputs[0].uses == []


def test_reorder_and_the_stable_topological_repair():
    graph = chain_graph()
    s, t, m = graph.nodes
    graph.reorder([t, s, m])
    assert not is_topological(graph)
    graph.reorder(stable_topological_order(graph.nodes))
    assert graph.nodes == [s, t, m] and is_topological(graph)


def test_builder_types_what_it_creates():
    graph = chain_graph()
    op = Builder(graph, Names(list(graph.values)), phase=BACKWARD)
    a = graph.values["a"]
    r = op.ReduceSum(op.Mul(a, a), op.ints([1]), keepdims=0)
    t = op.Transpose(a, perm=[1, 0])
    e = op.Equal(a, op.const(0.5, TensorProto.FLOAT))
    assert (r.elem_type, r.shape) == (TensorProto.FLOAT, (2,))
    assert t.shape == (3, 2) and e.elem_type == TensorProto.BOOL and e.shape == (2, 3)
    assert r.producer.phase == BACKWARD


def test_a_pass_out_of_place_fails_with_the_missing_fact():
    from onnxgrad.passes.gradient import Gradient
    build = pipeline.Build(str(MODELS / "mlp.onnx"), pipeline.Options())
    with pytest.raises(InternalError, match="the gradient pass needs graph, heads, lowered"):
        pipeline.run(build, [Gradient()])


def test_the_report_times_every_pass():
    result = onnxgrad.build(MODELS / "mlp.onnx", dims={"N": 4}, loss_fn="cross-entropy", target="logits",
                            loss_options={"loss_output": "ce"}, optimizer="sgd")
    assert list(result.report["passes"]) == ["read", "infer", "heads", "lower", "gradient", "expand_loss",
                                             "schedule", "optimizer", "validate"]


def test_requires_grad_messages_say_what_is_true():
    """A BatchNormalization statistic the loss reads but no rule differentiates (exit 4, not "unreachable"), and
    a float8 value named by its type rather than called an integer."""
    from onnxgrad.errors import UnsupportedError, UsageError
    stats = [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("s", "b", "m", "v")]
    nodes = [h.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn"),
             h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                  h.make_tensor_value_info("q", TensorProto.FLOAT8E4M3FN, [3])],
                     [h.make_tensor_value_info("loss", TensorProto.FLOAT, [])], stats)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    with pytest.raises(UnsupportedError, match="depends on it only through input 3 of BatchNormalization node 'bn', "
                                               "which no gradient rule differentiates"):
        onnxgrad.build(model, requires_grad=["m"])
    with pytest.raises(UsageError, match="--requires-grad q: has the element type float8e4m3fn"):
        onnxgrad.build(model, requires_grad=["q"])
