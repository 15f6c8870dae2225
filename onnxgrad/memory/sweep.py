"""Peak memory against extra compute, over every budget the fast solver reaches (`mirror --sweep`).

Each point is a schedule of the budget solver's Pareto front (the same front, pruned, that `mirror --budget`
chooses from), its peak checked on the graph itself
(`simulate.peak_of_plan`). Three reference points are marked: store-all (no recomputation), MXNet's mirroring
plan, and Chen et al.'s sqrt(n) segments (checkpoints at every sqrt(n)-th narrow point of the forward pass,
everything between them recomputed once); so are the floor (the peak no schedule goes below), the plan the
build chose and the budget it was chosen under.
"""
from __future__ import annotations

import logging
import math

from ..errors import UsageError
from . import solvers
from .budget import BudgetProblem, solver_limits
from .simulate import format_bytes, peak_of_plan
from .solvers.fast import segment_plan


def chen_solution(problem: solvers.Problem) -> solvers.Solution:
    """Chen et al.'s sqrt(n) scheme on the problem's narrow points."""
    every = max(1, round(math.sqrt(len(problem.cuts[0]))))
    plan = segment_plan(problem, every, None)
    return solvers.make_solution(problem, solvers.build_schedule(problem, plan), "chen")


def sweep(bp: BudgetProblem, nbytes: dict[int, int], mxnet_order: list | None, progress=None,
          work: int = solvers.DEFAULT_WORK, target: int | None = None, front: solvers.Front | None = None
          ) -> list[dict]:
    """Rows of (what, peak bytes, extra forward passes, recomputations); the last row is the floor, the peak no
    schedule goes below (its extra passes and recomputations null). `target`: the problem's budget, whose
    schedules the pruning serves first, as in `mirror --budget`; `front`: that front, when the caller has it
    already. The progress bar is shown only while onnxgrad logs progress (not under `onnxgrad -q`)."""
    graph, problem = bp.graph, bp.problem
    if front is None:
        front = solvers.front(problem, solver_limits(problem, work, target=target))
    front = front.solutions()
    points = [("front", s) for s in front] + [("chen", chen_solution(problem))]
    rows = []
    items = progress(points) if progress and logging.getLogger("onnxgrad").isEnabledFor(logging.INFO) else points
    for what, s in items:
        plan = bp.plan(s, what)
        rows.append({"what": what, "peak_bytes": peak_of_plan(graph, plan.order, nbytes),
                     "extra_forward_passes": s.extra_cost / bp.forward_cost if bp.forward_cost else 0.0,
                     "recomputations": plan.recompute_count()})
    store_all = [n.name for n in graph.nodes]
    rows.append({"what": "store-all", "peak_bytes": peak_of_plan(graph, store_all, nbytes),
                 "extra_forward_passes": 0.0, "recomputations": 0})
    if mxnet_order is not None:
        index = {n.name: k for k, n in enumerate(bp.nodes)}
        extra = sum(problem.cost[index[s[0]]] for s in mxnet_order if isinstance(s, tuple) and s[0] in index)
        rows.append({"what": "mxnet", "peak_bytes": peak_of_plan(graph, mxnet_order, nbytes),
                     "extra_forward_passes": extra / bp.forward_cost if bp.forward_cost else 0.0,
                     "recomputations": sum(isinstance(s, tuple) for s in mxnet_order)})
    rows.append({"what": FLOOR, "peak_bytes": solvers.floor(problem), "extra_forward_passes": None,
                 "recomputations": None})
    return rows


FLOOR = "floor"
CHOSEN = "chosen"


