"""Gradient rules: convolution and pooling.

Conv's input gradient is a ConvTranspose of dy with the same weights. Its weight gradient is, from 16 input
channels per group, one GEMM per kernel offset (x split once into its stride phases, dy shifted per offset);
with one channel per group and stride 1 (depthwise), a product summed per offset; otherwise a Conv in which x and
dy trade roles (batch and channel axes exchanged, stride and dilation exchanged). Pool gradients send dy back to
the window elements: MaxPool through its argmax indices, AveragePool through a ones-kernel ConvTranspose. Both
need the spatial sizes at build time, to choose the pads and output_padding that make the transposed placement
land exactly on x, and to count the elements of each averaging window. Every ConvTranspose written here has
equal begin and end pads: onnxruntime's CUDA provider (cuDNN) refuses others and leaves them to the CPU.
CausalConvWithState (opset 27) is a depthwise Conv over the carried state and x joined along the length; its
input gradient is a ConvTranspose of dz, its weight gradient a grouped Conv with the batch folded into channels.

Forward-only nodes here: the transposed copy of x for Conv's weight gradient (the contraction runs over the
batch; split into stride phases, which partition it, for the GEMM form), MaxPool's recomputed indices (int64,
one per output element) and the zeros they are scattered into, and the masks and counts of GlobalMaxPool.
"""
from __future__ import annotations

import math

import numpy as np

from ..registry import rule


def _spatial(ctx, v, what: str) -> list[int]:
    """The static spatial sizes of an (N, C, D1, ..., Dn) value."""
    shape = v.shape
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape[2:]):
        dims = "unknown" if shape is None else "x".join(str(d) for d in shape)
        raise ctx.unsupported(f"the spatial dims of {what} {v.name!r} must be static (shape {dims}): bind them "
                              f"with --input-shape or --dim")
    return list(shape[2:])


def _window(ctx, sizes: list[int], kernel: list[int]):
    """strides, dilations and (begin, end) pads per spatial axis, auto_pad resolved as onnxruntime does."""
    n = len(sizes)
    strides = list(ctx.attr("strides", [1] * n))
    dilations = list(ctx.attr("dilations", [1] * n))
    auto_pad = ctx.text_attr("auto_pad", "NOTSET")
    if auto_pad == "NOTSET":
        pads = list(ctx.attr("pads", [0] * (2 * n)))
        return strides, dilations, pads[:n], pads[n:]
    if auto_pad == "VALID":
        return strides, dilations, [0] * n, [0] * n
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ctx.unsupported(f"auto_pad={auto_pad}")
    begin, end = [], []
    for size, k, s, d in zip(sizes, kernel, strides, dilations):
        total = max(0, (math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size)
        small, large = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else large)
        end.append(large if auto_pad == "SAME_UPPER" else small)
    return strides, dilations, begin, end


def _transposed_placement(sizes, out, kernel, strides, dilations, begin):
    """Symmetric ConvTranspose pads, output_padding and a crop that map an `out` grid back onto `sizes` positions.

    The uncropped transposed result covers s*(out-1) + (k-1)*d + 1 positions starting at -begin; whatever runs
    past the end of x must be cropped, a shortfall (x positions no window reaches) is zeros at the end. The CUDA
    provider refuses a ConvTranspose with unequal begin and end pads (cuDNN), so the pads are equal: p = begin
    with output_padding q = begin - overhang where 0 <= q < stride (the common case, e.g. a stride-2 pad-1 Conv
    on an even size), else p = min(begin, overhang) and a Slice crops the rest. Returns (pads, output_padding or
    None, crop starts or None); the crop, when there is one, takes `sizes` positions from those starts.
    """
    pads, extra, starts = [], [], []
    for size, o, k, s, d, b in zip(sizes, out, kernel, strides, dilations, begin):
        overhang = s * (o - 1) + (k - 1) * d + 1 - b - size
        if 0 <= b - overhang < s:
            p, q = b, b - overhang
        else:
            p, q = min(b, max(overhang, 0)), max(-overhang, 0)
        pads.append(p)
        extra.append(q)
        starts.append(b - p)
    length = [s * (o - 1) + (k - 1) * d + 1 + q - 2 * p
              for o, k, s, d, p, q in zip(out, kernel, strides, dilations, pads, extra)]
    crop = any(st or n != size for st, n, size in zip(starts, length, sizes))
    return pads + pads, (extra if any(extra) else None), (starts if crop else None)


