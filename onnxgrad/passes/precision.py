"""Mixed precision, as two passes around the gradient.

`Precision` rewrites the forward graph before it is differentiated: each op runs in half precision or float32 by
the lists of `onnxgrad.precision`, with Casts between. The gradient pass then differentiates the Casts like any
op (Cast's rule casts the gradient back), so no rule changes, and the gradient of a float32 parameter read
through a Cast to half is float32 again: parameters and optimizer state stay float32 (the master weights).

`LossScale` (dynamic loss scaling, fp16 by default) replaces the constant 1 the backward starts from by the
input `loss_scale`, which is the gradient of loss * loss_scale, and multiplies each gradient output by
1 / loss_scale. A step graph's optimizer then skips the update when a gradient is not finite and updates the
scale (`optim.add_optimizer`, `scaler`)."""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import onnx.defs
from onnx import TensorProto, helper

from ..builder import Builder, Names
from ..contract import BACKWARD, FORWARD, GRAD_SUFFIX, LOSS_SCALE_INPUT, PRECISION_KEY
from ..errors import UsageError
from ..gradient import reaching_heads
from ..ir import Graph, Node, Value, outer_references
from ..pipeline import Build, Pass
from ..rules.subgraphs import as_graph
from .results import PrecisionResult, WidenResult
from ..precision import FLOAT32_OPS, HALF_OPS, HALF_TYPES, NOT_IN_BF16

F32 = TensorProto.FLOAT
TYPE_NAMES = {F32: "tensor(float)", TensorProto.FLOAT16: "tensor(float16)", TensorProto.BFLOAT16: "tensor(bfloat16)"}


class Precision(Pass):
    name = "precision"
    requires = frozenset({"graph", "heads", "lowered"})
    ensures = frozenset({"precision"})

    def wanted(self, build: Build) -> bool:
        settings = build.options.precision_settings
        asked = settings["precision"] != "fp32" or settings["loss_scale"] is not None
        if build.training_graph and asked:
            flag = f"--precision {settings['precision']}" if settings["precision"] != "fp32" else "--loss-scale"
            raise UsageError(f"{flag}: the model is already a training graph (written by onnxgrad build-grad); "
                             f"give the forward model instead")
        return asked

    def run(self, build: Build) -> None:
        settings = build.options.precision_settings
        graph = build.graph
        counts = {"half_nodes": 0, "casts": 0}
        if settings["precision"] != "fp32":
            counts = cast_to_precision(graph, build.new_names(), HALF_TYPES[settings["precision"]], build.heads)
            build.reaches_loss = reaching_heads(graph, build.heads)
        graph.metadata[PRECISION_KEY] = json.dumps(settings, separators=(",", ":"))
        build.record(PrecisionResult(settings["precision"], settings["loss_scale"], **counts))


def cast_to_precision(graph: Graph, names: Names, half: int, heads: list[Value]) -> dict:
    """Rewrite the forward nodes of `graph` to compute in `half` where the lists allow, with one Cast per value and
    precision shared by all its readers. Graph outputs (and `heads`, updated in place) stay float32. Returns the
    number of nodes run in half and of Casts added."""
    rewrite = _Rewrite(graph, names, half)
    order: list[Node] = []
    in_half = 0
    for node in list(graph.nodes):
        in_half += rewrite.node(node)
        order.extend(rewrite.emitted())
        order.append(node)
    for k, v in enumerate(graph.outputs):
        if v.elem_type == half and id(v) in rewrite.versions:
            f = rewrite.get(v, F32)
            if any(o is f for o in graph.outputs):  # the same value output twice: renamed the first time
                graph.outputs[k] = f
                continue
            original = v.name
            graph.rename(v, names.fresh(original + "/" + _short(half)))
            graph.rename(f, original)
            graph.outputs[k] = f
            heads[:] = [f if h is v else h for h in heads]
    order.extend(rewrite.emitted())
    graph.reorder(order)
    return {"half_nodes": in_half, "casts": rewrite.casts}


