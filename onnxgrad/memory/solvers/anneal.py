"""Moving recomputations one at a time: simulated annealing over where each copy runs, under a budget.

A schedule here is a sequence of runs in which each op's first run stays where it is; its copies may run anywhere
in the backward after it, in any order (a read takes the latest run before the reader, so any such order is a
valid schedule). A staged plan recomputes whole stages, each in index order, and `prune` can only take copies
out; this search also puts copies in, moves them and reorders them. Three moves, drawn at random:

- evict: at the schedule's peak, take a value that is held across it and not read there, and recompute it
  just before its next reader (sometimes with the movable values it reads, so that their copies are not held
  longer instead): the peak falls and the cost rises. Half the evictions also take a copy out elsewhere in the
  same move, so that a schedule at the budget can trade one copy for another;
- remove: take a copy out (its readers read the run before it, held longer). When that run, held longer, breaks
  the budget on the steps that change in no other way, the move is refused before it is simulated, as `prune`
  refuses it (`RemovalCheck.removal`);
- shift: move a copy up to SHIFT positions earlier or later, past first runs or other copies.

A move whose schedule goes over the budget is refused; one that costs more is taken with a probability that falls
as the search cools, so the search can pay for an eviction and then win it back by removals elsewhere. Copies no
read takes leave the schedule after each move. The random stream is seeded and the work counted in schedule
steps, so the same input gives the same schedule; the result is the cheapest schedule met, never worse than the
start.

On four 30-op random DAGs, four budgets each, the fast solver's plans come within 1.10x of CP-SAT's at 15 of the
16 budgets (BENCHMARKS.md, "Fifth round: copies placed one by one").
"""
from __future__ import annotations

import math
import random

import numpy as np

from .problem import PRUNE_CHARGE, Problem, RemovalCheck, first_runs, liveness_trace, trace_peak, trace_read

SHIFT = 6  # the most positions a copy moves in one shift
EVICT_SHARE, REMOVE_SHARE = 0.4, 0.35  # of the moves drawn; the rest are shifts
WITH_INPUTS = 0.5  # share of evictions that recompute the value's movable inputs with it
WITH_REMOVAL = 0.5  # share of evictions that also take a copy out, in the same move
CHAINS = 6  # independent searches from the start, each with its own seed and a share of the work
START_TEMPERATURE = 2.0  # times the mean cost of a movable op: an extra cost of two such ops taken with probability
# 1/e at first
CHECK_CHARGE = PRUNE_CHARGE // 8  # the least work a move refused (or found empty) without a simulation counts


def anneal(problem: Problem, schedule: list[int], budget: int, work: int, seed: int = 0
           ) -> tuple[list[int], int, float, int]:
    """The cheapest schedule met within `budget` by moving `schedule`'s recomputations (see the module
    docstring): CHAINS searches from it, each with its own seed and an equal share of `work` schedule steps
    (each simulation counts at least PRUNE_CHARGE, each move refused unsimulated at least CHECK_CHARGE).
    Returns (schedule, peak, cost, steps counted); the schedule given when nothing cheaper fits."""
    arrays = problem.arrays
    start = _State(problem, np.asarray(schedule, dtype=np.int64))
    best = (start.ops, start.peak, start.cost)
    steps = max(len(start.ops), PRUNE_CHARGE)
    movable_costs = arrays.cost[arrays.movable]
    if best[1] > budget or not len(movable_costs) or not movable_costs.mean() > 0:
        return start.ops.tolist(), best[1], best[2], steps
    temperature = START_TEMPERATURE * float(movable_costs.mean())
    share = (work - steps) // CHAINS
    for chain in range(CHAINS):
        found, used = _chain(problem, start, budget, share, temperature, random.Random(seed * CHAINS + chain))
        steps += used
        if found[2] < best[2] - 1e-9:
            best = found
    return best[0].tolist(), best[1], best[2], steps


