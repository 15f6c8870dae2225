"""Optimizers appended by --optimizer: 20 steps of the step graph give torch.optim's parameters, gradient
accumulation over K micro-batches equals one step on their union, and the step-graph contract holds."""
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
from onnxgrad.optim import append_optimizer

MLP = Path(__file__).resolve().parent.parent / "models" / "mlp.onnx"
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
STEPS, BATCH = 20, 8
REL_TOL = 1e-4


class StepRunner:
    """Runs a step graph as any runner would: state from the initializers, each `.next` fed back by name."""

    def __init__(self, step: onnx.ModelProto):
        meta = {p.key: p.value for p in step.metadata_props}
        self.state = json.loads(meta["onnxgrad.state"])
        self.sess = runtime.session(step)
        self.outputs = [o.name for o in self.sess.get_outputs()]
        inits = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer}
        self.values = {name: inits[name] for name in self.state}

    def run(self, feeds: dict) -> dict:
        out = dict(zip(self.outputs, self.sess.run(None, {**feeds, **self.values})))
        self.values = {name: out[nxt] for name, nxt in self.state.items()}
        return out


def batches(count: int, n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((n, 16)).astype(np.float32), "labels": rng.integers(0, 10, n)}
            for _ in range(count)]


def torch_mlp() -> dict[str, torch.nn.Parameter]:
    """The parameters of models/mlp.onnx as torch Parameters (Gemm weights are [out, in], as nn.Linear)."""
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(MLP).graph.initializer}
    return {name: torch.nn.Parameter(torch.tensor(inits[name])) for name in PARAMS}


def torch_loss(p: dict, batch: dict) -> torch.Tensor:
    hidden = F.relu(F.linear(torch.tensor(batch["x"]), p["fc1.weight"], p["fc1.bias"]))
    return F.cross_entropy(F.linear(hidden, p["fc2.weight"], p["fc2.bias"]), torch.tensor(batch["labels"]))


def rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def train_mlp() -> onnx.ModelProto:
    return onnxgrad.build_gradient(str(MLP))


# (id, --optimizer, its options, torch.optim class, its options, clip max_norm, learning-rate decay per step)
EQUIVALENCE = [
    ("sgd", "sgd", {"lr": 0.1}, torch.optim.SGD, {"lr": 0.1}, None, None),
    ("momentum-nesterov-wd", "momentum", {"lr": 0.05, "nesterov": True, "weight_decay": 1e-2},
     torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}, None, None),
    ("sgd-momentum-clip", "sgd", {"lr": 0.05, "momentum": 0.8, "clip_grad_norm": 0.5},
     torch.optim.SGD, {"lr": 0.05, "momentum": 0.8}, 0.5, None),
    ("adam-l2", "adam", {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 1e-2},
     torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.99), "weight_decay": 1e-2}, None, None),
    ("adamw-clip-schedule", "adamw", {"lr": 1e-2, "weight_decay": 0.1, "clip_grad_norm": 0.5, "eps": 1e-6},
     torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6}, 0.5, 0.9),
]


@pytest.mark.parametrize("kind,options,torch_cls,torch_options,clip,decay", [c[1:] for c in EQUIVALENCE],
                         ids=[c[0] for c in EQUIVALENCE])
def test_twenty_steps_match_torch_optim(train_mlp, kind, options, torch_cls, torch_options, clip, decay):
    step = append_optimizer(train_mlp, kind, **options)
    runner = StepRunner(step)
    params = torch_mlp()
    opt = torch_cls(list(params.values()), **torch_options)
    norms = []
    for k, batch in enumerate(batches(STEPS, BATCH)):
        lr = options["lr"] * decay ** k if decay else None
        out = runner.run({**batch, **({"lr": np.array(lr, np.float32)} if decay else {})})
        if decay:
            opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        loss = torch_loss(params, batch)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip)))
        opt.step()
        assert rel_error(out["loss"], loss.item()) <= REL_TOL, f"loss of step {k + 1}"
    if clip:
        assert max(norms) > clip  # the clipping really clipped
    for name, p in params.items():
        assert rel_error(runner.values[name], p.detach().numpy()) <= REL_TOL, name
        for state_name, value in opt.state[p].items():
            ours = {"momentum_buffer": "momentum"}.get(state_name, state_name)
            if value is None:  # SGD without momentum
                assert not any(n.startswith(name + ".") for n in runner.values)
            elif state_name == "step":
                assert int(runner.values["step"]) == int(value) == STEPS
            else:
                assert rel_error(runner.values[f"{name}.{ours}"], value.numpy()) <= REL_TOL, f"{name}.{ours}"
    assert set(runner.values) == set(runner.state)


