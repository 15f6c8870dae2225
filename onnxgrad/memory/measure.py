"""What one run of a graph really costs in onnxruntime: peak memory above the session's baseline, and time.

Each measurement runs in a fresh Python process, so no earlier allocation hides in the figure. The session has
the CPU arena and memory patterns off and glibc's mmap threshold fixed (each tensor is mapped and unmapped as
it lives, so the resident set follows the live bytes) and the settings of the graph's metadata (node order, CSE off). The process runs the
graph once to warm up, resets the kernel's high-water mark of its resident set (/proc/self/clear_refs), then
runs it again: the peak is VmHWM less the resident set just before that run (weights, feeds and the session
are already counted in the baseline), the figure the simulator calls the dynamic peak.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# glibc serves large blocks with mmap and gives them back on free, unless it raises its threshold after a free
# (its default, dynamic behaviour), after which blocks stay in the heap and a warm process's resident set no
# longer moves. A fixed threshold keeps every tensor above 64 KiB in its own mapping.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}

CHILD = r"""
import json, sys, time
import numpy as np, onnx, onnxruntime as ort
from onnxgrad import runtime
from onnxgrad.runner import random_feeds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)

path, level, threads, runs, dims = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
model = onnx.load(path)
so, extra = runtime.session_options(model, threads)
so.enable_cpu_mem_arena = False
so.enable_mem_pattern = False
so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, "ORT_ENABLE_" + level)
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"], **extra)
init = {t.name for t in model.graph.initializer}
feeds = random_feeds(model, dims, 0, init)
del model
sess.run(None, feeds)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
t = time.perf_counter()
sess.run(None, feeds)
first = time.perf_counter() - t
peak = status("VmHWM") - base
times = [first]
for _ in range(runs - 1):
    t = time.perf_counter()
    sess.run(None, feeds)
    times.append(time.perf_counter() - t)
print(json.dumps({"peak_bytes": peak, "seconds": times}))
"""


def measure(model_path: str | os.PathLike, *, level: str = "BASIC", threads: int = 1, runs: int = 1,
            dims: dict[str, int] | None = None) -> dict:
    """{"peak_bytes": ..., "seconds": [...]} of `runs` runs of the graph at ORT_ENABLE_<level>, in a fresh
    process; graph inputs without initializers get seeded random data (`dims` binds symbolic sizes)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_path), level, str(threads), str(runs),
                           json.dumps(dims or {})], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(threads), **MALLOC})
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {Path(model_path).name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
