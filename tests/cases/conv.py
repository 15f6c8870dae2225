"""Convolution and pooling cases: 1-D, 2-D, 3-D; strides, dilations, asymmetric and automatic pads, groups.

onnxruntime has no float64 Conv, ConvTranspose or AveragePool kernels, so the float64 checks of these cases run
in the onnx reference evaluator. Its ConvTranspose (onnx 1.23) mishandles groups with more than one channel per
group, which Conv's input gradient needs; `_reference_grouped_conv_transpose` below corrects it for the test
process by running each group on its own. Its AveragePool with ceil_mode also misplaces windows when a begin pad
meets a stride that does not divide the padded size, and its GlobalMaxPool returns the wrong rank for 1-D and
3-D inputs (onnxruntime is right in both): those forms are checked in float32, where onnxruntime runs them.
"""
import numpy as np
from onnx.reference.ops import op_conv_transpose

from gradcheck import Case, distinct


def _reference_grouped_conv_transpose(original):
    def run(self, X, W, B=None, group=None, **attrs):
        if not group or group == 1:
            return original(self, X, W, B, group=group, **attrs)
        biases = np.split(B, group) if B is not None else [None] * group
        parts = [original(self, x, w, b, group=1, **attrs)[0]
                 for x, w, b in zip(np.split(X, group, axis=1), np.split(W, group, axis=0), biases)]
        return (np.concatenate(parts, axis=1),)
    run.grouped_fix = True
    return run


if not getattr(op_conv_transpose.ConvTranspose._run, "grouped_fix", False):
    op_conv_transpose.ConvTranspose._run = _reference_grouped_conv_transpose(op_conv_transpose.ConvTranspose._run)


def conv(id, x, w, b=None, **attrs):
    opset = attrs.pop("opset", 18)
    return Case("Conv", [x, w] + ([b] if b is not None else []), attrs, id=f"Conv-{id}", opset=opset)


def pool(op, id, x, sampler=None, opset=18, **attrs):
    extra = {"sampler": sampler} if sampler else {}
    return Case(op, [x], attrs, id=f"{op}-{id}", opset=opset, **extra)


