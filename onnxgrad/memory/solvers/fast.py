"""The fast solver: a Pareto front of plans from the block DP, segment schemes and a local search.

The search does not depend on the budget, and it is bounded by a work count rather than a clock, so the same
problem gives the same front on every call and every machine, and along one front the cost of the cheapest plan
that fits never rises when the budget grows (which schedules get pruned may depend on a budget: see below). The
block DP (`dp.py`) gives the multi-level schemes (revolve on chains); segment schemes at the narrow points (Chen
et al.'s sqrt(n) and two-level ones) and MXNet-like partial holds come next; a local search (greedy repair to a
budget, greedy descent, pairs of changes, seeded perturbations) then improves the front at a grid of budgets
while work is left. On request (`prune_work`), `prune` then takes out
of each schedule on the front the recomputations that a copy made before can serve, held longer, within the
schedule's own peak: a value held, recomputed, then held again, which no staged plan says. `mirror --budget` asks
for it (`budget.PRUNE_WORK_PER_OP`), for the schedules under its budget, the closest first (`prune_below`): the
work goes where the answer is, not to the long schedules at the least peak. With `anneal_work` too, the
cheapest schedule under that budget is last annealed (`anneal.py`): copies put in, taken out, moved and reordered.
"""
from __future__ import annotations

import math
import random

import numpy as np

from . import dp
from .anneal import anneal
from .front import Candidate, Front, OutOfWork, Pool, pareto
from .problem import DROP, HOLD, REUSE, Problem, build_schedule, floor, plan_entry, plan_of_classes, prune


def segment_plan(problem: Problem, outer: int | None, inner: int | None, held_tail: float = 0.0
                  ) -> tuple[int, ...]:
    """The plan of a segmented scheme along the forward region: HOLD at every `outer`-th cut, REUSE at every
    `inner`-th cut between them (REUSE everywhere when `inner` is None: Chen's scheme), DROP elsewhere. Cuts
    are placed where few bytes cross from one side of the forward region to the other. The last segment is held
    outright (recomputing it would cost its own size in memory anyway), and so is the last `held_tail` fraction
    of the cuts: for budgets between Chen's and store-all, the top of the network is cheaper to hold than to
    recompute. `outer` None: no checkpoint is held at all, every value is recomputed from the graph's inputs
    (for budgets under which nothing may stay alive across the forward's widest op)."""
    cuts = problem.cuts[0]
    movable = problem.arrays.movable
    classes = np.where(movable, REUSE if inner is None else DROP, HOLD)
    count = len(cuts)
    if count == 0:
        return plan_of_classes(problem, classes)
    tail = cuts[max(0, min(count - outer, int(count * (1 - held_tail))))] if outer else problem.n
    # what crosses every inner-th cut is reused, every outer-th held (a cut that is both is held)
    values = problem.cut_values
    if inner is not None:
        reused = values[inner - 1::inner].ravel()
        classes[reused[reused >= 0]] = np.maximum(classes[reused[reused >= 0]], REUSE)
    if outer:
        held = values[outer - 1::outer].ravel()
        classes[held[held >= 0]] = HOLD
    top = movable.copy()
    top[:tail] = False
    classes[top if inner is None else top & (classes == REUSE)] = HOLD
    return plan_of_classes(problem, classes)


def _structured(problem: Problem, pool: Pool) -> None:
    """Evaluate segmented schemes over a geometric range of segment lengths: first nothing held and short
    segments reused (the least peaks, which `prune` can make cheap), then one level (Chen's), then two (outer
    checkpoints held, inner ones reused, the rest dropped), inner segments short enough that their repeated
    recomputation stays within a few forward passes. They are evaluated whatever the work limit: on a graph of
    long schedules a limit would end in here, before the schemes of least peak."""
    pool.evaluate(plan_of_classes(problem, [REUSE] * problem.n))
    count = len(problem.cuts[0])
    if count == 0:
        return
    steps = 32
    lengths = sorted({max(1, round(count ** (e / steps))) for e in range(steps + 1)})
    # from Chen's sqrt(n) outwards
    middle = math.sqrt(count)
    by_distance = sorted(lengths, key=lambda k: abs(math.log(k / middle)))
    # nothing held, short segments reused: the least peaks
    for inner in by_distance:
        if inner <= 32:
            pool.evaluate(segment_plan(problem, None, inner))
    for held_tail in (0.0, 0.5):
        for outer in by_distance:
            pool.evaluate(segment_plan(problem, outer, None, held_tail))
    for outer in by_distance:
        for inner in sorted({max(2, round(outer ** f)) for f in (0.34, 0.5, 0.67)}):
            if inner < outer and inner <= 32:
                pool.evaluate(segment_plan(problem, outer, inner))
    for held_tail in (0.25, 0.75, 0.125, 0.375, 0.625, 0.875):
        for outer in by_distance:
            pool.evaluate(segment_plan(problem, outer, None, held_tail))


