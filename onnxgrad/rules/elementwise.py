"""Gradient rules: element-wise arithmetic, selection and casts (all with numpy-style broadcasting).

Every node a rule emits consumes the output gradient, directly or through another node of the rule, so no
execution order can hoist it into the forward pass. The exceptions are masks and signs (1 byte or one
element per element), noted where they occur.
"""
from __future__ import annotations

import numpy as np

from ..registry import rule


@rule("Identity", since=13)
def identity(ctx):
    """dx = dy"""
    return [ctx.GO(0)]


@rule("Add", since=13)
def add(ctx):
    """da = dy, db = dy (each summed over its broadcast axes)"""
    gy = ctx.GO(0)
    return [ctx.unbroadcast(gy, ctx.I(i)) if ctx.needs(i) else None for i in range(2)]


@rule("Sub", since=13)
def sub(ctx):
    """da = dy, db = -dy"""
    gy = ctx.GO(0)
    return [ctx.unbroadcast(gy, ctx.I(0)) if ctx.needs(0) else None,
            ctx.unbroadcast(ctx.op.Neg(gy), ctx.I(1)) if ctx.needs(1) else None]


@rule("Mul", since=13)
def mul(ctx):
    """da = dy * b, db = dy * a"""
    a, b, gy = ctx.I(0), ctx.I(1), ctx.GO(0)
    return [ctx.unbroadcast(ctx.op.Mul(gy, b), a) if ctx.needs(0) else None,
            ctx.unbroadcast(ctx.op.Mul(gy, a), b) if ctx.needs(1) else None]


@rule("Div", since=13)
def div(ctx):
    """y = a / b: da = dy / b, db = -(dy * y) / b"""
    a, b, y, gy = ctx.I(0), ctx.I(1), ctx.O(0), ctx.GO(0)
    op = ctx.op
    return [ctx.unbroadcast(op.Div(gy, b), a) if ctx.needs(0) else None,
            ctx.unbroadcast(op.Neg(op.Div(op.Mul(gy, y), b)), b) if ctx.needs(1) else None]


@rule("Neg", since=13)
def neg(ctx):
    """dx = -dy"""
    return [ctx.op.Neg(ctx.GO(0))]


@rule("Pow", since=13)
def pow_(ctx):
    """y = a ** b: da = dy * b * a ** (b - 1) (0 where b = 0), db = dy * y * log(a) (0 where a <= 0)"""
    a, b, y, gy = ctx.I(0), ctx.I(1), ctx.O(0), ctx.GO(0)
    op = ctx.op
    ga = gb = None
    if ctx.needs(0):
        # a constant exponent of 1 or 2 gets a shorter form; not one that is trained (a parameter is fed anew)
        exponent = None if ctx.needs(1) else ctx.const_input(1)
        value = float(exponent.reshape(-1)[0]) if exponent is not None and exponent.size == 1 else None
        if value == 2.0:
            ga = op.Mul(op.Mul(gy, a), ctx.const_like(2.0, a))
        elif value == 1.0:
            ga = gy
        else:
            b_as_a = b if b.elem_type == a.elem_type else op.Cast(b, to=ctx.elem_type(a))
            # a ** (b - 1) reads forward values only; it is the one node here that can run early.
            power = op.Pow(a, op.Sub(b_as_a, ctx.const_like(1.0, a)))
            ga = op.Mul(op.Mul(gy, b_as_a), power)
            # b = 0 makes y = 1 for every a, so da = 0; at a = 0 the product would be 0 * inf (as PyTorch)
            if exponent is None or not np.all(exponent != 0):
                ga = op.Where(op.Equal(b_as_a, ctx.const_like(0.0, a)), ctx.const_like(0.0, a), ga)
        ga = ctx.unbroadcast(ga, a)
    if ctx.needs(1):
        gb = op.Mul(op.Mul(gy, y), op.Log(a))
        # log(a) is -inf at a = 0 and NaN below, where y is finite (0 or 1 at a = 0 with b >= 0, a real power
        # for an integer b): db is 0 there, as TensorFlow has it (PyTorch masks a = 0 with b >= 0 only)
        base = ctx.const_input(0)
        if base is None or not np.all(base > 0):
            zero = ctx.const_like(0.0, a)
            gb = op.Where(op.Greater(a, zero), gb, zero)
        gb = ctx.unbroadcast(gb, b)
    return [ga, gb]


