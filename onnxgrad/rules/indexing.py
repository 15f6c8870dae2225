"""Gradient rules: indexing ops (gathers, scatters, TopK, CumSum) and Einsum.

A gather's gradient scatters dy back to the positions it read, adding where an index repeats; a scatter's
gradient gathers dy at the positions it wrote. Where indices may repeat, the adding goes through
`GradContext.scatter_add_rows` (a one-hot MatMul for small tables, ScatterElements with reduction="add" for
large ones) or ScatterElements with reduction="add" (GatherElements, from opset 16), never through ScatterND with
a reduction, which onnxruntime's CPU provider races on. A repeat-free scatter is used where the indices are
constants without repeats; before opset 16 GatherElements sums through a boolean mask, noted there.

Forward-only nodes here: the zeros a gather's gradient is scattered into (ConstantOfShape, as large as the
input), index arithmetic (int64), one-hot masks (boolean for GatherElements at opsets 13-15, float for
GatherND's MatMul on small tables), and identities built at run time for Einsum diagonals of symbolic size.
Einsum's gradient is one Einsum of dy with the other operands (plus identity matrices for repeated subscripts).
"""
from __future__ import annotations

import string
from collections import Counter

import numpy as np
from onnx import TensorProto

from ..registry import rule


def _others_none(ctx, grads: dict) -> list:
    """One entry per forward input: the gradients given by index, None elsewhere."""
    return [grads.get(i) for i in range(ctx.num_inputs)]


def _repeats_along(indices: np.ndarray, axis: int, size) -> bool:
    """Whether two entries of constant GatherElements indices in one fiber along axis hit the same position."""
    wrapped = indices.astype(np.int64)
    if isinstance(size, int):
        wrapped = np.where(wrapped < 0, wrapped + size, wrapped)
    elif np.any(wrapped < 0):
        return True  # a negative index may meet a positive one once the size is known
    ordered = np.sort(wrapped, axis=axis)
    return bool(np.any(np.diff(ordered, axis=axis) == 0))


def _repeated_rows(indices: np.ndarray, dims) -> bool:
    """Whether constant ScatterND/GatherND index tuples (last axis) name the same position twice."""
    rows = indices.reshape(-1, indices.shape[-1]).astype(np.int64)
    if all(isinstance(d, int) for d in dims):
        rows = np.where(rows < 0, rows + np.asarray(dims, dtype=np.int64), rows)
    elif np.any(rows < 0):
        return True
    return np.unique(rows, axis=0).shape[0] != rows.shape[0]


# -- Einsum ----------------------------------------------------------------------------------------------------
class _Subscripts:
    """An Einsum equation with the ellipsis spelt out as letters: one label per axis of every operand.

    Ellipsis axes are right-aligned across operands (numpy broadcasting); the implicit output (no '->') is the
    ellipsis followed by the labels that occur once, sorted.
    """

    def __init__(self, ctx, equation: str, ranks: list[int]):
        eq = equation.replace(" ", "")
        lhs, arrow, rhs = eq.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(ranks):
            raise ctx.unsupported(f"equation {equation!r} names {len(terms)} operands, the node has {len(ranks)}")
        used = {c for c in eq if c.isalpha()}
        self._ctx = ctx
        self._fresh = iter([c for c in string.ascii_letters if c not in used])
        dots = [r - len(t.replace("...", "")) for t, r in zip(terms, ranks) if "..." in t]
        ellipsis = [self.fresh() for _ in range(max(dots, default=0))]
        self.operands = []
        for t, r in zip(terms, ranks):
            before, dot, after = t.partition("...")
            labels = list(before) + (ellipsis[len(ellipsis) - (r - len(before) - len(after)):] if dot else []) \
                + list(after)
            if len(labels) != r:
                raise ctx.unsupported(f"subscripts {t!r} do not match an operand of rank {r}")
            self.operands.append(labels)
        if arrow:
            before, dot, after = rhs.partition("...")
            self.output = list(before) + (ellipsis if dot else []) + list(after)
        else:
            counts = Counter(c for labels in self.operands for c in labels if c not in ellipsis)
            self.output = ellipsis + sorted(c for c, n in counts.items() if n == 1)

    def fresh(self) -> str:
        label = next(self._fresh, None)
        if label is None:
            raise self._ctx.unsupported("the gradient needs more than the 52 subscript letters Einsum has")
        return label


def _identity(ctx, like, v, axis: int):
    """A d x d identity with like's element type, d = v's size along axis."""
    d = v.shape[axis]
    if isinstance(d, int):
        return ctx.const_like(np.eye(d), like)
    square = ctx.op.Concat(ctx.dim_tensor(v, axis), ctx.dim_tensor(v, axis), axis=0)
    zeros = ctx.zeros(square, like)
    return ctx.op.EyeLike(zeros)