@pytest.mark.parametrize("kind,options", [("adam", {"clip_grad_norm": 0.3}), ("momentum", {"nesterov": True})])
def test_accumulating_micro_batches_equals_one_big_batch(train_mlp, kind, options):
    k, b = 3, 4
    options = {"lr": 0.05, **options}
    big = StepRunner(append_optimizer(train_mlp, kind, **options))
    micro = StepRunner(append_optimizer(train_mlp, kind, accumulate=k, **options))
    for n, batch in enumerate(batches(2, k * b, seed=3)):
        before = dict(micro.values)
        for i in range(k):
            part = {name: array[i * b:(i + 1) * b] for name, array in batch.items()}
            micro.run(part)
            if i < k - 1:  # no update yet: parameters and optimizer state unchanged, the gradient summed
                for name, value in before.items():
                    if not name.endswith((".grad_acc", "micro_step")):
                        np.testing.assert_array_equal(micro.values[name], value, err_msg=name)
                assert int(micro.values["micro_step"]) == i + 1
                assert np.any(micro.values["fc1.weight.grad_acc"] != 0)
        big.run(batch)
        assert int(micro.values["micro_step"]) == 0
        assert not np.any(micro.values["fc2.bias.grad_acc"])
        for name in PARAMS:
            assert rel_error(micro.values[name], big.values[name]) <= 1e-5, (n, name)
            assert rel_error(micro.values[name], before[name]) > 1e-4  # it did update
    if kind == "adam":
        assert int(micro.values["step"]) == int(big.values["step"]) == 2


