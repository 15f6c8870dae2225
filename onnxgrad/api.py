"""`build_gradient`: a forward model in, a training graph out.

The pipeline, in one place: read -> check -> upgrade opset -> [append loss] -> bind shapes -> infer -> gradient
-> finalize -> [append optimizer].
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field

import onnx
from onnx import helper

from . import loader, losses, optim, registry, weights
from .builder import Builder, Names
from .errors import InternalError, UsageError
from .fold import fold_small_constants
from .gradient import differentiate, reaching
from .ir import Graph, Value, from_model, set_metadata

# Settings a runner should apply for the emitted node order to be the schedule (see README, "Running").
RUNTIME_HINTS = {
    "onnxgrad.execution_order": "PRIORITY_BASED",
    "onnxgrad.disabled_optimizers": "CommonSubexpressionElimination",
}
GRAD_SUFFIX = "_grad"
LOSS_OPTIONS = {"target_input", "loss_output", "reduction", "class_weights", "ignore_index"}


@dataclass
class BuildResult:
    model: onnx.ModelProto
    report: dict = field(default_factory=dict)
    # with build(weights_apart=True): the data of the model's stubs by name (weights.py), and the input's
    # external data files; io.save_model writes them
    weights: dict[str, onnx.TensorProto] = field(default_factory=dict)
    external_data: list = field(default_factory=list)


def build_gradient(model: str | os.PathLike | onnx.ModelProto, *, loss: str | None = None,
                   requires_grad: list[str] | None = None, frozen: list[str] | None = None,
                   also_grad: list[str] | None = None, input_shapes: dict[str, list[int]] | None = None,
                   dims: dict[str, int] | None = None, loss_fn: str | None = None, target: str | None = None,
                   loss_options: dict | None = None, optimizer: str | None = None,
                   optimizer_options: dict | None = None) -> onnx.ModelProto:
    """Return the training graph of `model`: its outputs, then `<param>_grad` per parameter, then
    `<value>_grad` per `also_grad` value. See `build` for the report as well.

    `loss_fn` ('mse', 'l1', 'cross-entropy', 'bce-with-logits') first appends a loss comparing the output
    `target` with a new target input (`loss_options`: the keywords of `losses.append_loss`). `optimizer`
    ('sgd', 'momentum', 'adam', 'adamw') turns the result into a step graph (`optimizer_options`: lr, momentum,
    nesterov, betas, eps, weight_decay, clip_grad_norm, accumulate, keep_grads; see `optim.append_optimizer`)."""
    return build(model, loss=loss, requires_grad=requires_grad, frozen=frozen, also_grad=also_grad,
                 input_shapes=input_shapes, dims=dims, loss_fn=loss_fn, target=target, loss_options=loss_options,
                 optimizer=optimizer, optimizer_options=optimizer_options).model


def build(model, *, loss=None, requires_grad=None, frozen=None, also_grad=None, input_shapes=None,
          dims=None, feed_head_grads: bool = False, loss_fn=None, target=None, loss_options=None,
          optimizer=None, optimizer_options=None, weights_apart: bool = False) -> BuildResult:
    """Like `build_gradient`, with a report. `feed_head_grads` gives scalar losses a `<loss>_grad` input
    too (instead of the constant 1), e.g. to scale the loss or to compute vector-Jacobian products.
    `weights_apart`: leave the large weights out of `model` (stubs, see weights.py) and in `weights`, for
    `io.save_model` to stream to disk without another copy in memory."""
    # A build makes millions of small objects that live until it ends; the cyclic collector would scan
    # them over and over (a quarter of the time at 100k nodes) and find nothing to free.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(model, loss=loss, requires_grad=requires_grad, frozen=frozen, also_grad=also_grad,
                      input_shapes=input_shapes, dims=dims, feed_head_grads=feed_head_grads, loss_fn=loss_fn,
                      target=target, loss_options=loss_options or {}, optimizer=optimizer,
                      optimizer_options=optimizer_options or {}, weights_apart=weights_apart)
    finally:
        if was_enabled:
            gc.enable()


def _build(model, *, loss, requires_grad, frozen, also_grad, input_shapes, dims, feed_head_grads, loss_fn, target,
           loss_options, optimizer, optimizer_options, weights_apart=False) -> BuildResult:
    started = time.perf_counter()
    registry.all_rules()  # make sure every rule is registered
    _check_training_options(loss_fn, target, loss_options, optimizer, optimizer_options)
    # the passes below work on a skeleton: large weights stay where they were loaded (weights.py)
    proto, held, data_files = loader.read_apart(model)
    loader.check(proto)
    source_opset = loader.model_opset(proto)
    proto = loader.upgrade_opset(proto)
    if loss_fn is not None:
        proto, loss = append_loss(proto, loss_fn, target, loss, loss_options)
    loader.bind_shapes(proto, input_shapes or {}, dims or {})
    proto = loader.infer_shapes(proto)
    for _ in range(4):  # exporters' little axes/shape subgraphs; folding one can make the next one static
        if not fold_small_constants(proto, loader.model_opset(proto)):
            break
        proto = loader.infer_shapes(proto)
    graph = from_model(proto, held)
    heads = select_heads(graph, loss)
    from .unroll import lower_for_gradient  # recurrent ops, sequence chains, Dropout masks -> plain forms
    lower_for_gradient(graph, heads)
    forward_nodes = len(graph.nodes)

    live = reaching(graph, heads)
    xs = select_parameters(graph, heads, live, requires_grad, frozen)
    us = [_find_value(graph, name, "--also-grad") for name in also_grad or []]
    for u in us:
        if u.elem_type is not None and not u.is_float:
            raise UsageError(f"--also-grad {u.name}: has a non-floating-point type, so no gradient")

    names = Names([*graph.values, *(n.name for n in graph.nodes)])
    out_names = [x.name + GRAD_SUFFIX for x in xs] + [u.name + GRAD_SUFFIX for u in us]
    for name in out_names:
        if names.taken(name):
            raise UsageError(f"cannot name a gradient output {name!r}: the model already has a value of that name")
        names.reserve(name)

    head_grads = [seed_gradient(graph, h, names, feed_head_grads) for h in heads]
    result = differentiate(graph, heads, head_grads, xs + us, names, live)
    for x in xs:
        if result.grads[x.name] is None:
            raise UsageError(f"{x.name!r} is not reachable from the loss {heads[0].name!r}: it has no gradient")

    finalize_outputs(graph, xs, us, result.grads, names, first_new_node=forward_nodes)
    for x in xs:
        if graph.is_initializer(x) and x not in graph.inputs:
            graph.inputs.append(x)
    out = graph.to_model(weights_apart=True)
    out.ir_version = helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
    out.producer_name, out.producer_version = "onnxgrad", _version()
    set_metadata(out, {**RUNTIME_HINTS, "onnxgrad.loss": ",".join(h.name for h in heads)})
    if optimizer is not None:
        out = optim.append_optimizer(out, optimizer, parameters=[x.name for x in xs], weights=graph.initializers,
                                     **optimizer_options)
    try:
        weights.check_model(out, full_check=True)
    except Exception as e:
        raise InternalError(f"the training graph fails the ONNX checker: {str(e).splitlines()[0]}") from None
    report = {
        "loss": heads[0].name,
        "parameters": [x.name for x in xs],
        "also_grad": [u.name for u in us],
        "loss_fn": loss_fn,
        "optimizer": optimizer,
        "outputs": [o.name for o in out.graph.output],
        "source_opset": source_opset,
        "opset": graph.opset,
        "ir_version": out.ir_version,
        "forward_nodes": forward_nodes,
        "backward_nodes": len(graph.nodes) - forward_nodes,
        "rules_used": dict(sorted(result.rules_used.items())),
        "seconds": round(time.perf_counter() - started, 4),
    }
    if weights_apart:
        return BuildResult(out, report, weights=graph.initializers, external_data=data_files)
    weights.join(out, graph.initializers)
    return BuildResult(out, report)


def _check_training_options(loss_fn, target, loss_options, optimizer, optimizer_options) -> None:
    """Fail before the slow part: options without their --loss-fn / --optimizer, or optimizer values refused."""
    if loss_fn is None and (target is not None or loss_options):
        flag = "--target" if target is not None else "--" + next(iter(loss_options)).replace("_", "-")
        raise UsageError(f"{flag}: needs --loss-fn")
    unknown = sorted(set(loss_options) - LOSS_OPTIONS)
    if unknown:
        raise UsageError(f"loss option {unknown[0]!r}: expected one of {', '.join(sorted(LOSS_OPTIONS))}")
    if optimizer is None and optimizer_options:
        raise UsageError(f"--{next(iter(optimizer_options)).replace('_', '-')}: needs --optimizer")
    if optimizer is not None:
        optim.optimizer_settings(optimizer, optimizer_options)


def append_loss(proto: onnx.ModelProto, loss_fn: str, target: str | None, loss: str | None,
                options: dict) -> tuple[onnx.ModelProto, str]:
    """The forward model with the loss appended, and the loss's name: the head of the gradient pass."""
    if target is None:
        if len(proto.graph.output) != 1:
            raise UsageError(f"--loss-fn {loss_fn}: name the output to compare with --target "
                             f"(outputs: {', '.join(o.name for o in proto.graph.output)})")
        target = proto.graph.output[0].name
    loss_output = options.get("loss_output", "loss")
    if loss is not None and loss != loss_output:
        raise UsageError(f"--loss {loss}: with --loss-fn the gradient is taken of the appended loss "
                         f"{loss_output!r}; drop --loss")
    return losses.append_loss(proto, loss_fn, target, **options), loss_output


