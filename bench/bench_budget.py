"""`onnxgrad mirror --budget` measured in onnxruntime: at 50% and 30% of the unmirrored peak, the peak and the
step time against the unmirrored step, side by side.

    .venv/bin/python bench/bench_budget.py [--models resnet50,densenet121,gpt12] [--fractions 0.5,0.3] [--runs 3]

Models: ResNet-50 (bench_train's writer, bottlenecks 3-4-6-3, batch 8 at 224x224, cross-entropy);
DenseNet-121 from the onnx model zoo graph that ships inside the onnx wheel (`onnx/backend/test/data/light/`,
weights given by `onnxgrad materialize --seed 0`, the gradient taken of the class scores seeded by a random
`<output>_grad`); its batch is fixed at 1 in the file, so its weights and their updates are most of its peak and
a low budget can be under the floor, which the table then says; and the 12-layer GPT-2-style stack of
bench_train.py (width 256, 4 heads, 128 tokens, batch 8, cross-entropy). Every graph is a step graph (SGD).
Each figure is one fresh onnxruntime process (onnxgrad.memory.measure): peak = static bytes (weights, inputs)
+ the measured peak of one run above the session's baseline; step time = the median of `--runs` runs after a
warm-up, plain and budgeted processes alternating, at ORT_ENABLE_ALL. Also printed: the solver, its seconds,
the floor, and the extra compute the plan buys, in forward passes of the cost model.
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

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_train  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.errors import UsageError  # noqa: E402
from onnxgrad.materialize import materialize  # noqa: E402
from onnxgrad.memory.measure import measure  # noqa: E402
from onnxgrad.api import load_graph as load  # noqa: E402
from onnxgrad.memory.simulate import simulate  # noqa: E402

ZOO = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def zoo(name: str):
    forward, _ = materialize(onnx.load(str(ZOO / f"light_{name}.onnx")), seed=0)
    return forward, {"loss": forward.graph.output[0].name}


def resnet50():
    import bench_mirror
    return bench_mirror.resnet50(224), {"dims": {"N": 8}}


MODELS = {
    "resnet50": resnet50,
    "resnet50-zoo": lambda: zoo("resnet50"),
    "densenet121": lambda: zoo("densenet121"),
    "gpt12": lambda: (bench_train.gpt_model(vocab=512, d=256, heads=4, t=128, layers=12), {"dims": {"N": 8}}),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="resnet50,densenet121,gpt12")
    ap.add_argument("--fractions", default="0.5,0.3")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--level", default="ALL", choices=["BASIC", "ALL"])
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="onnxgrad-budget-") as tmp:
        tmp = Path(tmp)
        for name in args.models.split(","):
            forward, kw = MODELS[name]()
            plain = onnxgrad.build(forward, optimizer="sgd", **kw)
            paths = {"plain": tmp / f"{name}_plain.onnx"}
            onnx.save(plain.model, paths["plain"])
            static = simulate(load(plain.model)).static
            info = {}
            for f in args.fractions.split(","):
                started = time.perf_counter()
                try:
                    r = onnxgrad.build(forward, optimizer="sgd", mirror="budget", mirror_options={"budget": f"{f}x"},
                                       **kw)
                except UsageError as e:
                    print(f"| {name} | {float(f):.0%} | {e} |")
                    continue
                info[f] = {**r.report["mirror"], "build_seconds": time.perf_counter() - started}
                paths[f] = tmp / f"{name}_{f}.onnx"
                onnx.save(r.model, paths[f])
            peaks, times = {k: [] for k in paths}, {k: [] for k in paths}
            for side, path in paths.items():
                m = measure(path, level=args.level, threads=args.threads, runs=args.runs + 1)
                peaks[side] = static + m["peak_bytes"]
                times[side] = statistics.median(m["seconds"][1:])
            for f, m in info.items():
                row = {"model": name, "fraction": float(f), "budget": m["budget_bytes"],
                       "unmirrored_sim": m["predicted"]["unmirrored_peak_bytes"],
                       "simulated": m["predicted"]["peak_bytes"], "measured": peaks[f],
                       "measured_plain": peaks["plain"], "time_ratio": times[f] / times["plain"],
                       "plain_s": times["plain"], "step_s": times[f], "solver": m["solver"],
                       "solve_s": m["solve_seconds"], "floor": m["floor_bytes"],
                       "extra_forward_passes": m["extra_forward_passes"], "recomputed": len(m["recomputed"])}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"\nORT_ENABLE_{args.level}, {args.threads} threads, {args.runs} timed runs; load average "
          f"{os.getloadavg()[0]:.1f}; MiB, peaks include weights and inputs\n")
    print("| model | budget | floor | simulated | measured (plain) | measured / budget | step s (plain) | "
          "time ratio | extra fwd passes | solver (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['fraction']:.0%} = {mib(r['budget'])} | {mib(r['floor'])} | "
              f"{mib(r['simulated'])} | {mib(r['measured'])} ({mib(r['measured_plain'])}) | "
              f"{r['measured'] / r['budget']:.3f} | {r['step_s']:.3f} ({r['plain_s']:.3f}) | "
              f"{r['time_ratio']:.2f}x | {r['extra_forward_passes']:.2f} | {r['solver']} ({r['solve_s']:.1f}) |")


if __name__ == "__main__":
    main()
