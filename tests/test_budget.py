"""`mirror --budget`: the written graph's peak fits every budget from the floor up, the recomputation never grows
with the budget, gradients stay the same, the floor is an error that says itself, and onnxruntime's measured
peak keeps to the budget."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import pytest

import onnxgrad
from onnxgrad.cli import main
from onnxgrad.errors import UsageError
from onnxgrad.memory.budget import parse_budget
from onnxgrad.memory.measure import measure
from onnxgrad.api import load_graph as load
from onnxgrad.memory.simulate import simulate
from test_mirror import assert_same_outputs, mlp_tail

WORK = 150_000  # the fast solver's effort: enough for these graphs, and seconds per solve


def budgeted(model, budget, **kw):
    return onnxgrad.build(model, loss_fn="mse", mirror="budget",
                          mirror_options={"budget": budget, "work": WORK, **kw.pop("options", {})}, **kw)


@pytest.mark.parametrize("text, expected", [
    ("16GiB", 16 * 2**30), ("1500MB", 1_500_000_000), ("2e9", 2_000_000_000), ("4096", 4096), ("3 kib", 3072),
])
def test_budgets_in_bytes(text, expected):
    assert parse_budget(text).bytes == expected


def test_budgets_as_fraction_or_auto_and_bad_ones():
    assert parse_budget("0.4x").fraction == 0.4 and parse_budget("auto").auto
    for bad in ("lots", "1.5x", "-3GB", "0x"):
        with pytest.raises(UsageError, match="--budget"):
            parse_budget(bad)


@pytest.fixture(scope="module")
def tail_model():
    return mlp_tail(layers=4, width=32, batch=64)


@pytest.fixture(scope="module")
def ladder(tail_model):
    """Budgets from the least peak the solver reaches to the unmirrored peak, each with the built graph."""
    first = budgeted(tail_model, "auto").report["mirror"]
    floor, top = first["least_peak_found_bytes"], first["predicted"]["unmirrored_peak_bytes"]
    assert first["floor_bytes"] <= floor < top
    budgets = sorted({int(floor + (top - floor) * f) for f in (0.0, 0.2, 0.45, 0.7, 1.0)})
    return [(b, budgeted(tail_model, str(b))) for b in budgets]


def test_every_budget_from_the_floor_up_is_met_by_the_written_graph(ladder):
    for budget, result in ladder:
        written = simulate(load(result.model)).peak
        assert written <= budget, (budget, written)
        assert result.report["mirror"]["predicted"]["peak_bytes"] == written


def test_recomputation_never_grows_with_the_budget(ladder):
    costs = [r.report["mirror"]["extra_cost"] for _, r in ladder]
    assert all(a >= b - 1e-9 for a, b in zip(costs, costs[1:])), costs
    assert costs[-1] == 0 and costs[0] > 0


def test_gradients_are_unchanged_under_a_budget(tail_model, ladder):
    plain = onnxgrad.build(tail_model, loss_fn="mse")
    for _, result in ladder[:2]:
        assert_same_outputs(plain.model, result.model)


def test_a_budget_below_the_floor_says_the_floor(tail_model, ladder):
    with pytest.raises(UsageError, match=r"--budget 1kB: 1\.0 KiB is below the least peak any schedule can "
                                         r"reach, \d+\.\d KiB \(\d+\.\d KiB of weights and inputs") as e:
        budgeted(tail_model, "1kB")
    # the floor in its parts, where it is reached: they add up to it, and the node is named
    floor_text, parts = re.search(r"reach, ([\d.]+) KiB \((.*)\)$", str(e.value)).groups()
    figures = [float(f) for f in re.findall(r"([\d.]+) KiB", parts)]
    assert len(figures) >= 2 and abs(sum(figures) - float(floor_text)) <= 0.1 * len(figures)
    assert re.search(r"for the inputs and outputs of [A-Za-z]+ \S+$", parts), parts
    # between the floor (a bound) and what the solver reaches: both figures in the message
    floor = ladder[0][1].report["mirror"]["floor_bytes"]
    with pytest.raises(UsageError, match=r"finds no schedule under .*the least peak it reaches within 4 extra "
                                         r"forward passes is .*no schedule can go below"):
        budgeted(tail_model, str(floor))


def test_auto_is_the_least_peak_within_one_extra_forward_pass(tail_model, ladder):
    auto = budgeted(tail_model, "auto").report["mirror"]
    assert auto["extra_forward_passes"] <= 1.0 + 1e-9
    assert auto["predicted"]["peak_bytes"] < auto["predicted"]["unmirrored_peak_bytes"]


def test_the_exact_solver_is_an_oracle_for_the_fast_one():
    """A graph of under 60 nodes: the MILP's recomputation is at most the fast solver's, and within 5%."""
    small = mlp_tail(layers=2, width=16, batch=32)
    auto = budgeted(small, "auto")
    m = auto.report["mirror"]
    assert m["problem_ops"] <= 60
    budget = str((m["least_peak_found_bytes"] + m["predicted"]["unmirrored_peak_bytes"]) // 2)
    fast = budgeted(small, budget).report["mirror"]
    exact = budgeted(small, budget, options={"solver": "milp", "time_limit": 120}).report["mirror"]
    assert exact["predicted"]["peak_bytes"] <= exact["budget_bytes"]
    assert exact["extra_cost"] <= fast["extra_cost"] + 1e-6
    assert fast["extra_cost"] <= exact["extra_cost"] * 1.05 + 1e-6, (fast["extra_cost"], exact["extra_cost"])


def test_onnxruntime_keeps_to_the_budget(tmp_path):
    """Activations of 1 MiB: the measured peak of one step stays within 5% of the budget."""
    model = mlp_tail(layers=4, width=256, batch=1024)
    result = onnxgrad.build(model, loss_fn="mse", optimizer="sgd", mirror="budget",
                            mirror_options={"budget": "0.5x", "work": WORK})
    path = tmp_path / "step.onnx"
    onnx.save(result.model, path)
    m = result.report["mirror"]
    graph = load(result.model)
    static = simulate(graph).static
    measured = measure(path, level="BASIC")["peak_bytes"] + static
    assert measured <= m["budget_bytes"] * 1.05, (measured, m["budget_bytes"])


def test_command_line_budget_report_and_sweep(tmp_path, capsys):
    model, out, report, png = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "s.png"
    onnx.save(mlp_tail(layers=3, width=32, batch=64), model)
    args = ["mirror", str(model), "-o", str(out), "--loss-fn", "mse", "--budget", "0.6x", "--report", str(report),
            "--sweep", str(png)]
    assert main(args) == 0
    table = capsys.readouterr().out
    for what in ("store-all", "mxnet", "chen", "front"):
        assert f"| {what} |" in table
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = json.loads(report.read_text())["mirror"]
    assert r["predicted"]["peak_bytes"] <= r["budget_bytes"] and r["floor_bytes"] <= r["budget_bytes"]
    assert set(r["reasons"]) >= {"gemm0", "silu0"} and r["solver"]
    assert main(["mirror", str(model), "-o", str(out), "--loss-fn", "mse", "--budget", "1B"]) == 2
    assert "below the least peak any schedule can reach" in capsys.readouterr().err


def test_profiled_costs_price_the_nodes_and_the_budget_still_holds(tail_model, ladder):
    budget = ladder[1][0]
    result = budgeted(tail_model, str(budget), options={"cost": "profile"})
    m = result.report["mirror"]
    assert simulate(load(result.model)).peak <= budget and m["extra_cost"] >= 0
    with pytest.raises(UsageError, match="--cost guess: expected model, prices or profile"):
        budgeted(tail_model, str(budget), options={"cost": "guess"})


def export_image_classifier(net, batch: int, size: int, path, train: bool) -> str:
    """`net` (a transformers image classifier) with cross-entropy on its logits, through torch.onnx's
    TorchScript exporter at opset 17; `train` exports BatchNormalization in training mode."""
    import warnings

    import torch
    import torch.nn.functional as F

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return F.cross_entropy(self.net(pixel_values=x).logits, y)

    extra = dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False) if train else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))
        torch.onnx.export(Classifier().train(train), args, str(path), dynamo=False, opset_version=17, **extra)
    return str(path)


@pytest.fixture(scope="module")
def torchscript_vit(tmp_path_factory) -> str:
    """A small transformers ViT through torch.onnx's TorchScript exporter, which writes Constant nodes between
    the forward ops (MXNet's plan recomputes some of them)."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager"))
    return export_image_classifier(vit, 16, 32, tmp_path_factory.mktemp("vit") / "vit.onnx", train=False)


@pytest.mark.parametrize("budget", ["0.9x", "0.8x"])
def test_budget_on_a_torchscript_export_fits(torchscript_vit, budget):
    result = onnxgrad.build(torchscript_vit, mirror="budget", mirror_options={"budget": budget})
    report = result.report["mirror"]
    assert report["fits"] and report["predicted_peak_bytes"] <= report["budget_bytes"]
    assert simulate(load(result.model)).peak <= report["budget_bytes"]
    assert dict((p.key, p.value) for p in result.model.metadata_props)["onnxgrad.budget_bytes"] == \
        str(report["budget_bytes"])


@pytest.fixture(scope="module")
def torchscript_resnet(tmp_path_factory) -> str:
    """A small transformers ResNet (bottleneck blocks, training-mode BatchNormalization) at a batch whose
    activations are mostly over glibc's mmap threshold, through the TorchScript exporter."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    net = ResNetForImageClassification(ResNetConfig(num_labels=10, layer_type="bottleneck", depths=[2, 2, 2],
                                                    hidden_sizes=[64, 128, 256], embedding_size=32))
    return export_image_classifier(net, 32, 64, tmp_path_factory.mktemp("resnet") / "resnet.onnx", train=True)


@pytest.mark.parametrize("budget", ["0.9x", "0.7x"])
def test_onnxruntime_keeps_to_the_budget_of_a_real_export(torchscript_resnet, tmp_path, budget):
    """In a fresh process, allocating as onnxgrad's sessions do for a budgeted graph, onnxruntime (at its default
    optimization level, fusions on) stays within 5% of the budget. The simulator errs high on this export (by 6-11%
    in these runs, a cause not yet found), and must never be more than 5% low."""
    result = onnxgrad.build(torchscript_resnet, mirror="budget", mirror_options={"budget": budget})
    path = tmp_path / "mirrored.onnx"
    onnx.save(result.model, path)
    timeline = simulate(load(str(path)))
    measured = measure(path, level="ALL", threads=2)["peak_bytes"]
    budget_bytes = result.report["mirror"]["budget_bytes"]
    assert timeline.static + measured <= 1.05 * budget_bytes, (timeline.static + measured, budget_bytes)
    assert 0.95 <= timeline.dynamic_peak / measured <= 1.2, (timeline.dynamic_peak, measured)


def test_a_budget_that_fails_still_writes_its_report(tmp_path):
    model, out, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(mlp_tail(layers=3, width=32, batch=64), model)
    assert main(["mirror", str(model), "-o", str(out), "--loss-fn", "mse", "--budget", "0.1x",
                 "--report", str(report)]) == 2
    r = json.loads(report.read_text())
    assert not out.exists() and r["output"] is None and "below the least peak" in r["error"]
    m = r["mirror"]
    assert m["fits"] is False and m["status"] == "no schedule" and m["floor_bytes"] > m["budget_bytes"]


def test_a_budget_at_the_plain_peak_is_met_whatever_the_floor_says():
    """The floor counts the small Constant nodes as alive throughout; the graph frees them, so on models/mlp.onnx
    the floor is above the plain peak. A budget at the plain peak needs no recomputation and is met."""
    from pathlib import Path
    mlp = str(Path(__file__).resolve().parents[1] / "models" / "mlp.onnx")
    plain = simulate(load(onnxgrad.build(mlp, dims={"N": 32}).model)).peak
    result = onnxgrad.build(mlp, dims={"N": 32}, mirror="budget", mirror_options={"budget": str(plain)})
    assert result.report["mirror"]["fits"] and result.report["mirror"]["extra_cost"] == 0



def constant_then_chain(layers: int = 8, width: int = 64, batch: int = 256) -> onnx.ModelProto:
    """x + C, then Gemm + Tanh layers; C is a Constant node of an activation's size. The problem counts C alive
    throughout, the graph frees it after the Add, so the two peaks differ by C at the unmirrored schedule and by
    nothing at a plan that recomputes the Add in the backward."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    c = numpy_helper.from_array(rng.standard_normal((batch, width)).astype(np.float32))
    nodes = [helper.make_node("Constant", [], ["c"], value=c, name="const"),
             helper.make_node("Add", ["x", "c"], ["x1"], name="add")]
    inits, x = [], "x1"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Gemm", [x, f"w{i}"], [f"z{i}"], name=f"gemm{i}"),
                  helper.make_node("Tanh", [f"z{i}"], [f"y{i}"], name=f"tanh{i}")]
        x = f"y{i}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, width]) for n in ("x", x)]
    return helper.make_model(helper.make_graph(nodes, "constant_then_chain", io[:1], io[1:], inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_every_budget_above_the_least_is_met_when_a_constant_is_freed_early():
    """The policy raises the problem's budget by the baseline's offset between the two peaks; where a plan's
    offset is smaller, it asks again below that plan. Asking again below the raised budget instead found the same
    plan each time, and 0.75x failed here where 0.7x was met."""
    model = constant_then_chain()
    plain = simulate(load(onnxgrad.build(model, loss_fn="mse").model)).peak
    for fraction in (0.7, 0.75, 0.8, 0.85, 0.9, 0.95):
        result = budgeted(model, f"{fraction}x")
        written = simulate(load(result.model)).peak
        assert result.report["mirror"]["fits"] and written <= fraction * plain, (fraction, written, plain)



def tied_output_layer(width: int = 256, vocab: int = 4096, tokens: int = 64) -> onnx.ModelProto:
    """Embedding-like weights read through a Transpose by the output MatMul (GPT-2's tied output layer), with
    Reshapes around a Tanh: the transposed table is folded into the MatMul and the Reshapes are views."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((vocab, width)) / 16).astype(np.float32), "table"),
             numpy_helper.from_array(np.array([tokens, width], np.int64), "flat"),
             numpy_helper.from_array(np.array([1, tokens, width], np.int64), "batched"),
             numpy_helper.from_array((rng.standard_normal((width, width)) / 16).astype(np.float32), "w")]
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["x2"], name="flatten"),
             helper.make_node("MatMul", ["x2", "w"], ["z"], name="layer"),
             helper.make_node("Tanh", ["z"], ["h"], name="tanh"),
             helper.make_node("Reshape", ["h", "batched"], ["h3"], name="unflatten"),
             helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0], name="tied"),
             helper.make_node("MatMul", ["h3", "table_t"], ["logits"], name="head")]
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, tokens, width]),
          helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, tokens, vocab])]
    return helper.make_model(helper.make_graph(nodes, "tied_output_layer", io[:1], io[1:], inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def test_the_problem_counts_views_as_the_simulator_does():
    """The solvers' problem gives a view no bytes and keeps its buffer's owner alive while the view is read, as
    the simulator does: its unmirrored peak is the simulated one, less nothing but the small Constant nodes it
    counts as alive throughout. It counted each view as a buffer of its own before: a Reshape's 64 KiB at this
    graph's peak, and GPT-2's 147 MiB transposed table, which onnxruntime never makes."""
    from onnxgrad.memory.budget import BudgetProblem
    from onnxgrad.memory.cost import CostModel
    from onnxgrad.memory.simulate import sizes
    from onnxgrad.shapes import type_everything
    graph = load(onnxgrad.build(tied_output_layer(), loss_fn="mse").model)
    type_everything(graph)
    nbytes = sizes(graph, {})
    constants = sum(nbytes[id(v)] for n in graph.nodes if n.op_type == "Constant" and not n.all_inputs
                    for v in n.outputs if v.name)
    problem = BudgetProblem(graph, nbytes, CostModel(symbols={})).problem
    simulated = simulate(graph, nbytes=nbytes).peak
    assert simulated <= problem.baseline_peak <= simulated + constants, (problem.baseline_peak, simulated)



def conv_chain(layers: int = 4, channels: int = 16, side: int = 32, batch: int = 8) -> onnx.ModelProto:
    """Conv (3x3, no bias) + Relu layers: a convolution's weight gradient reads its output gradient through a
    Transpose, which is the backward output placed just before the next layer's Relu mask."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((channels, channels, 3, 3)) / 12).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"z{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"),
                  helper.make_node("Relu", [f"z{i}"], [f"y{i}"], name=f"relu{i}")]
        x = f"y{i}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, channels, side, side]) for n in ("x", x)]
    return helper.make_model(helper.make_graph(nodes, "conv_chain", io[:1], io[1:], inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def optimized_by_onnxruntime(model, tmp_path) -> onnx.ModelProto:
    """The graph onnxruntime runs: `model` saved as tmp_path/train.onnx, optimized at ORT_ENABLE_ALL with its own
    session settings (one thread)."""
    import onnxruntime as ort
    from onnxgrad.runtime import session_options
    path, optimized = tmp_path / "train.onnx", tmp_path / "optimized.onnx"
    onnx.save(model, path)
    so, extra = session_options(model, 1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(optimized)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], **extra)
    return onnx.load(optimized)


@pytest.mark.parametrize("mirror", [None, "budget"])
def test_no_tie_is_rewritten_by_onnxruntime(tmp_path, mirror):
    """Each tie (a node waiting for the gradient before it) reads nodes of the file only: onnxruntime's
    optimizers at its default level create no node on a tie's path. A node onnxruntime creates is numbered after
    every node of the file, and a tie through it holds its node back while everything after it runs early. The
    transpose optimizer pushes a Transpose through the tie's Slice (this chain had two such nodes, and a dynamo
    ResNet-50 at 0.7x measured 1.39x its budget), so a Transpose is never the gradient tied to."""
    options = {"budget": "0.85x"} if mirror else None
    result = onnxgrad.build(conv_chain(), loss_fn="mse", mirror=mirror, mirror_options=options)
    optimized = optimized_by_onnxruntime(result.model, tmp_path)
    ours = {n.name for n in result.model.graph.node}
    assert any("/after_gradient/" in o for n in result.model.graph.node for o in n.output)
    created = [n.name for n in optimized.graph.node
               if n.name not in ours and any("/after_gradient/" in o for o in n.output)]
    assert not created, created[:5]


def test_a_recomputed_pool_stays_a_node_of_the_file(tmp_path):
    """onnxruntime's NCHWc layout pass swaps a MaxPool whose channels are a multiple of 8 for three nodes of its
    own (reorder, pool, reorder back), numbered after the file's, so PRIORITY_BASED ran a recomputed pool only when
    nothing else was ready and its input stayed alive meanwhile: ResNet-50's least budget measured 24.5 MiB over
    its simulated peak. The graph's hints turn that pass off: the recomputed pool is still there, as it was."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MaxPool", ["x"], ["p0"], kernel_shape=[2, 2], strides=[2, 2], name="pool0")]
    inits, x = [], "p0"
    for i in range(8):
        inits.append(numpy_helper.from_array((rng.standard_normal((16, 16, 1, 1)) / 4).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"z{i}"], name=f"conv{i}"),
                  helper.make_node("Relu", [f"z{i}"], [f"r{i}"], name=f"relu{i}")]
        x = f"r{i}"
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16, 64, 64]),
          helper.make_tensor_value_info(x, TensorProto.FLOAT, [4, 16, 32, 32])]
    model = helper.make_model(helper.make_graph(nodes, "pool_chain", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    result = onnxgrad.build(model, loss_fn="mse", mirror="budget", mirror_options={"budget": "0.7x"})
    recomputed = {n.name: n.op_type for n in result.model.graph.node if n.name.endswith("_mirror")}
    assert "pool0_mirror" in recomputed
    optimized = {n.name: n.op_type for n in optimized_by_onnxruntime(result.model, tmp_path).graph.node}
    assert {name: optimized.get(name) for name in recomputed if name.startswith("pool")} == {"pool0_mirror": "MaxPool"}
    assert not [n for n in optimized if "nchwc" in n.lower()]



def test_the_budget_path_prunes_its_front(monkeypatch):
    """`mirror --budget` asks the fast solver to prune its front, with work that grows with the problem and is
    never less than the search's own (ResNet-50's least budget: 2.71 extra forward passes without, 0.97 with)."""
    from onnxgrad.memory import budget, solvers
    seen = []
    front = solvers.front
    monkeypatch.setattr(solvers, "front",
                        lambda problem, limits: seen.append((problem.n, limits)) or front(problem, limits))
    onnxgrad.build(mlp_tail(layers=4, width=64, batch=256), loss_fn="mse", mirror="budget",
                   mirror_options={"budget": "0.6x"})
    [(n, limits)] = seen
    assert limits.prune_work == max(limits.work, budget.PRUNE_WORK_PER_OP * n) > 0
    assert limits.prune_below is not None  # the schedules under the budget are pruned first


def test_the_sweep_draws_the_front_the_budget_chooses_from(monkeypatch):
    """`mirror --sweep` draws the same pruned front that `mirror --budget` chooses from, so a row of the sweep
    is never costlier than the plan the budget path writes at that peak; it is built once for both (it took a few
    seconds on ResNet-50 to build it twice)."""
    from onnxgrad.memory import solvers
    seen = []
    front = solvers.front
    monkeypatch.setattr(solvers, "front",
                        lambda problem, limits: seen.append(limits) or front(problem, limits))
    onnxgrad.build(mlp_tail(layers=4, width=64, batch=256), loss_fn="mse", mirror="budget",
                   mirror_options={"budget": "0.6x", "sweep": "unused.png"})
    [limits] = seen
    assert limits.prune_work > 0 and limits.prune_below is not None


def test_a_plan_over_the_budget_as_written_retries_down_to_the_least_peak(monkeypatch):
    """The problem's peak and the written graph's differ by an offset that is not the same at every plan. When
    the first plan is over the budget as written, the next request lies below it by the excess, but never below
    the least peak found: that plan may still fit (ViT-B/16's 0.77-pass plan was 9.2 MiB over 688 MiB, the request
    below it fell under the least peak, and the least plan, 689.3 MiB as written, was never tried)."""
    from onnxgrad.memory import budget
    real_peak, real_mxnet, calls, mxnet_orders = budget.peak_of_plan, budget.mxnet_plan, [], []

    def peak_of_plan(graph, order, nbytes):  # the first plan and MXNet's are far over as written
        calls.append(order)
        far = len(calls) == 1 or any(order is o for o in mxnet_orders)
        return real_peak(graph, order, nbytes) + (64 << 20 if far else 0)

    def mxnet_plan(*args):
        plan = real_mxnet(*args)
        mxnet_orders.append(plan.order)
        return plan

    monkeypatch.setattr(budget, "peak_of_plan", peak_of_plan)
    monkeypatch.setattr(budget, "mxnet_plan", mxnet_plan)
    result = onnxgrad.build(mlp_tail(layers=4, width=64, batch=256), loss_fn="mse", mirror="budget",
                            mirror_options={"budget": "0.6x"})
    report = result.report["mirror"]
    assert report["fits"] and report["predicted_peak_bytes"] <= report["budget_bytes"]
    assert report["recomputations"] > 10  # the least plan's, where the first plan recomputed 10 nodes


def test_no_schedule_reports_the_least_plan_as_written(monkeypatch):
    """When even the least plan is over the budget as written, the error and the report give its peak as
    written, not the problem's (which said 680.0 MiB for ViT-B/16's least plan, 689.3 MiB as written)."""
    from onnxgrad.memory import budget
    real_peak = budget.peak_of_plan
    monkeypatch.setattr(budget, "peak_of_plan",
                        lambda graph, order, nbytes: real_peak(graph, order, nbytes) + (1 << 20))
    with pytest.raises(budget.BudgetError) as failure:
        onnxgrad.build(mlp_tail(layers=4, width=64, batch=256), loss_fn="mse", mirror="budget",
                       mirror_options={"budget": "0.6x"})
    least = failure.value.report.least_peak_found_bytes
    assert least > 1 << 20  # the written peak, over 1 MiB; the problem's least peak is 611.4 KiB
    assert f"within 4 extra forward passes is {budget.format_bytes(least)}" in str(failure.value)



def test_a_read_through_a_view_holds_the_copy_the_view_read():
    """Op 1 is a view of op 0 (no bytes of its own); op 2 reads op 0 directly and through the view. Recomputing
    op 0 between the view and op 2 leaves two copies alive: the view holds the first run, the direct read the
    copy (a tie's Reshape and its node on ViT-B/16 did this). Read as the latest run of op 0, the problem freed the
    first run after the view and counted one copy."""
    from onnxgrad.memory import solvers
    args = ([4, 0, 1], [1.0, 0.0, 1.0], [[], [0], [0, 1]], [True, True, False], {2})
    through = [[], [(0, -1)], [(0, -1), (0, 1), (1, -1)]]
    schedule = [0, 1, 0, 2]
    assert solvers.profile(solvers.Problem(*args, through=through), schedule).peak == 4 + 4 + 1
    assert solvers.profile(solvers.Problem(*args), schedule).peak == 4 + 1
    # read only through the view, the copy serves nobody: it is held to the end, and `tidy` takes it out
    only_through = solvers.Problem(*args, through=[[], [(0, -1)], [(0, 1), (1, -1)]])
    assert solvers.profile(only_through, schedule).peak == 4 + 4 + 1
    assert solvers.unread_copies(only_through, schedule) == [2]
    assert solvers.profile(only_through, [0, 1, 2]).peak == 4 + 1


def test_a_staged_schedule_does_not_recompute_an_owner_read_only_through_a_view():
    """Op 3 reads op 0 only through its view, op 1. With op 0 dropped after the view and the view held, the
    staged schedule has nothing to recompute: the read through the view takes the copy the view read. Recomputing
    op 0 for it made a copy no read takes, held to the end (ResNet-50's training graph, whose ordering ties read
    activations through a Reshape: a segment scheme simulated at 625-800 MiB instead of 314)."""
    from onnxgrad.memory import solvers
    problem = solvers.Problem([4, 0, 4, 1], [1.0, 0.0, 1.0, 1.0], [[], [0], [], [0, 1, 2]],
                              [True, True, False, False], {3},
                              through=[[], [(0, -1)], [], [(0, 1), (1, -1), (2, -1)]])
    n = problem.n
    plan = [solvers.plan_entry(n, 1, n), solvers.plan_entry(n, n, 0), 0, 0]
    schedule = solvers.build_schedule(problem, plan)
    assert schedule == [0, 1, 2, 3] and solvers.unread_copies(problem, schedule) == []
    assert solvers.profile(problem, schedule).peak == 4 + 4 + 1


def test_an_output_nobody_reads_is_held_to_the_end(tmp_path):
    """With buffer reuse off (onnxgrad's graphs ask for it), onnxruntime holds an output no node reads until the
    run ends, and the simulator counts it so: here 32 MiB made first and never read, beside a chain of 32 MiB
    values (measured 96 MiB; 64 MiB if it were freed)."""
    from onnx import TensorProto, helper
    from onnxgrad.contract import RUNTIME_HINTS
    n = 8 << 20
    nodes = [helper.make_node("Mul", ["x", "two"], ["unread"], name="unread"),
             helper.make_node("Add", ["x", "one"], ["b"], name="b"),
             helper.make_node("Mul", ["b", "b"], ["c"], name="c"),
             helper.make_node("Add", ["c", "one"], ["d"], name="d"),
             helper.make_node("Add", ["d", "one"], ["y"], name="y")]
    graph = helper.make_graph(nodes, "unread", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])],
                              [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0]),
                               helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for key, value in RUNTIME_HINTS.items():  # buffer reuse off, as in every graph onnxgrad writes
        model.metadata_props.add(key=key, value=value)
    path = tmp_path / "unread.onnx"
    onnx.save(model, path)
    timeline = simulate(load(path))
    assert timeline.dynamic_peak == 3 * 4 * n
    measured = measure(path, level="ALL", threads=1, runs=2, allocator="exact")["peak_bytes"]
    assert abs(measured - timeline.dynamic_peak) < 0.05 * timeline.dynamic_peak, measured
    # memory patterns (off in onnxgrad's sessions) lay the run out in one block: a value more than the live bytes
    patterns = measure(path, level="ALL", threads=1, runs=2, allocator="patterns")["peak_bytes"]
    assert patterns > measured + 0.9 * 4 * n, (patterns, measured)

def tied_head(batch: int = 4, tokens: int | None = 256, width: int = 256, vocab: int = 512, layers: int = 4,
              head: str = "MatMul"):
    """GPT-2's output layer in small: `layers` of h = Tanh(h W) over [batch, tokens, width], then
    logits = h E^T through a Transpose of the table E; MSE. `tokens` None: 2-D, [batch, width]. `head` "Gemm"
    (2-D): logits = Relu(Gemm(h, E^T)), a Gemm onnxruntime fuses with the Relu and so keeps the Transpose."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((vocab, width)) / 16).astype(np.float32), "table")]
    nodes, h = [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / 16).astype(np.float32), f"w{i}"))
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"z{i}"], name=f"fc{i}"),
                  helper.make_node("Tanh", [f"z{i}"], [f"h{i}"], name=f"tanh{i}")]
        h = f"h{i}"
    nodes.append(helper.make_node("Transpose", ["table"], ["table_t"], name="table_t", perm=[1, 0]))
    if head == "Gemm":
        nodes += [helper.make_node("Gemm", [h, "table_t"], ["scores"], name="head"),
                  helper.make_node("Relu", ["scores"], ["logits"], name="relu")]
    else:
        nodes.append(helper.make_node("MatMul", [h, "table_t"], ["logits"], name="head"))
    lead = [batch] if tokens is None else [batch, tokens]
    io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, lead + [width]),
          helper.make_tensor_value_info("logits", TensorProto.FLOAT, lead + [vocab])]
    return helper.make_model(helper.make_graph(nodes, "tied_head", io[:1], io[1:], inits),
                             opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("budget,tokens,head", [(None, 256, "MatMul"), ("0.85x", 256, "MatMul"),
                                               (None, None, "MatMul"), (None, None, "Gemm")])
def test_the_simulator_knows_when_onnxruntime_keeps_a_transposed_weight(tmp_path, budget, tokens, head):
    """onnxruntime folds a Transpose into the Gemm that reads it only while the Gemm's result has one reader and
    no activation it fuses (the Relu after the 2-D Gemm head). The simulator counts the transposed table where
    onnxruntime keeps it, and no tie adds a second reader: one kept GPT-2's transposed embedding table (147 MiB)
    through the backward of its budgeted step graphs, 1.19x the budget. (The input gradient of `h E^T` reads
    E itself, so it is never such a reader.)"""
    from onnxgrad.memory.simulate import shares_buffer
    options = {"budget": budget} if budget else None
    model = tied_head(batch=1024, tokens=None, head=head) if tokens is None else tied_head()
    result = onnxgrad.build(model, loss_fn="mse", mirror="budget" if budget else None, mirror_options=options)
    if budget:
        assert result.report["mirror"]["recomputations"] > 0
    optimized = optimized_by_onnxruntime(result.model, tmp_path)
    kept = [n.name for n in optimized.graph.node if n.op_type == "Transpose" and "table" in n.input]
    graph = load(str(tmp_path / "train.onnx"))
    folded = [n.name for n in graph.nodes if n.op_type == "Transpose" and shares_buffer(n)]
    assert (kept, folded) == ((["table_t"], []) if head == "Gemm" else ([], ["table_t"]))
