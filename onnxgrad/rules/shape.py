"""Gradient rules: ops that move, copy or select tensor elements without arithmetic.

Each gradient puts the output gradient back where its elements came from: an inverse reshape or transpose,
a slice of a concatenation, a scatter into zeros, or a sum over the copies an op made (Expand, Tile, Pad's
edge and reflect modes, Gather's repeated indices through `GradContext.scatter_add_rows`). Sizes come from
static shapes where they are known and from Shape nodes where dims are symbolic, so one graph serves every
batch size.

Gradient-first: the nodes that move data consume the output gradient. Shape arithmetic, index vectors and
zero fills read forward values only; they are small (one entry per dim or per position along one axis),
except for Gather's one-hot matrix (tables of up to 512 rows, and every table at opsets 13-15).
"""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from ..registry import rule

INT64_MAX = 2**63 - 1
INT64_MIN = -2**63


# -- small helpers ---------------------------------------------------------------------------------------------
def _first_only(ctx, g):
    """[g, None, None, ...]: the data input's gradient, none for shapes, axes, indices."""
    return [g] + [None] * (ctx.num_inputs - 1)





def _shape_from(ctx, g, start: int):
    """Shape(g)[start:] as an int64 tensor."""
    if ctx.opset >= 15:
        return ctx.op.Shape(g, start=start)
    return ctx.op.Slice(ctx.op.Shape(g), ctx.op.ints([start]), ctx.op.ints([INT64_MAX]))




def _move_axis_to_front(rank: int, axis: int) -> tuple[list[int], list[int]]:
    """The permutation that brings axis to the front, and its inverse."""
    perm = [axis] + [i for i in range(rank) if i != axis]
    return perm, [int(i) for i in np.argsort(perm)]


def _scatter_along(ctx, g, positions, d, axis: int, rank: int, like):
    """Zeros with d entries along axis, and g's entries placed at `positions` (1-D, no repeats) there."""
    op = ctx.op
    perm, back = _move_axis_to_front(rank, axis)
    moved = op.Transpose(g, perm=perm) if axis else g
    zeros = ctx.zeros(op.Concat(d, _shape_from(ctx, moved, 1), axis=0), like)
    placed = op.ScatterND(zeros, op.Unsqueeze(positions, op.ints([1])), moved)
    return op.Transpose(placed, perm=back) if axis else placed


# -- reshapes --------------------------------------------------------------------------------------------------
@rule("Transpose", since=13)
def transpose(ctx):
    """dx = transpose(dy, inverse(perm))"""
    perm = ctx.attr("perm")
    if perm is None:  # the default perm reverses the axes, and is its own inverse
        return [ctx.op.Transpose(ctx.GO(0))]
    return [ctx.op.Transpose(ctx.GO(0), perm=[int(i) for i in np.argsort(perm)])]


@rule("Reshape", since=13, wrt=(0,))
def reshape(ctx):
    """dx = reshape(dy, shape(x))"""
    return _first_only(ctx, ctx.reshape_like(ctx.GO(0), ctx.I(0)))


@rule("Flatten", since=13)
def flatten(ctx):
    """dx = reshape(dy, shape(x))"""
    return [ctx.reshape_like(ctx.GO(0), ctx.I(0))]


@rule("Squeeze", since=13, wrt=(0,))
def squeeze(ctx):
    """dx = unsqueeze(dy, axes), or reshape(dy, shape(x)) when every 1 was squeezed"""
    if ctx.I(1) is None:
        return [ctx.reshape_like(ctx.GO(0), ctx.I(0))]
    return [ctx.op.Unsqueeze(ctx.GO(0), ctx.I(1)), None]


@rule("Unsqueeze", since=13, wrt=(0,))
def unsqueeze(ctx):
    """dx = squeeze(dy, axes)"""
    return [ctx.op.Squeeze(ctx.GO(0), ctx.I(1)), None]


# -- copies: the gradient sums the copies ---------------------------------------------------------------------
@rule("Expand", since=13, wrt=(0,))
def expand(ctx):
    """dx = dy summed over the axes Expand broadcast"""
    return [ctx.unbroadcast(ctx.GO(0), ctx.I(0)), None]


@rule("Tile", since=13, wrt=(0,))
def tile(ctx):
    """dx = sum over the tiles: reshape(dy, [r0, d0, r1, d1, ...]) summed over the r axes"""
    x, op = ctx.I(0), ctx.op
    rank = ctx.rank(x)
    repeats, dims = ctx.const_input(1), x.static_shape
    if repeats is not None and dims is not None:
        split = op.ints([int(n) for pair in zip(repeats, dims) for n in pair])
    else:  # interleave repeats and Shape(x) at run time: rows [repeats; dims], transposed, flattened
        rows = op.Concat(op.Unsqueeze(ctx.I(1), op.ints([0])), op.Unsqueeze(ctx.shape_of(x), op.ints([0])),
                         axis=0)
        split = op.Reshape(op.Transpose(rows, perm=[1, 0]), op.ints([-1]))
    tiles = op.Reshape(ctx.GO(0), split)
    return [op.ReduceSum(tiles, op.ints(range(0, 2 * rank, 2)), keepdims=0), None]


