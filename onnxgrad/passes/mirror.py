"""The mirror pass: recompute forward values in the backward pass instead of keeping them.

A policy decides and returns a `memory.plan.Plan`: `memory.mxnet` (MXNet's mirroring), or `memory.budget` (the
least recomputation whose peak fits `--budget`, found by `memory.solver`). `memory.plan.apply` rewrites the
graph to run the plan. The pass simulates the peak before and after, keeps the plan in the graph's metadata,
and puts it in the report with a reason per forward node.
"""
from __future__ import annotations

import json
import sys
import time

from .. import weights
from ..contract import FORWARD, MIRROR_KEY
from ..errors import UsageError
from ..memory import plan as plans
from ..memory import solver, sweep
from ..memory.budget import BudgetProblem, parse_budget
from ..memory.cost import CostModel, ProfiledCosts, profile_costs
from ..memory.mxnet import MirrorFunction, mxnet_plan
from ..memory.simulate import format_bytes as _mib, peak_of_plan, simulate, sizes
from ..pipeline import Build, Pass
from ..shapes import type_everything

POLICIES = ("mxnet", "budget")
SOLVERS = ("fast", "milp")


class Mirror(Pass):
    name = "mirror"
    requires = frozenset({"gradient"})
    ensures = frozenset({"mirrored"})

    def wanted(self, build: Build) -> bool:
        return build.options.mirror is not None

    def run(self, build: Build) -> None:
        graph, o = build.graph, build.options
        if MIRROR_KEY in graph.metadata:
            raise UsageError("the training graph is mirrored already (metadata onnxgrad.mirror); give the graph "
                             "build-grad wrote without --mirror, or the forward model")
        if o.mirror not in POLICIES:
            raise UsageError(f"--policy {o.mirror}: expected one of {', '.join(POLICIES)}")
        type_everything(graph)
        name_every_node(graph, build.new_names())
        nbytes = sizes(graph, o.dims)
        before = simulate(graph, nbytes=nbytes)
        save = set(o.mirror_options.get("save", ()))
        recompute = set(o.mirror_options.get("recompute", ()))
        # one problem serves the sweep and the budget: the solver keeps its front on it
        bp = None
        if o.mirror == "budget" or o.mirror_options.get("sweep"):
            bp = BudgetProblem(graph, nbytes, recompute_costs(build), save)
        if o.mirror_options.get("sweep"):
            build.report["sweep"] = sweep_rows(build, bp, nbytes, save)
        if o.mirror == "mxnet":
            plan = mxnet_plan(graph, nbytes, MirrorFunction(graph, save, recompute))
            plans.apply(graph, plan, build.new_names())
        else:
            plan = budget_plan(build, bp, nbytes, before.peak, save, recompute)
        after = simulate(graph, nbytes=sizes(graph, o.dims))
        plan.predicted = {"peak_bytes": after.peak, "unmirrored_peak_bytes": before.peak,
                          "saved_bytes": sum(b for _, b in after.saved),
                          "unmirrored_saved_bytes": sum(b for _, b in before.saved)}
        graph.metadata[MIRROR_KEY] = json.dumps(plan.record(), separators=(",", ":"))
        build.plan = plan
        build.report["mirror"] = {**plan.record(), "reasons": plan.reasons}


def recompute_costs(build: Build):
    """The price of running each node again: the cost model, or onnxruntime's own time per node (--cost profile)."""
    o = build.options
    which = o.mirror_options.get("cost", "model")
    if which == "model":
        return CostModel(symbols=dict(o.dims))
    if which != "profile":
        raise UsageError(f"--cost {which}: expected model or profile")
    proto = build.graph.to_model(weights_apart=True)
    weights.join(proto, build.graph.initializers)
    return ProfiledCosts(profile_costs(proto, symbols=dict(o.dims)))


