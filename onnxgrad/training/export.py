"""The forward model out of a trained step graph: the step graph cut back to its forward outputs, or the model
it was built from with the trained values in its initializers."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..contract import TRAINING_METADATA
from ..errors import UsageError
from ..protos import needed_subgraph
from .step import StepGraph


def strip_step_graph(graph: StepGraph, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The step graph cut back to its forward outputs, with `params` as its initializers."""
    src = graph.model
    keep = set(graph.forward_outputs)
    outputs = [o for o in src.graph.output if o.name in keep]
    nodes, names = needed_subgraph(src.graph, [o.name for o in outputs])
    inits = []
    for t in src.graph.initializer:
        if t.name in names:
            inits.append(numpy_helper.from_array(params[t.name], t.name) if t.name in params else t)
    inputs = [vi for vi in src.graph.input if vi.name in names and vi.name not in params]
    value_info = [vi for vi in src.graph.value_info if vi.name in names]
    g = helper.make_graph(nodes, src.graph.name, inputs, outputs, inits, doc_string=src.graph.doc_string,
                          value_info=value_info)
    model = helper.make_model(g, opset_imports=list(src.opset_import), ir_version=src.ir_version,
                              producer_name=src.producer_name, producer_version=src.producer_version,
                              doc_string=src.doc_string)
    for p in src.metadata_props:
        if p.key not in TRAINING_METADATA:
            model.metadata_props.add(key=p.key, value=p.value)
    model.functions.extend(src.functions)
    return model


def substitute_parameters(forward: onnx.ModelProto, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`forward` with the values of its initializers named like a trained parameter replaced."""
    inits = matching_initializers(forward, params)
    for name, value in params.items():
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return forward


def matching_initializers(forward: onnx.ModelProto, params: dict[str, np.ndarray]) -> dict[str, onnx.TensorProto]:
    """The initializers of `forward` by name, after checking that each parameter has one of its shape and type."""
    inits = {t.name: t for t in forward.graph.initializer}
    for name, value in params.items():
        t = inits.get(name)
        if t is None:
            raise UsageError(f"--forward: the model has no initializer {name!r} for the trained parameter")
        shape, dtype = tuple(t.dims), np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        if shape != value.shape or dtype != value.dtype:
            raise UsageError(f"--forward: initializer {name!r} is {dtype}{list(shape)}, the trained "
                             f"parameter is {value.dtype}{list(value.shape)}")
    return inits
