"""Reading and cutting ONNX protos at the edges: the phases a training graph records, the names a node or
subgraph reads from outside, the nodes a set of outputs needs, a model cut down to some of its nodes, the
forward outputs of a step graph, and seeded random data for a model's inputs.

Everything here works on protobuf (`onnx.ModelProto`, `GraphProto`, `NodeProto`), never on `ir.Graph`, so that
the loaders, runners and commands that meet a file share one reading of it.
"""
from __future__ import annotations

import json
from typing import Iterable

import numpy as np
import onnx
from onnx import helper

from .contract import CLASS_LABELS_KEY, LOSS_FN_KEY, PHASES, PHASES_KEY
from .errors import InvalidModelError, UsageError


# -- phases ----------------------------------------------------------------------------------------------------
def encode_phases(phases: Iterable[str]) -> str:
    """The phases of the nodes in order, as runs: '[["forward", 12], ["backward", 30]]'."""
    runs: list[list] = []
    for p in phases:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    return json.dumps(runs, separators=(",", ":"))


def decode_phases(text: str, count: int) -> list[str]:
    """The per-node phases recorded by `encode_phases`, for a graph of `count` nodes.

    Text that is not a JSON list of [phase, count] runs, or runs that do not cover exactly `count` nodes, is an
    InvalidModelError: a file whose phases cannot be trusted would be split, scheduled or reported wrongly."""
    rebuild = "; rebuild the graph with onnxgrad build-grad"
    try:
        runs = json.loads(text)
        if not isinstance(runs, list):
            raise TypeError(runs)
        phases = []
        for phase, length in runs:
            if phase not in PHASES or not isinstance(length, int) or isinstance(length, bool) or length < 0:
                raise ValueError(phase)
            phases += [phase] * length
    except (ValueError, TypeError):
        raise InvalidModelError(f"metadata {PHASES_KEY!r} is not a JSON list of [phase, count] runs with phases "
                                f"from {', '.join(PHASES)}{rebuild}") from None
    if len(phases) != count:
        raise InvalidModelError(f"metadata {PHASES_KEY!r} covers {len(phases)} nodes, the graph has {count}{rebuild}")
    return phases


def model_phases(model: onnx.ModelProto) -> list[str] | None:
    """The phase of each node of the main graph as the model's metadata records it; None when it records none."""
    text = {p.key: p.value for p in model.metadata_props}.get(PHASES_KEY)
    return None if text is None else decode_phases(text, len(model.graph.node))


# -- what nodes read -------------------------------------------------------------------------------------------
def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held in a node's attributes (If branches, Loop and Scan bodies)."""
    return [g for a in node.attribute
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs))]


def outer_references(g: onnx.GraphProto) -> list[str]:
    """Names a subgraph reads without defining them (nested subgraphs included), in first-use order."""
    defined = {v.name for v in g.input} | {t.name for t in g.initializer}
    defined |= {t.values.name for t in g.sparse_initializer} | {o for n in g.node for o in n.output}
    refs: list[str] = []
    for n in g.node:
        refs.extend(n.input)
        for sub in subgraphs(n):
            refs.extend(outer_references(sub))
    refs.extend(o.name for o in g.output)
    return [r for r in dict.fromkeys(refs) if r and r not in defined]


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The names a node reads from its graph: its inputs, then what its subgraphs read from outside them."""
    names = [i for i in node.input if i]
    for sub in subgraphs(node):
        names += outer_references(sub)
    return list(dict.fromkeys(names))


# -- cutting ---------------------------------------------------------------------------------------------------
def needed_subgraph(graph: onnx.GraphProto, outputs: Iterable[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes the outputs depend on (in graph order) and every value name they read, outputs included."""
    producer = {o: n for n in graph.node for o in n.output if o}
    needed_nodes, names, todo = set(), set(), list(outputs)
    while todo:
        name = todo.pop()
        if name in names:
            continue
        names.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in needed_nodes:
            needed_nodes.add(id(node))
            todo.extend(node_reads(node))
    return [n for n in graph.node if id(n) in needed_nodes], names


