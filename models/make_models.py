"""Write the shipped example forward models: mlp.onnx, cnn.onnx and transformer.onnx.

    python models/make_models.py [OUT_DIR]      (OUT_DIR defaults to the folder of this script)

Each model is built with onnx.helper at opset 18 in float32, from a fixed numpy seed, so running the script
twice writes byte-identical files. Each has a scalar output `loss` first and its logits or prediction second;
its parameters are initializers named like PyTorch's (`fc1.weight`), and data and labels are graph inputs
with a symbolic batch dimension `N`. Constants (scales, 0.5, 1, sqrt 2) are Constant nodes, not
initializers, so that every float initializer is a parameter.

Weights follow the conventions of the ops that use them: Gemm weights are [out, in] with transB=1 (as
torch.nn.Linear), MatMul weights are [in, out].
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
IR_VERSION = 8  # the lowest IR version that opset 18 allows; every onnxruntime since 1.14 reads it
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


class ModelWriter:
    """Collects nodes and initializers; names each node after its output."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def param(self, name: str, shape: tuple[int, ...], fan_in: int) -> str:
        """A parameter drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the PyTorch default for Linear/Conv."""
        bound = 1.0 / np.sqrt(fan_in)
        array = self.rng.uniform(-bound, bound, size=shape).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def ones(self, name: str, shape: tuple[int, ...]) -> str:
        self.initializers.append(numpy_helper.from_array(np.ones(shape, np.float32), name))
        return name

    def zeros(self, name: str, shape: tuple[int, ...]) -> str:
        self.initializers.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
        return name

    def const(self, name: str, value: float) -> str:
        value_tensor = numpy_helper.from_array(np.array(value, np.float32), name)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=value_tensor))
        return name

    def node(self, op: str, inputs: list[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attrs))
        return output

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.initializers, doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                                  producer_name="onnxgrad/models/make_models.py")
        onnx.checker.check_model(model, full_check=True)
        return model


def _linear(w: ModelWriter, x: str, name: str, n_in: int, n_out: int, output: str | None = None) -> str:
    """Gemm(x, W^T, b) with W [out, in], as torch.nn.Linear."""
    weight = w.param(f"{name}.weight", (n_out, n_in), n_in)
    bias = w.param(f"{name}.bias", (n_out,), n_in)
    return w.node("Gemm", [x, weight, bias], output or name, transB=1)


def mlp() -> onnx.ModelProto:
    """x[N,16] -> Gemm 32 -> Relu -> Gemm 10 = logits; loss = SoftmaxCrossEntropyLoss(logits, labels), mean."""
    w = ModelWriter(seed=1)
    h = w.node("Relu", [_linear(w, "x", "fc1", 16, 32)], "relu1")
    logits = _linear(w, h, "fc2", 32, 10, output="logits")
    w.node("SoftmaxCrossEntropyLoss", [logits, "labels"], "loss", reduction="mean")
    return w.model(
        "mlp",
        [helper.make_tensor_value_info("x", FLOAT, ["N", 16]),
         helper.make_tensor_value_info("labels", INT64, ["N"])],
        [helper.make_tensor_value_info("loss", FLOAT, []),
         helper.make_tensor_value_info("logits", FLOAT, ["N", 10])],
        "MLP classifier: 16 -> 32 (Relu) -> 10, softmax cross-entropy.")


