"""Output types of the nodes that passes create, worked out as each node is built.

The ops here are the vocabulary of the gradient rules, the losses and the optimizers: element-wise ops with
broadcasting, reductions, reshapes, MatMul. Symbolic dimensions stay symbols. An op not listed, or one whose
shape depends on a value that is not a constant, leaves its outputs untyped; `passes.infer_types` fills those in
from onnx's shape inference over the whole graph, which is slower per node but knows every op.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from .ir import Dim, Node, Value, constant_value

SAME_AS_INPUT = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Celu", "Clip", "Cos", "Cosh", "Elu", "Erf",
    "Exp", "Floor", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "Identity", "LeakyRelu", "Log", "LogSoftmax",
    "Mish", "Neg", "Reciprocal", "Relu", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softmax", "Softplus",
    "Softsign", "Sqrt", "Tan", "Tanh", "ThresholdedRelu", "CumSum", "Trilu",
})
BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Sum", "Max", "Min", "Mean", "Mod", "PRelu"})
COMPARE = frozenset({"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"})
REDUCE = frozenset({"ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                    "ReduceLogSumExp", "ReduceSumSquare", "ReduceLogSum"})


def broadcast(*shapes: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
    """numpy broadcasting over known, symbolic and unknown dims; None when a rank is unknown."""
    if any(s is None for s in shapes):
        return None
    if all(s == shapes[0] for s in shapes):
        return shapes[0]
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        known = [d for d in dims if d != 1]
        if not known:
            out.append(1)
            continue
        ints = [d for d in known if isinstance(d, int)]
        if ints:
            out.append(ints[0])
        elif all(d == known[0] for d in known):
            out.append(known[0])  # the same symbol (or all unknown)
        else:
            out.append(None)
    return tuple(out)


def constant(v: Value | None) -> np.ndarray | None:
    """The value of a Constant node's output."""
    p = v.producer if v is not None else None
    if p is None or p.op_type != "Constant":
        return None
    return constant_value(p.attributes)


def shape_value(v: Value | None) -> tuple[Dim, ...] | None:
    """The value of a 1-D int64 shape tensor, symbols included, when it is a constant, a Shape, or a Concat of
    those (how rules build the shape of zeros to scatter into); else None."""
    c = constant(v)
    if c is not None:
        return tuple(int(d) for d in c.ravel())
    p = v.producer if v is not None else None
    if p is None:
        return None
    if p.op_type == "Shape" and p.inputs[0].shape is not None:
        rank = len(p.inputs[0].shape)
        return tuple(p.inputs[0].shape[slice(p.attr("start", 0), p.attr("end", rank))])
    if p.op_type == "Concat":
        parts = [shape_value(x) for x in p.inputs]
        if all(part is not None for part in parts):
            return tuple(d for part in parts for d in part)
    return None


def infer(node: Node, opset: int) -> None:
    """Type the outputs of `node` where its op and inputs allow; leave the rest as they are."""
    if node.domain not in ("", "ai.onnx") or any(v.elem_type for v in node.outputs):
        return
    found = _infer(node, opset)
    if found is not None:
        out = node.outputs[0]
        out.elem_type, out.shape = found


def _infer(node: Node, opset: int) -> tuple[int, tuple[Dim, ...] | None] | None:
    op, ins = node.op_type, node.inputs
    first = ins[0] if ins else None
    if op in SAME_AS_INPUT and first is not None and first.elem_type:
        return first.elem_type, first.shape
    if op in BROADCAST and first is not None and first.elem_type:
        return first.elem_type, broadcast(*(v.shape for v in ins if v is not None))
    if op in COMPARE:
        return TensorProto.BOOL, broadcast(*(v.shape for v in ins if v is not None))
    if op == "Not" and first is not None:
        return TensorProto.BOOL, first.shape
    if op == "Where" and len(ins) == 3 and ins[1].elem_type:
        return ins[1].elem_type, broadcast(*(v.shape for v in ins))
    if op == "Cast":
        return node.attr("to"), first.shape
    if op == "CastLike" and ins[1].elem_type:
        return ins[1].elem_type, first.shape
    if op == "Shape":
        if first.shape is None:
            return None  # typed later by onnx's inference, which may know the rank
        rank = len(first.shape)
        start, end = node.attr("start", 0), node.attr("end", rank)
        return TensorProto.INT64, (len(range(rank)[slice(start, end)]),)
    if op == "Size":
        return TensorProto.INT64, ()
    if op == "ConstantOfShape":
        value = node.attr("value")
        elem = value.data_type if value is not None else TensorProto.FLOAT
        dims = shape_value(first)
        if dims is not None:
            return elem, dims
        return elem, (None,) * first.shape[0] if first.shape and isinstance(first.shape[0], int) else None
    if op in REDUCE and first is not None and first.elem_type:
        return first.elem_type, _reduced(node, opset)
    if op == "MatMul" and first is not None and first.elem_type:
        return first.elem_type, _matmul(first.shape, ins[1].shape)
    if op == "Transpose" and first is not None and first.elem_type:
        if first.shape is None:
            return first.elem_type, None
        perm = node.attr("perm") or list(reversed(range(len(first.shape))))
        return first.elem_type, tuple(first.shape[p] for p in perm)
    if op in ("Unsqueeze", "Squeeze") and first is not None and first.elem_type:
        return first.elem_type, _squeezed(node, opset)
    if op == "Flatten" and first is not None and first.elem_type:
        if first.shape is None:
            return first.elem_type, None
        axis = node.attr("axis", 1)
        axis = axis + len(first.shape) if axis < 0 else axis
        rows, columns = _product(first.shape[:axis]), _product(first.shape[axis:])
        # symbolic dims: left to onnx's inference, which names the products
        return (first.elem_type, (rows, columns)) if rows is not None and columns is not None else None
    if op in ("Reshape", "Expand") and first is not None and first.elem_type:
        target = constant(ins[1])
        if target is None or first.shape is None:
            return first.elem_type, None
        if op == "Expand":
            return first.elem_type, broadcast(first.shape, tuple(int(d) for d in target))
        return first.elem_type, _reshaped(first.shape, [int(d) for d in target], node.attr("allowzero", 0))
    return None


