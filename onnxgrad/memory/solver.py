"""The least recomputation that fits a memory budget, on an abstract problem.

A `Problem` numbers a training graph's ops in the baseline order (forward then backward) and says, per op, the
bytes of its output, the cost of running it, the ops it reads, whether it may run more than once, and which
outputs live to the end. A schedule runs the ops in that order, with recomputations inserted; `simulate` gives
its true liveness peak under the model onnxruntime applies to our graphs (an output is allocated when its op
runs and freed right after its last reader), so every solver here is judged by the same simulator that checks
the rewritten graph.

Solvers:
- `solve_milp`: the exact formulation of Checkmate (Jain et al., MLSys 2020) through HiGHS; stage t computes op t
  and may recompute earlier ops first. An optimality oracle for small problems.
- `solve`: the fast default. It builds a Pareto front of (peak, cost) schedules that does not depend on the
  budget, then takes the cheapest schedule under the budget, so its cost never rises when the budget grows.
  `pareto` returns that front (a sweep's table), `least_peak` its least peak within an extra cost (`auto`).
- `floor`: a peak no schedule can go below; a budget under it is infeasible for a reason that can be printed.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..errors import InternalError, UsageError

# ---------------------------------------------------------------------------------------------------------------
# The problem and its simulator


@dataclass
class Problem:
    """One recomputation problem. Ops are numbered in a topological order that is the baseline schedule."""

    size: list[int]  # bytes of op i's output(s)
    cost: list[float]  # cost of running op i once
    inputs: list[list[int]]  # ops whose outputs op i reads
    recomputable: list[bool]  # may op i run more than once
    keep: set[int]  # ops whose output stays live to the end (graph outputs)
    static_bytes: int = 0  # bytes live for the whole run (parameters, graph inputs, ...)

    def __post_init__(self) -> None:
        n = len(self.size)
        if not (len(self.cost) == len(self.inputs) == len(self.recomputable) == n):
            raise ValueError(f"problem: size, cost, inputs and recomputable must have one entry per op "
                             f"({n}, {len(self.cost)}, {len(self.inputs)}, {len(self.recomputable)})")
        for i, ins in enumerate(self.inputs):
            for j in ins:
                if not 0 <= j < i:
                    raise ValueError(f"problem: op {i} reads op {j}, which does not come before it")
        if any(s < 0 for s in self.size) or any(c < 0 for c in self.cost) or self.static_bytes < 0:
            raise ValueError("problem: sizes, costs and static bytes must be non-negative")
        if any(not 0 <= k < n for k in self.keep):
            raise ValueError(f"problem: keep names ops outside 0..{n - 1}")

    @property
    def n(self) -> int:
        return len(self.size)

    @cached_property
    def reads(self) -> list[tuple[int, ...]]:
        """The distinct ops each op reads (an op reading one value twice holds it once)."""
        return [tuple(sorted(set(ins))) for ins in self.inputs]

    @cached_property
    def users(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in range(self.n)]
        for k, ins in enumerate(self.reads):
            for i in ins:
                users[i].append(k)
        return users

    @property
    def baseline_cost(self) -> float:
        """Cost of the schedule that runs every op once."""
        return float(sum(self.cost))

    @property
    def baseline(self) -> list[int]:
        return list(range(self.n))

    @cached_property
    def movable(self) -> list[bool]:
        """Ops a solver may run more than once: recomputable and not kept (a kept output is computed once)."""
        return [r and i not in self.keep for i, r in enumerate(self.recomputable)]

    @cached_property
    def forward_end(self) -> int:
        """One past the last recomputable op: ops before it form the forward region, whose values the baseline
        holds for forward readers anyway."""
        last = max((i for i, r in enumerate(self.movable) if r), default=-1)
        return last + 1


@dataclass
class Simulation:
    peak: int  # the most bytes live at once, static bytes included
    peak_step: int  # position in the schedule where the peak is reached (first such)
    live_after: list[int]  # live bytes right after each step, once its frees are done
    cost: float  # sum of the cost of every occurrence


def _lifetimes(problem: Problem, schedule: list[int]) -> list[int]:
    """For each position of the schedule, the last position at which its output is live (len(schedule) for a
    kept output). Raises ValueError naming the first rule the schedule breaks."""
    n = problem.n
    reads, recomputable, keep = problem.reads, problem.recomputable, problem.keep
    length = len(schedule)
    latest = [-1] * n
    count = [0] * n
    end = [0] * length
    last_fixed = -1
    for p, op in enumerate(schedule):
        if not isinstance(op, (int, np.integer)) or not 0 <= op < n:
            raise ValueError(f"schedule position {p}: {op!r} is not an op index in 0..{n - 1}")
        for i in reads[op]:
            q = latest[i]
            if q < 0:
                raise ValueError(f"schedule position {p}: op {op} reads op {i}, which has not run before it")
            end[q] = p
        count[op] += 1
        if count[op] > 1:
            if not recomputable[op]:
                raise ValueError(f"schedule position {p}: op {op} is not recomputable and runs a second time")
            if op in keep:
                raise ValueError(f"schedule position {p}: op {op} is kept to the end and runs a second time")
        if not recomputable[op]:
            if op < last_fixed:
                raise ValueError(f"schedule position {p}: non-recomputable op {op} runs after op {last_fixed}, "
                                 f"out of the baseline order")
            last_fixed = op
        end[p] = p  # freed right after itself unless someone reads it later
        latest[op] = p
    missing = [i for i in range(n) if count[i] == 0]
    if missing:
        raise ValueError(f"schedule never runs op {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))
    for k in keep:
        end[latest[k]] = length
    return end


def validate(problem: Problem, schedule: list[int]) -> None:
    """Raise ValueError with the reason when `schedule` is not a valid schedule of `problem`: an op that never
    runs, a read before the producer ran, a second run of a non-recomputable or kept op, or non-recomputable ops
    out of their baseline order."""
    _lifetimes(problem, schedule)


def simulate(problem: Problem, schedule: list[int]) -> Simulation:
    """Peak and live bytes of a schedule. An output is allocated when its op runs and freed right after the
    last occurrence that reads it (a read takes the latest earlier occurrence of the producer), or right after
    its op when nobody reads it; kept outputs are never freed; while an op runs, its inputs and its output are
    live together."""
    end = _lifetimes(problem, schedule)
    length = len(schedule)
    if length == 0:
        return Simulation(problem.static_bytes, 0, [], 0.0)
    size = problem.size
    freed = [0] * (length + 1)
    for p, e in enumerate(end):
        freed[e] += size[schedule[p]]
    live = problem.static_bytes
    peak, peak_step = -1, 0
    live_after = [0] * length
    for p, op in enumerate(schedule):
        live += size[op]
        if live > peak:
            peak, peak_step = live, p
        live -= freed[p]
        live_after[p] = live
    cost = float(sum(problem.cost[op] for op in schedule))
    return Simulation(peak, peak_step, live_after, cost)


def _peak_profile(problem: Problem, schedule: list[int]) -> tuple[int, float, list[int]]:
    """(peak, cost, live bytes during each step) without the checks: for schedules this module built."""
    reads, size = problem.reads, problem.size
    latest = [-1] * problem.n
    length = len(schedule)
    end = list(range(length))
    for p, op in enumerate(schedule):
        for i in reads[op]:
            end[latest[i]] = p
        latest[op] = p
    for k in problem.keep:
        end[latest[k]] = length
    freed = [0] * (length + 1)
    for p, e in enumerate(end):
        freed[e] += size[schedule[p]]
    live = problem.static_bytes
    during = [0] * length
    for p, op in enumerate(schedule):
        live += size[op]
        during[p] = live
        live -= freed[p]
    cost = problem.cost
    return max(during, default=problem.static_bytes), float(sum(cost[op] for op in schedule)), during


def floor(problem: Problem) -> int:
    """A peak no valid schedule can go below.

    When op i runs, these buffers are live at once, and each is a different buffer: the static bytes, i's
    output, the outputs i reads, and every kept output already computed. A kept output is computed once and
    never freed, so it is live at i if its op must run before i: an ancestor of i, or (when i is not
    recomputable) a non-recomputable op before i in the baseline, or an ancestor of one. At the end of any
    schedule every kept output is live. The floor is the largest of these sums; it is a lower bound, not always
    reachable (a budget between it and the true least peak gets no schedule from the solvers)."""
    n = problem.n
    keep, size, reads = problem.keep, problem.size, problem.reads
    if n == 0:
        return problem.static_bytes
    # kept ancestors as bitsets (Python ints): cheap for the tens or thousands of kept outputs of a real graph
    bit = {k: 1 << j for j, k in enumerate(sorted(keep))}
    kept_size = {1 << j: size[k] for j, k in enumerate(sorted(keep))}
    before = [0] * n  # kept ops that must run before op i (strictly)
    fixed_prefix = 0  # kept ops that must run before the next non-recomputable op
    sums: dict[int, int] = {0: 0}

    def bytes_of(mask: int) -> int:
        total = sums.get(mask)
        if total is None:
            total, m = 0, mask
            while m:
                low = m & -m
                total += kept_size[low]
                m ^= low
            sums[mask] = total
        return total

    best = problem.static_bytes + sum(size[k] for k in keep)
    for i in range(n):
        mask = 0
        for j in reads[i]:
            mask |= before[j] | bit.get(j, 0)
        if not problem.recomputable[i]:
            mask |= fixed_prefix
            fixed_prefix = mask | bit.get(i, 0)
        before[i] = mask
        working = size[i] + sum(size[j] for j in reads[i])
        counted = bit.get(i, 0)
        for j in reads[i]:
            counted |= bit.get(j, 0)
        working += bytes_of(mask & ~counted)
        best = max(best, problem.static_bytes + working)
    return best


# ---------------------------------------------------------------------------------------------------------------
# Solutions


@dataclass
class Solution:
    schedule: list[int]
    peak: int  # simulated
    cost: float  # of the whole schedule
    extra_cost: float  # over the baseline, where each op runs once
    recomputed: dict[int, int]  # op -> how many extra times it runs
    solver: str
    gap: float | None = None  # relative optimality gap when known (0.0: proven optimal)
    status: str = ""

    @property
    def kept(self) -> list[int]:
        """Ops that run once (their output is held from its only run to its last reader)."""
        counted = set(self.recomputed)
        return sorted(set(self.schedule) - counted)


def make_solution(problem: Problem, schedule: list[int], solver: str, gap: float | None = None,
                  status: str = "") -> Solution:
    sim = simulate(problem, schedule)
    runs: dict[int, int] = {}
    for op in schedule:
        runs[op] = runs.get(op, 0) + 1
    recomputed = {op: r - 1 for op, r in sorted(runs.items()) if r > 1}
    return Solution(list(schedule), sim.peak, sim.cost, sim.cost - problem.baseline_cost, recomputed, solver,
                    gap, status)


# ---------------------------------------------------------------------------------------------------------------
# The exact solver (Checkmate)


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
        schedule = [i for t in range(n) for i in sorted(R[t]) if x[R[t][i]] > 0.5]
        gap = getattr(result, "mip_gap", None)
        gap = None if gap is None else max(0.0, float(gap))
        elapsed = time.perf_counter() - started
        status = "optimal" if result.status == 0 else f"time limit ({elapsed:.0f} s): {result.message}"
        solution = make_solution(problem, schedule, "milp", gap, status)
        if solution.peak <= budget:
            return solution
        limit -= (solution.peak - budget + 0.5) / unit
    raise InternalError(f"milp: the schedule's simulated peak {solution.peak} exceeds the budget {budget}; "
                        f"the program's memory model must never be below the simulator's")


# ---------------------------------------------------------------------------------------------------------------
# The fast solver
#
# A schedule is built from a plan of one entry per op, in stages like Checkmate's: stage t runs op t after
# recomputing, in index order, whatever op t needs that is not available. An op's entry is a horizon h and a
# reuse stage r: its first run serves readers up to stage h; after that a reader recomputes it, and a copy
# recomputed at stage r or later is held until its last reader (reused), an earlier one serves only the stage
# that made it (recomputed again for every stage that needs it). Named classes of entries:
#   HOLD: h = the end; a checkpoint, held from its one run to its last reader;
#   REUSE: h = the end of the forward region, r = 0; Chen et al.'s segment recomputation;
#   DROP: h = the end of the forward region, r = the end; the inner level of revolve/treeverse;
#   SHORT: h = SHORT_REACH stages after its run, r = the end; a far forward reader (the end of a skip connection)
#          recomputes it instead of holding it across the block.
# Ops that are not movable always HOLD. Plans span store-all, Chen's sqrt(n) segments (HOLD at segment
# boundaries, REUSE inside), multi-level schemes (HOLD, REUSE and DROP nested) and checkpoints held only part of
# the way (a horizon at one of the op's readers), and recompute a value as many times as its plan asks. The
# solver evaluates plans with the simulator and keeps every (peak, cost) it meets; the Pareto front of all of
# them answers every budget.

SHORT, DROP, REUSE, HOLD = 0, 1, 2, 3
SHORT_REACH = 2


def plan_entry(n: int, horizon: int, reuse_from: int) -> int:
    """One op's plan entry in a problem of n ops (horizon and reuse stage in 0..n; n: the end)."""
    return horizon * (n + 1) + reuse_from


