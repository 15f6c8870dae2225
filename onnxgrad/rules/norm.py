"""Gradient rules: normalization (layer, batch in inference form, instance, group, RMS) and dropout.

The normalizations share one input gradient. With xhat = (x - mean) * r, r = 1 / sqrt(var + eps), and g the
gradient reaching xhat (dy times the scale), dx = r * (g - mean(g)) - r^3 * mean(g * (x - mean)) * (x - mean).
It is written as g*r - x*k + (mean*k - mean(g)*r) with the per-row k = r^3 * (mean(g*x) - mean*mean(g)), the
form PyTorch's CPU kernel uses, and dscale's dy*xhat as (dy*x - dy*mean)*r, so every full-size node consumes
the gradient and none keeps a centred copy of x alive. The price is cancellation when |mean| >> std (relative
error about eps * |mean| / std), as in PyTorch. The statistics (mean and r, one value per normalized row) are
read from the forward node's optional outputs or recomputed from x: the only forward-only results, and small.
RMSNormalization (opset 23) is the same form without the mean: dx = g*r - x*k with k = r^3 * mean(g*x).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..registry import rule

_LOW_PRECISION = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _mean(ctx, v, axes):
    """ReduceMean over axes, keeping them; axes moved from attribute to input at opset 18."""
    if ctx.opset >= 18:
        return ctx.op.ReduceMean(v, ctx.op.ints(axes), keepdims=1)
    return ctx.op.ReduceMean(v, axes=list(axes), keepdims=1)


def _statistics(ctx, x, axes, eps, elem_type):
    """mean and r = 1/sqrt(var + eps) of x over axes (kept as size 1), recomputed from the forward input."""
    op = ctx.op
    mean = _mean(ctx, x, axes)
    centered = op.Sub(x, mean)
    var = _mean(ctx, op.Mul(centered, centered), axes)
    return mean, op.Reciprocal(op.Sqrt(op.Add(var, op.const(eps, elem_type))))


def _normalized_grad(ctx, x, g, mean, r, axes, g_mean=None, g_r=None, count=None):
    """dx for xhat = (x - mean) * r given g = dL/dxhat, plus the paths through mean and r as outputs."""
    op = ctx.op
    mg = _mean(ctx, g, axes)
    cov = op.Sub(_mean(ctx, op.Mul(g, x), axes), op.Mul(mean, mg))  # mean(g * (x - mean))
    if g_r is not None:  # dr/dx = -r^3 (x - mean) / n
        cov = op.Add(cov, op.Div(g_r, count))
    k = op.Mul(op.Mul(op.Mul(cov, r), r), r)
    shift = op.Sub(op.Mul(mean, k), op.Mul(mg, r))
    if g_mean is not None:  # dmean/dx = 1 / n
        shift = op.Add(shift, op.Div(g_mean, count))
    return op.Add(op.Sub(op.Mul(g, r), op.Mul(x, k)), shift)


def _xhat_times(ctx, gy, x, mean, r):
    """gy * (x - mean) * r, with every node consuming gy."""
    op = ctx.op
    return op.Mul(op.Sub(op.Mul(gy, x), op.Mul(gy, mean)), r)


def _channel_view(ctx, v, rank):
    """A per-channel (C,) tensor shaped (C, 1, ..., 1) to broadcast against (N, C, D1, ...)."""
    return v if rank <= 2 else ctx.op.Unsqueeze(v, ctx.op.ints(range(1, rank - 1)))


def _output(ctx, i):
    node = ctx.node
    return node.outputs[i] if i < len(node.outputs) and node.outputs[i].name else None


def _count(ctx, x, stat, elem_type):
    """Elements per normalized row: static where the shapes are, else Size(x) / Size(stat)."""
    xs, ss = x.static_shape, stat.static_shape
    if xs is not None and ss is not None:
        return ctx.op.const(float(np.prod(xs) // max(np.prod(ss), 1)), elem_type)
    return ctx.op.Cast(ctx.op.Div(ctx.op.Size(x), ctx.op.Size(stat)), to=elem_type)


def _work_type(ctx, x, stash_type):
    """float32 when the forward kept its statistics in float32 for a 16-bit input."""
    if stash_type == TensorProto.FLOAT and ctx.elem_type(x) in _LOW_PRECISION:
        return TensorProto.FLOAT
    return ctx.elem_type(x)


@rule("LayerNormalization", since=17)
def layer_normalization(ctx):
    """dx = r*(g - mean(g) - xhat*mean(g*xhat)) with g = dy*scale, dscale = sum(dy*xhat), db = sum(dy)"""
    op = ctx.op
    x, scale, y = ctx.I(0), ctx.I(1), ctx.O(0)
    rank = ctx.rank(x)
    axes = list(range(ctx.normalize_axis(ctx.attr("axis", -1), rank), rank))
    x_type, y_type = ctx.elem_type(x), ctx.elem_type(y)
    work = _work_type(ctx, x, ctx.attr("stash_type", TensorProto.FLOAT))
    xw = ctx.cast(x, x_type, work)
    gyw = ctx.cast(ctx.GO_or_zeros(0), y_type, work)
    mean_out, r_out = _output(ctx, 1), _output(ctx, 2)
    if mean_out is not None and r_out is not None:
        mean = ctx.cast(mean_out, ctx.elem_type(mean_out), work)
        r = ctx.cast(r_out, ctx.elem_type(r_out), work)
    else:
        mean, r = _statistics(ctx, xw, axes, ctx.attr("epsilon", 1e-5), work)
    gx = gs = gb = None
    if ctx.needs(0):
        g_mean = ctx.cast(ctx.GO(1), mean_out and ctx.elem_type(mean_out), work)
        g_r = ctx.cast(ctx.GO(2), r_out and ctx.elem_type(r_out), work)
        count = _count(ctx, x, mean_out or r_out, work) if (g_mean is not None or g_r is not None) else None
        g = op.Mul(gyw, ctx.cast(scale, ctx.elem_type(scale), work))
        gx = ctx.cast(_normalized_grad(ctx, xw, g, mean, r, axes, g_mean, g_r, count), work, x_type)
    if ctx.needs(1):
        scaled = ctx.cast(_xhat_times(ctx, gyw, xw, mean, r), work, ctx.elem_type(scale))
        gs = ctx.unbroadcast(scaled, scale)
    if ctx.needs(2):
        gb = ctx.unbroadcast(ctx.cast(ctx.GO_or_zeros(0), y_type, ctx.elem_type(ctx.I(2))), ctx.I(2))
    return [gx, gs, gb][:ctx.num_inputs]


@rule("BatchNormalization", since=13, wrt=(0, 1, 2),
      limits="training form at opset 14+ (training_mode=1; running statistics carry no gradient)")
def batch_normalization(ctx):
    """dx = dy * scale * r, dscale = sum(dy * (x - mean)) * r, db = sum(dy), r = 1/sqrt(var + eps)"""
    op = ctx.op
    if ctx.attr("training_mode", 0):
        return _batch_normalization_training(ctx)
    if any(o.name for o in ctx.node.outputs[1:]):
        raise ctx.unsupported("the opset 9-13 training form (statistics outputs, no training_mode attribute) is "
                              "not supported; export at opset 14+ (training_mode=1) or in eval mode")
    x, scale, bias, gy = ctx.I(0), ctx.I(1), ctx.I(2), ctx.GO(0)
    rank = ctx.rank(x)
    x_type, scale_type = ctx.elem_type(x), ctx.elem_type(scale)
    axes = op.ints([0, *range(2, rank)])
    mean = ctx.cast(ctx.I(3), ctx.elem_type(ctx.I(3)), x_type)
    var = ctx.cast(ctx.I(4), ctx.elem_type(ctx.I(4)), x_type)
    r = op.Reciprocal(op.Sqrt(op.Add(var, op.const(ctx.attr("epsilon", 1e-5), x_type))))  # per channel
    gx = gs = gb = None
    if ctx.needs(0):
        gx = op.Mul(gy, _channel_view(ctx, op.Mul(ctx.cast(scale, scale_type, x_type), r), rank))
    total = op.ReduceSum(gy, axes, keepdims=0) if ctx.needs(1) or ctx.needs(2) else None  # one pass for both
    if ctx.needs(1):
        weighted = op.ReduceSum(op.Mul(gy, x), axes, keepdims=0)
        gs = ctx.cast(op.Mul(op.Sub(weighted, op.Mul(total, mean)), r), x_type, scale_type)
    if ctx.needs(2):
        gb = ctx.cast(total, x_type, ctx.elem_type(bias))
    return [gx, gs, gb, None, None]


def _batch_normalization_training(ctx):
    """batch statistics over (N, D1, ...): dx = r*(g - mean(g) - xhat*mean(g*xhat)), g = dy*scale,
    dscale = sum(dy*xhat), db = sum(dy); running_mean and running_var are not differentiated"""
    if ctx.GO(1) is not None or ctx.GO(2) is not None:
        raise ctx.unsupported("the loss depends on the running_mean or running_var output; running statistics "
                              "carry no gradient (use Y)")
    op = ctx.op
    x, scale, bias, gy = ctx.I(0), ctx.I(1), ctx.I(2), ctx.GO(0)
    rank = ctx.rank(x)
    x_type, scale_type = ctx.elem_type(x), ctx.elem_type(scale)
    axes = [0, *range(2, rank)]
    mean, r = _statistics(ctx, x, axes, ctx.attr("epsilon", 1e-5), x_type)  # the batch's, shaped (1, C, 1, ...)
    gx = gs = gb = None
    if ctx.needs(0):
        g = op.Mul(gy, _channel_view(ctx, ctx.cast(scale, scale_type, x_type), rank))
        gx = _normalized_grad(ctx, x, g, mean, r, axes)
    if ctx.needs(1):
        gs = ctx.cast(op.ReduceSum(_xhat_times(ctx, gy, x, mean, r), op.ints(axes), keepdims=0), x_type,
                   scale_type)
    if ctx.needs(2):
        gb = ctx.cast(op.ReduceSum(gy, op.ints(axes), keepdims=0), x_type, ctx.elem_type(bias))
    return [gx, gs, gb, None, None]


@rule("InstanceNormalization", since=13)
def instance_normalization(ctx):
    """per (n, c) over spatial axes: dx = r*(g - mean(g) - xhat*mean(g*xhat)), g = dy*scale; dscale, db summed"""
    op = ctx.op
    x, scale, gy = ctx.I(0), ctx.I(1), ctx.GO(0)
    rank = ctx.rank(x)
    if rank < 3:
        raise ctx.unsupported("X needs at least one spatial axis")
    axes = list(range(2, rank))
    mean, r = _statistics(ctx, x, axes, ctx.attr("epsilon", 1e-5), ctx.elem_type(x))
    channel_axes = op.ints([0, *axes])
    gx = gs = gb = None
    if ctx.needs(0):
        gx = _normalized_grad(ctx, x, op.Mul(gy, _channel_view(ctx, scale, rank)), mean, r, axes)
    if ctx.needs(1):
        gs = op.ReduceSum(_xhat_times(ctx, gy, x, mean, r), channel_axes, keepdims=0)
    if ctx.needs(2):
        gb = op.ReduceSum(gy, channel_axes, keepdims=0)
    return [gx, gs, gb]


@rule("GroupNormalization", since=21)
def group_normalization(ctx):
    """per (n, group): dx = r*(g - mean(g) - xhat*mean(g*xhat)), g = dy*scale; dscale, db per channel"""
    op = ctx.op
    x, scale, gy = ctx.I(0), ctx.I(1), ctx.GO(0)
    rank = ctx.rank(x)
    x_type, scale_type = ctx.elem_type(x), ctx.elem_type(scale)
    work = _work_type(ctx, x, ctx.attr("stash_type", TensorProto.FLOAT))
    grouped = op.ints([0, ctx.attr("num_groups"), -1])
    gyw = ctx.cast(gy, x_type, work)  # Y has X's type
    xg, gyg = op.Reshape(ctx.cast(x, x_type, work), grouped), op.Reshape(gyw, grouped)
    mean, r = _statistics(ctx, xg, [2], ctx.attr("epsilon", 1e-5), work)
    channel_axes = op.ints([0, *range(2, rank)])
    gx = gs = gb = None
    if ctx.needs(0):
        g = op.Reshape(op.Mul(gyw, _channel_view(ctx, ctx.cast(scale, scale_type, work), rank)), grouped)
        gx = ctx.cast(ctx.reshape_like(_normalized_grad(ctx, xg, g, mean, r, [2]), x), work, x_type)
    if ctx.needs(1):
        scaled = ctx.reshape_like(_xhat_times(ctx, gyg, xg, mean, r), x)
        gs = ctx.cast(op.ReduceSum(scaled, channel_axes, keepdims=0), work, scale_type)
    if ctx.needs(2):
        gb = ctx.cast(op.ReduceSum(gy, channel_axes, keepdims=0), x_type, ctx.elem_type(ctx.I(2)))
    return [gx, gs, gb]


@rule("RMSNormalization", since=23)
def rms_normalization(ctx):
    """y = x * r * scale, r = 1/sqrt(mean(x^2) + eps): dx = g*r - x * r^3 * mean(g*x) with g = dy*scale,
    dscale = sum(dy * x * r)"""
    op = ctx.op
    x, scale, y = ctx.I(0), ctx.I(1), ctx.O(0)
    rank = ctx.rank(x)
    axes = op.ints(range(ctx.normalize_axis(ctx.attr("axis", -1), rank), rank))
    x_type = ctx.elem_type(x)
    work = _work_type(ctx, x, ctx.attr("stash_type", TensorProto.FLOAT))
    xw = ctx.cast(x, x_type, work)
    gy = ctx.cast(ctx.GO(0), ctx.elem_type(y), work)
    # r from a sum of squares: a per-row statistic, with no input-sized intermediate
    count = _row_count(ctx, x, work)
    r = op.Reciprocal(op.Sqrt(op.Add(op.Div(op.ReduceSumSquare(xw, axes, keepdims=1), count),
                                     op.const(ctx.attr("epsilon", 1e-5), work))))
    gx = gs = None
    if ctx.needs(0):
        g = op.Mul(gy, ctx.cast(scale, ctx.elem_type(scale), work))
        k = op.Mul(op.Mul(op.Mul(op.Div(op.ReduceSum(op.Mul(g, xw), axes, keepdims=1), count), r), r), r)
        gx = ctx.cast(op.Sub(op.Mul(g, r), op.Mul(xw, k)), work, x_type)
    if ctx.needs(1):
        gs = ctx.unbroadcast(ctx.cast(op.Mul(op.Mul(gy, xw), r), work, ctx.elem_type(scale)), scale)
    return [gx, gs]


def _row_count(ctx, x, elem_type):
    """Elements per normalized row, from the axis attribute (RMSNormalization has no statistic output to divide
    by): static where the shape is, else the product of Shape(x)[axis:]."""
    first = ctx.normalize_axis(ctx.attr("axis", -1), ctx.rank(x))
    dims = x.shape[first:]
    if all(isinstance(d, int) for d in dims):
        return ctx.op.const(float(np.prod(dims)), elem_type)
    return ctx.op.Cast(ctx.op.ReduceProd(ctx.op.Shape(x, start=first), keepdims=0), to=elem_type)


@rule("Dropout", since=13, wrt=(0,), limits="training mode uses the mask output (added when absent)")
def dropout(ctx):
    """dx = dy (inference); dx = dy * mask / (1 - ratio) (training, from the forward's mask output)"""
    op, x, gy = ctx.op, ctx.I(0), ctx.GO(0)
    rest = [None] * (ctx.num_inputs - 1)
    training = ctx.I(2)
    known = ctx.const_input(2)
    if training is None or (known is not None and not bool(np.asarray(known).reshape(-1)[0])):
        return [gy, *rest]
    mask = _output(ctx, 1)
    if mask is None:
        raise ctx.unsupported("training_mode may be true and the node has no mask output, so which elements "
                              "were dropped is unknown; give the Dropout a mask output or a constant "
                              "training_mode false")
    kept = op.Where(mask, gy, ctx.const_like(0.0, x))
    ratio = ctx.I(1)
    if ratio is None:
        keep = ctx.const_like(0.5, x)
    else:
        keep = op.Sub(ctx.const_like(1.0, x), ctx.cast(ratio, ctx.elem_type(ratio), ctx.elem_type(x)))
    if known is None:  # training_mode decided at run time: no scaling when it is false
        keep = op.Where(training, keep, ctx.const_like(1.0, x))
    return [op.Div(kept, keep), *rest]


def _reduce(ctx, op_type: str, v, axes):
    """A Reduce* over axes, kept; axes moved from attribute to input at opset 18."""
    if ctx.opset >= 18:
        return ctx.op.node(op_type, [v, ctx.op.ints(axes)], keepdims=1)
    return ctx.op.node(op_type, [v], axes=list(axes), keepdims=1)


@rule("LpNormalization", since=13)
def lp_normalization(ctx):
    """y = x / n, n = |x|_p: p=2: dx = (dy - y*sum(dy*y)) / n; p=1: dx = (dy - sign(x)*sum(dy*y)) / n"""
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    axes = [ctx.normalize_axis(ctx.attr("axis", -1), ctx.rank(x))]
    p = ctx.attr("p", 2)
    if p not in (1, 2):
        raise ctx.unsupported(f"p={p} (the op defines p=1 and p=2)")
    along = op.ReduceSum(op.Mul(gy, y), op.ints(axes), keepdims=1)
    if p == 2:
        norm = op.Sqrt(_reduce(ctx, "ReduceSumSquare", x, axes))
        radial = op.Mul(y, along)
    else:
        norm = _reduce(ctx, "ReduceL1", x, axes)
        radial = op.Where(op.Less(x, ctx.const_like(0.0, x)), op.Neg(along), along)  # sign(x) * along
    return [op.Div(op.Sub(gy, radial), norm)]


@rule("LRN", since=13, limits="odd size (as onnxruntime)")
def lrn(ctx):
    """y = x * d^-beta, d = bias + alpha/size * sum of x^2 over the channel window:
    dx = dy * d^-beta - 2*alpha*beta/size * x * (the transposed window sum of dy * y / d)"""
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    size, alpha = ctx.attr("size"), ctx.attr("alpha", 1e-4)
    beta, bias = ctx.attr("beta", 0.75), ctx.attr("bias", 1.0)
    if size % 2 == 0:
        raise ctx.unsupported(f"size={size}: onnxruntime runs LRN with odd sizes only")
    spatial = ctx.rank(x) - 2
    below = (size - 1) // 2        # channels c - below .. c + above form c's window
    above = size - 1 - below

    def window_sum(v, before, after, scale, offset=None):
        """scale * (sum of v over channels c - before .. c + after) + offset: a Conv along the channel axis."""
        kernel = ctx.const_like(np.full([1, 1, size] + [1] * spatial, scale), x)
        shift = None if offset is None else ctx.const_like([offset], x)
        summed = op.Conv(op.Unsqueeze(v, op.ints([1])), kernel, shift,
                         pads=[before] + [0] * spatial + [after] + [0] * spatial)
        return op.Squeeze(summed, op.ints([1]))

    # d and d^-beta are functions of x alone (forward-only, as large as x), like cos(x) for Sin.
    d = window_sum(op.Mul(x, x), below, above, alpha / size, bias)
    direct = op.Mul(gy, op.Pow(d, ctx.const_like(-beta, x)))
    spread = window_sum(op.Div(op.Mul(gy, y), d), above, below, 2 * alpha * beta / size)
    return [op.Sub(direct, op.Mul(x, spread))]
