"""Gradient rules: reductions.

ReduceSum takes its axes as an input since opset 13; the other Reduce* ops take an `axes` attribute at opsets
13-17 and an input since 18. Each op is registered once per form; the rule body reads the axes from wherever
the node has them (`_Reduction`). A rule works in the output's shape, restores the reduced axes as size 1
where keepdims=0, and lets broadcasting (or Expand) carry the result back to the input's shape.

With noop_with_empty_axes=1 and no axes, both onnxruntime and the ONNX reference evaluator reduce over no axes
at all, keeping the element-wise part (ReduceL2 gives |x|, ReduceSumSquare x*x, ReduceLogSum log x); the rules
treat it the same way, as a reduction over an empty set of axes.
"""
from __future__ import annotations

import numpy as np

from ..registry import rule

_RUNTIME_AXES = "axes computed at run time need keepdims=1"


class _Reduction:
    """Which axes of x a Reduce node reduces, and the shape moves its gradient rule needs.

    `axes` holds the reduced axes, sorted and non-negative, when they are known while building; when the axes
    input is computed at run time `axes` is None and the input itself is reused (keepdims=1 then, so the
    output already has the input's rank and restoring needs no axes).
    """

    def __init__(self, ctx):
        self.ctx = ctx
        self.x = x = ctx.I(0)
        self.keepdims = ctx.attr("keepdims", 1)
        self.noop = ctx.attr("noop_with_empty_axes", 0)
        self.axes_value = None
        if ctx.node.has_attr("axes"):
            axes = list(ctx.attr("axes"))
        elif ctx.I(1) is None:
            axes = []
        else:
            known = ctx.const_input(1)
            if known is None:
                if not self.keepdims:
                    raise ctx.unsupported(f"{_RUNTIME_AXES} (keepdims=0 drops axes that are only known at "
                                          f"run time, so the gradient cannot restore them)")
                self.axes, self.axes_value = None, ctx.I(1)
                return
            axes = [int(a) for a in np.asarray(known).reshape(-1)]
        rank = ctx.rank(x)
        if not axes and not self.noop:
            axes = list(range(rank))
        self.axes = sorted({ctx.normalize_axis(a, rank) for a in axes})

    def restore(self, v):
        """A value shaped like the output, reshaped with the reduced axes kept as size 1."""
        if self.keepdims or not self.axes:
            return v
        return self.ctx.op.Unsqueeze(v, self.ctx.op.ints(self.axes))

    def expand(self, v):
        """A value shaped like the output, broadcast to the input's shape."""
        return self.ctx.op.Expand(self.restore(v), self.ctx.shape_of(self.x))

    def _reduce(self, op_type: str, v, axes_input_since: int):
        """v (shaped like x) reduced over the reduced axes with keepdims=1, in the form valid at the opset."""
        op = self.ctx.op
        if self.axes_value is not None:
            return op.node(op_type, [v, self.axes_value], keepdims=1, noop_with_empty_axes=self.noop or None)
        if not self.axes:
            return v
        if self.ctx.opset >= axes_input_since:
            return op.node(op_type, [v, op.ints(self.axes)], keepdims=1)
        return op.node(op_type, [v], axes=self.axes, keepdims=1)

    def sum(self, v):
        return self._reduce("ReduceSum", v, axes_input_since=13)

    def prod(self, v):
        return self._reduce("ReduceProd", v, axes_input_since=18)

    def count(self):
        """How many elements of x go into each output element, as a scalar of x's type."""
        ctx, x = self.ctx, self.x
        if self.axes is not None and x.shape is not None and all(isinstance(x.shape[a], int) for a in self.axes):
            return ctx.const_like(float(np.prod([x.shape[a] for a in self.axes])), x)
        n = ctx.op.Div(ctx.op.Size(x), ctx.op.Size(ctx.O(0)))
        return ctx.op.Cast(n, to=ctx.elem_type(x))


def _attribute_form(op_type: str):
    """Registers a rule for opsets 13-17, where the op's axes are an attribute."""
    return rule(op_type, since=13, until=17, wrt=(0,))


def _input_form(op_type: str):
    """Registers a rule for opsets 18 on, where the op's axes are an optional input."""
    return rule(op_type, since=18, wrt=(0,), limits=_RUNTIME_AXES)


@rule("ReduceSum", since=13, wrt=(0,), limits=_RUNTIME_AXES)
def reduce_sum(ctx):
    """dx = expand(dy)"""
    return [_Reduction(ctx).expand(ctx.GO(0))]


@_attribute_form("ReduceMean")
@_input_form("ReduceMean")
def reduce_mean(ctx):
    """dx = expand(dy / n), n = number of elements reduced into each output"""
    r = _Reduction(ctx)
    return [r.expand(ctx.op.Div(ctx.GO(0), r.count()))]


