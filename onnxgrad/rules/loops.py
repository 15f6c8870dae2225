"""Gradient rules: Scan and Loop.

The forward loop gains one stacked output per carried value: the value each iteration started from (Scan: a
scan output along axis 0; Loop: a scan output, so its length is the count of iterations actually run). These
carries are the residuals. The backward is a loop of the same kind that runs the iterations the other way: each
backward iteration recomputes the forward body from its carry and its slices, differentiates it with the same
walker (the body read as a graph of its own, as the If rule does with its branches), and
- carries the gradient of the carried values from one iteration to the one before;
- carries, as extra state, the sum of the gradients of the outer values the body reads (weights);
- emits (Scan) the gradient of each scan input slice as a scan output running the other way.
Storing carries and recomputing the body keeps the residual memory at one carry per iteration whatever the body
computes, at the cost of running the body twice; it is also the shape segment checkpointing needs.
A body that would recompute a random op is refused: the recomputed draw would differ from the forward one.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from .. import lowering
from ..builder import Builder
from ..errors import UnsupportedError
from ..gradient import differentiate, reaching_heads
from ..ir import (Graph, Node, Value, attach_implicit_inputs, constant_value, from_model, known_value,
                  names_defined_in, outer_references)
from ..protos import declared_dims
from ..registry import rule
from ..shapes import type_everything
from .subgraphs import draws_random, needed_nodes, renamed_copy


@rule("Scan", since=13, limits="opset 8's batched form refused; tensor carries and scan values only; "
                              "no random op in the body; stores one carry per iteration and recomputes the body")
def scan(ctx):
    """d(initial carries, scan inputs, outer values) = reversed Scan of the body's backward over (carry, x, dy)"""
    node, op = ctx.node, ctx.op
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    n = len(node.inputs) - m
    k = len(body.output) - n
    in_axes = list(node.attr("scan_input_axes") or [0] * m)
    in_dirs = list(node.attr("scan_input_directions") or [0] * m)
    out_axes = list(node.attr("scan_output_axes") or [0] * k)
    out_dirs = list(node.attr("scan_output_directions") or [0] * k)
    _refuse_non_tensors(ctx, body)
    outer_needed = [v for j, v in enumerate(node.implicit_inputs) if ctx.needs(len(node.inputs) + j)]

    # the forward Scan also stacks the carry each iteration starts from
    residuals = _stack_carries(ctx, body, body_inputs=list(range(n)), axes_attr="scan_output_axes",
                               dirs_attr="scan_output_directions", length=_scan_length(node, n, in_axes))
    body = node.attr("body")

    renamed = {name: op.names.fresh(name) for name in sorted(names_defined_in(body))}
    sub = _typed_body(renamed_copy(body, renamed), op.graph, _body_input_types(node, body, n, in_axes))
    state_ins, slice_ins = sub.inputs[:n], sub.inputs[n:n + m]
    sub_outs = sub.outputs
    seeds_state = [_carry_seed(op, v) for v in state_ins]
    grads_y = [ctx.GO(n + i) for i in range(k)]
    seeds_y = [Value(op.names.fresh(f"{node.name or 'Scan'}_dy{i}"), sub_outs[n + i].elem_type,
                     sub_outs[n + i].shape) if g is not None and _float(sub_outs[n + i]) else None
               for i, g in enumerate(grads_y)]
    heads = [(o, s) for o, s in zip(sub_outs[:n], seeds_state) if s is not None]
    heads += [(sub_outs[n + i], s) for i, s in enumerate(seeds_y) if s is not None]
    wrt_slices = [v for j, v in enumerate(slice_ins) if ctx.needs(n + j) and _float(v)]
    outer_in_sub = [sub.values[v.name] for v in outer_needed]
    carried_w = [Value(op.names.fresh(f"{v.name}_acc"), v.elem_type, v.shape) for v in outer_needed]
    where = f"in the body of Scan node {node.name!r}"
    result = _differentiate_body(ctx, sub, heads, [v for v in state_ins if _float(v)] + wrt_slices + outer_in_sub,
                                 where)

    bop = Builder(sub, op.names, prefix=f"{node.name or 'Scan'}_grad/body")
    outs = [_grad_or_zeros(bop, result, v) for v in state_ins if _float(v)]
    outs += [_accumulate(bop, result, v, acc) for v, acc in zip(outer_in_sub, carried_w)]
    outs += [_grad_or_zeros(bop, result, v) for v in wrt_slices]
    outs = _distinct(bop, outs)
    seeds_state = [s for s in seeds_state if s is not None]
    inputs = seeds_state + carried_w + list(slice_ins) + list(state_ins) + [s for s in seeds_y if s is not None]
    graph_proto = _body_proto(ctx, sub, inputs, outs, f"{body.name or 'body'}_grad", where)

    # the backward Scan: carries (state gradients, accumulators), then scan inputs read in the reverse order
    y_used = [i for i, s in enumerate(seeds_y) if s is not None]
    starts = [ctx.GO(i) if ctx.GO(i) is not None else ctx.zeros_like(ctx.O(i))
              for i in range(n) if _float(state_ins[i])]
    starts += [ctx.zeros_like(v) for v in outer_needed]
    scans = list(node.inputs[n:]) + residuals + [grads_y[i] for i in y_used]
    wrt_idx = [j for j in range(m) if ctx.needs(n + j) and _float(slice_ins[j])]
    back = op.Scan(*starts, *scans, outputs=len(starts) + len(wrt_idx), body=graph_proto,
                   num_scan_inputs=len(scans),
                   scan_input_axes=in_axes + [0] * n + [out_axes[i] for i in y_used],
                   scan_input_directions=[1 - d for d in in_dirs] + [1] * n + [1 - out_dirs[i] for i in y_used],
                   scan_output_axes=[in_axes[j] for j in wrt_idx] or None,
                   scan_output_directions=[1 - in_dirs[j] for j in wrt_idx] or None)
    back = [back] if not isinstance(back, tuple) else list(back)
    attach_implicit_inputs(op.graph, back[0].producer)
    float_states = [i for i in range(n) if _float(state_ins[i])]
    like = [node.inputs[i] for i in float_states] + outer_needed + [node.inputs[n + j] for j in wrt_idx]
    for g, v in zip(back, like):
        g.elem_type, g.shape = v.elem_type, v.shape
    grads: list = [None] * len(node.all_inputs)
    for g, i in zip(back, float_states):
        grads[i] = g
    for g, v in zip(back[len(float_states):], outer_needed):
        grads[len(node.inputs) + node.implicit_inputs.index(v)] = g
    for g, j in zip(back[len(float_states) + len(outer_needed):], wrt_idx):
        grads[n + j] = g
    return [g if ctx.needs(i) else None for i, g in enumerate(grads)]


