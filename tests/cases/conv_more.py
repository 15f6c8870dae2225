"""ConvTranspose cases: 1-D, 2-D, 3-D; strides, dilations, explicit and automatic pads, output_padding,
output_shape, groups (depthwise too), with and without bias.

onnxruntime has no float64 ConvTranspose or Conv, so the float64 checks run the onnx reference evaluator
(patched for groups by cases/conv.py, imported here). That evaluator cannot run an output_shape without
auto_pad and places output_shape with output_padding differently from onnxruntime: those cases run in float32
only. Every float64 case also runs in float32, where the forward is onnxruntime's own.
"""
import dataclasses

import numpy as np

import cases.conv  # noqa: F401  (the reference evaluator's grouped ConvTranspose fix)
from cases.indexing import edited, symbolic
from gradcheck import Case


def convt(id, x, w, b=None, opset=18, dtype=np.float64, **attrs):
    tol = 1e-6 if dtype == np.float64 else 2e-3
    return Case("ConvTranspose", [x, w] + ([b] if b is not None else []), attrs, id=f"ConvTranspose-{id}",
                opset=opset, dtype=dtype, tol=tol)


CASES = [
    # 1-D
    convt("1d", (1, 2, 3), (2, 3, 2), (3,)),
    convt("1d-stride2-pads", (2, 2, 3), (2, 1, 3), (1,), strides=[2], pads=[1, 0]),
    convt("1d-stride3-output-padding", (1, 2, 3), (2, 2, 2), strides=[3], output_padding=[2]),
    convt("1d-output-padding-past-end-pad", (1, 1, 3), (1, 2, 3), strides=[3], pads=[0, 1], output_padding=[2]),
    convt("1d-dilation", (1, 2, 4), (2, 1, 2), dilations=[3], pads=[1, 1]),
    convt("1d-opset13", (1, 2, 3), (2, 2, 3), (2,), strides=[2], opset=13),
    # 2-D
    convt("2d", (1, 2, 3, 3), (2, 2, 3, 3), (2,)),
    convt("2d-stride2", (2, 2, 2, 3), (2, 3, 3, 3), (3,), strides=[2, 2]),
    convt("2d-stride2-asym-pads", (1, 2, 3, 3), (2, 2, 3, 2), strides=[2, 2], pads=[1, 0, 0, 1]),
    convt("2d-stride2-output-padding", (1, 2, 3, 2), (2, 2, 3, 3), (2,), strides=[2, 2], pads=[1, 1, 1, 1],
          output_padding=[1, 0]),
    convt("2d-dilation-stride", (1, 2, 3, 3), (2, 1, 2, 2), strides=[1, 2], dilations=[2, 1], pads=[0, 1, 1, 0]),
    convt("2d-kernel-shape", (1, 2, 2, 3), (2, 2, 2, 3), kernel_shape=[2, 3], strides=[2, 1]),
    convt("2d-same-upper", (1, 2, 3, 3), (2, 2, 3, 3), (2,), strides=[2, 2], auto_pad="SAME_UPPER"),
    convt("2d-same-lower", (1, 2, 3, 3), (2, 2, 3, 3), strides=[2, 2], auto_pad="SAME_LOWER"),
    convt("2d-same-upper-even-kernel", (1, 2, 3, 2), (2, 2, 4, 2), strides=[2, 1], auto_pad="SAME_UPPER"),
    convt("2d-same-lower-dilation", (1, 1, 3, 3), (1, 2, 2, 3), strides=[1, 2], dilations=[2, 1],
          auto_pad="SAME_LOWER"),
    convt("2d-valid", (1, 2, 3, 2), (2, 2, 2, 3), strides=[2, 2], auto_pad="VALID"),
    convt("2d-output-shape-same-upper", (1, 2, 3, 3), (2, 2, 4, 3), strides=[2, 2], output_shape=[7, 6],
          auto_pad="SAME_UPPER"),
    convt("2d-output-shape-same-lower", (1, 2, 3, 3), (2, 2, 4, 3), strides=[2, 2], output_shape=[7, 5],
          auto_pad="SAME_LOWER"),
    convt("2d-group2", (1, 4, 3, 3), (4, 1, 2, 2), (2,), group=2, strides=[2, 2]),
    convt("2d-group2-wide", (1, 4, 2, 3), (4, 2, 3, 2), (4,), group=2, pads=[1, 0, 0, 1], dilations=[1, 2]),
    convt("2d-depthwise", (2, 3, 3, 3), (3, 1, 3, 3), (3,), group=3, strides=[2, 2], pads=[1, 1, 1, 1]),
    convt("2d-depthwise-same-upper", (1, 3, 2, 3), (3, 1, 3, 3), group=3, strides=[2, 2], auto_pad="SAME_UPPER"),
    convt("2d-opset22", (1, 2, 3, 3), (2, 2, 2, 2), (2,), strides=[2, 2], opset=22),
    Case("ConvTranspose", [(1, 2, 3, 3), np.linspace(-1, 1, 36).reshape(2, 2, 3, 3)], {"strides": [2, 2]},
         id="ConvTranspose-2d-weights-frozen"),
    Case("ConvTranspose", [np.linspace(-1, 1, 18).reshape(1, 2, 3, 3), (2, 2, 2, 2), (2,)], {"strides": [2, 1]},
         id="ConvTranspose-2d-input-frozen"),
    # 16 or more output channels per group: the weight gradient as one GEMM per kernel offset
    convt("gemm-2d-stride2-output-padding", (1, 2, 3, 3), (2, 16, 3, 3), (16,), strides=[2, 2], pads=[1, 1, 1, 1],
          output_padding=[1, 1]),
    convt("gemm-2d-asym-pads", (1, 2, 3, 3), (2, 16, 3, 2), strides=[2, 2], pads=[1, 0, 0, 1]),
    convt("gemm-2d-group2-dilations", (1, 4, 2, 3), (4, 16, 3, 2), group=2, pads=[1, 0, 0, 1], dilations=[1, 2]),
    # 3-D
    convt("3d", (1, 2, 2, 3, 2), (2, 2, 2, 2, 2), (2,), strides=[2, 1, 2]),
    convt("3d-group2-pads", (1, 4, 2, 2, 2), (4, 1, 2, 2, 2), group=2, pads=[1, 0, 0, 0, 1, 1],
          output_padding=[0, 1, 0], strides=[1, 2, 1]),
]

