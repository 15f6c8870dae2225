"""Losses appended to a forward model: one of its outputs (predictions or logits) against a new target input.

`append_loss` runs before the gradient pass. It adds a graph input for the target and a scalar output for the
loss, after the original outputs, built from standard ops that have gradient rules; each loss means what the
PyTorch function of the same name means (see README, "Losses").
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, shape_inference

from .builder import Builder, Names
from .errors import UsageError
from .contract import LOSS_FN_KEY
from .ir import Graph, Value, from_model

LOSSES = ("mse", "l1", "cross-entropy", "bce-with-logits")
REDUCTIONS = ("mean", "sum")


def append_loss(model: onnx.ModelProto, kind: str, output: str, target_input: str = "target",
                reduction: str = "mean", class_weights: Sequence[float] | None = None,
                ignore_index: int | None = None, loss_output: str = "loss") -> onnx.ModelProto:
    """Return `model` with a `target_input` graph input and a scalar `loss_output` output that compares the
    model output `output` with it. Cross-entropy reads int64 class indices over axis 1 of the output; the other
    losses read a target of the output's type and shape. The model is not changed."""
    _check_options(kind, reduction, class_weights, ignore_index)
    graph = from_model(_with_output_types(model, output))
    names = Names([*graph.values, *(n.name for n in graph.nodes)])
    add_loss(graph, names, kind, output, target_input, reduction, class_weights, ignore_index, loss_output)
    return graph.to_model()


def add_loss(graph: Graph, names: Names, kind: str, output: str, target_input: str = "target",
             reduction: str = "mean", class_weights: Sequence[float] | None = None,
             ignore_index: int | None = None, loss_output: str = "loss") -> Value:
    """Append the loss to `graph` (the pass behind `append_loss`); returns the loss value, a new output."""
    _check_options(kind, reduction, class_weights, ignore_index)
    y = _find_output(graph, output)
    if target_input == loss_output:
        raise UsageError(f"--target-input and --loss-output are both {target_input!r}; choose two names")
    for name, what, flag in ((target_input, "target input", "--target-input"),
                             (loss_output, "loss output", "--loss-output")):
        if not name or names.taken(name):
            raise UsageError(f"cannot add the {what} {name!r}: the model already has a value of that name; "
                             f"name it with {flag}")
        names.reserve(name)

    target = _add_input(graph, target_input, *_target_type(y, kind))
    op = Builder(graph, names, prefix=loss_output)
    if kind == "cross-entropy":
        loss = _cross_entropy(op, y, target, reduction, class_weights, ignore_index)
    else:
        loss = _reduce(op, ELEMENTWISE[kind](op, y, target), reduction)
    graph.rename(loss, loss_output)
    loss.elem_type, loss.shape = y.elem_type, ()
    graph.outputs.append(loss)
    record = {"kind": kind, "output": output, "target_input": target_input, "loss_output": loss_output,
              "reduction": reduction, "class_weights": None if class_weights is None else list(class_weights),
              "ignore_index": ignore_index}
    graph.metadata[LOSS_FN_KEY] = json.dumps(record)
    return loss


# -- the losses, per element (before the reduction) ---------------------------------------------------------
def _squared_error(op: Builder, y: Value, t: Value) -> Value:
    """(y - t)^2"""
    d = op.Sub(y, t)
    return op.Mul(d, d)


def _absolute_error(op: Builder, y: Value, t: Value) -> Value:
    """|y - t|"""
    return op.Abs(op.Sub(y, t))


def _bce_with_logits(op: Builder, x: Value, t: Value) -> Value:
    """softplus(x) - x*t, which is -t*log(sigmoid(x)) - (1-t)*log(1-sigmoid(x)) without overflow for any x"""
    # Smooth everywhere (gradient sigmoid(x) - t), unlike the max(x,0) - x*t + log(1+exp(-|x|)) form, whose
    # Relu and Abs kinks would give a wrong gradient at x == 0 (zero-initialised heads start there).
    return op.Sub(op.Softplus(x), op.Mul(x, t))


ELEMENTWISE = {"mse": _squared_error, "l1": _absolute_error, "bce-with-logits": _bce_with_logits}


