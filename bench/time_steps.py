"""Step time of several graphs against the first, timed in turn so that the machine's drift falls on all alike.

    .venv/bin/python bench/time_steps.py PLAIN.onnx MIRRORED.onnx [MORE.onnx ...] [--rounds 2] [--runs 4]
        [--allocators exact,arena]

Each round measures every graph once, in the order given, each in a fresh process (`memory.measure`: 2 threads,
the optimization level onnxgrad's sessions give the graph) for `--runs` runs, of which the first is dropped (it
warms the session), once per allocator of `--allocators` (default: exact, onnxgrad's setting for a budgeted
graph; arena: onnxruntime's CPU arena, a default session's). Printed per graph and allocator: the median of its
timed runs over all rounds and its ratio to the first graph's in the first allocator.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from onnxgrad.memory.measure import measure  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("graphs", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allocators", default="exact")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs: at least 2 (the first run of each measurement is dropped)")
    rows = [(g, a) for g in args.graphs for a in args.allocators.split(",")]
    times: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    for _ in range(args.rounds):
        for g, a in rows:
            times[g, a] += measure(g, level="GRAPH", threads=args.threads, runs=args.runs, allocator=a)["seconds"][1:]
    first = statistics.median(times[rows[0]])
    print("| graph | allocator | median s | x the first | runs |")
    print("|---|---|---|---|---|")
    for g, a in rows:
        median = statistics.median(times[g, a])
        print(f"| {os.path.basename(g)} | {a} | {median:.2f} | {median / first:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in times[g, a])} |")


if __name__ == "__main__":
    main()
