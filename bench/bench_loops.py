"""Gradients through Scan and Loop: the node suite's figure, the PyTorch comparisons, peak memory against
the trip count, and the loop schemes a budget chooses.

    .venv/bin/python bench/bench_loops.py            # all four
    .venv/bin/python bench/bench_loops.py --budgets  # the budget sweep alone

1. The ONNX backend node suite's models holding a Scan or a Loop, run as gradient tests (the checks of
   tests/test_node_suite_loops.py): how many pass, and why the others are not gradient tests.
2. The three TorchScript loops of tests/test_torch_loops.py against PyTorch autograd: the largest relative L2
   error over the gradients.
3. A linear recurrence h = a * h + b * x_t (carry 128 x 1024 float32, 512 KiB) over 64 and 256 steps: the peak
   one run adds, simulated and measured (a fresh process, arena off), plain and mirrored (√T segments).
4. The same recurrence over 256 steps under `mirror --budget` from generous to tight: the scheme the budget
   chooses for the loop (unsegmented, one level, nested levels), its carries alive and extra forward passes of the
   loop, the whole run's peak simulated and measured (static bytes plus the peak a run adds), measured / budget,
   and the build's CPU seconds (the retries over schemes included).
"""
from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import onnx  # noqa: E402
import torch  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.memory.measure import measure  # noqa: E402
from onnxgrad.api import load_graph as load  # noqa: E402
from onnxgrad.memory.simulate import simulate  # noqa: E402


def node_suite() -> None:
    import test_node_suite_loops as suite
    passed, refused = [], {}
    for name, case in sorted(suite.CASES.items()):
        try:
            suite.gradient_test(case)
            passed.append(name)
        except Exception as e:  # noqa: BLE001  (the reason is the figure)
            refused[name] = str(e).splitlines()[0][:110]
    print(f"node suite, models with a Scan or a Loop: {len(suite.CASES)}; pass the gradient checks: {len(passed)}")
    for name, why in refused.items():
        print(f"  not a gradient test: {name}: {why}")


def torch_comparisons(folder: Path) -> None:
    import test_torch_loops as t
    torch.manual_seed(0)
    runs = {"GRU-like cell, 64 steps": (t.GRULoop(), (torch.randn(64, 2, 4), torch.randn(2, 8)), ["x", "h0"], {})}
    torch.manual_seed(1)
    runs["linear recurrence, 32 steps"] = (t.LinearRecurrence(), (torch.randn(32, 3, 6), torch.zeros(3, 6)),
                                           ["x", "h0"], {})
    torch.manual_seed(2)
    module = t.UntilNorm()
    runs["until a norm, --loop-bound /Loop=40"] = (module, (torch.randn(2, 4) * 0.1, torch.tensor(6.0)),
                                                   ["x", "limit"], {"loop_bounds": {"/Loop": 40}})
    for label, (module, args, names, extra) in runs.items():
        loss_error, errors = t.compare(module, args, names, folder / "m.onnx", **extra)
        worst = max(errors, key=errors.get)
        print(f"{label}: loss {loss_error:.1e}, largest gradient error {errors[worst]:.1e} ({worst})")


def peak_against_steps(folder: Path) -> None:
    import test_torch_loops as t
    print("steps | plain simulated MiB | plain measured MiB | mirrored segments | mirrored simulated MiB | "
          "mirrored measured MiB")
    for steps in (64, 256):
        torch.manual_seed(1)
        model = t.export(t.LinearRecurrence(1024), (torch.randn(steps, 128, 1024), torch.zeros(128, 1024)),
                         ["x", "h0"], folder / "linear.onnx")
        row = [str(steps)]
        for mirror in (None, "mxnet"):
            result = onnxgrad.build(model, requires_grad=["decay", "b", "c"], mirror=mirror)
            path = folder / f"train{steps}.onnx"
            onnx.save(result.model, str(path))
            if mirror:
                k = result.report["loop_segments"]["/Loop"]
                row.append(f"{steps // k} x {k}")
            simulated, measured = simulate(load(str(path))).dynamic_peak, measure(str(path))["peak_bytes"]
            row += [f"{simulated / 2**20:.1f}", f"{measured / 2**20:.1f}"]
        print(" | ".join(row))


def budget_sweep(folder: Path) -> None:
    import test_torch_loops as t
    from onnxgrad.memory.budget import BudgetError
    torch.manual_seed(1)
    model = t.export(t.LinearRecurrence(1024), (torch.randn(256, 128, 1024), torch.zeros(128, 1024)), ["x", "h0"],
                     folder / "linear.onnx")
    print("budget | scheme (segments, outermost first) | carries alive | extra loop passes | simulated peak MiB | "
          "measured peak MiB | measured / budget | build CPU s")
    for budget in ("400MiB", "200MiB", "155MiB", "150MiB", "146MiB", "143MiB", "140MiB"):
        started = time.process_time()
        try:
            result = onnxgrad.build(model, requires_grad=["decay", "b", "c"], mirror="budget",
                                    mirror_options={"budget": budget})
        except BudgetError as e:
            print(f"{budget} | none fits: floor {e.report.floor_bytes / 2**20:.1f} MiB | | | | | | "
                  f"{time.process_time() - started:.1f}")
            continue
        seconds = time.process_time() - started
        scheme = result.report["loop_schemes"]["/Loop"]
        path = folder / "budget.onnx"
        onnx.save(result.model, str(path))
        timeline = simulate(load(str(path)))
        measured = timeline.static + measure(str(path))["peak_bytes"]
        limit = result.mirror.budget.budget_bytes
        print(f"{budget} | {' x '.join(map(str, scheme['segments']))} | {scheme['carries']} | "
              f"{scheme['extra_passes']} | {timeline.peak / 2**20:.1f} | {measured / 2**20:.1f} | "
              f"{measured / limit:.3f} | {seconds:.1f}")


if __name__ == "__main__":
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        if sys.argv[1:] == ["--budgets"]:
            budget_sweep(Path(tmp))
            sys.exit(0)
        node_suite()
        torch_comparisons(Path(tmp))
        peak_against_steps(Path(tmp))
        budget_sweep(Path(tmp))