def _scan_length(node: Node, n: int, in_axes: list[int]) -> int | str | None:
    first = node.inputs[n]
    if first is None or first.shape is None:
        return None
    return first.shape[in_axes[0] % len(first.shape)]


@rule("Loop", since=13, limits="needs a trip count: a constant, a runtime value, or --loop-bound NAME=N for a "
                               "condition-only loop; tensor carries only; no random op in the body; stores one "
                               "carry per iteration run and recomputes the body")
def loop(ctx):
    """d(initial carries, outer values) = Loop over the iterations run, backwards, of the body's backward"""
    node, op = ctx.node, ctx.op
    body = node.attr("body")
    n = len(node.inputs) - 2
    k = len(body.output) - 1 - n
    trips = ctx.const_value_of(node.input(0))
    # exporters write a while loop's missing trip count as the largest int64
    if node.input(0) is None or (trips is not None and int(trips.reshape(-1)[0]) >= 2**62):
        raise ctx.unsupported(
            "the loop has no trip count, only a condition, so the iterations to store are not bounded; give a "
            f"bound with --loop-bound {node.name or '<loop name>'}=N (the loop then runs at most N iterations)")
    _refuse_non_tensors(ctx, body)
    outer_needed = [v for j, v in enumerate(node.implicit_inputs) if ctx.needs(len(node.inputs) + j)]

    # the forward Loop also stacks the carry each iteration starts from, and its iteration number
    residuals = _stack_carries(ctx, body, body_inputs=[0] + list(range(2, 2 + n)), axes_attr=None, dirs_attr=None,
                               length=_loop_length(ctx, body))
    iterations, residuals = residuals[0], residuals[1:]
    body = node.attr("body")

    renamed = {name: op.names.fresh(name) for name in sorted(names_defined_in(body))}
    types = [(TensorProto.INT64, ()), (TensorProto.BOOL, ())]
    types += [(v.elem_type, v.shape) if v is not None else (None, None) for v in node.inputs[2:]]
    sub = _typed_body(renamed_copy(body, renamed), op.graph, types)
    iter_in, cond_in, carried_in = sub.inputs[0], sub.inputs[1], sub.inputs[2:2 + n]
    sub_outs = sub.outputs
    prefix = f"{node.name or 'Loop'}_grad"

    # the body of the backward Loop starts by picking forward iteration t = count - 1 - u from the residuals
    count = op.Squeeze(op.Slice(op.Shape(iterations), op.ints([0]), op.ints([1])), op.ints([0]))
    u = Value(op.names.fresh(f"{prefix}/u"), TensorProto.INT64, ())
    u_cond = Value(op.names.fresh(f"{prefix}/cond"), TensorProto.BOOL, ())
    pick = Builder(sub, op.names, prefix=f"{prefix}/body")
    first_node = len(sub.nodes)
    t = pick.Sub(pick.Sub(Value(count.name, TensorProto.INT64, ()), u), pick.const(1, TensorProto.INT64))
    t.elem_type, t.shape = TensorProto.INT64, ()
    _define(sub, pick, "Identity", [t], iter_in)
    _define(sub, pick, "Identity", [pick.const(True, TensorProto.BOOL)], cond_in)
    for v, r in zip(carried_in, residuals):
        _define(sub, pick, "Gather", [Value(r.name, r.elem_type, r.shape), t], v, axis=0)
    out_grads = [op.Identity(ctx.GO(n + i)) if ctx.GO(n + i) is not None and _float(sub_outs[1 + n + i]) else None
                 for i in range(k)]  # read by name in the body: through Identities no later pass renames
    seeds_y = []
    for i, g in enumerate(out_grads):
        if g is None:
            seeds_y.append(None)
            continue
        o = sub_outs[1 + n + i]
        seed = pick.Gather(Value(g.name, o.elem_type, None if o.shape is None else (None, *o.shape)), t, axis=0)
        seed.elem_type, seed.shape = o.elem_type, o.shape
        seeds_y.append(seed)
    sub.reorder(sub.nodes[first_node:] + sub.nodes[:first_node])
    sub.inputs = [v for v in sub.inputs if v.producer is None]

    seeds_state = [_carry_seed(op, v) for v in carried_in]
    heads = [(o, s) for o, s in zip(sub_outs[1:1 + n], seeds_state) if s is not None]
    heads += [(sub_outs[1 + n + i], s) for i, s in enumerate(seeds_y) if s is not None]
    outer_in_sub = [sub.values[v.name] for v in outer_needed]
    carried_w = [Value(op.names.fresh(f"{v.name}_acc"), v.elem_type, v.shape) for v in outer_needed]
    where = f"in the body of Loop node {node.name!r}"
    float_carried = [v for v in carried_in if _float(v)]
    result = _differentiate_body(ctx, sub, heads, float_carried + outer_in_sub, where)

    bop = Builder(sub, op.names, prefix=f"{prefix}/body")
    outs = [bop.Identity(u_cond)]
    outs += [_grad_or_zeros(bop, result, v) for v in float_carried]
    outs += [_accumulate(bop, result, v, acc) for v, acc in zip(outer_in_sub, carried_w)]
    outs = _distinct(bop, outs)
    seeds_state = [s for s in seeds_state if s is not None]
    graph_proto = _body_proto(ctx, sub, [u, u_cond] + seeds_state + carried_w, outs,
                              f"{body.name or 'body'}_grad", where)

    float_idx = [i for i in range(n) if _float(carried_in[i])]
    starts = [ctx.GO(i) if ctx.GO(i) is not None else ctx.zeros_like(ctx.O(i)) for i in float_idx]
    starts += [ctx.zeros_like(v) for v in outer_needed]
    back = op.Loop(count, None, *starts, outputs=len(starts), body=graph_proto)
    back = [back] if not isinstance(back, tuple) else list(back)
    attach_implicit_inputs(op.graph, back[0].producer)
    like = [node.inputs[2 + i] for i in float_idx] + outer_needed
    for g, v in zip(back, like):
        g.elem_type, g.shape = v.elem_type, v.shape
    grads: list = [None] * len(node.all_inputs)
    for g, i in zip(back, float_idx):
        grads[2 + i] = g
    for g, v in zip(back[len(float_idx):], outer_needed):
        grads[len(node.inputs) + node.implicit_inputs.index(v)] = g
    return [g if ctx.needs(i) else None for i, g in enumerate(grads)]


