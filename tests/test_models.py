"""The shipped example models (models/*.onnx): regeneration, output contract, and gradients against PyTorch.

Each model's training graph runs in onnxruntime and is compared with a PyTorch module, written here, that
computes the same function from the same weights (read from the ONNX initializers): the loss and the second
output to float32 precision, every parameter gradient to a relative L2 error of 1e-4.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper

import onnxgrad
from onnxgrad import runtime

ROOT = Path(__file__).resolve().parents[1]
MODELS_DIR = ROOT / "models"
NAMES = ["mlp", "cnn", "transformer"]


def _make_models_module():
    spec = importlib.util.spec_from_file_location("make_models", MODELS_DIR / "make_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    """The script's output in a fresh folder, written by a separate interpreter as a user would run it."""
    out = tmp_path_factory.mktemp("models")
    subprocess.run([sys.executable, str(MODELS_DIR / "make_models.py"), str(out)], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="module")
def forward_models(regenerated) -> dict[str, onnx.ModelProto]:
    """The shipped files where present, else the freshly generated ones (they are byte-identical)."""
    return {name: onnx.load(str(MODELS_DIR / f"{name}.onnx" if (MODELS_DIR / f"{name}.onnx").exists()
                                else regenerated / f"{name}.onnx")) for name in NAMES}


# -- the same functions in PyTorch ------------------------------------------------------------------------

def torch_mlp(p, feeds):
    h = F.relu(F.linear(feeds["x"], p["fc1.weight"], p["fc1.bias"]))
    logits = F.linear(h, p["fc2.weight"], p["fc2.bias"])
    return F.cross_entropy(logits, feeds["labels"]), logits


def torch_cnn(p, feeds):
    h = F.relu(F.conv2d(feeds["x"], p["conv1.weight"], p["conv1.bias"], padding=1))
    h = torch.flatten(F.max_pool2d(h, 2), 1)
    logits = F.linear(h, p["fc.weight"], p["fc.bias"])
    return F.cross_entropy(logits, feeds["labels"]), logits


def torch_transformer(p, feeds):
    x = feeds["x"]
    d = x.shape[-1]

    def dense(v, name):  # MatMul weights are [in, out]
        return v @ p[f"{name}.weight"] + p[f"{name}.bias"]

    h = F.layer_norm(x, (d,), p["ln1.weight"], p["ln1.bias"], eps=1e-5)
    q, k, v = dense(h, "attn.q"), dense(h, "attn.k"), dense(h, "attn.v")
    probs = torch.softmax((q @ k.transpose(1, 2)) * np.float32(1.0 / np.sqrt(d)), dim=-1)
    r1 = x + dense(probs @ v, "attn.out")
    m = dense(F.layer_norm(r1, (d,), p["ln2.weight"], p["ln2.bias"], eps=1e-5), "mlp.fc1")
    gelu = (m * 0.5) * (1.0 + torch.erf(m / np.float32(np.sqrt(2.0))))
    pred = r1 + dense(gelu, "mlp.fc2")
    return torch.mean((pred - feeds["target"]) ** 2), pred


# Softmax is unchanged by adding q . b_k to every score of a row, so the key bias has an exact zero gradient;
# both frameworks return rounding noise of about 1e-9 there, where a relative error means nothing.
ANALYTICALLY_ZERO = {"transformer": {"attn.k.bias"}}

TORCH = {"mlp": torch_mlp, "cnn": torch_cnn, "transformer": torch_transformer}


