"""The schedule: the order of `graph.nodes` is the order onnxruntime runs them in, under the settings this pass
records in the metadata (contract.RUNTIME_HINTS). The gradient pass appends the backward in reverse forward
order, which frees each activation soon after its last backward use; the mirror pass places each recomputed
node just before its first reader. This pass checks that the order is a valid one, repairs it when a pass left
a node before one of its inputs' producers (a stable topological sort that moves as little as possible), and
writes the settings (with the fusions a graph with recomputation must not run, contract.py)."""
from __future__ import annotations

import heapq

from ..contract import (DISABLED_OPTIMIZERS_KEY, LOSS_KEY, RECOMPUTE, RECOMPUTE_DISABLED_OPTIMIZERS,
                        RUNTIME_HINTS)
from ..ir import Graph, Node
from ..pipeline import Build, Pass


class Schedule(Pass):
    name = "schedule"
    requires = frozenset({"gradient"})
    ensures = frozenset({"scheduled"})

    def run(self, build: Build) -> None:
        graph = build.graph
        if not is_topological(graph):
            graph.reorder(stable_topological_order(graph.nodes))
        graph.metadata.update(RUNTIME_HINTS)
        if any(n.phase == RECOMPUTE for n in graph.nodes):
            disabled = [RUNTIME_HINTS[DISABLED_OPTIMIZERS_KEY], *RECOMPUTE_DISABLED_OPTIMIZERS]
            graph.metadata[DISABLED_OPTIMIZERS_KEY] = ",".join(disabled)
        graph.metadata[LOSS_KEY] = ",".join(h.name for h in build.heads)


def is_topological(graph: Graph) -> bool:
    """Every node comes after the producers of all its inputs."""
    done: set[int] = set()
    for n in graph.nodes:
        for v in n.all_inputs:
            if v is not None and v.producer is not None and id(v.producer) not in done:
                return False
        done.add(id(n))
    return True


def stable_topological_order(nodes: list[Node]) -> list[Node]:
    """Kahn's algorithm, always taking the ready node that comes first in the current order."""
    position = {id(n): i for i, n in enumerate(nodes)}
    waiting = {}
    readers: dict[int, list[Node]] = {}
    ready = []
    for n in nodes:
        producers = {id(v.producer) for v in n.all_inputs
                     if v is not None and v.producer is not None and id(v.producer) in position}
        waiting[id(n)] = len(producers)
        for p in producers:
            readers.setdefault(p, []).append(n)
        if not producers:
            heapq.heappush(ready, (position[id(n)], n))
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for r in readers.get(id(n), ()):
            waiting[id(r)] -= 1
            if waiting[id(r)] == 0:
                heapq.heappush(ready, (position[id(r)], r))
    return order
