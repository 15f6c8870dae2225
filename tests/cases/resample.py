"""Resize, DepthToSpace and SpaceToDepth cases.

Resize: nearest with every nearest_mode under every coordinate transformation, linear (1-D and 2-D) and cubic
under each transformation, up- and downsampling, scales or sizes, the opset 13 form (roi, scales, sizes as
inputs), the opset 18 additions (axes, keep_aspect_ratio_policy, antialias when upsampling) and opset 19's
half_pixel_symmetric. align_corners from 3 to 5 puts nearest positions exactly on ties (x.5), which float32
represents exactly, so the rounding modes differ there.
"""
import dataclasses

import numpy as np

from onnx import numpy_helper

from cases.indexing import edited, symbolic
from gradcheck import Case

NEAREST_MODES = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]
COORDS = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]


def f32(values):
    return np.array(values, dtype=np.float32)


def i64(values):
    return np.array(values, dtype=np.int64)


def scales_input(scales) -> callable:
    """An edit (see cases/indexing.py): the Resize built with sizes reads float32 scales instead.

    gradcheck casts float initializers to the case's type, and scales must be float32.
    """
    def edit(model):
        graph, op = model.graph, model.graph.node[-1]
        sizes = op.input[3]
        kept = [t for t in graph.initializer if t.name != sizes]
        del graph.initializer[:]
        graph.initializer.extend(kept + [numpy_helper.from_array(f32(scales), "scales")])
        op.input[2] = "scales"
        del op.input[3]
    return edit


def resize(id, x, scales=None, sizes=None, roi=None, opset=18, dtype=np.float64, tol=1e-6, **attrs):
    """A Resize reading scales or sizes, and roi when given (absent otherwise)."""
    if scales is not None:  # built with the sizes the scales give, then switched to the scales
        dims = [x[a] for a in attrs["axes"]] if "axes" in attrs else x
        sizes = [int(np.floor(d * np.float32(s))) for d, s in zip(dims, scales)]
    inputs = [x, None if roi is None else np.array(roi, dtype=np.float64), None, i64(sizes)]
    case = Case("Resize", inputs, attrs, id=f"Resize-{id}", opset=opset, dtype=dtype, tol=tol)
    return case if scales is None else edited(case, scales_input(scales))


CASES = [
    # nearest: the common whole-factor upsampling (a reshape and a sum), and its opset-13 form with no roi
    resize("nearest-x2-asymmetric-floor", (1, 2, 2, 3), scales=[1, 1, 2, 2], coordinate_transformation_mode=
           "asymmetric", nearest_mode="floor"),
    resize("nearest-x2-default", (2, 1, 2, 2), scales=[1, 1, 2, 3]),
    resize("nearest-opset13", (1, 2, 2, 3), scales=[1, 1, 2, 2], opset=13, mode="nearest"),
    resize("nearest-downsample", (1, 1, 5, 6), scales=[1, 1, 0.5, 0.7], nearest_mode="round_prefer_ceil"),
    resize("nearest-sizes-opset13", (1, 1, 3, 4), sizes=[1, 1, 5, 7], opset=13),
]

# nearest: every rounding under every transformation, upsampling by 5/3 and 7/4 via sizes
CASES += [resize(f"nearest-{coord}-{rounding}", (1, 1, 3, 4), sizes=[1, 1, 5, 7], mode="nearest",
                 coordinate_transformation_mode=coord, nearest_mode=rounding)
          for coord in COORDS for rounding in NEAREST_MODES]
CASES += [resize(f"nearest-half-pixel-symmetric-{rounding}", (1, 1, 3, 4), scales=[1, 1, 1.7, 2.3], opset=19,
                 coordinate_transformation_mode="half_pixel_symmetric", nearest_mode=rounding)
          for rounding in ("round_prefer_floor", "floor")]

