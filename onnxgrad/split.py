"""A step graph cut in two at the gradients: a *gradient graph* (forward and backward: data and parameters in,
the loss and `<p>_grad` out) and an *update graph* (the optimizer: `<p>_grad`, parameters, optimizer state and
`lr` in, every `.next` state output out). One run of each, in that order, is one run of the step graph; a
data-parallel runner averages the gradients across processes between the two, so that gradient accumulation
and clipping by global norm, which live in the update graph, see the averaged gradient.

Which nodes are the optimizer's comes from the step graph's `onnxgrad.phases` metadata (runs of [phase, count]
over the node order) when it has it; otherwise from the graph's structure: the nodes that neither a forward
output nor a `<p>_grad` value needs. Both must give the same cut (a test checks this on every optimizer).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

from .contract import GRAD_SUFFIX, LOSS_KEY, OPTIMIZER, OPTIMIZER_KEY, RUNTIME_HINTS, STATE_KEY
from .errors import InvalidModelError, UsageError
from .protos import cut_model, forward_outputs, model_phases, needed_subgraph, node_reads


@dataclass
class SplitStep:
    """The two graphs, and the names a runner binds between them."""

    gradient: onnx.ModelProto     # data + parameters -> loss, forward outputs, <p>_grad
    update: onnx.ModelProto       # <p>_grad + parameters + optimizer state + lr -> <state>.next
    parameters: list[str]         # the parameters the optimizer updates, in its order
    grads: list[str]              # their gradients, `<p>_grad`, in the order the backward pass produces them
    loss: str
    phase_source: str             # "metadata" or "structure": how the optimizer's nodes were found

    @property
    def grad_parameters(self) -> list[str]:
        """The parameter of each entry of `grads`."""
        return [g[:-len(GRAD_SUFFIX)] for g in self.grads]


def optimizer_node_mask(model: onnx.ModelProto) -> tuple[list[bool], str]:
    """For each node in file order, whether it belongs to the optimizer; and where that came from."""
    phases = model_phases(model)
    if phases is not None:
        return [phase == OPTIMIZER for phase in phases], "metadata"
    meta = {p.key: p.value for p in model.metadata_props}
    params = _optimizer_parameters(meta)
    gradient_nodes, _ = needed_subgraph(model.graph, _gradient_outputs(model, params))
    kept = {id(n) for n in gradient_nodes}
    return [id(n) not in kept for n in model.graph.node], "structure"


def _optimizer_parameters(meta: dict[str, str]) -> list[str]:
    if OPTIMIZER_KEY not in meta or STATE_KEY not in meta:
        raise UsageError("not a step graph: no 'onnxgrad.optimizer' metadata; write one with "
                         "`onnxgrad build-grad MODEL -o STEP.onnx --optimizer sgd`")
    try:
        params = json.loads(meta[OPTIMIZER_KEY])["parameters"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise InvalidModelError(f"metadata {OPTIMIZER_KEY!r} does not list the parameters it updates") from None
    return list(params)


def _gradient_outputs(model: onnx.ModelProto, params: list[str]) -> list[str]:
    state = json.loads({p.key: p.value for p in model.metadata_props}[STATE_KEY])
    return [o.name for o in model.graph.output if o.name not in set(state.values())
            and not o.name.endswith(GRAD_SUFFIX)] + [p + GRAD_SUFFIX for p in params]


def split_step_graph(model: onnx.ModelProto) -> SplitStep:
    """The gradient graph and the update graph of a step graph written by `build-grad --optimizer`."""
    meta = {p.key: p.value for p in model.metadata_props}
    params = _optimizer_parameters(meta)
    state = json.loads(meta[STATE_KEY])
    g = model.graph
    mask, source = optimizer_node_mask(model)
    nodes = list(g.node)
    produced_by_gradient = {o for n, opt in zip(nodes, mask) if not opt for o in n.output if o}
    grads = [p + GRAD_SUFFIX for p in params]
    missing = [name for name in grads if name not in produced_by_gradient]
    if missing:
        raise InvalidModelError(f"the step graph computes no {missing[0]!r} before its optimizer's nodes")
    update_nodes = [n for n, opt in zip(nodes, mask) if opt]
    # The update graph may read parameters, state, lr and constants; from the gradient graph only `<p>_grad`
    # (anything else would be one process's value, not the average).
    crossing = sorted({r for n in update_nodes for r in node_reads(n)} & produced_by_gradient - set(grads))
    if crossing:
        raise InvalidModelError(f"the optimizer's nodes read {crossing[0]!r}, a value of the forward or backward "
                                f"pass that is not a parameter gradient")
    order = {name: i for i, n in enumerate(nodes) for name in n.output}
    grads.sort(key=lambda name: order[name])

    loss = meta.get(LOSS_KEY, "")
    forward = forward_outputs(model, state)   # without a loss that build-grad appended: put it first
    forward = ([loss] if loss not in forward else []) + forward
    gradient = _subgraph(model, [n for n, opt in zip(nodes, mask) if not opt], forward + grads,
                         keep_metadata=(LOSS_KEY, *RUNTIME_HINTS), name="gradient")
    update = _subgraph(model, update_nodes, list(state.values()), extra_inputs=grads,
                       keep_metadata=(STATE_KEY, OPTIMIZER_KEY, *RUNTIME_HINTS), name="update")
    return SplitStep(gradient, update, params, grads, loss, source)


def restrict_update(update: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """The update graph cut back to some of its outputs (one process's share under ZeRO-1), reading only the
    inputs those need; `onnxgrad.state` keeps the pairs whose output stays."""
    meta = {p.key: p.value for p in update.metadata_props}
    state = {k: v for k, v in json.loads(meta[STATE_KEY]).items() if v in set(outputs)}
    nodes, _ = needed_subgraph(update.graph, outputs)
    out = _subgraph(update, nodes, outputs, keep_metadata=(OPTIMIZER_KEY, *RUNTIME_HINTS), name=update.graph.name)
    out.metadata_props.add(key=STATE_KEY, value=json.dumps(state))
    return out


def _subgraph(model: onnx.ModelProto, nodes: list[onnx.NodeProto], outputs: list[str], *,
              extra_inputs: list[str] = (), keep_metadata: tuple[str, ...] = (), name: str) -> onnx.ModelProto:
    """A model of `nodes` with `outputs` (`protos.cut_model`), where a parameter's gradient `<p>_grad` that the
    step graph does not declare has its parameter's type and shape."""
    grads = {}
    for vi in model.graph.input:
        grad = grads[vi.name + GRAD_SUFFIX] = onnx.ValueInfoProto()
        grad.CopyFrom(vi)
        grad.name = vi.name + GRAD_SUFFIX
    return cut_model(model, nodes, outputs, extra_inputs=extra_inputs, types=grads, keep_metadata=keep_metadata,
                     name=name)
