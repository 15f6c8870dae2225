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


def conv_bn_block(channels: int = 8, classes: int = 4, seed: int = 0, activation: str = "Relu") -> onnx.ModelProto:
    """A ResNet basic block: x[N, 3, 8, 8] -> Conv -> BatchNormalization -> Relu -> Conv -> BatchNormalization
    (inference form) -> Add (the first Relu's output) -> Relu -> GlobalAveragePool -> Gemm -> logits. The first
    BatchNormalization computes batch statistics (training_mode=1), the second uses stored ones. `activation`
    "Tanh" gives the same graph without kinks (in half precision a few of a Relu's normalised inputs, near zero,
    change sign, and their elements' gradients with them)."""
    rng = np.random.default_rng(seed)

    def conv_weight(cout, cin):
        return (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)

    c = channels
    inits = {"w1": conv_weight(c, 3), "w2": conv_weight(c, c),
             "s1": (1 + 0.1 * rng.standard_normal(c)).astype(np.float32), "b1": (0.1 * rng.standard_normal(c)).astype(np.float32),
             "m1": np.zeros(c, np.float32), "v1": np.ones(c, np.float32),
             "s2": (1 + 0.1 * rng.standard_normal(c)).astype(np.float32), "b2": (0.1 * rng.standard_normal(c)).astype(np.float32),
             "m2": (0.1 * rng.standard_normal(c)).astype(np.float32), "v2": rng.uniform(0.5, 1.5, c).astype(np.float32),
             "wf": (rng.standard_normal((classes, c)) / np.sqrt(c)).astype(np.float32), "bf": np.zeros(classes, np.float32)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "s1", "b1", "m1", "v1"], ["n1", "rm1", "rv1"], name="bn1",
                              training_mode=1),
             helper.make_node(activation, ["n1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c2", "s2", "b2", "m2", "v2"], ["n2"], name="bn2"),
             helper.make_node("Add", ["n2", "r1"], ["sum"], name="residual"),
             helper.make_node(activation, ["sum"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["pooled"], name="pool"),
             helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "wf", "bf"], ["logits"], name="fc", transB=1)]
    graph = helper.make_graph(
        nodes, "conv_bn_block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", classes])],
        [numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def scaled_activation(rows: int = 64, width: int = 256, seed: int = 0) -> onnx.ModelProto:
    """x[N, width] -> MatMul -> Mul by a scalar weight `half_` (0.5, as GELU's) -> Tanh, and the same activation
    read three times (Tanh, Sin, Mul by itself) so that its gradient adds three contributions -> y[N, width].
    The scalar's gradient adds up N * width products."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("Mul", ["h", "half_"], ["z"], name="scale"),
             helper.make_node("Tanh", ["z"], ["t"], name="tanh"),
             helper.make_node("Sin", ["z"], ["s"], name="sin"),
             helper.make_node("Mul", ["z", "z"], ["q"], name="square"),
             helper.make_node("Add", ["t", "s"], ["ts"], name="add1"),
             helper.make_node("Add", ["ts", "q"], ["y"], name="add2")]
    graph = helper.make_graph(
        nodes, "scaled_activation", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array(0.5, np.float32), "half_")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