def _loop_length(ctx, body: onnx.GraphProto) -> int | str:
    """The number of iterations a Loop runs, as the first dim of its stacked carries: its trip count when that
    is a constant and nothing can end the loop early, else a symbol (`--dim <loop>_iterations=N` sizes it for the
    memory planner)."""
    node = ctx.node
    trips = ctx.const_value_of(node.input(0))
    cond = node.input(1)
    cond_value = ctx.const_value_of(cond) if cond is not None else np.array(True)
    producers = {o: n for n in body.node for o in n.output}
    cond_out = body.output[0].name
    while cond_out in producers and producers[cond_out].op_type == "Identity":
        cond_out = producers[cond_out].input[0]
    if cond_out in producers:
        value = constant_value(producers[cond_out].attribute) if producers[cond_out].op_type == "Constant" else None
    else:  # the condition read from outside the body
        value = ctx.const_value_of(ctx.op.graph.values.get(cond_out))
    keeps_going = cond_out == body.input[1].name or (value is not None and bool(value.reshape(-1)[0]))
    if trips is not None and cond_value is not None and bool(cond_value.reshape(-1)[0]) and keeps_going:
        return int(trips.reshape(-1)[0])
    return f"{node.name or 'Loop'}_iterations"


# -- the pieces both rules share -----------------------------------------------------------------------------------
def _float(v: Value) -> bool:
    return v.elem_type is None or v.is_float