CASES = [
    # Conv 1-D (small enough for the full Jacobian)
    conv("1d", (1, 2, 7), (3, 2, 3), (3,)),
    conv("1d-stride2-dil2-asym-pads", (1, 2, 7), (2, 2, 2), (2,), strides=[2], dilations=[2], pads=[1, 2]),
    conv("1d-stride3-remainder", (2, 2, 8), (2, 2, 2), strides=[3]),
    conv("1d-opset13", (1, 2, 6), (2, 2, 3), (2,), pads=[1, 1], opset=13),
    # Conv 2-D
    conv("2d", (2, 2, 5, 5), (3, 2, 3, 3), (3,)),
    conv("2d-no-bias-1x1", (2, 3, 4, 4), (2, 3, 1, 1)),
    conv("2d-stride2-asym-pads", (2, 2, 5, 6), (3, 2, 3, 3), (3,), strides=[2, 2], pads=[1, 0, 0, 1]),
    conv("2d-stride2-even-output-padding", (1, 2, 6, 6), (2, 2, 3, 3), strides=[2, 2]),
    conv("2d-stride2-pad-covers-remainder", (1, 2, 6, 6), (2, 2, 3, 3), strides=[2, 2], pads=[0, 0, 2, 1]),
    conv("2d-dilations-stride", (1, 2, 7, 6), (2, 2, 2, 3), (2,), strides=[2, 1], dilations=[2, 2],
         pads=[1, 2, 0, 1]),
    conv("2d-rect-kernel", (2, 2, 5, 6), (2, 2, 2, 3), strides=[1, 2], kernel_shape=[2, 3]),
    conv("2d-same-upper-stride2-odd", (1, 2, 5, 7), (2, 2, 3, 3), (2,), strides=[2, 2], auto_pad="SAME_UPPER"),
    conv("2d-same-upper-even-kernel", (1, 2, 5, 7), (2, 2, 2, 4), strides=[2, 2], auto_pad="SAME_UPPER"),
    conv("2d-same-lower-stride2-odd", (1, 2, 5, 7), (2, 2, 3, 2), (2,), strides=[2, 2], auto_pad="SAME_LOWER"),
    conv("2d-same-lower-stride1", (1, 2, 5, 5), (2, 2, 2, 2), auto_pad="SAME_LOWER"),
    conv("2d-valid-stride2", (1, 2, 7, 6), (2, 2, 3, 3), strides=[2, 2], auto_pad="VALID"),
    conv("2d-group2", (2, 4, 5, 5), (6, 2, 3, 3), (6,), group=2),
    conv("2d-group2-stride-dil-pads", (1, 4, 7, 6), (4, 2, 2, 3), strides=[2, 1], dilations=[1, 2],
         pads=[0, 1, 1, 0], group=2),
    conv("2d-depthwise", (2, 3, 5, 5), (3, 1, 3, 3), (3,), group=3, pads=[1, 1, 1, 1]),
    conv("2d-depthwise-multiplier2", (1, 3, 5, 6), (6, 1, 3, 3), group=3, strides=[2, 2]),
    conv("2d-depthwise-same-upper", (1, 4, 5, 5), (4, 1, 3, 3), group=4, strides=[2, 2], auto_pad="SAME_UPPER"),
    conv("2d-opset22", (1, 2, 5, 5), (2, 2, 3, 3), (2,), pads=[1, 1, 1, 1], opset=22),
    Case("Conv", [(1, 2, 5, 5), np.linspace(-1, 1, 36).reshape(2, 2, 3, 3)], {"strides": [2, 2]},
         id="Conv-2d-weights-frozen"),
    Case("Conv", [np.linspace(-1, 1, 50).reshape(1, 2, 5, 5), (2, 2, 3, 3), (2,)], {"pads": [1, 0, 0, 1]},
         id="Conv-2d-input-frozen"),
    # Conv 3-D
    conv("3d", (1, 2, 4, 5, 3), (2, 2, 2, 3, 2), (2,)),
    conv("3d-stride-pads", (1, 2, 5, 4, 4), (2, 2, 3, 2, 2), strides=[2, 1, 2], pads=[1, 0, 0, 0, 1, 1]),
    conv("3d-group2-dil", (1, 4, 5, 4, 4), (2, 2, 2, 2, 2), (2,), group=2, dilations=[2, 1, 1]),

    # Conv, 16 or more input channels per group: the weight gradient as one GEMM per kernel offset
    conv("gemm-2d-pad1", (2, 16, 4, 4), (3, 16, 3, 3), (3,), pads=[1, 1, 1, 1]),
    conv("gemm-2d-stride2-asym-pads", (1, 16, 5, 6), (2, 16, 3, 3), strides=[2, 2], pads=[1, 0, 0, 1]),
    conv("gemm-2d-dilations-stride", (1, 16, 7, 6), (2, 16, 2, 3), strides=[2, 1], dilations=[2, 2],
         pads=[1, 2, 0, 1]),
    conv("gemm-2d-same-upper-stride2", (1, 16, 5, 7), (2, 16, 3, 3), strides=[2, 2], auto_pad="SAME_UPPER"),
    conv("gemm-2d-1x1-stride2", (2, 16, 5, 5), (4, 16, 1, 1), (4,), strides=[2, 2]),
    conv("gemm-2d-pads-past-the-kernel", (1, 16, 4, 4), (2, 16, 3, 3), pads=[3, 0, 0, 3]),
    conv("gemm-1d-stride3", (2, 16, 8), (2, 16, 2), strides=[3]),
    conv("gemm-3d", (1, 16, 3, 4, 3), (2, 16, 2, 2, 2), pads=[1, 0, 1, 0, 1, 0]),
    conv("gemm-2d-group2", (1, 32, 4, 4), (4, 16, 3, 3), group=2, pads=[1, 1, 1, 1]),
    conv("gemm-2d-group2-stride2", (1, 32, 5, 5), (4, 16, 3, 3), (4,), group=2, strides=[2, 2], pads=[1, 1, 1, 1]),
    # depthwise with stride 1: the weight gradient as a product summed per kernel offset
    conv("2d-depthwise-dilations", (1, 3, 6, 6), (3, 1, 3, 3), group=3, dilations=[2, 2], pads=[2, 2, 2, 2]),
    conv("2d-depthwise-multiplier2-asym-pads", (1, 4, 5, 5), (8, 1, 3, 3), (8,), group=4, pads=[1, 0, 0, 1]),

    # MaxPool: opset 18 scatters with reduction="add", opset 13 in non-overlapping phases
    pool("MaxPool", "2d-k2s2", (2, 2, 4, 5), distinct, kernel_shape=[2, 2], strides=[2, 2]),
    pool("MaxPool", "2d-k2s2-opset13", (2, 2, 4, 5), distinct, opset=13, kernel_shape=[2, 2], strides=[2, 2]),
    pool("MaxPool", "2d-k3s2-pads", (2, 2, 5, 6), distinct, kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 1, 1, 1]),
    pool("MaxPool", "2d-k3s2-pads-opset13", (2, 2, 5, 6), distinct, opset=13, kernel_shape=[3, 3],
         strides=[2, 2], pads=[1, 1, 1, 1]),
    pool("MaxPool", "2d-k3s1-opset15", (1, 2, 5, 5), distinct, opset=15, kernel_shape=[3, 2]),
    pool("MaxPool", "2d-stride1-overlap", (1, 2, 5, 5), distinct, kernel_shape=[2, 2]),
    pool("MaxPool", "2d-ceil-mode", (2, 2, 5, 6), distinct, kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
    pool("MaxPool", "2d-ceil-mode-opset13", (1, 2, 5, 7), distinct, opset=13, kernel_shape=[3, 3],
         strides=[2, 2], ceil_mode=1),
    pool("MaxPool", "2d-dilations", (1, 2, 6, 6), distinct, kernel_shape=[2, 2], dilations=[2, 2],
         strides=[1, 2]),
    pool("MaxPool", "2d-dilations-opset13", (1, 2, 6, 6), distinct, opset=13, kernel_shape=[2, 2],
         dilations=[2, 2], strides=[1, 2]),
    pool("MaxPool", "2d-asym-pads", (1, 2, 5, 5), distinct, kernel_shape=[3, 3], strides=[2, 2],
         pads=[0, 1, 2, 0]),
    pool("MaxPool", "2d-same-upper", (1, 2, 5, 7), distinct, kernel_shape=[3, 3], strides=[2, 2],
         auto_pad="SAME_UPPER"),
    pool("MaxPool", "2d-storage-order1", (1, 2, 4, 5), distinct, kernel_shape=[2, 2], storage_order=1),
    pool("MaxPool", "1d", (2, 2, 7), distinct, kernel_shape=[3], strides=[2], pads=[1, 0]),
    pool("MaxPool", "1d-opset13", (2, 2, 7), distinct, opset=13, kernel_shape=[3], strides=[1]),
    pool("MaxPool", "3d", (1, 2, 4, 5, 4), distinct, kernel_shape=[2, 3, 2], strides=[2, 2, 1]),
    # windows that tile x (kernel = strides, no padding)
    pool("MaxPool", "2d-k2s2-even", (2, 3, 4, 6), distinct, kernel_shape=[2, 2], strides=[2, 2]),
    pool("MaxPool", "2d-k3s3-crop", (1, 2, 7, 6), distinct, kernel_shape=[3, 3], strides=[3, 3]),
    pool("MaxPool", "2d-k2s2-valid", (1, 2, 5, 4), distinct, kernel_shape=[2, 2], strides=[2, 2], auto_pad="VALID"),
    pool("MaxPool", "1d-k2s2", (2, 2, 7), distinct, kernel_shape=[2], strides=[2]),
    pool("MaxPool", "3d-k2s2", (1, 2, 4, 4, 3), distinct, kernel_shape=[2, 2, 1], strides=[2, 2, 1]),

    # AveragePool
    pool("AveragePool", "1d", (2, 2, 7), kernel_shape=[3], strides=[2]),
    pool("AveragePool", "1d-pads-exclude", (2, 2, 7), kernel_shape=[3], strides=[2], pads=[1, 2]),
    pool("AveragePool", "1d-pads-include", (2, 2, 7), kernel_shape=[3], strides=[2], pads=[1, 2],
         count_include_pad=1),
    pool("AveragePool", "1d-ceil", (2, 2, 6), kernel_shape=[3], strides=[2], ceil_mode=1),
    pool("AveragePool", "1d-ceil-include", (2, 2, 6), kernel_shape=[3], strides=[2], pads=[0, 1], ceil_mode=1,
         count_include_pad=1),
    pool("AveragePool", "2d-k2s2", (2, 2, 4, 6), kernel_shape=[2, 2], strides=[2, 2]),
    pool("AveragePool", "2d-k3s1-remainder", (2, 2, 5, 6), kernel_shape=[3, 2], strides=[2, 3]),
    pool("AveragePool", "2d-pads-exclude", (2, 2, 5, 5), kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 0, 0, 1]),
    pool("AveragePool", "2d-pads-include", (2, 2, 5, 5), kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 0, 0, 1], count_include_pad=1),
    pool("AveragePool", "2d-ceil-exclude", (1, 2, 5, 7), kernel_shape=[2, 3], strides=[2, 2], ceil_mode=1),
    pool("AveragePool", "2d-ceil-include-pads", (1, 2, 5, 6), kernel_shape=[3, 3], strides=[2, 2],
         pads=[1, 1, 1, 1], ceil_mode=1, count_include_pad=1),
    pool("AveragePool", "2d-same-upper", (1, 2, 5, 7), kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    pool("AveragePool", "2d-same-lower-include", (1, 2, 5, 7), kernel_shape=[2, 2], strides=[2, 2],
         auto_pad="SAME_LOWER", count_include_pad=1),
    pool("AveragePool", "2d-opset13", (2, 2, 5, 5), opset=13, kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    pool("AveragePool", "2d-dilations-opset19", (1, 2, 6, 6), opset=19, kernel_shape=[2, 2], dilations=[2, 2],
         pads=[1, 0, 0, 1], strides=[2, 1]),
    pool("AveragePool", "3d", (1, 2, 4, 5, 3), kernel_shape=[2, 2, 2], strides=[2, 2, 1]),

    # Global pools
    pool("GlobalAveragePool", "1d", (2, 3, 5)),
    pool("GlobalAveragePool", "2d", (2, 3, 4, 5)),
    pool("GlobalAveragePool", "3d", (1, 2, 3, 2, 4)),
    pool("GlobalMaxPool", "2d", (2, 3, 4, 5), distinct),
    pool("GlobalMaxPool", "2d-pair-ties", (2, 2, 1, 2), lambda rng, s: np.ones(s)),
]

# Right by a direct check in onnxruntime, but beyond tests/gradcheck.py as it stands (see the module docstring).
CASES += [
    pool("MaxPool", "2d-same-lower", (1, 2, 5, 7), distinct, kernel_shape=[2, 2], strides=[2, 2],
         auto_pad="SAME_LOWER"),
    # onnxruntime has no float64 kernel for these and the reference evaluator gets them wrong: float32
    Case("GlobalMaxPool", [(2, 3, 5)], id="GlobalMaxPool-1d", sampler=distinct, dtype=np.float32, tol=2e-3),
    Case("GlobalMaxPool", [(1, 2, 3, 2, 4)], id="GlobalMaxPool-3d", sampler=distinct, dtype=np.float32, tol=2e-3),
    Case("AveragePool", [(2, 2, 6)], dict(kernel_shape=[3], strides=[3], pads=[1, 0], ceil_mode=1,
         count_include_pad=1), id="AveragePool-1d-ceil-begin-pad-stride3", dtype=np.float32, tol=2e-3),
    Case("MaxPool", [(2, 2, 5, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         output_names=["out0", "indices"], sampler=distinct, id="MaxPool-indices-output"),
    Case("MaxPool", [(2, 2, 5, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
         output_names=["out0", "indices"], sampler=distinct, opset=13, id="MaxPool-indices-output-opset13"),
    Case("MaxPool", [(1, 2, 4, 5)], {"kernel_shape": [2, 2], "storage_order": 1},
         output_names=["out0", "indices"], sampler=distinct, id="MaxPool-indices-output-storage-order1"),
]

# checked against the onnx reference evaluator by tests/test_opset23.py
REFERENCE_CASES = [
    # CausalConvWithState (opset 27, float32 only): a Mamba / Gated DeltaNet causal depthwise conv with a carried
    # state (which the schema makes non-differentiable)
    Case("CausalConvWithState", [(2, 3, 4), (3, 1, 3), (3,), np.linspace(-1, 1, 12).reshape(2, 3, 2)], outputs=2,
         output_names=["out0", "present"], id="CausalConv-past-present", opset=27, dtype=np.float32, tol=2e-3),
    Case("CausalConvWithState", [(1, 2, 5), (2, 1, 4)], outputs=2, output_names=["out0", "present"],
         id="CausalConv-no-state", opset=27, dtype=np.float32, tol=2e-3),
    Case("CausalConvWithState", [(2, 2, 3), (2, 1, 2), (2,)], {"activation": "silu"}, outputs=2,
         output_names=["out0", "present"], id="CausalConv-silu", opset=27, dtype=np.float32, tol=2e-3),
]
