"""Mixed precision: which ops run in half precision, and the loss scaler's settings.

`precision_settings` decides (defaults, checks: the record written to the metadata); `passes/precision.py`
rewrites the forward graph by these lists, and `optim.py` writes the scaler's update into a step graph. The
lists follow PyTorch's autocast (torch/csrc/autograd/autocast_mode.cpp): the matrix products run in half, the
ops whose result loses too much in half (sums over many elements, exponentials and logarithms, normalisations,
losses) run in float32, and every other op runs in the precision of its inputs.
"""
from __future__ import annotations

import math

from onnx import TensorProto

from .errors import UsageError

PRECISIONS = ("fp32", "fp16", "bf16")
HALF_TYPES = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}

# run in half precision: the float32 inputs of their type are cast to half
HALF_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention"})
# ...but in float32 in bf16, because their gradients could not run in bfloat16: a Conv's input gradient is a
# ConvTranspose (and a ConvTranspose's a Conv), which onnxruntime's CUDA provider has no bfloat16 kernel for, and
# Attention's gradient rule contracts with Einsum, which ONNX defines for no bfloat16 type
NOT_IN_BF16 = frozenset({"Conv", "ConvTranspose", "Attention"})
# reductions, and the ops that sum along an axis: in float32 in the forward (below), and in the backward too,
# where a gradient's reduction (a broadcast's, a scalar weight's) is rewritten to accumulate in float32
SUMS = frozenset({
    "ReduceSum", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "CumSum", "GlobalAveragePool", "GlobalLpPool", "LpPool",
})
# run in float32: half inputs are cast back up
FLOAT32_OPS = SUMS | frozenset({
    # exponentials, logarithms, powers
    "Softmax", "LogSoftmax", "Hardmax", "Exp", "Log", "Pow", "Reciprocal", "Softplus", "Softsign",
    "Tan", "Acos", "Asin", "Acosh", "Asinh", "Atanh", "Cosh", "Sinh",
    # normalisations
    "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "LpNormalization", "MeanVarianceNormalization", "RMSNormalization", "LRN",
    # losses
    "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
})
# ...of which the normalisations hand their result back in the half type their input came in, as autocast runs
# batch_norm (cuDNN takes a half X with float32 statistics and returns half): a normalised result has no range
# to lose, and the element-wise ops after it (Relu, a residual Add) then run in half and keep half values for
# the backward instead of float32 ones. Readers that run in float32 still read the float32 result.
HALF_RESULT_OPS = frozenset({
    "BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
    "MeanVarianceNormalization", "RMSNormalization",
})

# torch.cuda.amp.GradScaler's defaults
SCALER_DEFAULTS = {"init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
SCALER_FLAGS = {"init_scale": "--loss-scale-init", "growth_interval": "--loss-scale-interval"}


def precision_settings(precision: str, loss_scale: str | None = None, scaler: dict | None = None) -> dict:
    """The checked settings of a build's precision: {"precision", "loss_scale": None or the scaler's settings}.
    `loss_scale`: "dynamic" or "none"; by default dynamic for fp16 and none for bf16 and fp32 (bfloat16 has
    float32's exponent range, so its gradients do not underflow where float32's would not). Dynamic scaling in
    fp32 is allowed: it changes no number but the scale, and runs where half-precision kernels do not."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision}: expected one of {', '.join(PRECISIONS)}")
    scaler = {k: v for k, v in (scaler or {}).items() if v is not None}
    if loss_scale not in (None, "dynamic", "none"):
        raise UsageError(f"--loss-scale {loss_scale}: expected dynamic or none")
    if loss_scale is None:
        loss_scale = "dynamic" if precision == "fp16" else "none"
    unknown = sorted(set(scaler) - set(SCALER_DEFAULTS))
    if unknown:
        raise UsageError(f"loss scaler option {unknown[0]!r}: expected one of {', '.join(SCALER_DEFAULTS)}")
    if scaler and loss_scale != "dynamic":
        key = next(iter(scaler))
        raise UsageError(f"{SCALER_FLAGS.get(key, key)}: needs dynamic loss scaling (--precision fp16, or "
                         f"--loss-scale dynamic)")
    if loss_scale == "none":
        return {"precision": precision, "loss_scale": None}
    s = {**SCALER_DEFAULTS, **scaler}
    try:
        s = {"init_scale": float(s["init_scale"]), "growth_factor": float(s["growth_factor"]),
             "backoff_factor": float(s["backoff_factor"]), "growth_interval": s["growth_interval"]}
    except (TypeError, ValueError):
        raise UsageError(f"loss scaler: a setting has the wrong type ({scaler})") from None
    if not (math.isfinite(s["init_scale"]) and s["init_scale"] > 0):
        raise UsageError(f"--loss-scale-init {s['init_scale']:g}: must be a finite number > 0")
    if not (math.isfinite(s["growth_factor"]) and s["growth_factor"] >= 1):
        raise UsageError(f"loss scaler growth_factor {s['growth_factor']:g}: must be >= 1")
    if not 0 < s["backoff_factor"] < 1:
        raise UsageError(f"loss scaler backoff_factor {s['backoff_factor']:g}: must be in (0, 1)")
    interval = s["growth_interval"]
    if isinstance(interval, bool) or int(interval) != interval or interval < 1:
        raise UsageError(f"--loss-scale-interval {interval}: expected a whole number of steps >= 1")
    s["growth_interval"] = int(interval)
    return {"precision": precision, "loss_scale": s}
