"""Step time of several graphs against the first, timed in turn so that the machine's drift falls on all alike.

    .venv/bin/python bench/time_steps.py PLAIN.onnx MIRRORED.onnx [MORE.onnx ...] [--rounds 2] [--runs 4]

Each round measures every graph once, in the order given, each in a fresh process (`memory.measure`: onnxgrad's
allocator setting, ORT_ENABLE_ALL, 2 threads) for `--runs` runs, of which the first is dropped (it warms the
session). Printed per graph: the median of its timed runs over all rounds and its ratio to the first graph's.
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
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs: at least 2 (the first run of each measurement is dropped)")
    times: dict[str, list[float]] = {g: [] for g in args.graphs}
    for _ in range(args.rounds):
        for g in args.graphs:
            times[g] += measure(g, level="ALL", threads=args.threads, runs=args.runs)["seconds"][1:]
    first = statistics.median(times[args.graphs[0]])
    print("| graph | median s | x the first | runs |")
    print("|---|---|---|---|")
    for g in args.graphs:
        median = statistics.median(times[g])
        print(f"| {os.path.basename(g)} | {median:.2f} | {median / first:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in times[g])} |")


if __name__ == "__main__":
    main()
