"""The mirror pass: recompute forward values in the backward pass instead of keeping them.

A policy decides and returns a `memory.plan.Plan`: `memory.mxnet` (MXNet's mirroring), or `memory.budget` (the
least recomputation whose peak fits `--budget`, found by `memory.solvers`). The pass reads its options once
into a `MirrorOptions`, asks the policy, and applies the plan with `memory.plan.apply`; it simulates the peak
before and after, keeps the plan in the graph's metadata, and puts it in the report with a reason per forward
node (and the solver's seconds, which stay out of the model).
"""
from __future__ import annotations

import json
import logging
import sys

from ..contract import ALLOCATOR_KEY, BUDGET_KEY, MIRROR_KEY
from ..errors import UsageError
from ..memory import plan as plans
from ..memory import solvers, sweep
from ..memory.arena import NEXT_POWER_OF_TWO, SPLIT_ALWAYS, STRATEGIES, least_limit, resident
from ..memory.budget import (BudgetProblem, MirrorOptions, budget_policy, problem_front, problem_target,
                             recompute_costs)
from ..memory.cost import CostModel
from ..memory.mxnet import MirrorFunction, mxnet_plan
from ..memory.simulate import allocations, format_bytes, simulate, sizes
from ..pipeline import Build, Pass
from ..shapes import type_everything
from .results import MirrorResult, SweepResult

POLICIES = ("mxnet", "budget")


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
        options = MirrorOptions.of(o.mirror_options)
        type_everything(graph)
        name_every_node(graph, build.new_names())
        nbytes = sizes(graph, o.dims)
        before = simulate(graph, nbytes=nbytes)
        bp = swept = budget = None
        if o.mirror == "budget" or options.sweep:
            bp = BudgetProblem(graph, nbytes, recompute_costs(graph, options, o.dims), options.save)
        # the one front that --budget chooses from and --sweep draws, built once for both
        front = (problem_front(bp.problem, options, before.peak)
                 if options.sweep and o.mirror == "budget" else None)
        if options.sweep:
            swept = sweep_rows(build, bp, nbytes, options, before.peak, front)
        timings = {}
        if o.mirror == "mxnet":
            plan = mxnet_plan(graph, nbytes, MirrorFunction(graph, options.save, options.recompute))
        else:
            # a BudgetError carries its report; the API's caller writes it
            result = budget_policy(graph, nbytes, bp, options, before.peak, CostModel(symbols=dict(o.dims)), front)
            plan, budget = result.plan, result.report
            timings = plan.timings
            if result.report.budget_bytes is not None:
                # runners give it to the allocator as its limit (runtime.provider_options)
                graph.metadata[BUDGET_KEY] = str(result.report.budget_bytes)
                # what the budget holds for: the CPU runners keep onnxruntime's arena for a plan made for it
                graph.metadata[ALLOCATOR_KEY] = options.allocator
        plans.apply(graph, plan, build.new_names())
        after_bytes = sizes(graph, o.dims)
        after = simulate(graph, nbytes=after_bytes)
        # what the process holds when onnxruntime's arena allocates: more than the live bytes. With onnxruntime's
        # default chunk splitting (CUDA's arena, a default CPU session's), and as onnxgrad's CPU sessions configure
        # the arena for a plan made for it (every chunk split: runtime.split_every_chunk)
        events = allocations(graph, after_bytes)
        arena = {s: after.static + least_limit(events, s) for s in STRATEGIES}
        cpu_arena = after.static + least_limit(events, NEXT_POWER_OF_TWO, max_dead_bytes=SPLIT_ALWAYS)
        plan.predicted = {"peak_bytes": after.peak, "unmirrored_peak_bytes": before.peak,
                          "saved_bytes": sum(b for _, b in after.saved),
                          "unmirrored_saved_bytes": sum(b for _, b in before.saved),
                          "arena_peak_bytes": arena, "cpu_arena_peak_bytes": cpu_arena,
                          # what a CPU process holds for it in onnxgrad's arena, which has no limit
                          "cpu_resident_bytes": after.static + resident(events)}
        cuda = arena[NEXT_POWER_OF_TWO]  # as onnxgrad's CUDA sessions run a budgeted graph (runtime.provider_options)
        if budget is not None and budget.budget_bytes is not None and budget.allocator == "exact" \
                and cuda > budget.budget_bytes:
            logging.getLogger("onnxgrad").warning(
                "mirror: in onnxruntime's arena (CUDA's, or the CPU provider's when on) this plan needs %s, over the "
                "budget of %s; onnxgrad's CPU sessions run it with the arena off, where it fits. For CUDA, or a "
                "faster CPU step, give --allocator arena",
                format_bytes(cuda), format_bytes(budget.budget_bytes))
        graph.metadata[MIRROR_KEY] = json.dumps(plan.record(), separators=(",", ":"))
        build.plan = plan
        if swept is not None:  # the chosen plan joins the rows
            chosen = sweep.with_choice(swept, plan.record())
            swept = SweepResult(chosen["rows"], chosen["table"], chosen["budget_bytes"])
        build.record(MirrorResult(plan, budget, timings, swept))


def sweep_rows(build: Build, bp: BudgetProblem, nbytes: dict[int, int], options: MirrorOptions,
               unmirrored_peak: int, front: solvers.Front | None = None) -> dict:
    """The Pareto sweep of `mirror --sweep`, on the graph before any plan is applied: the front `--budget`
    chooses from."""
    import click
    graph = build.graph
    mxnet_order = mxnet_plan(graph, nbytes, MirrorFunction(graph, set(options.save))).order

    def progress(items):
        with click.progressbar(items, label="sweep", file=sys.stderr) as bar:
            yield from bar
    target = problem_target(bp.problem, options, unmirrored_peak) if build.options.mirror == "budget" else None
    rows = sweep.sweep(bp, nbytes, mxnet_order, progress, options.work, target, front)
    return {"rows": rows, "table": sweep.table(rows)}


def name_every_node(graph, names) -> None:
    """A plan, --save and --recompute address nodes by name: give unnamed nodes, and all but the first of
    nodes that share a name, a name of their own."""
    seen: set[str] = set()
    for n in graph.nodes:
        if not n.name or n.name in seen:
            n.name = names.fresh(n.name or n.op_type)
        seen.add(n.name)
