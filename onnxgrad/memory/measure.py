"""What one run of a graph really costs in onnxruntime: peak memory above the session's baseline, and time.

Each measurement runs in a fresh Python process, so no earlier allocation hides in the figure. The session is
made with the graph's own settings (`runtime.session_options`: node order, CSE off) and, by default, allocates as
onnxgrad's sessions do for a graph with a budget (the CPU arena and memory patterns off, glibc's mmap threshold
fixed), or, for comparison, with onnxruntime's CPU arena on or glibc's default malloc (`allocator`). The
process runs the graph twice, each time after resetting the kernel's high-water mark of its resident set
(/proc/self/clear_refs): the peak is the larger rise of VmHWM over the resident set just before a run (weights,
feeds and the session are already counted there), the figure the simulator calls the dynamic peak. The first run
counts because an arena keeps what it reserved then; the second because a run may need more than the first left.
What the first run adds to the file-backed resident set is left out: onnxruntime's library code, paged in as each
kernel first runs (1.6-1.7 MiB on a small transformer's training graph, none in later runs), is the process's,
not the graph's.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# How the measuring process allocates: "exact" as onnxgrad's sessions run a graph with a budget (the CPU arena
# off, glibc's mmap threshold fixed: `runtime.follow_live_bytes`; its maps in huge pages, as `onnxgrad run`,
# `train` and `check` start, only where GLIBC_TUNABLES asks for them: they leave the peak as it is but spread a
# small graph's measurement, 0.94-1.00 of the simulated peak where it is 0.97-1.01 without); "arena" with
# onnxruntime's CPU arena on (a session's default, and onnxgrad's for graphs without a budget; for a plan made for
# the arena, the arena onnxgrad's sessions give it: `runtime.split_every_chunk`) and glibc's default malloc;
# "glibc" with the arena off and glibc's default malloc (which raises its mmap threshold after large frees, so
# freed tensors stay resident); "patterns" as "exact" with onnxruntime's memory patterns on (a run's tensors laid
# out in one block planned from the first run), which onnxgrad's sessions do not use (BENCHMARKS.md, "Huge pages").
ALLOCATORS = ("exact", "arena", "glibc", "patterns")

CHILD = r"""
import json, sys, time
import numpy as np, onnx, onnxruntime as ort
from onnxgrad import runtime
from onnxgrad.protos import random_feeds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(key)

path, level, threads, runs, dims = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
allocator = sys.argv[6]
model = onnx.load(path)
fix_malloc = runtime.follow_live_bytes
runtime.follow_live_bytes = lambda: False  # the allocator is chosen here, not by the graph's metadata
if allocator in ("exact", "patterns"):
    fix_malloc()
if allocator != "arena":
    runtime.split_every_chunk = lambda so: None