def cut_model(model: onnx.ModelProto, nodes: list[onnx.NodeProto], outputs: list[str], *,
              extra_inputs: Iterable[str] = (), types: dict[str, onnx.ValueInfoProto] | None = None,
              keep_metadata: Iterable[str] = (), name: str | None = None) -> onnx.ModelProto:
    """A model of `nodes` (in their order) with `outputs`. Its inputs are the source graph's inputs the nodes
    read, then `extra_inputs` (values the nodes read that become inputs); its initializers and value_info those
    the nodes read or write. Types come from the source graph, or from `types` for names it does not declare;
    opsets, IR version, producer and functions are the source's, and metadata keeps the keys in
    `keep_metadata`."""
    g = model.graph
    read = {r for n in nodes for r in node_reads(n)} | set(outputs)
    produced = {o for n in nodes for o in n.output if o}
    declared = {vi.name: vi for vi in [*g.input, *g.output, *g.value_info]}
    declared = {**(types or {}), **declared}
    for missing in [o for o in [*outputs, *extra_inputs] if o not in declared]:
        raise InvalidModelError(f"the graph declares no type for {missing!r}; run it through shape inference")
    inputs = [vi for vi in g.input if vi.name in read and vi.name not in produced]
    inputs += [declared[e] for e in extra_inputs if e not in {vi.name for vi in inputs}]
    inits = [t for t in g.initializer if t.name in read]
    value_info = [vi for vi in g.value_info if vi.name in read | produced and vi.name not in set(outputs)]
    graph = helper.make_graph(nodes, g.name if name is None else name, inputs, [declared[o] for o in outputs],
                              inits, value_info=value_info)
    out = helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version,
                            producer_name=model.producer_name, producer_version=model.producer_version)
    out.functions.extend(model.functions)
    keep = set(keep_metadata)
    for p in model.metadata_props:
        if p.key in keep:
            out.metadata_props.add(key=p.key, value=p.value)
    return out


# -- step graphs -----------------------------------------------------------------------------------------------
def forward_outputs(model: onnx.ModelProto, state: dict[str, str]) -> list[str]:
    """The outputs before the first state output (the step graph's original outputs), less the loss that
    `build-grad --loss-fn` appended (recorded in metadata `onnxgrad.loss_fn`)."""
    names = [o.name for o in model.graph.output]
    nexts = set(state.values())
    first = next((i for i, n in enumerate(names) if n in nexts), len(names))
    appended = None
    for p in model.metadata_props:
        if p.key == LOSS_FN_KEY:
            try:
                appended = json.loads(p.value).get("loss_output")
            except (json.JSONDecodeError, AttributeError):
                raise InvalidModelError(f"metadata {LOSS_FN_KEY!r} is not a JSON object") from None
    outputs = [n for n in names[:first] if n != appended]
    if not outputs:
        raise InvalidModelError("the step graph has no forward outputs before its state outputs")
    return outputs


def declared_dims(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """The dims a value declares (ints, symbol names, None where unknown); None when it declares no shape."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim]


# -- random data -----------------------------------------------------------------------------------------------
def random_feeds(model: onnx.ModelProto, dims: dict[str, int], seed: int, skip: set[str]) -> dict[str, np.ndarray]:
    """Seeded data for every graph input that is not a parameter; integer inputs get valid class labels."""
    rng = np.random.default_rng(seed)
    classes = class_counts(model)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in skip:
            continue
        t = vi.type.tensor_type
        shape = []
        for d in t.shape.dim:
            if d.HasField("dim_value"):
                shape.append(d.dim_value)
            else:
                shape.append(dims.get(d.dim_param, 4))
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, classes.get(vi.name, 2), size=shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[vi.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise UsageError(f"input {vi.name!r}: cannot make random data of type {dtype}; pass --data")
    return feeds


def class_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Labels read by a cross-entropy node take values below its class dimension, when that is known."""
    shapes = {vi.name: vi.type.tensor_type.shape.dim
              for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    counts = {}
    for n in model.graph.node:
        if n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and len(n.input) > 1:
            dims = shapes.get(n.input[0])
            if dims is not None and len(dims) > 1 and dims[1].HasField("dim_value"):
                counts[n.input[1]] = dims[1].dim_value
    for name, (classes, _) in expanded_labels(model).items():
        if classes is not None:
            counts[name] = classes
    return counts


def expanded_labels(model: onnx.ModelProto) -> dict[str, list]:
    """The labels of the cross-entropy losses the build expanded into plain ops: {input: [classes, ignore_index]}."""
    meta = {p.key: p.value for p in model.metadata_props}
    return json.loads(meta.get(CLASS_LABELS_KEY, "{}"))
