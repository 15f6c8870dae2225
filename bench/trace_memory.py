"""Where onnxruntime's memory parts from the simulation: the bytes alive while each node runs, measured.

    .venv/bin/python bench/trace_memory.py MODEL [--threads 2] [--over 3] [--keep DIR] [--arena]

The graph runs three times in a child process with the allocator onnxgrad's budgeted sessions use (the CPU arena
off, glibc's mmap threshold fixed at 64 KiB, `runtime.follow_live_bytes`), so every tensor of 64 KiB or more is
an mmap of its own and is unmapped when onnxruntime frees it. The child runs under `strace -e mmap,munmap`, and
its third run under onnxruntime's profiler. Lining the two up gives, for each node in the order onnxruntime ran
it, the largest number of mapped bytes while it ran, over those mapped before the run. Printed:
- the measured and simulated dynamic peaks (`memory.simulate`, which assumes the file's order);
- the nodes onnxruntime created (not in the file), with their place in its run order: PRIORITY_BASED numbers
  them after every node of the file, so each runs only when no node of the file is ready;
- every node where measured minus simulated rises or falls by more than `--over` MiB against the node before:
  where the two part, and what ran there.
Nodes onnxruntime runs in place (activations, `bench_inplace.py`) show as measured below simulated. Small
nodes that read no large value may run early; their simulated figure belongs to their place in the file.
With `--arena`, the least limit of onnxruntime's arena as `memory.arena` emulates it, for the third run's own
maps and for the simulator's allocations: where the two part, the simulator's allocations differ from
onnxruntime's (the emulation itself follows the arena: bench/bench_arena.py). The maps a kernel makes from malloc
(ScatterElements' copy of its indices: `simulate.OutsideAllocator`) are found by their node and size, and left
out of both, as the arena never serves them; the figure beside is what they add.
Needs strace (Linux).
"""
from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, sys, time
import onnx, onnxruntime as ort
from onnxgrad import runtime
from onnxgrad.protos import random_feeds
path, prefix, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = onnx.load(path)
runtime.follow_live_bytes()
runtime.split_every_chunk = lambda so: None  # a plan made for the arena runs with the arena off here too
so, extra = runtime.session_options(model, threads)
so.enable_cpu_mem_arena = False
so.enable_mem_pattern = False
so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
so.enable_profiling = True
so.profile_file_prefix = prefix
feeds = random_feeds(model, {}, 0, {t.name for t in model.graph.initializer})
del model
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"], **extra)
sess.run(None, feeds)
sess.run(None, feeds)
start = time.time()
sess.run(None, feeds)
end = time.time()
print(json.dumps({"start": start, "end": end, "profile": sess.end_profiling()}))
"""
LINE = re.compile(r"^(\d+)\s+([\d.]+)\s+(.*)$")
RESUMED = re.compile(r"<\.\.\. \w+ resumed>(.*)")


def maps(strace: Path):
    """(time, address, bytes) for each anonymous read-write map of 64 KiB or more, and (time, address, 0) for the
    unmap of one, in the log's order."""
    held: set[int] = set()
    pending: dict[str, str] = {}
    for line in strace.read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        pid, t, call = m.group(1), float(m.group(2)), m.group(3)
        if call.endswith("<unfinished ...>"):
            pending[pid] = call[: -len("<unfinished ...>")]
            continue
        resumed = RESUMED.match(call)
        if resumed:
            call = pending.pop(pid, "") + resumed.group(1)
        if call.startswith("mmap(") and "MAP_ANONYMOUS" in call and "PROT_READ|PROT_WRITE" in call:
            size, result = int(call.split(",")[1]), call.rsplit("=", 1)[1].strip()
            if result.startswith("0x") and size >= 65536:
                held.add(int(result, 16))
                yield t, int(result, 16), size
        elif call.startswith("munmap("):
            address = int(call[len("munmap("):].split(",")[0], 16)
            if address in held:
                held.discard(address)
                yield t, address, 0


def mapped_bytes(strace: Path) -> tuple[list[float], list[int]]:
    """(times, bytes mapped after each event) of the anonymous read-write maps of 64 KiB or more."""
    live: dict[int, int] = {}
    times, totals, total = [], [], 0
    for t, address, size in maps(strace):
        if size:
            live[address] = size
        total += size or -live.pop(address)
        times.append(t)
        totals.append(total)
    return times, totals