CASES += [
    # linear 1-D (rank 3, last axis) and 2-D under each transformation
    *[resize(f"linear-1d-{coord}", (1, 2, 4), scales=[1, 1, 1.75], mode="linear",
             coordinate_transformation_mode=coord) for coord in COORDS],
    *[resize(f"linear-2d-{coord}", (1, 1, 3, 4), sizes=[1, 1, 5, 6], mode="linear",
             coordinate_transformation_mode=coord) for coord in COORDS],
    resize("linear-2d-x2-half-pixel", (1, 2, 2, 3), scales=[1, 1, 2, 2], mode="linear"),
    resize("linear-downsample", (1, 1, 5, 6), sizes=[1, 1, 3, 4], mode="linear"),
    resize("linear-half-pixel-symmetric", (1, 1, 3, 4), scales=[1, 1, 1.7, 2.3], opset=19, mode="linear",
           coordinate_transformation_mode="half_pixel_symmetric"),
    resize("linear-opset13", (1, 1, 2, 4), scales=[1, 1, 1.5, 1.5], opset=13, mode="linear",
           coordinate_transformation_mode="align_corners"),
    resize("linear-tf-crop-and-resize", (1, 1, 4, 4), sizes=[1, 1, 3, 5], mode="linear",
           roi=[0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2], coordinate_transformation_mode="tf_crop_and_resize",
           extrapolation_value=0.5),
    resize("nearest-tf-crop-and-resize", (1, 1, 4, 4), sizes=[1, 1, 3, 5], roi=[0, 0, 0.2, -0.1, 1, 1, 0.9, 1.2],
           coordinate_transformation_mode="tf_crop_and_resize"),
    resize("linear-antialias-upsampling", (1, 1, 3, 4), scales=[1, 1, 1.5, 2], mode="linear", antialias=1),
    resize("linear-batch-and-channels", (2, 3, 2, 2), scales=[1, 1, 1.5, 2], mode="linear"),

    # cubic
    resize("cubic-half-pixel", (1, 1, 4, 4), scales=[1, 1, 1.5, 1.75], mode="cubic"),
    resize("cubic-exclude-outside", (1, 1, 4, 4), sizes=[1, 1, 6, 5], mode="cubic", exclude_outside=1),
    resize("cubic-align-corners-a", (1, 1, 4, 4), sizes=[1, 1, 6, 7], mode="cubic", cubic_coeff_a=-0.5,
           coordinate_transformation_mode="align_corners"),
    resize("cubic-asymmetric-downsample", (1, 1, 6, 5), sizes=[1, 1, 4, 3], mode="cubic",
           coordinate_transformation_mode="asymmetric"),
    resize("cubic-antialias-upsampling", (1, 1, 3, 4), scales=[1, 1, 1.5, 2], mode="cubic", antialias=1),
    resize("cubic-pytorch-opset13", (1, 1, 3, 4), scales=[1, 1, 2, 1.5], mode="cubic", opset=13,
           coordinate_transformation_mode="pytorch_half_pixel"),

    # opset 18: axes (negative too), keep_aspect_ratio_policy
    resize("axes-scales", (1, 2, 3, 4), scales=[2, 1.5], axes=[2, 3], mode="linear"),
    Case("Resize", [(2, 3, 4), None, None, i64([7])], {"axes": [-1]}, id="Resize-axes-negative-sizes",
         dtype=np.float32, tol=2e-3),
    resize("not-larger", (1, 1, 3, 4), sizes=[6, 6], axes=[2, 3], keep_aspect_ratio_policy="not_larger",
           mode="linear"),
    resize("not-smaller", (1, 1, 3, 4), sizes=[6, 6], axes=[2, 3], keep_aspect_ratio_policy="not_smaller",
           mode="nearest"),
    resize("channel-axis", (1, 2, 3), scales=[1, 2, 1], mode="nearest"),
    resize("axes-tf-crop-and-resize", (1, 2, 3, 4), sizes=[3], axes=[3], roi=[0.1, 0.8], mode="linear",
           coordinate_transformation_mode="tf_crop_and_resize"),
    resize("identity", (1, 2, 2, 3), scales=[1, 1, 1, 1], mode="linear"),

    # the reference evaluator (float64 above) divides by scale * in where onnxruntime and the spec use the output
    # length: align_corners with a fractional scale * in, pytorch_half_pixel with one output element
    resize("linear-align-corners-fractional", (1, 1, 3, 4), scales=[1, 1, 1.5, 1.7], mode="linear",
           coordinate_transformation_mode="align_corners", dtype=np.float32, tol=2e-3),
    resize("nearest-align-corners-fractional", (1, 1, 3, 4), scales=[1, 1, 1.5, 1.7], mode="nearest",
           coordinate_transformation_mode="align_corners", dtype=np.float32, tol=2e-3),
    resize("linear-pytorch-half-pixel-one-output", (1, 1, 3, 4), scales=[1, 1, 0.4, 1.5], mode="linear",
           coordinate_transformation_mode="pytorch_half_pixel", dtype=np.float32, tol=2e-3),

    # DepthToSpace (DCR, CRD) and SpaceToDepth
    Case("DepthToSpace", [(1, 8, 2, 3)], {"blocksize": 2}, id="DepthToSpace-DCR-default"),
    Case("DepthToSpace", [(2, 4, 2, 2)], {"blocksize": 2, "mode": "DCR"}, id="DepthToSpace-DCR", opset=13),
    Case("DepthToSpace", [(1, 8, 2, 3)], {"blocksize": 2, "mode": "CRD"}, id="DepthToSpace-CRD"),
    Case("DepthToSpace", [(1, 9, 1, 2)], {"blocksize": 3, "mode": "CRD"}, id="DepthToSpace-CRD-block3", opset=13),
    Case("SpaceToDepth", [(1, 2, 4, 6)], {"blocksize": 2}, id="SpaceToDepth"),
    Case("SpaceToDepth", [(2, 1, 3, 3)], {"blocksize": 3}, id="SpaceToDepth-block3", opset=13),
]

