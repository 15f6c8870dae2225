"""Which nodes onnxruntime's CPU provider runs in place: the output written over an input it is the last reader of.

    .venv/bin/python bench/bench_inplace.py
    .venv/bin/python bench/bench_inplace.py --chain 32    # what modelling it would change on the Gemm+Tanh chain

Each case is a small graph: A = X * 2 (a 32 MiB float tensor onnxruntime allocates), then one node reads A, and a
ReduceSum makes the graph's output. Its peak is measured as `memory.measure` measures every graph (a fresh
process, arena off, glibc's mmap threshold fixed), at ORT_ENABLE_BASIC and ORT_ENABLE_ALL. About 32 MiB means the
node wrote over A; about 64 MiB means it took a buffer of its own. The last cases check the conditions: a second
reader of A, and A seen through a Reshape.

The simulator (`memory/simulate.py`) does not model this: while such a node runs it counts both buffers, so it
errs on the high side for the length of that one node.

`--chain LAYERS`: the budget solver's front on the Gemm+Tanh chain of the solver tests (width 256, batch 4096),
once as the liveness kernel counts, once with every Tanh run in place (a Tanh that is the last reader of its
input's copy takes no buffer of its own while it runs): the extra forward passes at budgets of 0.3x-0.5x of the
plain peak and the least peak. It shows whether modelling these nodes would let the solver find cheaper plans.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from onnxgrad.memory.measure import measure  # noqa: E402

N, D = 4096, 2048  # 32 MiB of float32


def _graph(nodes: list, inits: list, opset: int, outputs: tuple[str, ...] = ("out",)) -> onnx.ModelProto:
    sums = [helper.make_node("ReduceSum", [o], [o + "_sum"], keepdims=0) for o in outputs]
    graph = helper.make_graph(nodes + sums, "inplace", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [N, D])],
                              [helper.make_tensor_value_info(o + "_sum", TensorProto.FLOAT, None) for o in outputs],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def cases():
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    a = helper.make_node("Mul", ["X", "two"], ["A"])
    rng = np.random.default_rng(0)
    idx = numpy_helper.from_array(rng.integers(0, N, (64, 1)) * np.ones((1, D), np.int64), "idx")
    rows = numpy_helper.from_array(rng.integers(0, N, (64, 1)).astype(np.int64), "rows")
    upd = numpy_helper.from_array(np.ones((64, D), np.float32), "upd")
    shape = numpy_helper.from_array(np.array([N * 2, D // 2], np.int64), "shape")
    for op, opset in (("Softmax", 18), ("LogSoftmax", 18), ("Tanh", 18), ("Relu", 18), ("Sigmoid", 18),
                      ("LeakyRelu", 18), ("Elu", 18), ("Softplus", 18), ("HardSigmoid", 18), ("Gelu", 20),
                      ("Erf", 18), ("Exp", 18), ("Neg", 18)):
        yield op, _graph([a, helper.make_node(op, ["A"], ["out"])], [two], opset)
    for op in ("Add", "Mul"):
        yield f"{op}(A, X)", _graph([a, helper.make_node(op, ["A", "X"], ["out"])], [two], 18)
    yield "ScatterElements", _graph([a, helper.make_node("ScatterElements", ["A", "idx", "upd"], ["out"], axis=0,
                                                         reduction="add")], [two, idx, upd], 18)
    yield "ScatterND", _graph([a, helper.make_node("ScatterND", ["A", "rows", "upd"], ["out"], reduction="add")],
                              [two, rows, upd], 18)
    yield "Softmax, A read twice", _graph([a, helper.make_node("Softmax", ["A"], ["out"]),
                                           helper.make_node("Neg", ["A"], ["out2"])], [two], 18, ("out", "out2"))
    yield "Softmax of Reshape(A)", _graph([a, helper.make_node("Reshape", ["A", "shape"], ["R"]),
                                           helper.make_node("Softmax", ["R"], ["out"])], [two, shape], 18)


def _in_place_kernel(kernel, problem, sources):
    """`kernel` (the problem module's `_liveness`) with, on `problem`, each op of `sources` (op -> the op whose
    output it may write over) run in place where it is the last reader of the copy it reads."""
    def liveness(p, schedule):
        ops, live_after, during, unread = kernel(p, schedule)
        if p is not problem:
            return ops, live_after, during, unread
        latest, last_read = {}, {}
        for q, op in enumerate(schedule):
            for j in p.reads[op]:
                last_read[latest[j]] = q
            latest[op] = q
        latest = {}
        for q, op in enumerate(schedule):
            j = sources.get(op)
            if j is not None and last_read.get(latest[j]) == q and j not in p.keep:
                during[q] -= p.size[j]
            latest[op] = q
        return ops, live_after, during, unread
    return liveness


def chain(layers: int) -> None:
    from solver_problems import tanh_chain

    from onnxgrad.memory import solvers
    from onnxgrad.memory.budget import solver_limits
    kernel_module = importlib.import_module("onnxgrad.memory.solvers.problem")
    bp, peak = tanh_chain(layers)
    problem = bp.problem
    offset = max(0, problem.baseline_peak - peak)
    sources = {i: problem.reads[i][0] for i, node in enumerate(bp.nodes)
               if node.op_type == "Tanh" and len(problem.reads[i]) == 1}
    fractions = (0.3, 0.316, 0.339, 0.4, 0.5)
    print(f"| kernel | least peak x | " + " | ".join(f"{f}x: extra fwd" for f in fractions) + " |")
    print("|---|---|" + "---|" * len(fractions))
    kernel = kernel_module._liveness
    for name in ("as simulated", f"{len(sources)} Tanh in place"):
        if name != "as simulated":
            kernel_module._liveness = _in_place_kernel(kernel, problem, sources)
        try:
            front = solvers.front(problem, solver_limits(problem))
        finally:
            kernel_module._liveness = kernel
        cells = []
        for f in fractions:
            s = front.best_under(int(f * peak) + offset)
            cells.append("none" if s is None else f"{s.extra_cost / bp.forward_cost:.3f}")
        print(f"| {name} | {(front.least_peak - offset) / peak:.4f} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chain", type=int, metavar="LAYERS")
    args = parser.parse_args()
    if args.chain:
        chain(args.chain)
        return
    print("| node reading A (32 MiB) | peak MiB, BASIC | peak MiB, ALL | in place |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in cases():
            path = os.path.join(tmp, "case.onnx")
            onnx.save(model, path)
            peaks = [measure(path, level=level, runs=2)["peak_bytes"] / 2**20 for level in ("BASIC", "ALL")]
            print(f"| {name} | {peaks[0]:.1f} | {peaks[1]:.1f} | {'yes' if max(peaks) < 48 else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