def _axes(node: Node, opset: int, moved_at: int) -> list[int] | None:
    """Axes from the attribute (before `moved_at`) or the constant second input; None when not constant."""
    if opset < moved_at:
        return node.attr("axes")
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return []
    a = constant(node.inputs[1])
    return None if a is None else [int(x) for x in a.ravel()]


def _reduced(node: Node, opset: int) -> tuple[Dim, ...] | None:
    shape = node.inputs[0].shape
    if shape is None:
        return None
    axes = _axes(node, opset, 13 if node.op_type == "ReduceSum" else 18)
    keep = node.attr("keepdims", 1)
    if axes is None:
        return None
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            return shape
        axes = list(range(len(shape)))
    axes = {a % len(shape) for a in axes} if shape else set()
    if keep:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _squeezed(node: Node, opset: int) -> tuple[Dim, ...] | None:
    shape = node.inputs[0].shape
    axes = _axes(node, opset, 13)
    if shape is None or axes is None:
        return None
    if node.op_type == "Unsqueeze":
        rank = len(shape) + len(axes)
        where = {a % rank for a in axes}
        rest = iter(shape)
        return tuple(1 if i in where else next(rest) for i in range(rank))
    if not axes:
        if any(not isinstance(d, int) for d in shape):
            return None
        return tuple(d for d in shape if d != 1)
    where = {a % len(shape) for a in axes}
    return tuple(d for i, d in enumerate(shape) if i not in where)


def _matmul(a: tuple[Dim, ...] | None, b: tuple[Dim, ...] | None) -> tuple[Dim, ...] | None:
    if a is None or b is None or not a or not b:
        return None
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    batch = broadcast(a2[:-2], b2[:-2])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _reshaped(shape: tuple[Dim, ...], target: list[int], allowzero: int) -> tuple[Dim, ...] | None:
    out: list[Dim] = []
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            if i >= len(shape):
                return None
            out.append(shape[i])
        else:
            out.append(d)
    if -1 in out:
        known = [d for d in shape]
        if not all(isinstance(d, int) for d in known) or not all(isinstance(d, int) for d in out):
            return tuple(None if d == -1 else d for d in out)
        total = int(np.prod(known, dtype=np.int64))
        rest = int(np.prod([d for d in out if d != -1], dtype=np.int64))
        out[out.index(-1)] = total // rest if rest else 0
    return tuple(out)


def read_types(model: onnx.ModelProto, values: dict[str, Value]) -> int:
    """Fill untyped values from a model's value_info (onnx's shape inference); returns how many were filled."""
    from .ir import type_shape
    filled = 0
    g = model.graph
    for vi in list(g.value_info) + list(g.output):
        v = values.get(vi.name)
        if v is None or v.is_typed:
            continue
        elem, shape = type_shape(vi.type)
        if elem:
            v.elem_type = v.elem_type or elem
            v.shape = v.shape if v.shape is not None else shape
            filled += 1
    return filled


def _product(dims: tuple[Dim, ...]) -> Dim:
    """The product of static dims (1 for none), or None where one is symbolic."""
    out = 1
    for d in dims:
        if not isinstance(d, int):
            return None
        out *= d
    return out


def type_everything(graph) -> None:
    """Type the values the passes could not type as they built them, with onnx's shape inference over the whole
    graph (one proto round trip, for types only)."""
    from onnx import shape_inference
    untyped = {v.name: v for n in graph.nodes for v in n.outputs if v.name and not v.is_typed}
    if untyped:
        read_types(shape_inference.infer_shapes(graph.to_model(weights_apart=True), data_prop=True), untyped)
