"""Moving recomputations one at a time: simulated annealing over where each copy runs, under a budget.

A schedule here is its first runs (in their order) and, before each, the copies recomputed for it, in index
order. A staged plan recomputes whole stages, and `prune` can only take copies out; this search also puts copies
in and moves them. Three moves, drawn at random:

- evict: at the schedule's peak, take a value that is held across it and not read there, and recompute it
  before its next reader (sometimes with the movable values it reads, so that their copies are not held longer
  instead): the peak falls and the cost rises;
- remove: take a copy out (its readers read the copy before it, held longer);
- shift: move a copy to a stage up to three first runs before or after.

A move whose schedule goes over the budget is refused; one that costs more is taken with a probability that falls
as the search cools, so the search can pay for an eviction and then win it back by removals elsewhere. Copies no
read takes leave the schedule after each move. The random stream is seeded and the work counted in schedule
steps, so the same input gives the same schedule; the result is the cheapest schedule met, never worse than the
start.

On a 30-op random DAG this takes the fast solver's plans from 1.11-1.37x to 1.11-1.16x CP-SAT's best (BENCHMARKS.md,
"Fourth round: annealing where the copies run").
"""
from __future__ import annotations

import math
import random

import numpy as np

from .problem import PRUNE_CHARGE, Problem, liveness_trace

SHIFTS = (-3, -2, -1, 1, 2, 3)  # stages a copy may move in one shift
EVICT_SHARE, REMOVE_SHARE = 0.3, 0.35  # of the moves drawn; the rest are shifts
WITH_INPUTS = 0.5  # share of evictions that recompute the value's movable inputs with it
CHAINS = 3  # independent searches from the start, each with its own seed and a share of the work
START_TEMPERATURE = 1.0  # times the mean cost of a movable op: an extra cost taken with probability 1/e at first


def anneal(problem: Problem, schedule: list[int], budget: int, work: int, seed: int = 0
           ) -> tuple[list[int], int, float, int]:
    """The cheapest schedule met within `budget` by moving `schedule`'s recomputations (see the module
    docstring): CHAINS searches from it, each with its own seed and an equal share of `work` schedule steps
    (each simulation counts at least PRUNE_CHARGE). Returns (schedule, peak, cost, steps counted); the schedule
    given, when nothing cheaper fits or its first runs are not in index order (a stage's copies could not then
    be put in index order)."""
    arrays = problem.arrays
    start = np.asarray(schedule, dtype=np.int64)
    trace = liveness_trace(problem, start)
    best = (start, _peak(problem, trace), float(np.cumsum(arrays.cost[start])[-1]) if len(start) else 0.0)
    steps = max(len(start), PRUNE_CHARGE)
    stages, anchors = _stages(problem, start)
    movable_costs = arrays.cost[arrays.movable]
    if stages is None or best[1] > budget or not len(movable_costs) or not movable_costs.mean() > 0:
        return start.tolist(), best[1], best[2], steps
    temperature = START_TEMPERATURE * float(movable_costs.mean())
    share = (work - steps) // CHAINS
    for chain in range(CHAINS):
        found, used = _chain(problem, (start, trace, best[2]), stages, anchors, budget, share, temperature,
                             random.Random(seed * CHAINS + chain))
        steps += used
        if found[2] < best[2] - 1e-9:
            best = found
    return best[0].tolist(), best[1], best[2], steps


def _chain(problem: Problem, start, stages: list[list[int]], anchors: np.ndarray, budget: int, work: int,
           start_temperature: float, rng: random.Random) -> tuple[tuple[np.ndarray, int, float], int]:
    """One search from `start` (its schedule, trace and cost; `stages` its copies, which no move changes in
    place), cooling linearly to nothing over `work` steps: the cheapest schedule met under `budget` (peak, cost),
    and the steps counted."""
    cost_of = problem.arrays.cost
    ops, trace, cost = start
    best = (ops, _peak(problem, trace), cost)
    first_backward = int(np.searchsorted(anchors, problem.forward_end))
    steps = 0
    while steps < work:
        temperature = start_temperature * max(1e-3, 1 - steps / work)
        trial = _moved(problem, rng, stages, anchors, trace, first_backward)
        if trial is None:
            steps += PRUNE_CHARGE  # a draw that found nothing to move still counts, so the search ends
            continue
        ops = _schedule(trial, anchors)
        while True:  # a copy no read takes goes, and then any copy only it read
            result = liveness_trace(problem, ops)
            steps += max(len(ops), PRUNE_CHARGE)
            if not result.unread.any():
                break
            ops = ops[~result.unread]
        peak = _peak(problem, result)
        if peak > budget:
            continue
        trial_cost = float(np.cumsum(cost_of[ops])[-1])
        rise = trial_cost - cost
        if rise <= 1e-12 or rng.random() < math.exp(-rise / temperature):
            stages, trace, cost = _stages(problem, ops)[0], result, trial_cost
            if cost < best[2] - 1e-9:
                best = (ops, peak, cost)
    return best, steps


