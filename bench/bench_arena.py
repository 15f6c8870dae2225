"""How much memory onnxruntime's arena needs to run a graph, against the live bytes the simulator counts.

    .venv/bin/python bench/bench_arena.py GRAPH [GRAPH ...] [--strategies same,pow2,split] [--threads 2]
        [--tolerance 0.01] [--no-run]   # only the emulation (memory.arena), no onnxruntime
        [--resident [--maps]]   # the resident set of a step in an arena without a limit (and the step's
                                # seconds), instead of the least limit; --maps: which maps gained it

On CUDA, onnxgrad's sessions give a graph that records a budget onnxruntime's BFC arena with
`arena_extend_strategy=kNextPowerOfTwo` and `gpu_mem_limit` = the budget (`runtime.provider_options`); on the CPU,
a plan made for the arena gets an arena that splits every chunk (`runtime.split_every_chunk`). The CPU provider
has the same arena as CUDA (the same code, configured by an `OrtArenaCfg`), so this measures on the CPU what an
arena needs: for each graph and extend strategy, the least `max_mem` with which one training step runs, found by
bisection, each try in a fresh process. The CPU arena holds no initializers, so the figure is the dynamic part,
and the table sets it beside the simulated dynamic peak (onnxgrad's simulator: what the exact allocator setting
measures, within 1-2% on these graphs) and, for a graph written by `mirror --budget`, the budget less the static
bytes. A ratio over 1 is the arena's own overhead: rounding, and free chunks too small or in the wrong region
for the next request. Kernels differ between the providers, so the CUDA figure will differ somewhat; the arena's
behaviour does not. Beside each measurement, `memory.arena.least_arena`'s emulation of the arena on the same
schedule.

Strategies: same (kSameAsRequested: each new region as large as the request), pow2 (kNextPowerOfTwo, onnxruntime's
default: regions doubling in size), both splitting chunks by onnxruntime's default rule; split (kNextPowerOfTwo,
every chunk split to the request: the arena onnxgrad's CPU sessions give a plan made for it).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onnxgrad.api import load_graph  # noqa: E402
from onnxgrad.memory.arena import (MAX_DEAD_BYTES, NEXT_POWER_OF_TWO, SAME_AS_REQUESTED, SPLIT_ALWAYS,  # noqa: E402
                                   least_arena)
from onnxgrad.memory.measure import resident_in_arena, runs_in_arena  # noqa: E402
from onnxgrad.memory.simulate import simulate  # noqa: E402
from onnxgrad.contract import BUDGET_KEY  # noqa: E402

# name -> (extend strategy, max_dead_bytes_per_chunk); split: onnxgrad's CPU arena for a plan made for it
STRATEGIES = {"pow2": (NEXT_POWER_OF_TWO, MAX_DEAD_BYTES), "same": (SAME_AS_REQUESTED, MAX_DEAD_BYTES),
              "split": (NEXT_POWER_OF_TWO, SPLIT_ALWAYS)}
MIB = 2 ** 20


def _ort_dead_bytes(dead: int) -> int:
    """The emulation's max_dead_bytes_per_chunk as `OrtArenaCfg` takes it (-1: onnxruntime's default)."""
    return -1 if dead == MAX_DEAD_BYTES else dead


def measured_arena(path: str, start: int, arena: tuple[str, int], threads: int, tolerance: float) -> int:
    """The least max_mem (bytes) with which one run of `path` succeeds, within `tolerance` of itself."""
    strategy, dead = arena[0], _ort_dead_bytes(arena[1])
    low, high = start // 2, start
    while not runs_in_arena(path, high, strategy, threads, dead):
        low, high = high, high * 2
    while high - low > tolerance * high:
        middle = (low + high) // 2
        if runs_in_arena(path, middle, strategy, threads, dead):
            high = middle
        else:
            low = middle
    return high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("graphs", nargs="+")
    parser.add_argument("--strategies", default="same,pow2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.01, help="bisection's relative precision")
    parser.add_argument("--no-run", action="store_true", help="only the emulation, no onnxruntime")
    parser.add_argument("--resident", action="store_true",
                        help="instead of the least limit: the resident set one step adds in an arena without a "
                             "limit (as a session runs), beside the emulated least limit")
    parser.add_argument("--maps", action="store_true",
                        help="with --resident: also the process's maps that gained 1 MiB or more of resident "
                             "bytes (map MiB: MiB gained), to tell the arena's regions from memory outside it")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    what = ("resident MiB without a limit (emulated least limit), / simulated, / budget, step s" if args.resident
            else "least arena MiB measured (emulated), / simulated, / budget")
    print("| graph | budget - static MiB | simulated dynamic peak MiB | "
          + " | ".join(f"{s}: {what}" for s in strategies) + " |")
    print("|---|---|---|" + "---|" * len(strategies))
    for path in args.graphs:
        graph = load_graph(path)
        timeline = simulate(graph)
        dynamic = timeline.peak - timeline.static
        budget = graph.metadata.get(BUDGET_KEY)
        room = int(budget) - timeline.static if budget and budget.isdigit() else None
        emulated = {name: least_arena(graph, STRATEGIES[name][0], max_dead_bytes=STRATEGIES[name][1])
                    for name in strategies}
        del graph
        cells = [Path(path).name, f"{room / MIB:.1f}" if room else "-", f"{dynamic / MIB:.1f}"]
        for name in strategies:
            strategy, dead = STRATEGIES[name]
            seconds = None
            if args.resident:
                need, seconds, *maps = resident_in_arena(path, strategy, args.threads, _ort_dead_bytes(dead),
                                                         maps=args.maps)
                if maps:
                    print(f"{Path(path).name} {name}: maps that gained resident bytes (map MiB: MiB gained): "
                          + ", ".join(f"{size / MIB:.1f}: {rise / MIB:.1f}" for size, rise in maps[0]), flush=True)
            elif args.no_run:
                need = emulated[name]
            else:
                need = measured_arena(path, dynamic, STRATEGIES[name], args.threads, args.tolerance)
            cells.append(f"{need / MIB:.1f} ({emulated[name] / MIB:.1f}), {need / dynamic:.2f}, "
                         + (f"{need / room:.2f}" if room else "-") + (f", {seconds:.2f}" if seconds else ""))
        print("| " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
