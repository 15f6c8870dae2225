"""A small in-memory graph with use-def links.

Protobuf is touched only in `from_model` and `Graph.to_model`; passes work on `Graph`, `Node` and `Value`.
Nodes keep their attributes as `AttributeProto`s, so a node can be cloned without knowing its op.
"""
from __future__ import annotations

import copy
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .weights import copy_fields, is_stub, should_stub, stub_of

FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})

Dim = int | str | None  # a known size, a symbol, or unknown


class Value:
    """One tensor: produced by at most one node, read by any number of nodes."""

    __slots__ = ("name", "producer", "index", "uses", "elem_type", "shape")

    def __init__(self, name: str, elem_type: int | None = None, shape: tuple[Dim, ...] | None = None):
        self.name = name
        self.producer: Node | None = None
        self.index = 0
        self.uses: list[tuple[Node, int]] = []
        self.elem_type = elem_type
        self.shape = shape

    def __repr__(self) -> str:
        return f"Value({self.name!r})"

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.elem_type in FLOAT_TYPES

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        """The shape when every dimension is a known integer, else None."""
        if self.shape is None or not all(isinstance(d, int) for d in self.shape):
            return None
        return tuple(self.shape)

    @property
    def nbytes(self) -> int | None:
        """Bytes of the tensor when its shape and dtype are known."""
        shape = self.static_shape
        if shape is None or not self.elem_type:
            return None
        itemsize = helper.tensor_dtype_to_np_dtype(self.elem_type).itemsize
        return int(np.prod(shape, dtype=np.int64)) * itemsize

    def value_info(self) -> onnx.ValueInfoProto:
        shape = None if self.shape is None else list(self.shape)
        return helper.make_tensor_value_info(self.name, self.elem_type or 0, shape)


