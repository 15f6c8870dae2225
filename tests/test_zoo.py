"""The onnx model zoo's light graphs (shipped inside the onnx wheel, opset 9, weights as ConstantOfShape
placeholders), given random weights by `onnxgrad materialize` and differentiated.

All nine: build-grad (after the opset 9 -> 13 upgrade) and the full checker on the training graph. Eight
(1.2M-87M parameters) also run in onnxruntime: the training graph's output must equal the forward model's,
and a finite-difference spot check of three parameters each (the first, a middle one and the last) must
agree. VGG-19 (144M parameters, 20 GFLOPs a forward pass) gets build + checker only: its calibration, run and
finite differences would take about 35 s of CI's 2 cores; its ops (Conv, MaxPool, Relu, Gemm, Dropout,
Softmax) are all checked numerically on AlexNet.

The spot check: f(theta) = <y, c> for the model output y (Softmax, or the last Conv for DenseNet-121) and a
seeded random c fed as `<y>_grad`; along d = sign(g) * U(0.5, 1.5) (every element of the parameter moves
the way its gradient says, so <g, d> is large and a wrong element shows), the central difference of f in
float32 must match <g, d> within 1e-2 for one of two steps, 3e-4 and 1e-4 times max(rms(theta), 0.1): the
larger step can cross ReLU/MaxPool kinks, the smaller one meets float32 rounding.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from onnxgrad import api, runtime, weights
from onnxgrad.materialize import materialize

ZOO = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
NUMERIC = ["squeezenet", "shufflenet", "inception_v1", "inception_v2", "resnet50", "densenet121", "bvlc_alexnet",
           "zfnet512"]
STEPS = (3e-4, 1e-4)
TOLERANCE = 1e-2


def zoo_model(name: str) -> onnx.ModelProto:
    return onnx.load(str(ZOO / f"light_{name}.onnx"))


@dataclass
class Trained:
    forward: onnx.ModelProto
    train: onnx.ModelProto
    report: dict
    feeds: dict[str, np.ndarray]     # data input and the output's seed gradient c
    results: dict[str, np.ndarray]   # every output of one run of the training graph


@pytest.fixture(scope="module", params=NUMERIC)
def trained(request) -> Trained:
    """Materialize (seed 0), build with the non-scalar output as the loss, run once: once per model."""
    forward, _ = materialize(zoo_model(request.param), seed=0)
    out = forward.graph.output[0].name
    result = api.build(forward, loss=out)
    rng = np.random.default_rng(0)
    x = forward.graph.input[0]
    feeds = {x.name: rng.standard_normal(_dims(x)).astype(np.float32),
             out + "_grad": rng.standard_normal(_dims(forward.graph.output[0])).astype(np.float32)}
    sess = runtime.session(result.model, "cpu")
    results = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return Trained(forward, result.model, result.report, feeds, results)


def _dims(vi: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value for d in vi.type.tensor_type.shape.dim]


def test_training_graph_passes_the_full_checker(trained):
    onnx.checker.check_model(trained.train, full_check=True)
    r = trained.report
    assert r["source_opset"] == 9 and r["opset"] == 13
    assert [o.name for o in trained.train.graph.output] == [trained.forward.graph.output[0].name] + [
        p + "_grad" for p in r["parameters"]]


def test_output_equals_the_forward_model_and_gradients_are_finite(trained):
    out = trained.forward.graph.output[0].name
    sess = ort.InferenceSession(trained.forward.SerializeToString(), providers=["CPUExecutionProvider"])
    x = trained.forward.graph.input[0].name
    y = sess.run([out], {x: trained.feeds[x]})[0]
    np.testing.assert_allclose(trained.results[out], y, rtol=1e-4, atol=1e-6)
    if trained.forward.graph.node[-1].op_type == "Softmax":  # calibrated weights: not saturated
        assert y.max() < 0.5
    grads = {p: trained.results[p + "_grad"] for p in trained.report["parameters"]}
    assert all(np.isfinite(g).all() for g in grads.values())
    zero = [p for p, g in grads.items() if not np.any(g)]
    assert len(zero) <= len(grads) // 10, zero


def test_finite_differences_agree(trained):
    params = trained.report["parameters"]
    picked = [params[0], params[len(params) // 2], params[-1]]
    out = trained.forward.graph.output[0].name
    inits = {t.name: t for t in trained.forward.graph.initializer}
    probe = onnx.ModelProto()
    probe.CopyFrom(trained.forward)
    for p in picked:  # graph inputs backed by the initializers, so a run can feed perturbed values
        probe.graph.input.append(helper.make_tensor_value_info(p, inits[p].data_type, list(inits[p].dims)))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), so, providers=["CPUExecutionProvider"])
    x = trained.forward.graph.input[0].name
    c = trained.feeds[out + "_grad"].astype(np.float64).ravel()

    def f(name: str, value: np.ndarray) -> float:
        y = sess.run([out], {x: trained.feeds[x], name: value.astype(np.float32)})[0]
        return float(y.astype(np.float64).ravel() @ c)

    failures = []
    for p in picked:
        theta = numpy_helper.to_array(inits[p]).astype(np.float64)
        g = trained.results[p + "_grad"].astype(np.float64)
        d = np.sign(g) * np.random.default_rng(1).uniform(0.5, 1.5, g.shape)
        analytic = float((g * d).sum())
        scale = max(float(np.sqrt((theta ** 2).mean())), 0.1)
        errors = []
        for step in STEPS:
            eps = step * scale
            fd = (f(p, theta + eps * d) - f(p, theta - eps * d)) / (2 * eps)
            errors.append(abs(fd - analytic) / abs(analytic))
        if min(errors) > TOLERANCE:
            failures.append(f"{p}: <g, d> = {analytic:.6g}, relative errors {errors}")
    assert not failures, failures


def test_rules_used(trained):
    used = set(trained.report["rules_used"])
    assert {"Conv", "Relu"} <= used
    assert ("LRN" in used) == any(n.op_type == "LRN" for n in trained.forward.graph.node)


def test_vgg19_builds_and_passes_the_full_checker():
    """Weights uncalibrated (calibration runs the model) and kept apart from the proto (no copy of them)."""
    forward, report = materialize(zoo_model("vgg19"), seed=0, calibrate=False)
    assert report.parameters == 143_667_112  # and two 64-element biases that the zoo file keeps
    out = forward.graph.output[0].name
    result = api.build(forward, loss=out, weights_apart=True)
    weights.check_model(result.model, full_check=True)
    assert result.report["opset"] == 13
    assert set(result.report["rules_used"]) == {"Conv", "Dropout", "Gemm", "MaxPool", "Relu", "Reshape", "Softmax"}
    assert [o.name for o in result.model.graph.output][1:] == [p + "_grad" for p in result.report["parameters"]]
    assert len(result.report["parameters"]) == len([t for t in forward.graph.initializer
                                                    if t.data_type == onnx.TensorProto.FLOAT])


# -- materialize itself ----------------------------------------------------------------------------------

def test_materialize_replaces_every_placeholder_with_role_scaled_initializers():
    source = zoo_model("resnet50")
    placeholders = {n.output[0] for n in source.graph.node if n.op_type == "ConstantOfShape"}
    model, report = materialize(source, seed=0, calibrate=False)
    g = model.graph
    assert not [n for n in g.node if n.op_type == "ConstantOfShape"]
    assert report.placeholders == 239 and report.roles["variance"] == 46
    init_names = {t.name for t in g.initializer}
    assert [vi.name for vi in g.input] == ["gpu_0/data_0"] and model.ir_version >= 4
    assert not [t for t in g.initializer if t.name.endswith("__SHAPE")]
    onnx.checker.check_model(model, full_check=True)
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    for n in g.node:  # the zoo file's few real tensors (e.g. the first BatchNormalization's) are kept as they are
        if n.op_type == "BatchNormalization" and set(n.input[1:5]) <= placeholders:
            scale, bias, mean, var = (values[v] for v in n.input[1:5])
            assert var.min() > 0 and np.abs(scale - 1).max() < 0.6 and np.abs(mean).max() < 0.6
        if n.op_type == "Conv" and n.input[1] in placeholders:
            w = values[n.input[1]]
            he = np.sqrt(2.0 / np.prod(w.shape[1:]))
            assert 0.8 * he < w.std() < 1.2 * he, n.input[1]
    assert init_names >= {n.input[1] for n in g.node if n.op_type == "Conv"}


def test_materialize_is_deterministic_for_a_seed_and_calibrates(tmp_path):
    src = ZOO / "light_squeezenet.onnx"
    outs = [tmp_path / f"{k}.onnx" for k in range(2)]
    for out in outs:
        proc = subprocess.run([sys.executable, "-m", "onnxgrad.cli", "materialize", str(src), "-o", str(out),
                               "--seed", "3"], capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.strip() == str(out), proc.stderr
    assert outs[0].read_bytes() == outs[1].read_bytes()
    model = onnx.load(str(outs[0]))
    other, _ = materialize(onnx.load(str(src)), seed=4)
    w3, w4 = (numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == "conv1_w_0"))
              for m in (model, other))
    assert w3.shape == w4.shape and not np.allclose(w3, w4)
    # calibration: every conv's output (before its bias) has a mean square of about 1 on an N(0, 1) input
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    convs = [n for n in probe.graph.node if n.op_type == "Conv"]
    for n in convs:
        plain = probe.graph.node.add()
        plain.CopyFrom(n)
        del plain.input[2:]
        plain.name, plain.output[0] = n.name + "_nobias", n.output[0] + "_nobias"
        probe.graph.output.append(helper.make_tensor_value_info(plain.output[0], onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((1, 3, 224, 224)).astype(np.float32)
    outs = sess.run([n.output[0] + "_nobias" for n in convs], {"data_0": x})
    ms = [float(np.mean(o.astype(np.float64) ** 2)) for o in outs]
    assert all(0.5 < m < 2 for m in ms), ms


def test_materialize_turns_float_constants_into_initializers():
    h = helper
    nodes = [h.make_node("Constant", [], ["w"], value=numpy_helper.from_array(np.zeros((4, 3), np.float32))),
             h.make_node("Constant", [], ["eps"], value=numpy_helper.from_array(np.array([0.5], np.float32))),
             h.make_node("MatMul", ["x", "w"], ["m"]), h.make_node("Add", ["m", "eps"], ["y"])]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
                     [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])])
    model, report = materialize(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), seed=1)
    assert report.constants == 1 and report.calibrated == 0  # a symbolic batch dim: no calibration run
    assert [t.name for t in model.graph.initializer] == ["w"]
    assert [n.op_type for n in model.graph.node] == ["Constant", "MatMul", "Add"]  # the scalar stays
    w = numpy_helper.to_array(model.graph.initializer[0])
    assert w.shape == (4, 3) and np.any(w)
    train = api.build_gradient(model, loss="y")
    assert [o.name for o in train.graph.output] == ["y", "w_grad"]


def test_materialize_refuses_a_model_without_placeholders():
    from onnxgrad.errors import UsageError
    h = helper
    g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [h.make_tensor_value_info("x", 1, [2])],
                     [h.make_tensor_value_info("y", 1, [2])])
    with pytest.raises(UsageError, match="no placeholder weights"):
        materialize(h.make_model(g))