def _refuse_non_tensors(ctx, body: onnx.GraphProto) -> None:
    for vi in [*body.input, *body.output]:
        if vi.type.HasField("sequence_type") or vi.type.HasField("optional_type") or vi.type.HasField("map_type"):
            raise ctx.unsupported(f"the body's {vi.name!r} is a {vi.type.WhichOneof('value').replace('_type', '')}, "
                                  f"not a tensor; only tensors are carried through a differentiated loop")


def _stack_carries(ctx, body: onnx.GraphProto, body_inputs: list[int], axes_attr, dirs_attr,
                   length) -> list[Value]:
    """Add to the forward node one scan output per listed body input: its value at the start of each iteration
    (stacked along axis 0, in iteration order). Returns the new outer outputs."""
    node, op = ctx.node, ctx.op
    new_body = onnx.GraphProto()
    new_body.CopyFrom(body)
    outs = []
    for i in body_inputs:
        vi = body.input[i]
        name = op.names.fresh(f"{vi.name}_stacked")
        new_body.node.append(helper.make_node("Identity", [vi.name], [name], name=name))
        info = new_body.output.add()
        info.CopyFrom(vi)
        info.name = name
        shape = declared_dims(vi)
        outer = Value(op.names.fresh(f"{node.name or node.op_type}_carry{i}"), vi.type.tensor_type.elem_type or None,
                      None if shape is None else (length, *shape))
        outs.append(outer)
    attrs = []
    for a in node.attributes:
        if a.name == "body":
            attrs.append(helper.make_attribute("body", new_body))
        elif a.name in (axes_attr, dirs_attr):
            attrs.append(helper.make_attribute(a.name, list(a.ints) + [0] * len(body_inputs)))
        else:
            attrs.append(a)
    node.attributes[:] = attrs
    base = len(node.outputs)
    for j, v in enumerate(outs):
        v.producer, v.index = node, base + j
        node.outputs.append(v)
        op.graph.values[v.name] = v
    return outs


def _body_input_types(node: Node, body: onnx.GraphProto, n: int, in_axes: list[int]) -> list:
    """Scan body input types from the outer operands, where the body leaves them untyped."""
    types = []
    for i, v in enumerate(node.inputs):
        if v is None or v.shape is None:
            types.append((v.elem_type if v is not None else None, None))
        elif i < n:
            types.append((v.elem_type, v.shape))
        else:
            axis = in_axes[i - n] % len(v.shape)
            types.append((v.elem_type, v.shape[:axis] + v.shape[axis + 1:]))
    return types


def _typed_body(body: onnx.GraphProto, outer: Graph, input_types: list) -> Graph:
    """A loop body as a Graph of its own, every value typed by onnx's shape inference: its inputs typed from the
    outer operands where the body leaves them untyped, and the outer values it reads as extra inputs."""
    proto = onnx.GraphProto()
    proto.CopyFrom(body)
    for vi, (elem, shape) in zip(proto.input, input_types):
        t = vi.type.tensor_type
        if elem and not t.elem_type:
            t.elem_type = elem
        if shape is not None and not t.HasField("shape"):
            vi.type.CopyFrom(helper.make_tensor_type_proto(t.elem_type, list(shape)))
    # small integer constants from outside (axes, shapes) are shown to onnx's inference as initializers, so it
    # can use their values; the body still reads them by name
    known = []
    for name in outer_references(body):
        v = outer.values.get(name)
        proto.input.append(v.value_info() if v is not None else helper.make_empty_tensor_value_info(name))
        value = _small_int_constant(outer, v)
        if value is not None:
            known.append(numpy_helper.from_array(value, name))
    model = helper.make_model(proto, opset_imports=[helper.make_opsetid(d, v) for d, v in outer.opsets.items()])
    model.ir_version = outer.model_template.ir_version or model.ir_version
    model.graph.initializer.extend(known)
    try:
        model = shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001  (untyped values stay untyped; the rules say which type they miss)
        pass
    kept = [t for t in model.graph.initializer if all(t.name != k.name for k in known)]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return from_model(model)


