"""The exact solver: Moccasin's constraint program (Bartan et al., ICML 2023) through OR-Tools' CP-SAT.

Each op may run up to C times (once when it is not movable). Copy k of op v is an optional interval from the
position where it runs to the last position where its output is live; every copy takes one position of the
schedule (no two copies share one); a copy that reads op u needs a copy of u that ran before it and is still
live; the live intervals, weighted by output bytes, never exceed the budget less the static bytes (a cumulative
constraint). First copies run in the baseline order, as in the staged schemes of the other solvers. The
objective is the cost of the copies after the first.

The program reads as the simulator does (`_read_as_simulated`): a read takes the latest copy before the reader,
every recomputed copy is read, and a read through a view holds the copy the view read. Its intervals may only
outlast the simulator's frees, so the schedule of a solution fits the budget the simulator checks; should it not,
the hint stands (a warning says so) rather than a schedule over the budget. The search starts from a hint (the
fast solver's schedule), so its answer is never worse; at the time limit it returns the best schedule found,
with the gap between its extra cost and the proven lower bound: CP-SAT's own, or `extra_cost_bound`'s where that
is higher (CP-SAT's bound often stays at 0). A hint that meets `extra_cost_bound` is optimal as it stands and is
returned without a search. CP-SAT with several workers may return different optimal schedules of equal cost from
run to run; a single worker is deterministic.
"""
from __future__ import annotations

import logging

from ...errors import UsageError
from .problem import Problem, Solution, extra_cost_bound, freed_after, make_solution, without_unread_copies

COPIES = 3  # runs allowed per movable op (one run plus two recomputations); the hint may raise it per op


def _cp_model():
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise UsageError("--solver exact needs OR-Tools: pip install 'onnxgrad[exact]'") from None
    return cp_model