@rule("Einsum", since=13, limits="a size-1 axis broadcast against a symbolic size")
def einsum(ctx):
    """dx_i = einsum(dy, x_j for j != i -> subscripts of x_i), repeats via identities, summed labels expanded"""
    op, gy = ctx.op, ctx.GO(0)
    xs = list(ctx.node.inputs)
    subs = _Subscripts(ctx, ctx.text_attr("equation", ""), [ctx.rank(x) for x in xs])
    grads = []
    for i, x in enumerate(xs):
        if not ctx.needs(i):
            grads.append(None)
            continue
        labels = subs.operands[i]
        # A repeated label (a diagonal) gets a fresh name per extra occurrence, tied to the first by an identity.
        target, ties, seen = [], [], set()
        for axis, label in enumerate(labels):
            if label in seen:
                twin = subs.fresh()
                ties.append((label, twin, _identity(ctx, x, x, axis)))
                target.append(twin)
            else:
                seen.add(label)
                target.append(label)
        # The sizes each label has in dy and in the other operands, where the gradient Einsum reads it.
        elsewhere: dict = {c: [] for c in target}
        for lbls, v in [(subs.output, ctx.O(0))] + [(s, xs[j]) for j, s in enumerate(subs.operands) if j != i]:
            for c, d in zip(lbls, v.shape if v.shape is not None else [None] * len(lbls)):
                elsewhere.setdefault(c, []).append(d)
        twins = {c for label, twin, _ in ties for c in (label, twin)}

        def drop(a: int, label: str) -> bool:
            """Left out of the gradient Einsum: summed over by it, or absent there and expanded after it."""
            sizes, own = elsewhere[label], x.shape[a]
            if label in twins:
                return False
            if not sizes:  # only x_i has it: summed away, dy carries nothing along it
                return True
            if own == 1 and any(d != 1 for d in sizes):  # x_i broadcast along it
                return True
            return isinstance(own, int) and own != 1 and all(d == 1 for d in sizes)  # the others broadcast

        dropped = [a for a, label in enumerate(target) if drop(a, label)]
        kept = "".join(c for a, c in enumerate(target) if a not in dropped)
        inputs = ["".join(subs.output)] + ["".join(s) for j, s in enumerate(subs.operands) if j != i]
        inputs += [label + twin for label, twin, _ in ties]
        g = op.Einsum(gy, *(v for j, v in enumerate(xs) if j != i), *(eye for _, _, eye in ties),
                      equation=",".join(inputs) + "->" + kept)
        if dropped:
            g = op.Unsqueeze(g, op.ints(dropped))
            if any(x.shape[a] != 1 for a in dropped):
                g = op.Expand(g, ctx.shape_of(x))
        grads.append(g)
    return grads


# -- CumSum and TopK -------------------------------------------------------------------------------------------
@rule("CumSum", since=13, wrt=(0,))
def cum_sum(ctx):
    """dx = cumsum(dy, axis, same exclusive, opposite direction)"""
    reverse = ctx.attr("reverse", 0)
    return [ctx.op.CumSum(ctx.GO(0), ctx.I(1), exclusive=ctx.attr("exclusive", 0), reverse=1 - reverse), None]


@rule("TopK", since=13, wrt=(0,))
def top_k(ctx):
    """dx = zeros with dy (of Values) placed at Indices along axis; the k positions in a fiber are distinct"""
    x, op = ctx.I(0), ctx.op
    axis = ctx.normalize_axis(ctx.attr("axis", -1), ctx.rank(x))
    gx = op.ScatterElements(ctx.zeros(ctx.shape_of(x), x), ctx.O(1), ctx.GO(0), axis=axis)
    return [gx, None]


# -- gathers ---------------------------------------------------------------------------------------------------
@rule("GatherElements", since=13, wrt=(0,),
      limits="opsets 13-15 with repeated or run-time indices: a boolean mask of (axis size x indices)")