def _small_int_constant(outer: Graph, v: Value | None):
    if v is None or v.elem_type not in (TensorProto.INT64, TensorProto.INT32) or v.static_shape is None:
        return None
    if len(v.static_shape) > 1 or (v.static_shape and v.static_shape[0] > 64):
        return None
    return known_value(outer, v)


def _carry_seed(op: Builder, v: Value) -> Value | None:
    """The carried gradient of a float carry: an input of the backward body."""
    if not _float(v):
        return None
    return Value(op.names.fresh(f"{v.name}_grad"), v.elem_type, v.shape)


def _differentiate_body(ctx, sub: Graph, heads: list, wrt: list[Value], where: str):
    head_values, seeds = [h for h, _ in heads], [s for _, s in heads]
    try:
        lowering.lower_for_gradient(sub, head_values)
        return differentiate(sub, head_values, seeds, wrt, ctx.op.names, reaching_heads(sub, head_values))
    except UnsupportedError as e:
        raise UnsupportedError(f"{where}: {e}") from None


def _grad_or_zeros(op: Builder, result, v: Value) -> Value:
    g = result.grads.get(v.name)
    if g is not None:
        return g
    zero = helper.make_tensor("", v.elem_type or TensorProto.FLOAT, [1], [0])
    shape = op.ints(v.static_shape) if v.static_shape is not None else op.Shape(v)
    out = op.ConstantOfShape(shape, value=zero)
    out.elem_type, out.shape = v.elem_type, v.shape
    return out


def _accumulate(op: Builder, result, v: Value, acc: Value) -> Value:
    g = result.grads.get(v.name)
    out = op.Identity(acc) if g is None else op.Add(acc, g)
    out.elem_type, out.shape = v.elem_type, v.shape
    return out


def _distinct(op: Builder, outs: list[Value]) -> list[Value]:
    """A body output must be a value the body computes, and each one distinct."""
    fixed = []
    for g in outs:
        if g.producer is None or any(g is o for o in fixed):
            copy = op.Identity(g)
            copy.elem_type, copy.shape = g.elem_type, g.shape
            g = copy
        fixed.append(g)
    return fixed


def _define(sub: Graph, op: Builder, op_type: str, inputs: list[Value], target: Value, **attrs) -> None:
    """A node that computes `target` (a body input until now) from `inputs`."""
    name = op.names.fresh(f"{op.prefix}/{op_type}")
    node = Node(op_type, inputs, [target], name, [helper.make_attribute(a, x) for a, x in attrs.items()],
                phase=op.phase)
    sub.add_node(node)


def _body_proto(ctx, sub: Graph, inputs: list[Value], outputs: list[Value], name: str, where: str):
    """The backward body: the nodes the outputs need, typed, with the given inputs and outputs."""
    kept = needed_nodes(sub, outputs)
    for n in kept:
        if draws_random(n, [sub, ctx.op.graph]):
            raise UnsupportedError(
                f"no gradient for {ctx.node.op_type} node {ctx.node.name!r}: {n.op_type} node {n.name!r} {where} "
                f"draws random numbers, and the backward recomputes the body, so it would draw different ones; "
                f"draw them before the loop and read them as a scan input")
    if any(v.name and not v.is_typed for node in kept for v in node.outputs):
        _type_nodes(sub, kept, inputs)
    edges = {v.name for v in outputs}
    value_info = [v.value_info() for node in kept for v in node.outputs
                  if v.name and v.elem_type and v.name not in edges]
    return helper.make_graph([node.to_proto() for node in kept], name, [v.value_info() for v in inputs],
                             [v.value_info() for v in outputs], list(sub.initializers.values()),
                             value_info=value_info, sparse_initializer=sub.sparse_initializers)


def _type_nodes(sub: Graph, kept: list[Node], inputs: list[Value]) -> None:
    """Type what the builder could not, with onnx's shape inference over the backward body."""
    saved_nodes, saved_inputs = sub.nodes, sub.inputs
    sub.nodes, sub.inputs = kept, list(inputs) + [v for v in saved_inputs if v.producer is None
                                                  and all(v is not w for w in inputs)]
    try:
        type_everything(sub)
    except Exception:  # noqa: BLE001  (a value onnx cannot type stays untyped in value_info)
        pass
    finally:
        sub.nodes, sub.inputs = saved_nodes, saved_inputs