def solve_exact(problem: Problem, budget: int, time_limit: float = 60.0, hint: Solution | None = None,
                copies: int = COPIES, workers: int = 2) -> Solution | None:
    """The cheapest schedule with at most `copies` runs per op whose simulated peak fits `budget`; None when
    the program is infeasible (or when no schedule was found in time and there is no hint). `status` is
    "optimal" or "feasible" (stopped by the time limit), `gap` the relative gap of the extra cost."""
    cp_model = _cp_model()
    n = problem.n
    if budget < problem.static_bytes:
        return None
    if n == 0:
        return make_solution(problem, [], "exact", 0.0, "optimal")
    reads, movable, size, keep = problem.reads, problem.movable, problem.size, problem.keep
    runs = [copies if movable[v] else 1 for v in range(n)]
    bound = extra_cost_bound(problem, budget)
    if bound is None:
        return None
    if hint is not None and hint.extra_cost <= bound + 1e-9 * (1 + abs(bound)):
        return _with_gap(problem, hint, bound, "optimal")  # the hint meets the lower bound: nothing to search
    if hint is not None:
        counts: dict[int, int] = {}
        for v in hint.schedule:
            counts[v] = counts.get(v, 0) + 1
        for v, c in counts.items():
            runs[v] = max(runs[v], c)
    horizon = sum(runs)
    last = horizon - 1
    capacity = budget - problem.static_bytes
    if any(size[v] + problem.scratch[v] > capacity for v in range(n)):
        return None
    # costs as integers: the objective is exact to about 1e-6 of the largest cost
    largest = max(problem.cost, default=0.0)
    scale = 1e6 / largest if largest > 0 else 1.0
    weight = [int(round(c * scale)) for c in problem.cost]

    m = cp_model.CpModel()
    start, end, present, intervals, demands, slots = [], [], [], [], [], []
    for v in range(n):
        sv, ev, pv = [], [], []
        for k in range(runs[v]):
            s = m.NewIntVar(0, last, f"s{v}_{k}")
            e = m.NewIntVar(0, last, f"e{v}_{k}")
            p = m.NewConstant(1) if k == 0 else m.NewBoolVar(f"p{v}_{k}")
            length = m.NewIntVar(1, horizon, f"l{v}_{k}")
            m.Add(e >= s)
            if k == 0:
                intervals.append(m.NewIntervalVar(s, length, e + 1, f"i{v}_{k}"))
                slots.append(m.NewFixedSizeIntervalVar(s, 1, f"u{v}_{k}"))
            else:
                intervals.append(m.NewOptionalIntervalVar(s, length, e + 1, p, f"i{v}_{k}"))
                slots.append(m.NewOptionalFixedSizeIntervalVar(s, 1, p, f"u{v}_{k}"))
                m.Add(s == 0).OnlyEnforceIf(p.Not())
                m.Add(e == 0).OnlyEnforceIf(p.Not())
                m.AddImplication(p, pv[-1])
                m.Add(s > sv[-1]).OnlyEnforceIf(p)
            demands.append(size[v])
            sv.append(s)
            ev.append(e)
            pv.append(p)
        if v in keep:
            m.Add(ev[0] == last)
        start.append(sv)
        end.append(ev)
        present.append(pv)
    for v in range(1, n):
        m.Add(start[v][0] > start[v - 1][0])
    m.AddNoOverlap(slots)
    # a kernel's working memory is taken in the one position where its copy runs
    scratch = [b for v in range(n) for _ in range(runs[v]) for b in [problem.scratch[v]]]
    working = [(slot, b) for slot, b in zip(slots, scratch) if b > 0]
    m.AddCumulative(intervals + [s for s, _ in working], demands + [b for _, b in working], capacity)
    chosen: dict[tuple[int, int, int], object] = {}  # (v, k, u) -> copy of u read, as booleans per copy
    for v in range(n):
        for k in range(runs[v]):
            p = present[v][k]
            for u in reads[v]:
                if runs[u] == 1:
                    m.Add(start[u][0] < start[v][k]).OnlyEnforceIf(p)
                    m.Add(end[u][0] >= start[v][k]).OnlyEnforceIf(p)
                    continue
                options = []
                for j in range(runs[u]):
                    b = m.NewBoolVar(f"r{v}_{k}_{u}_{j}")
                    m.AddImplication(b, present[u][j])
                    m.Add(start[u][j] < start[v][k]).OnlyEnforceIf(b)
                    m.Add(end[u][j] >= start[v][k]).OnlyEnforceIf(b)
                    options.append(b)
                    chosen[v, k, u, j] = b
                m.AddBoolOr(options).OnlyEnforceIf(p)
    _read_as_simulated(m, problem, runs, start, end, present, chosen)
    m.Minimize(sum(weight[v] * present[v][k] for v in range(n) for k in range(1, runs[v])))

    if hint is not None:
        _hint(m, problem, hint, runs, start, end, present, chosen, last)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = max(1, int(workers))
    code = solver.Solve(m)
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if code == cp_model.INFEASIBLE:
            return None
        if hint is None:
            return None
        return _with_gap(problem, hint, max(bound, solver.BestObjectiveBound() / scale), "feasible")
    occurrences = sorted((solver.Value(start[v][k]), v) for v in range(n) for k in range(runs[v])
                         if k == 0 or solver.Value(present[v][k]))
    schedule = without_unread_copies(problem, [v for _, v in occurrences])
    status = "optimal" if code == cp_model.OPTIMAL else "feasible"
    solution = make_solution(problem, schedule, "exact", status=status)
    if solution.peak > budget:
        logging.getLogger("onnxgrad").warning(
            "exact: CP-SAT's schedule is simulated at %d bytes, over the budget of %d; %s", solution.peak, budget,
            "the fast solver's schedule stands" if hint is not None else "no schedule")
        if hint is None:
            return None
        return _with_gap(problem, hint, bound, "feasible")
    if hint is not None and hint.cost < solution.cost - 1e-9 * (1 + abs(hint.cost)):
        solution = hint
    return _with_gap(problem, solution, max(bound, solver.BestObjectiveBound() / scale),
                     "optimal" if code == cp_model.OPTIMAL else "feasible")


