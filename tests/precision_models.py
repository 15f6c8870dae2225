"""Small models and feeds for the mixed-precision tests and bench/bench_precision.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"


def tanh_classifier(features: int = 8, hidden: int = 16, classes: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x[N, features] -> MatMul + Add -> Tanh -> Gemm -> logits[N, classes] (no kinks: gradients compare
    without sign flips at a Relu)."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((features, hidden)) / np.sqrt(features)).astype(np.float32)
    b1 = np.zeros(hidden, np.float32)
    w2 = (rng.standard_normal((classes, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b2 = np.zeros(classes, np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
             helper.make_node("Tanh", ["h1"], ["h"], name="act"),
             helper.make_node("Gemm", ["h", "w2", "b2"], ["logits"], name="fc2", transB=1)]
    graph = helper.make_graph(
        nodes, "tanh_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(a, n) for n, a in (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def blobs(n: int = 64, features: int = 8, classes: int = 4, seed: int = 1) -> dict[str, np.ndarray]:
    """A separable classification set: one Gaussian blob per class."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((classes, features)).astype(np.float32) * 2
    labels = rng.integers(0, classes, n).astype(np.int64)
    x = (centres[labels] + rng.standard_normal((n, features)).astype(np.float32)).astype(np.float32)
    return {"x": x, "target": labels}


def shipped(name: str) -> onnx.ModelProto:
    return onnx.load(str(MODELS_DIR / f"{name}.onnx"))


def shipped_feeds(name: str, batch: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for the shipped models (models/make_models.py)."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return {"x": rng.standard_normal((batch, 16)).astype(np.float32), "labels": np.arange(batch) % 10}
    if name == "cnn":
        return {"x": rng.standard_normal((batch, 1, 8, 8)).astype(np.float32), "labels": np.arange(batch) % 10}
    if name == "transformer":
        return {"x": rng.standard_normal((batch, 8, 16)).astype(np.float32),
                "target": rng.standard_normal((batch, 8, 16)).astype(np.float32)}
    raise KeyError(name)


def initial_state(step: onnx.ModelProto) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """A step graph's state pairs (input -> output) and their stored values."""
    import json
    meta = {p.key: p.value for p in step.metadata_props}
    pairs = json.loads(meta["onnxgrad.state"])
    inits = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer}
    return pairs, {name: inits[name] for name in pairs}


def reference_steps(step: onnx.ModelProto, feeds: dict[str, np.ndarray], steps: int) -> tuple[list[float], dict]:
    """Run `steps` steps of a step graph in onnx's ReferenceEvaluator (numpy; float16 natively, bfloat16 through
    ml_dtypes) on the same full batch: the losses and the final state."""
    from onnx.reference import ReferenceEvaluator
    pairs, state = initial_state(step)
    ev = ReferenceEvaluator(step)
    loss = {p.key: p.value for p in step.metadata_props}["onnxgrad.loss"]
    names = [loss, *pairs.values()]
    losses = []
    for _ in range(steps):
        out = dict(zip(names, ev.run(names, {**feeds, **state})))
        losses.append(float(out[loss]))
        state = {name: out[nxt] for name, nxt in pairs.items()}
    return losses, state