def cnn() -> onnx.ModelProto:
    """x[N,1,8,8] -> Conv 4x3x3 pad 1 -> Relu -> MaxPool 2 -> Flatten -> Gemm 10; cross-entropy."""
    w = ModelWriter(seed=2)
    weight = w.param("conv1.weight", (4, 1, 3, 3), 1 * 3 * 3)
    bias = w.param("conv1.bias", (4,), 1 * 3 * 3)
    c = w.node("Conv", ["x", weight, bias], "conv1", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    r = w.node("Relu", [c], "relu1")
    p = w.node("MaxPool", [r], "pool1", kernel_shape=[2, 2], strides=[2, 2])
    f = w.node("Flatten", [p], "flatten", axis=1)
    logits = _linear(w, f, "fc", 4 * 4 * 4, 10, output="logits")
    w.node("SoftmaxCrossEntropyLoss", [logits, "labels"], "loss", reduction="mean")
    return w.model(
        "cnn",
        [helper.make_tensor_value_info("x", FLOAT, ["N", 1, 8, 8]),
         helper.make_tensor_value_info("labels", INT64, ["N"])],
        [helper.make_tensor_value_info("loss", FLOAT, []),
         helper.make_tensor_value_info("logits", FLOAT, ["N", 10])],
        "Small CNN: Conv 4x3x3 (pad 1), Relu, MaxPool 2, Flatten, Gemm 10, softmax cross-entropy.")


def transformer(d: int = 16, hidden: int = 32, t: int = 8) -> onnx.ModelProto:
    """One pre-LN block: x + Attn(LN1(x)), then + MLP(LN2(.)) with erf-Gelu; loss = mean((y - target)^2)."""
    w = ModelWriter(seed=3)

    def dense(x: str, name: str, n_in: int, n_out: int) -> str:  # x @ W + b, W [in, out]
        weight = w.param(f"{name}.weight", (n_in, n_out), n_in)
        bias = w.param(f"{name}.bias", (n_out,), n_in)
        return w.node("Add", [w.node("MatMul", [x, weight], f"{name}.matmul"), bias], name)

    def layer_norm(x: str, name: str) -> str:
        return w.node("LayerNormalization", [x, w.ones(f"{name}.weight", (d,)), w.zeros(f"{name}.bias", (d,))],
                      name, axis=-1, epsilon=1e-5)

    h = layer_norm("x", "ln1")
    q, k, v = (dense(h, f"attn.{n}", d, d) for n in "qkv")
    scores = w.node("MatMul", [q, w.node("Transpose", [k], "attn.k_t", perm=[0, 2, 1])], "attn.scores")
    scaled = w.node("Mul", [scores, w.const("attn.scale", 1.0 / np.sqrt(d))], "attn.scaled")
    probs = w.node("Softmax", [scaled], "attn.probs", axis=-1)
    attn = dense(w.node("MatMul", [probs, v], "attn.mix"), "attn.out", d, d)
    r1 = w.node("Add", ["x", attn], "residual1")

    m = dense(layer_norm(r1, "ln2"), "mlp.fc1", d, hidden)
    erf = w.node("Erf", [w.node("Div", [m, w.const("gelu.sqrt2", np.sqrt(2.0))], "gelu.scaled")], "gelu.erf")
    half_m = w.node("Mul", [m, w.const("gelu.half", 0.5)], "gelu.half_x")
    gelu = w.node("Mul", [half_m, w.node("Add", [w.const("gelu.one", 1.0), erf], "gelu.one_plus")], "gelu")
    pred = w.node("Add", [r1, dense(gelu, "mlp.fc2", hidden, d)], "pred")  # the second residual
    diff = w.node("Sub", [pred, "target"], "diff")
    w.node("ReduceMean", [w.node("Mul", [diff, diff], "sq")], "loss", keepdims=0)
    return w.model(
        "transformer",
        [helper.make_tensor_value_info("x", FLOAT, ["N", t, d]),
         helper.make_tensor_value_info("target", FLOAT, ["N", t, d])],
        [helper.make_tensor_value_info("loss", FLOAT, []),
         helper.make_tensor_value_info("pred", FLOAT, ["N", t, d])],
        "One pre-LN transformer block (single-head attention, erf-Gelu MLP 16-32-16), mean-squared error.")


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def main(argv: list[str]) -> None:
    out_dir = Path(argv[0]) if argv else Path(__file__).resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, make in MODELS.items():
        path = out_dir / f"{name}.onnx"
        path.write_bytes(make().SerializeToString(deterministic=True))
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
