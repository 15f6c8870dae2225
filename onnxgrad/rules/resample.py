"""Gradient rules: resampling (Resize) and block rearrangements (DepthToSpace, SpaceToDepth).

Resize is separable: along each resized axis every output element is a fixed weighted sum of input elements
(one weight of 1 for nearest, two for linear, four for cubic), so y = x multiplied along that axis by an
(out x in) matrix M. The rule computes M at build time from the same coordinate transformation, rounding and
clamping the op uses, and sends dy back through Mᵀ, one axis at a time: a MatMul, or for nearest upsampling by
a whole factor (each input element copied f times in a row) a reshape and a sum over the copies. This needs
the resized axes static; the other axes may be symbolic. Every node consumes dy; M is a constant.
"""
from __future__ import annotations

import numpy as np

from ..registry import rule


# -- Resize ----------------------------------------------------------------------------------------------------
def _source_coordinates(ctx, coord: str, size: int, out: int, scale: float, roi) -> np.ndarray:
    """Where each output position along one axis reads the input (x_original of the ONNX spec)."""
    o = np.arange(out, dtype=np.float64)
    if coord == "half_pixel":
        return (o + 0.5) / scale - 0.5
    if coord == "half_pixel_symmetric":
        adjustment = out / (scale * size)
        return size / 2 * (1 - adjustment) + (o + 0.5) / scale - 0.5
    if coord == "pytorch_half_pixel":
        return (o + 0.5) / scale - 0.5 if out > 1 else np.zeros(out)
    if coord == "align_corners":
        return o * (size - 1) / (out - 1) if out > 1 else np.zeros(out)
    if coord == "asymmetric":
        return o / scale
    if coord == "tf_crop_and_resize":
        start, end = roi
        if out > 1:
            return start * (size - 1) + o * (end - start) * (size - 1) / (out - 1)
        return np.full(out, 0.5 * (start + end) * (size - 1))
    raise ctx.unsupported(f"coordinate_transformation_mode={coord!r}")


def _nearest(ctx, x: np.ndarray, rounding: str) -> np.ndarray:
    if rounding == "round_prefer_floor":
        return np.ceil(x - 0.5)
    if rounding == "round_prefer_ceil":
        return np.floor(x + 0.5)
    if rounding == "floor":
        return np.floor(x)
    if rounding == "ceil":
        return np.ceil(x)
    raise ctx.unsupported(f"nearest_mode={rounding!r}")


