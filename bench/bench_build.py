"""How long `onnxgrad.build_gradient` takes on large forward graphs, and where the time goes.

    .venv/bin/python bench/bench_build.py [--sizes 1000,10000,100000] [--repeat 3] [--no-phases] [--run]
    .venv/bin/python bench/bench_build.py --sizes 250,500,1000 --mirror 0.7x

Each graph is a seeded random DAG of element-wise ops (Add Sub Mul Div Neg Exp Log Sqrt Abs Sum Max Min Where
Clip Pow) over small float32 tensors: activations of shape [4, 8] and [1, 8], parameters (initializers) of
shapes [8], [4, 1], [1, 8] and [], so most binary ops broadcast and the backward pass must sum gradients back
down. Values have several consumers; the loss is ReduceSum of the Sum of every value nobody else reads, so every
node lies on a path to the loss. Unsafe ops get safe arguments (Log(|v| + 1), Exp(Clip(v)), a / (|b| + 1)),
so `--run` can execute the 1k training graph in onnxruntime and find finite numbers.

The table gives best-of-`repeat` wall-clock and CPU seconds (one run from 100k nodes on) and CPU microseconds
per forward node (CPU time, because wall time on a shared 2-core machine swings with other load). The phase
table gives the seconds of each pass of the pipeline, from the build's own report.
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from onnxgrad import registry

ROWS, COLS = 4, 8
PARAM_SHAPES = [(COLS,), (ROWS, 1), (1, COLS), ()]


class DagWriter:
    """Appends nodes to a list, naming every value v<k>, and tracks values that nothing reads yet."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.unread: dict[str, None] = {}   # insertion-ordered set
        self.recent: list[str] = []
        self.count = 0

    def fresh(self) -> str:
        self.count += 1
        return f"v{self.count}"

    def init(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        self.shapes[name] = array.shape
        return name

    def constant(self, name: str, value: float) -> str:
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(np.array(value, np.float32))))
        self.shapes[name] = ()
        return name

    def emit(self, op: str, inputs: list[str], shape: tuple[int, ...], activation: bool = True, **attrs) -> str:
        out = self.fresh()
        self.nodes.append(helper.make_node(op, inputs, [out], name=f"n{len(self.nodes)}", **attrs))
        for name in inputs:
            self.unread.pop(name, None)
        self.shapes[out] = shape
        if activation:
            self.unread[out] = None
            self.recent.append(out)
        return out

    def pick(self) -> str:
        """An operand: half the time the oldest unread value (keeps sinks few), else a recent one."""
        if self.unread and self.rng.random() < 0.5:
            return next(iter(self.unread))
        window = self.recent[-16:]
        return window[int(self.rng.integers(len(window)))]


def _broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*shapes))


