"""MXNet's mirroring walks each forward node's inputs once: on a ladder of diamonds, where the number of paths
doubles with every rung, the plan asks the mirror function about each node a bounded number of times (walking
every path asked 2^rungs times and never finished on a 1k-node random DAG)."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper as h, numpy_helper

import onnxgrad
from onnxgrad.memory import mxnet


def diamond_ladder(rungs: int):
    """x -> (Tanh, Sigmoid) -> Add -> (Tanh, Sigmoid) -> Add ... -> ReduceSum: 2^rungs paths from loss to x."""
    nodes, v = [h.make_node("Mul", ["x", "w"], ["v0"], name="scale")], "v0"
    for i in range(rungs):
        nodes += [h.make_node("Tanh", [v], [f"t{i}"], name=f"tanh{i}"),
                  h.make_node("Sigmoid", [v], [f"s{i}"], name=f"sigmoid{i}"),
                  h.make_node("Add", [f"t{i}", f"s{i}"], [f"a{i}"], name=f"add{i}")]
        v = f"a{i}"
    nodes.append(h.make_node("ReduceSum", [v], ["loss"], name="loss", keepdims=0))
    graph = h.make_graph(nodes, "ladder", [h.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                         [h.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                         [numpy_helper.from_array(np.full([8], 0.5, np.float32), "w")])
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=8), len(nodes)


def test_mirror_asks_about_each_node_a_bounded_number_of_times(monkeypatch):
    calls = []
    decide = mxnet.MirrorFunction.decide
    monkeypatch.setattr(mxnet.MirrorFunction, "decide", lambda self, node: calls.append(node.name) or decide(self, node))
    model, count = diamond_ladder(14)
    result = onnxgrad.build(model, mirror="mxnet")
    assert result.report["mirror"]["recomputed"]
    # a few questions per node and edge of the forward graph (187 here), far below the 2^14 paths
    assert len(calls) <= 8 * count, len(calls)
