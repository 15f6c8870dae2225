"""The least recomputation whose simulated peak fits a memory budget, as a policy that returns a `Plan`.

The training graph becomes a `solver.Problem`: its nodes in schedule order, each with the bytes of its outputs,
its cost (`cost.py`), the nodes it reads, whether it may run again (a forward node that is not random, writes no
graph output and is not read by name inside control flow), and the static bytes (weights and graph inputs). A
solver returns a schedule in which forward nodes may appear again; it becomes a plan (an order of node names with
recomputations), `plan.apply` rewrites the graph, and the graph's own simulator checks the peak of what was
written. Where the two models differ (a node with several outputs frees them together in the problem, one by
one in the graph), the graph's peak can only be lower or equal; should it still exceed the budget, the
solve is repeated under a budget lowered by the excess.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..contract import BACKWARD, FORWARD, RECOMPUTE
from ..errors import UsageError
from ..ir import Graph, Node
from . import solver
from .cost import CostModel
from .mxnet import RANDOM
from .plan import Plan, Step

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass
class Budget:
    """A budget as the user wrote it: bytes, a fraction of the unmirrored peak, or `auto`."""

    text: str
    bytes: int | None = None
    fraction: float | None = None
    auto: bool = False

    def resolve(self, unmirrored_peak: int) -> int | None:
        if self.auto:
            return None
        return self.bytes if self.bytes is not None else int(self.fraction * unmirrored_peak)


def parse_budget(text: str) -> Budget:
    """'16GiB', '2e9', '1500MB', '0.4x' or 'auto'."""
    t = text.strip().lower()
    if t == "auto":
        return Budget(text, auto=True)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(x|[kmgt]i?b|b)?", t)
    if m:
        value, unit = float(m.group(1)), m.group(2) or ""
        if unit == "x":
            if not 0 < value <= 1:
                raise UsageError(f"--budget {text}: a fraction of the unmirrored peak must be in (0, 1]")
            return Budget(text, fraction=value)
        if value > 0:
            return Budget(text, bytes=int(value * UNITS[unit]))
    raise UsageError(f"--budget {text}: expected bytes (e.g. 16GiB, 1500MB, 2e9), a fraction of the unmirrored "
                     f"peak (e.g. 0.4x) or auto")


class BudgetProblem:
    """A training graph as a `solver.Problem`, and the way back from a solver's schedule to a `Plan`."""

    def __init__(self, graph: Graph, nbytes: dict[int, int], costs: CostModel, save: set[str] = frozenset(),
                 recompute: set[str] = frozenset()):
        self.graph = graph
        # Constant nodes (shapes, axes, scalars) are counted as static and placed before their first reader:
        # they are small, and leaving them out keeps the problem the size of the real computation
        self.constants = [n for n in graph.nodes if not n.all_inputs and n.op_type == "Constant"]
        constant_ids = {id(n) for n in self.constants}
        self.nodes: list[Node] = [n for n in graph.nodes if id(n) not in constant_ids]
        index = {id(n): k for k, n in enumerate(self.nodes)}
        outputs = {id(v) for v in graph.outputs}
        read_by_name = {id(v) for n in graph.nodes for v in n.implicit_inputs}
        self.reasons: dict[str, str] = {}
        size, cost, inputs, recomputable, keep = [], [], [], [], set()
        for k, n in enumerate(self.nodes):
            size.append(sum(nbytes[id(v)] for v in n.outputs if v.name))
            cost.append(costs.cost(n))
            inputs.append(sorted({index[id(v.producer)] for v in n.all_inputs
                                  if v is not None and v.producer is not None and id(v.producer) in index}))
            if any(id(v) in outputs for v in n.outputs):
                keep.add(k)
            ok, why = self._may_recompute(n, outputs, read_by_name, save, recompute)
            recomputable.append(ok)
            if n.phase == FORWARD:
                self.reasons[n.name] = why
        statics = {id(v) for v in graph.inputs} | {id(graph.values[t]) for t in graph.initializers
                                                   if t in graph.values}
        statics |= {id(v) for n in self.constants for v in n.outputs if v.name}
        self.problem = solver.Problem(size, cost, inputs, recomputable, keep, sum(nbytes[i] for i in statics))
        self.forward_cost = sum(c for c, n in zip(cost, self.nodes) if n.phase == FORWARD)

    @staticmethod
    def _may_recompute(n: Node, outputs, read_by_name, save, recompute) -> tuple[bool, str]:
        if n.phase != FORWARD:
            return False, ""
        if n.op_type in RANDOM and not n.domain:
            return False, f"random op ({n.op_type}): kept, so recomputations read the same numbers"
        if any(id(v) in outputs for v in n.outputs):
            return False, "writes a graph output, alive to the end anyway"
        if n.subgraphs() or any(id(v) in read_by_name for v in n.outputs):
            return False, "control flow reads it by name"
        if n.name in save:
            return False, "--save"
        return True, "--recompute" if n.name in recompute else ""

    def plan(self, solution: solver.Solution, policy: str) -> Plan:
        """The solver's schedule as a plan: each node's first run is the node itself, later runs are copies."""
        order: list[Step] = []
        constant_of = {id(v): n for n in self.constants for v in n.outputs}
        placed: set[int] = set()
        seen: set[int] = set()
        for k in solution.schedule:
            n = self.nodes[k]
            for v in n.all_inputs:  # each constant just before its first reader, as in the graph
                c = constant_of.get(id(v)) if v is not None else None
                if c is not None and id(c) not in placed:
                    placed.add(id(c))
                    order.append(c.name)
            if k in seen:
                order.append((n.name, RECOMPUTE))
            else:
                seen.add(k)
                order.append(n.name)
        order += [c.name for c in self.constants if id(c) not in placed]
        reasons = {}
        read_by_backward = {id(v) for n in self.nodes if n.phase == BACKWARD for v in n.all_inputs}
        for k, n in enumerate(self.nodes):
            if n.phase != FORWARD:
                continue
            runs = solution.recomputed.get(k, 0)
            if runs:
                reasons[n.name] = f"recomputed {runs}x" + (" (--recompute)" if self.reasons[n.name] == "--recompute"
                                                           else "")
            elif any(id(v) in read_by_backward for v in n.outputs):
                why = self.reasons[n.name]
                reasons[n.name] = "stored: " + (why or "cheaper to keep within the budget")
            else:
                reasons[n.name] = "kept: the backward does not read it"
        return Plan(policy, order, reasons)
