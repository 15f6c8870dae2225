"""Models whose loop the TorchScript exporter keeps (`torch.jit.script`, then `torch.onnx.export(dynamo=False)`),
differentiated by onnxgrad through the ONNX Loop, run in onnxruntime, and checked against PyTorch autograd with
the tolerances of tests/test_real_models.py: the loss to 1e-5 relative, every gradient to 1e-4 in relative L2.

- a GRU-like cell over 64 steps (its weights read from outside the loop body);
- a Mamba/RWKV-style linear recurrence h = a * h + b * x_t with per-channel decay a = sigmoid(p);
- a loop that runs until the state's norm passes a limit (a data-dependent trip count), built with --loop-bound.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

import onnxgrad
from onnxgrad import runtime
from onnxgrad.errors import UnsupportedError

torch.set_num_threads(2)


class GRULoop(nn.Module):
    def __init__(self, i: int = 4, h: int = 8):
        super().__init__()
        self.wx = nn.Linear(i, 3 * h)
        self.wh = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, 1)

    def forward(self, x, h):
        for t in range(x.shape[0]):
            xr, xz, xn = self.wx(x[t]).chunk(3, 1)
            hr, hz, hn = self.wh(h).chunk(3, 1)
            r = torch.sigmoid(xr + hr)
            z = torch.sigmoid(xz + hz)
            n = torch.tanh(xn + r * hn)
            h = (1 - z) * n + z * h
        return (self.out(h) ** 2).mean()


class LinearRecurrence(nn.Module):
    """h_t = a * h_{t-1} + b * x_t, y_t = <c, h_t>; the loss sums y_t^2 over the steps."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.decay = nn.Parameter(torch.linspace(-1.0, 2.0, d))
        self.b = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.c = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x, h):
        a = torch.sigmoid(self.decay)
        total = torch.zeros(1)
        for t in range(x.shape[0]):
            h = a * h + self.b * x[t]
            y = (h * self.c).sum(-1)
            total = total + (y * y).sum()
        return total.sum()