class _State:
    """A schedule the search stands on: its trace, cost and peak, where each op first runs, the positions of its
    copies, and (when a move asks) the values it may evict and the removal checks."""

    def __init__(self, problem: Problem, ops: np.ndarray, trace=None, cost: float | None = None):
        self.problem, self.ops = problem, ops
        self.trace = trace if trace is not None else liveness_trace(problem, ops)
        self.cost = cost if cost is not None else (float(np.cumsum(problem.arrays.cost[ops])[-1]) if len(ops)
                                                   else 0.0)
        self.peak = trace_peak(problem, self.trace)
        self.first = first = first_runs(ops)
        self.first_run = np.full(problem.n, len(ops), dtype=np.int64)
        self.first_run[ops[first]] = np.flatnonzero(first)
        self.copies = np.flatnonzero(~first).tolist()
        backward = problem.forward_end
        self.backward_from = int(self.first_run[backward]) if backward < problem.n else len(ops)
        self._evictable: list[tuple[int, int]] | None = None
        self._check: RemovalCheck | None = None

    def evictable(self) -> list[tuple[int, int]]:
        """(value, position of its next reader) for each value held across the peak and not read there, whose
        next reader runs in the backward."""
        if self._evictable is None:
            trace, ops, arrays = self.trace, self.ops, self.problem.arrays
            at = int(np.argmax(trace.during))
            positions = np.arange(len(ops))
            read_here = trace.taken[trace.begin[at]:trace.begin[at] + trace.count[at]]
            held = (positions < at) & (trace.end > at) & arrays.movable[ops] & (arrays.size[ops] > 0)
            held[read_here] = False
            self._evictable = []
            for copy in np.flatnonzero(held).tolist():
                later = trace.reader[(trace.taken == copy) & (trace.reader > at)]
                reader = int(later.min()) if len(later) else -1
                if reader >= self.backward_from:
                    self._evictable.append((int(ops[copy]), reader))
        return self._evictable

    def check(self) -> RemovalCheck:
        if self._check is None:
            self._check = RemovalCheck(self.trace, self.first)
        return self._check


def _chain(problem: Problem, state: _State, budget: int, work: int, start_temperature: float,
           rng: random.Random) -> tuple[tuple[np.ndarray, int, float], int]:
    """One search from `state`, cooling linearly to nothing over `work` steps: the cheapest schedule met under
    `budget` (peak, cost), and the steps counted."""
    cost_of = problem.arrays.cost
    best = (state.ops, state.peak, state.cost)
    steps = 0
    while steps < work:
        temperature = start_temperature * max(1e-3, 1 - steps / work)
        trial, charge = _moved(problem, rng, state, budget)
        if trial is None:
            steps += charge
            continue
        stays, result, counted = trace_read(problem, trial)  # a copy no read takes goes, and any only it read
        trial = trial[stays]
        steps += counted
        peak = trace_peak(problem, result)
        if peak > budget:
            continue
        cost = float(np.cumsum(cost_of[trial])[-1])
        rise = cost - state.cost
        if rise <= 1e-12 or rng.random() < math.exp(-rise / temperature):
            state = _State(problem, trial, result, cost)
            if cost < best[2] - 1e-9:
                best = (trial, peak, cost)
    return best, steps


def _moved(problem: Problem, rng: random.Random, state: _State, budget: int) -> tuple[np.ndarray | None, int]:
    """The schedule with one move drawn, or None and the steps its check counted when the move has nothing to
    act on or is refused before a simulation."""
    ops, draw = state.ops, rng.random()
    if draw < EVICT_SHARE:
        evictable = state.evictable()
        if not evictable:
            return None, CHECK_CHARGE
        value, reader = evictable[rng.randrange(len(evictable))]
        runs = [value]
        if rng.random() < WITH_INPUTS:
            movable = problem.movable
            runs = sorted(i for i in problem.reads[value] if movable[i]) + runs
        trial = np.concatenate((ops[:reader], np.asarray(runs, dtype=np.int64), ops[reader:]))
        if state.copies and rng.random() < WITH_REMOVAL:
            q = state.copies[rng.randrange(len(state.copies))]
            trial = np.delete(trial, q + len(runs) if q >= reader else q)
        return trial, 0
    if not state.copies:
        return None, CHECK_CHARGE
    q = state.copies[rng.randrange(len(state.copies))]
    value = int(ops[q])
    if draw < EVICT_SHARE + REMOVE_SHARE:
        _, scanned = state.check().removal(q, problem.arrays.size, budget)
        if scanned:
            return None, max(scanned, CHECK_CHARGE)
        return np.delete(ops, q), 0
    shift = rng.randint(1, SHIFT) * (1 if rng.random() < 0.5 else -1)
    rest = np.delete(ops, q)
    to = min(len(rest), max(int(state.first_run[value]) + 1, state.backward_from, q + shift))
    if to == q:
        return None, CHECK_CHARGE
    return np.insert(rest, to, value), 0