@_attribute_form("ReduceSumSquare")
@_input_form("ReduceSumSquare")
def reduce_sum_square(ctx):
    """y = sum(x * x): dx = (dy * 2) * x"""
    r, x = _Reduction(ctx), ctx.I(0)
    return [ctx.op.Mul(r.restore(ctx.op.Mul(ctx.GO(0), ctx.const_like(2.0, x))), x)]


@_attribute_form("ReduceL1")
@_input_form("ReduceL1")
def reduce_l1(ctx):
    """y = sum(|x|): dx = dy * sign(x)"""
    r, x = _Reduction(ctx), ctx.I(0)
    return [ctx.op.Mul(r.restore(ctx.GO(0)), ctx.op.Sign(x))]  # sign: forward-only, as in Abs


@_attribute_form("ReduceL2")
@_input_form("ReduceL2")
def reduce_l2(ctx):
    """y = sqrt(sum(x * x)): dx = (dy / y) * x, and 0 where y = 0 (as PyTorch's norm)"""
    r, x, y, op = _Reduction(ctx), ctx.I(0), ctx.O(0), ctx.op
    zero = ctx.const_like(0.0, x)
    # the mask is output-sized: it reads y only
    scaled = op.Where(op.Equal(y, zero), zero, op.Div(ctx.GO(0), y))
    return [op.Mul(r.restore(scaled), x)]


@_attribute_form("ReduceLogSum")
@_input_form("ReduceLogSum")
def reduce_log_sum(ctx):
    """y = log(sum(x)): dx = expand(dy / exp(y))"""
    r, y, op = _Reduction(ctx), ctx.O(0), ctx.op
    return [r.expand(op.Div(ctx.GO(0), op.Exp(y)))]  # exp(y) is output-sized, the sum of x


@_attribute_form("ReduceLogSumExp")
@_input_form("ReduceLogSumExp")
def reduce_log_sum_exp(ctx):
    """y = log(sum(exp(x))): dx = dy * exp(x - y)"""
    r, x, y, op = _Reduction(ctx), ctx.I(0), ctx.O(0), ctx.op
    # exp(x - y), the softmax of x, reads forward values only: it is the one input-sized node here that can
    # run early (no gradient-first form exists: the gradient enters as a factor).
    softmax = op.Exp(op.Sub(x, r.restore(y)))
    return [op.Mul(r.restore(ctx.GO(0)), softmax)]


def _select_extreme(ctx):
    """dx = dy / count where x equals the output, else 0: ties split the gradient evenly, as in PyTorch."""
    r, x, y, op = _Reduction(ctx), ctx.I(0), ctx.O(0), ctx.op
    hit = op.Equal(x, r.restore(y))              # a mask: forward-only, one byte per element
    count = r.sum(op.Cast(hit, to=ctx.elem_type(x)))           # forward-only, output-sized
    share = op.Div(r.restore(ctx.GO(0)), count)
    return [op.Where(hit, share, ctx.const_like(0.0, x))]


@_attribute_form("ReduceMax")
@_input_form("ReduceMax")
def reduce_max(ctx):
    """dx = dy where x is the maximum (ties split evenly)"""
    return _select_extreme(ctx)


@_attribute_form("ReduceMin")
@_input_form("ReduceMin")
def reduce_min(ctx):
    """dx = dy where x is the minimum (ties split evenly)"""
    return _select_extreme(ctx)


@_attribute_form("ReduceProd")
@_input_form("ReduceProd")
def reduce_prod(ctx):
    """dx_i = dy * prod_{j != i} x_j: dy * y / x_i without zeros; with one zero only the zero gets it"""
    r, x, op = _Reduction(ctx), ctx.I(0), ctx.op
    zero, one = ctx.const_like(0.0, x), ctx.const_like(1.0, x)
    # Forward-only but small: a mask, the number of zeros per output, the product of the non-zero elements.
    is_zero = op.Equal(x, zero)
    zeros = r.sum(op.Cast(is_zero, to=ctx.elem_type(x)))
    others = r.prod(op.Where(is_zero, one, x))
    scaled = op.Mul(r.restore(ctx.GO(0)), others)
    # No zero in the slice: dy * y / x_i (others = y). One zero: the zero's gradient is dy * others, the
    # rest get 0. Two or more: every product of the others contains a zero.
    if_none = op.Mul(scaled, op.Cast(op.Equal(zeros, zero), to=ctx.elem_type(x)))
    if_one = op.Mul(scaled, op.Cast(op.Equal(zeros, one), to=ctx.elem_type(x)))
    # At the zeros, if_none is 0 and the division 0/0: Where takes if_one there.
    return [op.Where(is_zero, if_one, op.Div(if_none, x))]