# -- concatenation and splitting ------------------------------------------------------------------------------
@rule("Concat", since=13)
def concat(ctx):
    """dx_i = dy[..., offset_i : offset_i + size_i, ...] along axis"""
    g, op = ctx.GO(0), ctx.op
    axis = ctx.normalize_axis(ctx.attr("axis"), ctx.rank(ctx.O(0)))
    last = max(i for i in range(ctx.num_inputs) if ctx.needs(i))
    grads = []
    start = 0  # an int while every size so far is static, else a 1-D int64 Value
    for i, x in enumerate(ctx.node.inputs):
        if i > last:
            grads.append(None)
            continue
        size = x.shape[axis] if x.shape is not None else None
        if isinstance(start, int) and isinstance(size, int):
            end = start + size
        else:
            size_v = ctx.dim_tensor(x, axis)
            end = op.Add(op.ints([start]) if isinstance(start, int) else start, size_v)
        if ctx.needs(i):
            as_value = [op.ints([b]) if isinstance(b, int) else b for b in (start, end)]
            grads.append(op.Slice(g, *as_value, op.ints([axis])))
        else:
            grads.append(None)
        start = end
    return grads


def _concat_output_grads(ctx):
    """dx = concat of the output gradients along axis (zeros for outputs no gradient reaches)."""
    axis = ctx.normalize_axis(ctx.attr("axis", 0), ctx.rank(ctx.I(0)))
    for k, y in enumerate(ctx.node.outputs):
        if ctx.GO(k) is None and not y.name:
            raise ctx.unsupported(f"output {k} is unnamed, so the size of its piece is not known")
    parts = [ctx.GO_or_zeros(k) for k in range(len(ctx.node.outputs))]
    return _first_only(ctx, ctx.op.Concat(*parts, axis=axis) if len(parts) > 1 else parts[0])


@rule("Split", since=13, until=17, wrt=(0,))
def split_13(ctx):
    """dx = concat(dy_0, dy_1, ..., axis); split sizes from the `split` input or equal parts"""
    return _concat_output_grads(ctx)


@rule("Split", since=18, wrt=(0,))
def split_18(ctx):
    """dx = concat(dy_0, dy_1, ..., axis); split sizes from the `split` input or `num_outputs`"""
    return _concat_output_grads(ctx)


# -- selection -------------------------------------------------------------------------------------------------
@rule("Slice", since=13, wrt=(0,), limits="axes must be a constant, or absent with starts of known length")
def slice_(ctx):
    """dx = zeros with dy at the sliced positions: Pad for steps of +-1 with static bounds, else a scatter"""
    x, g, op = ctx.I(0), ctx.GO(0), ctx.op
    rank = ctx.rank(x)
    count = _slice_axis_count(ctx)
    axes = ctx.const_input(3)
    axes = list(range(count)) if axes is None else [ctx.normalize_axis(int(a), rank) for a in axes.reshape(-1)]
    if ctx.I(4) is not None and ctx.const_input(4) is None:
        steps = None
    else:
        steps = ctx.const_input(4)
        steps = [1] * count if steps is None else [int(s) for s in steps.reshape(-1)]
    starts, ends = ctx.const_input(1), ctx.const_input(2)

    pads = [0] * (2 * rank)
    reversed_axes, scatters = [], []
    for j, axis in enumerate(axes):
        d = x.shape[axis]
        if isinstance(d, int) and starts is not None and ends is not None and steps is not None:
            # Python's slice clamping is ONNX's: out-of-range and negative bounds resolve identically.
            picked = range(d)[slice(int(starts.reshape(-1)[j]), int(ends.reshape(-1)[j]), steps[j])]
            if len(picked) <= 1 or abs(steps[j]) == 1:
                low = min(picked) if len(picked) else d
                high = max(picked) if len(picked) else d - 1
                pads[axis], pads[rank + axis] = low, d - 1 - high
                if len(picked) > 1 and steps[j] < 0:
                    reversed_axes.append(axis)
            else:
                positions = op.ints(list(picked))
                scatters.append((axis, positions, op.ints([d])))
        else:
            # The forward Slice applied to 0..d-1 lists the positions it picks, clamping included.
            size = ctx.dim_tensor(x, axis)
            positions = op.Slice(op.Range(ctx.int64(0), op.Squeeze(size), ctx.int64(1)),
                                 *(_slice_param(ctx, k, j) for k in (1, 2)), op.ints([0]),
                                 _slice_param(ctx, 4, j))
            scatters.append((axis, positions, size))

    if reversed_axes:
        n = len(reversed_axes)
        g = op.Slice(g, op.ints([-1] * n), op.ints([INT64_MIN] * n), op.ints(reversed_axes), op.ints([-1] * n))
    if any(pads):
        g = op.Pad(g, op.ints(pads))
    for axis, positions, d in scatters:
        g = _scatter_along(ctx, g, positions, d, axis, rank, x)
    return _first_only(ctx, g)