def double_model(opset: int) -> onnx.ModelProto:
    """pred = tanh(x @ W1) @ W2 + b in float64, at a given opset."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4)), "W1"),
             numpy_helper.from_array(rng.standard_normal((4, 2)), "W2"),
             numpy_helper.from_array(rng.standard_normal(2), "b")]
    nodes = [h.make_node("MatMul", ["x", "W1"], ["a"]), h.make_node("Tanh", ["a"], ["t"]),
             h.make_node("MatMul", ["t", "W2"], ["tw"]), h.make_node("Add", ["tw", "b"], ["pred"])]
    g = h.make_graph(nodes, "double", [h.make_tensor_value_info("x", T.DOUBLE, ["N", 3])],
                     [h.make_tensor_value_info("pred", T.DOUBLE, ["N", 2])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [13, 18, 23])
def test_float64_step_graph_with_loss_clip_and_accumulation(opset):
    model = double_model(opset)
    step = onnxgrad.build_gradient(model, loss_fn="mse", target="pred", optimizer="adamw",
                                   optimizer_options={"lr": 0.05, "clip_grad_norm": 0.2, "accumulate": 2})
    onnx.checker.check_model(step, full_check=True)
    runner = StepRunner(step)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    p = {n: torch.nn.Parameter(torch.tensor(v)) for n, v in inits.items()}
    opt = torch.optim.AdamW(list(p.values()), lr=0.05)
    rng = np.random.default_rng(12)
    for _ in range(3):
        opt.zero_grad()
        for _ in range(2):
            x, t = rng.standard_normal((5, 3)), rng.standard_normal((5, 2))
            runner.run({"x": x, "target": t})
            pred = torch.tanh(torch.tensor(x) @ p["W1"]) @ p["W2"] + p["b"]
            (F.mse_loss(pred, torch.tensor(t)) / 2).backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 0.2)
        opt.step()
    for name in inits:
        assert runner.values[name].dtype == np.float64
        # float32 learning rate, float32 clip coefficient: float32 rounding, not float64
        assert rel_error(runner.values[name], p[name].detach().numpy()) <= 1e-6, name


def test_step_graph_contract(train_mlp):
    step = onnxgrad.build(str(MLP), also_grad=["relu1"], optimizer="adam",
                          optimizer_options={"lr": 0.01, "keep_grads": True})
    model = step.model
    states = [f"{p}.{s}" for p in PARAMS for s in ("exp_avg", "exp_avg_sq")]
    assert [i.name for i in model.graph.input] == ["x", "labels", *PARAMS, "lr", "step", *states]
    assert [o.name for o in model.graph.output] == (
        ["loss", "logits"] + [p + ".next" for p in PARAMS] + [s + ".next" for s in states] + ["step.next"]
        + [p + "_grad" for p in PARAMS] + ["relu1_grad"])
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["onnxgrad.state"]) == {
        **{p: p + ".next" for p in PARAMS}, **{s: s + ".next" for s in states}, "step": "step.next"}
    assert json.loads(meta["onnxgrad.optimizer"]) == {
        "kind": "adam", "lr": 0.01, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "clip_grad_norm": None,
        "accumulate": 1, "keep_grads": True, "parameters": PARAMS}
    assert meta["onnxgrad.loss"] == "loss" and meta["onnxgrad.execution_order"] == "PRIORITY_BASED"
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert inits["lr"].dtype == np.float32 and inits["lr"].shape == () and inits["lr"] == np.float32(0.01)
    assert inits["step"].dtype == np.int64 and inits["step"] == 0
    for s in states:
        assert inits[s].shape == inits[s.rsplit(".", 1)[0]].shape and not inits[s].any()
    types = {vi.name: vi.type for vi in list(model.graph.input) + list(model.graph.output)}
    for name, nxt in json.loads(meta["onnxgrad.state"]).items():
        assert types[name] == types[nxt], name
    assert model.ir_version == train_mlp.ir_version
    assert step.report["optimizer"] == "adam" and step.report["outputs"][-1] == "relu1_grad"
    onnx.checker.check_model(model, full_check=True)

    # without --keep-grads the parameter gradients go, the --also-grad gradient stays; lr may be fed or omitted
    plain = onnxgrad.build_gradient(str(MLP), also_grad=["relu1"], optimizer="adam")
    assert [o.name for o in plain.graph.output][-2:] == ["step.next", "relu1_grad"]
    again = onnxgrad.build_gradient(str(MLP), also_grad=["relu1"], optimizer="adam")
    assert again.SerializeToString(deterministic=True) == plain.SerializeToString(deterministic=True)
    sess = runtime.session(plain)
    batch = batches(1, 4)[0]
    stored = sess.run(["fc2.bias.next"], batch)[0]
    assert np.array_equal(stored, sess.run(["fc2.bias.next"], {**batch, "lr": np.array(1e-3, np.float32)})[0])
    assert not np.array_equal(stored, sess.run(["fc2.bias.next"], {**batch, "lr": np.array(0.5, np.float32)})[0])


@pytest.mark.parametrize("kind,options,states", [
    ("sgd", {}, []),
    ("sgd", {"momentum": 0.5}, ["momentum"]),
    ("momentum", {}, ["momentum"]),
    ("adamw", {"accumulate": 4}, ["exp_avg", "exp_avg_sq", "grad_acc"]),
    ("sgd", {"accumulate": 2}, ["grad_acc"]),
])
def test_state_inputs_per_optimizer(train_mlp, kind, options, states):
    step = append_optimizer(train_mlp, kind, **options)
    names = [i.name for i in step.graph.input]
    scalars = (["step"] if kind.startswith("adam") else []) + (["micro_step"] if "accumulate" in options else [])
    assert names == ["x", "labels", *PARAMS, "lr", *scalars, *[f"{p}.{s}" for p in PARAMS for s in states]]
    state = json.loads({p.key: p.value for p in step.metadata_props}["onnxgrad.state"])
    assert list(state) == [*PARAMS, *[f"{p}.{s}" for p in PARAMS for s in states], *scalars]


def test_lr_default_and_hyper_parameters_recorded(train_mlp):
    for kind, lr, wd in (("sgd", 1e-3, 0.0), ("momentum", 1e-3, 0.0), ("adam", 1e-3, 0.0), ("adamw", 1e-3, 1e-2)):
        meta = json.loads({p.key: p.value for p in append_optimizer(train_mlp, kind).metadata_props}
                          ["onnxgrad.optimizer"])
        assert (meta["kind"], meta["lr"], meta["weight_decay"]) == (kind, lr, wd)
    assert json.loads({p.key: p.value for p in append_optimizer(train_mlp, "momentum").metadata_props}
                      ["onnxgrad.optimizer"])["momentum"] == 0.9


@pytest.mark.parametrize("kind,options,message", [
    ("rmsprop", {}, "--optimizer rmsprop: expected one of sgd, momentum, adam, adamw"),
    ("sgd", {"betas": (0.9, 0.99)}, "--betas: not an option of --optimizer sgd"),
    ("adam", {"momentum": 0.9}, "--momentum: not an option of --optimizer adam"),
    ("adam", {"betas": (0.9,)}, "expected two values in [0, 1)"),
    ("adam", {"betas": (0.9, 1.0)}, "expected two values in [0, 1)"),
    ("sgd", {"lr": -1.0}, "--lr -1: must be >= 0"),
    ("sgd", {"lr": float("nan")}, "--lr nan"),
    ("sgd", {"nesterov": True}, "--nesterov: needs a momentum > 0"),
    ("momentum", {"momentum": 0.0}, "--momentum 0: must be > 0"),
    ("adamw", {"weight_decay": -0.1}, "--weight-decay -0.1: must be >= 0"),
    ("adamw", {"clip_grad_norm": 0.0}, "--clip-grad-norm 0: must be > 0"),
    ("adamw", {"accumulate": 0}, "--accumulate 0: expected a whole number"),
    ("adamw", {"accumulate": 1.5}, "--accumulate 1.5"),
    ("adamw", {"eps": "small"}, "a hyper-parameter has the wrong type"),
])
def test_option_errors(train_mlp, kind, options, message):
    with pytest.raises(UsageError) as e:
        append_optimizer(train_mlp, kind, **options)
    assert message in str(e.value)


def test_graph_errors(train_mlp):
    with pytest.raises(UsageError, match="already has an optimizer"):
        append_optimizer(append_optimizer(train_mlp, "sgd"), "adam")
    with pytest.raises(UsageError, match="no <param>_grad outputs"):
        append_optimizer(onnx.load(MLP), "sgd")
    with pytest.raises(UsageError, match="'x' has a gradient but no initializer"):
        onnxgrad.build_gradient(str(MLP), requires_grad=["x", "fc1.weight"], optimizer="sgd")
    with pytest.raises(UsageError, match="--lr: needs --optimizer"):
        onnxgrad.build_gradient(str(MLP), optimizer_options={"lr": 0.1})
    # a parameter named lr: the optimizer's input cannot take that name
    nodes = [h.make_node("Mul", ["x", "lr"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, [2])],
                     [h.make_tensor_value_info("loss", T.FLOAT, [])], [numpy_helper.from_array(np.ones(2, np.float32), "lr")])
    with pytest.raises(UsageError, match="cannot add the optimizer's 'lr'"):
        onnxgrad.build_gradient(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]), optimizer="sgd")


def test_cli_writes_a_step_graph(tmp_path):
    out = tmp_path / "step.onnx"
    assert main(["build-grad", str(MLP), "-o", str(out), "--optimizer", "adamw", "--lr", "0.01", "--betas",
                 "0.85,0.99", "--eps", "1e-7", "--weight-decay", "0.05", "--clip-grad-norm", "1", "--accumulate",
                 "2", "--keep-grads"]) == 0
    step = onnx.load(out)
    meta = json.loads({p.key: p.value for p in step.metadata_props}["onnxgrad.optimizer"])
    assert meta == {"kind": "adamw", "lr": 0.01, "betas": [0.85, 0.99], "eps": 1e-7, "weight_decay": 0.05,
                    "clip_grad_norm": 1.0, "accumulate": 2, "keep_grads": True, "parameters": PARAMS}
    assert [o.name for o in step.graph.output][-4:] == [p + "_grad" for p in PARAMS]
    runner = StepRunner(step)
    for batch in batches(2, 4):
        runner.run(batch)
    assert int(runner.values["step"]) == 1
    assert main(["build-grad", str(MLP), "-o", str(out), "--force", "--optimizer", "momentum", "--nesterov",
                 "--momentum", "0.5"]) == 0
    assert main(["build-grad", str(MLP), "-o", str(tmp_path / "x.onnx"), "--optimizer", "adam",
                 "--betas", "0.9"]) == UsageError.exit_code
    assert main(["build-grad", str(MLP), "-o", str(tmp_path / "x.onnx"), "--weight-decay", "0.1"]) \
        == UsageError.exit_code
    assert not (tmp_path / "x.onnx").exists()


def test_large_state_stays_apart_with_the_weights():
    # build(weights_apart=True) keeps large tensors out of the proto; the optimizer's zeros go the same way
    result = onnxgrad.build(str(MLP), optimizer="adam", weights_apart=True)
    stubs = {t.name for t in result.model.graph.initializer if t.data_location == T.EXTERNAL}
    assert {"fc1.weight.exp_avg", "fc1.weight.exp_avg_sq", "fc2.weight.exp_avg_sq"} <= stubs
    assert not numpy_helper.to_array(result.weights["fc1.weight.exp_avg"]).any()
    assert "fc1.bias.exp_avg" not in stubs  # small tensors stay inline