def gather_elements(ctx):
    """dx = zeros with dy added at indices along axis (ScatterElements, repeats accumulate)"""
    x, indices, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    rank = ctx.rank(x)
    axis = ctx.normalize_axis(ctx.attr("axis", 0), rank)
    known = ctx.const_input(1)
    if ctx.opset >= 16 or (known is not None and not _repeats_along(known, axis, x.shape[axis])):
        add = "add" if ctx.opset >= 16 else None
        return [op.ScatterElements(ctx.zeros(ctx.shape_of(x), x), indices, gy, axis=axis, reduction=add), None]
    # No adding scatter before opset 16: hits[..., p, j, ...] says that entry j of a fiber reads position p.
    # The mask is boolean and forward-only; the Where that selects dy is as large as dy times the axis size.
    d = ctx.dim_tensor(x, axis)
    idx = ctx.as_int64(indices)
    wrapped = op.Where(op.Less(idx, ctx.int64(0)), op.Add(idx, d), idx)
    along = op.Range(ctx.int64(0), op.Squeeze(d), ctx.int64(1))
    along = op.Reshape(along, op.ints([-1] + [1] * (rank - axis)))
    hits = op.Equal(op.Unsqueeze(wrapped, op.ints([axis])), along)
    picked = op.Where(hits, op.Unsqueeze(gy, op.ints([axis])), ctx.const_like(0.0, x))
    g = op.ReduceSum(picked, op.ints([axis + 1]), keepdims=0)
    # Indices may be shorter than x along the other axes: the positions no index reaches get zeros.
    xs, ids = x.static_shape, indices.static_shape
    if xs is not None and ids is not None:
        if any(a != axis and xd != idd for a, (xd, idd) in enumerate(zip(xs, ids))):
            g = op.Pad(g, op.ints([0] * rank + [0 if a == axis else xd - idd
                                                for a, (xd, idd) in enumerate(zip(xs, ids))]))
    else:
        g = op.Pad(g, op.Concat(op.ints([0] * rank), op.Sub(op.Shape(x), op.Shape(g)), axis=0))
    return [g, None]


def _index_tuples(ctx, data, indices, batch_dims: int):
    """GatherND/ScatterND indices made non-negative, with the batch coordinates prepended (batch_dims > 0).

    The result indexes `data` from its first axis, as ScatterND (which has no batch_dims) needs.
    """
    op = ctx.op
    q = ctx.rank(indices)
    k = indices.shape[-1]
    if not isinstance(k, int):
        raise ctx.unsupported(f"the last dim of the indices {indices.name!r} must be static")
    dims = data.shape[batch_dims:batch_dims + k]
    known = ctx.const_input(1)
    if known is not None and (np.all(known >= 0) or all(isinstance(d, int) for d in dims)):
        wrapped = known.astype(np.int64)
        if all(isinstance(d, int) for d in dims):
            wrapped = np.where(wrapped < 0, wrapped + np.asarray(dims, dtype=np.int64), wrapped)
        tuples = op.const(wrapped, TensorProto.INT64)
    else:
        if all(isinstance(d, int) for d in dims):
            sizes = op.ints(dims)
        else:
            sizes = op.Slice(op.Shape(data), op.ints([batch_dims]), op.ints([batch_dims + k]))
        tuples = op.Where(op.Less(indices, ctx.int64(0)), op.Add(indices, sizes), indices)
    if not batch_dims:
        return tuples, known
    # Coordinates of each batch position, broadcast over the index dims: [..., batch_dims] then the tuple.
    grid_shape = op.Concat(op.Slice(op.Shape(indices), op.ints([0]), op.ints([q - 1])), op.ints([1]), axis=0)
    coords = []
    for t in range(batch_dims):
        along = op.Range(ctx.int64(0), op.Squeeze(ctx.dim_tensor(data, t)), ctx.int64(1))
        along = op.Reshape(along, op.ints([-1 if a == t else 1 for a in range(q)]))
        coords.append(op.Expand(along, grid_shape))
    return op.Concat(*coords, tuples, axis=-1), None


@rule("GatherND", since=13, wrt=(0,),
      limits="tables of up to 512 addressed slices, and opsets 13-15: a one-hot matrix (slices x index tuples)")
def gather_nd(ctx):
    """dx = zeros with dy added at the gathered slices (repeats accumulate)"""
    x, indices, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    batch_dims = ctx.attr("batch_dims", 0)
    tuples, known = _index_tuples(ctx, x, indices, batch_dims)
    if known is not None and not batch_dims and not _repeated_rows(known, x.shape[:known.shape[-1]]):
        return [op.ScatterND(ctx.zeros(ctx.shape_of(x), x), tuples, gy), None]
    # Number the addressed slices of x row-major, and add dy's slices into that many rows.
    depth = batch_dims + indices.shape[-1]
    lead = x.shape[:depth]
    if all(isinstance(d, int) for d in lead):
        strides = op.ints([int(np.prod(lead[t + 1:])) for t in range(depth)])
        count = op.ints([int(np.prod(lead))])
    else:  # row-major strides of the addressed dims, multiplied up at run time
        steps = [op.ints([1])]
        for t in range(depth - 1, 0, -1):
            steps.insert(0, op.Mul(steps[0], ctx.dim_tensor(x, t)))
        strides = op.Concat(*steps, axis=0) if depth > 1 else steps[0]
        count = op.Mul(steps[0], ctx.dim_tensor(x, 0))
    flat = op.Reshape(op.ReduceSum(op.Mul(tuples, strides), op.ints([-1]), keepdims=0), op.ints([-1]))
    rows = op.Reshape(gy, op.Concat(op.Reshape(op.Size(flat), op.ints([1])), op.ints([-1]), axis=0))
    return [ctx.reshape_like(ctx.scatter_add_rows(count, flat, rows, x), x), None]


