"""LpNormalization and LRN cases.

onnxruntime has no float64 LRN, so its float64 checks run the onnx reference evaluator, whose LRN (onnx 1.23)
loops over the batch instead of the channels; `_lrn_by_the_spec` below replaces it for the test process. Every
LRN case also runs in float32, where the forward is onnxruntime's own. onnxruntime runs LRN with odd sizes on
4-D inputs only, so the cases keep to those (the rule refuses even sizes).
"""
import dataclasses

import numpy as np
from onnx.reference.ops import op_lrn

from cases.indexing import edited, symbolic
from gradcheck import Case


def _lrn_by_the_spec(self, x, alpha=None, beta=None, bias=None, size=None):
    """square_sum over channels c - floor((size-1)/2) .. c + ceil((size-1)/2), clipped to the channels."""
    below = (size - 1) // 2
    above = size - 1 - below
    channels = x.shape[1]
    squares = x.astype(np.float64) ** 2
    square_sum = np.stack([squares[:, max(0, c - below):min(channels, c + above + 1)].sum(axis=1)
                           for c in range(channels)], axis=1)
    return ((x / (bias + alpha / size * square_sum) ** beta).astype(x.dtype),)


_lrn_by_the_spec.spec_fix = True
if not getattr(op_lrn.LRN._run, "spec_fix", False):
    op_lrn.LRN._run = _lrn_by_the_spec

CASES = [
    # LpNormalization: p = 1 and 2 over each axis, negative axes, both opset forms of the norm's Reduce
    Case("LpNormalization", [(2, 3)], id="LpNorm-default"),
    Case("LpNormalization", [(2, 3)], {"p": 1}, id="LpNorm-p1"),
    Case("LpNormalization", [(3, 2, 2)], {"axis": 0, "p": 2}, id="LpNorm-p2-axis0"),
    Case("LpNormalization", [(2, 3, 2)], {"axis": 1, "p": 1}, id="LpNorm-p1-axis1"),
    Case("LpNormalization", [(2, 3, 2)], {"axis": -2, "p": 2}, id="LpNorm-p2-neg-axis"),
    Case("LpNormalization", [(2, 4)], {"axis": -1, "p": 1}, id="LpNorm-p1-opset13", opset=13),
    Case("LpNormalization", [(2, 4)], {"axis": 0, "p": 2}, id="LpNorm-p2-opset13", opset=13),
    Case("LpNormalization", [(1, 3, 2)], {"axis": 1}, id="LpNorm-opset22", opset=22),

    # LRN: every attribute, windows narrower and wider than the channels
    Case("LRN", [(1, 4, 2, 2)], {"size": 3}, id="LRN-size3-defaults"),
    Case("LRN", [(2, 5, 2, 1)], {"size": 3, "alpha": 0.5, "beta": 0.6, "bias": 1.5}, id="LRN-size3"),
    Case("LRN", [(1, 6, 1, 2)], {"size": 5, "alpha": 0.3, "beta": 1.2, "bias": 0.8}, id="LRN-size5"),
    Case("LRN", [(1, 3, 2, 2)], {"size": 7, "alpha": 0.9, "beta": 0.75, "bias": 2.0}, id="LRN-wider-than-C"),
    Case("LRN", [(1, 3, 2, 2)], {"size": 1, "alpha": 0.4}, id="LRN-size1"),
    Case("LRN", [(1, 4, 2, 2)], {"size": 3, "alpha": 0.2, "beta": 0.5}, id="LRN-opset13", opset=13),
]
CASES += [dataclasses.replace(c, id=f"{c.id}-ort", dtype=np.float32, tol=2e-3) for c in CASES if c.op == "LRN"]
CASES += [edited(Case("LpNormalization", [(2, 3, 2)], {"axis": 1, "p": 1}, id="LpNorm-symbolic"),
                 symbolic({0: {0: "N", 1: "C", 2: "L"}})),
          edited(Case("LRN", [(2, 4, 2, 1)], {"size": 3, "alpha": 0.3}, id="LRN-symbolic"),
                 symbolic({0: {0: "N", 2: "H", 3: "W"}}))]
