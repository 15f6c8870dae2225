"""MXNet's backward mirroring, as a policy that returns a `Plan`.

The mirror function says, per forward node, whether it may be recomputed: every op but the compute-heavy ones
(convolutions, matrix products, attention, recurrent cells) and the losses; never a random op (its output is
kept, so a recomputation downstream reads the same mask); never a node that writes a graph output (it stays
alive to the end anyway). `--save NAME` and `--recompute NAME` override it per node.

The decision runs on the training graph built without mirroring, which tells which forward values the backward
reads. A worklist starts from the nodes that write the outputs:
1. grow a subgraph backwards from the work item through nodes the mirror function allows; a node it refuses
   becomes a new work item;
2. close the subgraph forward: a node outside it that reads a value the subgraph reads joins it, with the chain
   of allowed nodes after it, since keeping or recomputing that value decides for all its readers at once;
3. from the subgraph's frontier (its nodes whose inputs are all stored), take a group of frontier nodes that
   share inputs; if storing their outputs releases at least as many bytes (inputs no one else needs) as it
   newly keeps (their outputs, and inputs other nodes need anyway), they are stored, and the frontier moves on;
4. what is left of the subgraph is recomputed.
The plan then recomputes each chosen node once, just before the first backward node that reads it, and every
backward read of its output, the gradients of the kept heavy ops included (dX and dW of a MatMul read X, not
Y), goes to the copy.
"""
from __future__ import annotations

from collections import deque

from ..contract import BACKWARD, FORWARD
from ..errors import UsageError
from ..ir import Graph, Node, Value
from .plan import Plan, recompute_before_first_use

