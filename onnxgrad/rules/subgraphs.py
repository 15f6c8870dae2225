"""Subgraphs read as graphs of their own: what the If, Scan and Loop rules (and the precision pass, for If
branches) do with a body or branch before rewriting or differentiating it."""
from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from ..ir import Graph, Node, Value, from_model, outer_references

RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
                        "Multinomial"})


def as_graph(branch: onnx.GraphProto, outer: Graph) -> Graph:
    """A branch as a Graph of its own: the outer values it reads become its inputs (with their types)."""
    proto = onnx.GraphProto()
    proto.CopyFrom(branch)
    for name in outer_references(branch):
        v = outer.values.get(name)
        proto.input.append(v.value_info() if v is not None else helper.make_empty_tensor_value_info(name))
    model = helper.make_model(proto, opset_imports=[helper.make_opsetid(d, v) for d, v in outer.opsets.items()])
    return from_model(model)


def renamed_copy(g: onnx.GraphProto, mapping: dict[str, str]) -> onnx.GraphProto:
    """A copy of a graph with the names it defines (nested graphs included) replaced; references follow."""
    out = onnx.GraphProto()
    out.CopyFrom(g)

    def rename(graph: onnx.GraphProto) -> None:
        for v in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
            v.name = mapping.get(v.name, v.name)
        for n in graph.node:
            n.input[:] = [mapping.get(x, x) for x in n.input]
            n.output[:] = [mapping.get(x, x) for x in n.output]
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs):
                    rename(sub)
    rename(out)
    return out


def needed_nodes(graph: Graph, outputs: list[Value]) -> list[Node]:
    """The nodes the outputs depend on, in graph order (the forward nodes the backward does not read go)."""
    needed = {id(v) for v in outputs}
    kept = []
    for n in reversed(graph.nodes):
        if any(id(o) in needed for o in n.outputs):
            kept.append(n)
            needed.update(id(v) for v in n.all_inputs if v is not None)
    return kept[::-1]


def draws_random(node: Node, graphs: list[Graph]) -> bool:
    """Whether running the node again would draw other random numbers: a Random* op or Bernoulli, a Dropout
    whose training_mode is not a constant false (looked up in `graphs`), or such an op in its subgraphs."""
    if node.op_type in RANDOM_OPS:
        return True
    if node.op_type == "Dropout":
        training = node.input(2)
        return training is not None and _constant(training, graphs) is not False
    return any(_proto_draws_random(g) for g in node.subgraphs())


def _proto_draws_random(g: onnx.GraphProto) -> bool:
    """Conservative, for nested subgraphs: any Random* op, or a Dropout given a training_mode input."""
    for n in g.node:
        if n.op_type in RANDOM_OPS or (n.op_type == "Dropout" and len(n.input) > 2 and n.input[2]):
            return True
        if any(_proto_draws_random(s) for a in n.attribute for s in ([a.g] if a.HasField("g") else a.graphs)):
            return True
    return False


def _constant(v: Value, graphs: list[Graph]):
    """A boolean scalar's value when an initializer or Constant holds it (in any of the graphs), else None."""
    for graph in graphs:
        value = graph.values.get(v.name)
        if value is None:
            continue
        if value.name in graph.initializers:
            return bool(numpy_helper.to_array(graph.initializers[value.name]).reshape(-1)[0])
        p = value.producer
        if p is not None and p.op_type == "Constant" and p.has_attr("value"):
            return bool(numpy_helper.to_array(p.attr("value")).reshape(-1)[0])
    return None
