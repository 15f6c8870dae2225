import numpy as np

from gradcheck import Case


def spread(*intervals):
    """A sampler that fills every interval: element j goes to interval j mod k (shuffled), uniform within.

    Used for ops with kinks away from 0: the intervals stay clear of each kink and cover both of its sides.
    """
    def sample(rng, shape):
        n = int(np.prod(shape))
        which = rng.permutation(np.arange(n) % len(intervals))
        lo = np.array([intervals[k][0] for k in which])
        hi = np.array([intervals[k][1] for k in which])
        return rng.uniform(lo, hi).reshape(shape)
    return sample


wide = spread((-3.0, -0.2), (0.2, 3.0))              # smooth ops: a wide range on both sides
around_zero = spread((-3.0, -0.1), (0.1, 3.0), (-0.6, 0.6))

# onnxruntime has no float64 Erf, and the onnx reference evaluator's Erf rounds to float32, so Erf and Gelu
# "none" are checked in float32 (finite differences with a larger step), with a looser tolerance.
ERF_TOL = 2e-3

CASES = [
    Case("Relu", [(2, 3)], id="Relu-13", opset=13),
    Case("Relu", [(2, 3, 2)], id="Relu-14"),
    Case("LeakyRelu", [(2, 3)], id="LeakyRelu-default"),
    Case("LeakyRelu", [(2, 3)], attrs={"alpha": 0.3}, id="LeakyRelu-alpha", opset=13),
    Case("LeakyRelu", [(2, 3)], attrs={"alpha": -0.5}, id="LeakyRelu-negative-alpha"),
    Case("LeakyRelu", [(2, 3)], attrs={"alpha": 2.0}, id="LeakyRelu-steep", opset=22),
    Case("ThresholdedRelu", [(2, 4)], sampler=spread((-1.5, -0.2), (0.2, 0.8), (1.2, 2.0)),
         id="ThresholdedRelu-default"),
    Case("ThresholdedRelu", [(2, 4)], attrs={"alpha": 0.5}, sampler=spread((-1.0, 0.3), (0.7, 2.0)),
         id="ThresholdedRelu-alpha"),
    Case("ThresholdedRelu", [(2, 4)], attrs={"alpha": -0.5}, sampler=spread((-2.0, -0.7), (-0.3, 1.5)),
         id="ThresholdedRelu-negative-alpha", opset=22),
    Case("PRelu", [(2, 3), (2, 3)], id="PRelu-same"),
    Case("PRelu", [(2, 3, 4), (4,)], id="PRelu-bcast-trailing"),
    Case("PRelu", [(2, 3, 2, 2), (3, 1, 1)], id="PRelu-bcast-channel"),
    Case("PRelu", [(2, 3), (1,)], id="PRelu-bcast-one", opset=13),
    Case("PRelu", [(2, 3), ()], id="PRelu-scalar-slope"),
    Case("PRelu", [(2, 3), np.array([0.1, -0.2, 0.3])], id="PRelu-const-slope"),
    Case("PRelu", [np.array([[1.0, -2.0, 0.5], [-0.7, 0.3, -1.1]]), (3,)], id="PRelu-slope-only"),
    Case("Elu", [(2, 3)], sampler=wide, id="Elu-default"),
    Case("Elu", [(2, 3)], attrs={"alpha": 0.5}, sampler=wide, id="Elu-alpha", opset=13),
    Case("Elu", [(2, 3)], attrs={"alpha": -0.5}, sampler=wide, id="Elu-negative-alpha", opset=22),
    Case("Selu", [(2, 3)], sampler=wide, id="Selu-default"),
    Case("Selu", [(2, 3)], attrs={"alpha": 1.5, "gamma": 2.0}, sampler=wide, id="Selu-attrs", opset=22),
    # Celu has no float64 form at opsets 13-23: checked in float32, with a looser tolerance
    Case("Celu", [(2, 3)], sampler=wide, id="Celu-default", dtype=np.float32, tol=2e-3),
    Case("Celu", [(2, 3)], attrs={"alpha": 0.5}, sampler=wide, id="Celu-alpha", opset=13, dtype=np.float32,
         tol=2e-3),
    Case("Celu", [(2, 3)], attrs={"alpha": -2.5}, sampler=wide, id="Celu-negative-alpha", dtype=np.float32,
         tol=2e-3),
    Case("Sigmoid", [(2, 3)], sampler=wide),
    Case("HardSigmoid", [(2, 4)], sampler=spread((-4.0, -2.7), (-2.3, 2.3), (2.7, 4.0)),
         id="HardSigmoid-default"),
    Case("HardSigmoid", [(2, 4)], attrs={"alpha": 0.5, "beta": 0.6},
         sampler=spread((-2.0, -1.4), (-1.0, 0.6), (1.0, 2.0)), id="HardSigmoid-attrs", opset=13),
    Case("HardSigmoid", [(2, 4)], attrs={"alpha": -0.25, "beta": 0.5},
         sampler=spread((-4.0, -2.2), (-1.8, 1.8), (2.2, 4.0)), id="HardSigmoid-negative-alpha", opset=22),
    Case("HardSwish", [(2, 4)], sampler=spread((-4.5, -3.2), (-2.8, -0.1), (0.1, 2.8), (3.2, 4.5)),
         id="HardSwish-14", opset=14),
    Case("HardSwish", [(3, 4)], sampler=spread((-4.5, -3.2), (-2.8, 2.8), (3.2, 4.5)), id="HardSwish-22",
         opset=22),
    Case("Tanh", [(2, 3)], sampler=wide),
    Case("Softsign", [(2, 3)], sampler=spread((-6.0, -0.1), (0.1, 6.0))),
    Case("Softplus", [(2, 3)], sampler=spread((-5.0, 5.0))),
    Case("Softplus", [(2, 3)], sampler=spread((-5.0, 5.0)), id="Softplus-22", opset=22),
    Case("Erf", [(2, 3)], sampler=spread((-2.5, 2.5)), tol=ERF_TOL, dtype=np.float32),
    Case("Gelu", [(2, 4)], sampler=around_zero, id="Gelu-none", opset=20, tol=ERF_TOL, dtype=np.float32),
    Case("Gelu", [(2, 4)], attrs={"approximate": "none"}, sampler=around_zero, id="Gelu-none-explicit",
         opset=23, tol=ERF_TOL, dtype=np.float32),
    Case("Gelu", [(2, 4)], attrs={"approximate": "tanh"}, sampler=around_zero, id="Gelu-tanh", opset=20),
    Case("Gelu", [(2, 4)], attrs={"approximate": "tanh"}, sampler=around_zero, id="Gelu-tanh-22", opset=22),
    Case("Mish", [(2, 4)], sampler=around_zero, id="Mish-18"),
    Case("Mish", [(2, 4)], sampler=around_zero, id="Mish-22", opset=22),
    Case("Sin", [(2, 3)], sampler=spread((-4.0, 4.0))),
    Case("Cos", [(2, 3)], sampler=spread((-4.0, 4.0))),
]

CASES += [
    # Swish (opset 24)
    Case("Swish", [(2, 3)], id="Swish", opset=24),
    Case("Swish", [(2, 3)], {"alpha": 0.7}, id="Swish-alpha", opset=24),
]

# SwiGLU (opset 28): no onnxruntime runs opset 28 yet, so it is checked against the reference evaluator by
# tests/test_opset23.py
REFERENCE_CASES = [
    Case("SwiGLU", [(2, 3), (2, 3)], id="SwiGLU", opset=28),
    Case("SwiGLU", [(2, 3), (2, 3)], {"alpha": 1.7}, id="SwiGLU-alpha", opset=28),
]
