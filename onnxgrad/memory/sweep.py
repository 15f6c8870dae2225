"""Peak memory against extra compute, over every budget the fast solver reaches (`mirror --sweep`).

Each point is a schedule of the budget solver's Pareto front, its peak checked on the graph itself
(`simulate.peak_of_plan`). Three reference points are marked: store-all (no recomputation), MXNet's mirroring
plan, and Chen et al.'s sqrt(n) segments (checkpoints at every sqrt(n)-th narrow point of the forward pass,
everything between them recomputed once).
"""
from __future__ import annotations

import math

from ..errors import UsageError
from . import solver
from .budget import BudgetProblem
from .simulate import peak_of_plan


def chen_solution(problem: solver.Problem) -> solver.Solution:
    """Chen et al.'s sqrt(n) scheme on the problem's narrow points."""
    cuts, _ = solver._cuts(problem)
    every = max(1, round(math.sqrt(len(cuts))))
    return solver.make_solution(problem, solver.build_schedule(problem, solver._segment_plan(problem, every, None)),
                                "chen")


def sweep(bp: BudgetProblem, nbytes: dict[int, int], mxnet_order: list | None, progress=None,
          work: int = solver.DEFAULT_WORK) -> list[dict]:
    """Rows of (what, peak bytes, extra forward passes, recomputations), cheapest last."""
    graph, problem = bp.graph, bp.problem
    front = solver.pareto(problem, work)
    points = [("front", s) for s in front] + [("chen", chen_solution(problem))]
    rows = []
    items = progress(points) if progress else points
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
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| schedule | peak MiB | extra forward passes | recomputations |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["peak_bytes"], r["extra_forward_passes"])):
        lines.append(f"| {r['what']} | {r['peak_bytes'] / 2**20:.1f} | {r['extra_forward_passes']:.2f} | "
                     f"{r['recomputations']} |")
    return "\n".join(lines)


def chart(rows: list[dict], path, title: str) -> None:
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
    for what, marker in (("store-all", "s"), ("mxnet", "D"), ("chen", "^")):
        for r in rows:
            if r["what"] == what:
                ax.scatter([r["extra_forward_passes"]], [r["peak_bytes"] / 2**20], marker=marker, s=60, zorder=3,
                           label={"chen": "Chen sqrt(n)", "mxnet": "MXNet mirror"}.get(what, what))
    ax.set_xlabel("extra compute, in forward passes")
    ax.set_ylabel("simulated peak, MiB")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