def _reduce(op: Builder, per_element: Value, reduction: str) -> Value:
    # No axes: every element (ReduceMean's axes moved to an input at opset 18; absent means all in both forms).
    if reduction == "mean":
        return op.ReduceMean(per_element, keepdims=0)
    return op.ReduceSum(per_element, keepdims=0)


def _cross_entropy(op: Builder, logits: Value, labels: Value, reduction: str, class_weights, ignore_index):
    """SoftmaxCrossEntropyLoss over axis 1, with PyTorch's weighting: mean divides by the kept weights."""
    weights = None
    if class_weights is not None:
        classes = logits.shape[1] if logits.shape is not None else None
        if isinstance(classes, int) and classes != len(class_weights):
            raise UsageError(f"--class-weights: {len(class_weights)} weights given, the output "
                             f"{logits.name!r} has {classes} classes (axis 1)")
        # A Constant, not an initializer: every float initializer is taken for a parameter.
        weights = op.const(np.asarray(class_weights, dtype=np.float64), logits.elem_type)
    inputs = [logits, labels] + ([weights] if weights is not None else [])
    return op.SoftmaxCrossEntropyLoss(*inputs, reduction=reduction, ignore_index=ignore_index)


# -- checks and plumbing ------------------------------------------------------------------------------------
def _check_options(kind, reduction, class_weights, ignore_index) -> None:
    if kind not in LOSSES:
        raise UsageError(f"--loss-fn {kind}: expected one of {', '.join(LOSSES)}")
    if reduction not in REDUCTIONS:
        raise UsageError(f"--reduction {reduction}: expected mean or sum (the loss must be a scalar)")
    if kind != "cross-entropy":
        if class_weights is not None:
            raise UsageError(f"--class-weights: only for --loss-fn cross-entropy, not {kind}")
        if ignore_index is not None:
            raise UsageError(f"--ignore-index: only for --loss-fn cross-entropy, not {kind}")
    if class_weights is not None:
        if len(class_weights) == 0:
            raise UsageError("--class-weights: no weights given")
        if not all(np.isfinite(w) and w >= 0 for w in class_weights):
            raise UsageError("--class-weights: weights must be finite and non-negative")


def _with_output_types(model: onnx.ModelProto, output: str) -> onnx.ModelProto:
    """The model, with the type of `output` inferred when the graph output does not declare it."""
    for vi in model.graph.output:
        if vi.name == output:
            t = vi.type.tensor_type
            if t.elem_type and t.HasField("shape"):
                return model
            break
    else:
        return model  # _find_output reports the missing name
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception:  # the pipeline's strict inference reports a broken model later, with its reason
        return model
    known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for vi in copy.graph.output:
        if vi.name == output and output in known:
            vi.type.CopyFrom(known[output].type)
    return copy


def find_output(graph: Graph, name: str, flag: str) -> Value:
    """The graph output `name`; a usage error under `flag` that lists the outputs when there is none."""
    for v in graph.outputs:
        if v.name == name:
            return v
    raise UsageError(f"{flag} {name}: no graph output of that name "
                     f"(outputs: {', '.join(o.name for o in graph.outputs)})")


def _find_output(graph: Graph, name: str) -> Value:
    v = find_output(graph, name, "--target")
    if v.elem_type is None:
        raise UsageError(f"--target {name}: the output's element type is unknown")
    if not v.is_float:
        raise UsageError(f"--target {name}: the output is not a floating-point tensor")
    return v


def _target_type(y: Value, kind: str) -> tuple[int, tuple | None]:
    """Cross-entropy: int64 class indices shaped like y without axis 1. Others: y's type and shape."""
    if kind != "cross-entropy":
        return y.elem_type, y.shape
    if y.shape is None:
        raise UsageError(f"--target {y.name}: cross-entropy needs the rank of the logits, which is unknown "
                         f"(fix it with --input-shape)")
    if len(y.shape) < 2:
        raise UsageError(f"--target {y.name}: cross-entropy needs logits of shape [N, C, ...], "
                         f"this output has rank {len(y.shape)}")
    return TensorProto.INT64, (y.shape[0],) + tuple(y.shape[2:])


def _add_input(graph: Graph, name: str, elem_type: int, shape) -> Value:
    v = Value(name, elem_type, shape)
    graph.values[name] = v
    graph.inputs.append(v)
    return v