def synthetic_model(n_nodes: int, seed: int = 0) -> onnx.ModelProto:
    """A forward model of about `n_nodes` nodes (the exact count is `len(model.graph.node)`), whose one
    output is the scalar `loss`."""
    rng = np.random.default_rng(seed)
    w = DagWriter(rng)
    params = [w.init(f"p{i}", rng.uniform(0.5, 1.5, size=PARAM_SHAPES[i % len(PARAM_SHAPES)]))
              for i in range(max(8, n_nodes // 100))]
    # Constants are Constant nodes, not initializers, so they are not parameters: d(a ** 2)/d2 = y log(a)
    # would be NaN for a < 0.
    one, two, lo, hi = (w.constant(name, value) for name, value in
                        [("one", 1.0), ("two", 2.0), ("lo", -3.0), ("hi", 3.0)])
    w.recent += ["x", "h"]
    w.shapes["x"], w.shapes["h"] = (ROWS, COLS), (1, COLS)
    w.unread.update({"x": None, "h": None})

    def param() -> str:
        return params[int(rng.integers(len(params)))]

    def safe_pos(v: str) -> str:  # |v| + 1 >= 1
        return w.emit("Add", [w.emit("Abs", [v], w.shapes[v], activation=False), one], w.shapes[v], False)

    binary = ["Add", "Sub", "Mul", "Div", "Max", "Min", "Sum3", "Where"]
    unary = ["Neg", "Exp", "Log", "Sqrt", "Abs", "Clip", "Pow"]
    while len(w.nodes) < n_nodes - 4:
        a = w.pick()
        if rng.random() < 0.55:
            op = binary[int(rng.integers(len(binary)))]
            b = param() if rng.random() < 0.4 else w.pick()
            shape = _broadcast(w.shapes[a], w.shapes[b])
            if op == "Div":
                w.emit("Div", [a, safe_pos(b)], shape)
            elif op == "Sum3":
                c = w.pick()
                w.emit("Sum", [a, b, c], _broadcast(shape, w.shapes[c]))
            elif op == "Where":
                cond = w.emit("Greater", [a, b], shape, activation=False)
                w.emit("Where", [cond, a, b], shape)
            else:
                w.emit(op, [a, b], shape)
        else:
            op = unary[int(rng.integers(len(unary)))]
            shape = w.shapes[a]
            if op == "Exp":
                w.emit("Exp", [w.emit("Clip", [a, lo, hi], shape, activation=False)], shape)
            elif op in ("Log", "Sqrt"):
                w.emit(op, [safe_pos(a)], shape)
            elif op == "Clip":
                w.emit("Clip", [a, lo, hi], shape)
            elif op == "Pow":
                w.emit("Pow", [w.emit("Clip", [a, lo, hi], shape, activation=False), two], shape)
            else:
                w.emit(op, [a], shape)
    sinks = list(w.unread)
    total = w.emit("Sum", sinks, _broadcast(*(w.shapes[s] for s in sinks)), activation=False)
    scaled = w.emit("Mul", [total, w.constant("scale", 1.0 / len(sinks))], w.shapes[total], False)
    w.nodes.append(helper.make_node("ReduceSum", [scaled], ["loss"], name="loss", keepdims=0))
    loss_shape = []

    graph = helper.make_graph(
        w.nodes, f"dag{n_nodes}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, COLS]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, COLS])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, loss_shape)], w.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    return model


# -- timing -------------------------------------------------------------------------------------------------

def _collect() -> None:
    """Free the previous build's graph before timing the next, as a fresh `onnxgrad` process would start.

    A finished build's Graph holds reference cycles (Value <-> Node), so it is only freed by a full
    collection; left alone, that collection and the walk over the dead graph land in the next timed build.
    """
    if gc.isenabled():
        gc.collect()


def time_build(model: onnx.ModelProto, repeat: int) -> tuple[float, float, dict]:
    """Best wall-clock and best CPU seconds of `repeat` builds (CPU time is steadier on a shared machine)."""
    best_wall = best_cpu = float("inf")
    report = {}
    for _ in range(repeat):
        _collect()
        wall, cpu = time.perf_counter(), time.process_time()
        result = onnxgrad.build(model, loss="loss")
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
        report = result.report
    return best_wall, best_cpu, report


def time_mirror(model: onnx.ModelProto, mirror: str, options: dict | None = None) -> tuple[float, dict]:
    """CPU seconds of one build with recomputation (the mirror pass and its policy included), and its report."""
    _collect()
    cpu = time.process_time()
    report = onnxgrad.build(model, loss="loss", mirror=mirror, mirror_options=options).report
    return time.process_time() - cpu, report


def mirror_table(models: dict[int, onnx.ModelProto], budget: str) -> None:
    """The build with MXNet's mirroring and with `--budget`, against the plain build, per graph size."""
    print()
    print(f"| forward nodes | plain, CPU s | mirror (MXNet), CPU s | ratio | --budget {budget}, CPU s | ratio | "
          f"solver ops | recomputations |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, model in models.items():
        _, plain, _ = time_build(model, 1)
        mxnet, _ = time_mirror(model, "mxnet")
        budgeted, report = time_mirror(model, "budget", {"budget": budget})
        m = report["mirror"]
        print(f"| {n} | {plain:.2f} | {mxnet:.2f} | {mxnet / plain:.1f}x | {budgeted:.2f} | {budgeted / plain:.1f}x | "
              f"{m.get('problem_ops', '')} | {m.get('recomputations', '')} |", flush=True)


def run_once(model: onnx.ModelProto) -> None:
    """Run the training graph in onnxruntime and check the gradients are finite."""
    from onnxgrad import runtime
    train = onnxgrad.build_gradient(model, loss="loss")
    sess = runtime.session(train, "cpu")
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((ROWS, COLS)).astype(np.float32),
             "h": rng.standard_normal((1, COLS)).astype(np.float32)}
    for init in train.graph.initializer:
        if any(i.name == init.name for i in train.graph.input):
            feeds[init.name] = numpy_helper.to_array(init)
    if any(i.name == "loss_grad" for i in train.graph.input):
        feeds["loss_grad"] = np.ones((ROWS, COLS), np.float32)
    outs = sess.run(None, feeds)
    finite = all(np.isfinite(o).all() for o in outs)
    print(f"onnxruntime ran the {len(model.graph.node)}-node training graph: {len(outs)} outputs, "
          f"loss sum {float(np.sum(outs[0])):.6g}, all finite: {finite}")
    if not finite:
        sys.exit(1)


def machine() -> str:
    return (f"{os.cpu_count()} cores ({platform.processor() or platform.machine()}), Python "
            f"{platform.python_version()}, onnx {onnx.__version__}, onnxruntime {ort.__version__}, "
            f"numpy {np.__version__}, onnxgrad {onnxgrad.__version__}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1000,10000,100000", help="forward node counts, comma-separated")
    p.add_argument("--repeat", type=int, default=3, help="runs per size below 100k (best is reported)")
    p.add_argument("--no-phases", action="store_true", help="skip the per-phase timing")
    p.add_argument("--run", action="store_true", help="also run the 1k training graph in onnxruntime")
    p.add_argument("--mirror", metavar="BUDGET", help="only the table of builds with recomputation: MXNet's "
                   "mirroring and --budget BUDGET (e.g. 0.7x) against the plain build")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    registry.all_rules()
    print(machine())

    models = {}
    for n in sizes:
        t = time.perf_counter()
        models[n] = synthetic_model(n)
        print(f"built the {len(models[n].graph.node)}-node forward graph in {time.perf_counter() - t:.2f} s")
    onnxgrad.build(models[sizes[0]], loss="loss")  # warm-up: imports, rule registration
    if args.mirror:
        mirror_table(models, args.mirror)
        return

    print()
    print("| forward nodes | seconds (wall) | seconds (CPU) | µs / node (CPU) | backward nodes | runs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        repeat = 1 if n >= 100_000 else args.repeat
        wall, cpu, report = time_build(models[n], repeat)
        fwd = report["forward_nodes"]
        runs = f"best of {repeat}" if repeat > 1 else "1"
        print(f"| {fwd} | {wall:.3f} | {cpu:.3f} | {cpu / fwd * 1e6:.1f} | {report['backward_nodes']} | {runs} |",
              flush=True)

    if not args.no_phases:
        per_size = {}
        for n in sizes:
            _collect()
            t = time.perf_counter()
            report = onnxgrad.build(models[n], loss="loss").report
            per_size[n] = (report["passes"], time.perf_counter() - t)
        phases = list(next(iter(per_size.values()))[0])
        print()
        print("Passes (one run each, wall seconds from the report; µs per forward node in brackets):")
        print()
        print("| pass | " + " | ".join(f"{len(models[n].graph.node)} nodes" for n in sizes) + " |")
        print("|---|" + "---:|" * len(sizes))
        for ph in phases + ["other", "total"]:
            cells = []
            for n in sizes:
                secs, total = per_size[n]
                s = {"other": total - sum(secs.values()), "total": total}.get(ph, secs.get(ph, 0.0))
                cells.append(f"{s:.3f} ({s / len(models[n].graph.node) * 1e6:.1f})")
            print(f"| {ph} | " + " | ".join(cells) + " |")

    if args.run:
        print()
        run_once(models[sizes[0]])


if __name__ == "__main__":
    main()
