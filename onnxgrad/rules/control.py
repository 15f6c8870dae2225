"""Gradient rules: control flow (If), and the ops that onnxgrad/lowering.py rewrites before differentiation.

If: the gradient is itself an If on the same condition. Each of its branches is the backward graph of the
forward branch, built by the same walker on the branch read as a graph of its own: the outer-scope values the
branch reads are that graph's inputs, its outputs the heads, seeded by the outer output gradients (read by
name from the outer scope). The backward branch recomputes the forward branch's intermediates instead of
exporting them from the forward If: simplest and always correct, at the cost of running the branch twice.
It outputs one gradient per outer value that needs one, zeros where the branch does not read it. A branch
that would recompute a random op (Dropout in training form, Random*, Bernoulli) is refused: the recomputed
draw would differ from the forward one.

LSTM, GRU, RNN and the sequence ops are rewritten into plain tensor ops before the gradient pass
(onnxgrad/lowering.py). Their rules below are reached only when that rewrite declined a node; they raise the
reason, so the error names the form and what to do. Scan and Loop have their rules in rules/loops.py.
"""
from __future__ import annotations

import onnx
from onnx import helper

from .. import lowering
from ..builder import Builder
from ..errors import UnsupportedError
from ..gradient import differentiate, reaching_heads
from ..ir import Value, attach_implicit_inputs, names_defined_in
from ..registry import rule
from .subgraphs import as_graph, draws_random, needed_nodes, renamed_copy


@rule("If", since=13, limits="branches are recomputed by the backward If, so no random op may feed the "
                             "gradient inside them")
def if_(ctx):
    """d(outer values the branches read) = If(cond, backward of then_branch, backward of else_branch)"""
    node = ctx.node
    first = len(node.inputs)
    wanted = [v for k, v in enumerate(node.implicit_inputs) if ctx.needs(first + k)]
    # the branches read the output gradients by name: through Identities, which no later pass renames (a
    # gradient value itself may become an `--also-grad` output and be renamed)
    out_grads = [None if g is None else ctx.op.Identity(g) for g in map(ctx.GO, range(len(node.outputs)))]
    branches = {name: _branch_backward(ctx, name, wanted, out_grads) for name in ("then_branch", "else_branch")}
    outs = ctx.op.If(ctx.I(0), outputs=len(wanted), **branches)
    outs = [outs] if len(wanted) == 1 else list(outs)
    attach_implicit_inputs(ctx.op.graph, outs[0].producer)
    for g, v in zip(outs, wanted):
        g.elem_type, g.shape = v.elem_type, v.shape
    by_value = {id(v): g for v, g in zip(wanted, outs)}
    return [None] * first + [by_value.get(id(v)) for v in node.implicit_inputs]


def _branch_backward(ctx, attr_name: str, wanted: list[Value], out_grads: list[Value | None]) -> onnx.GraphProto:
    """The backward graph of one branch: recompute it, differentiate it, output one gradient per wanted value."""
    node, outer, names = ctx.node, ctx.op.graph, ctx.op.names
    branch = node.attr(attr_name)
    # the recomputed values get new names: sibling subgraphs defining one name trip onnx's data propagation
    renamed = {name: names.fresh(name) for name in sorted(names_defined_in(branch))}
    sub = as_graph(renamed_copy(branch, renamed), outer)
    heads, seeds = [], []
    for out, g in zip(sub.outputs, out_grads):
        if g is not None and (out.elem_type is None or out.is_float):
            heads.append(out)
            seeds.append(Value(g.name, out.elem_type, out.shape))  # the outer gradient, read by name
    wrt = [sub.values[v.name] for v in wanted if v.name in sub.values]
    where = f"in the {attr_name} of If node {node.name!r}"
    try:
        lowering.lower_for_gradient(sub, heads)
        result = differentiate(sub, heads, seeds, wrt, names, reaching_heads(sub, heads))
    except UnsupportedError as e:
        raise UnsupportedError(f"{where}: {e}") from None

    op = Builder(sub, names, prefix=f"{node.name or 'If'}_grad/{attr_name}")
    outputs: list[Value] = []
    for v in wanted:
        g = result.grads.get(v.name)
        if g is None:  # the branch does not read v, or v does not reach the branch's outputs
            zero = helper.make_tensor("", ctx.elem_type(v), [1], [0])
            shape = op.ints(v.static_shape) if v.static_shape is not None else op.Shape(Value(v.name))
            g = op.ConstantOfShape(shape, value=zero)
        elif g.producer is None or any(g is o for o in outputs):  # an outer value, or a second copy
            g = op.Identity(g)
        outputs.append(g)

    kept = needed_nodes(sub, outputs)
    for n in kept:
        if draws_random(n, [sub, outer]):
            raise UnsupportedError(
                f"no gradient for If node {node.name!r}: {n.op_type} node {n.name!r} {where} draws random "
                f"numbers, and the backward branch recomputes the branch, so it would draw different ones; "
                f"move the random op out of the If (compute it before and read its result in the branch)")
    infos = [Value(g.name, v.elem_type, v.shape).value_info() for g, v in zip(outputs, wanted)]
    return helper.make_graph([n.to_proto() for n in kept], f"{branch.name or attr_name}_grad", [], infos,
                             list(sub.initializers.values()), sparse_initializer=sub.sparse_initializers)


# -- forms the pre-pass declined ----------------------------------------------------------------------------------
def _declined(ctx):
    raise ctx.unsupported(lowering.why_not_lowered(ctx.node, ctx.op.graph))


@rule("LSTM", since=13, limits="unrolled before differentiation: static sequence length, sequence_lens absent or "
                               "constant and full")
def lstm(ctx):
    """unrolled into MatMul/Sigmoid/Tanh/Mul steps by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("GRU", since=13, limits="unrolled before differentiation: static sequence length, sequence_lens absent or "
                              "constant and full")
def gru(ctx):
    """unrolled into MatMul/Sigmoid/Tanh/Mul steps by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("RNN", since=13, limits="unrolled before differentiation: static sequence length, sequence_lens absent or "
                              "constant and full")
def rnn(ctx):
    """unrolled into MatMul/Tanh steps by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


_SEQUENCE_LIMITS = "rewritten to tensor ops before differentiation: constant positions, static split sizes"


@rule("SplitToSequence", since=13, limits=_SEQUENCE_LIMITS)
def split_to_sequence(ctx):
    """a Split (then Squeeze for keepdims=0) by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("SequenceConstruct", since=13, limits=_SEQUENCE_LIMITS)
def sequence_construct(ctx):
    """the list of its inputs, tracked by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("SequenceInsert", since=13, limits=_SEQUENCE_LIMITS)
def sequence_insert(ctx):
    """the list with one more tensor, tracked by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("SequenceErase", since=13, limits=_SEQUENCE_LIMITS)
def sequence_erase(ctx):
    """the list with one tensor less, tracked by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("SequenceAt", since=13, limits=_SEQUENCE_LIMITS)
def sequence_at(ctx):
    """the tensor at a constant position, by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)


@rule("ConcatFromSequence", since=13, limits=_SEQUENCE_LIMITS)
def concat_from_sequence(ctx):
    """a Concat (of Unsqueezed tensors for new_axis=1) by onnxgrad/lowering.py; reached only when that declined"""
    return _declined(ctx)