def _read_as_simulated(m, problem: Problem, runs, start, end, present, chosen) -> None:
    """The reads the simulator makes, as constraints: a read takes the latest copy that ran before the reader
    (no later copy of the op starts between the two); a recomputed copy is read by some copy (the simulator
    holds a copy no read takes to the end of the run); and a read through a view (`Problem.through`) holds the
    copy of the owner that the view's copy read, until the reader runs."""
    readers: dict[tuple[int, int], list] = {}
    for (v, k, u, j), b in chosen.items():
        readers.setdefault((u, j), []).append(b)
        if j + 1 < runs[u]:
            m.Add(start[u][j + 1] > start[v][k]).OnlyEnforceIf([b, present[u][j + 1]])
    for u in range(problem.n):
        for j in range(1, runs[u]):
            if (u, j) in readers:
                m.AddBoolOr(readers[u, j]).OnlyEnforceIf(present[u][j])
            else:
                m.Add(present[u][j] == 0)
    if problem.through is None:
        return
    for v, pairs in enumerate(problem.through):
        for u, w in sorted(set(pairs)):
            if w < 0 or runs[u] == 1:
                continue  # a direct read, or an owner that runs once: the reads above hold it
            for k in range(runs[v]):
                for i in range(runs[w]):
                    view_read = [] if runs[w] == 1 else [chosen[v, k, w, i]]
                    for j in range(runs[u]):
                        taken = [chosen[w, i, u, j]] + view_read + ([present[v][k]] if k else [])
                        m.Add(end[u][j] >= start[v][k]).OnlyEnforceIf(taken)


def _with_gap(problem: Problem, solution: Solution, bound: float, status: str) -> Solution:
    extra = max(solution.extra_cost, 0.0)
    if extra <= bound + 1e-9 * (1 + abs(bound)):
        status = "optimal"  # the schedule meets a lower bound: proven, whatever stopped the search
    gap = 0.0 if status == "optimal" or extra <= 0 else max(0.0, (extra - bound) / extra)
    return Solution(solution.schedule, solution.peak, solution.cost, solution.extra_cost, solution.recomputed,
                    "exact", 0.0 if status == "optimal" else gap, status)


def _hint(m, problem: Problem, hint: Solution, runs, start, end, present, chosen, last) -> None:
    """The hint's schedule as values of every variable: positions, ends as the liveness kernel frees (`freed_after`:
    a read through a view holds the copy the view's run read; a recomputed copy no read takes, and a kept
    output, are held to the end), the copy each read takes (the latest)."""
    schedule = hint.schedule
    length = len(schedule)
    sim_end = [last if e >= length else e for e in freed_after(problem, schedule)]
    latest = [-1] * problem.n
    copy_at: list[int] = []
    copies = [0] * problem.n
    read_copy: dict[tuple[int, int, int], int] = {}
    for p, v in enumerate(schedule):
        for u in problem.reads[v]:
            read_copy[v, copies[v], u] = copy_at[latest[u]]
        latest[v] = p
        copy_at.append(copies[v])
        copies[v] += 1
    for p, v in enumerate(schedule):
        k = copy_at[p]
        m.AddHint(start[v][k], p)
        m.AddHint(end[v][k], sim_end[p])
        if k:
            m.AddHint(present[v][k], 1)
    for v in range(problem.n):
        for k in range(copies[v], runs[v]):
            m.AddHint(start[v][k], 0)
            m.AddHint(end[v][k], 0)
            m.AddHint(present[v][k], 0)
    for (v, k, u, j), b in chosen.items():
        m.AddHint(b, 1 if k < copies[v] and read_copy.get((v, k, u)) == j else 0)