def budget_plan(build: Build, bp: BudgetProblem, nbytes: dict[int, int], unmirrored_peak: int, save: set[str],
                recompute: set[str]) -> plans.Plan:
    """Solve for the cheapest schedule under the budget, apply it, and check the written graph's peak."""
    graph, o = build.graph, build.options
    opts = o.mirror_options
    budget = parse_budget(opts.get("budget") or "auto")
    which = opts.get("solver", "fast")
    if which not in SOLVERS:
        raise UsageError(f"--solver {which}: expected one of {', '.join(SOLVERS)}")
    if recompute:
        raise UsageError("--recompute: with --budget the solver chooses what to recompute; use --save to keep a "
                         "node")
    forward = {n.name for n in graph.nodes if n.phase == FORWARD}
    for name in sorted(save - forward):
        raise UsageError(f"--save {name}: no forward node of that name")
    model_costs = CostModel(symbols=dict(o.dims))  # FLOPs for the report, whatever priced the plan
    problem = bp.problem
    least = solver.floor(problem)
    target = budget.resolve(unmirrored_peak)
    if target is not None and target < least:
        raise UsageError(f"--budget {budget.text}: {_mib(target)} is below the least peak any schedule can reach, "
                         f"{_mib(least)} ({_mib(problem.static_bytes)} of weights and inputs, and the largest "
                         f"working set of one op)")
    time_limit = float(opts.get("time_limit", 60.0))
    started = time.perf_counter()
    wanted = target
    solution = plan = None
    found: dict = {}
    if target is not None:
        # the problem counts the small Constant nodes as alive throughout; the graph frees them: start from a
        # budget raised by that difference, and let the check below lower it should a plan then not fit
        target += max(0, solver.simulate(problem, problem.baseline).peak - unmirrored_peak)
    for _ in range(4):  # the graph's own peak is checked; a miss tightens the problem's budget by the excess
        solution = _solve(bp, which, target, time_limit, opts.get("work", solver.DEFAULT_WORK), found)
        if solution is None:
            break
        plan = bp.plan(solution, "budget" if which == "fast" else "budget-milp")
        peak = peak_of_plan(graph, plan.order, nbytes)
        if wanted is None or peak <= wanted:
            break
        target -= peak - wanted
        solution = plan = None
    # MXNet's plan is one more candidate: on element-wise tails between heavy ops it is often the cheapest
    mxnet = mxnet_plan(graph, nbytes, MirrorFunction(graph, save))
    index = {n.name: k for k, n in enumerate(bp.nodes)}
    mxnet_extra = sum(problem.cost[index[s[0]]] for s in mxnet.order if isinstance(s, tuple) and s[0] in index)
    mxnet_peak = peak_of_plan(graph, mxnet.order, nbytes)
    if wanted is None:
        fits = mxnet_extra <= bp.forward_cost and (solution is None or mxnet_peak < peak_of_plan(graph, plan.order,
                                                                                                 nbytes))
    else:
        fits = mxnet_peak <= wanted and (solution is None or mxnet_extra < solution.extra_cost)
    if fits:
        recomputed = {index[s[0]]: 1 for s in mxnet.order if isinstance(s, tuple)}
        steps = [s[0] if isinstance(s, tuple) else s for s in mxnet.order]
        solution = solver.Solution([index[s] for s in steps if s in index],
                                   mxnet_peak, problem.baseline_cost + mxnet_extra, mxnet_extra, recomputed,
                                   "mxnet (the cheapest plan that fits)")
        plan = plans.Plan("budget", mxnet.order, mxnet.reasons)
    if solution is None:
        raise UsageError(_no_schedule(budget, wanted, least, which, found))
    plans.apply(graph, plan, build.new_names())
    seconds = time.perf_counter() - started
    recomputed_flops = sum(model_costs.flops(bp.nodes[k]) * runs for k, runs in solution.recomputed.items())
    forward_flops = sum(model_costs.flops(n) for n in bp.nodes if n.phase == FORWARD)
    plan.extra = {"budget": budget.text, "budget_bytes": wanted, "floor_bytes": least, "solver": solution.solver,
                  "gap": solution.gap, "status": solution.status, "solve_seconds": round(seconds, 3),
                  "least_peak_found_bytes": found.get("least"), "problem_ops": problem.n,
                  "extra_cost": solution.extra_cost, "forward_cost": bp.forward_cost,
                  "extra_forward_passes": solution.extra_cost / bp.forward_cost if bp.forward_cost else 0.0,
                  "extra_flops": recomputed_flops, "forward_flops": forward_flops}
    return plan


def sweep_rows(build: Build, bp: BudgetProblem, nbytes: dict[int, int], save: set[str]) -> dict:
    """The Pareto sweep of `mirror --sweep`, on the graph before any plan is applied."""
    import click
    graph, o = build.graph, build.options
    mxnet_order = mxnet_plan(graph, nbytes, MirrorFunction(graph, save)).order

    def progress(items):
        with click.progressbar(items, label="sweep", file=sys.stderr) as bar:
            yield from bar
    rows = sweep.sweep(bp, nbytes, mxnet_order, progress, o.mirror_options.get("work", solver.DEFAULT_WORK))
    return {"rows": rows, "table": sweep.table(rows)}


def _solve(bp: BudgetProblem, which: str, target: int | None, time_limit: float, work: int, found: dict
           ) -> solver.Solution | None:
    """The cheapest schedule under `target` (None: auto); `found["least"]` gets the least peak the fast solver
    reached, for the error when nothing fits."""
    problem = bp.problem
    if which == "milp" and target is not None:
        return solver.solve_milp(problem, target, time_limit)
    front = solver.pareto(problem, work)
    found["least"] = min((s.peak for s in front), default=None)
    if target is not None:
        return solver.best_under(front, target)
    # auto: the least peak at most one extra forward pass buys
    affordable = [s for s in front if s.extra_cost <= bp.forward_cost * (1 + 1e-9)]
    best = min(affordable, key=lambda s: (s.peak, s.cost)) if affordable else None
    if best is not None and which == "milp":
        try:
            return solver.solve_milp(problem, best.peak, time_limit) or best
        except solver.SolverTimeout:  # the fast solver's schedule stands
            return best
    return best


def _no_schedule(budget, target, floor, which, found: dict) -> str:
    if target is None:
        return "--budget auto: no schedule found"
    least = found.get("least")
    reached = f"the least peak it reaches is {_mib(least)}, " if least is not None else ""
    return (f"--budget {budget.text}: the {which} solver finds no schedule under {_mib(target)} ({reached}and no "
            f"schedule can go below {_mib(floor)}; give a larger budget"
            + (" or try --solver milp)" if which == "fast" else ")"))


def name_every_node(graph, names) -> None:
    """A plan, --save and --recompute address nodes by name: give unnamed nodes, and all but the first of
    nodes that share a name, a name of their own."""
    seen: set[str] = set()
    for n in graph.nodes:
        if not n.name or n.name in seen:
            n.name = names.fresh(n.name or n.op_type)
        seen.add(n.name)