def select_heads(graph: Graph, loss: str | list[str] | None) -> list[Value]:
    """The ys: the loss, or several outputs (each non-scalar one seeded by a `<y>_grad` input)."""
    if isinstance(loss, (list, tuple)):
        if not loss:
            raise UsageError("--loss: no output named")
        return [select_loss(graph, name) for name in loss]
    return [select_loss(graph, loss)]


def select_loss(graph: Graph, name: str | None) -> Value:
    if name is not None:
        for v in graph.outputs:
            if v.name == name:
                break
        else:
            raise UsageError(f"--loss {name}: no graph output of that name "
                             f"(outputs: {', '.join(o.name for o in graph.outputs)})")
    else:
        scalars = [v for v in graph.outputs if v.shape == () and v.is_float]
        if len(scalars) != 1:
            found = "no scalar output" if not scalars else f"{len(scalars)} scalar outputs"
            raise UsageError(f"cannot choose the loss: {found}; name it with --loss "
                             f"(candidates: {', '.join(o.name for o in (scalars or graph.outputs))})")
        v = scalars[0]
    if not v.is_float:
        raise UsageError(f"the loss {v.name!r} is not a floating-point tensor")
    return v


def select_parameters(graph: Graph, heads: list[Value], live: set[int], requires_grad, frozen) -> list[Value]:
    """The xs: requested names, or every floating-point initializer with a differentiable path to the loss
    (`live`: the ids of the values the heads depend on)."""
    frozen_set = set(frozen or [])
    for name in frozen_set:
        _find_value(graph, name, "--frozen")
    if requires_grad:
        xs = []
        for name in requires_grad:
            v = _find_value(graph, name, "--requires-grad")
            if not (graph.is_initializer(v) or v in graph.inputs):
                raise UsageError(f"--requires-grad {name}: not an initializer or a graph input "
                                 f"(use --also-grad for intermediate values)")
            if v.elem_type is not None and not v.is_float:
                raise UsageError(f"--requires-grad {name}: has an integer type, so no gradient")
            if id(v) not in live:
                raise UsageError(f"--requires-grad {name}: not reachable from the loss {heads[0].name!r} "
                                 f"through differentiable ops")
            if name not in frozen_set and v not in xs:
                xs.append(v)
    else:
        xs = [graph.values[name] for name in graph.initializers
              if name not in frozen_set and graph.values[name].is_float and id(graph.values[name]) in live]
    # parameters in initializer order, then graph inputs in input order
    order = {name: i for i, name in enumerate(graph.initializers)}
    order.update({v.name: len(order) + i for i, v in enumerate(graph.inputs) if v.name not in order})
    return sorted(xs, key=lambda v: order[v.name])


