"""A whole `onnxgrad build-grad` process against onnxruntime-training's `generate_artifacts`, as a user waits for
them: each side in a fresh process (interpreter start and imports included), on the same file, in turns.

    .venv/bin/python bench/bench_pipeline.py [--layers 2500,10000] [--rounds 3] [--ort-training PYTHON]

The model is a chain of layers MatMul(16x16) + Add + Sigmoid + Mul (4 forward nodes a layer, batch 8, width 16),
so 2500 layers are 10k forward nodes. Ours: `onnxgrad build-grad chain.onnx -o out.onnx --loss-fn mse
--optimizer sgd` (a step graph: loss, gradient, SGD update, checked and written). Theirs: `generate_artifacts(
model with an MSE loss, requires_grad=every weight, optimizer=OptimType.SGD)` (a training graph, an eval graph,
an optimizer graph and a checkpoint), run by a Python that has onnxruntime-training 1.19.2, which needs its own
venv (Python <= 3.11, numpy < 2):

    python3 -m venv /tmp/ortt-venv && /tmp/ortt-venv/bin/pip install onnxruntime-training==1.19.2 onnx==1.17.0 "numpy<2" torch==2.13.0

(its `artifacts` module imports torch, so the venv needs a torch too; the CPU build on local disk will do).

The sides alternate within each round, and the table gives the median wall-clock seconds over the rounds, the
ratio of the medians, and our build's own `--report` seconds with its slowest passes. Start-up is measured the
same way on a 1-layer chain (interpreter, imports and a build of 4 nodes): the table gives each side's share of
its process that start-up is, and the first line the seconds of start-up and of `onnxgrad --version`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
ONNXGRAD = Path(sys.executable).parent / "onnxgrad"
DEFAULT_ORTT = "/tmp/ortt-venv/bin/python"

ORT_TRAINING = """
import sys, onnx
from onnxruntime.training import artifacts
model = onnx.load(sys.argv[1])
params = [t.name for t in model.graph.initializer]
artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.MSELoss,
                             optimizer=artifacts.OptimType.SGD, artifact_directory=sys.argv[2])
"""


def chain(layers: int, width: int = 16, batch: int = 8, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) / 4).astype(np.float32), f"w{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"),
                  numpy_helper.from_array(np.ones(width, np.float32), f"s{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Sigmoid", [f"a{i}"], [f"g{i}"]),
                  helper.make_node("Mul", [f"g{i}", f"s{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [batch, width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def ours_cmd(model: Path, out: Path, report: Path) -> list[str]:
    return [str(ONNXGRAD), "-q", "build-grad", str(model), "-o", str(out), "--loss-fn", "mse", "--optimizer", "sgd",
            "--report", str(report)]


def timed(cmd: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="2500,10000", help="layer counts (4 forward nodes each), comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ort-training", default=DEFAULT_ORTT if os.path.exists(DEFAULT_ORTT) else "",
                    help="a Python with onnxruntime-training installed (empty: ours only)")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="onnxgrad-bench-") as tmp:
        tmp = Path(tmp)
        script = tmp / "ortt.py"
        script.write_text(ORT_TRAINING)
        tiny = tmp / "chain1.onnx"
        onnx.save(chain(1), tiny)
        start = {"ours": [], "theirs": [], "version": []}
        for r in range(args.rounds):
            start["version"].append(timed([str(ONNXGRAD), "--version"]))
            start["ours"].append(timed(ours_cmd(tiny, tmp / "tiny.onnx", tmp / "tiny.json")))
            if args.ort_training:
                art = tmp / f"tiny_artifacts{r}"
                art.mkdir()
                start["theirs"].append(timed([args.ort_training, str(script), str(tiny), str(art)]))
        startup = {k: statistics.median(v) for k, v in start.items() if v}
        for layers in [int(n) for n in args.layers.split(",")]:
            model = tmp / f"chain{layers}.onnx"
            onnx.save(chain(layers), model)
            ours, theirs, reports = [], [], []
            for r in range(args.rounds):
                out, report = tmp / "out.onnx", tmp / "report.json"
                ours.append(timed(ours_cmd(model, out, report)))
                reports.append(json.loads(report.read_text()))
                if args.ort_training:
                    art = tmp / f"artifacts{layers}_{r}"
                    art.mkdir()
                    theirs.append(timed([args.ort_training, str(script), str(model), str(art)]))
            rep = min(reports, key=lambda x: x["seconds"])
            passes = sorted(rep["passes"].items(), key=lambda kv: -kv[1])[:3]
            row = {"layers": layers, "nodes": 4 * layers, "ours": statistics.median(ours),
                   "build": statistics.median(x["seconds"] for x in reports),
                   "slowest": ", ".join(f"{k} {v:.2f}" for k, v in passes)}
            if theirs:
                row["theirs"] = statistics.median(theirs)
                row["ratio"] = row["ours"] / row["theirs"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    print(f"\n{args.rounds} rounds, medians; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}; "
          f"ml_dtypes {_version('ml_dtypes')}, onnx {onnx.__version__}\n")
    print(f"start-up (a whole process on a 1-layer chain): onnxgrad {startup['ours']:.2f} s"
          + (f", ort-training {startup['theirs']:.2f} s" if "theirs" in startup else "")
          + f"; `onnxgrad --version` {startup['version']:.2f} s\n")
    print("| forward nodes | onnxgrad process s (start-up share) | its build s (slowest passes) | ort-training process s "
          "(start-up share) | ours / theirs |")
    print("|---|---|---|---|---|")
    for r in rows:
        ours = f"{r['ours']:.2f} ({startup['ours'] / r['ours']:.0%})"
        theirs = f"{r['theirs']:.2f} ({startup['theirs'] / r['theirs']:.0%}) | {r['ratio']:.2f}x" if "theirs" in r \
            else "- | -"
        print(f"| {r['nodes']} | {ours} | {r['build']:.2f} ({r['slowest']}) | {theirs} |")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    main()
