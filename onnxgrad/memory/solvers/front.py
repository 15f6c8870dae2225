"""A Pareto front of schedules, and the pool of evaluated plans that the heuristic solvers grow it from.

The front is an object a caller keeps (a sweep over budgets asks it once per budget); nothing is cached on the
problem. Along it the peak rises and the cost falls, so `best_under` never pays more when the budget grows.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .problem import Problem, Solution, build_schedule, make_solution, measure


class OutOfWork(Exception):
    """A search has used its work limit: the front found so far is the answer."""


@dataclass
class Candidate:
    peak: int
    cost: float
    plan: tuple[int, ...]
    source: str = ""  # the solver whose search first met this plan
    schedule: tuple[int, ...] | None = None  # when not the plan's staged schedule (`prune` took some out)


def pareto(candidates: list[Candidate]) -> list[Candidate]:
    """The candidates on the Pareto front: increasing peak, strictly decreasing cost (ties: the plan first in
    order, a staged schedule before a pruned one)."""
    ranked = sorted(candidates, key=lambda c: (c.peak, c.cost, c.plan, c.schedule is not None, c.schedule or ()))
    front: list[Candidate] = []
    for c in ranked:
        if not front or c.cost < front[-1].cost - 1e-9:
            front.append(c)
    return front


@dataclass
class Pool:
    """Every plan evaluated, with its peak and cost, within a work limit counted in schedule steps built and
    simulated (a count rather than a time, so the same input gives the same front on every machine). With
    `keep_profiles`, also each schedule's live bytes per step, which a local search scores against a budget."""

    problem: Problem
    work_limit: int
    keep_profiles: bool = False
    seen: dict[tuple[int, ...], tuple[int, float]] = field(default_factory=dict)
    sources: dict[tuple[int, ...], str] = field(default_factory=dict)
    profiles: dict[tuple[int, ...], np.ndarray] = field(default_factory=dict)
    evaluations: int = 0
    work: int = 0
    source: str = ""  # credited to the plans evaluated from now on

    def evaluate(self, plan: tuple[int, ...]) -> tuple[int, float]:
        known = self.seen.get(plan)
        if known is not None:
            return known
        if self.work >= self.work_limit:
            raise OutOfWork
        schedule = build_schedule(self.problem, plan)
        peak, cost, during = measure(self.problem, schedule)
        self.evaluations += 1
        self.work += len(schedule)
        self.seen[plan] = (peak, cost)
        self.sources[plan] = self.source
        if self.keep_profiles:
            self.profiles[plan] = during
        return peak, cost

    @contextmanager
    def share(self, fraction: float):
        """Within the block, the work limit is `fraction` of the work left; a search that uses its share ends
        the block, not the caller's search."""
        limit = self.work_limit
        self.work_limit = min(limit, self.work + int((limit - self.work) * fraction))
        try:
            yield
        except OutOfWork:
            if self.work_limit >= limit:
                raise
        finally:
            self.work_limit = limit

    def scored(self, plan: tuple[int, ...], budget: int) -> tuple[int, float, int]:
        """(peak, cost, bytes over `budget` summed over the steps)."""
        peak, cost = self.evaluate(plan)
        if peak <= budget:
            return peak, cost, 0
        during = self.profiles.get(plan)
        if during is None:
            during = measure(self.problem, build_schedule(self.problem, plan))[2]
        return peak, cost, int(np.maximum(during - budget, 0).sum())

    def candidates(self) -> list[Candidate]:
        """The Pareto front of the pool: increasing peak, strictly decreasing cost."""
        return pareto([Candidate(p, c, k, self.sources.get(k, "")) for k, (p, c) in self.seen.items()])

    def cheapest_under(self, budget: int) -> tuple[int, ...] | None:
        fitting = [(c, p, k) for k, (p, c) in self.seen.items() if p <= budget]
        return min(fitting)[2] if fitting else None

    def least_peak(self) -> tuple[int, ...]:
        return min(self.seen.items(), key=lambda e: (e[1][0], e[1][1], e[0]))[0]


@dataclass
class Front:
    """Schedules from the least peak a solver reached to store-all, each cheaper than every one before it."""

    problem: Problem
    points: list[Candidate]
    solver: str
    evaluations: int = 0
    # the fast solver's front before it pruned toward a budget: the same whatever the budget
    staged: list[Candidate] | None = None

    def solutions(self) -> list[Solution]:
        return [self.solution(c) for c in self.points]

    def solution(self, c: Candidate) -> Solution:
        schedule = list(c.schedule) if c.schedule is not None else build_schedule(self.problem, c.plan)
        return make_solution(self.problem, schedule, self.solver, status="heuristic")

    @property
    def least_peak(self) -> int | None:
        return self.points[0].peak if self.points else None

    def within(self, max_extra_cost: float) -> Front:
        """The front less its schedules whose extra cost exceeds `max_extra_cost`."""
        base = self.problem.baseline_cost
        limit = max_extra_cost + 1e-9 * (1 + abs(base))
        points = [c for c in self.points if c.cost - base <= limit]
        staged = None if self.staged is None else [c for c in self.staged if c.cost - base <= limit]
        if len(points) == len(self.points) and (staged is None or len(staged) == len(self.staged)):
            return self
        return Front(self.problem, points, self.solver, self.evaluations, staged)

    def best_under(self, budget: int) -> Solution | None:
        """The cheapest schedule whose peak fits `budget`."""
        fitting = [c for c in self.points if c.peak <= budget]
        return self.solution(min(fitting, key=lambda c: (c.cost, c.peak))) if fitting else None

    def least_peak_within(self, max_extra_cost: float) -> Solution | None:
        """The schedule of least peak whose extra cost is at most `max_extra_cost`."""
        base = self.problem.baseline_cost
        within = [c for c in self.points if c.cost - base <= max_extra_cost + 1e-9 * (1 + abs(base))]
        return self.solution(min(within, key=lambda c: (c.peak, c.cost))) if within else None


def best_under(front: list[Solution], budget: int) -> Solution | None:
    """The cheapest schedule of a list of solutions whose peak fits `budget`."""
    fitting = [s for s in front if s.peak <= budget]
    return min(fitting, key=lambda s: (s.cost, s.peak)) if fitting else None
