"""Gradient rules: matrix products.

When MatMul's b is one matrix (the common x @ W), its rule flattens the batch axes of a and dy into rows and
uses Gemm, whose transA/transB read the transposes for free: every node then consumes the gradient, and W's
gradient is summed over the batch inside the product rather than by a ReduceSum over a batch of products.
"""
from __future__ import annotations

from ..builder import unbroadcast
from ..ir import Value
from ..registry import rule


def _swap_last_two(ctx, v, rank: int):
    return ctx.op.Transpose(v, perm=[*range(rank - 2), rank - 1, rank - 2])


def _sum_to(ctx, g, like: Value, shape: tuple) -> Value:
    """Sum g, whose shape is `shape` (batch axes first), down to like's shape over broadcast batch axes."""
    return unbroadcast(ctx, g, like, Value(f"{g.name}:shape", shape=shape))


def _transposed_from(v: Value) -> Value | None:
    """w when v is Transpose(w) of a matrix w."""
    node = v.producer
    if node is None or node.op_type != "Transpose" or node.domain or node.inputs[0] is None:
        return None
    perm = node.attr("perm")
    return node.inputs[0] if node.inputs[0].rank == 2 and (perm is None or list(perm) == [1, 0]) else None


@rule("MatMul", since=13, limits="operands of unknown rank")
def matmul(ctx):
    """y = a @ b: da = dy @ bᵀ, db = aᵀ @ dy (1-D operands as a row / a column; broadcast batch axes summed)"""
    a, b, y, gy, op = ctx.I(0), ctx.I(1), ctx.O(0), ctx.GO(0), ctx.op
    ra, rb = ctx.rank(a), ctx.rank(b)
    if ra == 1 and rb == 1:
        return [op.Mul(gy, b) if ctx.needs(0) else None, op.Mul(gy, a) if ctx.needs(1) else None]

    # A 1-D a is a row (1, k) and a 1-D b a column (k, 1): put the axes they dropped from y back into dy.
    g2 = gy if ra > 1 else op.Unsqueeze(gy, op.ints([-2]))
    g2 = g2 if rb > 1 else op.Unsqueeze(g2, op.ints([-1]))
    ra2, rb2 = max(ra, 2), max(rb, 2)
    ga = gb = None

    if rb2 == 2:
        # b is one matrix: flatten the batch axes of a and dy into rows, and let Gemm transpose.
        b2 = b if rb > 1 else op.Unsqueeze(b, op.ints([1]))
        g_rows = g2 if ra2 == 2 else op.Flatten(g2, axis=ra2 - 1)
        if ctx.needs(0):
            w = _transposed_from(b) if rb == 2 else None
            # dy @ (wᵀ)ᵀ = dy @ w: onnxruntime would fold the Transpose into this Gemm as a node of its own, which
            # it numbers after every node of the file, so it ran after the rest of the backward with dy alive
            # (dynamo's GPT-2, whose tied output layer reads the table through a Transpose: dy is 196 MiB)
            ga = op.Gemm(g_rows, w) if w is not None else op.Gemm(g_rows, b2, transB=1)
            ga = ga if ra == 2 else ctx.reshape_like(ga, a)
        if ctx.needs(1):
            a2 = a if ra > 1 else op.Unsqueeze(a, op.ints([0]))
            a_rows = a2 if ra2 == 2 else op.Flatten(a2, axis=ra2 - 1)  # a view of a
            gb = op.Gemm(a_rows, g_rows, transA=1)
            gb = gb if rb == 2 else ctx.reshape_like(gb, b)
        return [ga, gb]

    # Batched b. The transposes read forward values only; onnxruntime folds a Transpose feeding a MatMul into
    # one FusedMatMul at ORT_ENABLE_EXTENDED and above, and that node consumes the gradient.
    n_batch = max(ra2, rb2) - 2
    batch = tuple(y.shape[:n_batch]) if y.shape is not None else (None,) * n_batch
    if ctx.needs(0):
        ga = op.MatMul(g2, _swap_last_two(ctx, b, rb))
        # a's matrix part is (n, k), or (1, k) for a 1-D a: the sum then drops the 1 with the batch axes
        rows = tuple(a.shape[-2:]) if ra > 1 else (1, a.shape[0])
        ga = _sum_to(ctx, ga, a, batch + rows)
    if ctx.needs(1):
        a_t = op.Unsqueeze(a, op.ints([1])) if ra == 1 else _swap_last_two(ctx, a, ra)
        gb = _sum_to(ctx, op.MatMul(a_t, g2), b, batch + tuple(b.shape[-2:]))
    return [ga, gb]


@rule("Gemm", since=13)
def gemm(ctx):
    """y = alpha * a' @ b' + beta * c: da' = alpha * dy @ b'ᵀ, db' = alpha * a'ᵀ @ dy, dc = beta * sum(dy)"""
    a, b, c, gy, op = ctx.I(0), ctx.I(1), ctx.I(2), ctx.GO(0), ctx.op
    trans_a, trans_b = ctx.attr("transA", 0), ctx.attr("transB", 0)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    scale = alpha if alpha != 1.0 else None
    ga = gb = gc = None
    if ctx.needs(0):
        # da' = dy @ b'ᵀ; with transA the stored a is its transpose, b' @ dyᵀ
        if trans_a:
            ga = op.Gemm(b, gy, alpha=scale, transA=trans_b or None, transB=1)
        else:
            ga = op.Gemm(gy, b, alpha=scale, transB=None if trans_b else 1)
    if ctx.needs(1):
        if trans_b:
            gb = op.Gemm(gy, a, alpha=scale, transA=1, transB=trans_a or None)
        else:
            gb = op.Gemm(a, gy, alpha=scale, transA=None if trans_a else 1)
    if c is not None and ctx.needs(2):
        gc = ctx.unbroadcast(gy, c)
        if beta != 1.0:
            gc = op.Mul(gc, ctx.const_like(beta, c))
    return [ga, gb, gc][:ctx.num_inputs]
