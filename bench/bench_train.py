"""Training step time: onnxgrad's step graph in onnxruntime against PyTorch eager (and onnxruntime-training).

    .venv/bin/python bench/bench_train.py [--models mlp,cnn,gpt] [--threads 2] [--steps 5] [--rounds 7]
                                          [--lr 0.01] [--profile 10] [--variants] [--ort-training PYTHON]

Three models, each written here with onnx.helper and mirrored op for op in PyTorch with the same weights:
  mlp  784-1024-1024-1024-10, Relu, softmax cross-entropy, batch 128
  cnn  [3,32,32] Conv 32 3x3, Relu, MaxPool 2, Conv 64 3x3, Relu, MaxPool 2, Gemm 128, Relu, Gemm 10; batch 64
  gpt  GPT-2-style: token + position embeddings, 4 pre-LN blocks (causal 4-head attention, tanh-Gelu MLP 4x),
       final LayerNorm, LM head, cross-entropy; vocab 512, width 128, context 64, batch 8
  gpt12  the same with 12 blocks
  resnet50  torchvision's ResNet-50 layout (7x7 stem, max pool, bottlenecks [3, 4, 6, 3] of widths 64-512 x4,
       global average pool, linear 100), BatchNormalization in inference form (frozen statistics, learned scale
       and shift); [3,64,64], batch 8
  mobilenet  torchvision's MobileNetV2 layout (inverted residuals with depthwise 3x3 convs, ReLU6, widths 16-320,
       1x1 conv to 1280, global average pool, linear 100), BatchNormalization as above; [3,96,96], batch 16
One step = forward, backward and a plain SGD update (`p -= lr * grad`) on one fixed batch:
  ours   the step graph (`onnxgrad.build_gradient` plus an SGD update, parameters kept in OrtValues and bound
         with IOBinding by onnxgrad.training.StepGraphTrainer), CPU provider, the graph's session settings
  torch  eager `loss.backward()` and `torch.optim.SGD.step()` (zero_grad(set_to_none=True) first)
  ort-training  onnxruntime-training's `generate_artifacts(..., optimizer=OptimType.SGD)`, then
         `Module(...)(inputs)`, `Optimizer.step()`, `Module.lazy_reset_grad()`; it runs in its own interpreter
         (`--ort-training PYTHON`, default /tmp/ortt-venv/bin/python when it exists), because it needs
         onnx==1.17 and its own onnxruntime build.
Thread counts are equal: `torch.set_num_threads(T)`, onnxruntime `intra_op_num_threads=T` on both ORT sides.
The sides take turns: a block of `steps` timed steps each, `rounds` times, after 3 warm-up steps each; a
ratio is the median over rounds of the ratio of the two sides' block medians, so that load from elsewhere
(which changes slowly) falls on both alike. The first-step losses of all sides are printed as a check that
they run the same model.
`--profile K` runs K more steps of ours under onnxruntime's profiler and prints where the time goes by op type.
`--variants` also times ours under other session settings (execution order, optimization level).
`--conv-grad` instead times the training graph of single Conv layers (forward, input and weight gradient) with
the weight gradient as the rules write it against the swapped-Conv form, in paired rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
OPSET, IR_VERSION = 20, 9     # opset 20 for Gelu; IR 9 is the lowest that opset 20 allows
WORKER_FLAG = "--ort-training-worker"


# -- the models, as ONNX ------------------------------------------------------------------------------------

class Writer:
    """Nodes and initializers of one model; a parameter is drawn from U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes, self.inits, self.count = [], [], 0

    def param(self, name, shape, fan_in=None, value=None):
        if value is None:
            bound = 1.0 / np.sqrt(fan_in)
            value = self.rng.uniform(-bound, bound, size=shape)
        self.inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    def const(self, value, dtype=np.float32):
        self.count += 1
        name = f"const{self.count}"
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.asarray(value, dtype))))
        return name

    def node(self, op, inputs, output=None, outputs=1, **attrs):
        self.count += 1
        names = [output or f"{op.lower()}{self.count}"] if outputs == 1 else \
            [f"{op.lower()}{self.count}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op, inputs, names, name=names[0], **attrs))
        return names[0] if outputs == 1 else names

    def cross_entropy(self, logits, labels):
        """The loss, with SoftmaxCrossEntropyLoss's log_prob output too: onnxruntime-training's gradient
        builder for it reads that output (and so then does ours, instead of recomputing the softmax)."""
        self.nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [logits, labels], ["loss", "log_prob"],
                                           name="loss", reduction="mean"))

    def model(self, name, inputs, doc):
        graph = helper.make_graph(self.nodes, name, inputs, [helper.make_tensor_value_info("loss", FLOAT, [])],
                                  self.inits, doc_string=doc)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)
        onnx.checker.check_model(model, full_check=True)
        return model