def _local_search(problem: Problem, pool: Pool, grid: list[int], pairs: bool) -> None:
    """For each budget of the grid: from the cheapest plan known to fit (else the last one), change entries
    greedily until the peak fits (the change that removes the most bytes over the budget, summed over the
    steps, per unit of cost); and, apart, from the plan of least peak, change entries greedily (the most cost
    saved per byte of peak added) while the peak fits. Both then take every single change, and with `pairs`
    every pair of changes, that lowers the cost and still fits. Every plan met goes into the pool."""
    state = plan_of_classes(problem, [HOLD] * problem.n)
    for budget in grid:
        fitting = [(c, k) for k, (p, c) in pool.seen.items() if p <= budget]
        starts = []
        if fitting:
            state = min(fitting)[1]
        descended = _descend(pool, state, budget)
        least = min(pool.seen.items(), key=lambda e: (e[1][0], e[1][1]))
        if descended is None and least[0] != state:
            descended = _descend(pool, least[0], budget)
        if descended is not None:
            state = descended
            starts.append(descended)
        least = min(pool.seen.items(), key=lambda e: (e[1][0], e[1][1]))
        if least[1][0] <= budget:
            starts.append(_ascend(pool, least[0], budget))
        for start in starts:
            _improve(pool, start, budget, pairs)


def _lower(pool: Pool, low: int) -> None:
    """Lower the least peak known, one byte at a time: repair the plan of least peak to fit one byte under it
    and improve what fits, until a repair fails or the peak reaches `low`."""
    while True:
        least = pool.least_peak()
        budget = pool.seen[least][0] - 1
        if budget < low:
            return
        repaired = _descend(pool, least, budget)
        if repaired is None:
            return
        _improve(pool, repaired, budget, pairs=False)


PERTURBATION_ROUNDS = 4


def _perturbed_search(problem: Problem, pool: Pool) -> None:
    """Iterated local search: from each point of the front, change a few entries at random (seeded, so the
    front stays the same on every call), then repair to the point's peak and improve; repeated while that finds
    cheaper plans, up to PERTURBATION_ROUNDS rounds."""
    rng = random.Random(0)
    for _ in range(PERTURBATION_ROUNDS):
        before = [(c.peak, c.cost) for c in pool.candidates()]
        for point in pool.candidates():
            options = _options(problem, point.plan)
            if not options:
                return
            state = point.plan
            for _ in range(min(3, len(options))):
                i, entries = rng.choice(options)
                state = state[:i] + (rng.choice(entries),) + state[i + 1:]
            repaired = _descend(pool, state, point.peak)
            if repaired is not None:
                _improve(pool, repaired, point.peak, pairs=False)
        if [(c.peak, c.cost) for c in pool.candidates()] == before:
            return


def _options(problem: Problem, state: tuple[int, ...] | None = None) -> list[tuple[int, list[int]]]:
    """For each movable op, the plan entries worth trying: horizons at each of its readers, at each stage that
    reads it in `state`'s schedule, at the end of the forward region and at the end, each with reuse from the
    start or never; and the current horizon with reuse from each of those stages."""
    n, last_forward = problem.n, problem.forward_end - 1
    demands: list[list[int]] = [[] for _ in range(n)]
    if state is not None:
        build_schedule(problem, state, demands)
    options = []
    for i in range(n):
        if not problem.movable[i]:
            continue
        horizons = sorted({u for u in problem.users[i]} | {last_forward} | set(demands[i]))
        entries = {plan_entry(n, h, r) for h in horizons if h < n for r in (0, n)}
        current = state[i] // (n + 1) if state is not None else n
        if current < n:
            entries |= {plan_entry(n, current, r) for r in demands[i]}
        entries.add(plan_entry(n, n, 0))
        options.append((i, sorted(entries)))
    return options


def _changes(state: tuple[int, ...], options: list[tuple[int, list[int]]]):
    for i, entries in options:
        for e in entries:
            if e != state[i]:
                yield state[:i] + (e,) + state[i + 1:]


def _descend(pool: Pool, state: tuple[int, ...], budget: int) -> tuple[int, ...] | None:
    peak, cost, excess = pool.scored(state, budget)
    while peak > budget:
        best = None
        for trial in _changes(state, _options(pool.problem, state)):
            p, c, e = pool.scored(trial, budget)
            if e >= excess:
                continue
            score = (excess - e) / (max(c - cost, 0.0) + 1e-9 * (1 + cost))
            if best is None or score > best[0]:
                best = (score, trial, p, c, e)
        if best is None:
            return None
        _, state, peak, cost, excess = best
    return state


def _ascend(pool: Pool, state: tuple[int, ...], budget: int) -> tuple[int, ...]:
    peak, cost = pool.evaluate(state)
    while True:
        best = None
        for trial in _changes(state, _options(pool.problem, state)):
            p, c = pool.evaluate(trial)
            if p > budget or c >= cost - 1e-12:
                continue
            score = (cost - c) / (max(p - peak, 0) + 1e-3)
            if best is None or score > best[0]:
                best = (score, trial, p, c)
        if best is None:
            return state
        _, state, peak, cost = best


