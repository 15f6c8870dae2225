"""Models written in PyTorch, exported with the dynamo exporter, differentiated by onnxgrad, checked by autograd.

Each torch module returns its scalar loss. It is exported once per module (exports take seconds) with
`torch.onnx.export(..., dynamo=True, optimize=False)`: the default `optimize=True` constant-folds parameters
into new anonymous initializers (BatchNorm in eval mode is folded into the Conv weights; the transposed
Linear weights become `val_<n>` constants), so the ONNX parameters would no longer be the torch parameters.
Without it the exporter keeps torch's names (`fc1.weight`) and values, so ONNX initializers map to
`named_parameters()` by name. Buffers (BatchNorm running statistics) are passed as `frozen`.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import numpy_helper

import onnxgrad
from onnxgrad import runtime
from test_pipeline import assert_typed

torch.set_num_threads(2)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x, labels):
        return F.cross_entropy(self.fc2(F.relu(self.fc1(x))), labels)


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.pool = nn.MaxPool2d(2)
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 10)

    def forward(self, x, labels):
        h = self.gap(self.pool(F.relu(self.bn(self.conv(x))))).flatten(1)
        return F.cross_entropy(self.fc(h), labels)


class EncoderBlock(nn.Module):
    """Pre-LN: x + MHA(LN(x)), then + MLP(LN(.)) with exact (erf) GELU; mean-squared error to a target."""

    def __init__(self, d=16, heads=2, hidden=32):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x, target):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return F.mse_loss(x, target)


def _cnn_eval():
    model = CNN()
    with torch.no_grad():  # non-trivial running statistics, so eval-mode BatchNorm is not the identity
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.bias.uniform_(-0.5, 0.5)
    return model.eval()


def _inputs(name: str, g: torch.Generator):
    if name == "mlp":
        return torch.randn(4, 16, generator=g), torch.randint(0, 10, (4,), generator=g)
    if name == "cnn":
        return torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    return torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g)


MODELS = {"mlp": MLP, "cnn": _cnn_eval, "transformer": lambda: EncoderBlock().eval()}


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    """(name, torch module, example inputs, path of the exported .onnx), one export per model."""
    name = request.param
    torch.manual_seed(0)
    model = MODELS[name]()
    args = _inputs(name, torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), dynamo=True, optimize=False)
    return name, model, args, path


def test_export_keeps_parameter_names_and_values(exported):
    name, model, _, path = exported
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    for pname, p in model.named_parameters():
        assert pname in inits, f"{name}: the export renamed or folded {pname}"
        np.testing.assert_array_equal(inits[pname], p.detach().numpy())


def test_gradients_match_torch(exported):
    name, model, args, path = exported
    buffers = [b for b, _ in model.named_buffers() if b.endswith(("running_mean", "running_var"))]
    result = onnxgrad.build(path, frozen=buffers or None)
    train = result.model
    assert_typed(train)
    params = dict(model.named_parameters())
    assert result.report["parameters"] == list(params), "onnxgrad chose other parameters than torch has"

    sess = runtime.session(train, "cpu")
    input_names = [i.name for i in onnx.load(str(path), load_external_data=False).graph.input]
    feeds = {n: a.numpy() for n, a in zip(input_names, args)}
    feeds.update({k: p.detach().numpy() for k, p in params.items()})
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    model.zero_grad()
    loss = model(*args)
    loss.backward()
    np.testing.assert_allclose(outs[result.report["loss"]], loss.item(), rtol=1e-5, err_msg=f"{name}: loss")
    errors = {}
    for k, p in params.items():
        ours, theirs = outs[k + "_grad"], p.grad.numpy()
        errors[k] = float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))
    bad = {k: e for k, e in errors.items() if not e <= 1e-4}
    assert not bad, f"{name}: gradients differ from torch (relative L2): {bad}"


def test_mirrored_export_gives_the_same_gradients(exported):
    from test_mirror import assert_same_outputs
    name, model, args, path = exported
    buffers = [b for b, _ in model.named_buffers() if b.endswith(("running_mean", "running_var"))] or None
    plain = onnxgrad.build(path, frozen=buffers)
    mirrored = onnxgrad.build(path, frozen=buffers, mirror="mxnet")
    assert_typed(mirrored.model)
    assert_same_outputs(plain.model, mirrored.model)