@rule("Sqrt", since=13)
def sqrt(ctx):
    """y = sqrt(x): dx = (dy * 0.5) / y"""
    return [ctx.op.Div(ctx.op.Mul(ctx.GO(0), ctx.const_like(0.5, ctx.O(0))), ctx.O(0))]


@rule("Reciprocal", since=13)
def reciprocal(ctx):
    """y = 1 / x: dx = -(dy * y) * y"""
    y = ctx.O(0)
    return [ctx.op.Neg(ctx.op.Mul(ctx.op.Mul(ctx.GO(0), y), y))]


@rule("Exp", since=13)
def exp(ctx):
    """y = exp(x): dx = dy * y"""
    return [ctx.op.Mul(ctx.GO(0), ctx.O(0))]


@rule("Log", since=13)
def log(ctx):
    """dx = dy / x"""
    return [ctx.op.Div(ctx.GO(0), ctx.I(0))]


@rule("Abs", since=13)
def abs_(ctx):
    """dx = where(x < 0, -dy, dy)"""
    gy, x = ctx.GO(0), ctx.I(0)
    return [ctx.op.Where(ctx.op.Less(x, ctx.const_like(0.0, x)), ctx.op.Neg(gy), gy)]


@rule("Sum", since=13)
def sum_(ctx):
    """d x_i = dy"""
    gy = ctx.GO(0)
    return [ctx.unbroadcast(gy, x) if ctx.needs(i) else None for i, x in enumerate(ctx.node.inputs)]


@rule("Mean", since=13)
def mean(ctx):
    """d x_i = dy / n"""
    n = len(ctx.node.inputs)
    scaled = ctx.op.Div(ctx.GO(0), ctx.const_like(float(n), ctx.O(0)))
    return [ctx.unbroadcast(scaled, x) if ctx.needs(i) else None for i, x in enumerate(ctx.node.inputs)]


def _select_extreme(ctx):
    """d x_i = dy * [x_i == y] / (number of inputs equal to y): ties share the gradient, as in PyTorch."""
    op, y, gy = ctx.op, ctx.O(0), ctx.GO(0)
    inputs = ctx.node.inputs
    if len(inputs) == 1:
        return [gy]
    masks = [op.Cast(op.Equal(x, y), to=ctx.elem_type(y)) for x in inputs]  # forward-only masks
    share = op.Div(gy, op.Sum(*masks))
    return [ctx.unbroadcast(op.Mul(share, m), x) if ctx.needs(i) else None
            for i, (x, m) in enumerate(zip(inputs, masks))]


@rule("Max", since=13)
def max_(ctx):
    """d x_i = dy where x_i is the maximum (ties split evenly)"""
    return _select_extreme(ctx)


@rule("Min", since=13)
def min_(ctx):
    """d x_i = dy where x_i is the minimum (ties split evenly)"""
    return _select_extreme(ctx)


@rule("Where", since=13, wrt=(1, 2))
def where(ctx):
    """dx = where(c, dy, 0), dz = where(c, 0, dy)"""
    c, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    zero = ctx.const_like(0.0, ctx.O(0))
    return [None,
            ctx.unbroadcast(op.Where(c, gy, zero), ctx.I(1)) if ctx.needs(1) else None,
            ctx.unbroadcast(op.Where(c, zero, gy), ctx.I(2)) if ctx.needs(2) else None]


@rule("Clip", since=13, wrt=(0,))
def clip(ctx):
    """dx = dy where min <= x <= max, else 0 (bounds get no gradient)"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    inside = None
    if ctx.I(1) is not None:
        inside = op.GreaterOrEqual(x, ctx.I(1))
    if ctx.I(2) is not None:
        below = op.LessOrEqual(x, ctx.I(2))
        inside = below if inside is None else op.And(inside, below)
    if inside is None:
        return [gy]
    return [op.Where(inside, gy, ctx.const_like(0.0, x))]


@rule("Cast", since=13)
def cast(ctx):
    """dx = cast(dy, dtype of x)"""
    return [ctx.op.Cast(ctx.GO(0), to=ctx.elem_type(ctx.I(0)))]


@rule("CastLike", since=15, wrt=(0,))
def cast_like(ctx):
    """dx = cast(dy, dtype of x); the target gets none"""
    return [ctx.op.Cast(ctx.GO(0), to=ctx.elem_type(ctx.I(0))), None]