def seed_gradient(graph: Graph, head: Value, names: Names, feed: bool = False) -> Value:
    """1 for a scalar loss; otherwise (or when asked) a new graph input `<head>_grad` that the caller feeds."""
    if head.shape == () and not feed:
        return Builder(graph, names, prefix="seed").const(1.0, head.elem_type)
    name = head.name + GRAD_SUFFIX
    if names.taken(name):
        raise UsageError(f"cannot add the input {name!r} for the gradient of {head.name!r}: the name is taken")
    names.reserve(name)
    v = Value(name, head.elem_type, head.shape)
    graph.values[name] = v
    graph.inputs.append(v)
    return v


def finalize_outputs(graph: Graph, xs, us, grads: dict[str, Value | None], names: Names,
                     first_new_node: int) -> None:
    """Name each gradient output; a value claimed twice, or not ours to rename, goes out through Identity."""
    new_nodes = {id(n) for n in graph.nodes[first_new_node:]}
    claimed = {id(v) for v in graph.outputs} | {id(v) for v in graph.inputs}
    op = Builder(graph, names, prefix="grad_out")
    for v in list(xs) + list(us):
        g = grads[v.name]
        if g is None:  # an --also-grad value that the loss does not depend on
            g = op.ConstantOfShape(op.Shape(v), value=helper.make_tensor("", v.elem_type, [1], [0]))
        target = v.name + GRAD_SUFFIX
        if id(g) in claimed or g.producer is None or id(g.producer) not in new_nodes:
            g = op.Identity(g)
        graph.rename(g, target)
        g.elem_type, g.shape = v.elem_type, v.shape
        claimed.add(id(g))
        graph.outputs.append(g)


def _find_value(graph: Graph, name: str, flag: str) -> Value:
    v = graph.values.get(name)
    if v is None:
        raise UsageError(f"{flag} {name}: no value of that name in the model")
    return v


def _version() -> str:
    from . import __version__
    return __version__