def _cubic_weights(t: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution weights of the taps at floor(x) - 1 .. floor(x) + 2, t = x - floor(x)."""
    def near(d):  # |d| <= 1
        return ((a + 2) * d - (a + 3)) * d * d + 1

    def far(d):   # 1 < |d| < 2
        return ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=1)


def _resize_matrix(ctx, mode: str, size: int, out: int, scale: float, roi) -> np.ndarray:
    """M (out x in) with y = M @ x along one axis."""
    coord = ctx.text_attr("coordinate_transformation_mode", "half_pixel")
    x = _source_coordinates(ctx, coord, size, out, scale, roi)
    rows = np.arange(out)
    m = np.zeros((out, size))
    if mode == "nearest":
        taps = _nearest(ctx, x, ctx.text_attr("nearest_mode", "round_prefer_floor"))[:, None]
        weights = np.ones((out, 1))
    elif mode == "linear":
        inside = np.clip(x, 0, size - 1)
        low = np.floor(inside)
        taps = np.stack([low, low + 1], axis=1)
        weights = np.stack([1 - (inside - low), inside - low], axis=1)
    elif mode == "cubic":
        low = np.floor(x)
        taps = low[:, None] + np.arange(-1, 3)
        weights = _cubic_weights(x - low, float(ctx.attr("cubic_coeff_a", -0.75)))
        if ctx.attr("exclude_outside", 0):
            weights = np.where((taps < 0) | (taps > size - 1), 0.0, weights)
            weights = weights / weights.sum(axis=1, keepdims=True)
    else:
        raise ctx.unsupported(f"mode={mode!r}")
    taps = np.clip(taps, 0, size - 1).astype(np.int64)
    for k in range(taps.shape[1]):
        np.add.at(m, (rows, taps[:, k]), weights[:, k])
    if coord == "tf_crop_and_resize":  # outside the crop the output is the constant extrapolation_value
        m[(x < 0) | (x > size - 1)] = 0.0
    return m


def _whole_factor(m: np.ndarray) -> int | None:
    """f when M copies each input element to f consecutive outputs (nearest upsampling by a whole factor)."""
    out, size = m.shape
    if out % size:
        return None
    f = out // size
    return f if np.array_equal(m, np.repeat(np.eye(size), f, axis=0)) else None


def _resize_plan(ctx):
    """{axis: M} for every axis Resize changes, from its scales or sizes, axes, roi and aspect-ratio policy."""
    x, y = ctx.I(0), ctx.O(0)
    rank = ctx.rank(x)
    mode = ctx.text_attr("mode", "nearest")
    coord = ctx.text_attr("coordinate_transformation_mode", "half_pixel")
    policy = ctx.text_attr("keep_aspect_ratio_policy", "stretch")
    listed = ctx.attr("axes")  # the axes that scales, sizes and roi describe, in their order
    listed = list(range(rank)) if listed is None else [ctx.normalize_axis(a, rank) for a in listed]
    scales, sizes, roi = ctx.const_input(2), ctx.const_input(3), ctx.const_input(1)
    if ctx.I(2) is not None and scales is None and ctx.I(2).shape != (0,):
        raise ctx.unsupported("the scales input is computed at run time; make it a constant")
    use_scales = scales is not None and scales.size > 0
    crop = coord == "tf_crop_and_resize"
    if crop and roi is None:
        raise ctx.unsupported("tf_crop_and_resize needs the roi input as a constant")

    # Axes whose positions all map to themselves need no matrix (and may be symbolic): a scale of exactly 1,
    # or an output size equal to the input's, outside a crop.
    if use_scales:
        requested = dict(zip(listed, (float(s) for s in scales.reshape(-1))))
        changed = [a for a in listed if crop or requested[a] != 1.0]
    elif policy == "stretch":
        changed = [a for a in listed if crop or x.shape is None or y.shape is None or x.shape[a] != y.shape[a]]
    else:
        changed = listed

    def static(v, a, what):
        d = v.shape[a] if v.shape is not None else None
        if not isinstance(d, int):
            raise ctx.unsupported(f"axis {a} of {what} {v.name!r} is resized, so its size must be static: bind it "
                                  f"with --input-shape or --dim")
        return d

    ins = {a: static(x, a, "X") for a in changed}
    outs = {a: static(y, a, "Y") for a in changed}
    if use_scales:
        axis_scale = {a: requested[a] for a in changed}
    elif policy == "stretch":
        axis_scale = {a: outs[a] / ins[a] for a in changed}
    elif policy in ("not_larger", "not_smaller"):
        if sizes is None:
            raise ctx.unsupported(f"keep_aspect_ratio_policy={policy!r} needs the sizes input as a constant")
        ratios = [int(s) / ins[a] for a, s in zip(listed, sizes.reshape(-1))]
        shared = min(ratios) if policy == "not_larger" else max(ratios)
        axis_scale = {a: shared for a in changed}
    else:
        raise ctx.unsupported(f"keep_aspect_ratio_policy={policy!r}")

    plan = {}
    for a in changed:
        if ctx.attr("antialias", 0) and mode != "nearest" and axis_scale[a] < 1:
            raise ctx.unsupported(f"antialias=1 when downsampling (axis {a}, scale {axis_scale[a]:g}) widens the "
                                  f"{mode} filter; not supported")
        axis_roi = None
        if crop:
            j, flat = listed.index(a), roi.reshape(-1)
            axis_roi = (float(flat[j]), float(flat[len(listed) + j]))
        m = _resize_matrix(ctx, mode, ins[a], outs[a], axis_scale[a], axis_roi)
        if m.shape != (ins[a], ins[a]) or not np.array_equal(m, np.eye(ins[a])):
            plan[a] = m
    return plan


def _resize_grad(ctx):
    x, gy, op = ctx.I(0), ctx.GO(0), ctx.op
    plan = _resize_plan(ctx)
    rank = ctx.rank(x)
    g = gy
    # Axes from the last: Reshape's 0 keeps the dims before axis a as they are (symbolic or not), and the dims
    # after it, already back at the input's sizes, are flattened into one.
    for a in sorted(plan, reverse=True):
        m = plan[a]
        out, size = m.shape
        f = _whole_factor(m)
        if f is not None:  # each input element was copied f times in a row: sum the copies
            g = op.ReduceSum(op.Reshape(g, op.ints([0] * a + [size, f, -1])), op.ints([a + 1]), keepdims=0)
        elif a == rank - 1:
            g = op.MatMul(g, ctx.const_like(m, x))
        else:
            g = op.MatMul(ctx.const_like(m.T, x), op.Reshape(g, op.ints([0] * a + [out, -1])))
    return [ctx.reshape_like(g, x) if plan else gy] + [None] * (ctx.num_inputs - 1)


@rule("Resize", since=13, until=17, wrt=(0,),
      limits="resized axes static; scales (or roi for tf_crop_and_resize) constant")
def resize_13(ctx):
    """dx = dy multiplied along each resized axis by Mᵀ, M the (out x in) interpolation matrix"""
    return _resize_grad(ctx)


@rule("Resize", since=18, wrt=(0,),
      limits="resized axes static; scales (or roi, or sizes with keep_aspect_ratio_policy) constant; "
             "no antialias when downsampling with linear or cubic")
def resize_18(ctx):
    """dx = dy multiplied along each resized axis by Mᵀ (axes, keep_aspect_ratio_policy and antialias read)"""
    return _resize_grad(ctx)


# -- block rearrangements --------------------------------------------------------------------------------------
@rule("DepthToSpace", since=13, limits="CRD mode needs the channel dim static")
def depth_to_space(ctx):
    """DCR: dx = SpaceToDepth(dy); CRD: the same, then channels reordered from (block, c) to (c, block)"""
    x, op = ctx.I(0), ctx.op
    b = ctx.attr("blocksize")
    g = op.SpaceToDepth(ctx.GO(0), blocksize=b)
    if ctx.text_attr("mode", "DCR") == "DCR":
        return [g]
    channels = x.shape[1] if x.shape is not None and len(x.shape) == 4 else None
    if not isinstance(channels, int):
        raise ctx.unsupported(f"mode CRD needs the channel dim of {x.name!r} static")
    # SpaceToDepth numbers channels (i*b + j)*C' + c; CRD's depth is c*b*b + i*b + j.
    g = op.Transpose(op.Reshape(g, op.ints([0, b * b, channels // (b * b), -1])), perm=[0, 2, 1, 3])
    return [ctx.reshape_like(g, x)]


@rule("SpaceToDepth", since=13, limits="mode CRD (opset 28)")
def space_to_depth(ctx):
    """dx = DepthToSpace(dy, mode=DCR), its inverse"""
    if ctx.text_attr("mode", "DCR") != "DCR":
        raise ctx.unsupported("mode CRD (its inverse has no checked rule here)")
    return [ctx.op.DepthToSpace(ctx.GO(0), blocksize=ctx.attr("blocksize"), mode="DCR")]
