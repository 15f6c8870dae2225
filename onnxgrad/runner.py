"""`onnxgrad run`: a *training graph* (forward and backward, `<p>_grad` outputs, written by `build-grad`) run
step by step with plain SGD applied on the host, `p -= lr * <p>_grad`; for trying a training graph out
(`run_training_graph`, `training_graph_parameters`).

Training with a *step graph* (`onnxgrad train`) is in `onnxgrad.training`; seeded data for a graph's inputs
comes from `protos.random_feeds`.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from . import runtime
from .contract import GRAD_SUFFIX, LOSS_SCALE_INPUT
from .errors import UsageError
from .protos import random_feeds
from .training.data import check_labels, read_npz


# -- a training graph with plain SGD (`onnxgrad run`) --------------------------------------------------------

def training_graph_parameters(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers that have a `<name>_grad` output: the trainable parameters, in initializer order."""
    outs = {o.name for o in model.graph.output}
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name + GRAD_SUFFIX in outs}


def run_training_graph(model: onnx.ModelProto, steps: int = 1, lr: float = 0.1, data: str | None = None,
                       dims: dict[str, int] | None = None, seed: int = 0, provider: str = "auto") -> list[dict]:
    """`steps` runs of a training graph on fixed data (`data` arrays over seeded random ones), each followed by
    `p -= lr * <p>_grad` on the host; per step, the loss and the L2 norm of every gradient."""
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