def with_choice(result: dict, mirror: dict | None) -> dict:
    """The sweep of a build with the plan the build chose added as a row `chosen` (the peak of the written
    graph; the policy in `plan`) and the budget it was chosen under, and the table made again with that row."""
    rows = [r for r in result["rows"] if r["what"] != CHOSEN]
    budget = None
    if mirror is not None:
        extra = mirror.get("extra_forward_passes")
        if extra is None:  # MXNet's plan: the sweep priced it with the same costs
            extra = next((r["extra_forward_passes"] for r in rows if r["what"] == "mxnet"), None)
        rows.append({"what": CHOSEN, "plan": mirror.get("policy"), "peak_bytes": mirror["predicted"]["peak_bytes"],
                     "extra_forward_passes": extra, "recomputations": mirror.get("recomputations")})
        budget = mirror.get("budget_bytes")
    return {**result, "rows": rows, "budget_bytes": budget, "table": table(rows)}


def table(rows: list[dict]) -> str:
    """A Markdown table, least peak first: the peaks in one unit with as many decimals as it takes to tell
    different peaks apart, the chosen plan and the floor named as such."""
    peaks = [r["peak_bytes"] for r in rows]
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
                        if max(peaks, default=0) >= s), ("bytes", 1))
    peak_text = _distinct([p / scale for p in peaks], 1 if scale > 1 else 0)
    extras = [r["extra_forward_passes"] for r in rows]
    extra_text = _distinct([e for e in extras if e is not None], 2)
    lines = [f"| schedule | peak {unit} | extra forward passes | recomputations |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["peak_bytes"], r["what"] != FLOOR, r["extra_forward_passes"] or 0)):
        what = {CHOSEN: f"**chosen** ({r.get('plan')})", FLOOR: "floor (no schedule goes lower)"}.get(r["what"],
                                                                                                        r["what"])
        extra = "-" if r["extra_forward_passes"] is None else extra_text(r["extra_forward_passes"])
        count = "-" if r["recomputations"] is None else r["recomputations"]
        lines.append(f"| {what} | {peak_text(r['peak_bytes'] / scale)} | {extra} | {count} |")
    return "\n".join(lines)


def _distinct(values: list[float], decimals: int):
    """A formatter with the fewest decimals (from `decimals`, at most 6) that keeps different values apart."""
    for d in range(decimals, 7):
        if len({f"{v:.{d}f}" for v in values}) == len(set(values)):
            break
    return lambda v: f"{v:.{d}f}"


def chart(rows: list[dict], path, title: str, budget_bytes: int | None = None) -> None:
    """Peak against extra compute: the fast solver's front as steps, store-all, MXNet's plan and Chen's sqrt(n)
    as points, the chosen plan as a star, the budget and the floor as horizontal lines."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--sweep needs matplotlib for the chart: pip install 'onnxgrad[plot]'") from None
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    front = sorted((r for r in rows if r["what"] == "front"), key=lambda r: r["peak_bytes"])
    ax.step([r["extra_forward_passes"] for r in front], [r["peak_bytes"] / 2**20 for r in front], where="post",
            marker="o", markersize=3, label="budget solver (fast)")
    labels = {"chen": "Chen sqrt(n)", "mxnet": "MXNet mirror", "store-all": "store-all"}
    for what, marker, size in (("store-all", "s", 60), ("mxnet", "D", 60), ("chen", "^", 60), (CHOSEN, "*", 220)):
        for r in rows:
            if r["what"] == what and r["extra_forward_passes"] is not None:
                label = labels.get(what) or f"chosen ({r.get('plan')})"
                ax.scatter([r["extra_forward_passes"]], [r["peak_bytes"] / 2**20], marker=marker, s=size,
                           zorder=4 if what == CHOSEN else 3, label=label)
    for r in rows:
        if r["what"] == FLOOR:
            ax.axhline(r["peak_bytes"] / 2**20, color="0.4", linestyle=":", linewidth=1,
                       label=f"floor {format_bytes(r['peak_bytes'])}")
    if budget_bytes:
        ax.axhline(budget_bytes / 2**20, color="tab:red", linestyle="--", linewidth=1,
                   label=f"budget {format_bytes(budget_bytes)}")
    ax.set_xlabel("extra compute, in forward passes")
    ax.set_ylabel("simulated peak, MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