# onnxruntime has no float64 Resize, so the float64 checks above run the reference evaluator's forward; each
# float64 case also runs in float32, where the forward (and its finite differences) is onnxruntime's own.
CASES += [dataclasses.replace(c, id=f"{c.id}-ort", dtype=np.float32, tol=2e-3)
          for c in CASES if c.op == "Resize" and c.dtype == np.float64]

# Symbolic batch and channel dims (the resized axes must be static): one training graph for every batch size
NC = {0: {0: "N", 1: "C"}}
CASES += [
    edited(resize("nearest-x2-symbolic", (2, 3, 2, 2), scales=[1, 1, 2, 2]), symbolic(NC)),
    edited(resize("linear-symbolic", (2, 1, 2, 3), scales=[1, 1, 1.5, 2], mode="linear"), symbolic(NC)),
    edited(resize("linear-axes-symbolic-trail", (2, 3, 2), scales=[2], axes=[1], mode="linear"),
           symbolic({0: {0: "N", 2: "W"}})),
    edited(Case("DepthToSpace", [(2, 8, 2, 3)], {"blocksize": 2, "mode": "CRD"}, id="DepthToSpace-CRD-symbolic"),
           symbolic({0: {0: "N", 2: "H", 3: "W"}})),
    edited(Case("DepthToSpace", [(2, 8, 2, 3)], {"blocksize": 2}, id="DepthToSpace-DCR-symbolic"),
           symbolic({0: {0: "N", 1: "C", 2: "H", 3: "W"}})),
    edited(Case("SpaceToDepth", [(2, 2, 4, 2)], {"blocksize": 2}, id="SpaceToDepth-symbolic"),
           symbolic({0: {0: "N", 1: "C", 2: "H", 3: "W"}})),
]
