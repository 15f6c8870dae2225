"""The recomputation cost model against onnxruntime: per-kernel-class prices, and the step-time ratio each cost
predicts for a mirrored graph against the ratio measured.

    .venv/bin/python bench/bench_cost.py --graphs DIR [--calibrate] [--runs 5] [--threads 1]

DIR holds training graphs as `bench/bench_real_budget.py --out DIR` leaves them: `<model>_b<batch>_train.onnx`
(the plain graph) beside `<model>_b<batch>_<budget>.onnx` (mirrored under a budget).

`--calibrate` profiles every plain graph (onnxruntime's profiler, graph optimisations off so that each node
runs as itself, 1 thread, the median of `--runs` runs) and fits, by non-negative least squares over all their
nodes, microseconds per FLOP and per byte moved for each kernel class (`memory.cost.KERNEL_CLASSES`) and per
node run. It prints the fit per class and the `Prices` to paste into `memory/cost.py`.

Then, for every mirrored graph, the step-time ratio against its plain graph as each cost predicts it (the sum
of the cost of every node the step runs, recomputed copies priced as their originals) and as measured: the
process CPU seconds of one run at ORT_ENABLE_ALL, the median of `--runs` runs after a warm-up, in a fresh
process per graph, `--threads` threads (CPU seconds rather than wall time, so that other work on the machine
moves the figure less). Costs:
  flops      FLOPs + 20 x bytes moved (the model before calibration)
  prices     the calibrated prices (`memory.cost.CPU_PRICES`)
  profile    onnxruntime's own time per node of the plain graph (`--cost profile`)
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPY = re.compile(r"_mirror(_\d+)?$")


def features(graph, model):
    """Per node: its kernel class, FLOPs and bytes moved (nodes whose shapes are unknown are left out)."""
    from onnxgrad.errors import UsageError
    from onnxgrad.memory.cost import kernel_class
    rows = {}
    for n in graph.nodes:
        try:
            rows[n.name] = (kernel_class(n), model.flops(n), model.bytes_moved(n))
        except UsageError:
            continue
    return rows


def fit(samples, classes):
    """Non-negative least squares: microseconds ~ per_flop[class] * flops + per_byte[class] * bytes + per_node."""
    from scipy.optimize import nnls
    columns = [("flop", c) for c in classes] + [("byte", c) for c in classes] + [("node", "")]
    a = np.zeros((len(samples), len(columns)))
    b = np.zeros(len(samples))
    index = {col: j for j, col in enumerate(columns)}
    for i, (cls, flops, moved, us) in enumerate(samples):
        a[i, index[("flop", cls)]] = flops
        a[i, index[("byte", cls)]] = moved
        a[i, index[("node", "")]] = 1.0
        b[i] = us
    # scale the columns so that the solver sees numbers of one size
    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x, _ = nnls(a / scale, b, maxiter=50 * len(columns))
    x = x / scale
    per_flop = {c: float(x[index[("flop", c)]]) for c in classes}
    per_byte = {c: float(x[index[("byte", c)]]) for c in classes}
    return per_flop, per_byte, float(x[index[("node", "")]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--graphs", required=True)
    ap.add_argument("--calibrate", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import onnx

    from onnxgrad.api import load_graph
    from onnxgrad.memory import measure, simulate
    from onnxgrad.memory.cost import CPU_PRICES, KERNEL_CLASSES, CostModel, Prices, profile_costs

    folder = Path(args.graphs)
    plains = sorted(folder.glob("*_train.onnx"))
    flops_model = CostModel()
    graphs, profiles, rows = {}, {}, {}
    for path in plains:
        graphs[path] = load_graph(str(path))
        rows[path] = features(graphs[path], flops_model)
        profiles[path] = profile_costs(onnx.load(str(path)), runs=args.runs, threads=args.threads)

    prices = CPU_PRICES
    if args.calibrate:
        classes = [*KERNEL_CLASSES, "elementwise"]
        samples = [(*rows[p][name], us) for p in plains for name, us in profiles[p].items() if name in rows[p]]
        per_flop, per_byte, per_node = fit(samples, classes)
        prices = Prices(per_flop, per_byte, per_node)
        fitted = CostModel(prices=prices)
        nodes = {p: {n.name: n for n in graphs[p].nodes} for p in plains}
        print(f"calibration over {len(samples)} nodes of {len(plains)} graphs "
              f"({', '.join(p.stem for p in plains)}), {args.threads} thread(s), median of {args.runs} runs")
        print("| class | nodes | measured ms | fitted ms | fitted / measured | us per GFLOP | us per MB |")
        print("|---|---|---|---|---|---|---|")
        for c in classes:
            mine = [(p, name) for p in plains for name in profiles[p] if name in rows[p] and rows[p][name][0] == c]
            if not mine:
                continue
            measured = sum(profiles[p][name] for p, name in mine) / 1e3
            model_ms = sum(fitted.cost(nodes[p][name]) for p, name in mine) / 1e3
            print(f"| {c} | {len(mine)} | {measured:.1f} | {model_ms:.1f} | {model_ms / measured:.2f} | "
                  f"{per_flop[c] * 1e9:.1f} | {per_byte[c] * 1e6:.1f} |")
        print(f"per node run: {per_node:.2f} us")
        print("CPU_PRICES = Prices(")
        print("    per_flop={" + ", ".join(f'"{c}": {v:.4g}' for c, v in per_flop.items()) + "},")
        print("    per_byte={" + ", ".join(f'"{c}": {v:.4g}' for c, v in per_byte.items()) + "},")
        print(f"    per_node={per_node:.4g},\n)")
        print()

    priced = CostModel(prices=prices)
    print("| graph | recomputed nodes | predicted ratio: flops | prices | profile | measured ratio (CPU s) | "
          "error: flops | prices | profile |")
    print("|---|---|---|---|---|---|---|---|---|")
    for plain in plains:
        prefix = plain.name[:-len("_train.onnx")]
        mirrored = sorted(p for p in folder.glob(f"{prefix}_*.onnx")
                          if p != plain and not p.stem.endswith("_step") and "_b" in p.stem)
        if not mirrored:
            continue
        base = measure.measure(plain, level="ALL", threads=args.threads, runs=args.runs + 1)
        base_cpu = float(np.median(base["cpu_seconds"][1:]))
        by_name = {n.name: n for n in graphs[plain].nodes}
        totals = {"flops": sum(flops_model.cost(n) for n in graphs[plain].nodes),
                  "prices": sum(priced.cost(n) for n in graphs[plain].nodes),
                  "profile": sum(profiles[plain].values())}
        for path in mirrored:
            g = onnx.load(str(path), load_external_data=False)
            copies = [COPY.sub("", n.name) for n in g.graph.node if COPY.search(n.name)]
            copies = [by_name[c] for c in copies if c in by_name]
            extra = {"flops": sum(flops_model.cost(n) for n in copies),
                     "prices": sum(priced.cost(n) for n in copies),
                     "profile": sum(profiles[plain].get(n.name, 0.0) for n in copies)}
            m = measure.measure(path, level="ALL", threads=args.threads, runs=args.runs + 1)
            ratio = float(np.median(m["cpu_seconds"][1:])) / base_cpu
            predicted = {k: 1 + extra[k] / totals[k] for k in totals}
            print(f"| {path.stem} | {len(copies)} | " + " | ".join(f"{predicted[k]:.2f}" for k in totals)
                  + f" | {ratio:.2f} | " + " | ".join(f"{predicted[k] / ratio - 1:+.0%}" for k in totals) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
