"""Gradient rules: element-wise activations.

Where the forward output determines the derivative (Sigmoid, Tanh, Elu, ...), the rule reads y rather than x,
so x need not be kept for the backward pass. Every node consumes the output gradient except masks (one byte per
element) and the few local derivatives that no rearrangement can tie to the gradient (Erf's exp(-x*x), Gelu's
and Mish's inner functions, Sin and Cos, the sigmoid of Swish and SwiGLU); those are noted where they occur.
"""
from __future__ import annotations

import math

from ..registry import rule


@rule("Relu", since=13)
def relu(ctx):
    """dx = dy where y > 0, else 0"""
    y = ctx.O(0)
    return [ctx.op.Where(ctx.op.Greater(y, ctx.const_like(0.0, y)), ctx.GO(0), ctx.const_like(0.0, y))]


@rule("LeakyRelu", since=13)
def leaky_relu(ctx):
    """dx = dy where x > 0, else dy * alpha"""
    alpha = ctx.attr("alpha", 0.01)
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    # With alpha > 0, y > 0 exactly where x > 0, so the mask can read y and x need not be kept.
    side = ctx.O(0) if alpha > 0 else x
    return [op.Where(op.Greater(side, ctx.const_like(0.0, x)), gy, op.Mul(gy, ctx.const_like(alpha, x)))]


@rule("ThresholdedRelu", since=13)
def thresholded_relu(ctx):
    """dx = dy where x > alpha, else 0"""
    x, op = ctx.I(0), ctx.op
    alpha = ctx.attr("alpha", 1.0)
    return [op.Where(op.Greater(x, ctx.const_like(alpha, x)), ctx.GO(0), ctx.const_like(0.0, x))]


@rule("PRelu", since=13)
def prelu(ctx):
    """dx = dy where x >= 0, else dy * slope; dslope = dy * x where x < 0 (summed over broadcast axes)"""
    x, slope, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    zero = ctx.const_like(0.0, x)
    negative = op.Less(x, zero)
    gx = op.Where(negative, op.Mul(gy, slope), gy) if ctx.needs(0) else None
    gs = ctx.unbroadcast(op.Where(negative, op.Mul(gy, x), zero), slope) if ctx.needs(1) else None
    return [gx, gs]


@rule("Elu", since=13)
def elu(ctx):
    """dx = dy where x > 0, else dy * y + dy * alpha (alpha * exp(x) = y + alpha there)"""
    alpha = ctx.attr("alpha", 1.0)
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    side = y if alpha >= 0 else x  # y > 0 exactly where x > 0 unless alpha < 0
    below = op.Add(op.Mul(gy, y), op.Mul(gy, ctx.const_like(alpha, x)))
    return [op.Where(op.Greater(side, ctx.const_like(0.0, x)), gy, below)]


@rule("Selu", since=13)
def selu(ctx):
    """dx = dy * gamma where x > 0, else dy * y + dy * (gamma * alpha)"""
    alpha = ctx.attr("alpha", 1.67326319217681884765625)
    gamma = ctx.attr("gamma", 1.05070102214813232421875)
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    side = y if gamma > 0 and alpha >= 0 else x  # the sign of y follows x for the usual constants
    below = op.Add(op.Mul(gy, y), op.Mul(gy, ctx.const_like(gamma * alpha, x)))
    return [op.Where(op.Greater(side, ctx.const_like(0.0, x)), op.Mul(gy, ctx.const_like(gamma, x)), below)]


@rule("Celu", since=13)
def celu(ctx):
    """dx = dy where x > 0, else dy + (dy * y) / alpha (exp(x / alpha) = y / alpha + 1 there)"""
    alpha = ctx.attr("alpha", 1.0)
    y, gy, op = ctx.O(0), ctx.GO(0), ctx.op
    # For either sign of alpha, y > 0 exactly where x > 0.
    below = op.Add(gy, op.Mul(op.Mul(gy, y), ctx.const_like(1.0 / alpha, y)))
    return [op.Where(op.Greater(y, ctx.const_like(0.0, y)), gy, below)]


@rule("Sigmoid", since=13)
def sigmoid(ctx):
    """dx = dy * y - (dy * y) * y"""
    t = ctx.op.Mul(ctx.GO(0), ctx.O(0))
    return [ctx.op.Sub(t, ctx.op.Mul(t, ctx.O(0)))]


@rule("HardSigmoid", since=13)
def hard_sigmoid(ctx):
    """dx = dy * alpha where 0 < y < 1, else 0"""
    alpha = ctx.attr("alpha", 0.2)
    y, op = ctx.O(0), ctx.op
    inside = op.And(op.Greater(y, ctx.const_like(0.0, y)), op.Less(y, ctx.const_like(1.0, y)))
    return [op.Where(inside, op.Mul(ctx.GO(0), ctx.const_like(alpha, y)), ctx.const_like(0.0, y))]