HEAVY = frozenset({"Conv", "ConvTranspose", "ConvInteger", "MatMul", "MatMulInteger", "Gemm", "Einsum",
                   "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN", "QLinearConv", "QLinearMatMul",
                   "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
RANDOM = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli"})


class MirrorFunction:
    """May this forward node be recomputed? With the reason, for the plan's report."""

    def __init__(self, graph: Graph, save: set[str] = frozenset(), recompute: set[str] = frozenset()):
        by_name = {n.name for n in graph.nodes if n.phase == FORWARD}
        for flag, names in (("--save", save), ("--recompute", recompute)):
            for name in sorted(names):
                if name not in by_name:
                    raise UsageError(f"{flag} {name}: no forward node of that name")
        both = sorted(set(save) & set(recompute))
        if both:
            raise UsageError(f"--save and --recompute both name {both[0]!r}")
        self.save, self.recompute = set(save), set(recompute)
        self.outputs = {id(v) for v in graph.outputs}
        self.read_in_subgraph = {id(v) for n in graph.nodes if n.phase == BACKWARD for v in n.implicit_inputs}
        self._cache: dict[int, tuple[bool, str]] = {}

    def __call__(self, node: Node) -> bool:
        return self.decide(node)[0]

    def decide(self, node: Node) -> tuple[bool, str]:
        found = self._cache.get(id(node))
        if found is None:
            found = self._cache[id(node)] = self._decide(node)
        return found

    def _decide(self, node: Node) -> tuple[bool, str]:
        if node.phase != FORWARD:
            return False, "not a forward node"
        if node.op_type in RANDOM and not node.domain:
            if node.name in self.recompute:
                raise UsageError(f"--recompute {node.name}: a random op is never recomputed (its copy would draw "
                                 f"other numbers); its output is kept")
            return False, f"random op ({node.op_type}): kept, so recomputations read the same numbers"
        if any(id(v) in self.outputs for v in node.outputs):
            return False, "writes a graph output, alive to the end anyway"
        if node.subgraphs() or any(id(v) in self.read_in_subgraph for v in node.outputs):
            return False, "control flow reads it by name"
        if node.name in self.save:
            return False, "--save"
        if node.name in self.recompute:
            return True, "--recompute"
        if node.op_type in HEAVY and not node.domain:
            return False, f"compute-heavy op ({node.op_type})"
        return True, "cheap op"


def mxnet_plan(graph: Graph, nbytes: dict[int, int], mirror: MirrorFunction) -> Plan:
    """The plan of MXNet's mirroring for a training graph (forward + backward, phases set)."""
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None:
                readers.setdefault(id(v), []).append(n)
    is_forward = {id(n) for n in graph.nodes if n.phase == FORWARD}
    heads = [v.producer for v in graph.outputs if v.producer is not None and id(v.producer) in is_forward]

    def forward_inputs(n: Node) -> list[Node]:
        return [v.producer for v in n.inputs
                if v is not None and v.producer is not None and id(v.producer) in is_forward]

    # decision per forward node: True = recompute, False = store; absent = undecided
    decided: dict[int, bool] = {}
    stored_why: dict[str, str] = {}
    order_of = {id(n): i for i, n in enumerate(graph.nodes)}
    worklist = deque(heads)
    while worklist:
        item = worklist.popleft()
        if id(item) in decided:
            continue
        subgraph: dict[int, Node] = {}
        topo: list[Node] = []
        sub_queue = deque([item])

        def grow() -> None:
            added = []
            while sub_queue:
                n = sub_queue.popleft()
                if id(n) in subgraph:
                    continue  # its inputs are queued already: expanding it again would walk every path
                subgraph[id(n)] = n
                added.append(n)
                for p in forward_inputs(n):
                    (sub_queue if mirror(p) else worklist).append(p)
            topo.extend(sorted(added, key=lambda n: order_of[id(n)]))

        grow()
        # close the subgraph over the readers of the values it reads
        changed = True
        while changed:
            changed = False
            for n in list(topo):
                for v in n.inputs:
                    if v is None:
                        continue
                    for ref in readers.get(id(v), ()):
                        if ref is n or id(ref) not in is_forward or id(ref) in subgraph:
                            continue
                        sub_queue.append(ref)  # it joins, with the heads of the chains it starts
                        heads_queue = deque([ref])
                        seen = set()
                        while heads_queue:
                            r = heads_queue.popleft()
                            if id(r) in seen:
                                continue
                            seen.add(id(r))
                            if not mirror(r):
                                sub_queue.append(r)
                                continue
                            for o in r.outputs:
                                heads_queue.extend(x for x in readers.get(id(o), ()) if id(x) in is_forward)
                        grow()
                        changed = True
                        break
                    if changed:
                        break
                if changed:
                    break

        # move frontier groups off the mirror path while storing them releases at least what it keeps
        while True:
            frontier = {}
            for n in subgraph.values():
                if not mirror(n):
                    decided[id(n)] = False
                    continue
                if id(n) in decided:
                    continue
                if all(not mirror(p) or decided.get(id(p)) is False for p in forward_inputs(n)):
                    frontier[id(n)] = n
            moved = False
            visited: set[int] = set()
            for key, first in list(frontier.items()):
                if key in visited:
                    continue
                group = {key: first}
                visited.add(key)
                grew = True
                while grew:
                    grew = False
                    for cand in list(group.values()):
                        for v in cand.inputs:
                            if v is None:
                                continue
                            for ref in readers.get(id(v), ()):
                                if id(ref) in frontier and id(ref) not in group:
                                    group[id(ref)] = ref
                                    visited.add(id(ref))
                                    grew = True
                allocated: set[int] = set()
                released: set[int] = set()
                for cand in group.values():
                    for o in cand.outputs:
                        if o.name and readers.get(id(o)):
                            allocated.add(id(o))
                    for v in cand.inputs:
                        if v is None:
                            continue
                        outside = [r for r in readers.get(id(v), ()) if id(r) not in frontier]
                        (allocated if outside else released).add(id(v))
                if sum(nbytes.get(i, 0) for i in released) >= sum(nbytes.get(i, 0) for i in allocated):
                    for cand in group.values():
                        decided[id(cand)] = False
                        stored_why[cand.name] = "stored: keeping it releases at least the bytes it holds"
                    moved = True
                    break
            if not moved:
                break
        for n in topo:
            decided.setdefault(id(n), True)

    # only what the backward reads, directly or through other recomputed nodes, is worth recomputing
    recomputed = _needed_by_backward(graph, {i for i, r in decided.items() if r}, is_forward)
    reasons = {}
    for n in graph.nodes:
        if n.phase != FORWARD:
            continue
        if n.name in recomputed:
            reasons[n.name] = "recomputed: " + mirror.decide(n)[1]
        elif n.name in stored_why:
            reasons[n.name] = stored_why[n.name]
        else:
            ok, why = mirror.decide(n)
            reasons[n.name] = ("stored: " + why) if not ok else "kept: the backward does not read it"
    order = recompute_before_first_use(graph, recomputed)
    return Plan("mxnet", order, reasons)


def _needed_by_backward(graph: Graph, chosen: set[int], is_forward: set[int]) -> set[str]:
    """The chosen nodes whose outputs a backward node reads, and the chosen nodes those read, transitively."""
    needed: set[str] = set()
    stack: list[Node] = []
    for n in graph.nodes:
        if n.phase == BACKWARD:
            for v in n.inputs:
                p = v.producer if v is not None else None
                if p is not None and id(p) in chosen and p.name not in needed:
                    needed.add(p.name)
                    stack.append(p)
    while stack:
        n = stack.pop()
        for v in n.inputs:
            p = v.producer if v is not None else None
            if p is not None and id(p) in chosen and p.name not in needed:
                needed.add(p.name)
                stack.append(p)
    return needed