def _conv_transpose_onto(ctx, g, w, sizes, out, kernel, strides, dilations, begin, group=1):
    """ConvTranspose of g with w whose result lands exactly on the `sizes` grid (see _transposed_placement)."""
    op = ctx.op
    pads, extra, starts = _transposed_placement(sizes, out, kernel, strides, dilations, begin)
    gx = op.ConvTranspose(g, w, strides=strides, dilations=dilations, pads=pads, output_padding=extra,
                          group=group, kernel_shape=kernel)
    if starts is not None:
        n = len(sizes)
        gx = op.Slice(gx, op.ints(starts), op.ints([st + size for st, size in zip(starts, sizes)]),
                      op.ints(range(2, n + 2)))
    return gx


@rule("Conv", since=13, limits="spatial dims of X and W must be static")
def conv(ctx):
    """dx = ConvTranspose(dy, w), dw = Conv(x^T, dy^T) (stride and dilation swapped), db = sum(dy) but axis 1"""
    x, w, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    sizes, kernel, out = _spatial(ctx, x, "X"), _spatial(ctx, w, "W"), _spatial(ctx, ctx.O(0), "Y")
    group = ctx.attr("group", 1)
    strides, dilations, begin, end = _window(ctx, sizes, kernel)
    for size, o, k, s, d, b, e in zip(sizes, out, kernel, strides, dilations, begin, end):
        if (size + b + e - (k - 1) * d - 1) // s + 1 != o:
            raise ctx.unsupported(f"output size {o} does not follow from input {size}, kernel {k}, stride {s}, "
                                  f"dilation {d}, pads ({b}, {e})")
    gx = gw = gb = None
    if ctx.needs(1):
        gw = _conv_weight_grad(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations, begin, end,
                               shift="gy")
    if ctx.needs(0):
        gx = _conv_transpose_onto(ctx, gy, w, sizes, out, kernel, strides, dilations, begin, group)
    if ctx.needs(2):
        gb = op.ReduceSum(gy, op.ints([0, *range(2, len(sizes) + 2)]), keepdims=0)
    return [gx, gw, gb][:ctx.num_inputs]


# From this many input channels per group on, the weight gradient is one GEMM per kernel offset (measured in
# bench/bench_train.py's profiles and BENCHMARKS.md: 1.5-4x faster than the swapped Conv with 32 or more channels,
# slower with 3); below it, the swapped Conv.
GEMM_WEIGHT_GRAD_MIN_CHANNELS = 16


def _conv_weight_grad(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations, begin, end, shift):
    """dw[m, c, k] = sum over n, o of dy[n, m, o] * x[n, c, o*s + k*d - begin].

    `shift` names the operand that depends on the incoming gradient ("gy" for Conv, "x" for ConvTranspose,
    which calls this with the roles exchanged): per-offset slices are taken of that operand only, so the
    forward-only work stays one copy of the other.
    """
    m, c_per_group = w.shape[0], w.shape[1]
    if isinstance(m, int) and isinstance(c_per_group, int):
        if c_per_group >= GEMM_WEIGHT_GRAD_MIN_CHANNELS:
            return _weight_grad_by_offsets(ctx, x, gy, group, m, c_per_group, sizes, out, kernel, strides,
                                           dilations, begin, shift, "gemm")
        if c_per_group == 1 and shift == "gy" and all(s == 1 for s in strides):
            return _weight_grad_by_offsets(ctx, x, gy, group, m, c_per_group, sizes, out, kernel, strides,
                                           dilations, begin, shift, "dot")
    return _weight_grad_as_conv(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations, begin, end)