def _slice_axis_count(ctx) -> int:
    """How many axes a Slice node slices: the length of its axes, or of its starts when axes is absent."""
    if ctx.I(3) is not None:
        if ctx.const_input(3) is None:
            raise ctx.unsupported("the axes input is computed at run time; make it a constant")
        return int(ctx.const_input(3).size)
    starts = ctx.I(1)
    if starts.shape is None or len(starts.shape) != 1 or not isinstance(starts.shape[0], int):
        raise ctx.unsupported("without an axes input the number of starts must be known before run time")
    return starts.shape[0]


def _slice_param(ctx, i: int, j: int):
    """Entry j of Slice input i (starts, ends or steps) as a 1-D int64 tensor; steps default to 1."""
    value = ctx.const_input(i)
    if ctx.I(i) is None:
        return ctx.op.ints([1])
    if value is not None:
        return ctx.op.ints([int(value.reshape(-1)[j])])
    return ctx.op.Gather(ctx.as_int64(ctx.I(i)), ctx.op.ints([j]))


@rule("Gather", since=13, wrt=(0,),
      limits="repeated or run-time indices into up to 512 rows, or at opsets 13-15: a one-hot MatMul (rows x indices)")
def gather(ctx):
    """dx = zeros with dy added at the gathered positions along axis (repeated indices accumulate)"""
    x, indices, g, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    rank, q = ctx.rank(x), ctx.rank(indices)
    axis = ctx.normalize_axis(ctx.attr("axis", 0), rank)
    d = ctx.dim_tensor(x, axis)

    # Bring dy's index dims to the front: [indices..., x dims before axis..., x dims after axis...].
    perm = list(range(axis, axis + q)) + list(range(axis)) + list(range(axis + q, rank - 1 + q))
    moved = op.Transpose(g, perm=perm) if perm != sorted(perm) else g
    rest = _shape_from(ctx, moved, q)

    static_indices, size = ctx.const_input(1), x.shape[axis]
    if static_indices is not None and (isinstance(size, int) or np.all(static_indices >= 0)):
        wrapped = static_indices.astype(np.int64)
        if isinstance(size, int):
            wrapped = np.where(wrapped < 0, wrapped + size, wrapped)
        positions = op.const(wrapped[..., None], TensorProto.INT64)
        repeats = np.unique(wrapped).size != wrapped.size
    else:
        idx = ctx.as_int64(indices)
        wrapped = op.Where(op.Less(idx, ctx.int64(0)), op.Add(idx, op.Squeeze(d)), idx)
        positions = op.Unsqueeze(wrapped, op.ints([-1]))
        repeats = True

    if not repeats:
        placed = op.ScatterND(ctx.zeros(op.Concat(d, rest, axis=0), x), positions, moved)
    else:
        summed = ctx.scatter_add_rows(d, op.Reshape(positions, op.ints([-1])), op.Flatten(moved, axis=q), x)
        placed = op.Reshape(summed, op.Concat(d, rest, axis=0))
    _, back = _move_axis_to_front(rank, axis)
    return [op.Transpose(placed, perm=back) if axis else placed, None]


@rule("Trilu", since=14, wrt=(0,))
def trilu(ctx):
    """dx = trilu(dy, k, upper): the same triangle"""
    return _first_only(ctx, ctx.op.Trilu(ctx.GO(0), ctx.I(1), upper=ctx.attr("upper", 1)))


# -- padding ---------------------------------------------------------------------------------------------------
@rule("Pad", since=13, until=17, wrt=(0,), limits="edge and reflect modes need constant pads")
def pad_13(ctx):
    """constant: dx = pad(dy, -pads), which crops; edge/reflect: the copies are summed back"""
    return _pad_grad(ctx, axes=None)


