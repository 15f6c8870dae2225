"""onnxgrad.protos: malformed phase metadata is one error for every reader, a subgraph's outer reads leave out
the names it defines, and a model cut to some outputs keeps only what they need and runs."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper as h

from onnxgrad.contract import PHASES_KEY
from onnxgrad.cuda import cuda_fallbacks
from onnxgrad.errors import InvalidModelError
from onnxgrad.ir import from_model
from onnxgrad.protos import (cut_model, decode_phases, encode_phases, model_phases, needed_subgraph, node_reads,
                             outer_references)
from onnxgrad.split import optimizer_node_mask

F = TensorProto.FLOAT


def two_node_model() -> onnx.ModelProto:
    """y = relu(x) * w, z = exp(x): two outputs, one of them needing a node the other does not."""
    w = onnx.numpy_helper.from_array(np.full((2, 3), 2.0, np.float32), "w")
    nodes = [h.make_node("Relu", ["x"], ["r"], name="relu"), h.make_node("Mul", ["r", "w"], ["y"], name="mul"),
             h.make_node("Exp", ["x"], ["z"], name="exp")]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", F, [2, 3])],
                         [h.make_tensor_value_info("y", F, [2, 3]), h.make_tensor_value_info("z", F, [2, 3])], [w],
                         value_info=[h.make_tensor_value_info("r", F, [2, 3])])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8)


# -- phases ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("not json", "not a JSON list of"),
    ('{"forward": 3}', "not a JSON list of"),
    ('[["forward", 1], ["sideways", 2]]', "not a JSON list of"),
    ('[["forward", "3"]]', "not a JSON list of"),
    ('[["forward", 2]]', "covers 2 nodes, the graph has 3"),
])
def test_malformed_phases_are_one_error_for_every_reader(text, message):
    model = two_node_model()
    model.metadata_props.add(key=PHASES_KEY, value=text)
    for read in (model_phases, lambda m: from_model(onnx.shape_inference.infer_shapes(m)), cuda_fallbacks,
                 optimizer_node_mask):
        with pytest.raises(InvalidModelError, match=message):
            read(model)


def test_phases_round_trip_and_a_model_without_them_has_none():
    phases = ["forward", "forward", "backward", "optimizer"]
    assert decode_phases(encode_phases(phases), 4) == phases
    model = two_node_model()
    assert model_phases(model) is None
    model.metadata_props.add(key=PHASES_KEY, value=encode_phases(["forward", "backward", "backward"]))
    assert model_phases(model) == ["forward", "backward", "backward"]


# -- outer reads -----------------------------------------------------------------------------------------------
def nested_if_in_loop() -> onnx.NodeProto:
    """A Loop whose body defines `t` and holds an If; the If's branches read `t` (the body's), `a` (the Loop's
    outer scope) and define `u`, read again inside the branch."""
    then = h.make_graph([h.make_node("Add", ["t", "a"], ["u"]), h.make_node("Mul", ["u", "u"], ["then_out"])],
                        "then", [], [h.make_tensor_value_info("then_out", F, [1])])
    other = h.make_graph([h.make_node("Identity", ["b"], ["else_out"])], "else", [],
                         [h.make_tensor_value_info("else_out", F, [1])])
    body = h.make_graph(
        [h.make_node("Neg", ["carry"], ["t"]),
         h.make_node("If", ["cond_in"], ["picked"], then_branch=then, else_branch=other),
         h.make_node("Identity", ["cond_in"], ["cond_out"]),
         h.make_node("Add", ["picked", "c"], ["carry_out"])],
        "body",
        [h.make_tensor_value_info("i", TensorProto.INT64, []),
         h.make_tensor_value_info("cond_in", TensorProto.BOOL, []), h.make_tensor_value_info("carry", F, [1])],
        [h.make_tensor_value_info("cond_out", TensorProto.BOOL, []), h.make_tensor_value_info("carry_out", F, [1])])
    return h.make_node("Loop", ["trips", "", "start"], ["end"], body=body)


def test_outer_reads_of_a_nested_body_leave_out_names_defined_inside():
    loop = nested_if_in_loop()
    body = loop.attribute[0].g
    assert sorted(outer_references(body)) == ["a", "b", "c"]
    then = next(a.g for a in body.node[1].attribute if a.name == "then_branch")
    assert outer_references(then) == ["t", "a"]  # the Loop body's `t` is outer to the branch
    reads = node_reads(loop)
    assert reads[:2] == ["trips", "start"] and sorted(reads[2:]) == ["a", "b", "c"]


# -- cutting ---------------------------------------------------------------------------------------------------
def test_a_model_cut_to_an_output_keeps_only_what_it_needs_and_runs():
    model = two_node_model()
    nodes, names = needed_subgraph(model.graph, ["y"])
    assert [n.name for n in nodes] == ["relu", "mul"] and names == {"x", "r", "w", "y"}
    cut = cut_model(model, nodes, ["y"])
    onnx.checker.check_model(cut, full_check=True)
    assert [n.name for n in cut.graph.node] == ["relu", "mul"]
    assert [o.name for o in cut.graph.output] == ["y"] and [t.name for t in cut.graph.initializer] == ["w"]
    x = np.array([[-1, 0, 1], [2, -3, 4]], np.float32)
    (y,) = ort.InferenceSession(cut.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0) * 2)


def test_cutting_to_an_output_without_a_type_is_refused():
    model = two_node_model()
    del model.graph.value_info[:]
    with pytest.raises(InvalidModelError, match="declares no type for 'r'"):
        cut_model(model, list(model.graph.node[:1]), ["r"])