class _Rewrite:
    """The walk's state: each float32 value's versions by element type (the value and its Casts share one
    dict), and which values depend on the data (graph inputs that are not initializers)."""

    def __init__(self, graph: Graph, names: Names, half: int):
        self.graph, self.names, self.half = graph, names, half
        self.versions: dict[int, dict[int, Value]] = {}
        self.data: set[int] = set()
        self.casts = 0
        self._emitted: list[Node] = []
        for v in graph.inputs:
            if not graph.is_initializer(v):
                self.data.add(id(v))
        for v in graph.values.values():
            if v.elem_type == F32 and (v.producer is None or v.producer.phase == FORWARD):
                self.versions[id(v)] = {F32: v}
        # values read by name inside a subgraph keep their type: their producers run in float32
        self.pinned = {v.name for n in graph.nodes for v in n.implicit_inputs}
        self.pinned |= {name for n in graph.nodes for sub in n.subgraphs() for name in outer_references(sub)}

    def emitted(self) -> list[Node]:
        out, self._emitted = self._emitted, []
        return out

    def get(self, v: Value, elem_type: int) -> Value:
        """`v` as `elem_type`: itself, or its one Cast."""
        versions = self.versions[id(v)]
        if elem_type not in versions:
            source = next(iter(versions.values()))
            op = Builder(self.graph, self.names, prefix=f"{source.name}/{_short(elem_type)}", phase=FORWARD)
            c = op.Cast(source, to=elem_type)
            c.elem_type, c.shape = elem_type, source.shape
            versions[elem_type] = c
            self.versions[id(c)] = versions
            if id(source) in self.data:
                self.data.add(id(c))
            self._emitted.extend(op.emitted)
            self.casts += 1
        return versions[elem_type]

    def node(self, node: Node) -> int:
        """Rewrite one node's inputs (and output types); 1 when it now runs in half."""
        if node.phase != FORWARD:
            return 0
        if any(id(v) in self.data for v in node.all_inputs if v is not None):
            self.data.update(id(v) for v in node.outputs)
        formal = _formal_types(node, self.graph.opset)
        castable = [i for i, v in enumerate(node.inputs)
                    if v is not None and id(v) in self.versions and formal is not None
                    and _allows(formal, i, self.half)]
        mode = self._mode(node, castable, formal)
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            self._rewrite_branches(node)
        if mode == F32:
            for i, v in enumerate(node.inputs):
                if v is not None and v.elem_type == self.half and id(v) in self.versions:
                    node.set_input(i, self.get(v, F32))
            return 0
        if mode is None:
            return 0
        for i in castable:
            if node.inputs[i].elem_type == F32:
                node.set_input(i, self.get(node.inputs[i], self.half))
        bound = {formal.inputs[i]: node.inputs[i].elem_type for i in castable}
        for k, v in enumerate(node.outputs):
            param = formal.outputs[k] if k < len(formal.outputs) else None
            if v.elem_type == F32 and bound.get(param) == self.half:
                v.elem_type = self.half
                self.versions[id(v)] = {self.half: v}
        return 1

    def _rewrite_branches(self, node: Node) -> None:
        """Rewrite each branch of an If as a graph of its own, by the same lists: the outer values it reads stay
        float32 (their producers are pinned), and so do its outputs, so the If's types do not change."""
        for k, a in enumerate(node.attributes):
            if a.type != onnx.AttributeProto.GRAPH:
                continue
            sub = as_graph(a.g, self.graph)
            outer = {v.name for v in sub.inputs}
            counts = cast_to_precision(sub, self.names, self.half, [])
            if counts["casts"]:
                node.attributes[k] = helper.make_attribute(a.name, _as_branch(sub, a.g, outer))

    def _mode(self, node: Node, castable: list[int], formal) -> int | None:
        """F32, half, or None (leave the node as it is)."""
        pinned = any(v.name in self.pinned for v in node.outputs)
        if node.domain not in ("", "ai.onnx") or node.subgraphs() or formal is None or pinned:
            return F32
        if node.op_type in FLOAT32_OPS:
            return F32
        if node.op_type in HALF_OPS:
            kept = self.half == TensorProto.BFLOAT16 and node.op_type in NOT_IN_BF16
            return self.half if castable and not kept else F32
        # the other ops follow their inputs: half when a half input meets only half values and weights
        # (initializers, constants), float32 when it meets a float32 activation (as PyTorch promotes a sum)
        ins = [node.inputs[i] for i in castable]
        if not any(v.elem_type == self.half for v in ins):
            return None
        if any(v.elem_type == F32 and id(v) in self.data for v in ins):
            return F32
        return self.half


