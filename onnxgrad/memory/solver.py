"""The names the budget solver had before it became the `solvers` package, for the code that still calls them
(`memory/sweep.py`). New code imports `onnxgrad.memory.solvers`."""
from __future__ import annotations

from .solvers import (DEFAULT_WORK, DROP, HOLD, REUSE, SHORT, Limits, Problem, Simulation,  # noqa: F401
                      Solution, SolverTimeout, best_under, build_schedule, floor, make_solution, plan_entry,
                      plan_of_classes, simulate, solve_milp, validate)
from .solvers import front as _front
from .solvers.fast import segment_plan  # noqa: F401


def _cuts(problem: Problem) -> tuple[list[int], list[list[int]]]:
    return problem.cuts


def pareto(problem: Problem, work: int = DEFAULT_WORK) -> list[Solution]:
    """The fast solver's front as a list of solutions (peak rising, cost falling)."""
    return _front(problem, Limits(work=work)).solutions()


def solve(problem: Problem, budget: int, work: int = DEFAULT_WORK) -> Solution | None:
    from .solvers import solve_fast
    return solve_fast(problem, budget, Limits(work=work))


def least_peak(problem: Problem, max_extra_cost: float, work: int = DEFAULT_WORK) -> Solution | None:
    return _front(problem, Limits(work=work)).least_peak_within(max_extra_cost)
