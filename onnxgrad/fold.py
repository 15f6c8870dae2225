"""Folding small integer subgraphs into constants before the gradient pass.

Exporters compute axes, starts and shapes in little subgraphs (`Reshape(Constant([2, 3]), [-1])`,
`Cast(Constant(4))`, `Shape(x)` of a static x). Rules that need such an input to be known (the axes of a
ReduceMean with keepdims=0, the starts of a Slice) would see run-time data. This pass evaluates every node whose
inputs are all known and whose outputs are small integer or boolean tensors, and replaces it by a Constant node
with the same outputs. Floating-point values are never folded, so parameters and activations stay as they are.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MAX_ELEMENTS = 4096  # larger integer tensors (index tables) are left to run time
_NO_FOLD = {"Constant", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
            "Multinomial", "If", "Loop", "Scan"}


def _small_int(a: np.ndarray) -> bool:
    return (a.dtype.kind in "iub") and a.size <= MAX_ELEMENTS


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name in ("value_int", "value_ints"):
            return np.asarray(helper.get_attribute_value(a), dtype=np.int64)
    return None


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    shapes = {}
    g = model.graph
    for vi in [*g.value_info, *g.input, *g.output]:
        t = vi.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[vi.name] = [d.dim_value for d in t.shape.dim]
    for init in g.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    single = helper.make_node(node.op_type, names, [f"o{k}" for k in range(len(node.output))], domain=node.domain)
    single.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [single], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in zip(names, inputs) if v is not None],
        [helper.make_value_info(f"o{k}", onnx.TypeProto()) for k in range(len(node.output))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        outs = ReferenceEvaluator(model).run(None, {n: v for n, v in zip(names, inputs) if v is not None})
    except Exception:  # an op the evaluator cannot run: leave it to onnxruntime
        return None
    return [np.asarray(o) for o in outs]


def fold_small_constants(model: onnx.ModelProto, opset: int) -> int:
    """Fold in place; returns how many nodes became constants. Shapes must have been inferred."""
    g = model.graph
    known: dict[str, np.ndarray] = {}
    for init in g.initializer:
        if init.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                                  onnx.TensorProto.BFLOAT16) and np.prod(init.dims, dtype=np.int64) <= MAX_ELEMENTS:
            known[init.name] = numpy_helper.to_array(init)
    shapes = _static_shapes(model)
    folded = 0
    for k, node in enumerate(g.node):
        if node.domain not in ("", "ai.onnx") or node.op_type in _NO_FOLD:
            if node.op_type == "Constant" and len(node.output) == 1:
                value = _constant_value(node)
                if value is not None and _small_int(value):
                    known[node.output[0]] = value
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        outputs: list[np.ndarray] | None = None
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            shape = np.asarray(shapes[node.input[0]], dtype=np.int64)
            if node.op_type == "Size":
                outputs = [np.asarray(np.prod(shape), dtype=np.int64)]
            else:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                outputs = [shape[attrs.get("start", 0):attrs.get("end", len(shape))]]
        elif node.input and all(not n or n in known for n in node.input):
            outputs = _evaluate(node, [known[n] if n else None for n in node.input], opset)
        if not outputs or len(outputs) != len(node.output) or not all(_small_int(o) for o in outputs):
            continue
        if len(node.output) != 1:
            continue
        replacement = helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                       value=numpy_helper.from_array(outputs[0], ""))
        g.node[k].CopyFrom(replacement)
        known[node.output[0]] = outputs[0]
        folded += 1
    return folded