def _as_branch(sub: Graph, original: onnx.GraphProto, outer: set[str]) -> onnx.GraphProto:
    """A rewritten branch back as a subgraph: no inputs (the outer values are read by name again), its own
    initializers, and the types of the values it now computes."""
    typed = [v.value_info() for n in sub.nodes for v in n.outputs
             if v.name and v.elem_type and v.name not in {o.name for o in sub.outputs}]
    return helper.make_graph([n.to_proto() for n in sub.nodes], original.name, [],
                             [v.value_info() for v in sub.outputs],
                             [t for name, t in sub.initializers.items() if name not in outer],
                             value_info=typed, sparse_initializer=list(original.sparse_initializer))


class _Formal:
    """Each input's and output's type parameter ('T'), or None for a fixed type; the allowed types by parameter."""

    def __init__(self, inputs: list[str | None], outputs: list[str | None], allowed: dict[str, set[str]]):
        self.inputs, self.outputs, self.allowed = inputs, outputs, allowed


def _formal_types(node: Node, opset: int) -> _Formal | None:
    return _formal(node.op_type, opset, len(node.inputs), len(node.outputs))


@lru_cache(maxsize=None)
def _formal(op_type: str, opset: int, inputs: int, outputs: int) -> _Formal | None:
    """The type parameters of an ai.onnx op's inputs and outputs at `opset` (a variadic last formal repeats)."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}

    def spread(formals, count):
        params = [f.type_str if f.type_str in allowed else None for f in formals]
        variadic = bool(formals) and formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic
        while len(params) < count:
            params.append(params[-1] if variadic and params else None)
        return params
    return _Formal(spread(schema.inputs, inputs), spread(schema.outputs, outputs), allowed)


def _allows(formal: _Formal, i: int, half: int) -> bool:
    param = formal.inputs[i] if i < len(formal.inputs) else None
    return param is not None and TYPE_NAMES[half] in formal.allowed[param] and "tensor(float)" in formal.allowed[param]


def _short(elem_type: int) -> str:
    return {F32: "fp32", TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}[elem_type]


class LossScale(Pass):
    """Scale the loss by the input `loss_scale` and unscale the gradient outputs."""

    name = "loss_scale"
    requires = frozenset({"gradient", "precision"})
    ensures = frozenset({"loss_scale"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph and build.options.precision_settings["loss_scale"] is not None

    def run(self, build: Build) -> None:
        graph, names = build.graph, build.new_names()
        settings = build.options.precision_settings["loss_scale"]
        seeds = [s for s in build.seeds if s.producer is not None and s.producer.name.startswith("seed/")]
        if len(seeds) != 1 or len(build.heads) != 1:
            raise UsageError("loss scaling needs one scalar loss (a --loss-fn, or a scalar --loss) and no fed "
                             "<loss>_grad input; give --loss-scale none")
        if names.taken(LOSS_SCALE_INPUT):
            raise UsageError(f"cannot add the input {LOSS_SCALE_INPUT!r}: the model already has a value of that name")
        names.reserve(LOSS_SCALE_INPUT)
        seed = seeds[0]
        scale = add_scalar_input(graph, LOSS_SCALE_INPUT, np.array(settings["init_scale"], np.float32))
        if seed.elem_type != F32:
            scale = Builder(graph, names, prefix="seed", phase=BACKWARD).Cast(scale, to=seed.elem_type)
        graph.replace_all_uses(seed, scale)
        graph.remove([seed.producer])
        build.seeds = [scale]
        op = Builder(graph, names, prefix="loss_scale", phase=BACKWARD)
        inverse = op.Reciprocal(graph.values[LOSS_SCALE_INPUT])
        casts: dict[int, Value] = {F32: inverse}
        grads = {v.name + GRAD_SUFFIX for v in build.parameters + build.also}
        for k, g in enumerate(graph.outputs):
            if g.name not in grads:
                continue
            if g.elem_type not in casts:
                casts[g.elem_type] = op.Cast(inverse, to=g.elem_type)
            name = g.name
            graph.rename(g, names.fresh(name + "/scaled"))
            unscaled = op.Mul(g, casts[g.elem_type])
            graph.rename(unscaled, name)
            unscaled.elem_type, unscaled.shape = g.elem_type, g.shape
            graph.outputs[k] = unscaled


def add_scalar_input(graph: Graph, name: str, initial: np.ndarray) -> Value:
    """A graph input with a stored initial value (so a caller may omit it)."""
    from onnx import numpy_helper
    graph.initializers[name] = numpy_helper.from_array(initial, name)
    v = Value(name, F32 if initial.dtype == np.float32 else TensorProto.INT64, tuple(initial.shape))
    graph.values[name] = v
    graph.inputs.append(v)
    return v


# Ops onnxruntime's CUDA provider has no bfloat16 kernel for, which gradient rules and the schedule write
# (onnxgrad/cuda.py's table). Comparisons and ArgMax read float32 copies of their bfloat16 inputs: widening is
# exact, so the booleans and indices are the same. Pad (the gradient of Slice, Gather and strided Conv) runs in
# float32 between two Casts: it only moves and adds zeros, so the result is the same bits.
BF16_WIDENED = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "ArgMax", "ArgMin"})
BF16_THROUGH_FLOAT32 = frozenset({"Pad"})


class WidenBfloat16(Pass):
    """Give the nodes of a bf16 graph that the CUDA provider has no bfloat16 kernel for float32 inputs."""

    name = "widen_bf16"
    requires = frozenset({"gradient", "scheduled"})

    def wanted(self, build: Build) -> bool:
        # a bf16 graph built now, or one build-grad wrote and a later command (mirror) takes up
        recorded = json.loads(build.graph.metadata.get(PRECISION_KEY, "{}")).get("precision")
        return "bf16" in (build.options.precision_settings["precision"], recorded)

    def run(self, build: Build) -> None:
        graph, names = build.graph, build.new_names()
        bf16 = TensorProto.BFLOAT16
        wide: dict[int, Value] = {}
        order: list[Node] = []
        widened = 0
        for node in list(graph.nodes):
            through = node.op_type in BF16_THROUGH_FLOAT32
            if node.domain not in ("", "ai.onnx") or not (through or node.op_type in BF16_WIDENED):
                order.append(node)
                continue
            data_bf16 = bool(node.inputs) and node.inputs[0] is not None and _elem_type(node.inputs[0]) == bf16
            for i, v in enumerate(node.inputs):
                if v is None or _elem_type(v) != bf16:
                    continue
                if id(v) not in wide:
                    op = Builder(graph, names, prefix=f"{v.name}/fp32", phase=node.phase)
                    wide[id(v)] = op.Cast(v, to=F32)
                    wide[id(v)].elem_type = F32
                    order.extend(op.emitted)
                node.set_input(i, wide[id(v)])
                widened += 1
            order.append(node)
            if through and data_bf16:
                for k, o in enumerate(node.outputs):
                    if o.elem_type in (bf16, None):
                        # the node now writes a float32 value; a Cast back writes `o`, which keeps its readers
                        w = Value(names.fresh(f"{o.name}/fp32"), F32, o.shape)
                        node.outputs[k] = w
                        w.producer, w.index = node, k
                        graph.values[w.name] = w
                        o.elem_type = bf16
                        order.append(Node("Cast", [w], [o], names.fresh(f"{node.name}/bf16/Cast"),
                                          [helper.make_attribute("to", bf16)], phase=node.phase))
        if widened:
            graph.reorder(order)
        build.record(WidenResult(widened))


VIEWS = frozenset({"Reshape", "Slice", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Expand"})


def _elem_type(v: Value) -> int | None:
    """v's element type; for a value the builder left untyped, that of the view it is made from."""
    while v.elem_type is None and v.producer is not None and v.producer.op_type in VIEWS and v.producer.inputs:
        v = v.producer.inputs[0]
    return v.elem_type