class Node:
    __slots__ = ("op_type", "domain", "name", "inputs", "outputs", "attributes", "implicit_inputs")

    def __init__(self, op_type: str, inputs: Iterable[Value | None], outputs: Iterable[Value], name: str,
                 attributes: Iterable[onnx.AttributeProto] = (), domain: str = ""):
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.inputs: list[Value | None] = list(inputs)
        self.outputs: list[Value] = list(outputs)
        self.attributes: list[onnx.AttributeProto] = list(attributes)
        # outer-scope values read by name inside the node's subgraphs (If, Loop, Scan): inputs of the node for
        # the walker, numbered after the explicit ones; never written into the node's input list
        self.implicit_inputs: list[Value] = []
        for i, v in enumerate(self.inputs):
            if v is not None:
                v.uses.append((self, i))
        for i, v in enumerate(self.outputs):
            v.producer, v.index = self, i

    def __repr__(self) -> str:
        return f"Node({self.op_type}, {self.name!r})"

    def attr(self, name: str, default=None):
        for a in self.attributes:
            if a.name == name:
                return helper.get_attribute_value(a)
        return default

    def has_attr(self, name: str) -> bool:
        return any(a.name == name for a in self.attributes)

    def input(self, i: int) -> Value | None:
        """Input i, counting the implicit inputs after the explicit ones; None when absent."""
        inputs = self.all_inputs
        return inputs[i] if i < len(inputs) else None

    @property
    def all_inputs(self) -> list[Value | None]:
        return self.inputs + self.implicit_inputs if self.implicit_inputs else self.inputs

    def subgraphs(self) -> list[onnx.GraphProto]:
        """The graphs held in the node's attributes (If's branches, Loop's and Scan's bodies)."""
        found = []
        for a in self.attributes:
            if a.type == onnx.AttributeProto.GRAPH:
                found.append(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                found.extend(a.graphs)
        return found

    def set_implicit_inputs(self, values: Iterable[Value]) -> None:
        for k, v in enumerate(self.implicit_inputs):
            v.uses.remove((self, len(self.inputs) + k))
        self.implicit_inputs = list(values)
        for k, v in enumerate(self.implicit_inputs):
            v.uses.append((self, len(self.inputs) + k))

    def to_proto(self) -> onnx.NodeProto:
        node = onnx.NodeProto(op_type=self.op_type, domain=self.domain, name=self.name,
                              input=[v.name if v is not None else "" for v in self.inputs],
                              output=[v.name for v in self.outputs])
        node.attribute.extend(self.attributes)
        return node


class Graph:
    """A model's main graph plus the model-level fields needed to write it back."""

    def __init__(self, model: onnx.ModelProto):
        self.model_template = onnx.ModelProto()
        copy_fields(model, self.model_template, {"graph"})  # not CopyFrom: that would copy every weight too
        self.name = model.graph.name
        self.doc_string = model.graph.doc_string
        self.opsets = {o.domain: o.version for o in model.opset_import}
        self.values: dict[str, Value] = {}
        self.nodes: list[Node] = []
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.initializers: dict[str, onnx.TensorProto] = {}
        self.sparse_initializers = list(model.graph.sparse_initializer)

    @property
    def opset(self) -> int:
        return self.opsets.get("", self.opsets.get("ai.onnx", 1))

    def value(self, name: str) -> Value:
        v = self.values.get(name)
        if v is None:
            v = self.values[name] = Value(name)
        return v

    def add_node(self, node: Node) -> Node:
        self.nodes.append(node)
        for v in node.outputs:
            self.values[v.name] = v
        return node

    def rename(self, value: Value, new_name: str) -> None:
        """Rename a value; only values that no subgraph refers to by name may be renamed."""
        del self.values[value.name]
        value.name = new_name
        self.values[new_name] = value

    def is_initializer(self, v: Value) -> bool:
        return v.name in self.initializers

    def to_model(self, weights_apart: bool = False) -> onnx.ModelProto:
        """The model as a proto. `weights_apart`: write large float initializers as stubs (weights.py) whose
        data stays in `self.initializers`, instead of copying it into the new proto."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model_template)
        g = model.graph
        g.name, g.doc_string = self.name, self.doc_string
        g.node.extend(n.to_proto() for n in self.nodes)
        g.input.extend(v.value_info() for v in self.inputs)
        g.output.extend(v.value_info() for v in self.outputs)
        g.initializer.extend(stub_of(t) if weights_apart and should_stub(t) else t
                             for t in self.initializers.values())
        g.sparse_initializer.extend(self.sparse_initializers)
        del model.opset_import[:]
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in self.opsets.items())
        return model


def _shape_of(type_proto: onnx.TypeProto) -> tuple[int | None, tuple[Dim, ...] | None]:
    if not type_proto.HasField("tensor_type"):
        return None, None
    t = type_proto.tensor_type
    if not t.HasField("shape"):
        return t.elem_type or None, None
    dims: list[Dim] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif d.HasField("dim_param") and d.dim_param:
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return t.elem_type or None, tuple(dims)


def from_model(model: onnx.ModelProto, weights: dict[str, onnx.TensorProto] | None = None) -> Graph:
    """Build a `Graph` from a model whose shapes were inferred; value_info supplies types. `weights` holds
    the data of a skeleton's stubs (weights.py): the Graph gets those tensors in their place."""
    graph = Graph(model)
    g = model.graph
    types: dict[str, onnx.TypeProto] = {}
    for vi in list(g.value_info) + list(g.input) + list(g.output):
        types[vi.name] = vi.type
    for init in g.initializer:
        graph.initializers[init.name] = weights.get(init.name, init) if weights and is_stub(init) else init
        v = graph.value(init.name)
        v.elem_type, v.shape = init.data_type, tuple(init.dims)
    for vi in g.input:
        v = graph.value(vi.name)
        if vi.name not in graph.initializers:
            v.elem_type, v.shape = _shape_of(vi.type)
        graph.inputs.append(v)
    for n in g.node:
        inputs = [graph.value(name) if name else None for name in n.input]
        outputs = []
        for name in n.output:
            v = graph.value(name) if name else Value("")
            if name in types:
                v.elem_type, v.shape = _shape_of(types[name])
            outputs.append(v)
        node = graph.add_node(Node(n.op_type, inputs, outputs, n.name, copy.deepcopy(list(n.attribute)), n.domain))
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            attach_implicit_inputs(graph, node)
    graph.values.pop("", None)
    for vi in g.output:
        v = graph.value(vi.name)
        et, shape = _shape_of(vi.type)
        v.elem_type = v.elem_type or et
        v.shape = v.shape if v.shape is not None else shape
        graph.outputs.append(v)
    return graph


def outer_references(g: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads without defining them (nested subgraphs included), in first-use order."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    defined |= {t.values.name for t in g.sparse_initializer} | {o for n in g.node for o in n.output}
    refs: list[str] = []
    for n in g.node:
        refs.extend(n.input)
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs):
                refs.extend(outer_references(sub))
    refs.extend(o.name for o in g.output)
    return [r for r in dict.fromkeys(refs) if r and r not in defined]


def names_defined_in(g: onnx.GraphProto) -> set[str]:
    """Every value name a subgraph defines, nested subgraphs included: names a new outer value must avoid."""
    names = {v.name for v in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs):
                names |= names_defined_in(sub)
    names.discard("")
    return names


def attach_implicit_inputs(graph: Graph, node: Node) -> None:
    """Give a node with subgraphs the outer values they read, looked up in `graph` by name."""
    refs = [name for sub in node.subgraphs() for name in outer_references(sub)]
    node.set_implicit_inputs(graph.values[name] for name in dict.fromkeys(refs) if name in graph.values)


def set_metadata(model: onnx.ModelProto, entries: dict[str, str]) -> None:
    """Set metadata_props entries, replacing the value of a key that exists."""
    existing = {p.key: p for p in model.metadata_props}
    for k, v in entries.items():
        if k in existing:
            existing[k].value = v
        else:
            model.metadata_props.add(key=k, value=v)


def tensor_value(t: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(t)
