"""`onnxgrad run`: a *training graph* (forward and backward, `<p>_grad` outputs, written by `build-grad`) run
step by step with plain SGD applied on the host, `p -= lr * <p>_grad`; for trying a training graph out
(`run_training_graph`, `training_graph_parameters`).

Also here, for the other readers of graph protos: seeded data for a graph's inputs (`random_feeds`, with class
labels in range: `_class_counts`), a step graph's forward outputs (`forward_outputs`), the nodes and values some
outputs depend on (`_needed`, `_reads`) and the dims of a value (`_dims`). Training with a *step graph*
(`onnxgrad train`) is in `onnxgrad.training`.
"""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import runtime
from .contract import GRAD_SUFFIX, LOSS_FN_KEY, LOSS_SCALE_INPUT
from .errors import InvalidModelError, UsageError


# -- a training graph with plain SGD (`onnxgrad run`) --------------------------------------------------------

def training_graph_parameters(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers that have a `<name>_grad` output: the trainable parameters, in initializer order."""
    outs = {o.name for o in model.graph.output}
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name + GRAD_SUFFIX in outs}


def random_feeds(model: onnx.ModelProto, dims: dict[str, int], seed: int, skip: set[str]) -> dict[str, np.ndarray]:
    """Seeded data for every graph input that is not a parameter; integer inputs get valid class labels."""
    rng = np.random.default_rng(seed)
    classes = _class_counts(model)
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


def _class_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Labels read by a cross-entropy node take values below its class dimension, when that is known."""
    shapes = {vi.name: vi.type.tensor_type.shape.dim
              for vi in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.output)}
    counts = {}
    for n in model.graph.node:
        if n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and len(n.input) > 1:
            dims = shapes.get(n.input[0])
            if dims is not None and len(dims) > 1 and dims[1].HasField("dim_value"):
                counts[n.input[1]] = dims[1].dim_value
    return counts


def run_training_graph(model: onnx.ModelProto, steps: int = 1, lr: float = 0.1, data: str | None = None,
                       dims: dict[str, int] | None = None, seed: int = 0, provider: str = "auto") -> list[dict]:
    """`steps` runs of a training graph on fixed data (`data` arrays over seeded random ones), each followed by
    `p -= lr * <p>_grad` on the host; per step, the loss and the L2 norm of every gradient."""
    from .training.data import check_labels, read_npz  # training.data reads graphs with this module's helpers

    params = training_graph_parameters(model)
    if not params:
        raise UsageError("the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?")
    inferred = onnx.shape_inference.infer_shapes(model)
    # a loss scale (build-grad --loss-scale) keeps its stored value, as the parameters do
    stored = {t.name for t in model.graph.initializer}
    feeds = random_feeds(inferred, dims or {}, seed, skip=set(params) | ({LOSS_SCALE_INPUT} & stored))
    if data:
        arrays = read_npz(data, "--data")
        unknown = sorted(set(arrays) - set(feeds))
        if unknown:
            raise UsageError(f"--data {data}: {unknown[0]!r} is not a data input of the model")
        check_labels(inferred, arrays, f"--data {data}")
        feeds.update(arrays)
    sess = runtime.session(model, provider)
    outputs = [o.name for o in sess.get_outputs()]
    loss_name = outputs[0]
    history = []
    for _ in range(steps):
        result = dict(zip(outputs, sess.run(None, {**feeds, **params})))
        grads = {p: result[p + GRAD_SUFFIX] for p in params}
        history.append({"loss": float(np.asarray(result[loss_name]).reshape(-1)[0]),
                        "grad_norms": {p + GRAD_SUFFIX: float(np.linalg.norm(g)) for p, g in grads.items()}})
        params = {p: np.asarray(v - lr * grads[p], dtype=v.dtype) for p, v in params.items()}
    return history


# -- a step graph, its state kept on the device (`onnxgrad train`) ------------------------------------------

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


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in t.shape.dim]


# -- export --------------------------------------------------------------------------------------------------

def _needed(graph: onnx.GraphProto, outputs: list[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes the outputs depend on (in graph order) and every value name they read."""
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
            todo.extend(_reads(node))
    return [n for n in graph.node if id(n) in needed_nodes], names


def _reads(node: onnx.NodeProto) -> list[str]:
    """A node's inputs and the outer-scope names its subgraphs read."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            local = {i.name for i in sub.input} | {t.name for t in sub.initializer}
            local |= {o for n in sub.node for o in n.output}
            names += [r for n in sub.node for r in _reads(n) if r not in local]
    return names