# -- scatters --------------------------------------------------------------------------------------------------
def _scatter_reduction(ctx) -> str:
    reduction = ctx.text_attr("reduction", "none")
    if reduction not in ("none", "add"):
        raise ctx.unsupported(f"reduction={reduction!r}: only 'none' and 'add' have gradient rules")
    return reduction


def _scatter_nd_grad(ctx):
    data, indices, updates, gy, op = ctx.I(0), ctx.I(1), ctx.I(2), ctx.GO(0), ctx.op
    reduction = _scatter_reduction(ctx)
    grads = {}
    if ctx.needs(0):
        if reduction == "add":
            grads[0] = gy
        else:  # overwritten positions take no gradient back to data
            grads[0] = op.ScatterND(gy, indices, ctx.zeros(ctx.shape_of(updates), updates))
    if ctx.needs(2):
        grads[2] = op.GatherND(gy, indices)
    return _others_none(ctx, grads)


@rule("ScatterND", since=13, until=15, wrt=(0, 2),
      limits="repeated indices (the op leaves the result undefined): each repeat's update gets dy")
def scatter_nd_13(ctx):
    """d_data = dy with zeros at the written positions, d_updates = gather_nd(dy, indices)"""
    return _scatter_nd_grad(ctx)


@rule("ScatterND", since=16, wrt=(0, 2),
      limits="reduction mul, max, min; repeated indices with reduction none: each repeat's update gets dy")
def scatter_nd_16(ctx):
    """none: d_data = dy zeroed at indices; add: d_data = dy; both: d_updates = gather_nd(dy, indices)"""
    return _scatter_nd_grad(ctx)


def _scatter_elements_grad(ctx):
    data, indices, updates, gy, op = ctx.I(0), ctx.I(1), ctx.I(2), ctx.GO(0), ctx.op
    axis = ctx.normalize_axis(ctx.attr("axis", 0), ctx.rank(data))
    reduction = _scatter_reduction(ctx)
    grads = {}
    if ctx.needs(0):
        if reduction == "add":
            grads[0] = gy
        else:
            grads[0] = op.ScatterElements(gy, indices, ctx.zeros(ctx.shape_of(updates), updates), axis=axis)
    if ctx.needs(2):
        grads[2] = op.GatherElements(gy, indices, axis=axis)
    return _others_none(ctx, grads)


@rule("ScatterElements", since=13, until=15, wrt=(0, 2),
      limits="repeated indices (the op leaves the result undefined): each repeat's update gets dy")
def scatter_elements_13(ctx):
    """d_data = dy with zeros at the written positions, d_updates = gather_elements(dy, indices, axis)"""
    return _scatter_elements_grad(ctx)


@rule("ScatterElements", since=16, wrt=(0, 2),
      limits="reduction mul, max, min; repeated indices with reduction none: each repeat's update gets dy")
def scatter_elements_16(ctx):
    """none: d_data = dy zeroed at indices; add: d_data = dy; both: d_updates = gather_elements(dy, indices)"""
    return _scatter_elements_grad(ctx)


@rule("TensorScatter", since=24, wrt=(0, 1))
def tensor_scatter(ctx):
    """y = past with update written at write_indices[b] + s along axis: dpast = dy with those places 0
    (a TensorScatter of zeros), dupdate = dy at those places (GatherElements)"""
    op = ctx.op
    past, update, where = ctx.I(0), ctx.I(1), ctx.I(2)
    gy = ctx.GO(0)
    rank = ctx.rank(past)
    axis = ctx.normalize_axis(ctx.attr("axis", -2), rank)
    mode = ctx.attr("mode", "linear")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    gp = gu = None
    if ctx.needs(0):
        gp = op.TensorScatter(gy, ctx.zeros_like(update), where, axis=axis, mode=mode)
    if ctx.needs(1):
        # the place of update[b, ..., s, ...] in the cache: write_indices[b] + s (modulo the cache length)
        along = [1] * rank
        along[axis] = -1
        steps = op.Reshape(op.Range(ctx.int64(0), ctx.dim_scalar(ctx.dim(update, axis)), ctx.int64(1)),
                           op.ints(along))
        places = steps
        if where is not None:
            places = op.Add(op.Reshape(where, op.ints([-1] + [1] * (rank - 1))), steps)
        if mode == "circular":
            places = op.Mod(places, op.Reshape(ctx.dim_scalar(ctx.dim(past, axis)), op.ints([1])))
        gu = op.GatherElements(gy, op.Expand(places, ctx.shape_of(update)), axis=axis)
    return [gp, gu, None][:ctx.num_inputs]
