"""A small in-memory graph with use-def links.

Protobuf is touched only in `from_model` and `Graph.to_model`; passes work on `Graph`, `Node` and `Value`.
Nodes keep their attributes as `AttributeProto`s, so a node can be cloned without knowing its op. Every node
carries its phase (forward, recompute, backward, optimizer); `to_model` records the phases and the type of every
value in the file, and `from_model` reads them back, so a later command can take a training graph up again.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from typing import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .contract import FLOAT_TYPES, FORWARD, PHASES_KEY
from .errors import InternalError
from .protos import decode_phases, encode_phases, outer_references
from .weights import copy_fields, is_stub, should_stub, stub_of

Dim = int | str | None  # a known size, a symbol, or unknown


@lru_cache(maxsize=4096)
def _tensor_type(elem_type: int, shape: tuple[Dim, ...] | None) -> onnx.TypeProto:
    """The TypeProto of a tensor type; training graphs repeat a few types many times, so each is made once."""
    return helper.make_tensor_type_proto(elem_type, None if shape is None else list(shape))


@lru_cache(maxsize=None)
def itemsize(elem_type: int) -> int:
    """Bytes per element of an ONNX element type (sub-byte types count as one byte)."""
    return max(helper.tensor_dtype_to_np_dtype(elem_type).itemsize, 1)


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
        return self.bytes_with({})

    def bytes_with(self, dims: dict[str, int]) -> int | None:
        """Bytes of the tensor with its symbolic dimensions bound by `dims`; None while any is unknown."""
        if self.shape is None or not self.elem_type:
            return None
        count = 1
        for d in self.shape:
            d = dims.get(d) if isinstance(d, str) else d
            if d is None:
                return None
            count *= d
        return count * itemsize(self.elem_type)

    @property
    def is_typed(self) -> bool:
        return bool(self.elem_type) and self.shape is not None

    def value_info(self) -> onnx.ValueInfoProto:
        vi = onnx.ValueInfoProto(name=self.name)
        vi.type.CopyFrom(_tensor_type(self.elem_type or 0, self.shape))
        return vi


class Node:
    __slots__ = ("op_type", "domain", "name", "inputs", "outputs", "attributes", "implicit_inputs", "phase")

    def __init__(self, op_type: str, inputs: Iterable[Value | None], outputs: Iterable[Value], name: str,
                 attributes: Iterable[onnx.AttributeProto] = (), domain: str = "", phase: str = FORWARD):
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.phase = phase
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

    def set_input(self, i: int, v: Value | None) -> None:
        """Read `v` as explicit input i instead of what was there."""
        old = self.inputs[i]
        if old is not None:
            old.uses.remove((self, i))
        self.inputs[i] = v
        if v is not None:
            v.uses.append((self, i))

    def detach(self) -> None:
        """Stop reading every input (the node is leaving the graph)."""
        for i, v in enumerate(self.inputs):
            if v is not None:
                v.uses.remove((self, i))
        self.set_implicit_inputs(())

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
    """A model's main graph plus the model-level fields needed to write it back.

    `nodes` is the schedule: the order the file lists them in, which onnxruntime follows under the settings in
    contract.RUNTIME_HINTS. Passes edit the graph through the methods below rather than splicing lists."""

    def __init__(self, model: onnx.ModelProto):
        self.model_template = onnx.ModelProto()
        copy_fields(model, self.model_template, {"graph", "metadata_props"})  # not CopyFrom: no weight copies
        self.metadata: dict[str, str] = {p.key: p.value for p in model.metadata_props}
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

    # -- editing ------------------------------------------------------------------------------------------
    def clone(self, node: Node, name: str, output_names: list[str], phase: str | None = None) -> Node:
        """A copy of `node` reading the same inputs, with new outputs of the same types. The copy is not in the
        schedule yet: place it with `insert_before`/`insert_after`, or `reorder`."""
        outputs = [Value(n, v.elem_type, v.shape) for n, v in zip(output_names, node.outputs)]
        copy_ = Node(node.op_type, node.inputs, outputs, name, node.attributes, node.domain,
                     node.phase if phase is None else phase)
        if node.implicit_inputs:
            copy_.set_implicit_inputs(node.implicit_inputs)
        for v in outputs:
            self.values[v.name] = v
        return copy_

    def insert_before(self, anchor: Node, nodes: list[Node]) -> None:
        self._insert(self._position(anchor), nodes)

    def insert_after(self, anchor: Node, nodes: list[Node]) -> None:
        self._insert(self._position(anchor) + 1, nodes)

    def _insert(self, at: int, nodes: list[Node]) -> None:
        self.nodes[at:at] = nodes
        for n in nodes:
            for v in n.outputs:
                self.values[v.name] = v

    def _position(self, anchor: Node) -> int:
        for i, n in enumerate(self.nodes):
            if n is anchor:
                return i
        raise InternalError(f"node {anchor.name!r} is not in the graph")

    def reorder(self, nodes: list[Node]) -> None:
        """Make `nodes` the schedule: the same nodes as now, plus any new ones (clones), in a new order."""
        for n in nodes:
            for v in n.outputs:
                self.values[v.name] = v
        self.nodes = list(nodes)

    def replace_all_uses(self, old: Value, new: Value, where=None) -> int:
        """Every node that reads `old` (and for which `where(node)` holds) reads `new` instead; graph outputs
        are not touched. Returns the number of inputs rewired."""
        count = 0
        for node, i in list(old.uses):
            if where is not None and not where(node):
                continue
            if i >= len(node.inputs):
                raise InternalError(f"{old.name!r} is read by name inside a subgraph of {node.name!r}: cannot rewire")
            node.set_input(i, new)
            count += 1
        return count

    def remove(self, nodes: Iterable[Node]) -> None:
        """Take nodes out of the graph; none of their outputs may still be read, except by removed nodes."""
        gone = {id(n) for n in nodes}
        outputs = {id(v) for v in self.outputs}
        for n in self.nodes:
            if id(n) not in gone:
                continue
            for v in n.outputs:
                if id(v) in outputs or any(id(u) not in gone for u, _ in v.uses):
                    raise InternalError(f"cannot remove {n.name!r}: its output {v.name!r} is still used")
        kept = []
        for n in self.nodes:
            if id(n) in gone:
                n.detach()
                for v in n.outputs:
                    if self.values.get(v.name) is v:
                        del self.values[v.name]
            else:
                kept.append(n)
        self.nodes = kept

    def remove_dead(self) -> int:
        """Remove the nodes nothing reaches the graph outputs through; returns how many were removed."""
        needed: set[int] = {id(v) for v in self.outputs}
        dead = []
        for n in reversed(self.nodes):
            if any(id(v) in needed for v in n.outputs):
                needed.update(id(v) for v in n.all_inputs if v is not None)
            else:
                dead.append(n)
        if dead:
            self.remove(dead)
        return len(dead)

    # -- writing ------------------------------------------------------------------------------------------
    def to_model(self, weights_apart: bool = False) -> onnx.ModelProto:
        """The model as a proto. `weights_apart`: write large float initializers as stubs (weights.py) whose
        data stays in `self.initializers`, instead of copying it into the new proto. The type of every value
        that is neither a graph input nor an output is written as value_info, as shape inference would."""
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
        edges = {v.name for v in self.inputs} | {v.name for v in self.outputs}
        g.value_info.extend(v.value_info() for n in self.nodes for v in n.outputs
                            if v.elem_type and v.name and v.name not in edges)
        del model.opset_import[:]
        model.opset_import.extend(helper.make_opsetid(d, v) for d, v in self.opsets.items())
        metadata = dict(self.metadata)
        if any(n.phase != FORWARD for n in self.nodes):
            metadata[PHASES_KEY] = encode_phases(n.phase for n in self.nodes)
        else:
            metadata.pop(PHASES_KEY, None)
        model.metadata_props.extend(onnx.StringStringEntryProto(key=k, value=v) for k, v in metadata.items())
        return model


def type_shape(type_proto: onnx.TypeProto) -> tuple[int | None, tuple[Dim, ...] | None]:
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
            v.elem_type, v.shape = type_shape(vi.type)
        graph.inputs.append(v)
    for n in g.node:
        inputs = [graph.value(name) if name else None for name in n.input]
        outputs = []
        for name in n.output:
            v = graph.value(name) if name else Value("")
            if name in types:
                v.elem_type, v.shape = type_shape(types[name])
            outputs.append(v)
        node = graph.add_node(Node(n.op_type, inputs, outputs, n.name, copy.deepcopy(list(n.attribute)), n.domain))
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            attach_implicit_inputs(graph, node)
    graph.values.pop("", None)
    if PHASES_KEY in graph.metadata:
        for node, phase in zip(graph.nodes, decode_phases(graph.metadata[PHASES_KEY], len(graph.nodes))):
            node.phase = phase
    for vi in g.output:
        v = graph.value(vi.name)
        et, shape = type_shape(vi.type)
        v.elem_type = v.elem_type or et
        v.shape = v.shape if v.shape is not None else shape
        graph.outputs.append(v)
    return graph


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


def constant_value(attributes: Iterable[onnx.AttributeProto]) -> np.ndarray | None:
    """The value a Constant node's attributes hold (value, value_int(s), value_float(s)); None for others."""
    for a in attributes:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(a), dtype=np.int64)
        if a.name in ("value_float", "value_floats"):
            return np.asarray(helper.get_attribute_value(a), dtype=np.float32)
    return None


def known_value(graph: Graph, v: Value | None) -> np.ndarray | None:
    """The value of `v` when the graph fixes it (an initializer or a Constant node's output); None otherwise."""
    if v is None:
        return None
    if v.name in graph.initializers:
        return numpy_helper.to_array(graph.initializers[v.name])
    if v.producer is not None and v.producer.op_type == "Constant":
        return constant_value(v.producer.attributes)
    return None


def tensor_value(t: onnx.TensorProto) -> np.ndarray:
    return numpy_helper.to_array(t)
