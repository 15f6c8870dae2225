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
from dataclasses import dataclass, field

from ..contract import BACKWARD, FORWARD
from ..errors import UsageError
from ..ir import Graph, Node
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
    """The plan of MXNet's mirroring for a training graph (forward + backward, phases set): the steps of the
    module's docstring, one subgraph per work item, then the plan from the nodes left to recompute."""
    m = _Mirroring(graph, nbytes, mirror)
    while m.worklist:
        item = m.worklist.popleft()
        if id(item) in m.decided:
            continue
        sub = _Subgraph(deque([item]))
        m.grow(sub)
        m.close(sub)
        m.store_frontier_groups(sub)
        for n in sub.topo:  # 4. what is left is recomputed
            m.decided.setdefault(id(n), True)
    # only what the backward reads, directly or through other recomputed nodes, is worth recomputing
    recomputed = _needed_by_backward(graph, {i for i, r in m.decided.items() if r}, m.is_forward)
    order = recompute_before_first_use(graph, recomputed)
    return Plan("mxnet", order, _reasons(graph, mirror, recomputed, m.stored_why))


@dataclass
class _Subgraph:
    """The subgraph grown from one work item: its nodes by id, in the order they joined (each batch in graph
    order), and the nodes waiting to join."""

    queue: deque
    nodes: dict[int, Node] = field(default_factory=dict)
    topo: list[Node] = field(default_factory=list)


class _Mirroring:
    """The state of one mxnet_plan: the graph's readers, the decision per forward node (True: recompute, False:
    store; absent: undecided), why a node was stored, and the work items left."""

    def __init__(self, graph: Graph, nbytes: dict[int, int], mirror: MirrorFunction):
        self.nbytes, self.mirror = nbytes, mirror
        self.readers: dict[int, list[Node]] = {}
        for n in graph.nodes:
            for v in n.inputs:
                if v is not None:
                    self.readers.setdefault(id(v), []).append(n)
        self.is_forward = {id(n) for n in graph.nodes if n.phase == FORWARD}
        self.order_of = {id(n): i for i, n in enumerate(graph.nodes)}
        self.decided: dict[int, bool] = {}
        self.stored_why: dict[str, str] = {}
        self.worklist = deque(v.producer for v in graph.outputs
                              if v.producer is not None and id(v.producer) in self.is_forward)

    def forward_inputs(self, n: Node) -> list[Node]:
        return [v.producer for v in n.inputs
                if v is not None and v.producer is not None and id(v.producer) in self.is_forward]

    def grow(self, sub: _Subgraph) -> None:
        """1. Take the queued nodes in, and their forward inputs: through the nodes the mirror function allows;
        one it refuses becomes a work item."""
        added = []
        while sub.queue:
            n = sub.queue.popleft()
            if id(n) in sub.nodes:
                continue  # its inputs are queued already: expanding it again would walk every path
            sub.nodes[id(n)] = n
            added.append(n)
            for p in self.forward_inputs(n):
                (sub.queue if self.mirror(p) else self.worklist).append(p)
        sub.topo.extend(sorted(added, key=lambda n: self.order_of[id(n)]))

    def close(self, sub: _Subgraph) -> None:
        """2. A forward node outside the subgraph that reads a value the subgraph reads joins it, with the nodes
        the mirror function refuses at the ends of the allowed chains it starts."""
        while (ref := self._outside_reader(sub)) is not None:
            sub.queue.append(ref)
            chain = deque([ref])
            seen = set()
            while chain:
                r = chain.popleft()
                if id(r) in seen:
                    continue
                seen.add(id(r))
                if not self.mirror(r):
                    sub.queue.append(r)
                    continue
                for o in r.outputs:
                    chain.extend(x for x in self.readers.get(id(o), ()) if id(x) in self.is_forward)
            self.grow(sub)

    def _outside_reader(self, sub: _Subgraph) -> Node | None:
        """The first forward node outside the subgraph that reads a value a node of the subgraph reads."""
        for n in sub.topo:
            for v in n.inputs:
                if v is None:
                    continue
                for ref in self.readers.get(id(v), ()):
                    if ref is not n and id(ref) in self.is_forward and id(ref) not in sub.nodes:
                        return ref
        return None

    def store_frontier_groups(self, sub: _Subgraph) -> None:
        """3. Store frontier groups, and move the frontier on, while storing one releases at least what it
        keeps."""
        while (group := self._storable_group(sub)) is not None:
            for cand in group:
                self.decided[id(cand)] = False
                self.stored_why[cand.name] = "stored: keeping it releases at least the bytes it holds"

    def _frontier(self, sub: _Subgraph) -> dict[int, Node]:
        """The undecided nodes of the subgraph whose forward inputs are all stored (refused nodes are decided
        stored here)."""
        frontier = {}
        for n in sub.nodes.values():
            if not self.mirror(n):
                self.decided[id(n)] = False
                continue
            if id(n) in self.decided:
                continue
            if all(not self.mirror(p) or self.decided.get(id(p)) is False for p in self.forward_inputs(n)):
                frontier[id(n)] = n
        return frontier

    def _storable_group(self, sub: _Subgraph) -> list[Node] | None:
        """The first group of frontier nodes that share inputs whose storage releases at least the bytes it
        newly keeps, or None."""
        frontier = self._frontier(sub)
        visited: set[int] = set()
        for key, first in list(frontier.items()):
            if key in visited:
                continue
            group = self._group(first, frontier)
            visited.update(group)
            if self._releases_enough(group.values(), frontier):
                return list(group.values())
        return None

    def _group(self, first: Node, frontier: dict[int, Node]) -> dict[int, Node]:
        """`first` and the frontier nodes that read an input of the group, transitively."""
        group = {id(first): first}
        grew = True
        while grew:
            grew = False
            for cand in list(group.values()):
                for v in cand.inputs:
                    if v is None:
                        continue
                    for ref in self.readers.get(id(v), ()):
                        if id(ref) in frontier and id(ref) not in group:
                            group[id(ref)] = ref
                            grew = True
        return group

    def _releases_enough(self, group, frontier: dict[int, Node]) -> bool:
        """Storing the group's outputs releases (inputs no node outside the frontier reads) at least the bytes
        it newly keeps (its outputs, and inputs other nodes need anyway)."""
        allocated: set[int] = set()
        released: set[int] = set()
        for cand in group:
            for o in cand.outputs:
                if o.name and self.readers.get(id(o)):
                    allocated.add(id(o))
            for v in cand.inputs:
                if v is None:
                    continue
                outside = [r for r in self.readers.get(id(v), ()) if id(r) not in frontier]
                (allocated if outside else released).add(id(v))
        return sum(self.nbytes.get(i, 0) for i in released) >= sum(self.nbytes.get(i, 0) for i in allocated)


def _reasons(graph: Graph, mirror: MirrorFunction, recomputed: set[str], stored_why: dict[str, str]) -> dict:
    """Why each forward node is recomputed, stored or kept."""
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
    return reasons


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
