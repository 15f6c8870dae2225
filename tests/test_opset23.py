"""The newest exporters' graphs: opset 23+ fused ops in whole models against torch autograd, the Attention forms
onnxruntime does not run as the spec says (checked against the onnx reference evaluator), Pow at a zero base,
newer opsets, and a channel-shuffle net exported with a dynamic batch.

Exports use `optimize=False` so that the ONNX initializers keep torch's parameter names and values (see
test_torch_export.py).
"""
from __future__ import annotations

import importlib
import pkgutil
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto as T
from onnx import helper as h
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad import gradcheck, loader, runtime
import cases
from gradcheck import _build, _model, float_outputs

# the forms each family's case table checks against the onnx reference evaluator instead of onnxruntime
REFERENCE_CASES = [c for m in pkgutil.iter_modules(cases.__path__)
                   for c in getattr(importlib.import_module(f"cases.{m.name}"), "REFERENCE_CASES", [])]

torch.set_num_threads(2)


def _relative(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))


def _export(model, args, path, opset, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), opset_version=opset, **kw)


def _grads_vs_torch(model, args, path, input_names, **build_kw):
    """Build the training graph, run it in onnxruntime, and return ({param: relative L2 error}, result).
    Buffers (the rotary caches) are passed as `frozen`, as test_torch_export.py does with BatchNorm's."""
    result = onnxgrad.build(str(path), **build_kw)
    params = dict(model.named_parameters())
    assert result.report["parameters"] == list(params)
    sess = runtime.session(result.model, "cpu")
    feeds = {n: a.numpy() for n, a in zip(input_names, args)}
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    model.zero_grad()
    loss = model(*args)
    loss.backward()
    np.testing.assert_allclose(outs[result.report["loss"]], loss.item(), rtol=1e-5)
    return {k: _relative(outs[k + "_grad"], p.grad.numpy()) for k, p in params.items()}, result


# -- a small decoder: RMSNorm, rotary embeddings, grouped-query causal attention, a learned attention bias ---
class Decoder(nn.Module):
    """Two pre-norm blocks: RMSNorm -> q/k/v (4 query heads sharing 2 key/value heads) -> RotaryEmbedding on q
    and k -> causal SDPA with a learned float bias as attn_mask (as T5's relative position bias) -> o, and an
    RMSNorm'd SiLU MLP; mean of squares of a final RMSNorm as the loss."""

    def __init__(self, d=16, hq=4, hkv=2, seq=5, blocks=2):
        super().__init__()
        self.hq, self.hkv, self.hd = hq, hkv, d // hq
        self.norms = nn.ModuleList(nn.RMSNorm(d, eps=1e-6) for _ in range(2 * blocks + 1))
        self.q = nn.ModuleList(nn.Linear(d, hq * self.hd, bias=False) for _ in range(blocks))
        self.k = nn.ModuleList(nn.Linear(d, hkv * self.hd, bias=False) for _ in range(blocks))
        self.v = nn.ModuleList(nn.Linear(d, hkv * self.hd, bias=False) for _ in range(blocks))
        self.o = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(blocks))
        self.up = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(blocks))
        self.bias = nn.Parameter(0.1 * torch.randn(hq, seq, seq))
        freq = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        angles = torch.outer(torch.arange(16).float(), freq)              # 16 positions
        self.register_buffer("cos", angles.cos(), persistent=True)
        self.register_buffer("sin", angles.sin(), persistent=True)

    def rotate(self, x, positions, heads):
        """RotaryEmbedding when exporting; the same rotation in torch ops (which autograd differentiates) else."""
        if torch.onnx.is_in_onnx_export():
            return torch.onnx.ops.rotary_embedding(x, self.cos, self.sin, positions, num_heads=heads)
        b, t, _ = x.shape
        x = x.view(b, t, heads, self.hd)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1).view(b, t, -1)

    def forward(self, x, positions):
        b, t, _ = x.shape
        for i in range(len(self.q)):
            hid = self.norms[2 * i](x)
            q = self.rotate(self.q[i](hid), positions, self.hq)
            k = self.rotate(self.k[i](hid), positions, self.hkv)
            q = q.view(b, t, self.hq, self.hd).transpose(1, 2)
            k = k.view(b, t, self.hkv, self.hd).transpose(1, 2)
            v = self.v[i](hid).view(b, t, self.hkv, self.hd).transpose(1, 2)
            causal = torch.full((t, t), float("-inf")).triu(1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias + causal, enable_gqa=True)
            x = x + self.o[i](y.transpose(1, 2).reshape(b, t, -1))
            x = x + self.down[i](F.silu(self.up[i](self.norms[2 * i + 1](x))))
        return self.norms[-1](x).pow(2).mean()