def plan_of_classes(problem: Problem, classes: list[int]) -> tuple[int, ...]:
    """The plan of one named class per op (ignored for ops that are not movable)."""
    n, last_forward = problem.n, problem.forward_end - 1
    hold = plan_entry(n, n, 0)
    entries = []
    for i, c in enumerate(classes):
        if not problem.movable[i] or c == HOLD:
            entries.append(hold)
        elif c == SHORT:
            entries.append(plan_entry(n, min(last_forward, i + SHORT_REACH), n))
        else:
            entries.append(plan_entry(n, last_forward, 0 if c == REUSE else n))
    return tuple(entries)


def build_schedule(problem: Problem, plan: tuple[int, ...] | list[int],
                   demands: list[list[int]] | None = None) -> list[int]:
    """The staged schedule of a plan (see above; entries of ops that are not movable are ignored). `demands`,
    when given, receives for each op the stages at which something read it."""
    n = problem.n
    reads, movable = problem.reads, problem.movable
    horizon = [plan[i] // (n + 1) if movable[i] else n for i in range(n)]
    reuse_from = [plan[i] % (n + 1) for i in range(n)]
    computed_at = [-1] * n  # stage of the latest run of each op
    schedule: list[int] = []
    for t in range(n):
        need = {t}
        stack = [t]
        while stack:
            k = stack.pop()
            for i in reads[k]:
                if demands is not None and (not demands[i] or demands[i][-1] != t):
                    demands[i].append(t)
                if i in need:
                    continue
                at = computed_at[i]
                if (t <= horizon[i] if at == i else at >= reuse_from[i]):
                    continue
                need.add(i)
                stack.append(i)
        if len(need) == 1:
            schedule.append(t)
            computed_at[t] = t
        else:
            for i in sorted(need):
                schedule.append(i)
                computed_at[i] = t
    return schedule


class _OutOfWork(Exception):
    """The search has used its work limit: the front found so far is the answer."""


@dataclass
class _Candidate:
    peak: int
    cost: float
    plan: tuple[int, ...]


@dataclass
class _Pool:
    """Every plan evaluated, with its peak and cost. Small problems also keep each schedule's live
    bytes per step, which the local search scores against a budget."""

    problem: Problem
    work_limit: int  # schedule steps built and simulated, all evaluations together
    keep_profiles: bool = False
    seen: dict[tuple[int, ...], tuple[int, float]] = field(default_factory=dict)
    profiles: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    evaluations: int = 0
    work: int = 0

    def evaluate(self, plan: tuple[int, ...]) -> tuple[int, float]:
        known = self.seen.get(plan)
        if known is not None:
            return known
        if self.work >= self.work_limit:
            raise _OutOfWork
        schedule = build_schedule(self.problem, list(plan))
        peak, cost, during = _peak_profile(self.problem, schedule)
        self.evaluations += 1
        self.work += len(schedule)
        self.seen[plan] = (peak, cost)
        if self.keep_profiles:
            self.profiles[plan] = during
        return peak, cost

    def scored(self, plan: tuple[int, ...], budget: int) -> tuple[int, float, int]:
        """(peak, cost, bytes over `budget` summed over the steps)."""
        peak, cost = self.evaluate(plan)
        excess = sum(d - budget for d in self.profiles[plan] if d > budget) if peak > budget else 0
        return peak, cost, excess

    def front(self) -> list[_Candidate]:
        """The Pareto front: increasing peak, strictly decreasing cost."""
        ranked = sorted(((p, c, k) for k, (p, c) in self.seen.items()), key=lambda e: (e[0], e[1]))
        front: list[_Candidate] = []
        for p, c, k in ranked:
            if not front or c < front[-1].cost - 1e-9:
                front.append(_Candidate(p, c, k))
        return front


def _segment_plan(problem: Problem, outer: int | None, inner: int | None, held_tail: float = 0.0
                  ) -> tuple[int, ...]:
    """The plan of a segmented scheme along the forward region: HOLD at every `outer`-th cut, REUSE at every
    `inner`-th cut between them (REUSE everywhere when `inner` is None: Chen's scheme), DROP elsewhere. Cuts
    are placed where few bytes cross from one side of the forward region to the other. The last segment is held
    outright (recomputing it would cost its own size in memory anyway), and so is the last `held_tail` fraction
    of the cuts: for budgets between Chen's and store-all, the top of the network is cheaper to hold than to
    recompute. `outer` None: no checkpoint is held at all, every value is recomputed from the graph's inputs
    (for budgets under which nothing may stay alive across the forward's widest op)."""
    cuts, crossing = _cuts(problem)
    n = problem.n
    classes = [HOLD] * n
    movable = problem.movable
    for i in range(n):
        if movable[i]:
            classes[i] = REUSE if inner is None else DROP
    count = len(cuts)
    if count == 0:
        return plan_of_classes(problem, classes)
    tail = cuts[max(0, min(count - outer, int(count * (1 - held_tail))))] if outer else problem.n
    for j in range(count):
        level = (HOLD if outer and (j + 1) % outer == 0 else
                 REUSE if inner is not None and (j + 1) % inner == 0 else None)
        if level is None:
            continue
        for i in crossing[j]:
            if movable[i]:
                classes[i] = max(classes[i], level)
    for i in range(n):
        if movable[i] and i >= tail:
            classes[i] = HOLD if classes[i] == REUSE or inner is None else classes[i]
    return plan_of_classes(problem, classes)


MAX_CUT_VALUES = 64  # a position crossed by more values than this is no narrow point


def _cuts(problem: Problem) -> tuple[list[int], list[list[int]]]:
    """Positions in the forward region and, for each, the movable outputs made at or before it that forward
    ops after it read: holding those splits the forward region in two. Positions crossed by more bytes than a
    neighbour, or by many values, are skipped, so segments end at the graph's narrow points (articulation
    points in a residual network)."""
    cached = problem.__dict__.get("_cut_cache")
    if cached is not None:
        return cached
    end = problem.forward_end
    movable, users, size = problem.movable, problem.users, problem.size
    last_forward_reader = [max((u for u in users[i] if u < end), default=-1) for i in range(problem.n)]
    open_values: dict[int, None] = {}
    open_bytes = 0
    closing: dict[int, list[int]] = {}
    positions: list[int] = []
    crossing: list[list[int]] = []
    weights: list[int] = []
    for p in range(end):
        for i in closing.pop(p, ()):
            del open_values[i]
            open_bytes -= size[i]
        if movable[p] and last_forward_reader[p] > p:
            open_values[p] = None
            open_bytes += size[p]
            closing.setdefault(last_forward_reader[p], []).append(p)
        if not movable[p] or len(open_values) > MAX_CUT_VALUES:
            continue
        positions.append(p)
        # p itself is the cut when nothing crosses (the forward region's last op)
        crossing.append(list(open_values) or [p])
        weights.append(open_bytes)
    narrow = [j for j in range(len(positions))
              if weights[j] == 0 or weights[j] <= 1.5 * min(weights[max(0, j - 1):j + 2])]
    result = ([positions[j] for j in narrow], [crossing[j] for j in narrow])
    problem.__dict__["_cut_cache"] = result
    return result


def _structured(problem: Problem, pool: _Pool) -> None:
    """Evaluate segmented schemes over a geometric range of segment lengths: one level (Chen's), then two
    (outer checkpoints held, inner ones reused, the rest dropped), inner segments short enough that their
    repeated recomputation stays within a few forward passes."""
    pool.evaluate(plan_of_classes(problem, [REUSE] * problem.n))
    count = len(_cuts(problem)[0])
    if count == 0:
        return
    steps = 32
    lengths = sorted({max(1, round(count ** (e / steps))) for e in range(steps + 1)})
    # from Chen's sqrt(n) outwards, so that a tight work limit still covers the middle of the front
    middle = math.sqrt(count)
    by_distance = sorted(lengths, key=lambda k: abs(math.log(k / middle)))
    for held_tail in (0.0, 0.5):
        for outer in by_distance:
            pool.evaluate(_segment_plan(problem, outer, None, held_tail))
    for outer in by_distance:
        for inner in sorted({max(2, round(outer ** f)) for f in (0.34, 0.5, 0.67)}):
            if inner < outer and inner <= 32:
                pool.evaluate(_segment_plan(problem, outer, inner))
    for inner in lengths:
        if inner <= 32:
            pool.evaluate(_segment_plan(problem, None, inner))
    for held_tail in (0.25, 0.75, 0.125, 0.375, 0.625, 0.875):
        for outer in by_distance:
            pool.evaluate(_segment_plan(problem, outer, None, held_tail))


def _local_search(problem: Problem, pool: _Pool, grid: list[int], pairs: bool) -> None:
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


PERTURBATION_ROUNDS = 4


def _perturbed_search(problem: Problem, pool: _Pool) -> None:
    """Iterated local search: from each point of the front, change a few entries at random (seeded, so the
    front stays the same on every call), then repair to the point's peak and improve; repeated while that finds
    cheaper plans, up to PERTURBATION_ROUNDS rounds."""
    rng = random.Random(0)
    for _ in range(PERTURBATION_ROUNDS):
        before = [(c.peak, c.cost) for c in pool.front()]
        for point in pool.front():
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
        if [(c.peak, c.cost) for c in pool.front()] == before:
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


def _descend(pool: _Pool, state: tuple[int, ...], budget: int) -> tuple[int, ...] | None:
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


def _ascend(pool: _Pool, state: tuple[int, ...], budget: int) -> tuple[int, ...]:
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


def _improve(pool: _Pool, state: tuple[int, ...], budget: int, pairs: bool) -> None:
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


def _pair_move(pool: _Pool, state: tuple[int, ...], cost: float, budget: int
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
DEFAULT_WORK = 6_000_000  # schedule steps the fast solver may build and simulate (10-20 s of Python)


def _front(problem: Problem, work: int = DEFAULT_WORK, grid_points: int = 24) -> list[_Candidate]:
    """The Pareto front of every plan the search evaluates. The search stops after `work` schedule steps, a
    count rather than a time, so the front is the same on every call and every machine: that is what makes
    the cost of `solve` fall or stay when the budget grows. The front is kept on the problem (treated as
    immutable once solved), so a sweep over budgets searches once."""
    fronts = problem.__dict__.setdefault("_fronts", {})
    if work in fronts:
        return fronts[work]
    small = sum(problem.movable) <= LOCAL_SEARCH_OPS
    pool = _Pool(problem, work, keep_profiles=small)
    try:
        pool.evaluate(plan_of_classes(problem, [HOLD] * problem.n))
        _structured(problem, pool)
        if small:
            low = max(floor(problem), 1)
            top = max(p for p, _ in pool.seen.values())
            grid = sorted({int(low + (top - low) * j / grid_points) for j in range(grid_points + 1)}, reverse=True)
            _local_search(problem, pool, grid, pairs=False)
            # budgets just under each point of the front so far, first with single changes, then with pairs
            for pairs in (False, True):
                grid = sorted({c.peak - 1 for c in pool.front() if c.peak - 1 >= low}, reverse=True)
                _local_search(problem, pool, grid, pairs)
            _perturbed_search(problem, pool)
    except _OutOfWork:
        pass
    fronts[work] = pool.front()
    return fronts[work]


def pareto(problem: Problem, work: int = DEFAULT_WORK) -> list[Solution]:
    """Schedules of the fast solver from the least peak it finds to store-all, each cheaper than every
    schedule before it: peak rises and cost falls along the list. Nothing here depends on a budget."""
    return [make_solution(problem, build_schedule(problem, c.plan), "fast") for c in _front(problem, work)]


def best_under(front: list[Solution], budget: int) -> Solution | None:
    """The cheapest schedule of a front whose peak fits `budget`."""
    fitting = [s for s in front if s.peak <= budget]
    return min(fitting, key=lambda s: (s.cost, s.peak)) if fitting else None


def solve(problem: Problem, budget: int, work: int = DEFAULT_WORK) -> Solution | None:
    """The cheapest schedule the fast solver finds whose simulated peak fits `budget`; None when it finds none
    (always when `budget < floor(problem)`, which says why). The candidates do not depend on the budget, so
    the cost never rises when the budget grows."""
    if budget < floor(problem):
        return None
    fitting = [c for c in _front(problem, work) if c.peak <= budget]
    if not fitting:
        return None
    chosen = min(fitting, key=lambda c: (c.cost, c.peak))
    solution = make_solution(problem, build_schedule(problem, chosen.plan), "fast")
    if solution.peak > budget:
        raise InternalError(f"fast solver: simulated peak {solution.peak} over the budget {budget}")
    return solution


def least_peak(problem: Problem, max_extra_cost: float, work: int = DEFAULT_WORK) -> Solution | None:
    """The schedule of least peak among the fast solver's whose extra cost is at most `max_extra_cost` (for
    `--budget auto`, the cost of one forward pass: Chen et al.'s 2*sqrt(n) on a chain)."""
    within = [c for c in _front(problem, work) if c.cost - problem.baseline_cost <= max_extra_cost + 1e-9]
    if not within:
        return None
    chosen = min(within, key=lambda c: (c.peak, c.cost))
    return make_solution(problem, build_schedule(problem, chosen.plan), "fast")


# ---------------------------------------------------------------------------------------------------------------
# Problems for tests and benchmarks


def chain(n: int, activation_bytes: int = 1, forward_cost: float = 1.0, backward_cost: float = 2.0,
          static_bytes: int = 0) -> Problem:
    """A uniform chain of n layers and its backward pass (2n ops).

    Forward op i (index i) reads layer i-1's output. The backward op of layer i (index 2n-1-i) reads layer i's
    input (the output of layer i-1; the graph input is static for layer 0) and the gradient from the backward op
    of layer i+1; the top one reads the chain's output in its place. The last backward output is kept."""
    size = [activation_bytes] * (2 * n)
    cost = [forward_cost] * n + [backward_cost] * n
    inputs: list[list[int]] = [[i - 1] if i else [] for i in range(n)]
    for layer in range(n - 1, -1, -1):
        index = 2 * n - 1 - layer
        reads = [layer - 1] if layer else []
        reads.append(index - 1)  # the gradient from above (the chain's output for the top layer)
        inputs.append(reads)
    return Problem(size, cost, inputs, [True] * n + [False] * n, {2 * n - 1}, static_bytes)


def random_training_dag(forward_ops: int, seed: int = 0, skip: float = 0.3, reach: int = 8,
                        fixed: float = 0.05, max_size: int = 8, static_bytes: int = 0) -> Problem:
    """A random forward DAG and its backward pass: forward op i reads op i-1 and, with probability `skip`, one
    more op at most `reach` ops back (a skip connection; `reach` 0: any earlier op); a fraction `fixed` of
    forward ops may not be recomputed (random ops). The backward op of forward op f reads f's inputs (the saved
    activations; f itself when it reads none) and the backward ops of f's readers (the gradient of f's output);
    the backward op of the last forward op reads it as the loss. The backward op of the first forward op is
    kept, as a gradient output."""
    rng = random.Random(seed)
    size = [rng.randint(1, max_size) for _ in range(forward_ops)]
    cost = [float(rng.randint(1, 10)) for _ in range(forward_ops)]
    inputs: list[list[int]] = []
    for i in range(forward_ops):
        reads = [i - 1] if i else []
        if i > 1 and rng.random() < skip:
            reads.append(rng.randrange(max(0, i - 1 - reach) if reach else 0, i - 1))
        inputs.append(reads)
    recomputable = [rng.random() >= fixed for _ in range(forward_ops)]
    readers: list[list[int]] = [[] for _ in range(forward_ops)]
    for i, reads in enumerate(inputs):
        for j in reads:
            readers[j].append(i)
    grad = {}
    for f in range(forward_ops - 1, -1, -1):
        index = forward_ops + (forward_ops - 1 - f)
        grad[f] = index
        reads = list(inputs[f]) or [f]
        reads += [grad[r] for r in readers[f]] or [f]
        inputs.append(sorted(set(reads)))
        size.append(size[f])
        cost.append(2 * cost[f])
        recomputable.append(False)
    return Problem(size, cost, inputs, recomputable, {grad[0]}, static_bytes)