def make_feeds(name: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "transformer":
        return {"x": rng.standard_normal((n, 8, 16)).astype(np.float32),
                "target": rng.standard_normal((n, 8, 16)).astype(np.float32)}
    shape = (n, 16) if name == "mlp" else (n, 1, 8, 8)
    return {"x": rng.standard_normal(shape).astype(np.float32),
            "labels": rng.integers(0, 10, size=n).astype(np.int64)}


def parameters(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_type == onnx.TensorProto.FLOAT}


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_against_torch(name: str, forward: onnx.ModelProto, train: onnx.ModelProto, n: int) -> None:
    feeds = make_feeds(name, n, seed=n)
    params = parameters(forward)
    sess = runtime.session(train, "cpu")
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **params})))

    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    loss, second = TORCH[name](tp, {k: torch.from_numpy(v) for k, v in feeds.items()})
    loss.backward()

    second_name = forward.graph.output[1].name
    np.testing.assert_allclose(outs["loss"], loss.item(), rtol=1e-5, err_msg=f"{name}: loss")
    assert outs["loss"].shape == ()
    np.testing.assert_allclose(outs[second_name], second.detach().numpy(), rtol=1e-4, atol=1e-5,
                               err_msg=f"{name}: {second_name}")
    zero = ANALYTICALLY_ZERO.get(name, set())
    scale = np.sqrt(sum(float(np.sum(tp[k].grad.numpy() ** 2)) for k in params))
    for k in zero:  # both sides are float32 rounding noise; they must only be tiny
        assert np.linalg.norm(outs[k + "_grad"]) <= 1e-6 * scale, f"{name}: {k}_grad should be about 0"
    errors = {k: rel_l2(outs[k + "_grad"], tp[k].grad.numpy()) for k in params if k not in zero}
    bad = {k: e for k, e in errors.items() if not e <= 1e-4}
    assert not bad, f"{name} (N={n}): gradients differ from torch (relative L2): {bad}"


# -- tests --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_script_regenerates_byte_identical(name, regenerated):
    again = _make_models_module().MODELS[name]().SerializeToString(deterministic=True)
    fresh = (regenerated / f"{name}.onnx").read_bytes()
    assert fresh == again, "two runs of make_models.py differ"
    shipped = MODELS_DIR / f"{name}.onnx"
    if shipped.exists():
        assert shipped.read_bytes() == fresh, f"{shipped} is stale: run python models/make_models.py"


@pytest.mark.parametrize("name", NAMES)
def test_forward_model_shape(name, forward_models):
    m = forward_models[name]
    onnx.checker.check_model(m, full_check=True)
    assert [o.name for o in m.graph.output][0] == "loss" and len(m.graph.output) == 2
    assert m.opset_import[0].version == 18
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in m.graph.initializer)


@pytest.mark.parametrize("name", NAMES)
def test_output_contract(name, forward_models):
    forward = forward_models[name]
    train = onnxgrad.build_gradient(forward, dims={"N": 4})
    onnx.checker.check_model(train, full_check=True)
    assert train.ir_version <= 13, "onnxruntime 1.31 reads IR versions up to 13"
    params = [t for t in forward.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    expected = [o.name for o in forward.graph.output] + [t.name + "_grad" for t in params]
    assert [o.name for o in train.graph.output] == expected
    inputs = {i.name: i for i in train.graph.input}
    for t in params:
        assert t.name in inputs, f"parameter {t.name} is not a graph input"
    grads = {o.name: o for o in train.graph.output}
    for t in params:
        dims = [d.dim_value for d in grads[t.name + "_grad"].type.tensor_type.shape.dim]
        assert dims == list(t.dims), f"{t.name}_grad has shape {dims}, the parameter {list(t.dims)}"
    assert [d.dim_value for d in inputs["x"].type.tensor_type.shape.dim][0] == 4


@pytest.mark.parametrize("name", NAMES)
def test_gradients_match_torch(name, forward_models):
    forward = forward_models[name]
    train = onnxgrad.build_gradient(forward, dims={"N": 4})
    check_against_torch(name, forward, train, n=4)


@pytest.mark.parametrize("name", NAMES)
def test_symbolic_batch_runs_for_several_sizes(name, forward_models):
    forward = forward_models[name]
    train = onnxgrad.build_gradient(forward)
    assert train.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for n in (3, 5):
        check_against_torch(name, forward, train, n=n)