@pytest.fixture(scope="module", params=[23, 24])
def decoder(request, tmp_path_factory):
    model, args = _decoder()
    path = tmp_path_factory.mktemp(f"decoder{request.param}") / "decoder.onnx"
    _export(model, args, path, request.param, dynamo=True, optimize=False)
    return request.param, model, args, path


def _decoder():
    torch.manual_seed(0)
    model = Decoder().eval()
    for p in model.norms.parameters():   # non-trivial RMSNorm scales (with ones the loss is ~1 by construction)
        nn.init.uniform_(p, 0.5, 1.5)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(2, 5, 16, generator=g), torch.tensor([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]))


def test_decoder_with_a_symbolic_batch(tmp_path):
    """Exported with a dynamic batch: the rules build their shapes at run time, no --dim needed."""
    model, args = _decoder()
    path = tmp_path / "decoder.onnx"
    batch = torch.export.Dim("batch")
    _export(model, args, path, 23, dynamo=True, optimize=False,
            dynamic_shapes={"x": {0: batch}, "positions": {0: batch}})
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_param
    errors, _ = _grads_vs_torch(model, args, path, ["x", "positions"], frozen=["cos", "sin"])
    assert max(errors.values()) <= 1e-4, errors


def test_the_export_writes_the_fused_ops(decoder):
    opset, _, _, path = decoder
    proto = onnx.load(str(path))
    ops = {n.op_type for n in proto.graph.node}
    assert {"Attention", "RMSNormalization", "RotaryEmbedding"} <= ops
    assert loader.model_opset(proto) == opset


def test_decoder_gradients_match_torch(decoder):
    opset, model, args, path = decoder
    errors, result = _grads_vs_torch(model, args, path, ["x", "positions"], frozen=["cos", "sin"])
    worst = max(errors.values())
    assert worst <= 1e-4, f"opset {opset}: gradients differ from torch (relative L2): {errors}"
    assert {"Attention", "RMSNormalization", "RotaryEmbedding"} <= set(result.report["rules_used"])


def test_attention_probabilities_are_recomputed_in_the_backward(decoder):
    """No [B, H, S, S] value crosses from the forward pass to the backward: every Softmax the training graph
    runs (the recomputed probabilities) depends on the incoming gradient."""
    _, _, _, path = decoder
    train = onnxgrad.build(str(path), feed_head_grads=True, frozen=["cos", "sin"]).model
    grad_dependent = {i.name for i in train.graph.input if i.name.endswith("_grad")}
    softmaxes = 0
    for node in train.graph.node:
        if any(i in grad_dependent for i in node.input):
            grad_dependent.update(node.output)
        if node.op_type == "Softmax":
            softmaxes += 1
            assert node.output[0] in grad_dependent, f"{node.name} runs before the gradient arrives"
    assert softmaxes == 2   # one per attention layer, none kept from the forward pass


# -- forms onnxruntime runs differently from the spec or not at all: checked in the reference evaluator ------
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_forms_against_the_reference_evaluator(case):
    rng = np.random.default_rng(0)
    fwd, wrt = _model(case, case.dtype)
    heads = float_outputs(fwd)
    train = _build(fwd, heads, wrt)
    f, b = ReferenceEvaluator(fwd), ReferenceEvaluator(train)
    out_names = [o.name for o in train.graph.output]
    x = {f"in{i}": case.sampler(rng, s).astype(case.dtype) for i, s in enumerate(case.inputs) if isinstance(s, tuple)}
    eps = 1e-6 if case.dtype == np.float64 else 1e-2

    def forward(feeds):
        return [np.asarray(y) for y in f.run(heads, feeds)]
    y0 = forward(x)
    assert all(np.isfinite(y).all() for y in y0)

    def vjp(c):
        seeds = {n + "_grad": np.asarray(ci, dtype=case.dtype) for n, ci in zip(heads, c)}
        res = dict(zip(out_names, b.run(None, {**x, **seeds})))
        return {n: res[n + "_grad"] for n in wrt}

    def jvp(t):
        return gradcheck.central_difference(forward, x, t, eps)
    for _ in range(2):
        t, c = gradcheck.directions(rng, {n: x[n].shape for n in wrt}, [y.shape for y in y0])
        lhs, rhs, scale = gradcheck.inner_product(t, vjp(c), jvp(t), c)
        assert abs(lhs - rhs) <= case.tol * max(scale, 1.0) + 1e-9, f"<t, J^T c> = {lhs} but <J t, c> = {rhs}"
    rows, cols = gradcheck.jacobian(vjp, jvp, {n: x[n] for n in wrt}, [y.shape for y in y0])
    np.testing.assert_allclose(rows, cols, rtol=case.tol * 10, atol=case.tol * 10)