CASES += [dataclasses.replace(c, id=f"{c.id}-ort", dtype=np.float32, tol=2e-3) for c in CASES]

# onnxruntime only (see the module docstring): output_shape without auto_pad, and with output_padding
CASES += [
    convt("2d-output-shape", (1, 2, 3, 3), (2, 2, 4, 3), (2,), strides=[2, 2], output_shape=[7, 6],
          dtype=np.float32),
    convt("1d-output-shape-odd-total", (1, 2, 3), (2, 1, 4), strides=[2], output_shape=[5], dtype=np.float32),
    convt("1d-output-shape-ignores-pads", (1, 2, 3), (2, 1, 4), strides=[2], output_shape=[6], pads=[0, 0],
          dtype=np.float32),
    convt("1d-output-shape-output-padding", (1, 2, 3), (2, 1, 4), strides=[2], output_shape=[8],
          output_padding=[1], dtype=np.float32),
    convt("1d-output-shape-valid", (1, 2, 3), (2, 1, 3), strides=[2], output_shape=[4], auto_pad="VALID",
          dtype=np.float32),
]

# a symbolic batch dim
CASES += [edited(convt("2d-symbolic-batch", (2, 2, 3, 3), (2, 2, 2, 2), (2,), strides=[2, 2]), symbolic({0: {0: "N"}})),
          edited(convt("2d-group2-symbolic-batch", (2, 4, 2, 2), (4, 2, 2, 2), group=2, strides=[2, 1]),
                 symbolic({0: {0: "N"}}))]
