"""Checkmate's mixed-integer program (Jain et al., MLSys 2020) through HiGHS (`scipy.optimize.milp`).

Kept as the oracle of the small problems in the tests: on up to about 20 ops HiGHS proves the optimum of the
staged program in seconds, from a formulation independent of CP-SAT's. Beyond that it rarely finds a schedule
in minutes (BENCHMARKS.md, "The solvers against the exact optimum"); `exact.py` is the solver for those.
"""
from __future__ import annotations

import math
import time

import numpy as np

from ...errors import InternalError, UsageError
from .problem import Problem, Solution, make_solution, without_unread_copies


class SolverTimeout(UsageError, TimeoutError):
    """The MILP found no schedule within its time limit (which says nothing about feasibility)."""



def solve_milp(problem: Problem, budget: int, time_limit: float = 60.0, mip_rel_gap: float = 1e-6
               ) -> Solution | None:
    """The cheapest staged schedule whose peak fits `budget`, by Checkmate's mixed-integer program.

    Stage t computes op t, after recomputing any earlier ops it needs (R[t,i]); S[t,i] says op i's output is
    held from stage t-1 into stage t; FREE[t,i,k] frees op i's output right after op k in stage t; U[t,k] is
    the memory while op k runs in stage t. Only ops that `Problem.movable` allows get R[t,i] = 1 for i != t.

    The program's memory never falls below the simulator's: a held output stays counted until the program
    frees it, and it may free an output only after its last reader in the stage when it is not held into the
    next stage, which is exactly when the simulator frees it (the simulator may free earlier, never later). The
    returned schedule is simulated and checked against the budget. Returns None when the program is infeasible;
    raises SolverTimeout (a UsageError and a TimeoutError) when no schedule was found in `time_limit` seconds;
    `status` and `gap` report a search that found one but could not prove it optimal in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    n = problem.n
    if n == 0:
        return make_solution(problem, [], "milp", 0.0, "optimal") if problem.static_bytes <= budget else None
    reads, users, movable, keep = problem.reads, problem.users, problem.movable, problem.keep
    last_use = [max(users[i], default=-1) for i in range(n)]
    unit = float(max(max(problem.size), problem.static_bytes, 1))
    size = [s / unit for s in problem.size]

    lower: list[float] = []
    upper: list[float] = []
    objective: list[float] = []
    integral: list[int] = []

    def var(lo: float, hi: float, cost: float = 0.0, binary: bool = True) -> int:
        lower.append(lo)
        upper.append(hi)
        objective.append(cost)
        integral.append(1 if binary else 0)
        return len(lower) - 1

    R: list[dict[int, int]] = []
    S: list[dict[int, int]] = []
    for t in range(n):
        R.append({i: var(1.0 if i == t else 0.0, 1.0, 0.0 if i == t else problem.cost[i])
                  for i in range(t + 1) if i == t or movable[i]})
        held = {}
        for i in range(t):
            if i in keep:
                held[i] = var(1.0, 1.0)
            elif last_use[i] >= t:
                # an op that cannot be recomputed must be held until its last reader
                held[i] = var(1.0 if not movable[i] else 0.0, 1.0)
        S.append(held)

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    row_lo: list[float] = []
    row_hi: list[float] = []

    def row(terms: list[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(row_lo)
        for c, v in terms:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        row_lo.append(lo)
        row_hi.append(hi)

    limit = (budget + 0.5) / unit  # memory is a whole number of bytes: half a byte absorbs rounding
    memory: list[int] = []  # the U variables, bounded by the limit
    for t in range(n):
        Rt, St = R[t], S[t]
        St1 = S[t + 1] if t + 1 < n else {}
        # an op runs only if each output it reads is computed in this stage or held into it
        for k, rk in Rt.items():
            for i in reads[k]:
                terms = [(rk, 1.0)]
                if i in Rt:
                    terms.append((Rt[i], -1.0))
                if i in St:
                    terms.append((St[i], -1.0))
                row(terms, -math.inf, 0.0)
        # an output is held into a stage only if it was computed or held in the one before
        if t > 0:
            for i, s in St.items():
                terms = [(s, 1.0)]
                if i in R[t - 1]:
                    terms.append((R[t - 1][i], -1.0))
                if i in S[t - 1]:
                    terms.append((S[t - 1][i], -1.0))
                row(terms, -math.inf, 0.0)
        for i, s in St.items():
            if i in Rt:
                row([(s, 1.0), (Rt[i], 1.0)], -math.inf, 1.0)
        # memory through the stage
        order = sorted(Rt)
        previous_u = None
        pending_frees: list[tuple[int, float]] = []
        for k in order:
            u = var(0.0, limit, binary=False)
            memory.append(u)
            terms = [(u, 1.0), (Rt[k], -size[k])]
            if previous_u is None:
                terms += [(s, -size[i]) for i, s in St.items()]
                rhs = problem.static_bytes / unit
            else:
                terms += [(previous_u, -1.0)] + [(f, w) for f, w in pending_frees]
                rhs = 0.0
            row(terms, rhs, rhs)
            previous_u = u
            # frees right after k: k's inputs and k itself, when no later reader in the stage needs them and they
            # are not held into the next stage
            pending_frees = []
            for i in (*reads[k], k):
                if i in keep:
                    continue
                f = var(0.0, 1.0, binary=False)
                pending_frees.append((f, size[i]))
                row([(f, 1.0), (Rt[k], -1.0)], -math.inf, 0.0)
                if i in St1:
                    row([(f, 1.0), (St1[i], 1.0)], -math.inf, 1.0)
                for j in users[i]:
                    if k < j <= t and j in Rt:
                        row([(f, 1.0), (Rt[j], 1.0)], -math.inf, 1.0)

    nvars = len(lower)
    A = coo_array((vals, (rows, cols)), shape=(len(row_lo), nvars)).tocsr()
    memory_vars = np.array(memory)
    upper_bounds = np.array(upper)
    started = time.perf_counter()
    # HiGHS may overstep a row by its feasibility tolerance, which is more than a byte when sizes are large: a
    # schedule whose simulated peak is over the budget is solved again under a limit lowered by the excess
    for _ in range(3):
        upper_bounds[memory_vars] = limit
        result = milp(np.array(objective), integrality=np.array(integral),
                      bounds=Bounds(np.array(lower), upper_bounds),
                      constraints=LinearConstraint(A, np.array(row_lo), np.array(row_hi)),
                      options={"time_limit": max(1.0, time_limit - (time.perf_counter() - started)),
                               "mip_rel_gap": mip_rel_gap, "disp": False})
        if result.x is None:
            if result.status == 1:
                raise SolverTimeout(f"--solver milp: no schedule found in {time_limit:g} s, the time limit "
                                    f"(HiGHS: {result.message})")
            return None
        x = result.x
        # a copy the program made but no read takes would be held to the end: taken out, it costs less
        schedule = without_unread_copies(problem, [i for t in range(n) for i in sorted(R[t]) if x[R[t][i]] > 0.5])
        gap = getattr(result, "mip_gap", None)
        gap = None if gap is None else max(0.0, float(gap))
        status = "optimal" if result.status == 0 else "feasible"
        solution = make_solution(problem, schedule, "milp", gap, status)
        if solution.peak <= budget:
            return solution
        limit -= (solution.peak - budget + 0.5) / unit
    raise InternalError(f"milp: the schedule's simulated peak {solution.peak} exceeds the budget {budget}; "
                        f"the program's memory model must never be below the simulator's")
