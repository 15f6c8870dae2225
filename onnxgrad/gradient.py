"""The gradient pass: reverse-mode differentiation as a graph rewrite.

The walker knows no op names. It finds the values on a differentiable path from the wrt values (xs and the
extra values us) to the heads (ys), visits their producers in reverse topological order, sums the gradient
contributions of each output with one Sum node, and asks the op's registered rule for the input gradients.
Backward nodes are appended in the order they are built, so the file order is the reverse of the forward
order: a schedule that frees each activation soon after its last backward use.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import lru_cache

import onnx.defs

from . import registry
from .builder import Builder, GradContext, Names, sum_gradients
from .contract import BACKWARD
from .errors import InternalError, UnsupportedError
from .ir import Graph, Node, Value, names_defined_in


@dataclass
class GradientResult:
    grads: dict[str, Value | None]     # wrt value name -> its gradient, None where none reaches it
    nodes_added: int
    rules_used: dict[str, int] = field(default_factory=dict)


def differentiable_edge(node: Node, i: int, opset: int) -> bool:
    """Can a gradient flow from node's outputs back into input i?"""
    if registry.is_non_differentiable(node.op_type, node.domain):
        return False
    v = node.input(i)  # implicit inputs (outer values read by subgraphs) are numbered after the explicit ones
    if v is None or (v.elem_type is not None and not v.is_float):
        return False
    if i < len(node.inputs) and schema_says_non_differentiable(node.op_type, node.domain, opset, i):
        return False
    r = registry.lookup(node.op_type, opset, node.domain)
    return r is None or r.differentiates(i)  # no rule: keep the edge so the error can name the op