@rule("Pad", since=18, wrt=(0,), limits="edge and reflect modes need constant pads and axes; no wrap mode")
def pad_18(ctx):
    """constant: dx = pad(dy, -pads, axes), which crops; edge/reflect: the copies are summed back"""
    axes = ctx.const_input(3)
    if ctx.I(3) is not None and axes is None and _pad_mode(ctx) != "constant":
        raise ctx.unsupported("the axes input is computed at run time; make it a constant")
    rank = ctx.rank(ctx.I(0))
    return _pad_grad(ctx, axes=None if axes is None else [ctx.normalize_axis(int(a), rank) for a in axes])


def _pad_mode(ctx) -> str:
    mode = ctx.attr("mode", "constant")
    return mode.decode() if isinstance(mode, bytes) else mode


def _pad_grad(ctx, axes):
    x, g, op = ctx.I(0), ctx.GO(0), ctx.op
    mode = _pad_mode(ctx)
    if mode == "constant":
        pads = ctx.const_input(1)
        crop = op.ints([-int(p) for p in pads]) if pads is not None else op.Neg(ctx.I(1))
        gx = op.Pad(g, crop, None, ctx.I(3)) if ctx.I(3) is not None else op.Pad(g, crop)
        return _first_only(ctx, gx)
    if mode not in ("edge", "reflect"):
        raise ctx.unsupported(f"mode {mode!r}")
    pads = ctx.const_input(1)
    if pads is None:
        raise ctx.unsupported(f"mode {mode!r} with pads computed at run time; make them a constant")
    rank = ctx.rank(x)
    axes = list(range(rank)) if axes is None else axes
    n = len(axes)
    # onnxruntime crops (negative pads) before it pads, so the gradient folds the copies back first and then
    # zero-pads the cropped borders.
    crop_back = [0] * (2 * rank)
    for j, axis in enumerate(axes):
        before, after = int(pads[j]), int(pads[n + j])
        fold = _fold_edge if mode == "edge" else _fold_reflect
        g = fold(ctx, g, axis, max(before, 0), max(after, 0))
        crop_back[axis], crop_back[rank + axis] = max(-before, 0), max(-after, 0)
    if any(crop_back):
        g = op.Pad(g, op.ints(crop_back))
    return _first_only(ctx, g)


def _cut(ctx, g, axis: int, start: int, end: int, step: int | None = None):
    op = ctx.op
    args = [op.ints([start]), op.ints([end]), op.ints([axis])]
    return op.Slice(g, *args, op.ints([step])) if step is not None else op.Slice(g, *args)


def _add_at_start(ctx, g, axis: int, offset: int, extra, length: int):
    """g with `extra` (length entries along axis) added at positions offset..offset+length-1."""
    op = ctx.op
    parts = [_cut(ctx, g, axis, 0, offset)] if offset else []
    parts += [op.Add(_cut(ctx, g, axis, offset, offset + length), extra), _cut(ctx, g, axis, offset + length,
                                                                                 INT64_MAX)]
    return op.Concat(*parts, axis=axis)


def _add_at_end(ctx, g, axis: int, offset: int, extra, length: int):
    """g with `extra` added at positions -(offset+length) .. -(offset+1), counted from the end."""
    op = ctx.op
    parts = [_cut(ctx, g, axis, 0, -(offset + length)),
             op.Add(_cut(ctx, g, axis, -(offset + length), -offset if offset else INT64_MAX), extra)]
    if offset:
        parts.append(_cut(ctx, g, axis, -offset, INT64_MAX))
    return op.Concat(*parts, axis=axis)


def _fold_edge(ctx, g, axis: int, before: int, after: int):
    """Edge padding copied x's first and last entries: add each border's sum to them."""
    if not before and not after:
        return g
    op = ctx.op
    core = _cut(ctx, g, axis, before, -after if after else INT64_MAX)
    if before:
        core = _add_at_start(ctx, core, axis, 0, op.ReduceSum(_cut(ctx, g, axis, 0, before), op.ints([axis]),
                                                             keepdims=1), 1)
    if after:
        core = _add_at_end(ctx, core, axis, 0, op.ReduceSum(_cut(ctx, g, axis, -after, INT64_MAX),
                                                            op.ints([axis]), keepdims=1), 1)
    return core


def _fold_reflect(ctx, g, axis: int, before: int, after: int):
    """Reflect padding copied x[before..1] and x[-2..-1-after]: add the reversed borders there."""
    if not before and not after:
        return g
    core = _cut(ctx, g, axis, before, -after if after else INT64_MAX)
    if before:  # out[i] = x[before - i] for i < before
        core = _add_at_start(ctx, core, axis, 1, _cut(ctx, g, axis, before - 1, INT64_MIN, -1), before)
    if after:  # out[-1 - i] = x[-2 - (after - 1 - i)]: the border, reversed, lands on x[-1-after .. -2]
        core = _add_at_end(ctx, core, axis, 1, _cut(ctx, g, axis, -1, -after - 1, -1), after)
    return core
