"""Real model families (tests/real_models.py), exported by torch.onnx's dynamo exporter, checked by autograd.

Each model is exported twice, once per exporter mode, each export once per module (exports are the slow part).

- `plain` (`optimize=False`): the initializers are torch's parameters under torch's names and values (a tied
  parameter appears once, under one of its names). onnxgrad chooses the parameters itself (buffers frozen) and
  must choose exactly torch's. Compared: the loss, every parameter's gradient, every float input's gradient.
- `optimized` (`optimize=True`, the default): the optimizer folds constant subgraphs, so an initializer is
  either a parameter, or an exact copy of one under a new name (reshaped, transposed, a leading block of rows,
  or broadcast: what folding Unsqueeze, Transpose, Slice/Gather and Expand of a parameter gives), or a
  BatchNorm folded into the conv before it (the conv's weight name then holds W*s, a new initializer the
  bias (b - mean)*s + beta, s = gamma/std), or something else. Copies and folded pairs are found by value,
  differentiated (`requires_grad`), and their gradients mapped back to torch's parameters and summed per
  parameter (a tied embedding's Gather and its folded transpose both contribute; a folded BatchNorm's gamma
  gets the chain rule through both W' and b'). Compared: the loss, the float inputs' gradients (they flow
  through every folded weight), and every parameter so mapped; FOLDED lists, per model, the parameters that
  are none of these (so not compared in this mode; the plain mode compares them).

Gradients must agree to a relative L2 error of 1e-4, the loss to 1e-5.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

import onnxgrad
import real_models
from test_pipeline import assert_typed
from onnxgrad import runtime

torch.set_num_threads(2)

# Parameters the optimizer may fold into values that are no exact copy of them (a full match of the name).
FOLDED = {
    # torch's gate order (i, f, g, o) reordered to ONNX's (i, o, f, c), directions stacked, biases concatenated
    "lstm_tagger": r"lstm\.(weight|bias)_(ih|hh)_l0(_reverse)?",
}
# Softmax is unchanged by adding q.b_k to every score of a row: the key bias has an exact zero gradient, and
# both sides return rounding noise there, where a relative error means nothing.
ANALYTICALLY_ZERO = r".*attention\.self\.key\.bias"
MODES = {"plain": False, "optimized": True}


@dataclass
class Exported:
    name: str
    mode: str
    model: torch.nn.Module
    args: tuple
    onnx: onnx.ModelProto
    path: str


@pytest.fixture(scope="module", params=[(n, m) for n in real_models.MODELS for m in MODES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def exported(request, tmp_path_factory) -> Exported:
    name, mode = request.param
    model, args = real_models.make(name)
    path = str(tmp_path_factory.mktemp(name) / f"{name}_{mode}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, path, dynamo=True, optimize=MODES[mode])
    return Exported(name, mode, model, args, onnx.load(path), path)


# -- mapping ONNX initializers back to torch parameters -------------------------------------------------------

def _copy_kind(value: np.ndarray, p: np.ndarray) -> str | None:
    """How `value` was folded from parameter `p` (an exact copy), or None."""
    if value.shape == p.shape and np.array_equal(value, p):
        return "same"
    if value.size == p.size and np.array_equal(value.ravel(), p.ravel()):
        return "reshape"
    if p.ndim == 2 and value.shape == p.T.shape and np.array_equal(value, p.T):
        return "transpose"
    row = int(np.prod(p.shape[1:]))
    if p.ndim and value.size < p.size and value.size % row == 0:  # p[:k], perhaps with added unit axes
        k = value.size // row
        if np.array_equal(value.reshape(k, *p.shape[1:]), p[:k]):
            return "rows"
    if value.size > p.size:
        try:
            if np.array_equal(value, np.broadcast_to(p, value.shape)):
                return "broadcast"
        except ValueError:
            pass
    return None


def _grad_back(kind: str, g: np.ndarray, p: np.ndarray) -> np.ndarray:
    """The gradient of the parameter from the gradient of its folded copy."""
    if kind in ("same", "reshape"):
        return g.reshape(p.shape)
    if kind == "transpose":
        return g.T
    if kind == "rows":
        out = np.zeros_like(p)
        out[:g.size // out[0].size] = g.reshape(-1, *p.shape[1:])
        return out
    lead = g.ndim - p.ndim  # broadcast: sum over the added and the stretched axes
    g = g.sum(axis=tuple(range(lead)))
    return g.sum(axis=tuple(i for i, d in enumerate(p.shape) if d == 1), keepdims=True)


@dataclass
class Source:
    """One initializer that parameter gradients are read from: `back` maps its gradient to a contribution."""
    init: str
    kind: str
    back: Callable[[np.ndarray], np.ndarray]


def copies_of_parameters(exp: Exported, sources: dict[str, list[Source]]) -> set[str]:
    """Add a Source per float initializer that is an exact copy of one parameter (a name known to torch, any
    alias of a tied parameter, is matched by name first); return the initializers that are no copy."""
    params = dict(exp.model.named_parameters())
    values = {k: p.detach().numpy() for k, p in params.items()}
    alias = {k: next(name for name, q in params.items() if q is p)
             for k, p in exp.model.named_parameters(remove_duplicate=False)}
    rest = set()
    for t in exp.onnx.graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT:
            continue
        value = numpy_helper.to_array(t)
        if t.name in alias and _copy_kind(value, values[alias[t.name]]) == "same":
            matches = [(alias[t.name], "same")]
        else:
            matches = [(k, kind) for k, v in values.items() if (kind := _copy_kind(value, v))]
        assert len(matches) <= 1, f"{exp.name}: initializer {t.name} is a copy of several parameters: {matches}"
        for k, kind in matches:
            sources.setdefault(k, []).append(Source(t.name, kind, partial(_grad_back, kind, p=values[k])))
        if not matches:
            rest.add(t.name)
    return rest


def folded_batchnorms(exp: Exported, candidates: set[str], sources: dict[str, list[Source]]) -> None:
    """Add Sources for eval-mode BatchNorms folded into the conv before them. The folded weight is
    W' = W*s and the folded bias b' = (b - mean)*s + beta, with s = gamma/std per output channel, so
    dW = dW'*s, db = db'*s, dbeta = db', dgamma = sum(dW'*W)/std + db'*(b - mean)/std."""
    values = {t.name: numpy_helper.to_array(t) for t in exp.onnx.graph.initializer if t.name in candidates}

    def find(target: np.ndarray) -> str | None:
        found = [k for k, v in values.items() if v.shape == target.shape and np.allclose(v, target, 1e-5, 1e-7)]
        assert len(found) <= 1, f"{exp.name}: several initializers look like one folded value: {found}"
        return found[0] if found else None

    modules = dict(exp.model.named_modules())
    convs = [k for k, m in modules.items() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    bns = [k for k, m in modules.items() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for c, b in [(c, b) for c in convs for b in bns if modules[c].out_channels == modules[b].num_features]:
        conv, bn = modules[c], modules[b]
        w = conv.weight.detach().numpy()
        bias = conv.bias.detach().numpy() if conv.bias is not None else np.zeros(w.shape[0], np.float32)
        std = np.sqrt(bn.running_var.numpy() + bn.eps)
        s = bn.weight.detach().numpy() / std
        col = (-1,) + (1,) * (w.ndim - 1)
        w_init = find(w * s.reshape(col))
        b_init = find((bias - bn.running_mean.numpy()) * s + bn.bias.detach().numpy())
        if w_init is None or b_init is None:
            continue
        axes = tuple(range(1, w.ndim))
        centred = bias - bn.running_mean.numpy()
        sources.setdefault(f"{c}.weight", []).append(
            Source(w_init, "bn-fold", lambda g, s=s, col=col: g * s.reshape(col)))
        if conv.bias is not None:
            sources.setdefault(f"{c}.bias", []).append(Source(b_init, "bn-fold", lambda g, s=s: g * s))
        sources.setdefault(f"{b}.weight", []).extend([
            Source(w_init, "bn-fold", lambda g, w=w, std=std, axes=axes: (g * w).sum(axes) / std),
            Source(b_init, "bn-fold", lambda g, centred=centred, std=std: g * centred / std)])
        sources.setdefault(f"{b}.bias", []).append(Source(b_init, "bn-fold", lambda g: g))


def parameter_sources(exp: Exported) -> dict[str, list[Source]]:
    """torch parameter name -> the initializers its gradient is the sum of contributions from."""
    sources: dict[str, list[Source]] = {}
    rest = copies_of_parameters(exp, sources)
    if exp.mode == "optimized":
        folded_batchnorms(exp, rest, sources)
    return sources


# -- the test -------------------------------------------------------------------------------------------------

def rel_l2(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))


@dataclass
class Comparison:
    loss: tuple[float, float]              # ours, torch's
    errors: dict[str, float]               # parameter or input name -> relative L2 error of its gradient
    zero: dict[str, float]                 # analytically zero gradients: norm relative to all gradients
    report: dict                           # onnxgrad's build report


def compare(exp: Exported) -> Comparison:
    """Build the training graph of the export, run it and torch autograd on the same inputs, compare."""
    graph = exp.onnx.graph
    sources = parameter_sources(exp)
    params = dict(exp.model.named_parameters())
    input_names = [i.name for i in graph.input]
    float_inputs = [i.name for i in graph.input if i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    inits = [t.name for t in graph.initializer]

    if exp.mode == "plain":
        assert set(sources) == set(params) and all([s.kind for s in c] == ["same"] for c in sources.values()), \
            f"{exp.name}: the plain export renamed or changed parameters: {sources}"
        buffers = [k for k, _ in exp.model.named_buffers() if k in inits]
        result = onnxgrad.build(exp.path, frozen=buffers or None, also_grad=float_inputs or None)
        chosen = [t for t in inits if t in {c[0].init for c in sources.values()}]
        assert result.report["parameters"] == chosen, "onnxgrad chose other parameters than torch has"
    else:
        uncompared = sorted(set(params) - set(sources))
        allowed = FOLDED.get(exp.name, "(?!)")
        assert all(re.fullmatch(allowed, k) for k in uncompared), \
            f"{exp.name}: parameters folded where no folding was expected: {uncompared}"
        wanted = list(dict.fromkeys(s.init for c in sources.values() for s in c))
        # by default every copy of a parameter is trained, and none of the scalar constants the optimizer
        # stores as initializers (trained, GPT-2's mask fill value went to -inf in one SGD step)
        chosen = onnxgrad.build(exp.path).report
        scalars = {t.name for t in graph.initializer if not t.dims and t.data_type == onnx.TensorProto.FLOAT}
        assert set(wanted) - scalars <= set(chosen["parameters"]), f"{exp.name}: a parameter left untrained"
        assert not (scalars - set(wanted)) & set(chosen["parameters"]), f"{exp.name}: a constant trained"
        result = onnxgrad.build(exp.path, requires_grad=wanted + float_inputs)

    assert_typed(result.model)
    sess = runtime.session(result.model, "cpu")
    feeds = {n: a.numpy() for n, a in zip(input_names, exp.args)}
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))

    args = [a.clone().requires_grad_(a.is_floating_point()) for a in exp.args]
    exp.model.zero_grad()
    loss = exp.model(*args)
    loss.backward()

    errors, zero = {}, {}
    scale = np.sqrt(sum(float(p.grad.square().sum()) for p in params.values()))
    for k, c in sources.items():
        theirs = params[k].grad.numpy()
        ours = sum(s.back(outs[s.init + "_grad"]) for s in c)
        if re.fullmatch(ANALYTICALLY_ZERO, k):
            zero[k] = float(np.linalg.norm(ours) / scale)
        else:
            errors[k] = rel_l2(ours, theirs)
    for name, a in zip(input_names, args):
        if name in float_inputs:
            errors[name] = rel_l2(outs[name + "_grad"], a.grad.numpy())
    return Comparison((float(outs[result.report["loss"]]), loss.item()), errors, zero, result.report)