@lru_cache(maxsize=None)
def schema_says_non_differentiable(op_type: str, domain: str, opset: int, i: int) -> bool:
    """Inputs the ONNX schema marks non-differentiable (indices, shapes, conditions) get no gradient."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # an op the installed onnx does not know: nothing to learn from it
        return False
    params = schema.inputs
    if not params:
        return False
    p = params[min(i, len(params) - 1)]  # a variadic last parameter covers the remaining inputs
    return p.differentiation_category == onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable


def _float_out(v: Value) -> bool:
    return v.elem_type is None or v.is_float


def reachable_from(graph: Graph, sources: list[Value]) -> set[int]:
    """ids of the values that depend on a source through differentiable edges."""
    active = {id(v) for v in sources}
    for node in graph.nodes:
        if any(v is not None and id(v) in active and differentiable_edge(node, i, graph.opset)
               for i, v in enumerate(node.all_inputs)):
            active.update(id(o) for o in node.outputs if _float_out(o))
    return active


def reaching_heads(graph: Graph, heads: list[Value]) -> set[int]:
    """ids of the values that some head depends on through differentiable edges (the values that reach the
    loss)."""
    reaches_loss = {id(v) for v in heads}
    for node in reversed(graph.nodes):
        if any(id(o) in reaches_loss for o in node.outputs if _float_out(o)):
            reaches_loss.update(id(v) for i, v in enumerate(node.all_inputs)
                                if v is not None and differentiable_edge(node, i, graph.opset))
    return reaches_loss


def _path_from(heads: list[Value], target: Node, on_path: set[int]) -> str:
    """'loss <- Softmax(sm) <- Foo(n2)': how the gradient reaches a node, for error messages."""
    parent: dict[int, tuple[Node, Node | None]] = {}
    queue = deque()
    for h in heads:
        if h.producer is not None and id(h.producer) not in parent:
            parent[id(h.producer)] = (h.producer, None)
            queue.append(h.producer)
    while queue:
        n = queue.popleft()
        if n is target:
            break
        for v in n.all_inputs:
            if v is not None and id(v) in on_path and v.producer is not None and id(v.producer) not in parent:
                parent[id(v.producer)] = (v.producer, n)
                queue.append(v.producer)
    steps, cur = [], target
    while cur is not None and id(cur) in parent:
        steps.append(f"{cur.op_type}({cur.name})")
        cur = parent[id(cur)][1]
    return " <- ".join([heads[0].name] + steps[::-1])


def _drop_unread(graph: Graph, v: Value) -> None:
    """Take out the backward nodes that made `v`, now that nothing reads it, and those that fed only them."""
    outputs = {id(o) for o in graph.outputs}
    stack = [v.producer]
    while stack:
        node = stack.pop()
        if (node is None or node.phase != BACKWARD or node not in graph.nodes
                or any(o.uses or id(o) in outputs for o in node.outputs)):
            continue
        inputs = [u for u in node.all_inputs if u is not None]
        graph.remove([node])
        stack.extend(u.producer for u in inputs)


def differentiate(graph: Graph, heads: list[Value], head_grads: list[Value], wrt: list[Value],
                  names: Names, reaches_loss: set[int] | None = None) -> GradientResult:
    """Append the backward graph of `heads` (seeded with `head_grads`) with respect to `wrt`.

    `reaches_loss` is `reaching_heads(graph, heads)` where the caller has it already. New nodes are in the
    backward phase; a gradient has the type and shape of its value, so each one is typed as it is summed."""
    opset = graph.opset
    for node in graph.nodes:  # a new value must not take a name that a subgraph defines (no shadowing)
        for sub in node.subgraphs():
            for name in names_defined_in(sub):
                names.reserve(name)
    if reaches_loss is None:
        reaches_loss = reaching_heads(graph, heads)
    on_path = reachable_from(graph, wrt) & reaches_loss
    contributions: dict[int, list[Value]] = {}
    for h, hg in zip(heads, head_grads):
        contributions.setdefault(id(h), []).append(hg)

    def total(v: Value, op: Builder) -> Value | None:
        parts = contributions.get(id(v))
        if not parts:
            return None
        if len(parts) > 1:
            total_grad, unread = sum_gradients(op, parts)
            parts[:] = [total_grad]
            if unread is not None:
                _drop_unread(graph, unread)
        g = parts[0]
        if g.shape is None and g.producer is not None and g.producer.phase == BACKWARD:
            g.elem_type, g.shape = g.elem_type or v.elem_type, v.shape
        return g

    added = 0
    used: dict[str, int] = {}
    for node in reversed(graph.nodes[:]):
        if not any(id(o) in on_path for o in node.outputs):
            continue
        needed = [v is not None and id(v) in on_path and differentiable_edge(node, i, opset)
                  for i, v in enumerate(node.all_inputs)]
        if not any(needed):
            continue
        op = Builder(graph, names, prefix=f"{node.name or node.op_type}_grad", phase=BACKWARD)
        out_grads = [total(o, op) for o in node.outputs]
        if all(g is None for g in out_grads):
            continue
        rule = registry.lookup(node.op_type, opset, node.domain)
        if rule is None:
            where = _path_from(heads, node, on_path)
            domain = f"{node.domain}." if node.domain else ""
            raise UnsupportedError(f"no gradient rule for {domain}{node.op_type} (opset {opset}) at node "
                                   f"{node.name!r}, reached by {where}")
        ctx = GradContext(node, out_grads, needed, op, opset)
        in_grads = rule.fn(ctx)
        # a rule may list gradients for absent trailing optional inputs, as long as they are None
        if in_grads is None or any(g is not None for g in in_grads[len(node.all_inputs):]):
            raise InternalError(f"the {node.op_type} rule returned {in_grads!r} for {len(node.all_inputs)} inputs")
        for i, (v, g) in enumerate(zip(node.all_inputs, in_grads)):
            if needed[i] and g is None:
                raise InternalError(f"the {node.op_type} rule gave no gradient for needed input {i} "
                                    f"of node {node.name!r}")
            if needed[i]:
                contributions.setdefault(id(v), []).append(g)
        added += len(op.emitted)
        used[node.op_type] = used.get(node.op_type, 0) + 1

    grads = {}
    final = Builder(graph, names, prefix="grad_sum", phase=BACKWARD)
    for v in wrt:
        grads[v.name] = total(v, final)  # None: no gradient reaches v
    added += len(final.emitted)
    return GradientResult(grads, added, used)