def _improve(pool: Pool, state: tuple[int, ...], budget: int, pairs: bool) -> None:
    peak, cost = pool.evaluate(state)
    while True:
        best = None
        for trial in _changes(state, _options(pool.problem, state)):
            p, c = pool.evaluate(trial)
            if p <= budget and c < cost - 1e-12 and (best is None or c < best[2]):
                best = (trial, p, c)
        if best is None and pairs:
            best = _pair_move(pool, state, cost, budget)
        if best is None:
            return
        state, peak, cost = best


def _pair_move(pool: Pool, state: tuple[int, ...], cost: float, budget: int
               ) -> tuple[tuple[int, ...], int, float] | None:
    """The best change of two entries at once that lowers the cost and still fits: one change that saves cost
    but does not fit alone, and a second one that makes it fit."""
    best = None
    options = _options(pool.problem, state)
    for raised in _changes(state, options):
        p, c = pool.evaluate(raised)
        if c >= cost - 1e-12 or p <= budget:
            continue
        for trial in _changes(raised, options):
            p2, c2 = pool.evaluate(trial)
            if p2 <= budget and c2 < cost - 1e-12 and (best is None or c2 < best[2]):
                best = (trial, p2, c2)
    return best


LOCAL_SEARCH_OPS = 400  # problems with at most this many movable ops also get the local search
DEFAULT_WORK = 400_000  # schedule steps the local search may build and simulate (after the DP and segment schemes)


def fast_front(problem: Problem, work: int = DEFAULT_WORK, grid_points: int = 12, prune_work: int = 0,
               prune_below: int | None = None, anneal_work: int = 0) -> Front:
    """The front of every plan the fast solver evaluates: the DP's plans and the segment schemes, always, then
    the local search within `work` schedule steps; with `prune_work`, its schedules then pruned (`prune`) within
    that many steps more: those under `prune_below` (a budget), the closest to it first, or, without one, all of
    them from the least peak up; with `anneal_work` and `prune_below`, the cheapest schedule under that budget
    then annealed (`anneal`) within that many steps more."""
    small = sum(problem.movable) <= LOCAL_SEARCH_OPS
    pool = Pool(problem, 10**12, keep_profiles=small)
    pool.source = "store-all"
    pool.evaluate(plan_of_classes(problem, [HOLD] * problem.n))
    pool.source = "dp"
    for plan in dp.plans(problem):
        pool.evaluate(plan)
    pool.source = "segments"
    _structured(problem, pool)
    pool.work_limit = pool.work + work
    try:
        if small:
            pool.source = "local search"
            low = max(floor(problem), 1)
            top = max(p for p, _ in pool.seen.values())
            grid = sorted({int(low + (top - low) * j / grid_points) for j in range(grid_points)})
            # half the work walks the grid down from the plain peak (at each budget, a climb from the least peak
            # traces the front's low end); the rest walks it up from the floor, each budget starting from the
            # cheapest plan that fit the one below (the middle of the front); then the least peak is lowered
            with pool.share(0.5):
                _local_search(problem, pool, grid[::-1], pairs=False)
            _local_search(problem, pool, grid, pairs=False)
            _lower(pool, low)
            for pairs in (False, True):
                grid = sorted({c.peak - 1 for c in pool.candidates() if c.peak - 1 >= low}, reverse=True)
                _local_search(problem, pool, grid, pairs)
            _perturbed_search(problem, pool)
    except OutOfWork:
        pass
    points = staged = pool.candidates()
    if small and prune_work > 0:
        if prune_below is None:
            order = points
        else:
            order = sorted((c for c in points if c.peak <= prune_below), key=lambda c: (-c.peak, c.cost))
        points = pareto(points + _pruned(problem, order, prune_work))
    if small and anneal_work > 0 and prune_below is not None:
        points = pareto(points + _annealed(problem, points, prune_below, anneal_work))
    return Front(problem, points, "fast", pool.evaluations, staged)


def _annealed(problem: Problem, points: list[Candidate], budget: int, work: int) -> list[Candidate]:
    """The cheapest schedule of `points` under `budget`, its recomputations moved (`anneal`) within `work`
    steps, when that makes it cheaper."""
    fits = [c for c in points if c.peak <= budget]
    if not fits:
        return []
    c = min(fits, key=lambda c: c.cost)
    schedule = list(c.schedule) if c.schedule is not None else build_schedule(problem, c.plan)
    if len(schedule) == problem.n:
        return []  # nothing recomputed: nothing to move
    moved, peak, cost, _ = anneal(problem, schedule, budget, work)
    if cost < c.cost - 1e-9:
        return [Candidate(peak, cost, c.plan, c.source + ", annealed", tuple(moved))]
    return []


def _pruned(problem: Problem, points: list[Candidate], work: int) -> list[Candidate]:
    """The schedules of `points` with the recomputations they can do without taken out (`prune`), each within its
    own peak, in the order given while `work` lasts."""
    out = []
    for c in points:
        if work <= 0:
            break
        schedule = build_schedule(problem, c.plan)
        if len(schedule) == problem.n:
            continue  # nothing recomputed
        kept, peak, cost, steps = prune(problem, schedule, c.peak, work)
        work -= steps
        if cost < c.cost - 1e-9:
            out.append(Candidate(peak, cost, c.plan, c.source + ", pruned", tuple(kept)))
    return out
