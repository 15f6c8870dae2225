"""A recomputation plan, and the one mechanism that applies any plan to a training graph.

The policies (MXNet's mirror heuristic in `mxnet.py`, the budget solver) decide; `apply` only rewrites. A plan
is an execution order over the graph's nodes in which a forward node may appear again, as a recomputation:
`order` lists node names, each original node once (forward, backward, optimizer), and recomputations as
`(name, "recompute")` entries placed where they run. `apply` clones each recomputation as `<name>_mirror`
(`_mirror_1`, ... for later copies), in the recompute phase; a clone, and every backward node after it, reads
the most recent copy of each forward value, so the originals can be freed after the forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..contract import BACKWARD, FORWARD, MIRROR_SUFFIX, RECOMPUTE
from ..errors import InternalError
from ..ir import Graph, Node, Value
from .simulate import passes_through

Step = str | tuple[str, str]  # a node name, or (forward node name, "recompute")


@dataclass
class Plan:
    """What to recompute, where, and why."""

    policy: str
    order: list[Step]
    reasons: dict[str, str] = field(default_factory=dict)    # forward node -> why it is kept or recomputed
    predicted: dict = field(default_factory=dict)            # the simulator's figures for the planned schedule
    extra: dict = field(default_factory=dict)                # what else the policy reports (cost, solver, ...)
    timings: dict = field(default_factory=dict)              # seconds: for the build report, never the model

    @property
    def recomputed(self) -> list[str]:
        """The forward nodes recomputed at least once, in first-recomputation order."""
        return list(dict.fromkeys(s[0] for s in self.order if isinstance(s, tuple)))

    def recompute_count(self) -> int:
        return sum(isinstance(s, tuple) for s in self.order)

    def record(self) -> dict:
        """The plan as the JSON a written graph keeps in its metadata."""
        return {"policy": self.policy, "recomputed": self.recomputed, "recomputations": self.recompute_count(),
                "predicted": self.predicted, **self.extra}


def recompute_before_first_use(graph: Graph, recomputed: set[str]) -> list[Step]:
    """The order that MXNet's mirroring gives: each recomputed node once, placed (after what it reads) just
    before the first backward node that reads it, directly or through other recomputed nodes."""
    by_name = {n.name: n for n in graph.nodes}
    order: list[Step] = []
    emitted: set[str] = set()

    def emit(node: Node) -> None:
        # the recomputed nodes this one reads come first (iteratively: chains can be long)
        stack = [(node, False)]
        while stack:
            n, ready = stack.pop()
            if n.name in emitted:
                continue
            if ready:
                emitted.add(n.name)
                order.append((n.name, RECOMPUTE))
                continue
            stack.append((n, True))
            for v in n.all_inputs:
                p = v.producer if v is not None else None
                if p is not None and p.name in recomputed and p.name not in emitted:
                    stack.append((p, False))

    for n in graph.nodes:
        if n.phase == BACKWARD:
            for v in n.all_inputs:
                p = v.producer if v is not None else None
                if p is not None and p.phase == FORWARD and p.name in recomputed:
                    emit(by_name[p.name])
        order.append(n.name)
    return order


def apply(graph: Graph, plan: Plan, names) -> dict[str, list[Node]]:
    """Rewrite `graph` to run `plan.order`; returns the clones made per forward node. `names` is the run's
    name authority (`builder.Names`)."""
    by_name = {n.name: n for n in graph.nodes}
    if len(by_name) != len(graph.nodes):
        raise InternalError("the graph has nodes with the same name; a plan cannot address them")
    planned = [s for s in plan.order if not isinstance(s, tuple)]
    if sorted(planned) != sorted(by_name):
        raise InternalError("the plan does not list every node of the graph exactly once")
    latest: dict[int, Value] = {}  # id(original forward value) -> its most recent copy
    clones: dict[str, list[Node]] = {}
    new_order: list[Node] = []
    for step in plan.order:
        if isinstance(step, tuple):
            original = by_name[step[0]]
            if original.phase != FORWARD:
                raise InternalError(f"the plan recomputes {step[0]!r}, which is not a forward node")
            if passes_through(original):
                # a copy of a no-op reads what its original read: onnxruntime removes such a node, and a copy
                # of a same-type Cast removed so (CastElimination at ORT_ENABLE_ALL) left its readers reading
                # a value no node made (a T5's RMS norm recomputed: the session could not be created)
                source = original.inputs[0]
                latest[id(original.outputs[0])] = latest.get(id(source), source)
                continue
            base = original.name + MIRROR_SUFFIX
            node_name = names.fresh(base)
            outs = [names.fresh(v.name + MIRROR_SUFFIX) if v.name else "" for v in original.outputs]
            copy = graph.clone(original, node_name, outs, phase=RECOMPUTE)
            _read_latest(copy, latest)
            for v, c in zip(original.outputs, copy.outputs):
                if v.name:
                    latest[id(v)] = c
            clones.setdefault(original.name, []).append(copy)
            new_order.append(copy)
            continue
        node = by_name[step]
        if node.phase == BACKWARD:
            _read_latest(node, latest)
        new_order.append(node)
    graph.reorder(new_order)
    graph.values.pop("", None)
    return clones


def _read_latest(node: Node, latest: dict[int, Value]) -> None:
    for i, v in enumerate(node.inputs):
        if v is not None and id(v) in latest:
            node.set_input(i, latest[id(v)])
    if node.implicit_inputs and any(id(v) in latest for v in node.implicit_inputs):
        raise InternalError(f"{node.name!r} reads a recomputed value inside a subgraph; it cannot be rewired")
