"""The recomputation solvers on abstract problems: the simulator against hand-computed and brute-force peaks,
schedule validation, the floor, the fast solver's guarantees (fits the budget, cost monotone in the budget,
within 5% of the exact optimum, Chen's sqrt(n) on chains) and the Checkmate MILP as the oracle."""
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxgrad.errors import UsageError
from onnxgrad.memory.solvers import (HOLD, REUSE, Problem, best_under, build_schedule, floor, make_solution,
                                     plan_of_classes, simulate, solve_milp, validate)
from onnxgrad.memory import solvers
from solver_problems import chain, random_training_dag


def pareto(problem, work):
    """The fast solver's front as a list of solutions."""
    return solvers.front(problem, solvers.Limits(work=work)).solutions()


def solve(problem, budget, work=solvers.DEFAULT_WORK):
    return solvers.solve_fast(problem, budget, solvers.Limits(work=work))


def least_peak(problem, max_extra_cost, work):
    return solvers.front(problem, solvers.Limits(work=work)).least_peak_within(max_extra_cost)


WORK = 300_000  # the fast solver's work limit in these tests: about a second per small problem


def small() -> Problem:
    """0 -> 1 -> 2 (kept), and 3 reads 0 and 2; sizes 1, 2, 4, 8 and 16 static bytes."""
    return Problem(size=[1, 2, 4, 8], cost=[1.0, 2.0, 3.0, 4.0], inputs=[[], [0], [1], [0, 2]],
                   recomputable=[True, True, False, False], keep={2}, static_bytes=16)


# ---------------------------------------------------------------------------------------------------------------
# simulate


def test_simulate_by_hand():
    p = small()
    sim = simulate(p, [0, 1, 2, 3])
    # step 0: 0 (1); step 1: 0, 1 (3); step 2: 0, 1, 2 (7), then 1 freed; step 3: 0, 2, 3 (13), then 0 goes
    # (3, which nothing reads, is held to the end, as onnxruntime does)
    assert sim.live_after == [16 + 1, 16 + 3, 16 + 5, 16 + 12]
    assert (sim.peak, sim.peak_step) == (16 + 13, 3)
    assert sim.cost == 10.0


def test_simulate_recomputation_by_hand():
    p = small()
    # 0 freed after 1 reads it, recomputed for 3: the second copy lives only through step 4
    sim = simulate(p, [0, 1, 2, 0, 3])
    assert sim.live_after == [16 + 1, 16 + 3 - 1, 16 + 4, 16 + 5, 16 + 12]
    assert sim.peak == 16 + 1 + 4 + 8
    assert sim.cost == 11.0


def test_unread_outputs_are_held_to_the_end_as_kept_ones():
    p = Problem(size=[5, 7, 3], cost=[1, 1, 1], inputs=[[], [], [0]], recomputable=[True, True, True],
                keep={2})
    sim = simulate(p, [0, 1, 2])
    # 1 is read by nobody: onnxruntime holds such an output to the end of the run (a kept op, then)
    assert 1 in p.keep and not p.movable[1]
    assert sim.live_after == [5, 12, 10]
    assert sim.peak == 15


def test_chain_baseline_peak():
    # store-all on a chain of n layers holds every activation when the top backward op runs
    for n in (1, 2, 5, 16):
        p = chain(n)
        assert simulate(p, p.baseline).peak == n + 1
        assert floor(p) == min(3, n + 1)


def _reference_peak(problem: Problem, schedule: list[int]) -> int:
    """Liveness by definition, step by step: a copy is live from its run to its last reader, or to the end when
    nothing reads it (a first run nothing reads: its own step only)."""
    latest: dict[int, int] = {}
    reader_of: dict[int, int] = {}
    for p, op in enumerate(schedule):
        for i in set(problem.inputs[op]):
            reader_of[latest[i]] = p
        latest[op] = p
    peak = 0
    for step in range(len(schedule)):
        live = problem.static_bytes
        for p, op in enumerate(schedule[:step + 1]):
            unread = p if schedule.index(op) == p else len(schedule)  # a copy nobody reads is held to the end
            last = len(schedule) if (op in problem.keep and latest[op] == p) else reader_of.get(p, unread)
            if last >= step:
                live += problem.size[op]
        peak = max(peak, live)
    return peak


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), forward=st.integers(1, 9), extra=st.integers(0, 6))
def test_simulate_matches_the_definition(seed, forward, extra):
    problem = random_training_dag(forward, seed)
    rng = random.Random(seed)
    schedule = problem.baseline
    movable = [i for i in range(problem.n) if problem.movable[i]]
    for _ in range(extra if movable else 0):
        # recompute an op and whatever it needs right before a random later position
        op = rng.choice(movable)
        at = rng.randrange(schedule.index(op) + 1, len(schedule) + 1)
        needed = sorted(_ancestors(problem, op) & set(movable)) + [op]
        schedule = schedule[:at] + needed + schedule[at:]
    validate(problem, schedule)
    sim = simulate(problem, schedule)
    peak = sim.peak
    assert peak == _reference_peak(problem, schedule)
    assert floor(problem) <= peak
    # every schedule whose first runs keep the baseline order costs at least the bound at its own peak
    assert solvers.extra_cost_bound(problem, peak) <= sim.cost - problem.baseline_cost + 1e-9
    # pruning keeps it valid and within its peak, and never costs more; under a budget that holds everything it
    # takes out every recomputation a single extra run made
    pruned, pruned_peak, pruned_cost, _ = solvers.prune(problem, schedule, peak, 10**9)
    validate(problem, pruned)
    assert simulate(problem, pruned).peak == pruned_peak <= peak
    assert pruned_cost == pytest.approx(simulate(problem, pruned).cost) and pruned_cost <= sim.cost + 1e-9
    if extra == 1 and peak <= problem.baseline_peak:
        assert solvers.prune(problem, schedule, problem.baseline_peak, 10**9)[0] == problem.baseline


