"""The recomputation solvers, behind one signature: `solve(problem, budget, limits) -> Solution | None`.

- `problem.py`: the `Problem`, its one liveness kernel (`profile`), the floor, and the staged plans the
  heuristic solvers speak.
- `dp.py`: the block DP (Rotor's revolve generalised to blocks between narrow points), every budget at once.
- `fast.py`: the default; the DP's plans, segment schemes and a bounded local search, as one Pareto front.
- `anneal.py`: moves a schedule's recomputations (in, out, along) under a budget: the fast solver's last step.
- `exact.py`: Moccasin's constraint program through CP-SAT, started from the fast plan; optimum or gap.
- `milp.py`: Checkmate's MILP through HiGHS, the oracle of the small problems in the tests.
- `front.py`: the `Front` object (peak rising, cost falling) that answers every budget of a sweep.

Every solver returns None when it finds no schedule under the budget, and a budget at or above the baseline's
peak is answered at once with the baseline (nothing recomputed).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import dp
from .anneal import anneal
from .exact import solve_exact
from .fast import DEFAULT_WORK, fast_front
from .front import Candidate, Front, OutOfWork, Pool, best_under
from .milp import SolverTimeout, solve_milp
from .problem import (DROP, HOLD, REUSE, SHORT, Problem, Simulation, Solution, build_schedule,  # noqa: F401
                      extra_cost_bound, floor, floor_parts, make_solution, narrow_points, necessary_bytes, plan_entry,
                      plan_of_classes, profile, prune, simulate, unread_copies, validate,
                      without_unread_copies)


@dataclass(frozen=True)
class Limits:
    """What a solver may spend: `work` (schedule steps the heuristics build and simulate, a count so that the
    same input gives the same answer), `time_limit` (seconds, for the exact solvers) and `workers` (threads of
    CP-SAT)."""

    work: int = DEFAULT_WORK
    time_limit: float = 60.0
    workers: int = 2
    prune_work: int = 0  # schedule steps the fast solver may spend pruning its front (`prune`); 0: none
    prune_below: int | None = None  # the budget the pruning serves: the schedules under it, closest first
    anneal_work: int = 0  # schedule steps the fast solver may spend moving the recomputations of its plan for
    # `prune_below` (`anneal`); 0: none


def baseline(problem: Problem) -> Solution:
    return make_solution(problem, problem.baseline, "store-all", 0.0, "optimal")


def front(problem: Problem, limits: Limits = Limits()) -> Front:
    """The fast solver's Pareto front (keep it to answer several budgets)."""
    return fast_front(problem, limits.work, prune_work=limits.prune_work, prune_below=limits.prune_below,
                      anneal_work=limits.anneal_work)


def dp_front(problem: Problem) -> Front:
    """The block DP's plans alone, as a front."""
    pool = Pool(problem, 10**12)
    pool.evaluate(plan_of_classes(problem, [HOLD] * problem.n))
    for plan in dp.plans(problem):
        pool.evaluate(plan)
    return Front(problem, pool.candidates(), "dp", pool.evaluations)


def solve_fast(problem: Problem, budget: int, limits: Limits = Limits()) -> Solution | None:
    if budget >= problem.baseline_peak:
        return baseline(problem)
    if budget < floor(problem):
        return None
    return front(problem, limits).best_under(budget)


def solve_dp(problem: Problem, budget: int, limits: Limits = Limits()) -> Solution | None:
    if budget >= problem.baseline_peak:
        return baseline(problem)
    if budget < floor(problem):
        return None
    return dp_front(problem).best_under(budget)


def solve_cp(problem: Problem, budget: int, limits: Limits = Limits(), hint: Solution | None = None
             ) -> Solution | None:
    """CP-SAT from the fast solver's plan (or `hint`): never worse than it."""
    if budget >= problem.baseline_peak:
        return baseline(problem)
    if budget < floor(problem):
        return None
    hint = hint or solve_fast(problem, budget, limits)
    return solve_exact(problem, budget, limits.time_limit, hint, workers=limits.workers)


def solve_highs(problem: Problem, budget: int, limits: Limits = Limits()) -> Solution | None:
    if budget >= problem.baseline_peak:
        return baseline(problem)
    return solve_milp(problem, budget, limits.time_limit)


SOLVERS = {"fast": solve_fast, "dp": solve_dp, "exact": solve_cp, "milp": solve_highs}


def solve(problem: Problem, budget: int, solver: str = "fast", limits: Limits = Limits()) -> Solution | None:
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r}: expected one of {', '.join(SOLVERS)}")
    return SOLVERS[solver](problem, budget, limits)