def _peak(problem: Problem, trace) -> int:
    return max(int(trace.during.max()), problem.static_bytes) if len(trace.ops) else problem.static_bytes


def _stages(problem: Problem, ops: np.ndarray) -> tuple[list[list[int]] | None, np.ndarray]:
    """The copies recomputed before each first run (one list per first run) and the first runs in order; None
    for the lists when the first runs are not in index order."""
    first = _first_runs(ops)
    anchors = ops[first]
    if len(anchors) != problem.n or (np.diff(anchors) <= 0).any():
        return None, anchors
    stage = _stage_of(first)
    stages: list[list[int]] = [[] for _ in range(len(anchors))]
    for s, op in zip(stage[~first].tolist(), ops[~first].tolist()):
        stages[s].append(op)
    return stages, anchors


def _first_runs(ops: np.ndarray) -> np.ndarray:
    """Per position, whether it is its op's first run."""
    first = np.zeros(len(ops), dtype=bool)
    first[np.unique(ops, return_index=True)[1]] = True
    return first


def _stage_of(first: np.ndarray) -> np.ndarray:
    """Per position, its stage: the index of the first run at or after it (a copy belongs to the next one)."""
    return np.cumsum(first) - 1 + ~first


def _schedule(stages: list[list[int]], anchors: np.ndarray) -> np.ndarray:
    out: list[int] = []
    for copies, anchor in zip(stages, anchors.tolist()):
        if copies:
            out.extend(sorted(set(copies)))
        out.append(anchor)
    return np.asarray(out, dtype=np.int64)


def _moved(problem: Problem, rng: random.Random, stages: list[list[int]], anchors: np.ndarray, trace,
           first_backward: int) -> list[list[int]] | None:
    """`stages` with one move drawn (a copy), or None when the move drawn has nothing to act on."""
    draw = rng.random()
    placed = [(s, op) for s, copies in enumerate(stages) for op in copies]
    if draw >= EVICT_SHARE and not placed:
        return None
    stages = [list(copies) for copies in stages]
    if draw < EVICT_SHARE:
        return _evicted(problem, rng, stages, anchors, trace, first_backward)
    s, op = placed[rng.randrange(len(placed))]
    stages[s].remove(op)
    if draw >= EVICT_SHARE + REMOVE_SHARE:
        # a copy of op may run before any first run after op's own (the first runs are the ops in index order)
        to = s + rng.choice(SHIFTS)
        to = min(len(stages) - 1, max(first_backward, op + 1, to))
        stages[to].append(op)
    return stages


def _evicted(problem: Problem, rng: random.Random, stages: list[list[int]], anchors: np.ndarray, trace,
             first_backward: int) -> list[list[int]] | None:
    """A value held across the peak and not read there, recomputed before its next reader after it."""
    at = int(np.argmax(trace.during))
    ops = trace.ops
    positions = np.arange(len(ops))
    read_here = trace.taken[trace.begin[at]:trace.begin[at] + trace.count[at]]
    held = (positions < at) & (trace.end > at) & problem.arrays.movable[ops] & (problem.arrays.size[ops] > 0)
    held[read_here] = False
    candidates = np.flatnonzero(held)
    if not len(candidates):
        return None
    copy = int(candidates[rng.randrange(len(candidates))])
    later = trace.reader[(trace.taken == copy) & (trace.reader > at)]
    if not len(later):
        return None
    s = int(_stage_of(_first_runs(ops))[int(later.min())])  # the next reader's stage
    if s < first_backward or s >= len(stages):
        return None
    value = int(ops[copy])
    stages[s].append(value)
    if rng.random() < WITH_INPUTS:
        movable = problem.movable
        stages[s].extend(i for i in problem.reads[value] if movable[i])
    return stages