@rule("HardSwish", since=14)
def hard_swish(ctx):
    """dx = 0 where x < -3, dy where x > 3, else dy * x / 3 + dy / 2"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    ramp = op.Add(op.Mul(op.Mul(gy, x), ctx.const_like(1.0 / 3.0, x)), op.Mul(gy, ctx.const_like(0.5, x)))
    upper = op.Where(op.Greater(x, ctx.const_like(3.0, x)), gy, ramp)
    return [op.Where(op.Less(x, ctx.const_like(-3.0, x)), ctx.const_like(0.0, x), upper)]


@rule("Tanh", since=13)
def tanh(ctx):
    """dx = dy - (dy * y) * y"""
    gy, y = ctx.GO(0), ctx.O(0)
    return [ctx.op.Sub(gy, ctx.op.Mul(ctx.op.Mul(gy, y), y))]


@rule("Softsign", since=13)
def softsign(ctx):
    """dx = dy / (1 + |x|) / (1 + |x|)"""
    x, op = ctx.I(0), ctx.op
    # 1 + |x| reads x only; (1 - |y|)^2 would avoid it but loses precision for large |x|.
    denom = op.Add(op.Abs(x), ctx.const_like(1.0, x))
    return [op.Div(op.Div(ctx.GO(0), denom), denom)]


@rule("Softplus", since=13)
def softplus(ctx):
    """dx = dy * sigmoid(x)"""
    # sigmoid(x) reads x only; 1 - exp(-y) would read y but cancels badly for very negative x.
    return [ctx.op.Mul(ctx.GO(0), ctx.op.Sigmoid(ctx.I(0)))]


@rule("Erf", since=13)
def erf(ctx):
    """dx = dy * 2/sqrt(pi) * exp(-x*x)"""
    x, op = ctx.I(0), ctx.op
    scaled = op.Mul(ctx.GO(0), ctx.const_like(2.0 / math.sqrt(math.pi), x))
    # exp(-x*x) depends on x alone; no rearrangement ties it to the gradient.
    return [op.Mul(scaled, op.Exp(op.Neg(op.Mul(x, x))))]


@rule("Gelu", since=20, limits="approximate other than 'none' or 'tanh'")
def gelu(ctx):
    """none: dx = h + h*erf(x/sqrt2) + (dy*x)*pdf(x), h = dy/2; tanh: dx = h + h*t + (h*x - (h*x)*t*t) * du/dx"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    approximate = ctx.text_attr("approximate", "none")
    half = op.Mul(gy, ctx.const_like(0.5, x))
    if approximate == "none":
        # erf(x / sqrt 2) and exp(-x*x / 2) depend on x alone.
        cdf = op.Erf(op.Mul(x, ctx.const_like(1.0 / math.sqrt(2.0), x)))
        density = op.Exp(op.Mul(op.Mul(x, x), ctx.const_like(-0.5, x)))
        scaled = op.Mul(op.Mul(gy, x), ctx.const_like(1.0 / math.sqrt(2.0 * math.pi), x))
        return [op.Add(op.Add(half, op.Mul(half, cdf)), op.Mul(scaled, density))]
    if approximate == "tanh":
        k, a = math.sqrt(2.0 / math.pi), 0.044715
        # t = tanh(u), u = k * (x + a*x^3), and du/dx = k + 3*a*k*x^2 depend on x alone.
        square = op.Mul(x, x)
        u = op.Mul(op.Add(x, op.Mul(op.Mul(square, x), ctx.const_like(a, x))), ctx.const_like(k, x))
        t = op.Tanh(u)
        du = op.Add(op.Mul(square, ctx.const_like(3.0 * a * k, x)), ctx.const_like(k, x))
        hx = op.Mul(half, x)
        return [op.Add(op.Add(half, op.Mul(half, t)), op.Mul(op.Sub(hx, op.Mul(op.Mul(hx, t), t)), du))]
    raise ctx.unsupported(f"approximate={approximate!r} (expected 'none' or 'tanh')")


@rule("Mish", since=18)
def mish(ctx):
    """y = x * t, t = tanh(softplus(x)): dx = dy*t + u - (u*t)*t, u = (dy*x) * sigmoid(x)"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    # t and sigmoid(x) depend on x alone (t = y / x would divide by zero).
    t = op.Tanh(op.Softplus(x))
    u = op.Mul(op.Mul(gy, x), op.Sigmoid(x))
    return [op.Add(op.Mul(gy, t), op.Sub(u, op.Mul(op.Mul(u, t), t)))]


@rule("Sin", since=13)
def sin(ctx):
    """dx = dy * cos(x)"""
    return [ctx.op.Mul(ctx.GO(0), ctx.op.Cos(ctx.I(0)))]  # cos(x) depends on x alone


@rule("Cos", since=13)
def cos(ctx):
    """dx = -(dy * sin(x))"""
    return [ctx.op.Neg(ctx.op.Mul(ctx.GO(0), ctx.op.Sin(ctx.I(0))))]  # sin(x) depends on x alone


@rule("Swish", since=24)
def swish(ctx):
    """y = x * s, s = sigmoid(alpha*x): dx = dy*s + alpha*(dy*y)*(1 - s)"""
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    alpha = ctx.attr("alpha", 1.0)
    # s is a function of x alone (as Softplus's sigmoid): the one forward-only node
    s = op.Sigmoid(op.Mul(x, ctx.const_like(alpha, x)) if alpha != 1.0 else x)
    gys = op.Mul(gy, s)
    gyy = op.Mul(op.Mul(gy, y), ctx.const_like(alpha, x)) if alpha != 1.0 else op.Mul(gy, y)
    return [op.Add(gys, op.Sub(gyy, op.Mul(gyy, s)))]


@rule("SwiGLU", since=28)
def swiglu(ctx):
    """y = a * s * b, s = sigmoid(alpha*a): db = (dy*a)*s, da = t + alpha*(t*a)*(1 - s) with t = (dy*b)*s"""
    a, b, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    alpha = ctx.attr("alpha", 1.0)
    s = op.Sigmoid(op.Mul(a, ctx.const_like(alpha, a)) if alpha != 1.0 else a)  # a function of a alone
    ga = gb = None
    if ctx.needs(0):
        t = op.Mul(op.Mul(gy, b), s)
        ta = op.Mul(t, a)
        if alpha != 1.0:
            ta = op.Mul(ta, ctx.const_like(alpha, a))
        ga = op.Add(t, op.Sub(ta, op.Mul(ta, s)))
    if ctx.needs(1):
        gb = op.Mul(op.Mul(gy, a), s)
    return [ga, gb]
