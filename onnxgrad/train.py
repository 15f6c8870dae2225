"""Running a training graph: feed data, read the loss and gradients, apply a plain SGD update."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import runtime
from .errors import UsageError

GRAD_SUFFIX = "_grad"


def parameters(model: onnx.ModelProto) -> dict[str, np.ndarray]:
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


def run_steps(model: onnx.ModelProto, steps: int = 1, lr: float = 0.1, data: str | None = None,
              dims: dict[str, int] | None = None, seed: int = 0, provider: str = "auto") -> list[dict]:
    params = parameters(model)
    if not params:
        raise UsageError("the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?")
    inferred = onnx.shape_inference.infer_shapes(model)
    feeds = random_feeds(inferred, dims or {}, seed, skip=set(params))
    if data:
        with np.load(data) as arrays:
            unknown = sorted(set(arrays.files) - set(feeds))
            if unknown:
                raise UsageError(f"--data {data}: {unknown[0]!r} is not a data input of the model")
            feeds.update({k: arrays[k] for k in arrays.files})
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