def _offset_pairs(ctx, x, gy, sizes, out, kernel, strides, dilations, begin, shift, channel_first=True):
    """Per kernel offset k (in C order): (dy_k, x_k), channel-first [C, N, ...] tensors (or [N, C, ...] as given)
    whose elementwise product summed over all but the channel axis is that offset's term of dw.

    A generator: each offset's slice is written when the caller asks for it, just before the product that reads
    it, so one slice at a time is live (all of them written first held kernel-size copies of dy at once: 49 on
    a 7x7 depthwise Conv, 9 on a 3x3).

    shift="gy": x is split once into its stride phases x_r[i] = x[i*s + r] (a partition of x; for stride 1 x
    itself), and dy, padded once, is sliced per offset: x position o*s + t (t = k*d - begin = q*s + r) is
    x_r[o + q], so dy_k[i] = dy[i - q] on phase r's grid.
    shift="x": x, padded once, is sliced per offset at o*s + k*d (step s), and dy is used whole.
    """
    op = ctx.op
    n = len(sizes)
    axes = op.ints(range(2, n + 2))
    first = [1, 0, *range(2, n + 2)]
    xt, gyt = (op.Transpose(x, perm=first), op.Transpose(gy, perm=first)) if channel_first else (x, gy)
    offsets = list(np.ndindex(*kernel))
    if shift == "x":
        need = [max(0, (o - 1) * s + (k - 1) * d - b - size + 1)
                for size, o, k, s, d, b in zip(sizes, out, kernel, strides, dilations, begin)]
        if any(begin) or any(need):
            xt = op.Pad(xt, op.ints([0, 0, *begin, 0, 0, *need]))
        for k in offsets:
            starts = [kk * d for kk, d in zip(k, dilations)]
            ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, out, strides)]
            yield gyt, op.Slice(xt, op.ints(starts), op.ints(ends), axes, op.ints(strides))
        return
    # shift == "gy"
    plan = []
    for k in offsets:
        rq = [((kk * d - b) % s, (kk * d - b) // s) for kk, d, b, s in zip(k, dilations, begin, strides)]
        lengths = [max(0, (size - r + s - 1) // s) for size, (r, _), s in zip(sizes, rq, strides)]
        plan.append((rq, lengths))
    pad_begin = [max(0, *(rq[a][1] for rq, _ in plan)) for a in range(n)]
    pad_end = [max(0, *(lengths[a] - rq[a][1] - out[a] for rq, lengths in plan)) for a in range(n)]
    if any(pad_begin) or any(pad_end):
        gyt = op.Pad(gyt, op.ints([0, 0, *pad_begin, 0, 0, *pad_end]))
    phases = {}
    for rq, lengths in plan:
        r = tuple(r for r, _ in rq)
        if r not in phases:
            phases[r] = xt if all(s == 1 for s in strides) else \
                op.Slice(xt, op.ints(r), op.ints([2**62] * n), axes, op.ints(strides))
        starts = [p - q for p, (_, q) in zip(pad_begin, rq)]
        ends = [st + ln for st, ln in zip(starts, lengths)]
        # (a 1x1 kernel at stride 1 reads dy whole: a Slice of all of it would be a copy)
        whole = gyt.shape is not None and not any(starts) and ends == list(gyt.shape[2:])
        yield (gyt if whole else op.Slice(gyt, op.ints(starts), op.ints(ends), axes)), phases[r]


def _weight_grad_by_offsets(ctx, x, gy, group, m, c_per_group, sizes, out, kernel, strides, dilations, begin,
                            shift, form):
    """dw[:, :, k] for each kernel offset k as a contraction over the batch and spatial positions: a GEMM
    ([M, NL] x [C, NL]^T, batched over groups) or, with one channel per group (depthwise), a product summed."""
    op = ctx.op
    m_per_group = m // group
    columns, flat = [], {}

    def rows(v, per_group):  # [C, N, ...] as [C, NL], or [G, C/G, NL] with groups
        if v not in flat:
            flat[v] = op.Reshape(v, op.ints([group, per_group, -1] if group > 1 else [per_group, -1]))
        return flat[v]

    def per_group(v, per_group):  # [N, C, L...] as [N, G, C/G, L'] (the dot form works in the given layout)
        if v not in flat:
            flat[v] = op.Reshape(v, op.ints([0, group, per_group, -1]))
        return flat[v]

    pairs = _offset_pairs(ctx, x, gy, sizes, out, kernel, strides, dilations, begin, shift,
                          channel_first=form != "dot")
    for dy_k, x_k in pairs:
        if form == "dot":  # one input channel per group: [N, G, Mg, L] * [N, G, 1, L] summed over N and L
            term = op.ReduceSum(op.Mul(per_group(dy_k, m_per_group), per_group(x_k, 1)), op.ints([0, 3]),
                                keepdims=0)
        else:
            a, b = rows(dy_k, m_per_group), rows(x_k, c_per_group)
            term = op.Gemm(a, b, transB=1) if group == 1 else op.MatMul(a, op.Transpose(b, perm=[0, 2, 1]))
        columns.append(term)
    if len(columns) == 1:
        # one Reshape, not two in a row: onnxruntime merges such a pair into a node numbered after every node of
        # the file, which PRIORITY_BASED runs only when nothing else is ready (a 1x1 Conv's weight gradient
        # then waited for the end of the backward pass)
        return op.Reshape(columns[0], op.ints([m, c_per_group, *kernel]))
    gw = op.Concat(*[op.Reshape(c, op.ints([m, c_per_group, 1])) for c in columns], axis=2)
    return op.Reshape(gw, op.ints([m, c_per_group, *kernel]))


def _weight_grad_as_conv(ctx, x, w, gy, group, sizes, out, kernel, strides, dilations, begin, end):
    """dw[m, c, k] = sum over n, o of dy[n, m, o] * x[n, c, o*s + k*d - begin], as one Conv.

    x becomes the input with batch and channels exchanged, dy the weights likewise; the sum over the batch is
    then the Conv's sum over input channels. Sliding over x with step d and reading dy with dilation s walks
    the kernel offsets k. With groups, channels are ordered (group, n) so each group's x channels meet only
    that group's dy channels.
    """
    op = ctx.op
    n = len(sizes)
    spatial = list(range(3, n + 3))
    if group == 1:
        gyt = op.Transpose(gy, perm=[1, 0, *range(2, n + 2)])
        xt = op.Transpose(x, perm=[1, 0, *range(2, n + 2)])
    else:
        m, c_per_group = w.shape[0], w.shape[1]
        if not isinstance(m, int) or not isinstance(c_per_group, int):
            raise ctx.unsupported(f"grouped Conv needs the channel dims of W {w.name!r} static")
        gyt = op.Reshape(gy, op.ints([0, group, m // group, *out]))
        gyt = op.Reshape(op.Transpose(gyt, perm=[1, 2, 0, *spatial]), op.ints([m, -1, *out]))
        xt = op.Reshape(x, op.ints([0, group, c_per_group, *sizes]))
        xt = op.Reshape(op.Transpose(xt, perm=[2, 1, 0, *spatial]), op.ints([c_per_group, -1, *sizes]))
    # The swapped Conv reaches kernel offsets up to the last one x still covers; trim its end pad so it stops at
    # the kernel's size, and slice where the pad is too small to trim.
    end_pads, reach = [], []
    for size, o, k, s, d, b, e in zip(sizes, out, kernel, strides, dilations, begin, end):
        surplus = (size + b + e - (o - 1) * s - 1) // d + 1 - k
        trim = min(surplus, e // d)
        end_pads.append(e - trim * d)
        reach.append(k + surplus - trim)
    gw = op.Conv(xt, gyt, strides=dilations, dilations=strides, pads=list(begin) + end_pads, group=group)
    gw = op.Transpose(gw, perm=[1, 0, *range(2, n + 2)])
    if reach != kernel:
        gw = op.Slice(gw, op.ints([0] * n), op.ints(kernel), op.ints(range(2, n + 2)))
    return gw


def _pool_attrs(ctx) -> dict:
    names = ("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides")
    attrs = {name: ctx.attr(name) for name in names}
    if attrs["auto_pad"] is not None:
        attrs["auto_pad"] = ctx.text_attr("auto_pad", "NOTSET")
    return attrs


def _flat_size(ctx, x):
    static = x.static_shape
    if static is not None:
        return ctx.op.ints([int(np.prod(static))])
    return ctx.op.Reshape(ctx.op.Size(x), ctx.op.ints([1]))


@rule("MaxPool", since=13, wrt=(0,))
def max_pool(ctx):
    """dx = dy added at the argmax of each window (indices recomputed unless the forward has them)"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    has_indices = len(ctx.node.outputs) > 1 and ctx.O(1).name
    if has_indices and ctx.attr("storage_order", 0) == 0:
        indices = ctx.O(1)
    else:
        _, indices = op.MaxPool(x, outputs=2, storage_order=0, **_pool_attrs(ctx))
    # MaxPool's indices are flat positions in x (batch and channel included, padding excluded).
    zeros = ctx.zeros(_flat_size(ctx, x), x)
    if ctx.opset >= 16:
        flat = op.ScatterElements(zeros, op.Reshape(indices, op.ints([-1])), op.Reshape(gy, op.ints([-1])),
                                  axis=0, reduction="add")
        return [ctx.reshape_like(flat, x)]
    # Before opset 16 ScatterElements cannot add; windows whose outputs lie q = ceil(extent / stride) apart
    # never overlap, so each of the q**n phases is a plain scatter of distinct indices, and the phases are summed.
    rank = ctx.rank(x)
    n = rank - 2
    kernel = ctx.attr("kernel_shape")
    strides = ctx.attr("strides", [1] * n)
    dilations = ctx.attr("dilations", [1] * n)
    steps = [max(1, math.ceil(((k - 1) * d + 1) / s)) for k, s, d in zip(kernel, strides, dilations)]
    parts = []
    for phase in np.ndindex(*steps):
        g_phase, i_phase = gy, indices
        if any(steps[a] > 1 for a in range(n)):
            axes = [a + 2 for a in range(n) if steps[a] > 1]
            starts = op.ints([phase[a - 2] for a in axes])
            ends = op.ints([2**62] * len(axes))
            step = op.ints([steps[a - 2] for a in axes])
            g_phase = op.Slice(gy, starts, ends, op.ints(axes), step)
            i_phase = op.Slice(indices, starts, ends, op.ints(axes), step)
        parts.append(op.ScatterElements(zeros, op.Reshape(i_phase, op.ints([-1])),
                                        op.Reshape(g_phase, op.ints([-1])), axis=0))
    flat = parts[0] if len(parts) == 1 else op.Sum(*parts)
    return [ctx.reshape_like(flat, x)]


def _window_counts(size, out, k, s, d, b, e, include_pad) -> np.ndarray:
    """Per output position along one axis: how many window elements the average divides by."""
    counts = np.zeros(out)
    for o in range(out):
        taps = o * s - b + d * np.arange(k)
        lo, hi = (-b, size + e) if include_pad else (0, size)
        counts[o] = np.count_nonzero((taps >= lo) & (taps < hi))
    return counts


@rule("AveragePool", since=13, limits="spatial dims of X must be static")
def average_pool(ctx):
    """dx = ConvTranspose(dy / count, ones): each output's gradient spread evenly over its window"""
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    sizes, out = _spatial(ctx, x, "X"), _spatial(ctx, ctx.O(0), "Y")
    kernel = list(ctx.attr("kernel_shape"))
    strides, dilations, begin, end = _window(ctx, sizes, kernel)
    include_pad = ctx.attr("count_include_pad", 0) == 1
    for size, o, s, b in zip(sizes, out, strides, begin):
        if ctx.attr("ceil_mode", 0) and (o - 1) * s - b >= size:
            raise ctx.unsupported(f"with ceil_mode the last window starts past the end of X ({size} elements): "
                                  f"onnxruntime drops that window, onnx shape inference keeps it, so the size of "
                                  f"Y is not known")
    # The divisor of each output: elements inside x (or inside the padded x), a product over the axes.
    inverse = np.ones([1, 1])
    for size, o, k, s, d, b, e in zip(sizes, out, kernel, strides, dilations, begin, end):
        counts = _window_counts(size, o, k, s, d, b, e, include_pad)
        # A window lying wholly in the padding reads no element of x: its output is constant, its weight 0.
        inverse = np.multiply.outer(inverse, np.divide(1.0, counts, out=np.zeros(o), where=counts > 0))
    if np.all(inverse == inverse.flat[0]):
        scaled = op.Mul(gy, ctx.const_like(float(inverse.flat[0]), x))
    else:
        scaled = op.Mul(gy, ctx.const_like(inverse, x))
    # Batch and channels fold into one axis, so a single-channel ones kernel serves any channel count.
    ones = ctx.const_like(np.ones([1, 1, *kernel]), x)
    gx = _conv_transpose_onto(ctx, op.Reshape(scaled, op.ints([-1, 1, *out])), ones, sizes, out, kernel, strides,
                              dilations, begin)
    return [ctx.reshape_like(gx, x)]


@rule("GlobalAveragePool", since=13)
def global_average_pool(ctx):
    """dx = expand(dy / number of spatial positions)"""
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    shape = ctx.shape_of(x)
    if x.shape is not None and all(isinstance(d, int) for d in x.shape[2:]):
        scaled = op.Div(gy, ctx.const_like(float(np.prod(x.shape[2:])), y))
    else:
        count = op.Cast(op.Div(op.Size(x), op.Size(y)), to=ctx.elem_type(y))
        scaled = op.Div(gy, count)
    return [op.Expand(scaled, shape)]


@rule("GlobalMaxPool", since=13)
def global_max_pool(ctx):
    """dx = dy where x equals its channel's maximum (ties share the gradient)"""
    x, y, gy, op = ctx.I(0), ctx.O(0), ctx.GO(0), ctx.op
    rank = ctx.rank(x)
    is_max = op.Equal(x, y)  # a mask: forward-only, one byte per element
    ties = op.ReduceSum(op.Cast(is_max, to=ctx.elem_type(y)), op.ints(range(2, rank)), keepdims=1)
    share = op.Div(gy, ties)
    return [op.Where(is_max, share, ctx.const_like(0.0, y))]


# -- ConvTranspose ---------------------------------------------------------------------------------------------
def _transposed_window(ctx, sizes: list[int], kernel: list[int]):
    """strides, dilations, begin pads and output sizes of a ConvTranspose, resolved as onnxruntime does.

    With output_shape or SAME padding, the total padding is whatever trims the full transposed result
    s*(in-1) + output_padding + (k-1)*d + 1 to the output size; SAME_UPPER puts the smaller half at the begin,
    the other forms the larger half.
    """
    n = len(sizes)
    strides = list(ctx.attr("strides", [1] * n))
    dilations = list(ctx.attr("dilations", [1] * n))
    extra = list(ctx.attr("output_padding", [0] * n))
    auto_pad = ctx.text_attr("auto_pad", "NOTSET")
    output_shape = ctx.attr("output_shape")
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise ctx.unsupported(f"auto_pad={auto_pad}")
    full = [s * (size - 1) + p + (k - 1) * d + 1 for size, k, s, d, p in zip(sizes, kernel, strides, dilations, extra)]
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = list(output_shape)[-n:] if output_shape is not None else [size * s for size, s in zip(sizes, strides)]
        begin = []
        for f, o in zip(full, out):
            total = f - o
            if total < 0:
                raise ctx.unsupported(f"the output size {o} exceeds the full transposed size {f} (negative padding)")
            begin.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
    elif auto_pad == "VALID":
        begin, out = [0] * n, full
    else:
        pads = list(ctx.attr("pads", [0] * (2 * n)))
        begin, out = pads[:n], [f - b - e for f, b, e in zip(full, pads[:n], pads[n:])]
    return strides, dilations, begin, out


@rule("ConvTranspose", since=13, limits="spatial dims of X and W must be static")
def conv_transpose(ctx):
    """dx = Conv(dy, w) (same stride, dilation, pads), dw = Conv(dy^T, x^T) (stride and dilation swapped), db"""
    x, w, gy, op = ctx.I(0), ctx.I(1), ctx.GO(0), ctx.op
    sizes, kernel = _spatial(ctx, x, "X"), _spatial(ctx, w, "W")
    group = ctx.attr("group", 1)
    strides, dilations, begin, out = _transposed_window(ctx, sizes, kernel)
    y_sizes = ctx.O(0).shape[2:] if ctx.O(0).shape is not None else [None] * len(sizes)
    if any(isinstance(d, int) and d != o for d, o in zip(y_sizes, out)):
        raise ctx.unsupported(f"onnxruntime computes spatial output sizes {out}, onnx shape inference "
                              f"{list(y_sizes)} (output_padding with auto_pad SAME?)")
    # y[o] gathers x[i] * w[k] for o = i*s + k*d - begin, so dx[i] = sum over k of dy[i*s + k*d - begin] * w[k]:
    # a Conv of dy. Its end pad makes it stop at the last i; where dy runs past that (output_padding beyond the
    # end pad), no pad is needed and the Conv's rounding drops the surplus, which is less than one stride.
    end = [max(s * (size - 1) + (k - 1) * d + 1 - b - o, 0)
           for size, k, s, d, b, o in zip(sizes, kernel, strides, dilations, begin, out)]
    reach = [(o + b + e - (k - 1) * d - 1) // s + 1 for o, k, s, d, b, e in zip(out, kernel, strides, dilations,
                                                                                 begin, end)]
    if reach != sizes:
        raise ctx.unsupported(f"output_padding reaches a stride or more past the end pad (output sizes {out})")
    gx = gw = gb = None
    if ctx.needs(0):
        gx = op.Conv(gy, w, strides=strides, dilations=dilations, pads=list(begin) + end, group=group,
                     kernel_shape=kernel)
    if ctx.needs(1):
        # dw[c, m, k] = sum over n, i of x[n, c, i] * dy[n, m, i*s + k*d - begin]: Conv's weight gradient with dy
        # as the input and x as the output gradient.
        gw = _conv_weight_grad(ctx, gy, w, x, group, out, sizes, kernel, strides, dilations, begin, end,
                               shift="x")
    if ctx.needs(2):
        gb = op.ReduceSum(gy, op.ints([0, *range(2, len(sizes) + 2)]), keepdims=0)
    return [gx, gw, gb][:ctx.num_inputs]


# -- CausalConvWithState ---------------------------------------------------------------------------------------------
@rule("CausalConvWithState", since=27, wrt=(0, 1, 2),
      limits="static kernel size and channels; past_state gets no gradient (the schema marks it so)")
def causal_conv_with_state(ctx):
    """p = [past, x] along the length, z = depthwise Conv(p, w) + b, y = act(z), present = the last k-1 of p:
    dz = dy * act'(z), dx = ConvTranspose(dz, w) (+ dpresent) without its first k-1,
    dw[c, j] = sum dz[., c, t] * p[., c, t + j] (a grouped Conv), db = sum(dz)"""
    op = ctx.op
    x, w, b, past = ctx.I(0), ctx.I(1), ctx.I(2), ctx.I(3)
    k = w.shape[-1] if w.shape else None
    if not isinstance(k, int):
        raise ctx.unsupported("the kernel size (the last axis of weight) must be static")
    channels = ctx.dim(w, 0)
    activation = ctx.attr("activation", "none")
    activation = activation.decode() if isinstance(activation, bytes) else activation
    gy = ctx.GO_or_zeros(0)
    if past is None:
        past = ctx.zeros(ctx.make_shape([ctx.dim(x, 0), ctx.dim(x, 1), k - 1]), x)
    # [past, x] through the gradient (as Attention's Q): Concat with dy and Split again, so the recomputed
    # pre-activation and the weight gradient's input cannot run during the forward pass
    length = ctx.dim(x, 2)
    padded, gy = op.Split(op.Concat(past, x, gy, axis=2), ctx.make_shape([k - 1 + length if isinstance(length, int)
                                                                     else op.Add(length, op.ints([k - 1])),
                                                                     length]), axis=2, outputs=2)
    gz = gy
    if activation in ("silu", "swish"):
        z = op.Conv(padded, w, b, group=channels) if isinstance(channels, int) else None
        if z is None:
            raise ctx.unsupported("the number of channels (the first axis of weight) must be static")
        s = op.Sigmoid(z)
        t = op.Mul(gy, s)
        tz = op.Mul(t, z)
        gz = op.Add(t, op.Sub(tz, op.Mul(tz, s)))
    elif activation != "none":
        raise ctx.unsupported(f"activation {activation!r}")
    g_padded = op.ConvTranspose(gz, w, group=channels)
    g_present = ctx.GO(1)
    if g_present is not None:   # present is the last k-1 positions of [past, x]
        g_padded = op.Add(g_padded, op.Pad(g_present, ctx.make_shape([0, 0, length, 0, 0, 0])))
    gx = gw = gb = None
    if ctx.needs(0):
        _, gx = op.Split(g_padded, ctx.make_shape([k - 1, length]), axis=2, outputs=2)
    if ctx.needs(1):
        # batch folded into channels: out[0, c, j] = sum_b sum_t p[b, c, t + j] * dz[b, c, t]
        p_cb = ctx.reshape(op.Transpose(padded, perm=[1, 0, 2]), [1, -1, 0])
        dz_cb = op.Transpose(gz, perm=[1, 0, 2])
        gw = ctx.reshape(op.Conv(p_cb, dz_cb, group=channels), [channels, 1, k])
    if ctx.needs(2):
        gb = op.ReduceSum(gz, op.ints([0, 2]), keepdims=0)
    return [gx, gw, gb, None][:ctx.num_inputs]