def test_gradients_match_torch(exported):
    c = compare(exported)
    where = f"{exported.name} ({exported.mode})"
    np.testing.assert_allclose(c.loss[0], c.loss[1], rtol=1e-5, err_msg=f"{where}: loss")
    assert c.errors, f"{where}: nothing compared"
    bad = {k: e for k, e in c.errors.items() if not e <= 1e-4}
    assert not bad, f"{where}: gradients differ from torch (relative L2): {bad}"
    big = {k: e for k, e in c.zero.items() if not e <= 1e-6}
    assert not big, f"{where}: gradients that are analytically zero are not about 0: {big}"


def test_mirrored_graph_gives_the_same_gradients(exported):
    from test_mirror import assert_same_outputs
    buffers = [k for k, _ in exported.model.named_buffers() if k in {t.name for t in exported.onnx.graph.initializer}]
    plain = onnxgrad.build(exported.path, frozen=buffers or None)
    mirrored = onnxgrad.build(exported.path, frozen=buffers or None, mirror="mxnet")
    assert_typed(mirrored.model)
    assert_same_outputs(plain.model, mirrored.model)


def test_training_graph_is_repeatable(exported):
    from repeat import assert_repeatable
    train = onnxgrad.build(exported.path).model
    feeds = {i.name: a.numpy() for i, a in zip(exported.onnx.graph.input, exported.args)}
    assert_repeatable(train, feeds, f"{exported.name} ({exported.mode})")