def allocations_traced(strace: Path, start: float, end: float,
                       outside: list[tuple[float, float, int]] = ()) -> list[tuple[object, int]]:
    """The maps and unmaps of 64 KiB or more between `start` and `end`, as `memory.simulate.allocations` gives
    events: (address, bytes) for a map, less glibc's page of header and rounding, and (address, 0) for its unmap
    (of a map made in that time). A map made between a and b of about n bytes, for (a, b, n) in `outside` (a
    kernel's buffer from malloc, `simulate.OutsideAllocator`), is keyed (simulate.OUTSIDE, address), as the
    simulator keys it, so that the arena's emulation leaves it out as it does the simulator's."""
    from onnxgrad.memory.simulate import OUTSIDE
    made: dict[int, object] = {}
    events = []
    for t, address, size in maps(strace):
        if not start <= t <= end:
            continue
        if size:
            key = address
            if any(a <= t <= b and abs(size - 4096 - n) < 8192 for a, b, n in outside):
                key = (OUTSIDE, address)
            made[address] = key
            events.append((key, size - 4096))
        elif address in made:
            events.append((made.pop(address), 0))
    return events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--over", type=float, default=3.0, help="MiB: print where measured - simulated moves this much")
    ap.add_argument("--keep", default=None, help="keep the strace log and the profile here")
    ap.add_argument("--arena", action="store_true",
                    help="also the least arena (memory.arena, every chunk split and onnxruntime's default rule) "
                         "for the third run's own allocations, against the same for the simulator's")
    args = ap.parse_args()
    if not shutil.which("strace"):
        sys.exit("trace_memory: strace is not installed")
    from onnxgrad.api import load_graph
    from onnxgrad.memory import simulate

    work = Path(args.keep or tempfile.mkdtemp(prefix="trace_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "mmap.strace"
    p = subprocess.run(["strace", "-f", "-ttt", "-e", "trace=mmap,munmap", "-o", str(log), sys.executable, "-c",
                        CHILD, args.model, str(work / "profile"), str(args.threads)],
                       capture_output=True, text=True, cwd=ROOT)
    if p.returncode:
        sys.exit(f"trace_memory: the run failed: {p.stderr.strip().splitlines()[-1:]}")
    run = json.loads(p.stdout.strip().splitlines()[-1])
    times, totals = mapped_bytes(log)

    def mapped_during(a: float, b: float) -> int:
        i = max(bisect.bisect_right(times, a) - 1, 0)
        j = max(bisect.bisect_right(times, b), i + 1)
        return max(totals[i:j])

    before = totals[max(bisect.bisect_right(times, run["start"]) - 1, 0)]
    events = json.loads(Path(run["profile"]).read_text())
    last_run = [e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"][-1]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                    and e["ts"] >= last_run["ts"]), key=lambda e: e["ts"])
    offset = run["start"] - last_run["ts"] * 1e-6

    graph = load_graph(args.model)
    timeline = simulate.simulate(graph)
    simulated = {n.name: d for n, d in zip(graph.nodes, timeline.during)}
    mib = 2 ** 20
    peak = mapped_during(run["start"], run["end"]) - before
    print(f"{Path(args.model).name}: measured dynamic peak {peak / mib:.1f} MiB, simulated "
          f"{timeline.dynamic_peak / mib:.1f} MiB (at {timeline.peak_node}); {len(nodes)} nodes ran")
    if args.arena:
        from onnxgrad.memory.arena import MAX_DEAD_BYTES, SPLIT_ALWAYS, least_limit, outside_peak
        nbytes = simulate.sizes(graph)
        by_name = {n.name: n for n in graph.nodes}
        outside = []  # (start, end, bytes) of each kernel buffer from malloc, while its node ran
        for e in nodes:
            node = by_name.get(e["name"][: -len("_kernel_time")])
            scratch = simulate.scratch_bytes(node, nbytes) if node is not None else 0
            if isinstance(scratch, simulate.OutsideAllocator):
                a = offset + e["ts"] * 1e-6
                outside += [(a, a + e["dur"] * 1e-6, part) for part in scratch.parts]
        traced = allocations_traced(log, run["start"], run["end"], outside)
        simulated_events = simulate.allocations(graph, nbytes)
        for name, dead in (("every chunk split", SPLIT_ALWAYS), ("onnxruntime's default rule", MAX_DEAD_BYTES)):
            print(f"least arena, {name}: {least_limit(traced, max_dead_bytes=dead) / mib:.1f} MiB for the traced "
                  f"allocations of 64 KiB or more, {least_limit(simulated_events, max_dead_bytes=dead) / mib:.1f} "
                  f"MiB for the simulator's (memory.simulate.allocations)")
        print(f"beside the arena (kernels' buffers from malloc): {outside_peak(traced) / mib:.2f} MiB traced, "
              f"{outside_peak(simulated_events) / mib:.2f} MiB simulated")
    rows = []
    for k, e in enumerate(nodes):
        name = e["name"][: -len("_kernel_time")]
        a = offset + e["ts"] * 1e-6
        measured = (mapped_during(a, a + e["dur"] * 1e-6) - before) / mib
        sim = simulated.get(name)
        rows.append((k, name, e["args"].get("op_name", "?"), measured, None if sim is None else sim / mib))
    created = [r for r in rows if r[4] is None]
    print(f"\nnodes onnxruntime created ({len(created)}): run order, op, name, measured MiB")
    for k, name, op, measured, _ in created:
        print(f"  {k:6d} {op:16s} {name[-90:]}  {measured:.1f}")
    print(f"\nwhere measured - simulated moves by more than {args.over} MiB: run order, op, name, measured, simulated")
    previous = 0.0
    for k, name, op, measured, sim in rows:
        if sim is None:
            continue
        if abs((measured - sim) - previous) > args.over:
            print(f"  {k:6d} {op:16s} {name[-90:]}  {measured:.1f} {sim:.1f} ({measured - sim:+.1f})")
        previous = measured - sim


if __name__ == "__main__":
    main()
