"""The liveness kernel (`profile`) and the staged schedules (`build_schedule`) against plain loops that state
their rules one step at a time, on random problems and random valid schedules with recomputations."""
from __future__ import annotations

import dataclasses
import random

import pytest

from onnxgrad.memory.solvers import build_schedule
from onnxgrad.memory.solvers import dp
from onnxgrad.memory.solvers.fast import segment_plan
from onnxgrad.memory.solvers.problem import measure, profile
from solver_problems import chain, random_training_dag


def plain_profile(problem, schedule):
    """(peak, peak_step, live_after, cost, during), one position at a time."""
    length = len(schedule)
    latest = [-1] * problem.n
    end = [-1] * length
    taken = []  # per position, the occurrence it read of each op
    through = problem.through or [[(i, -1) for i in r] for r in problem.reads]
    for p, op in enumerate(schedule):
        taken.append({i: latest[i] for i in problem.reads[op]})
        for i, view in through[op]:
            # a read through a view holds the occurrence the view's latest run read
            q = taken[latest[view]][i] if view >= 0 else latest[i]
            end[q] = max(end[q], p)
        latest[op] = p
    firsts = {schedule.index(op) for op in set(schedule)}
    end = [(p if p in firsts else length) if e < 0 else e for p, e in enumerate(end)]  # a copy nobody reads: held
    for k in problem.keep:
        if latest[k] >= 0:
            end[latest[k]] = length
    freed = [0] * (length + 1)
    for p, e in enumerate(end):
        freed[e] += problem.size[schedule[p]]
    live, peak, peak_step = problem.static_bytes, -1, 0
    during, live_after = [], []
    for p, op in enumerate(schedule):
        live += problem.size[op]
        during.append(live + problem.scratch[op])
        if during[-1] > peak:
            peak, peak_step = during[-1], p
        live -= freed[p]
        live_after.append(live)
    return (max(peak, problem.static_bytes), peak_step, live_after, float(sum(problem.cost[op] for op in schedule)),
            during)


def plain_schedule(problem, plan):
    """The staged schedule, searching every op's inputs the same way (no shortcut for ops that run alone)."""
    n = problem.n
    horizon = [plan[i] // (n + 1) if problem.movable[i] else n for i in range(n)]
    reuse_from = [plan[i] % (n + 1) for i in range(n)]
    computed_at, schedule = [-1] * n, []
    for t in range(n):
        need, stack = {t}, [t]
        while stack:
            for i in problem.reads[stack.pop()]:
                at = computed_at[i]
                if i in need or (t <= horizon[i] if at == i else at >= reuse_from[i]):
                    continue
                need.add(i)
                stack.append(i)
        for i in sorted(need):
            schedule.append(i)
            computed_at[i] = t
    return schedule


def random_plan(problem, rng):
    n = problem.n
    return tuple(rng.randint(0, n) * (n + 1) + rng.randint(0, n) for _ in range(n))


PROBLEMS = [chain(6), chain(12, activation_bytes=3, static_bytes=5)] + \
    [random_training_dag(ops, seed=seed, static_bytes=seed) for ops, seed in ((5, 0), (20, 1), (40, 2), (80, 3))]


@pytest.mark.parametrize("index", range(len(PROBLEMS)))
def test_kernel_and_schedules_match_the_plain_loops(index):
    problem = dataclasses.replace(PROBLEMS[index], scratch=[random.Random(index).randint(0, 3)
                                                            for _ in range(PROBLEMS[index].n)])
    rng = random.Random(index)
    plans = [tuple([problem.n * (problem.n + 1)] * problem.n)] + [random_plan(problem, rng) for _ in range(60)]
    recomputing = 0
    for plan in plans:
        schedule = build_schedule(problem, plan)
        assert schedule == plain_schedule(problem, plan)
        recomputing += len(schedule) > problem.n
        sim = profile(problem, schedule, check=True)
        assert (sim.peak, sim.peak_step, sim.live_after, sim.cost, sim.during) == plain_profile(problem, schedule)
        peak, cost, during = measure(problem, schedule)
        assert (peak, cost, during.tolist()) == (sim.peak, sim.cost, sim.during)
    assert recomputing > 10  # the plans exercise recomputation, not only the baseline


@pytest.mark.parametrize("index", range(len(PROBLEMS)))
def test_the_solvers_plans_match_the_plain_loops(index):
    """The DP's plans and the segment schemes hold every horizon to the end of the forward region, so their
    schedules skip the search there: the same schedules as the plain loops, and the same peaks and costs."""
    problem = PROBLEMS[index]
    plans = dp.plans(problem) + [segment_plan(problem, outer, inner, tail) for outer in (None, 1, 2, 3)
                                 for inner in (None, 2) for tail in (0.0, 0.5)]
    assert len(plans) > 5
    for plan in plans:
        schedule = build_schedule(problem, plan)
        assert schedule == plain_schedule(problem, plan)
        peak, cost, during = measure(problem, schedule)
        expected = plain_profile(problem, schedule)
        assert (peak, cost, during.tolist()) == (expected[0], expected[3], expected[4])


def test_costs_add_up_in_schedule_order():
    """`measure`'s cost is `profile`'s to the last bit: both add the costs in schedule order (costs whose sum
    depends on the order)."""
    problem = dataclasses.replace(chain(4), cost=[0.1, 1e16, 0.3, -0.0, 0.7, 1.0, 2.0, 3.0])
    schedule = [0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7]
    assert measure(problem, schedule)[1] == profile(problem, schedule).cost == float(sum(problem.cost[op] for op in schedule))


def test_empty_schedule_holds_the_static_bytes():
    problem = chain(3, static_bytes=7)
    sim = profile(problem, [])
    assert (sim.peak, sim.cost, sim.during) == (7, 0.0, [])
