"""Step time of several graphs against the first, timed in turn so that the machine's drift falls on all alike.

    .venv/bin/python bench/time_steps.py PLAIN.onnx MIRRORED.onnx [MORE.onnx ...] [--rounds 2] [--runs 4]
        [--allocators exact,arena] [--huge-pages off,on]

Each round measures every graph once, in the order given, each in a fresh process (`memory.measure`: 2 threads,
the optimization level onnxgrad's sessions give the graph) for `--runs` runs, of which the first is dropped (it
warms the session), once per allocator of `--allocators` (default: exact, onnxgrad's setting for a budgeted
graph; arena: onnxruntime's CPU arena, a default session's) and, with `--huge-pages`, once per setting of glibc's
huge-page tunable (off: GLIBC_TUNABLES=glibc.malloc.hugetlb=0; on: =1, as `onnxgrad run`, `train` and `check`
start where it changes something, `hugepages.huge_pages_env`; without the option, as the environment has it).
Printed per graph, allocator and setting: the median of its timed runs over all rounds, its
ratio to the first row's, and the peak (MiB above the session's baseline) of each round.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from onnxgrad.memory.measure import measure  # noqa: E402

TUNABLE = {"off": "glibc.malloc.hugetlb=0", "on": "glibc.malloc.hugetlb=1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("graphs", nargs="+")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--allocators", default="exact")
    parser.add_argument("--huge-pages", default="", help="off,on: measure each graph with the tunable at each")
    args = parser.parse_args()
    if args.runs < 2:
        parser.error("--runs: at least 2 (the first run of each measurement is dropped)")
    pages = args.huge_pages.split(",") if args.huge_pages else [""]
    if any(p not in ("", *TUNABLE) for p in pages):
        parser.error(f"--huge-pages: off, on or both, not {args.huge_pages!r}")
    rows = [(g, a, p) for g in args.graphs for a in args.allocators.split(",") for p in pages]
    times: dict[tuple[str, str, str], list[float]] = {row: [] for row in rows}
    peaks: dict[tuple[str, str, str], list[int]] = {row: [] for row in rows}
    saved = os.environ.get("GLIBC_TUNABLES")  # `memory.measure` passes it on to its child
    try:
        for _ in range(args.rounds):
            for row in rows:
                g, a, p = row
                _set_tunables(TUNABLE[p] if p else saved)
                m = measure(g, level="GRAPH", threads=args.threads, runs=args.runs, allocator=a)
                times[row] += m["seconds"][1:]
                peaks[row].append(m["peak_bytes"])
    finally:
        _set_tunables(saved)
    first = statistics.median(times[rows[0]])
    print("| graph | allocator | huge pages | median s | x the first | runs | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        g, a, p = row
        median = statistics.median(times[row])
        print(f"| {os.path.basename(g)} | {a} | {p or 'as set'} | {median:.2f} | {median / first:.2f} | "
              f"{', '.join(f'{t:.2f}' for t in times[row])} | {', '.join(f'{b / 2**20:.0f}' for b in peaks[row])} |")


def _set_tunables(value: str | None) -> None:
    if value is None:
        os.environ.pop("GLIBC_TUNABLES", None)
    else:
        os.environ["GLIBC_TUNABLES"] = value


if __name__ == "__main__":
    main()
