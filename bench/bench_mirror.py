"""Backward mirroring measured in onnxruntime: the peak memory and the time of one training step, with and
without mirroring, side by side, at ORT_ENABLE_BASIC and ORT_ENABLE_ALL, next to the simulator's prediction.

    .venv/bin/python bench/bench_mirror.py [--models mlp32,resnet50,gpt12] [--rounds 3] [--threads 2]
    .venv/bin/python bench/bench_mirror.py --fusions     # also list the onnxruntime fusions that fire at ALL

Models (step graphs: the loss, the gradient and an SGD update; `onnxgrad mirror --policy mxnet`):
- mlp32: 32 layers of Gemm(256x256) + scale + shift + SiLU (x * sigmoid(x)), batch 4096, MSE loss;
- resnet50: ResNet-50 (bottlenecks 3-4-6-3, BatchNorm with fixed statistics, 100 classes), batch 8, 224x224
  (`--image` to change), cross-entropy;
- gpt12: a GPT-2-style stack of 12 layers (width 256, 4 heads, 128 tokens, tanh-Gelu MLP), batch 8.
Each measurement is a fresh process (onnxgrad.memory.measure): CPU arena and memory patterns off, the graph's
own settings (node order, CSE and the listed fusions off), one warm-up run, then the peak resident set above
the baseline of a run and the median time of the runs after it. The sides alternate, `--rounds` times.
Also: how long the mirror pass takes on a 10k-node chain (2500 layers of MatMul + Add + Sigmoid + Mul).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline  # noqa: E402
import bench_train  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.ir import from_model  # noqa: E402
from onnxgrad.memory.measure import measure  # noqa: E402
from onnxgrad.memory.simulate import simulate  # noqa: E402
from onnxgrad.shapes import type_everything  # noqa: E402


def mlp32(layers=32, width=256, seed=0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32),
                                          f"w{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}"),
                  numpy_helper.from_array(np.ones(width, np.float32), f"scale{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"shift{i}")]
        nodes += [helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [f"z{i}"], name=f"gemm{i}"),
                  helper.make_node("Mul", [f"z{i}", f"scale{i}"], [f"s{i}"], name=f"scale{i}"),
                  helper.make_node("Add", [f"s{i}", f"shift{i}"], [f"t{i}"], name=f"shift{i}"),
                  helper.make_node("Sigmoid", [f"t{i}"], [f"q{i}"], name=f"sigmoid{i}"),
                  helper.make_node("Mul", [f"t{i}", f"q{i}"], [f"y{i}"], name=f"silu{i}")]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "mlp32", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def resnet50(image: int) -> onnx.ModelProto:
    w = bench_train.ConvNetOnnx(seed=13)
    bench_train.resnet50(w, "x")
    return w.model("resnet50", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, image, image]),
                                helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])], "ResNet-50")


MODELS = {
    "mlp32": (lambda args: mlp32(), {"N": 4096}, {"loss_fn": "mse"}),
    "resnet50": (lambda args: resnet50(args.image), {"N": 8}, {}),
    "gpt12": (lambda args: bench_train.gpt_model(vocab=512, d=256, heads=4, t=128, layers=12), {"N": 8}, {}),
}


def fusions_fired(path: Path, threads: int) -> list[str]:
    """The onnxruntime transformers that replaced nodes at ORT_ENABLE_ALL (named in the new nodes' names)."""
    import onnxruntime as ort
    from onnxgrad import runtime
    model = onnx.load(str(path))
    so, extra = runtime.session_options(model, threads)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    out = path.with_suffix(".optimized.onnx")
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], **extra)
    names = {part for n in onnx.load(str(out), load_external_data=False).graph.node
             for part in n.name.split("/") if part.endswith(("Fusion", "Transformer"))}
    return sorted(names)


def mirror_seconds(layers: int = 2500) -> tuple[int, float]:
    model = bench_pipeline.chain(layers)
    onnxgrad.build(model, loss_fn="mse", mirror="mxnet")  # warm: imports, rule registry
    result = onnxgrad.build(model, loss_fn="mse", mirror="mxnet")
    return result.report["forward_nodes"], result.report["passes"]["mirror"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp32,resnet50,gpt12")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the plain and mirrored processes")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per process (after one warm-up)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--image", type=int, default=224, help="resnet50's image size")
    ap.add_argument("--fusions", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="onnxgrad-mirror-") as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            make, dims, extra = MODELS[name]
            forward = make(args)
            paths, simulated, predicted = {}, {}, {}
            for side, policy in (("plain", None), ("mirrored", "mxnet")):
                result = onnxgrad.build(forward, dims=dims, optimizer="sgd", mirror=policy, **extra)
                paths[side] = tmp / f"{name}_{side}.onnx"
                onnx.save(result.model, paths[side])
                graph = from_model(result.model)
                type_everything(graph)
                simulated[side] = simulate(graph).dynamic_peak
                if policy:
                    predicted = result.report["mirror"]
            row = {"model": name, "nodes": len(forward.graph.node), "recomputed": len(predicted["recomputed"])}
            for level in ("BASIC", "ALL"):
                peaks = {"plain": [], "mirrored": []}
                times = {"plain": [], "mirrored": []}
                for _ in range(args.rounds):
                    for side in ("plain", "mirrored"):
                        m = measure(paths[side], level=level, threads=args.threads, runs=args.runs + 1)
                        peaks[side].append(m["peak_bytes"])
                        times[side].append(statistics.median(m["seconds"][1:]))
                for side in ("plain", "mirrored"):
                    row[f"{level}_{side}_peak"] = statistics.median(peaks[side])
                    row[f"{level}_{side}_s"] = statistics.median(times[side])
                row[f"{level}_reduction"] = row[f"{level}_plain_peak"] / row[f"{level}_mirrored_peak"]
                row[f"{level}_time_ratio"] = row[f"{level}_mirrored_s"] / row[f"{level}_plain_s"]
            row.update({f"sim_{k}": v for k, v in simulated.items()})
            row["sim_error"] = {side: row[f"BASIC_{side}_peak"] / simulated[side] - 1 for side in simulated}
            if args.fusions:
                row["fusions"] = {side: fusions_fired(paths[side], args.threads) for side in paths}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    nodes, seconds = mirror_seconds()
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"\n{args.rounds} rounds x {args.runs} runs, {args.threads} threads, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}; peaks in MiB above the session's baseline\n")
    print("| model | level | plain peak | mirrored peak | reduction | simulated plain / mirrored | "
          "plain step s | mirrored step s | time ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for level in ("BASIC", "ALL"):
            print(f"| {r['model']} ({r['recomputed']} recomputed) | {level} | {mib(r[f'{level}_plain_peak'])} | "
                  f"{mib(r[f'{level}_mirrored_peak'])} | {r[f'{level}_reduction']:.2f}x | "
                  f"{mib(r['sim_plain'])} / {mib(r['sim_mirrored'])} | {r[f'{level}_plain_s']:.3f} | "
                  f"{r[f'{level}_mirrored_s']:.3f} | {r[f'{level}_time_ratio']:.2f}x |")
    print("\nmeasured (BASIC) / simulated - 1: " + "; ".join(
        f"{r['model']} plain {r['sim_error']['plain']:+.1%}, mirrored {r['sim_error']['mirrored']:+.1%}"
        for r in rows))
    if args.fusions:
        for r in rows:
            print(f"fusions at ALL, {r['model']}: {r['fusions']}")
    print(f"mirror pass on a {nodes}-node chain: {seconds:.2f} s")


if __name__ == "__main__":
    main()