class UntilNorm(nn.Module):
    """Residual tanh steps until the state's L1 norm reaches `limit`: the trip count depends on the data."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.w = nn.Linear(d, d)

    def forward(self, x, limit):
        h = x
        while bool(h.abs().sum() < limit):
            h = h + torch.tanh(self.w(h))
        return (h ** 2).sum()


def export(module: nn.Module, args, names, path) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(module), args, str(path), dynamo=False, input_names=names,
                          output_names=["loss"], do_constant_folding=False, opset_version=17)
    model = onnx.load(str(path))
    assert any(n.op_type == "Loop" for n in model.graph.node), "the exporter unrolled the loop"
    return model


def compare(module, args, names, path, **build):
    """Build, run in onnxruntime, compare with autograd; returns (loss error, {name: relative L2 error})."""
    model = export(module, args, names, path)
    result = onnxgrad.build(model, requires_grad=list(dict(module.named_parameters())) + [names[0]], **build)
    feeds = {n: a.detach().numpy() for n, a in zip(names, args)}
    out = dict(zip([o.name for o in result.model.graph.output], runtime.session(result.model).run(None, feeds)))
    leaf = args[0].detach().clone().requires_grad_()
    loss = module(leaf, *args[1:])
    loss.backward()
    theirs = {k: p.grad.numpy() for k, p in module.named_parameters()}
    theirs[names[0]] = leaf.grad.numpy()
    errors = {k: float(np.linalg.norm(out[k + "_grad"] - g) / (np.linalg.norm(g) + 1e-12)) for k, g in theirs.items()}
    return abs(float(out["loss"]) - loss.item()) / abs(loss.item()), errors


def assert_close(loss_error, errors):
    assert loss_error <= 1e-5, f"loss off by {loss_error:.2e}"
    bad = {k: e for k, e in errors.items() if not e <= 1e-4}
    assert not bad, f"gradients differ from torch (relative L2): {bad}"


def test_gru_cell_over_64_steps(tmp_path):
    torch.manual_seed(0)
    x, h = torch.randn(64, 2, 4), torch.randn(2, 8)
    assert_close(*compare(GRULoop(), (x, h), ["x", "h0"], tmp_path / "gru.onnx"))


def test_linear_recurrence(tmp_path):
    torch.manual_seed(1)
    x, h = torch.randn(32, 3, 6), torch.zeros(3, 6)
    assert_close(*compare(LinearRecurrence(), (x, h), ["x", "h0"], tmp_path / "linear.onnx"))


def test_data_dependent_trip_count_with_a_loop_bound(tmp_path):
    torch.manual_seed(2)
    module = UntilNorm()
    x, limit = torch.randn(2, 4) * 0.1, torch.tensor(6.0)
    model = export(module, (x, limit), ["x", "limit"], tmp_path / "until.onnx")
    loop = next(n for n in model.graph.node if n.op_type == "Loop")
    with pytest.raises(UnsupportedError, match=rf"Loop node '{loop.name}': the loop has no trip count.*"
                                               rf"--loop-bound {loop.name}=N"):
        onnxgrad.build(model, requires_grad=["w.weight", "w.bias", "x"])
    with torch.no_grad():  # the bound is above the iterations this input runs, so the function is unchanged
        h, steps = x.clone(), 0
        while bool(h.abs().sum() < limit):
            h, steps = h + torch.tanh(module.w(h)), steps + 1
    assert 3 <= steps < 40
    assert_close(*compare(module, (x, limit), ["x", "limit"], tmp_path / "until.onnx",
                          loop_bounds={loop.name: 40}))


def test_gru_mirrored_stores_a_carry_per_segment(tmp_path):
    """With recomputation asked for, the 64-step loop runs as 8 segments of 8: the forward stores 8 carries, each
    segment's backward recomputes its 8, and the gradients are autograd's."""
    torch.manual_seed(0)
    x, h = torch.randn(64, 2, 4), torch.randn(2, 8)
    assert_close(*compare(GRULoop(), (x, h), ["x", "h0"], tmp_path / "gru.onnx", mirror="mxnet"))
    result = onnxgrad.build(export(GRULoop(), (x, h), ["x", "h0"], tmp_path / "gru.onnx"), mirror="mxnet")
    assert result.report["loop_segments"] == {"/Loop": 8}
    forward = next(n for n in result.model.graph.node if n.name == "/Loop")
    types = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in result.model.graph.value_info}
    assert [types[o][0] for o in forward.output[1:]] == [8, 8]  # the iteration numbers and the carries


@pytest.mark.parametrize("steps", [64, 256])
def test_stored_carries_simulated_as_measured(tmp_path, steps):
    """The peak a run adds, simulated and measured in onnxruntime, plain (one carry per iteration, kept by the Loop and
    concatenated when it ends) and mirrored (√T segments: about 2√T carries alive).
    Measured here (MiB, simulated / measured): 64 steps 64.5 / 65.2 plain, 14.0 / 14.5-14.6 mirrored; 256 steps
    256.5 / 258.1 plain, 26.0 / 26.5-27.3 mirrored. The measurement includes onnxruntime's first run, whose one-time
    allocations add about 0.5 MiB: later runs of the mirrored graphs measure 13.9-14.0 and 26.0-26.1."""
    from onnxgrad.memory.measure import measure
    from onnxgrad.api import load_graph as load
    from onnxgrad.memory.simulate import simulate
    torch.manual_seed(1)
    carry = 128 * 1024 * 4
    model = export(LinearRecurrence(1024), (torch.randn(steps, 128, 1024), torch.zeros(128, 1024)), ["x", "h0"],
                   tmp_path / "linear.onnx")
    peaks = {}
    for mirror in (None, "mxnet"):
        path = tmp_path / f"train_{mirror}.onnx"
        onnx.save(onnxgrad.build(model, requires_grad=["decay", "b", "c"], mirror=mirror).model, str(path))
        simulated = simulate(load(str(path))).dynamic_peak
        measured = measure(str(path))["peak_bytes"]
        assert abs(simulated - measured) <= 0.05 * simulated, (mirror, measured, simulated)
        peaks[mirror] = simulated
    root = int(steps ** 0.5)
    assert peaks[None] >= 2 * steps * carry  # the kept carries, and their concatenated copy
    assert peaks["mxnet"] <= (4 * root + 4) * carry  # 2√T carries, each kept and concatenated


def _recurrence(folder, steps: int) -> onnx.ModelProto:
    """The linear recurrence over a 128 x 1024 float32 carry (512 KiB), as the peak tests above export it."""
    torch.manual_seed(1)
    return export(LinearRecurrence(1024), (torch.randn(steps, 128, 1024), torch.zeros(128, 1024)), ["x", "h0"],
                  folder / "linear.onnx")


def _outputs(model: onnx.ModelProto, feeds: dict) -> dict:
    return dict(zip([o.name for o in model.graph.output], runtime.session(model).run(None, feeds)))


@pytest.mark.parametrize("budget, segments", [("1.0x", [64]), ("0.5x", [8, 8]), ("46MiB", [4, 4, 4])],
                         ids=["generous-unsegmented", "middle-one-level", "tight-two-levels"])
def test_budget_chooses_how_the_loop_is_checkpointed(tmp_path, budget, segments):
    """64 steps: plain, the training graph's peak is 97.0 MiB (64 stored carries); √T segments bring it to 47.0
    MiB, two levels (4 segments of 4 of 4) to 45.1 MiB (measured 12.4 MiB over the weights and inputs, simulated
    12.6; the loop's final carries, which nothing reads, stay to the end of the run). The budget keeps the least
    recomputation that fits: the loop as it is at the plain peak, one level at half of it (the fraction is of the
    unsegmented peak), two levels at 46 MiB, which no one-level scheme reaches. The simulated peak of what is written
    fits the budget and the gradients are the plain graph's (relative L2 error 1e-6: the segments sum the
    weights' gradients in another order, which moves single float32 elements by up to 1e-4)."""
    from onnxgrad.api import load_graph as load
    from onnxgrad.memory.simulate import simulate
    model = _recurrence(tmp_path, 64)
    wrt = ["decay", "b", "c"]
    plain = onnxgrad.build(model, requires_grad=wrt)
    chosen = onnxgrad.build(model, requires_grad=wrt, mirror="budget", mirror_options={"budget": budget})
    scheme = chosen.report["loop_schemes"]["/Loop"]
    assert scheme["segments"] == segments and scheme["extra_passes"] == len(segments) - 1
    assert scheme["carries"] == (64 if len(segments) == 1 else sum(segments))
    assert chosen.report["loop_segments"] == ({} if len(segments) == 1 else {"/Loop": segments[-1]})
    path = tmp_path / "chosen.onnx"
    onnx.save(chosen.model, str(path))
    limit = chosen.mirror.budget.budget_bytes
    assert simulate(load(str(path))).peak <= limit == chosen.report["mirror"]["budget_bytes"]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 128, 1024), dtype=np.float32), "h0": np.zeros((128, 1024), np.float32)}
    theirs, ours = _outputs(plain.model, feeds), _outputs(chosen.model, feeds)
    for name in ("loss", "decay_grad", "b_grad", "c_grad"):  # float32 sums in another order: relative L2
        error = np.linalg.norm(ours[name] - theirs[name]) / np.linalg.norm(theirs[name])
        assert error <= 1e-6, (name, error)


