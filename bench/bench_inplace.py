"""Which nodes onnxruntime's CPU provider runs in place: the output written over an input it is the last reader of.

    .venv/bin/python bench/bench_inplace.py

Each case is a small graph: A = X * 2 (a 32 MiB float tensor onnxruntime allocates), then one node reads A, and a
ReduceSum makes the graph's output. Its peak is measured as `memory.measure` measures every graph (a fresh
process, arena off, glibc's mmap threshold fixed), at ORT_ENABLE_BASIC and ORT_ENABLE_ALL. About 32 MiB means the
node wrote over A; about 64 MiB means it took a buffer of its own. The last cases check the conditions: a second
reader of A, and A seen through a Reshape.

The simulator (`memory/simulate.py`) does not model this: while such a node runs it counts both buffers, so it
errs on the high side for the length of that one node.
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
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


def main() -> None:
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
