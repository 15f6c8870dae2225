import numpy as np

from gradcheck import Case


def i64(*values):
    return np.array(values, dtype=np.int64)


CASES = [
    # Transpose
    Case("Transpose", [(2, 3, 4)], {"perm": [1, 0, 2]}, id="Transpose-perm"),
    Case("Transpose", [(2, 3, 4)], {"perm": [2, 0, 1]}, id="Transpose-rotate"),
    Case("Transpose", [(2, 3, 4)], id="Transpose-default-reversed"),
    Case("Transpose", [(2, 3, 4)], {"perm": [1, 2, 0]}, opset=13, id="Transpose-opset13"),

    # Reshape
    Case("Reshape", [(2, 3, 4), i64(4, -1)], id="Reshape-minus1"),
    Case("Reshape", [(2, 3, 4), i64(0, -1)], id="Reshape-zero-copies-dim"),
    Case("Reshape", [(2, 3, 4), i64(0, 4, 3)], id="Reshape-zero-and-static"),
    Case("Reshape", [(2, 3, 4), i64(-1)], id="Reshape-to-1d"),
    Case("Reshape", [(2, 3, 4), i64(3, 8)], {"allowzero": 1}, id="Reshape-allowzero"),
    Case("Reshape", [(2, 0, 3), i64(3, 0)], {"allowzero": 1}, id="Reshape-allowzero-empty"),
    Case("Reshape", [(2, 3, 4), i64(0, -1)], opset=13, id="Reshape-opset13"),

    # Flatten
    Case("Flatten", [(2, 3, 4)], id="Flatten-default"),
    Case("Flatten", [(2, 3, 4)], {"axis": 0}, id="Flatten-axis0"),
    Case("Flatten", [(2, 3, 4)], {"axis": 2}, id="Flatten-axis2"),
    Case("Flatten", [(2, 3, 4)], {"axis": -1}, id="Flatten-negative-axis"),
    Case("Flatten", [(2, 3, 4)], {"axis": 3}, id="Flatten-axis-rank"),
    Case("Flatten", [(2, 3, 4)], {"axis": -2}, opset=13, id="Flatten-opset13"),

    # Squeeze / Unsqueeze: axes as an input since opset 13
    Case("Squeeze", [(2, 1, 3), i64(1)], id="Squeeze-axis"),
    Case("Squeeze", [(2, 3, 1), i64(-1)], id="Squeeze-negative-axis"),
    Case("Squeeze", [(1, 3, 1, 2), i64(0, -2)], id="Squeeze-two-axes"),
    Case("Squeeze", [(1, 3, 1, 2)], id="Squeeze-no-axes"),
    Case("Squeeze", [(2, 1, 3), i64(1)], opset=13, id="Squeeze-opset13"),
    Case("Squeeze", [(1, 3, 1)], opset=13, id="Squeeze-no-axes-opset13"),
    Case("Unsqueeze", [(2, 3), i64(0)], id="Unsqueeze-front"),
    Case("Unsqueeze", [(2, 3), i64(-1)], id="Unsqueeze-negative-axis"),
    Case("Unsqueeze", [(2, 3), i64(1, 3)], id="Unsqueeze-two-axes"),
    Case("Unsqueeze", [(2, 3), i64(-4, 2)], opset=13, id="Unsqueeze-opset13"),

    # Expand: the gradient is summed down to the input's shape
    Case("Expand", [(3, 1), i64(2, 1, 4)], id="Expand-lead-and-inner"),
    Case("Expand", [(2, 1), i64(1, 3)], id="Expand-both-ways"),
    Case("Expand", [(2, 3), i64(3)], id="Expand-no-op-shape"),
    Case("Expand", [(2, 3), i64(2, 1, 1)], id="Expand-lead-only"),
    Case("Expand", [(), i64(2, 3)], id="Expand-scalar"),
    Case("Expand", [(1, 3), i64(4, 1)], opset=13, id="Expand-opset13"),

    # Concat
    Case("Concat", [(2, 3), (2, 2), (2, 1)], {"axis": 1}, id="Concat-three"),
    Case("Concat", [(2, 3), (1, 3)], {"axis": 0}, id="Concat-axis0"),
    Case("Concat", [(2, 3, 1), (2, 3, 2)], {"axis": -1}, id="Concat-negative-axis"),
    Case("Concat", [(2, 3), np.ones((2, 2)), (2, 1)], {"axis": 1}, id="Concat-some-differentiated"),
    Case("Concat", [np.ones((1, 3)), (2, 3), np.ones((2, 3))], {"axis": -2}, id="Concat-middle-only"),
    Case("Concat", [(2, 2), (2, 3)], {"axis": 1}, opset=13, id="Concat-opset13"),
    Case("Concat", [(3,)], {"axis": 0}, id="Concat-one-input"),

    # Split, opset 13-17: optional `split` input, else equal parts
    Case("Split", [(2, 6)], {"axis": 1}, outputs=3, opset=13, id="Split13-equal"),
    Case("Split", [(2, 4), i64(1, 3)], {"axis": 1}, outputs=2, opset=13, id="Split13-split-input"),
    Case("Split", [(4, 2), i64(1, 2, 1)], {"axis": -2}, outputs=3, opset=17, id="Split17-negative-axis"),
    Case("Split", [(2, 4), i64(1, 1, 2)], {"axis": 1}, outputs=3, opset=21, id="Split21-split-input"),
    # (gradients reaching only some outputs: tests/test_shape_symbolic.py, as a case cannot leave outputs out)
    # Split, opset 18+: `split` input or `num_outputs` (the last chunk may be smaller)
    Case("Split", [(2, 4), i64(3, 1)], {"axis": 1}, outputs=2, id="Split18-split-input"),
    Case("Split", [(7, 2)], {"num_outputs": 3}, outputs=3, id="Split18-num-outputs-uneven"),
    Case("Split", [(2, 6)], {"axis": -1, "num_outputs": 2}, outputs=2, id="Split18-num-outputs-negative-axis"),

    # Slice: starts, ends, optional axes and steps as inputs
    Case("Slice", [(4, 5), i64(1, 0), i64(3, 4)], id="Slice-no-axes-no-steps"),
    Case("Slice", [(4, 5), i64(1), i64(3), i64(1)], id="Slice-one-axis"),
    Case("Slice", [(4, 5), i64(-3), i64(-1), i64(-1)], id="Slice-negative-starts-ends-axes"),
    Case("Slice", [(4, 5), i64(-100, 2), i64(100, 1000), i64(0, 1)], id="Slice-out-of-range-clamped"),
    Case("Slice", [(4, 5), i64(0, 1), i64(4, 5), i64(0, 1), i64(2, 3)], id="Slice-steps-gt1"),
    Case("Slice", [(4, 5), i64(-1), i64(-100), i64(1), i64(-1)], id="Slice-reverse"),
    Case("Slice", [(4, 5), i64(3, 4), i64(0, -1000), i64(0, 1), i64(-1, -2)], id="Slice-negative-steps"),
    Case("Slice", [(6, 3), i64(10), i64(-10), i64(0), i64(-2)], id="Slice-negative-step-clamped"),
    Case("Slice", [(4, 5), i64(2), i64(3), i64(-2), i64(7)], id="Slice-step-past-end"),
    Case("Slice", [(2, 3, 4), i64(1, 0), i64(3, 2), i64(-1, 0), i64(1, 1)], id="Slice-unordered-axes"),
    Case("Slice", [(4, 5), i64(0), i64(100), i64(1)], id="Slice-everything"),
    Case("Slice", [(4, 5), i64(1), i64(3), None, i64(1)], id="Slice-omitted-axes-with-steps"),
    Case("Slice", [(4, 5), np.array([1], np.int32), np.array([-1], np.int32)], id="Slice-int32"),
    Case("Slice", [(4, 5), i64(3, 0), i64(0, 5), i64(0, 1), i64(-2, 2)], opset=13, id="Slice-opset13"),

    # Gather: axis, negative axis, scalar and tensor indices, negative and repeated indices
    Case("Gather", [(4, 3), i64(2, 0)], id="Gather-axis0"),
    Case("Gather", [(4, 3), i64(2, 0, 2, 2)], id="Gather-repeated"),
    Case("Gather", [(4, 3), i64(2, 0, 2, 2)], opset=16, id="Gather-repeated-opset16"),
    Case("Gather", [(4, 3), i64(2, 0, 2, 2)], opset=13, id="Gather-repeated-opset13"),
    Case("Gather", [(4, 3), i64(-1, 0, 3)], opset=13, id="Gather-negative-unique-opset13"),
    Case("Gather", [(2, 4, 3), np.array([[1, -3], [3, 3]], np.int64)], {"axis": 1}, id="Gather-axis1-2d-indices"),
    Case("Gather", [(2, 4, 3), np.array([[1, -3], [3, 3]], np.int64)], {"axis": 1}, opset=15,
         id="Gather-axis1-2d-indices-opset15"),
    Case("Gather", [(2, 3, 4), i64(-1, 1, 3, -1)], {"axis": -1}, id="Gather-negative-axis"),
    Case("Gather", [(2, 3, 4), i64(-1, 1, 3, -1)], {"axis": -1}, opset=13, id="Gather-negative-axis-opset13"),
    Case("Gather", [(4, 3), np.array(-2, np.int64)], id="Gather-scalar-index"),
    # tables above builder.ONE_HOT_MAX_ROWS rows add their gradient with ScatterElements
    Case("Gather", [(600, 3), np.array([[599, 0, 599], [7, 599, -1]], np.int64)], id="Gather-large-table-repeated"),
    Case("Gather", [(2, 600, 3), i64(-1, 5, 599, 5)], {"axis": 1}, id="Gather-large-table-axis1"),
    Case("Gather", [(3, 4), np.array(1, np.int64)], {"axis": 1}, opset=13, id="Gather-scalar-index-axis1-opset13"),
    Case("Gather", [(5,), np.array(3, np.int64)], opset=13, id="Gather-scalar-from-vector-opset13"),
    Case("Gather", [(5,), np.array(3, np.int64)], id="Gather-scalar-from-vector"),
    Case("Gather", [(4, 3), np.array([1, 1, -3], np.int32)], id="Gather-int32-indices"),

    # Pad: constant / edge / reflect, pads input, axes input (opset 18+). Negative pads (cropping) are tested in
    # tests/test_shape_symbolic.py: the checker's float64 forward runs in the onnx reference evaluator, which
    # refuses them.
    Case("Pad", [(2, 3), i64(1, 0, 0, 2)], id="Pad-constant"),
    Case("Pad", [(2, 3), i64(1, 0, 0, 2), np.array(0.5)], id="Pad-constant-value-fixed"),
    Case("Pad", [(2, 3), i64(1, 2, 2, 1)], {"mode": "edge"}, id="Pad-edge"),
    Case("Pad", [(1, 3), i64(2, 0, 1, 0)], {"mode": "edge"}, id="Pad-edge-size1"),
    Case("Pad", [(3, 4), i64(2, 1, 1, 3)], {"mode": "reflect"}, id="Pad-reflect"),
    Case("Pad", [(2, 3), i64(0, 1, 0, 2), np.array(2.0)], {"mode": "edge"}, id="Pad-edge-value-unused"),
    Case("Pad", [(2, 3, 4), i64(1, 2), None, i64(-1)], id="Pad-axes-negative"),
    Case("Pad", [(2, 3, 4), i64(1, 0, 2, 1), None, i64(2, 0)], {"mode": "reflect"}, id="Pad-axes-reflect"),
    Case("Pad", [(2, 3, 4), i64(1, 0, 0, 2), np.array(0.5), i64(0, -1)], {"mode": "edge"}, id="Pad-axes-edge"),
    Case("Pad", [(2, 3, 4), i64(2, 1), np.array(-1.0), i64(1)], opset=21, id="Pad-axes-constant-value-opset21"),
    Case("Pad", [(2, 3), i64(0, 1, 1, 0), np.array(3.0)], opset=13, id="Pad-constant-opset13"),
    Case("Pad", [(3, 3), i64(1, 1, 0, 2)], {"mode": "edge"}, opset=13, id="Pad-edge-opset13"),
    Case("Pad", [(3, 3), i64(2, 0, 0, 2)], {"mode": "reflect"}, opset=13, id="Pad-reflect-opset13"),

    # Tile: the gradient sums the tiles
    Case("Tile", [(2, 3), i64(2, 2)], id="Tile-2d"),
    Case("Tile", [(1, 2, 3), i64(2, 1, 3)], id="Tile-3d"),
    Case("Tile", [(3,), i64(1)], id="Tile-once"),
    Case("Tile", [(2, 2), i64(3, 1)], opset=13, id="Tile-opset13"),

    # Trilu (opset 14+): upper/lower, optional k
    Case("Trilu", [(3, 4)], id="Trilu-upper"),
    Case("Trilu", [(3, 4)], {"upper": 0}, id="Trilu-lower"),
    Case("Trilu", [(3, 4), np.array(1, np.int64)], id="Trilu-upper-k1"),
    Case("Trilu", [(2, 3, 3), np.array(-1, np.int64)], {"upper": 0}, id="Trilu-lower-k-neg-batched"),
    Case("Trilu", [(4, 3), np.array(-1, np.int64)], opset=14, id="Trilu-opset14"),
]
