"""Losses appended by --loss-fn: the values and the gradients they give match torch.nn.functional's losses, and
the contract (target input, loss output, names, metadata, errors) holds."""
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxgrad
from onnxgrad import UsageError, runtime
from onnxgrad.cli import main
from onnxgrad.losses import append_loss

N, FEATURES, C, D = 6, 5, 4, 3
MLP = Path(__file__).resolve().parent.parent / "models" / "mlp.onnx"


def linear_model(out_shape, opset=18, out_name="pred", dtype=np.float32, zero=False):
    """out = reshape(x @ W + b, out_shape) with x [N, 5] and W [5, prod(out_shape[1:])]: predictions or logits."""
    rng = np.random.default_rng(7)
    width = int(np.prod(out_shape[1:]))
    w = np.zeros((FEATURES, width)) if zero else rng.standard_normal((FEATURES, width))
    b = np.zeros(width) if zero else rng.standard_normal(width) * 0.1
    elem = T.DOUBLE if dtype == np.float64 else T.FLOAT
    nodes = [h.make_node("MatMul", ["x", "W"], ["xw"], name="matmul"),
             h.make_node("Add", ["xw", "b"], ["flat"], name="add"),
             h.make_node("Reshape", ["flat", "shape"], [out_name], name="reshape")]
    inits = [numpy_helper.from_array(w.astype(dtype), "W"), numpy_helper.from_array(b.astype(dtype), "b"),
             numpy_helper.from_array(np.array([-1, *out_shape[1:]], np.int64), "shape")]
    out_dims = ["N", *out_shape[1:]]
    g = h.make_graph(nodes, "linear", [h.make_tensor_value_info("x", elem, ["N", FEATURES])],
                     [h.make_tensor_value_info(out_name, elem, out_dims)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def run(model, feeds):
    sess = runtime.session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def torch_reference(model, x, target, loss_fn):
    """Loss and gradients of W and b in PyTorch (float64), for the linear model."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out_shape = tuple(int(d) for d in inits["shape"])
    w = torch.tensor(inits["W"], dtype=torch.float64, requires_grad=True)
    b = torch.tensor(inits["b"], dtype=torch.float64, requires_grad=True)
    out = (torch.tensor(x, dtype=torch.float64) @ w + b).reshape(out_shape)
    loss = loss_fn(out, torch.tensor(target))
    loss.backward()
    return loss.item(), w.grad.numpy(), b.grad.numpy()


def float_target(shape, kind, rng):
    if kind == "bce-with-logits":
        return rng.uniform(0, 1, shape).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


TORCH = {
    "mse": lambda reduction: lambda o, t: F.mse_loss(o, t.to(o.dtype), reduction=reduction),
    "l1": lambda reduction: lambda o, t: F.l1_loss(o, t.to(o.dtype), reduction=reduction),
    "bce-with-logits": lambda reduction: lambda o, t: F.binary_cross_entropy_with_logits(
        o, t.to(o.dtype), reduction=reduction),
}


def check_against_torch(model, kind, x, target, torch_loss, **options):
    train = onnxgrad.build_gradient(model, loss_fn=kind, target=model.graph.output[0].name, loss_options=options)
    out = run(train, {"x": x, "target": target})
    loss, gw, gb = torch_reference(model, x, target, torch_loss)
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["W_grad"], gw, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out["b_grad"], gb, rtol=1e-4, atol=1e-6)
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["mse", "l1", "bce-with-logits"])
def test_elementwise_losses_match_torch(kind, reduction):
    rng = np.random.default_rng(1)
    model = linear_model((N, 2, 3))
    x = rng.standard_normal((N, FEATURES)).astype(np.float32)
    target = float_target((N, 2, 3), kind, rng)
    check_against_torch(model, kind, x, target, TORCH[kind](reduction), reduction=reduction)


def test_bce_with_logits_is_stable_for_large_logits():
    rng = np.random.default_rng(2)
    model = linear_model((N, 4))
    x = (rng.standard_normal((N, FEATURES)) * 40).astype(np.float32)  # logits of size ~100: exp would overflow
    target = rng.uniform(0, 1, (N, 4)).astype(np.float32)
    out = check_against_torch(model, "bce-with-logits", x, target, TORCH["bce-with-logits"]("mean"))
    assert np.isfinite(out["loss"]) and abs(float(out["loss"])) > 1.0


def test_bce_with_logits_gradient_at_zero_logits():
    # A zero-initialised head starts at logits 0, where a max(x,0)/|x| form of the loss has a kink.
    rng = np.random.default_rng(3)
    model = linear_model((N, 4), zero=True)
    x = rng.standard_normal((N, FEATURES)).astype(np.float32)
    target = rng.uniform(0, 1, (N, 4)).astype(np.float32)
    out = check_against_torch(model, "bce-with-logits", x, target, TORCH["bce-with-logits"]("mean"))
    np.testing.assert_allclose(out["b_grad"], (0.5 - target).sum(axis=0) / target.size, rtol=1e-5)


CE_CASES = [
    # (id, logits shape, options)
    ("mean", (N, C), {}),
    ("sum", (N, C), {"reduction": "sum"}),
    ("weights", (N, C), {"class_weights": [0.5, 2.0, 1.0, 3.0]}),
    ("ignore", (N, C), {"ignore_index": 2}),
    ("weights-ignore-sum", (N, C), {"class_weights": [0.5, 2.0, 1.0, 3.0], "ignore_index": 1, "reduction": "sum"}),
    ("weights-ignore-neg", (N, C), {"class_weights": [0.5, 2.0, 1.0, 3.0], "ignore_index": -100}),
    ("rank3", (N, C, D), {"class_weights": [1.0, 0.25, 2.0, 1.5], "ignore_index": 0}),
]


@pytest.mark.parametrize("shape,options", [c[1:] for c in CE_CASES], ids=[c[0] for c in CE_CASES])
def test_cross_entropy_matches_torch(shape, options):
    rng = np.random.default_rng(4)
    model = linear_model(shape, out_name="logits")
    x = rng.standard_normal((N, FEATURES)).astype(np.float32)
    labels = rng.integers(0, C, (N,) + shape[2:]).astype(np.int64)
    if "ignore_index" in options:
        labels.flat[::3] = options["ignore_index"]  # some targets ignored, the others kept
    weight = options.get("class_weights")

    def torch_loss(o, t):
        return F.cross_entropy(o, t, weight=None if weight is None else torch.tensor(weight, dtype=o.dtype),
                               ignore_index=options.get("ignore_index", -100),
                               reduction=options.get("reduction", "mean"))
    check_against_torch(model, "cross-entropy", x, labels, torch_loss, **options)


def test_contract_inputs_outputs_types_and_metadata():
    model = linear_model((N, C, D), out_name="logits")
    with_loss = append_loss(model, "cross-entropy", "logits", ignore_index=-1)
    assert [i.name for i in with_loss.graph.input] == ["x", "target"]
    assert [o.name for o in with_loss.graph.output] == ["logits", "loss"]
    target = with_loss.graph.input[1].type.tensor_type
    assert target.elem_type == T.INT64
    assert [d.dim_param or d.dim_value for d in target.shape.dim] == ["N", D]
    loss = with_loss.graph.output[1].type.tensor_type
    assert loss.elem_type == T.FLOAT and len(loss.shape.dim) == 0
    meta = json.loads({p.key: p.value for p in with_loss.metadata_props}["onnxgrad.loss_fn"])
    assert meta == {"kind": "cross-entropy", "output": "logits", "target_input": "target", "loss_output": "loss",
                    "reduction": "mean", "class_weights": None, "ignore_index": -1}
    assert with_loss.ir_version == model.ir_version
    onnx.checker.check_model(with_loss, full_check=True)
    assert {t.name for t in with_loss.graph.initializer} == {"W", "b", "shape"}  # class weights never train

    mse = append_loss(model, "mse", "logits", target_input="y", loss_output="l")
    t = mse.graph.input[1]
    assert t.name == "y" and t.type.tensor_type.elem_type == T.FLOAT
    assert [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim] == ["N", C, D]
    assert [o.name for o in mse.graph.output] == ["logits", "l"]


def test_training_graph_with_loss_fn():
    model = linear_model((N, C), out_name="logits")
    train = onnxgrad.build(model, loss_fn="cross-entropy", target="logits",
                           loss_options={"class_weights": [1, 2, 3, 4]})
    assert [i.name for i in train.model.graph.input] == ["x", "target", "W", "b"]
    assert [o.name for o in train.model.graph.output] == ["logits", "loss", "W_grad", "b_grad"]
    meta = {p.key: p.value for p in train.model.metadata_props}
    assert meta["onnxgrad.loss"] == "loss" and "onnxgrad.loss_fn" in meta
    assert train.report["loss_fn"] == "cross-entropy" and train.report["parameters"] == ["W", "b"]
    onnx.checker.check_model(train.model, full_check=True)
    again = onnxgrad.build_gradient(model, loss_fn="cross-entropy", target="logits",
                                    loss_options={"class_weights": [1, 2, 3, 4]})
    assert again.SerializeToString(deterministic=True) == train.model.SerializeToString(deterministic=True)


@pytest.mark.parametrize("opset", [13, 23])
def test_losses_valid_at_opset(opset):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, FEATURES)).astype(np.float32)
    for kind in ("mse", "l1", "bce-with-logits"):
        model = linear_model((N, C), opset=opset)
        check_against_torch(model, kind, x, float_target((N, C), kind, rng), TORCH[kind]("sum"), reduction="sum")
    model = linear_model((N, C), opset=opset, out_name="logits")
    labels = rng.integers(0, C, N).astype(np.int64)
    check_against_torch(model, "cross-entropy", x, labels, F.cross_entropy)


def test_float64_model():
    rng = np.random.default_rng(6)
    model = linear_model((N, C), dtype=np.float64)
    x = rng.standard_normal((N, FEATURES))
    target = rng.standard_normal((N, C))
    train = onnxgrad.build_gradient(model, loss_fn="mse", target="pred")
    assert train.graph.input[1].type.tensor_type.elem_type == T.DOUBLE
    out = run(train, {"x": x, "target": target})
    loss, gw, _ = torch_reference(model, x, target, F.mse_loss)
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-12)
    np.testing.assert_allclose(out["W_grad"], gw, rtol=1e-10)


def test_the_only_output_is_the_default_target():
    train = onnxgrad.build_gradient(linear_model((N, C)), loss_fn="l1")
    assert [o.name for o in train.graph.output] == ["pred", "loss", "W_grad", "b_grad"]


@pytest.mark.parametrize("kwargs,message", [
    ({"loss_fn": "hinge", "target": "pred"}, "--loss-fn hinge: expected one of"),
    ({"loss_fn": "mse", "target": "nope"}, "--target nope: no graph output of that name (outputs: pred)"),
    ({"loss_fn": "mse", "target": "pred", "loss_options": {"reduction": "none"}}, "--reduction none"),
    ({"loss_fn": "mse", "target": "pred", "loss_options": {"class_weights": [1.0]}}, "only for --loss-fn cross"),
    ({"loss_fn": "l1", "target": "pred", "loss_options": {"ignore_index": 0}}, "--ignore-index: only for"),
    ({"loss_fn": "cross-entropy", "target": "pred", "loss_options": {"class_weights": [1.0, 2.0]}},
     "2 weights given, the output 'pred' has 4 classes"),
    ({"loss_fn": "cross-entropy", "target": "pred", "loss_options": {"class_weights": [1, -1, 1, 1]}},
     "non-negative"),
    ({"loss_fn": "mse", "target": "pred", "loss_options": {"target_input": "x"}},
     "cannot add the target input 'x': the model already has a value of that name; name it with --target-input"),
    ({"loss_fn": "mse", "target": "pred", "loss_options": {"loss_output": "xw"}},
     "cannot add the loss output 'xw'"),
    ({"loss_fn": "mse", "target": "pred", "loss_options": {"loss_output": "t", "target_input": "t"}},
     "both 't'"),
    ({"loss_fn": "mse", "target": "pred", "loss": "pred"}, "--loss pred: with --loss-fn"),
    ({"target": "pred"}, "--target: needs --loss-fn"),
    ({"loss_options": {"reduction": "sum"}}, "--reduction: needs --loss-fn"),
    ({"loss_fn": "mse", "loss_options": {"weights": [1]}}, "loss option 'weights'"),
])
def test_usage_errors(kwargs, message):
    with pytest.raises(UsageError) as e:
        onnxgrad.build_gradient(linear_model((N, C)), **kwargs)
    assert message in str(e.value)


def test_cross_entropy_needs_logits_with_a_class_axis():
    g = h.make_graph([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0)], "m",
                     [h.make_tensor_value_info("x", T.FLOAT, [3])], [h.make_tensor_value_info("s", T.FLOAT, [])])
    with pytest.raises(UsageError, match="logits of shape \\[N, C, ...\\], this output has rank 0"):
        append_loss(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]), "cross-entropy", "s")


def test_shipped_mlp_needs_another_loss_name(tmp_path):
    # models/mlp.onnx already has an output `loss`: the appended one must be named otherwise.
    out = tmp_path / "t.onnx"
    code = main(["build-grad", str(MLP), "-o", str(out), "--loss-fn", "cross-entropy", "--target",
                 "logits"])
    assert code == UsageError.exit_code and not out.exists()
    assert main(["build-grad", str(MLP), "-o", str(out), "--loss-fn", "cross-entropy", "--target",
                 "logits", "--loss-output", "ce", "--class-weights", "1,1,1,1,1,1,1,1,1,2", "--ignore-index",
                 "-1", "--target-input", "y", "--dim", "N=3"]) == 0
    train = onnx.load(out)
    assert [o.name for o in train.graph.output][:3] == ["loss", "logits", "ce"]
    rng = np.random.default_rng(8)
    labels = np.array([1, -1, 9])
    res = run(train, {"x": rng.standard_normal((3, 16)).astype(np.float32), "labels": labels, "y": labels})
    assert np.isfinite(res["ce"]) and res["ce"] != res["loss"]  # ignore_index and weights change the value


def test_cross_entropy_gradient_holds_two_score_sized_tensors(tmp_path):
    """Over many classes the scores' gradient is the softmax times the loss's coefficient with each label's
    coefficient added at its class: the backward holds two score-sized tensors at once (the softmax and its
    product, then the product and the sum), simulated and as onnxruntime runs it; a one-hot gradient beside
    them made three."""
    from onnxgrad.api import load_graph
    from onnxgrad.memory.measure import measure
    from onnxgrad.memory.simulate import simulate
    rows, classes = 256, 20000
    w = np.random.default_rng(0).standard_normal((FEATURES, classes)).astype(np.float32)
    nodes = [h.make_node("MatMul", ["x", "W"], ["scores"]),
             h.make_node("SoftmaxCrossEntropyLoss", ["scores", "labels"], ["loss"])]
    graph = h.make_graph(nodes, "classifier", [h.make_tensor_value_info("x", T.FLOAT, [rows, FEATURES]),
                                                h.make_tensor_value_info("labels", T.INT64, [rows])],
                         [h.make_tensor_value_info("loss", T.FLOAT, [])], [numpy_helper.from_array(w, "W")])
    train = onnxgrad.build_gradient(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))
    scores = rows * classes * 4
    assert simulate(load_graph(train)).dynamic_peak < 2.3 * scores
    path = tmp_path / "classifier.onnx"
    onnx.save(train, str(path))
    assert measure(path)["peak_bytes"] < 2.3 * scores
