"""A step graph (written by `build-grad --optimizer`) and what a runner needs to know about it.

A step graph does one whole training step: forward, backward and the optimizer's update. Its metadata
`onnxgrad.state` maps each state input (parameters, optimizer state, `step`) to the output that replaces it after
a step; `onnxgrad.loss` names the loss output; an optional float scalar input `lr` carries the learning rate.
Every other graph input is data, fed from `.npz` arrays batch by batch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..contract import LOSS_KEY, LR_INPUT, STATE_KEY
from ..errors import InvalidModelError, UsageError
from ..loader import read_model
from ..protos import declared_dims, forward_outputs, needed_subgraph


@dataclass
class StepGraph:
    """What the runner needs to know about a step graph, read from its inputs, outputs and metadata."""

    model: onnx.ModelProto
    state: dict[str, str]                      # state input -> the output that replaces it after a step
    loss: str
    loss_shape: tuple[int, ...]
    loss_dtype: np.dtype
    lr: str | None                             # the learning-rate input, when the graph has one
    data: dict[str, onnx.ValueInfoProto]       # the inputs fed from the data (no initializer), in graph order
    parameters: list[str]                      # state inputs the forward outputs depend on (not optimizer state)
    initial: dict[str, np.ndarray]             # initializer values of the state inputs and of `lr`
    forward_outputs: list[str]                 # the forward model's outputs, without a loss build-grad appended


def read_step_graph(model: str | os.PathLike | onnx.ModelProto) -> StepGraph:
    proto = read_model(model)
    g = proto.graph
    meta = {p.key: p.value for p in proto.metadata_props}
    if STATE_KEY not in meta:
        raise UsageError(f"not a step graph: no {STATE_KEY!r} metadata; write one with "
                         f"`onnxgrad build-grad MODEL -o STEP.onnx --optimizer sgd`")
    try:
        state = json.loads(meta[STATE_KEY])
    except json.JSONDecodeError:
        state = None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in state.items()):
        raise InvalidModelError(f"metadata {STATE_KEY!r} is not a JSON object of input -> output names")
    inputs = {vi.name: vi for vi in g.input}
    outputs = {vi.name: vi for vi in g.output}
    inits = {t.name: t for t in g.initializer}
    for name, nxt in state.items():
        if name not in inputs:
            raise InvalidModelError(f"{STATE_KEY}: {name!r} is not a graph input")
        if nxt not in outputs:
            raise InvalidModelError(f"{STATE_KEY}: {nxt!r} (the next value of {name!r}) is not a graph output")
        if name not in inits:
            raise InvalidModelError(f"{STATE_KEY}: {name!r} has no initializer to start from")
        if outputs[nxt].type.tensor_type.elem_type not in (0, inits[name].data_type):
            raise InvalidModelError(f"{STATE_KEY}: {nxt!r} has another element type than {name!r}")
    loss = meta.get(LOSS_KEY, "")
    if not loss or "," in loss or loss not in outputs:
        raise InvalidModelError(f"metadata {LOSS_KEY!r} must name one graph output (found {loss!r})")
    loss_type = outputs[loss].type.tensor_type
    loss_dims = declared_dims(outputs[loss])
    if loss_dims is None or not all(isinstance(d, int) for d in loss_dims) or int(np.prod(loss_dims)) != 1 \
            or not loss_type.elem_type:
        raise InvalidModelError(f"the loss output {loss!r} must be declared a scalar (a static shape of one "
                                f"element) with its element type")
    loss_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(loss_type.elem_type))
    lr = LR_INPUT if LR_INPUT in inputs and LR_INPUT not in state else None
    # Other inputs with a stored value (an initializer) keep it; the rest are fed from the data.
    data = {n: vi for n, vi in inputs.items() if n not in state and n != lr and n not in inits}
    initial = {name: numpy_helper.to_array(inits[name]) for name in state}
    if lr is not None and lr in inits:
        initial[lr] = numpy_helper.to_array(inits[lr])
    forward = forward_outputs(proto, state)
    needed = needed_subgraph(g, forward)[1]
    parameters = [name for name in state if name in needed]
    return StepGraph(proto, state, loss, tuple(loss_dims), loss_dtype, lr, data, parameters, initial, forward)
