"""Gradient rules: softmax family and classification losses.

The losses are written with standard ops only: the labels pick their class through an Equal mask against the
class indices (no OneHot, whose onnxruntime kernels cover few value types), and ignore_index becomes a 0/1
weight. The one forward-only tensor is the softmax (exp of the log-probabilities) that the log-softmax
gradient multiplies the summed gradient by; masks and per-label weights are small.
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..registry import rule


@rule("Softmax", since=13)
def softmax(ctx):
    """dx = dy*y - sum(dy*y, axis) * y"""
    y, op = ctx.O(0), ctx.op
    t = op.Mul(ctx.GO(0), y)
    total = op.ReduceSum(t, op.ints([ctx.attr("axis", -1)]), keepdims=1)
    return [op.Sub(t, op.Mul(total, y))]


@rule("LogSoftmax", since=13)
def log_softmax(ctx):
    """dx = dy - sum(dy, axis) * exp(y)"""
    gy, op = ctx.GO(0), ctx.op
    total = op.ReduceSum(gy, op.ints([ctx.attr("axis", -1)]), keepdims=1)
    return [op.Sub(gy, op.Mul(total, op.Exp(ctx.O(0))))]  # exp(y) reads the forward output only


def _picked_grad(ctx, x):
    """The gradient of the loss output with respect to x[n, c, d...] (x: log-probabilities, shape (N, C, d...)).

    Returns (g, per_label) where g is -dl[n, d...] * w[n, d...] at c == label[n, d...] and 0 elsewhere, and
    per_label is that coefficient with the class axis kept as size 1 (the sum of g over classes).
    w is weight[label] (1 without weights), 0 where label == ignore_index; dl is the loss gradient spread back
    over the reduction: 'none' as is, 'sum' broadcast, 'mean' divided by sum(w) (or the count of labels).
    """
    op = ctx.op
    per_label, _ = _label_coefficient(ctx, x)
    hit = op.Equal(op.Unsqueeze(ctx.I(1), op.ints([1])), _class_indices(ctx, x, ctx.elem_type(ctx.I(1))))
    return op.Where(hit, per_label, ctx.const_like(0.0, x)), per_label


def _label_coefficient(ctx, x):
    """(per_label, safe_labels): the coefficient of `_picked_grad` at each label, shape (N, 1, d...), and the
    labels with ignored ones pointed at class 0 (whose coefficient is 0)."""
    op = ctx.op
    labels, weight, gl = ctx.I(1), ctx.I(2), ctx.GO(0)
    reduction = ctx.text_attr("reduction", "mean")
    ignore_index = ctx.attr("ignore_index")
    if reduction not in ("none", "sum", "mean"):
        raise ctx.unsupported(f"reduction={reduction!r}")
    label_type = ctx.elem_type(labels)

    w = None
    safe_labels = labels
    if ignore_index is not None:
        ignored = op.Equal(labels, op.const(ignore_index, label_type))
        # An ignored label may lie outside [0, C): point it at class 0 so Gather stays in range; its weight is 0.
        safe_labels = op.Where(ignored, op.const(0, label_type), labels)
        w = op.Where(ignored, ctx.const_like(0.0, x), ctx.const_like(1.0, x))
    if weight is not None:
        picked = op.Gather(weight, safe_labels, axis=0)
        w = picked if w is None else op.Mul(picked, w)

    if reduction == "mean":
        if w is not None:
            count = op.ReduceSum(w, keepdims=0)
        else:
            static = labels.static_shape
            count = (ctx.const_like(float(np.prod(static)), x) if static is not None
                     else op.Cast(op.Size(labels), to=ctx.elem_type(x)))
        gl = op.Div(gl, count)
    coef = op.Neg(gl)
    if w is not None:
        coef = op.Mul(coef, w)
    elif reduction != "none":
        coef = op.Expand(coef, ctx.shape_of(labels))
    return op.Unsqueeze(coef, op.ints([1])), safe_labels


def _class_indices(ctx, x, label_type: int):
    """0..C-1 laid along axis 1 of a tensor of x's rank: shape (1, C, 1, ...)."""
    op, rank = ctx.op, ctx.rank(x)
    if rank < 2:
        raise ctx.unsupported(f"the scores {x.name!r} have rank {rank}; the op needs [N, C, ...]")
    classes = x.shape[1]
    if isinstance(classes, int):
        return op.const(np.arange(classes).reshape((1, classes) + (1,) * (rank - 2)), label_type)
    int64 = TensorProto.INT64
    c = op.Gather(op.Shape(x), op.const(1, int64), axis=0)  # a scalar, as Range wants
    indices = op.Range(op.const(0, int64), c, op.const(1, int64))
    indices = op.Reshape(indices, op.ints([1, -1] + [1] * (rank - 2)))
    return indices if label_type == int64 else op.Cast(indices, to=label_type)


@rule("NegativeLogLikelihoodLoss", since=13, wrt=(0,))
def negative_log_likelihood_loss(ctx):
    """dx[n, c, d] = -dl[n, d] * w[n, d] where c == label[n, d], else 0 (labels and weights get none)"""
    return [_picked_grad(ctx, ctx.I(0))[0]] + [None] * (ctx.num_inputs - 1)


@rule("SoftmaxCrossEntropyLoss", since=13, wrt=(0,))
def softmax_cross_entropy_loss(ctx):
    """g = dlog_prob + picked; dscores = g - softmax(scores) * sum(g, axis=1) (labels and weights get none)"""
    op, scores = ctx.op, ctx.I(0)
    has_log_prob = len(ctx.node.outputs) > 1 and ctx.O(1).name != ""
    g_log_prob = ctx.GO(1) if has_log_prob else None
    # The softmax reads forward values only: exp of the log_prob output when there is one, else recomputed.
    prob = op.Exp(ctx.O(1)) if has_log_prob else op.Softmax(scores, axis=1)
    if g_log_prob is None and ctx.GO(0) is not None and ctx.opset >= 16:
        # Only the loss has a gradient: -total * softmax, with each label's coefficient added at its class. Two
        # tensors of the scores' size are alive at once (the softmax and its product, then the product and the
        # sum), where the one-hot g beside them made three.
        per_label, labels = _label_coefficient(ctx, scores)
        spread = op.Mul(prob, op.Neg(per_label))
        at = op.Unsqueeze(labels, op.ints([1]))
        return [op.ScatterElements(spread, at, per_label, axis=1, reduction="add")] + [None] * (ctx.num_inputs - 1)
    g, total = None, None
    if ctx.GO(0) is not None:
        g, total = _picked_grad(ctx, scores)  # each label picks one class: sum over classes is per_label
    if g_log_prob is not None:
        g = g_log_prob if g is None else op.Add(g, g_log_prob)
        total = op.ReduceSum(g, op.ints([1]), keepdims=1)
    return [op.Sub(g, op.Mul(total, prob))] + [None] * (ctx.num_inputs - 1)