def _ancestors(problem: Problem, op: int) -> set[int]:
    found, stack = set(), [op]
    while stack:
        for i in problem.inputs[stack.pop()]:
            if i not in found:
                found.add(i)
                stack.append(i)
    return found


# ---------------------------------------------------------------------------------------------------------------
# validate


@pytest.mark.parametrize("schedule,reason", [
    ([0, 1, 2], "never runs op 3"),
    ([1, 0, 2, 3], "op 1 reads op 0, which has not run"),
    ([0, 1, 2, 2, 3], "op 2 is not recomputable"),
    ([0, 1, 3, 2], "op 3 reads op 2, which has not run"),
    ([0, 1, 2, 3, 7], "7 is not an op index"),
], ids=["missing", "read-before-run", "fixed-twice", "out-of-order", "bad-index"])
def test_validate_rejects(schedule, reason):
    with pytest.raises(ValueError, match=reason):
        validate(small(), schedule)


def test_validate_rejects_fixed_ops_out_of_baseline_order():
    p = Problem([1, 1], [1, 1], [[], []], [False, False], set())
    with pytest.raises(ValueError, match="out of the baseline order"):
        validate(p, [1, 0])


def test_validate_rejects_a_kept_op_run_twice():
    p = Problem([1, 1], [1, 1], [[], [0]], [True, False], {0})
    with pytest.raises(ValueError, match="kept to the end and runs a second time"):
        validate(p, [0, 0, 1])


def test_problem_rejects_forward_references():
    with pytest.raises(ValueError, match="op 0 reads op 1"):
        Problem([1, 1], [1, 1], [[1], []], [True, True], set())


# ---------------------------------------------------------------------------------------------------------------
# floor and the fast solver


def test_floor_counts_kept_outputs_computed_before():
    # op 2 (kept) must run before the fixed op 3, so it is live when 3 runs: 16 + 1 (0) + 4 (2) + 8 (3)
    assert floor(small()) == 16 + 13


def test_all_hold_is_the_baseline():
    p = random_training_dag(20, 3)
    assert build_schedule(p, plan_of_classes(p, [HOLD] * p.n)) == p.baseline


def test_chen_segments_on_a_chain():
    # one level of segments of 4 on 16 layers: at most 4 checkpoints + 4 in a segment + the top's 2 + gradients
    p = chain(16)
    classes = [HOLD if (i + 1) % 4 == 0 else REUSE for i in range(p.n)]
    sim = simulate(p, build_schedule(p, plan_of_classes(p, classes)))
    assert sim.peak <= 11
    assert sim.cost - p.baseline_cost <= 16


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 1000), forward=st.integers(2, 24), kind=st.sampled_from(["dag", "chain"]),
       fractions=st.lists(st.floats(0.0, 1.2), min_size=2, max_size=6))
def test_fast_solver_fits_and_is_monotone(seed, forward, kind, fractions):
    problem = chain(forward) if kind == "chain" else random_training_dag(forward, seed)
    low, top = floor(problem), simulate(problem, problem.baseline).peak
    costs = []
    front = solvers.front(problem, solvers.Limits(work=WORK))
    for budget in sorted(int(low + f * (top - low)) for f in fractions):
        solution = front.best_under(budget) if budget >= floor(problem) else None
        if solution is None:
            costs.append(math.inf)
            continue
        validate(problem, solution.schedule)
        assert solution.peak == simulate(problem, solution.schedule).peak <= budget
        assert solvers.extra_cost_bound(problem, budget) <= solution.extra_cost + 1e-9
        costs.append(solution.cost)
    assert costs == sorted(costs, reverse=True), "cost rose with the budget"
    # store-all fits the unmirrored peak, at no extra cost
    assert solve(problem, top, work=WORK).extra_cost == 0


def test_front_is_a_pareto_front_of_valid_schedules():
    problem = random_training_dag(25, 7)
    front = pareto(problem, work=WORK)
    assert [s.peak for s in front] == sorted(s.peak for s in front)
    assert all(a.cost > b.cost for a, b in zip(front, front[1:]))
    for s in front:
        validate(problem, s.schedule)
        assert s.peak >= floor(problem)
        assert s.extra_cost == pytest.approx(s.cost - problem.baseline_cost)
        assert sum(s.recomputed.values()) == len(s.schedule) - problem.n