def mlp_model(widths=(784, 1024, 1024, 1024, 10)):
    w = Writer(seed=11)
    h = "x"
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        h = w.node("Gemm", [h, w.param(f"fc{i}.weight", (n_out, n_in), n_in), w.param(f"fc{i}.bias", (n_out,), n_in)],
                   transB=1)
        if i < len(widths) - 2:
            h = w.node("Relu", [h])
    w.cross_entropy(h, "labels")
    return w.model("mlp", [helper.make_tensor_value_info("x", FLOAT, ["N", widths[0]]),
                           helper.make_tensor_value_info("labels", INT64, ["N"])], "MLP")


def cnn_model():
    w = Writer(seed=12)
    h = "x"
    for i, (c_in, c_out) in enumerate([(3, 32), (32, 64)]):
        h = w.node("Conv", [h, w.param(f"conv{i}.weight", (c_out, c_in, 3, 3), c_in * 9),
                            w.param(f"conv{i}.bias", (c_out,), c_in * 9)], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
        h = w.node("MaxPool", [w.node("Relu", [h])], kernel_shape=[2, 2], strides=[2, 2])
    h = w.node("Flatten", [h], axis=1)
    h = w.node("Relu", [w.node("Gemm", [h, w.param("fc0.weight", (128, 4096), 4096),
                                        w.param("fc0.bias", (128,), 4096)], transB=1)])
    h = w.node("Gemm", [h, w.param("fc1.weight", (10, 128), 128), w.param("fc1.bias", (10,), 128)], transB=1)
    w.cross_entropy(h, "labels")
    return w.model("cnn", [helper.make_tensor_value_info("x", FLOAT, ["N", 3, 32, 32]),
                           helper.make_tensor_value_info("labels", INT64, ["N"])], "small CNN")


GPT = {"vocab": 512, "d": 128, "heads": 4, "t": 64, "layers": 4}


def gpt_model(vocab=GPT["vocab"], d=GPT["d"], heads=GPT["heads"], t=GPT["t"], layers=GPT["layers"]):
    w = Writer(seed=13)
    dh = d // heads

    def dense(x, name, n_in, n_out, bias=True):
        y = w.node("MatMul", [x, w.param(f"{name}.weight", (n_in, n_out), n_in)])
        return w.node("Add", [y, w.param(f"{name}.bias", (n_out,), n_in)]) if bias else y

    def layer_norm(x, name):
        # Mean and InvStdDev outputs too: onnxruntime-training's gradient builder reads them
        y, _, _ = w.node("LayerNormalization", [x, w.param(f"{name}.weight", (d,), value=np.ones(d)),
                                                w.param(f"{name}.bias", (d,), value=np.zeros(d))], outputs=3,
                         axis=-1, epsilon=1e-5)
        return y

    mask = w.const(np.triu(np.full((t, t), -1e9, np.float32), k=1))
    scale = w.const(1.0 / np.sqrt(dh))
    heads_shape, merged_shape = w.const([0, 0, heads, dh], np.int64), w.const([0, 0, d], np.int64)
    x = w.node("Gather", [w.param("wte", (vocab, d), value=w.rng.normal(0, 0.02, (vocab, d))), "tokens"])
    x = w.node("Add", [x, w.param("wpe", (t, d), value=w.rng.normal(0, 0.01, (t, d)))])
    for i in range(layers):
        p = f"h{i}"
        q, k, v = w.node("Split", [dense(layer_norm(x, f"{p}.ln1"), f"{p}.attn.qkv", d, 3 * d)], outputs=3,
                         axis=2, num_outputs=3)
        q = w.node("Transpose", [w.node("Reshape", [q, heads_shape])], perm=[0, 2, 1, 3])
        k = w.node("Transpose", [w.node("Reshape", [k, heads_shape])], perm=[0, 2, 3, 1])
        v = w.node("Transpose", [w.node("Reshape", [v, heads_shape])], perm=[0, 2, 1, 3])
        scores = w.node("Add", [w.node("Mul", [w.node("MatMul", [q, k]), scale]), mask])
        a = w.node("MatMul", [w.node("Softmax", [scores], axis=-1), v])
        a = w.node("Reshape", [w.node("Transpose", [a], perm=[0, 2, 1, 3]), merged_shape])
        x = w.node("Add", [x, dense(a, f"{p}.attn.proj", d, d)])
        m = w.node("Gelu", [dense(layer_norm(x, f"{p}.ln2"), f"{p}.mlp.fc", d, 4 * d)], approximate="tanh")
        x = w.node("Add", [x, dense(m, f"{p}.mlp.proj", 4 * d, d)])
    logits = dense(layer_norm(x, "ln_f"), "head", d, vocab, bias=False)
    flat = w.node("Reshape", [logits, w.const([-1, vocab], np.int64)])
    labels = w.node("Reshape", ["labels", w.const([-1], np.int64)])
    w.cross_entropy(flat, labels)
    return w.model("gpt", [helper.make_tensor_value_info("tokens", INT64, ["N", t]),
                           helper.make_tensor_value_info("labels", INT64, ["N", t])], "GPT-2-style stack")


class ConvNetOnnx(Writer):
    """The conv nets' layers as ONNX nodes (see conv_net); parameters He-normal, BatchNorm statistics fixed."""

    def conv(self, x, name, c_in, c_out, k, stride=1, groups=1):
        fan_in = c_in // groups * k * k
        weight = self.param(f"{name}.weight", None, value=self.rng.normal(0, np.sqrt(2.0 / fan_in),
                                                                            (c_out, c_in // groups, k, k)))
        return self.node("Conv", [x, weight], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[(k - 1) // 2] * 4, group=groups)

    def bn(self, x, name, c, gamma=1.0):
        inputs = [self.param(f"{name}.weight", None, value=np.full(c, gamma)),
                  self.param(f"{name}.bias", None, value=np.zeros(c)),
                  self.param(f"{name}.running_mean", None, value=self.rng.uniform(-0.1, 0.1, c)),
                  self.param(f"{name}.running_var", None, value=self.rng.uniform(0.8, 1.2, c))]
        return self.node("BatchNormalization", [x, *inputs], epsilon=1e-5)

    def relu(self, x):
        return self.node("Relu", [x])

    def relu6(self, x):
        return self.node("Clip", [x, self.const(0.0), self.const(6.0)])

    def add(self, a, b):
        return self.node("Add", [a, b])

    def max_pool(self, x):
        return self.node("MaxPool", [x], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])

    def head(self, x, c_in, classes):
        h = self.node("Flatten", [self.node("GlobalAveragePool", [x])], axis=1)
        h = self.node("Gemm", [h, self.param("fc.weight", (classes, c_in), c_in),
                               self.param("fc.bias", (classes,), c_in)], transB=1)
        self.cross_entropy(h, "labels")


class ConvNetTorch:
    """The same layers in torch.nn.functional on the parameters loaded from the ONNX initializers."""

    def __init__(self, params):
        import torch
        import torch.nn.functional as F
        self.p, self.torch, self.F = params, torch, F

    def conv(self, x, name, c_in, c_out, k, stride=1, groups=1):
        return self.F.conv2d(x, self.p[f"{name}.weight"], None, stride, (k - 1) // 2, 1, groups)

    def bn(self, x, name, c, gamma=1.0):
        p = self.p
        return self.F.batch_norm(x, p[f"{name}.running_mean"].detach(), p[f"{name}.running_var"].detach(),
                                 p[f"{name}.weight"], p[f"{name}.bias"], False, 0.0, 1e-5)

    def relu(self, x):
        return self.torch.relu(x)

    def relu6(self, x):
        return self.torch.clamp(x, 0.0, 6.0)

    def add(self, a, b):
        return a + b

    def max_pool(self, x):
        return self.F.max_pool2d(x, 3, 2, 1)

    def head(self, x, c_in, classes):
        h = x.mean((2, 3), keepdim=True).flatten(1)
        return lambda labels: self.F.cross_entropy(self.F.linear(h, self.p["fc.weight"], self.p["fc.bias"]),
                                                   labels)


def resnet50(net, x, classes=100):
    """ResNet-50: bottleneck blocks (1x1, 3x3 with the stride, 1x1 x4; projection shortcut where the shape
    changes); the last BatchNorm of each block starts at scale 0.2 so that the frozen-statistics net stays finite."""
    h = net.max_pool(net.relu(net.bn(net.conv(x, "stem", 3, 64, 7, 2), "stem.bn", 64)))
    c_in = 64
    for stage, (width, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]):
        for i in range(blocks):
            p, s = f"l{stage}.{i}", stride if i == 0 else 1
            y = net.relu(net.bn(net.conv(h, f"{p}.conv1", c_in, width, 1), f"{p}.bn1", width))
            y = net.relu(net.bn(net.conv(y, f"{p}.conv2", width, width, 3, s), f"{p}.bn2", width))
            y = net.bn(net.conv(y, f"{p}.conv3", width, 4 * width, 1), f"{p}.bn3", 4 * width, gamma=0.2)
            if i == 0:
                h = net.bn(net.conv(h, f"{p}.down", c_in, 4 * width, 1, s), f"{p}.down.bn", 4 * width)
            h = net.relu(net.add(h, y))
            c_in = 4 * width
    return net.head(h, c_in, classes)


def mobilenet_v2(net, x, classes=100):
    """MobileNetV2: inverted residuals (1x1 expand x t, depthwise 3x3 with the stride, 1x1 project; residual
    where the shape is kept), ReLU6."""
    h = net.relu6(net.bn(net.conv(x, "stem", 3, 32, 3, 2), "stem.bn", 32))
    c_in = 32
    for stage, (t, c, n, stride) in enumerate([(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                                               (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]):
        for i in range(n):
            p, s, hidden = f"b{stage}.{i}", stride if i == 0 else 1, c_in * t
            y = h
            if t != 1:
                y = net.relu6(net.bn(net.conv(y, f"{p}.expand", c_in, hidden, 1), f"{p}.expand.bn", hidden))
            y = net.relu6(net.bn(net.conv(y, f"{p}.dw", hidden, hidden, 3, s, groups=hidden), f"{p}.dw.bn", hidden))
            y = net.bn(net.conv(y, f"{p}.project", hidden, c, 1), f"{p}.project.bn", c, gamma=0.5)
            h = net.add(h, y) if s == 1 and c_in == c else y
            c_in = c
    h = net.relu6(net.bn(net.conv(h, "last", c_in, 1280, 1), "last.bn", 1280))
    return net.head(h, 1280, classes)


CONV_NETS = {"resnet50": (resnet50, [3, 64, 64], 8, 13), "mobilenet": (mobilenet_v2, [3, 96, 96], 16, 14)}


def conv_net_model(name):
    build, image, _, seed = CONV_NETS[name]
    w = ConvNetOnnx(seed=seed)
    build(w, "x")
    return w.model(name, [helper.make_tensor_value_info("x", FLOAT, ["N", *image]),
                          helper.make_tensor_value_info("labels", INT64, ["N"])], name)


def batch_for(name, rng):
    if name == "mlp":
        return {"x": rng.standard_normal((128, 784)).astype(np.float32),
                "labels": rng.integers(0, 10, 128).astype(np.int64)}
    if name == "cnn":
        return {"x": rng.standard_normal((64, 3, 32, 32)).astype(np.float32),
                "labels": rng.integers(0, 10, 64).astype(np.int64)}
    if name in CONV_NETS:
        _, image, batch, _ = CONV_NETS[name]
        return {"x": rng.standard_normal((batch, *image)).astype(np.float32),
                "labels": rng.integers(0, 100, batch).astype(np.int64)}
    tokens = rng.integers(0, GPT["vocab"], (8, GPT["t"] + 1)).astype(np.int64)
    return {"tokens": tokens[:, :-1].copy(), "labels": tokens[:, 1:].copy()}


GPT_LAYERS = {"gpt": GPT["layers"], "gpt12": 12}
MODELS = {"mlp": mlp_model, "cnn": cnn_model, "gpt": gpt_model, "gpt12": lambda: gpt_model(layers=12),
          "resnet50": lambda: conv_net_model("resnet50"), "mobilenet": lambda: conv_net_model("mobilenet")}


# -- the same models in PyTorch ------------------------------------------------------------------------------

def torch_loss_fn(name, params):
    """A function of the batch that computes the loss with exactly the ONNX model's ops and parameters."""
    import torch
    import torch.nn.functional as F

    if name == "mlp":
        def loss(b):
            h = b["x"]
            for i in range(4):
                h = F.linear(h, params[f"fc{i}.weight"], params[f"fc{i}.bias"])
                h = torch.relu(h) if i < 3 else h
            return F.cross_entropy(h, b["labels"])
        return loss
    if name == "cnn":
        def loss(b):
            h = b["x"]
            for i in range(2):
                h = F.conv2d(h, params[f"conv{i}.weight"], params[f"conv{i}.bias"], padding=1)
                h = F.max_pool2d(torch.relu(h), 2)
            h = torch.relu(F.linear(h.flatten(1), params["fc0.weight"], params["fc0.bias"]))
            return F.cross_entropy(F.linear(h, params["fc1.weight"], params["fc1.bias"]), b["labels"])
        return loss
    if name in CONV_NETS:
        build = CONV_NETS[name][0]
        return lambda b: build(ConvNetTorch(params), b["x"])(b["labels"])
    d, heads, t, vocab = GPT["d"], GPT["heads"], GPT["t"], GPT["vocab"]
    mask = torch.triu(torch.full((t, t), -1e9), diagonal=1).to(params["wte"].device)
    scale = 1.0 / np.sqrt(d // heads)

    def loss(b):
        x = params["wte"][b["tokens"]] + params["wpe"]
        n = x.shape[0]
        for i in range(GPT_LAYERS[name]):
            p = f"h{i}"
            h = F.layer_norm(x, (d,), params[f"{p}.ln1.weight"], params[f"{p}.ln1.bias"], 1e-5)
            qkv = h @ params[f"{p}.attn.qkv.weight"] + params[f"{p}.attn.qkv.bias"]
            q, k, v = (z.reshape(n, t, heads, d // heads).transpose(1, 2) for z in qkv.split(d, dim=2))
            a = torch.softmax((q @ k.transpose(2, 3)) * scale + mask, dim=-1) @ v
            a = a.transpose(1, 2).reshape(n, t, d)
            x = x + (a @ params[f"{p}.attn.proj.weight"] + params[f"{p}.attn.proj.bias"])
            h = F.layer_norm(x, (d,), params[f"{p}.ln2.weight"], params[f"{p}.ln2.bias"], 1e-5)
            m = F.gelu(h @ params[f"{p}.mlp.fc.weight"] + params[f"{p}.mlp.fc.bias"], approximate="tanh")
            x = x + (m @ params[f"{p}.mlp.proj.weight"] + params[f"{p}.mlp.proj.bias"])
        x = F.layer_norm(x, (d,), params["ln_f.weight"], params["ln_f.bias"], 1e-5)
        return F.cross_entropy((x @ params["head.weight"]).reshape(-1, vocab), b["labels"].reshape(-1))
    return loss


class TorchSide:
    """The same step in PyTorch eager, its parameters and batch on `device` (the CPU, or a GPU for gpu_check)."""

    def __init__(self, name, model, batch, lr, threads=None, device="cpu", amp: str | None = None):
        """`amp` ("fp16", "bf16"): the step under torch.autocast, with a GradScaler for fp16 (as onnxgrad's
        --precision)."""
        import torch
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        self.amp = {"fp16": torch.float16, "bf16": torch.bfloat16}[amp] if amp else None
        self.scaler = torch.amp.GradScaler(device) if amp == "fp16" else None
        self.params = {t.name: torch.nn.Parameter(torch.from_numpy(numpy_helper.to_array(t).copy()).to(device))
                       for t in model.graph.initializer}
        self.loss_fn = torch_loss_fn(name, self.params)
        self.batch = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
        self.opt = torch.optim.SGD(list(self.params.values()), lr=lr)

    def step(self):
        import torch
        self.opt.zero_grad(set_to_none=True)
        if self.amp is None:
            loss = self.loss_fn(self.batch)
            loss.backward()
            self.opt.step()
            return float(loss.detach())  # waits for a GPU, as our step's loss does
        with torch.autocast(self.device, dtype=self.amp):
            loss = self.loss_fn(self.batch)
        if self.scaler is None:
            loss.backward()
            self.opt.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        return float(loss.detach())


# -- ours ------------------------------------------------------------------------------------------------------

def step_graph(model, lr, precision="fp32"):
    """The SGD step graph of `model` (onnxgrad.build_gradient with the optimizer appended)."""
    import onnxgrad
    return onnxgrad.build_gradient(model, optimizer="sgd", optimizer_options={"lr": lr}, precision=precision)


def our_trainer(step, threads, configure=None, profile_prefix=None):
    from onnxgrad.training import StepGraphTrainer as Trainer
    return Trainer(step, provider="cpu", threads=threads, configure=configure, profile_prefix=profile_prefix)


VARIANTS = {
    "graph's settings (PRIORITY_BASED, CSE off, ALL)": None,
    "ExecutionOrder.DEFAULT": lambda so: setattr(so, "execution_order", _ort().ExecutionOrder.DEFAULT),
    "ORT_ENABLE_BASIC": lambda so: setattr(so, "graph_optimization_level",
                                           _ort().GraphOptimizationLevel.ORT_ENABLE_BASIC),
    "ORT_ENABLE_EXTENDED": lambda so: setattr(so, "graph_optimization_level",
                                              _ort().GraphOptimizationLevel.ORT_ENABLE_EXTENDED),
    "intra-op spinning off": lambda so: so.add_session_config_entry("session.intra_op.allow_spinning", "0"),
}


def _ort():
    import onnxruntime
    return onnxruntime


def timed(step, n, cpu=None):
    """Wall seconds of each of n steps; the process CPU seconds they took are added to `cpu` (a list)."""
    times = []
    cpu_started = time.process_time()
    for _ in range(n):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if cpu is not None:
        cpu.append((time.process_time() - cpu_started) / n)
    return times


def profile(step, batch, threads, k, top=12):
    """Where our step's time goes: kernel ms per step by op type over k profiled steps (after 3 warm-up
    steps), from onnxruntime's profiler, and the mean `model_run` time of those steps."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = our_trainer(step, threads, profile_prefix=os.path.join(tmp, "ours"))
        for _ in range(3 + k):
            trainer.step(batch)
        events = json.loads(Path(trainer.executor.session.end_profiling()).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-k:]
    start = runs[0]["ts"]
    by_op, node_op = {}, {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e["ts"] >= start:
            op = e["args"].get("op_name", "?")
            by_op[op] = by_op.get(op, 0) + e["dur"]
            node_op[e["name"]] = op
    total = sum(by_op.values())
    counts = {}
    for op in node_op.values():
        counts[op] = counts.get(op, 0) + 1
    rows = sorted(by_op.items(), key=lambda kv: -kv[1])[:top]
    run_ms = sum(e["dur"] for e in runs) / 1e3 / k
    return run_ms, [(op, counts[op], us / 1e3 / k, 100 * us / total) for op, us in rows]


# -- onnxruntime-training, in its own interpreter --------------------------------------------------------------

def ort_training_worker(folder, threads, lr):
    """Runs inside the onnxruntime-training venv (imports nothing from onnxgrad): sets up, says so with one
    JSON line, then for each line `N` on stdin runs N steps and answers with their times."""
    import onnxruntime as ort
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    folder = Path(folder)
    model = onnx.load(str(folder / "forward.onnx"))
    params = [t.name for t in model.graph.initializer]
    with np.load(folder / "batch.npz") as npz:
        batch = {k: npz[k] for k in npz.files}
    art = folder / "artifacts"
    art.mkdir()
    artifacts.generate_artifacts(model, requires_grad=params, loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(art))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"), "cpu", so)
    optimizer = Optimizer(str(art / "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(lr)
    module.train()
    inputs = [batch[i] for i in module.input_names()]

    def step():
        loss = module(*inputs)
        optimizer.step()
        module.lazy_reset_grad()
        return float(loss)

    first = step()
    for _ in range(2):
        step()
    print(json.dumps({"version": ort.__version__, "first_loss": first}), flush=True)
    for line in sys.stdin:
        cpu = []
        times = timed(step, int(line), cpu)
        print(json.dumps({"times": times, "cpu": cpu[0]}), flush=True)


class OrtTrainingSide:
    """onnxruntime-training in a worker process of its own interpreter, stepped block by block."""

    def __init__(self, python, model, batch, threads, lr):
        self.tmp = tempfile.TemporaryDirectory()
        onnx.save(model, os.path.join(self.tmp.name, "forward.onnx"))
        np.savez(os.path.join(self.tmp.name, "batch.npz"), **batch)
        self.proc = subprocess.Popen([python, __file__, WORKER_FLAG, self.tmp.name, str(threads), str(lr)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONPATH": ""})
        self.ready = self._answer()

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            lines = [ln for ln in self.proc.stderr.read().splitlines() if ln.strip()]
            raise RuntimeError(lines[-1] if lines else f"exit {self.proc.wait()}")
        return json.loads(line)

    def block(self, n, cpu):
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        r = self._answer()
        cpu.append(r["cpu"])
        return r["times"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()
        self.tmp.cleanup()


# -- the table -------------------------------------------------------------------------------------------------

def ms(times):
    return 1e3 * float(np.median(times))


def _stepper(trainer, batch):
    return lambda n, cpu: timed(lambda: trainer.step(batch), n, cpu)


def measure(sides, steps, rounds):
    """Each side runs a block of `steps` steps in turn, `rounds` times. Per side: all step times and the
    CPU seconds per step of each block; per pair of sides, the median over rounds of the ratio of block
    medians (load from elsewhere changes slowly, so it falls on both blocks of a round alike)."""
    times = {k: [] for k in sides}
    blocks = {k: [] for k in sides}
    cpu = {k: [] for k in sides}
    for _ in range(rounds):
        for k, block in sides.items():
            t = block(steps, cpu[k])
            times[k] += t
            blocks[k].append(np.median(t))
    return times, blocks, cpu


CONV_LAYERS = {  # name: x shape, Conv weight shape, stride, group
    "3x3, 3 -> 32 channels": ((64, 3, 32, 32), (32, 3, 3, 3), 1, 1),
    "3x3, 32 -> 64": ((64, 32, 16, 16), (64, 32, 3, 3), 1, 1),
    "3x3, 64 -> 64": ((8, 64, 16, 16), (64, 64, 3, 3), 1, 1),
    "3x3/2, 128 -> 128": ((8, 128, 16, 16), (128, 128, 3, 3), 2, 1),
    "3x3, 256 -> 256": ((8, 256, 8, 8), (256, 256, 3, 3), 1, 1),
    "1x1, 256 -> 64": ((8, 256, 16, 16), (64, 256, 1, 1), 1, 1),
    "7x7/2 stem, 3 -> 64": ((8, 3, 64, 64), (64, 3, 7, 7), 2, 1),
    "depthwise 3x3, 96": ((16, 96, 32, 32), (96, 1, 3, 3), 1, 96),
    "depthwise 3x3/2, 144": ((16, 144, 32, 32), (144, 1, 3, 3), 2, 144),
}


def conv_layer_model(x_shape, w_shape, stride, group):
    w = Writer(seed=21)
    k = w_shape[2]
    y = w.node("Conv", ["x", w.param("w", w_shape, int(np.prod(w_shape[1:])))], kernel_shape=[k, k],
               strides=[stride, stride], pads=[(k - 1) // 2] * 4, group=group)
    # loss = sum(y * y): dy = 2y is computed at run time (a constant dy would let onnxruntime fold the weight
    # gradient's operands into initializers, which no real step has)
    w.nodes.append(helper.make_node("ReduceSum", [w.node("Mul", [y, y])], ["loss"], keepdims=0, name="sum"))
    graph = helper.make_graph(w.nodes, "conv", [helper.make_tensor_value_info("x", FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("loss", FLOAT, [])], w.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION)


def conv_grad_table(threads, steps, rounds):
    """ms per run of a single Conv's training graph (x and w differentiated): the rules as they are, against
    the weight gradient as the swapped Conv (the form below 16 channels per group)."""
    import onnxgrad
    from onnxgrad import runtime
    from onnxgrad.rules import conv as conv_rules

    def swapped(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations, begin, end, shift):
        return conv_rules._weight_grad_as_conv(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations,
                                               begin, end)
    print("| layer (x shape) | rules' form ms | swapped Conv ms | rules / swapped | form the rules chose |")
    print("|---|---:|---:|---:|---|")
    for name, (x_shape, w_shape, stride, group) in CONV_LAYERS.items():
        model = conv_layer_model(x_shape, w_shape, stride, group)
        graphs = {"rules": onnxgrad.build(model, requires_grad=["x", "w"]).model}
        original = conv_rules._conv_weight_grad
        conv_rules._conv_weight_grad = swapped
        try:
            graphs["swapped"] = onnxgrad.build(model, requires_grad=["x", "w"]).model
        finally:
            conv_rules._conv_weight_grad = original
        c_per_group = w_shape[1]
        chose = ("GEMM per offset" if c_per_group >= conv_rules.GEMM_WEIGHT_GRAD_MIN_CHANNELS else
                 "product summed" if c_per_group == 1 and stride == 1 else "swapped Conv (same graph)")
        feeds = {"x": np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)}
        sessions = {k: runtime.session(g, "cpu", threads) for k, g in graphs.items()}
        for sess in sessions.values():
            sess.run(None, feeds)
        sides = {k: (lambda sess: lambda n, cpu: timed(lambda: sess.run(None, feeds), n, cpu))(sess)
                 for k, sess in sessions.items()}
        times, blocks, _ = measure(sides, steps, rounds)
        ratio = float(np.median(np.array(blocks["rules"]) / np.array(blocks["swapped"])))
        print(f"| {name} ({'x'.join(map(str, x_shape))}) | {ms(times['rules']):.2f} | {ms(times['swapped']):.2f} | "
              f"{ratio:.2f}x | {chose} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,cnn,gpt")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--rounds", type=int, default=7, help="blocks per side, sides taking turns")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--profile", type=int, default=10, metavar="K", help="profiled steps of ours (0: none)")
    ap.add_argument("--variants", action="store_true", help="also time ours under other session settings")
    default_ortt = "/tmp/ortt-venv/bin/python"
    ap.add_argument("--ort-training", default=default_ortt if os.path.exists(default_ortt) else "",
                    metavar="PYTHON", help="interpreter with onnxruntime-training 1.19.2 ('' to skip)")
    ap.add_argument("--conv-grad", action="store_true", help="time single Conv layers' training graphs: the "
                    "rules' weight gradient against the swapped-Conv form")
    args = ap.parse_args(argv)
    if args.conv_grad:
        return conv_grad_table(args.threads, args.steps, args.rounds)

    import onnxruntime
    import torch
    print(f"# {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, onnxruntime "
          f"{onnxruntime.__version__}, torch {torch.__version__}, threads {args.threads}, "
          f"{args.rounds} rounds x {args.steps} timed steps per side, lr {args.lr}, load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    rows, profiles, variants, notes = [], {}, {}, {}
    for name in args.models.split(","):
        model = MODELS[name]()
        batch = batch_for(name, np.random.default_rng(0))
        step = step_graph(model, args.lr)
        ours = our_trainer(step, args.threads)
        theirs = TorchSide(name, model, batch, args.lr, args.threads)
        first = {"ours": ours.step(batch), "torch": theirs.step()}
        for _ in range(2):
            ours.step(batch), theirs.step()
        sides = {"ours": _stepper(ours, batch),
                 "torch": lambda n, cpu: timed(theirs.step, n, cpu)}
        ortt = None
        if args.ort_training:
            try:
                ortt = OrtTrainingSide(args.ort_training, model, batch, args.threads, args.lr)
                first["ort-training"] = ortt.ready["first_loss"]
                notes[name] = f"onnxruntime-training {ortt.ready['version']}"
                sides["ortt"] = ortt.block
            except RuntimeError as e:
                notes[name] = f"onnxruntime-training failed: {e}"
        times, blocks, cpu = measure(sides, args.steps, args.rounds)
        if ortt is not None:
            ortt.close()
        row = {"model": name, "first_loss": first}
        for k in sides:
            row[k], row[k + "_min"], row[k + "_cpu"] = ms(times[k]), 1e3 * min(times[k]), ms(cpu[k])
            row["ours/" + k] = float(np.median(np.array(blocks["ours"]) / np.array(blocks[k])))
        rows.append(row)
        if args.profile:
            profiles[name] = profile(step, batch, args.threads, args.profile)
        if args.variants:
            trainers = {label: our_trainer(step, args.threads, configure=configure)
                        for label, configure in VARIANTS.items()}
            for tr in trainers.values():
                timed(lambda: tr.step(batch), 3)
            v_sides = {label: _stepper(tr, batch) for label, tr in trainers.items()}
            v_times, v_blocks, v_cpu = measure(v_sides, args.steps, args.rounds)
            base = next(iter(trainers))
            variants[name] = {label: (ms(v_times[label]), ms(v_cpu[label]),
                                      float(np.median(np.array(v_blocks[label]) / np.array(v_blocks[base]))))
                              for label in trainers}

    print("\nms per step: median (min) over all timed steps; ratio: median over rounds of the ratio of the two "
          "sides' block medians; CPU: process CPU ms per step.")
    print("\n| model | ours | torch eager | ours / torch | ort-training | ours / ort-training | "
          "CPU ms: ours, torch, ort-training | first-step loss: ours, torch, ort-training |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        ortt_cells = (f"{r['ortt']:.2f} ({r['ortt_min']:.2f}) | {r['ours/ortt']:.2f}x" if "ortt" in r else
                      "n/a | n/a")
        cpu = ", ".join(f"{r[k]:.1f}" for k in ("ours_cpu", "torch_cpu", "ortt_cpu") if k in r)
        losses = ", ".join(f"{v:.6f}" for v in r["first_loss"].values())
        print(f"| {r['model']} | {r['ours']:.2f} ({r['ours_min']:.2f}) | {r['torch']:.2f} ({r['torch_min']:.2f}) | "
              f"{r['ours/torch']:.2f}x | {ortt_cells} | {cpu} | {losses} |")
    for name, note in notes.items():
        print(f"- {name}: {note}")
    for name, (run_ms, top) in profiles.items():
        print(f"\n{name}: onnxruntime profile of our step, {run_ms:.2f} ms per run (model_run), kernel time by op type")
        print("| op | nodes | ms/step | share |")
        print("|---|---:|---:|---:|")
        for op, count, op_ms, share in top:
            print(f"| {op} | {count} | {op_ms:.2f} | {share:.1f}% |")
    for name, table in variants.items():
        print(f"\n{name}: our step under other session settings")
        print("| settings | wall ms/step | CPU ms/step | time / first row's |")
        print("|---|---:|---:|---:|")
        for label, (wall, cpu, ratio) in table.items():
            print(f"| {label} | {wall:.2f} | {cpu:.2f} | {ratio:.2f}x |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == WORKER_FLAG:
        folder, threads, lr = sys.argv[2:5]
        ort_training_worker(folder, int(threads), float(lr))
    else:
        main()