def test_budget_no_loop_scheme_fits(tmp_path):
    """Below what the deepest scheme reaches, the error gives that floor and the schemes tried."""
    from onnxgrad.memory.budget import BudgetError
    model = _recurrence(tmp_path, 64)
    with pytest.raises(BudgetError, match=r"^--budget 40MiB: 40.0 MiB is below the least peak any schedule can reach, "
                                          r"45.1 MiB .* \(loops tried: /Loop 64 iterations unsegmented; /Loop 64 "
                                          r"iterations as 8 segments of 8; /Loop 64 iterations as 4 segments of 4 "
                                          r"segments of 4\)$") as e:
        onnxgrad.build(model, requires_grad=["decay", "b", "c"], mirror="budget", mirror_options={"budget": "40MiB"})
    assert not e.value.report.fits and e.value.report.floor_bytes < 46 * 2**20


def test_two_level_segments_simulated_as_measured(tmp_path):
    """256 steps under a 150 MiB budget: √T segments peak at 154.5 MiB, so the loop runs as 4 segments of 8 of 8
    (about 20 carries alive instead of 32, for two more forward passes of the loop). onnxruntime's run fits the
    budget too (its static bytes and the peak it adds), and the peak it adds is the simulated one within 5%: 17.4
    MiB measured, 17.6 simulated. (Before the simulator held outputs no node reads to the end of the run, as
    onnxruntime does, it said 16.6 MiB: the nested segments' final carries, which nothing reads, are the two
    carries it missed.)"""
    from onnxgrad.api import load_graph as load
    from onnxgrad.memory.measure import measure
    from onnxgrad.memory.simulate import simulate
    model = _recurrence(tmp_path, 256)
    result = onnxgrad.build(model, requires_grad=["decay", "b", "c"], mirror="budget",
                            mirror_options={"budget": "150MiB"})
    assert result.report["loop_schemes"]["/Loop"]["segments"] == [4, 8, 8]
    path = tmp_path / "two_levels.onnx"
    onnx.save(result.model, str(path))
    timeline = simulate(load(str(path)))
    assert timeline.peak <= 150 * 2**20
    measured = measure(str(path))["peak_bytes"]
    assert timeline.static + measured <= 150 * 2**20, measured
    assert abs(measured - timeline.dynamic_peak) <= 0.05 * timeline.dynamic_peak, (measured, timeline.dynamic_peak)
