"""Normalization and dropout cases.

The checker makes every named output a head, so the LayerNormalization cases with Mean and InvStdDev outputs
(in PENDING below) check the gradient flowing back through those outputs too. A Dropout mask output cannot be
named in a case: it is boolean, and the checker would make it a head of the loss.
"""
import numpy as np

from gradcheck import Case

LN3 = ["out0", "mean", "inv_std"]

CASES = [
    # LayerNormalization (opset 17+)
    Case("LayerNormalization", [(2, 5), (5,), (5,)], id="LayerNorm-last-axis", opset=17),
    Case("LayerNormalization", [(2, 3, 4), (4,), (4,)], {"axis": -1, "epsilon": 1e-3}, id="LayerNorm-3d-eps"),
    Case("LayerNormalization", [(2, 3, 4), (3, 4), (3, 4)], {"axis": 1}, id="LayerNorm-axis1"),
    Case("LayerNormalization", [(2, 3, 4), (3, 4)], {"axis": -2}, id="LayerNorm-neg-axis-no-bias"),
    Case("LayerNormalization", [(2, 2, 3), (2, 2, 3), (2, 2, 3)], {"axis": 0}, id="LayerNorm-axis0"),
    Case("LayerNormalization", [(2, 5), np.linspace(0.5, 1.5, 5), np.zeros(5)], id="LayerNorm-frozen-params"),
    Case("LayerNormalization", [(2, 4), (4,), (4,)], id="LayerNorm-opset23", opset=23),

    # BatchNormalization, inference form
    Case("BatchNormalization", [(2, 3, 4), (3,), (3,), np.array([0.1, -0.2, 0.3]), np.array([0.5, 1.0, 2.0])],
         {"epsilon": 1e-3}, id="BatchNorm-1d"),
    Case("BatchNormalization", [(2, 3, 2, 3), (3,), (3,), np.array([0.1, -0.2, 0.3]), np.array([0.5, 1.0, 2.0])],
         id="BatchNorm-2d"),
    Case("BatchNormalization", [(2, 3), (3,), (3,), np.array([0.1, -0.2, 0.3]), np.array([0.5, 1.0, 2.0])],
         id="BatchNorm-rank2"),
    Case("BatchNormalization", [(2, 2, 2, 2, 2), (2,), (2,), np.array([0.1, -0.2]), np.array([0.5, 2.0])],
         {"training_mode": 0}, id="BatchNorm-3d-opset14", opset=14),
    Case("BatchNormalization", [(2, 3, 4), np.array([1.0, 2.0, 0.5]), np.array([0.0, 1.0, -1.0]),
                                np.array([0.1, -0.2, 0.3]), np.array([0.5, 1.0, 2.0])], id="BatchNorm-x-only",
         opset=15),

    # Dropout, inference form (no training_mode, or a constant false one)
    Case("Dropout", [(2, 3)], id="Dropout-plain"),
    Case("Dropout", [(2, 3), np.array(0.3)], id="Dropout-ratio", opset=13),
    Case("Dropout", [(2, 3), np.array(0.3), np.array(False)], id="Dropout-training-false"),
    Case("Dropout", [(2, 3), None, np.array(False)], id="Dropout-no-ratio-training-false", opset=22),

    # InstanceNormalization
    Case("InstanceNormalization", [(2, 3, 4), (3,), (3,)], id="InstanceNorm-1d"),
    Case("InstanceNormalization", [(2, 2, 2, 3), (2,), (2,)], {"epsilon": 1e-3}, id="InstanceNorm-2d"),
    Case("InstanceNormalization", [(1, 2, 2, 2, 2), (2,), (2,)], id="InstanceNorm-3d", opset=13),
]

# Forms checked in float32:
# - LayerNormalization's Mean and InvStdDev are computed in float32 (stash_type=1), and onnxruntime has no
#   float64 GroupNormalization: both are checked in float32 with a looser tolerance.
CASES += [
    Case("LayerNormalization", [(2, 4), (4,), (4,)], outputs=3, output_names=LN3, id="LayerNorm-mean-invstd",
         opset=17, dtype=np.float32, tol=2e-3),
    Case("LayerNormalization", [(2, 2, 3), (3,)], {"axis": -1}, outputs=3, dtype=np.float32, tol=2e-3, output_names=LN3,
         id="LayerNorm-mean-invstd-no-bias"),
    Case("LayerNormalization", [(2, 2, 3), (2, 3), (2, 3)], {"axis": 1}, outputs=2, dtype=np.float32, tol=2e-3, output_names=["out0", "mean"],
         id="LayerNorm-mean-only"),
    Case("LayerNormalization", [(2, 2, 3), (2, 3), (2, 3)], {"axis": 1}, dtype=np.float32, tol=2e-3, output_names=["out0", "", "inv_std"],
         id="LayerNorm-invstd-only"),
    Case("BatchNormalization", [(2, 2, 3), (2,), (2,), np.array([0.1, -0.2]), np.array([0.5, 2.0])],
         id="BatchNorm-opset13", opset=13),
    # GroupNormalization (opset 21: per-channel scale and bias)
    Case("GroupNormalization", [(2, 4, 3), (4,), (4,)], {"num_groups": 2}, id="GroupNorm-1d", opset=21, dtype=np.float32, tol=2e-3),
    Case("GroupNormalization", [(2, 6, 2, 2), (6,), (6,)], {"num_groups": 3, "epsilon": 1e-3}, id="GroupNorm-2d",
         opset=21, dtype=np.float32, tol=2e-3),
    Case("GroupNormalization", [(2, 4, 3), (4,), (4,)], {"num_groups": 4}, id="GroupNorm-instance-like",
         opset=21, dtype=np.float32, tol=2e-3),
    Case("GroupNormalization", [(2, 4, 3), (4,), (4,)], {"num_groups": 1}, id="GroupNorm-one-group", opset=21, dtype=np.float32, tol=2e-3),
    Case("GroupNormalization", [(2, 8), (8,), (8,)], {"num_groups": 2}, id="GroupNorm-rank2", opset=23, dtype=np.float32, tol=2e-3),
]

CASES += [
    # RMSNormalization
    Case("RMSNormalization", [(2, 5), (5,)], {"stash_type": 11}, id="RMSNorm", opset=23),
    Case("RMSNormalization", [(2, 3, 4), (3, 4)], {"axis": 1, "epsilon": 1e-3, "stash_type": 11},
         id="RMSNorm-axis1", opset=23),
    Case("RMSNormalization", [(2, 3, 4), (1, 4)], {"axis": -2, "stash_type": 11}, id="RMSNorm-broadcast-scale",
         opset=23),
    Case("RMSNormalization", [(2, 3, 4), np.linspace(0.5, 1.5, 4)], {"stash_type": 11}, id="RMSNorm-frozen-scale",
         opset=24),
    Case("RMSNormalization", [(2, 4), (4,)], id="RMSNorm-float32-stash", opset=23, dtype=np.float32, tol=2e-3),
]