so, extra = runtime.session_options(model, threads)
so.enable_cpu_mem_arena = allocator == "arena"
so.enable_mem_pattern = allocator == "patterns"
if level != "GRAPH":  # GRAPH: the level onnxgrad's sessions give this graph
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, "ORT_ENABLE_" + level)
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"], **extra)
init = {t.name for t in model.graph.initializer}
feeds = random_feeds(model, dims, 0, init)
del model
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base, code = status("VmRSS"), status("RssFile")
sess.run(None, feeds)
first_peak = status("VmHWM") - base - (status("RssFile") - code)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
t, c = time.perf_counter(), time.process_time()
sess.run(None, feeds)
times, cpu = [time.perf_counter() - t], [time.process_time() - c]
peak = max(status("VmHWM") - base, first_peak)
for _ in range(runs - 1):
    t, c = time.perf_counter(), time.process_time()
    sess.run(None, feeds)
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
print(json.dumps({"peak_bytes": peak, "seconds": times, "cpu_seconds": cpu}))
"""


def measure(model_path: str | os.PathLike, *, level: str = "BASIC", threads: int = 1, runs: int = 1,
            dims: dict[str, int] | None = None, allocator: str = "exact") -> dict:
    """{"peak_bytes": ..., "seconds": [...], "cpu_seconds": [...]} (wall and process CPU time) of `runs` runs
    of the graph at ORT_ENABLE_<level> (GRAPH: the level onnxgrad's sessions give it), in a fresh process
    allocating as `allocator` says (ALLOCATORS); graph inputs without initializers get seeded random data (`dims`
    binds symbolic sizes)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator {allocator!r}: expected one of {', '.join(ALLOCATORS)}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_path), level, str(threads), str(runs),
                           json.dumps(dims or {}), allocator], capture_output=True, text=True,
                          env={**env, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise RuntimeError(f"measuring {Path(model_path).name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


ARENA_CHILD = r"""
import json, sys, time
import onnx, onnxruntime as ort
from onnxgrad import runtime
from onnxgrad.protos import random_feeds

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

path, limit, strategy, threads, dead = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
runs, maps = int(sys.argv[6]), len(sys.argv) > 7

def resident_maps():
    out, start = {}, None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start = head
            low, high = (int(x, 16) for x in start.split("-"))
            out[start] = [high - low, 0]
        elif head == "Rss:":
            out[start][1] = int(line.split()[1]) * 1024
    return out
model = onnx.load(path)
runtime.follow_live_bytes = lambda: False  # the arena allocates here, not glibc's mmap
runtime.split_every_chunk = lambda so: None  # and it is the one configured here
so, extra = runtime.session_options(model, threads)
so.enable_cpu_mem_arena = True
so.enable_mem_pattern = False
so.add_session_config_entry("session.use_env_allocators", "1")
info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
ort.create_and_register_allocator(info, ort.OrtArenaCfg(limit, strategy, -1, dead))
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"], **extra)
feeds = random_feeds(model, {}, 0, {t.name for t in model.graph.initializer})
del model
base, code = status("VmRSS"), status("RssFile")
before = resident_maps() if maps else {}
seconds = []
try:
    for _ in range(runs):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = time.perf_counter()
        sess.run(None, feeds)
        seconds.append(time.perf_counter() - start)
except Exception as e:
    sys.exit(3 if "Available memory" in str(e) else 1)
if maps:  # the maps whose resident bytes rose by 1 MiB or more: (map bytes, rise)
    rises = [(size, rss - before.get(key, [0, 0])[1]) for key, (size, rss) in resident_maps().items()]
    print(json.dumps(sorted((r for r in rises if r[1] >= 1 << 20), key=lambda r: -r[1])))
print(json.dumps([status("VmHWM") - base - (status("RssFile") - code), min(seconds[1:] or seconds)]))
"""
ARENA_STRATEGIES = {"kNextPowerOfTwo": 0, "kSameAsRequested": 1}  # OrtArenaCfg's arena_extend_strategy


def runs_in_arena(model_path: str | os.PathLike, limit: int, strategy: str = "kNextPowerOfTwo",
                  threads: int = 1, max_dead_bytes: int = -1) -> bool:
    """Whether one run of the graph succeeds in onnxruntime's CPU arena limited to `limit` bytes (its BFC arena,
    the one CUDA has too), in a fresh process; False when the arena refuses a request. `max_dead_bytes`: the
    arena's max_dead_bytes_per_chunk (-1: onnxruntime's default, 128 MiB)."""
    proc = subprocess.run([sys.executable, "-c", ARENA_CHILD, str(model_path), str(int(limit)),
                           str(ARENA_STRATEGIES[strategy]), str(threads), str(max_dead_bytes), "1"],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 3):
        raise RuntimeError(f"running {Path(model_path).name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.returncode == 0


def resident_in_arena(model_path: str | os.PathLike, strategy: str = "kNextPowerOfTwo", threads: int = 1,
                      max_dead_bytes: int = -1, runs: int = 3, maps: bool = False):
    """The bytes `runs` runs of the graph add to the resident set in onnxruntime's CPU arena without a limit, in
    a fresh process, and the fastest run's seconds after the first; with `maps`, also (map bytes, resident bytes
    it gained) for each of the process's maps that gained 1 MiB or more (/proc/self/smaps), the most first."""
    proc = subprocess.run([sys.executable, "-c", ARENA_CHILD, str(model_path), "0", str(ARENA_STRATEGIES[strategy]),
                           str(threads), str(max_dead_bytes), str(runs), *(["maps"] if maps else [])],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"running {Path(model_path).name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    lines = proc.stdout.strip().splitlines()
    held, seconds = json.loads(lines[-1])
    return (held, seconds, [tuple(m) for m in json.loads(lines[-2])]) if maps else (held, seconds)
