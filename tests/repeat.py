"""Running a training graph again, and on other thread counts, must give the same numbers.

`assert_repeatable` runs a model RUNS times in one session at each of THREADS intra-op threads. Within one
thread count the outputs must be bit-identical: nothing in a training graph may depend on which thread wins a
race. Across thread counts onnxruntime's own kernels (MatMul, reductions) split their sums differently, so
there the outputs must agree to a relative L2 error of ACROSS_THREADS.
"""
from __future__ import annotations

import numpy as np
import onnx

from onnxgrad import runtime

THREADS = (2, 4)
RUNS = 3
ACROSS_THREADS = 1e-5


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_repeatable(model: onnx.ModelProto, feeds: dict[str, np.ndarray], what: str) -> list[np.ndarray]:
    """Run `model` RUNS times at each thread count; return the outputs of the first run at THREADS[0]."""
    first: dict[int, list[np.ndarray]] = {}
    for threads in THREADS:
        sess = runtime.session(model, "cpu", threads=threads)
        names = [o.name for o in sess.get_outputs()]
        runs = [sess.run(None, feeds) for _ in range(RUNS)]
        for k, outs in enumerate(runs[1:], start=2):
            differ = [n for n, a, b in zip(names, runs[0], outs) if not np.array_equal(a, b, equal_nan=True)]
            assert not differ, f"{what}: run {k} at {threads} threads differs from run 1 in {differ}"
        first[threads] = runs[0]
    base = THREADS[0]
    for threads in THREADS[1:]:
        far = {n: e for n, a, b in zip(names, first[threads], first[base])
               if np.issubdtype(np.asarray(a).dtype, np.floating) and (e := rel_l2(a, b)) > ACROSS_THREADS}
        assert not far, f"{what}: {threads} threads against {base} (relative L2): {far}"
    return first[base]