# -- Pow at a zero base ---------------------------------------------------------------------------------------
def test_pow_gradients_are_finite_where_the_power_is():
    """db is 0 where the base is 0 (as PyTorch) or negative (as TensorFlow; PyTorch gives NaN there)."""
    a = np.array([0.0, 0.0, 0.0, 2.0, 0.5, 0.0, -2.0, -1.5], np.float32)
    b = np.array([2.0, 0.0, 1.5, 0.0, -1.0, 1.0, 3.0, 2.0], np.float32)
    m = h.make_model(h.make_graph(
        [h.make_node("Pow", ["a", "b"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "pow",
        [h.make_tensor_value_info("a", T.FLOAT, [8]), h.make_tensor_value_info("b", T.FLOAT, [8])],
        [h.make_tensor_value_info("loss", T.FLOAT, [])]), opset_imports=[h.make_opsetid("", 18)])
    train = onnxgrad.build_gradient(m, requires_grad=["a", "b"])
    outs = dict(zip([o.name for o in train.graph.output], runtime.session(train, "cpu").run(None, {"a": a, "b": b})))
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    torch.pow(ta, tb).sum().backward()
    assert np.isfinite(outs["b_grad"]).all()
    np.testing.assert_allclose(outs["b_grad"][:6], tb.grad.numpy()[:6], rtol=1e-6)
    np.testing.assert_array_equal(outs["b_grad"][6:], [0.0, 0.0])
    np.testing.assert_allclose(outs["a_grad"], ta.grad.numpy(), rtol=1e-6)


# -- newer opsets ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opset", range(24, onnx.defs.onnx_opset_version() + 1))
def test_every_opset_the_installed_onnx_defines_is_taken(opset):
    m = h.make_model(h.make_graph(
        [h.make_node("Mul", ["x", "w"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "m",
        [h.make_tensor_value_info("x", T.FLOAT, [3])], [h.make_tensor_value_info("loss", T.FLOAT, [])],
        [h.make_tensor("w", T.FLOAT, [3], [1.0, 2.0, 3.0])]), opset_imports=[h.make_opsetid("", opset)])
    train = onnxgrad.build_gradient(m)
    assert train.opset_import[0].version == opset
    x = np.array([1.0, -2.0, 0.5], np.float32)
    got = dict(zip([o.name for o in train.graph.output], ReferenceEvaluator(train).run(None, {"x": x})))
    np.testing.assert_array_equal(got["w_grad"], x)


def test_an_opset_newer_than_onnx_defines_is_refused():
    newest = onnx.defs.onnx_opset_version()
    m = h.make_model(h.make_graph([h.make_node("Mul", ["x", "x"], ["loss"])], "m",
                                  [h.make_tensor_value_info("x", T.FLOAT, [])],
                                  [h.make_tensor_value_info("loss", T.FLOAT, [])]),
                     opset_imports=[h.make_opsetid("", newest + 1)])
    with pytest.raises(onnxgrad.InvalidModelError, match=f"opset {newest + 1} is newer than the newest opset"):
        onnxgrad.build_gradient(m, requires_grad=["x"])


# -- a channel-shuffle net exported by the TorchScript exporter with a dynamic batch ---------------------------
class ShuffleNet(nn.Module):
    """Six ShuffleNetV2-style units: grouped 1x1 conv, channel shuffle (view/transpose/view from x.size()), depthwise
    3x3 conv, 1x1 conv; a Conv at the end sees the shape only the last shuffle's Reshape makes known."""

    def __init__(self, c=8, groups=2, units=6):
        super().__init__()
        self.groups = groups
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.units = nn.ModuleList(nn.ModuleDict({
            "g": nn.Conv2d(c, c, 1, groups=groups), "dw": nn.Conv2d(c, c, 3, padding=1, groups=c),
            "pw": nn.Conv2d(c, c, 1)}) for _ in range(units))
        self.head = nn.Conv2d(c, 4, 1)

    def shuffle(self, x):
        b, c, hh, ww = x.size()
        return x.view(b, self.groups, c // self.groups, hh, ww).transpose(1, 2).contiguous().view(b, -1, hh, ww)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for u in self.units:
            x = x + u["pw"](F.relu(u["dw"](self.shuffle(F.relu(u["g"](x))))))
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("dims", [{"batch": 2}, None], ids=["dim-bound", "batch-symbolic"])
def test_channel_shuffle_net_with_a_dynamic_batch(tmp_path, dims):
    torch.manual_seed(0)
    model = ShuffleNet().eval()
    x = torch.randn(2, 3, 6, 6)
    path = tmp_path / "shuffle.onnx"
    _export(model, (x,), path, 17, dynamo=False, input_names=["x"], output_names=["loss"],
            dynamic_axes={"x": {0: "batch"}})
    proto = onnx.load(str(path))
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert sum(n.op_type == "Reshape" for n in proto.graph.node) >= 12
    errors, _ = _grads_vs_torch(model, (x,), path, ["x"], dims=dims)
    assert max(errors.values()) <= 1e-4, errors


# the structural gradient-first test of test_gradient_first.py, for the cases above that it does not see
REFERENCE_INTRINSIC = {"SwiGLU": {"Mul", "Sigmoid"}}   # sigmoid(alpha * a), a function of a alone, as Swish's


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_cases_are_gradient_first(case):
    from test_gradient_first import forward_only_large_nodes
    unexpected = forward_only_large_nodes(case) - REFERENCE_INTRINSIC.get(case.op, set())
    assert not unexpected, f"{case}: backward nodes {sorted(unexpected)} read only forward values"


# -- symbolic batch and sequence: the rules build their shapes at run time ------------------------------------
@pytest.mark.parametrize("form", ["4d-gqa-mask", "3d-gqa-causal", "rms-rotary"])
def test_symbolic_dims_give_the_gradients_of_static_ones(form):
    rng = np.random.default_rng(0)
    if form == "4d-gqa-mask":
        shapes = {"q": ["B", 4, "S", 2], "k": ["B", 2, "S", 2], "v": ["B", 2, "S", 3], "m": ["B", 1, "S", "S"]}
        sizes = {"B": 2, "S": 3}
        nodes = [h.make_node("Attention", ["q", "k", "v", "m"], ["y"], is_causal=1)]
    elif form == "3d-gqa-causal":
        shapes = {"q": ["B", "S", 8], "k": ["B", "S", 4], "v": ["B", "S", 4]}
        sizes = {"B": 2, "S": 3}
        nodes = [h.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1, q_num_heads=4, kv_num_heads=2)]
    else:
        shapes = {"q": ["B", 2, "S", 4], "k": [4]}
        sizes = {"B": 2, "S": 3}
        nodes = [h.make_node("RMSNormalization", ["q", "k"], ["n"]),
                 h.make_node("RotaryEmbedding", ["n", "cos", "sin"], ["y"])]
    nodes.append(h.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0))
    inits = []
    if form == "rms-rotary":
        angles = np.arange(12, dtype=np.float32).reshape(2, 3, 2) * 0.3
        inits = [onnx.numpy_helper.from_array(f(angles), name) for f, name in ((np.cos, "cos"), (np.sin, "sin"))]

    def build(dims):
        inputs = [h.make_tensor_value_info(n, T.FLOAT, [sizes[d] if dims and isinstance(d, str) else d for d in s])
                  for n, s in shapes.items()]
        m = h.make_model(h.make_graph(nodes, "m", inputs, [h.make_tensor_value_info("loss", T.FLOAT, [])], inits),
                         opset_imports=[h.make_opsetid("", 23)])
        return onnxgrad.build_gradient(m, requires_grad=list(shapes))
    feeds = {n: rng.standard_normal([sizes.get(d, d) for d in s]).astype(np.float32) for n, s in shapes.items()}
    static, symbolic = build(True), build(False)
    got = [runtime.session(t, "cpu").run(None, feeds) for t in (static, symbolic)]
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_cases_backward_runs_on_cuda(case):
    from test_cuda_coverage import added_fallbacks
    fwd, wrt = _model(case, np.float32)
    assert not added_fallbacks(fwd, _build(fwd, float_outputs(fwd), wrt))