def test_infeasible_budgets():
    p = chain(8)
    assert solve(p, floor(p) - 1) is None
    assert solve_milp(p, floor(p) - 1, time_limit=10) is None
    # above the floor, yet below what any schedule reaches: 0 (kept... none here) and the fixed gradients
    q = Problem([4, 4, 4], [1, 1, 1], [[], [0], [0, 1]], [False, False, False], set())
    assert floor(q) == 12 and solve(q, 12).peak == 12 and solve(q, 11) is None


@pytest.mark.parametrize("n", [16, 64, 100])
def test_chen_sqrt_n_on_uniform_chains(n):
    """Chen et al. 2016: at most one extra forward pass holds about 2*sqrt(n) activations."""
    p = chain(n)
    forward_cost = float(n)
    front = pareto(p, work=WORK)
    within = [s for s in front if s.extra_cost <= forward_cost]
    least = min(s.peak for s in within)
    assert least <= 2 * math.sqrt(n) + 3, (least, 2 * math.sqrt(n))


# ---------------------------------------------------------------------------------------------------------------
# the exact solver as an oracle

ORACLE_CASES = [("chain", 5, 0), ("chain", 6, 0)] + [("dag", 8, seed) for seed in range(4)] + [("dag", 10, 11)]


@pytest.mark.parametrize("kind,size,seed", ORACLE_CASES, ids=[f"{k}{n}-{s}" for k, n, s in ORACLE_CASES])
def test_fast_solver_within_5_percent_of_the_milp(kind, size, seed):
    problem = chain(size) if kind == "chain" else random_training_dag(size, seed)
    low, top = floor(problem), simulate(problem, problem.baseline).peak
    front = pareto(problem, work=WORK)
    for budget in sorted({low, low + (top - low) // 3, low + 2 * (top - low) // 3, top}):
        exact = solve_milp(problem, budget, time_limit=30)
        fast = best_under(front, budget)
        if exact is None:
            assert fast is None, "the fast solver fits a budget the exact one calls infeasible"
            continue
        assert exact.status == "optimal"
        assert solvers.extra_cost_bound(problem, budget) <= exact.extra_cost + 1e-9
        validate(problem, exact.schedule)
        assert exact.peak <= budget
        assert fast is not None, f"budget {budget}: the MILP fits it, the fast solver does not"
        assert fast.cost <= 1.05 * exact.cost, (budget, fast.cost, exact.cost)
        assert fast.cost >= exact.cost - 1e-9, "the fast solver beat the optimum: the MILP misses schedules"


def test_milp_reports_a_time_limited_search():
    problem = chain(14)
    try:
        solution = solve_milp(problem, 6, time_limit=2)
    except TimeoutError as e:
        assert "no schedule found in 2 s" in str(e) and isinstance(e, UsageError)
        return
    assert solution.peak <= 6
    assert solution.status in ("optimal", "feasible")
    assert solution.gap is not None


def test_milp_solution_fields():
    problem = chain(4)
    solution = solve_milp(problem, 4)
    assert solution.solver == "milp" and solution.gap == pytest.approx(0, abs=1e-6)
    assert solution == make_solution(problem, solution.schedule, "milp", solution.gap, solution.status)
    assert set(solution.kept) | set(solution.recomputed) == set(range(problem.n))


def test_front_is_the_same_on_every_call():
    """Monotone by construction holds across calls only if the search is deterministic: a work limit, no
    clock, no unseeded randomness."""
    fronts = [[(s.peak, s.cost, tuple(s.schedule)) for s in pareto(random_training_dag(18, 5), work=WORK)]
              for _ in range(2)]
    assert fronts[0] == fronts[1]


def test_least_peak_within_one_forward_pass():
    p = chain(36)
    auto = least_peak(p, max_extra_cost=36.0, work=WORK)
    assert auto.extra_cost <= 36 and auto.peak <= 2 * 6 + 3
    assert least_peak(p, 0.0, work=WORK).peak == simulate(p, p.baseline).peak


def test_fast_solver_reaches_a_floor_that_needs_everything_recomputed():
    # under a budget of 24 nothing may stay alive across the forward's widest op (10, 11, 12: 8 bytes each), so
    # the backward recomputes the forward from its first op; solve_milp's optimum is 238 (23 s, so not rerun)
    problem = random_training_dag(12, 3)
    assert floor(problem) == 24
    solution = best_under(pareto(problem, work=WORK), 24)
    assert solution is not None and solution.cost <= 1.05 * 238


def test_milp_with_real_byte_sizes_fits_the_budget():
    # sizes of hundreds of MB put a byte under HiGHS's feasibility tolerance; the budget must still hold exactly
    unit = 123_456_789
    small_chain, large_chain = chain(4), chain(4, activation_bytes=unit, static_bytes=7 * unit + 3)
    for activations in (3, 4, 5):
        budget = 7 * unit + 3 + activations * unit
        exact = solve_milp(large_chain, budget)
        assert exact.peak <= budget
        assert exact.cost == solve_milp(small_chain, activations).cost
