"""The recomputation solvers on abstract problems: speed and extra cost of the fast solver, and its gap to the
exact (Checkmate MILP) optimum on small problems.

    .venv/bin/python bench/bench_solver.py [--sizes 100,1000,10000] [--milp-time 60] [--no-milp]
    .venv/bin/python bench/bench_solver.py --solvers [--cp-time 60]     # every solver against the optimum, and
                                                                        # the Gemm+Tanh chains
        [--prune 400000 --anneal 1600000]  # the fast plan of each budget pruned and annealed, as mirror makes it
    .venv/bin/python bench/bench_solver.py --bound 150 [--milp-time 20]  # the lower bound against HiGHS's optima
    .venv/bin/python bench/bench_solver.py --front [--front-sizes 100,500,10000] [--front-seeds 1,2] [--against DIR]
                                                        # CPU seconds of `solvers.front` and a digest of its front
    .venv/bin/python bench/bench_solver.py --rises --front-seeds 1,2,3,4   # does the cost rise with the budget,
                                                                           # pruning under each budget first?
    .venv/bin/python bench/bench_solver.py --dags --front-seeds 1,2,3,4 [--cp-time 30]   # the fast plan as mirror
                                                        # --budget makes it against CP-SAT from it, on 30-op DAGs

`--front`: for uniform chains and random training DAGs (`--front-seeds`, default 1) of n forward ops, the CPU
seconds of `solvers.front` (best of 3, `time.process_time`), its number of points and a digest of their (peak,
cost). With `--against DIR`, the same in a fresh process that imports the `onnxgrad` under DIR (another checkout:
the peer), run problem by problem beside this tree's, with the ratio of the times and the two fronts compared at
every budget between them: where this one is cheaper or costlier, where only one fits, and the geometric mean and
worst of (extra cost + 1) / (the peer's + 1) where both fit ("same": the identical front).

`--sizes ''` skips the scale table.

Scale table: uniform chains of n layers and random training DAGs of n forward ops (2n ops with the backward;
`solver.chain`, `solver.random_training_dag`, seed 1). `front s` is the time of the first `solve` on a problem
(it builds the whole front; later budgets on the same problem pick from it), then for budgets of 30%, 50% and
70% of the unmirrored peak: the schedule's simulated peak (as a fraction of the unmirrored one) and its extra
cost in forward passes. `chen` is the least peak at <= 1 extra forward pass, in activations, beside 2*sqrt(n).

Gap table: chains and random DAGs of 6 to 14 forward ops, at budgets from the floor to the unmirrored peak:
the MILP's cost (status, time) and the fast solver's, as total cost and as extra cost over the baseline.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# `--code DIR` (the peer of --against) imports onnxgrad from DIR rather than from this checkout
_CODE = sys.argv[sys.argv.index("--code") + 1] if "--code" in sys.argv else None
sys.path.insert(0, _CODE or str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from onnxgrad.memory import solvers  # noqa: E402
from onnxgrad.memory.solvers import floor, simulate, solve_milp  # noqa: E402
from solver_problems import chain, random_training_dag, tanh_chain  # noqa: E402


PRUNE = 0  # --prune: schedule steps this tree's fast solver may spend pruning its fronts (Limits.prune_work)
ANNEAL = 0  # --anneal: schedule steps it may spend moving the recomputations of its plan for a budget


def limits(budget: int | None = None) -> solvers.Limits:
    """The fast solver's limits; with --anneal and a budget, as `mirror --budget` asks for that budget (pruned
    toward it, then annealed)."""
    if ANNEAL and budget is not None:
        return solvers.Limits(prune_work=PRUNE, prune_below=budget, anneal_work=ANNEAL)
    return solvers.Limits(prune_work=PRUNE) if PRUNE else solvers.Limits()


def fast_under(problem: solvers.Problem, front: solvers.Front, seconds: float, budget: int
               ) -> tuple[solvers.Solution | None, float]:
    """The fast solver's plan for `budget` and its seconds: from `front` (made in `seconds`), or with --anneal
    from a front made for the budget."""
    if not ANNEAL:
        return front.best_under(budget), seconds
    started = time.perf_counter()
    return solvers.front(problem, limits(budget)).best_under(budget), time.perf_counter() - started


def solve(problem: solvers.Problem, budget: int) -> solvers.Solution | None:
    return solvers.solve_fast(problem, budget, limits())


FRACTIONS = (0.3, 0.5, 0.7)


def scale_table(sizes: list[int]) -> None:
    print("| problem | ops | front s | " + " | ".join(f"{f:.0%}: peak, extra fwd" for f in FRACTIONS)
          + " | chen (2*sqrt n) |")
    print("|---|---|---|" + "---|" * len(FRACTIONS) + "---|")
    for kind in ("chain", "dag"):
        for n in sizes:
            problem = chain(n) if kind == "chain" else random_training_dag(n, 1)
            forward_cost = sum(problem.cost[i] for i in range(problem.n) if problem.recomputable[i])
            top = simulate(problem, problem.baseline).peak
            started = time.perf_counter()
            front = solvers.front(problem, limits())  # every budget below answers from it
            elapsed = time.perf_counter() - started
            cells = []
            for f in FRACTIONS:
                s = front.best_under(int(f * top))
                cells.append("none" if s is None else f"{s.peak / top:.2f}, {s.extra_cost / forward_cost:.2f}")
            chen = ""
            if kind == "chain":
                least = min(c.peak for c in front.points if c.cost - problem.baseline_cost <= forward_cost)
                chen = f"{least} ({2 * math.sqrt(n):.0f})"
            print(f"| {kind} {n} | {problem.n} | {elapsed:.1f} | " + " | ".join(cells) + f" | {chen} |",
                  flush=True)


def gap_table(milp_time: float) -> None:
    problems = [(f"chain {n}", chain(n)) for n in (6, 10, 14)]
    problems += [(f"dag 12 seed {s}", random_training_dag(12, s)) for s in range(4)]
    problems += [(f"dag 16 seed {s} skip .5", random_training_dag(16, 100 + s, skip=0.5)) for s in range(2)]
    print("| problem | ops | budget | milp cost | milp status | milp s | fast cost | total ratio | extra ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for name, problem in problems:
        low, top = floor(problem), simulate(problem, problem.baseline).peak
        for j in range(5):
            budget = low + (top - low) * j // 4
            started = time.perf_counter()
            try:
                exact = solve_milp(problem, budget, time_limit=milp_time)
                verdict = "infeasible"
            except TimeoutError:
                exact, verdict = None, "no schedule in time"
            took = time.perf_counter() - started
            fast = solve(problem, budget)
            if exact is None:
                print(f"| {name} | {problem.n} | {budget} | none | {verdict} | {took:.1f} | "
                      f"{'none' if fast is None else fast.cost} | | |", flush=True)
                continue
            status = "optimal" if exact.status == "optimal" else f"gap {exact.gap:.0%}"
            total = fast.cost / exact.cost if fast else math.inf
            extra = (fast.extra_cost / exact.extra_cost if exact.extra_cost else
                     (1.0 if fast and not fast.extra_cost else math.inf)) if fast else math.inf
            if exact.status == "optimal":
                ratios.append((total, extra))
            print(f"| {name} | {problem.n} | {budget} | {exact.cost:g} | {status} | {took:.1f} | "
                  f"{'none' if fast is None else f'{fast.cost:g}'} | {total:.3f} | {extra:.3f} |", flush=True)
    if ratios:
        totals = [t for t, _ in ratios]
        extras = [e for _, e in ratios]
        print(f"\nagainst proven optima ({len(ratios)} budgets): total cost ratio max {max(totals):.3f}, "
              f"mean {sum(totals) / len(totals):.4f}; extra cost ratio max {max(extras):.3f}, "
              f"within 5% of total: {sum(t <= 1.05 for t in totals)}/{len(totals)}")


def solvers_table(cp_time: float, milp_time: float) -> None:
    """Per problem and budget: each solver's extra cost and seconds, the best proven optimum (HiGHS on small
    problems, CP-SAT from the fast plan), and each heuristic's gap to it."""
    problems = [(f"chain {n}", chain(n)) for n in (10, 32, 100)]
    problems += [(f"dag 10 seed {s}", random_training_dag(10, s)) for s in (1, 11)]
    problems += [("dag 30 seed 4", random_training_dag(30, 4))]
    print("| problem | ops | budget | fast extra | fast s | dp extra | dp s | exact extra (status, gap) | exact s | "
          "optimum | bound | fast / optimum | dp / optimum |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, problem in problems:
        started = time.perf_counter()
        fast = solvers.front(problem, limits())
        fast_s = time.perf_counter() - started
        started = time.perf_counter()
        dp = solvers.dp_front(problem)
        dp_s = time.perf_counter() - started
        low, top = fast.least_peak, problem.baseline_peak
        for j in range(4):
            budget = low + (top - low) * j // 4
            (f, f_s), d = fast_under(problem, fast, fast_s, budget), dp.best_under(budget)
            started = time.perf_counter()
            exact = solvers.solve_cp(problem, budget, solvers.Limits(time_limit=cp_time), hint=f)
            cp_s = time.perf_counter() - started
            optimum = exact.extra_cost if exact.status == "optimal" else None
            if optimum is None and problem.n <= 24:
                m = solvers.solve_milp(problem, budget, time_limit=milp_time)
                optimum = m.extra_cost if m is not None and m.status == "optimal" else None

            def ratio(s):
                if s is None or optimum is None:
                    return "-"
                return "1.000" if s.extra_cost == optimum else (f"{s.extra_cost / optimum:.3f}" if optimum else "inf")
            print(f"| {name} | {problem.n} | {budget} | {f.extra_cost:g} | {f_s:.2f} | "
                  f"{'none' if d is None else f'{d.extra_cost:g}'} | {dp_s:.2f} | {exact.extra_cost:g} ({exact.status}, "
                  f"{exact.gap:.0%}) | {cp_s:.1f} | {'-' if optimum is None else f'{optimum:g}'} | "
                  f"{solvers.extra_cost_bound(problem, budget):.4g} | {ratio(f)} | {ratio(d)} |", flush=True)


def bound_table(problems: int, milp_time: float) -> None:
    """`extra_cost_bound` against HiGHS's proven optima on random training DAGs of 2-8 forward ops (random skips,
    reach, fixed ops and static bytes; seeds 0..problems-1) at four budgets each from the floor to the plain peak:
    how often the bound is the optimum, how far below it is otherwise, and any case above it (a bug)."""
    import random
    rows = []
    for seed in range(problems):
        rng = random.Random(seed)
        problem = random_training_dag(rng.randint(2, 8), seed, skip=rng.random(), reach=rng.randint(0, 5),
                                      fixed=rng.random() * 0.3, static_bytes=rng.randint(0, 5))
        low, top = solvers.floor(problem), problem.baseline_peak
        for budget in sorted({low, low + (top - low) // 4, (low + top) // 2, top - 1}):
            if budget < low:
                continue
            try:
                exact = solvers.solve_milp(problem, budget, time_limit=milp_time)
            except solvers.SolverTimeout:
                continue
            if exact is None or exact.status != "optimal":
                continue
            rows.append((solvers.extra_cost_bound(problem, budget), exact.extra_cost))
    above = sum(b > e + 1e-9 for b, e in rows)
    tight = sum(abs(b - e) <= 1e-9 for b, e in rows)
    positive = [(b, e) for b, e in rows if e > 0]
    mean = sum(b / e for b, e in positive) / len(positive) if positive else 1.0
    print("| proven optima | bound = optimum | bound / optimum where the optimum > 0: mean, least | bound > optimum |")
    print("|---|---|---|---|")
    print(f"| {len(rows)} | {tight} | {mean:.3f}, {min((b / e for b, e in positive), default=1.0):.3f} | {above} |")


def tanh_table(cp_time: float) -> None:
    """The Gemm+Tanh chains' training graphs (width 256, batch 4096, MSE) at fractions of the graph's unmirrored
    peak: the floor and the least peak found, the fast and DP plans in extra forward passes, and CP-SAT from the
    fast plan."""
    print("| problem | ops | budget | floor | least peak (fast) | fast s | fast extra fwd | dp extra fwd | "
          "CP-SAT extra fwd (status, gap) | CP-SAT s | bound, extra fwd |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layers, fractions in ((10, (0.45, 0.4925, 0.55, 0.7)), (32, (0.3, 0.316, 0.339, 0.5))):
        bp, peak = tanh_chain(layers)
        problem = bp.problem
        started = time.perf_counter()
        fast = solvers.front(problem, limits())
        fast_s = time.perf_counter() - started
        dp = solvers.dp_front(problem)
        low = solvers.floor(problem)
        for fraction in fractions:
            # the problem counts the small Constant nodes as alive throughout, the graph frees them
            budget = int(fraction * peak) + max(0, problem.baseline_peak - peak)
            (f, f_s), d = fast_under(problem, fast, fast_s, budget), dp.best_under(budget)

            def passes(s):
                return "none" if s is None else f"{s.extra_cost / bp.forward_cost:.2f}"
            exact, cp_s = None, 0.0
            if f is not None:
                started = time.perf_counter()
                exact = solvers.solve_cp(problem, budget, solvers.Limits(time_limit=cp_time), hint=f)
                cp_s = time.perf_counter() - started
            cp = "below the floor" if budget < low else (
                "none" if exact is None else f"{passes(exact)} ({exact.status}, {exact.gap:.0%})")
            bound = solvers.extra_cost_bound(problem, budget)
            print(f"| tanh chain {layers} | {problem.n} | {fraction}x | {low / peak:.4f}x | "
                  f"{fast.least_peak / peak:.4f}x | {f_s:.2f} | {passes(f)} | {passes(d)} | {cp} | {cp_s:.1f} | "
                  f"{'-' if bound is None else f'{bound / bp.forward_cost:.3f}'} |", flush=True)


def dags_table(seeds: list[int], cp_time: float) -> None:
    """On random 30-op DAGs, at four budgets from the least peak toward the plain peak (0, 25, 50 and 75% of the
    way): the fast plan made as `mirror --budget` makes it (`budget.solver_limits`: the front pruned toward the
    budget, its cheapest plan under it annealed), its seconds, and CP-SAT's plan from it as a hint."""
    from onnxgrad.memory.budget import solver_limits
    print("| DAG seed | budget | fast extra | fast s | CP-SAT from it (status, gap) | fast / CP-SAT |")
    print("|---|---|---|---|---|---|")
    total = [0.0, 0.0]
    worst = 1.0
    for seed in seeds:
        problem = random_training_dag(30, seed)
        low, top = solvers.front(problem).least_peak, problem.baseline_peak
        for j in range(4):
            budget = low + (top - low) * j // 4
            started = time.perf_counter()
            fast = solvers.front(problem, solver_limits(problem, target=budget)).best_under(budget)
            fast_s = time.perf_counter() - started
            exact = solvers.solve_cp(problem, budget, solvers.Limits(time_limit=cp_time), hint=fast)
            ratio = fast.extra_cost / exact.extra_cost if exact.extra_cost else 1.0
            worst = max(worst, ratio)
            total[0] += fast.extra_cost
            total[1] += exact.extra_cost
            print(f"| {seed} | {budget} | {fast.extra_cost:g} | {fast_s:.2f} | {exact.extra_cost:g} ({exact.status}, "
                  f"{exact.gap:.0%}) | {ratio:.3f} |", flush=True)
    print(f"\nsum of extra costs: fast {total[0]:g}, CP-SAT {total[1]:g}; worst fast / CP-SAT {worst:.3f}")


def front_problem(kind: str, n: int, seed: int = 1):
    return chain(n) if kind == "chain" else random_training_dag(n, seed)


def measure_front(kind: str, n: int, repeat: int = 3, seed: int = 1) -> dict:
    """CPU seconds of `solvers.front` on a fresh problem (best of `repeat`), and the front's (peak, cost)s."""
    best, points = math.inf, []
    for _ in range(repeat):
        problem = front_problem(kind, n, seed)  # fresh: nothing the problem caches carries over between runs
        started = time.process_time()
        front = solvers.front(problem, limits())
        best = min(best, time.process_time() - started)
        points = [(c.peak, c.cost) for c in front.points]
    return {"seconds": best, "points": points, "ops": problem.n, "base": problem.baseline_cost}


def digest(points: list) -> str:
    return hashlib.sha1(repr([(p, round(c, 6)) for p, c in points]).encode()).hexdigest()[:10]


def _cheapest(front: list, budget: int) -> float:
    return min((c for p, c in front if p <= budget), default=math.inf)


def compare(points: list, peer: list, base: float) -> dict:
    """The two fronts at every budget from the lower of their least peaks to the higher of their top peaks: at
    how many this front is cheaper or costlier (extra cost over `base`), reaches where the peer does not or the
    other way round, and the ratio of extra costs ((this + 1) / (peer + 1), in the problem's cost units) at the
    budgets both reach: geometric mean and worst."""
    budgets = range(min(points[0][0], peer[0][0]), max(points[-1][0], peer[-1][0]) + 1)
    out = {"budgets": 0, "cheaper": 0, "costlier": 0, "only this": 0, "only peer": 0, "ratios": []}
    for b in budgets:
        this, other = _cheapest(points, b) - base, _cheapest(peer, b) - base
        out["budgets"] += 1
        if math.isinf(this) or math.isinf(other):
            key = None if math.isinf(this) and math.isinf(other) else ("only peer" if math.isinf(this) else "only this")
            if key:
                out[key] += 1
            continue
        tol = 1e-9 * (1 + abs(other))
        out["cheaper"] += this < other - tol
        out["costlier"] += this > other + tol
        out["ratios"].append((this + 1) / (other + 1))
    return out


def front_table(sizes: list[int], against: str | None, seeds: list[int]) -> None:
    head = "| problem | ops | s |" if against is None else ("| problem | ops | peer s | s | peer / this | budgets | "
                                                          "cheaper | costlier | only this, only peer fits | "
                                                          "extra cost / peer's: geo mean, worst |")
    print(head + " points | digest |")
    print("|---" * (head.count("|") + 1) + "|")
    for kind in ("chain", "dag"):
        for n in sizes:
            for seed in (seeds if kind == "dag" else [1]):
                peer = None
                if against is not None:
                    out = subprocess.run([sys.executable, __file__, "--front-one", f"{kind}:{n}:{seed}", "--code",
                                          against], check=True, capture_output=True, text=True,
                                         env={**os.environ, "PYTHONPATH": against}).stdout
                    peer = json.loads(out.strip().splitlines()[-1])
                this = measure_front(kind, n, seed=seed)
                cells = [f"{kind} {n}" + (f" seed {seed}" if kind == "dag" else ""), str(this["ops"])]
                if peer is not None:
                    pts, other = [tuple(x) for x in this["points"]], [tuple(x) for x in peer["points"]]
                    c = compare(pts, other, this["base"])
                    ratios = c["ratios"] or [1.0]
                    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
                    cells += [f"{peer['seconds']:.2f}", f"{this['seconds']:.2f}",
                              f"{peer['seconds'] / this['seconds']:.2f}", str(c["budgets"]),
                              str(c["cheaper"]), str(c["costlier"]), f"{c['only this']}, {c['only peer']}",
                              "same" if pts == other else f"{geo:.3f}, {max(ratios):.2f}"]
                else:
                    cells.append(f"{this['seconds']:.2f}")
                cells += [str(len(this["points"])), digest(this["points"])]
                print("| " + " | ".join(cells) + " |", flush=True)


def rises_table(seeds: list[int], works: list[int]) -> None:
    """`mirror --budget` prunes the schedules under its budget first (`Limits.prune_below`), so each budget gets
    a front of its own: at every integer budget from the least peak to the plain peak of random 30-op DAGs, the
    cheapest plan's extra cost, and where it rises as the budget grows by one."""
    print("| problem | pruning steps | budgets | rises (budget: cost before, after) |")
    print("|---|---|---|---|")
    for seed in seeds:
        problem = random_training_dag(30, seed)
        low = solvers.front(problem, solvers.Limits()).least_peak
        for work in works:
            rises, before = [], None
            for budget in range(low, problem.baseline_peak + 1):
                limits = solvers.Limits(prune_work=work, prune_below=budget)
                cost = solvers.front(problem, limits).best_under(budget).extra_cost
                if before is not None and cost > before + 1e-9:
                    rises.append(f"{budget}: {before:g}, {cost:g}")
                before = cost
            print(f"| dag 30 seed {seed} | {work} | {low}-{problem.baseline_peak} | {'; '.join(rises) or 'none'} |",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="100,1000,10000")
    parser.add_argument("--milp-time", type=float, default=60.0)
    parser.add_argument("--no-milp", action="store_true")
    parser.add_argument("--solvers", action="store_true", help="only the table of every solver against the optimum")
    parser.add_argument("--cp-time", type=float, default=60.0)
    parser.add_argument("--front", action="store_true", help="only the CPU seconds and digest of solvers.front")
    parser.add_argument("--bound", type=int, metavar="N",
                        help="only extra_cost_bound against HiGHS's optima on N small random DAGs")
    parser.add_argument("--front-sizes", default="100,500,10000")
    parser.add_argument("--against", metavar="DIR", help="with --front: also time the onnxgrad under DIR")
    parser.add_argument("--prune", type=int, default=0, metavar="STEPS",
                        help="this tree's fast solver prunes its fronts within STEPS schedule steps (not the peer's)")
    parser.add_argument("--anneal", type=int, default=0, metavar="STEPS",
                        help="with --solvers: the fast plan of each budget is pruned toward it and annealed within "
                             "STEPS schedule steps, as mirror --budget makes it")
    parser.add_argument("--front-seeds", default="1", help="with --front: the random DAGs' seeds (comma-separated)")
    parser.add_argument("--rises", action="store_true",
                        help="only where the pruned plan's cost rises with the budget (random 30-op DAGs, seeds "
                             "--front-seeds, pruning work --rise-work)")
    parser.add_argument("--rise-work", default="5000,400000")
    parser.add_argument("--dags", action="store_true",
                        help="only the fast plan as mirror --budget makes it against CP-SAT from it, on random 30-op "
                             "DAGs (seeds --front-seeds), within --cp-time seconds")
    parser.add_argument("--front-one", help=argparse.SUPPRESS)  # kind:n:seed, as JSON (the peer's process)
    parser.add_argument("--code", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global PRUNE, ANNEAL
    PRUNE = args.prune if not args.front_one else 0
    ANNEAL = args.anneal if not args.front_one else 0
    if args.front_one:
        kind, n, seed = args.front_one.split(":")
        print(json.dumps(measure_front(kind, int(n), seed=int(seed))))
        return
    if args.bound:
        bound_table(args.bound, args.milp_time)
        return
    if args.dags:
        dags_table([int(s) for s in args.front_seeds.split(",")], args.cp_time)
        return
    if args.rises:
        rises_table([int(s) for s in args.front_seeds.split(",")], [int(w) for w in args.rise_work.split(",")])
        return
    if args.front:
        front_table([int(s) for s in args.front_sizes.split(",")], args.against,
                    [int(s) for s in args.front_seeds.split(",")])
        return
    if args.solvers:
        solvers_table(args.cp_time, args.milp_time)
        print()
        tanh_table(args.cp_time)
        return
    if args.sizes:
        scale_table([int(s) for s in args.sizes.split(",")])
        print()
    if not args.no_milp:
        gap_table(args.milp_time)


if __name__ == "__main__":
    main()
