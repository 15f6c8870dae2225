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
from dataclasses import replace
from functools import lru_cache

import numpy as np
import onnx.defs
from onnx import TensorProto, helper

from ..builder import Builder, Names
from ..contract import BACKWARD, FORWARD, GRAD_SUFFIX, LOSS_SCALE_INPUT, PRECISION_KEY, RECOMPUTE
from ..errors import UsageError
from ..gradient import reaching_heads
from ..ir import Graph, Node, Value, outer_references
from ..memory import plan as plans
from ..pipeline import Build, Pass
from ..rules.subgraphs import as_graph
from ..shapes import type_everything
from .mirror import name_every_node
from .results import PrecisionResult, WidenResult
from ..precision import FLOAT32_OPS, HALF_OPS, HALF_RESULT_OPS, HALF_TYPES, NOT_IN_BF16, SUMS

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
        order.extend(rewrite.narrowed(node))
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
    # a half result whose readers all ran in float32 after all (they read the float32 result) is not needed
    unread = [c.producer for c in rewrite.half_results if not c.uses and not any(c is o for o in graph.outputs)]
    graph.remove(unread)
    return {"half_nodes": in_half, "casts": rewrite.casts - len(unread)}


class _Rewrite:
    """The walk's state: each float32 value's versions by element type (the value and its Casts share one
    dict), and which values depend on the data (graph inputs that are not initializers)."""

    def __init__(self, graph: Graph, names: Names, half: int):
        self.graph, self.names, self.half = graph, names, half
        self.versions: dict[int, dict[int, Value]] = {}
        self.data: set[int] = set()
        self.casts = 0
        self._emitted: list[Node] = []
        self.half_results: list[Value] = []  # the half copies of HALF_RESULT_OPS' results
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

    def narrowed(self, node: Node) -> list[Node]:
        """After a node of HALF_RESULT_OPS that `node` widened from half: a Cast of its result back to half, which
        its forward readers read instead (those that run in float32 get the float32 result back through the
        versions the two share, without a rounding)."""
        y = node.outputs[0] if node.outputs else None
        if (node.op_type not in HALF_RESULT_OPS or node.phase != FORWARD or y is None or y.elem_type != F32
                or id(y) not in self.versions or y.name in self.pinned or not node.inputs
                or not self._came_in_half(node.inputs[0])):
            return []
        readers = [(r, i) for r, i in y.uses if r.phase == FORWARD and i < len(r.inputs)]
        if not readers or len(readers) != len(y.uses):
            return []
        h = self.get(y, self.half)
        for r, i in readers:
            r.set_input(i, h)
        self.half_results.append(h)
        return self.emitted()

    def _came_in_half(self, x: Value | None) -> bool:
        """`x` is the float32 Cast of a value computed in half."""
        versions = self.versions.get(id(x)) if x is not None else None
        return versions is not None and x is not versions.get(self.half) and \
            next(iter(versions.values())).elem_type == self.half

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
        if node.op_type in ("Loop", "Scan") and node.domain in ("", "ai.onnx"):
            self._rewrite_body(node)
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

    def _rewrite_body(self, node: Node) -> None:
        """Rewrite a Loop's or Scan's body by the same lists, as a graph of its own: its inputs (the iteration's
        carries and slices) and outputs stay as they are, so the loop's types do not change and the carries it
        stores for the backward stay float32; what the body computes in between runs in half where allowed."""
        for k, a in enumerate(node.attributes):
            if a.type != onnx.AttributeProto.GRAPH or a.name != "body":
                continue
            sub = as_graph(a.g, self.graph)
            formal = len(a.g.input)
            outer = {v.name for v in sub.inputs[formal:]}
            counts = cast_to_precision(sub, self.names, self.half, [])
            if counts["casts"]:
                body = _as_branch(sub, a.g, outer | {v.name for v in a.g.input})
                body.input.extend(a.g.input)
                node.attributes[k] = helper.make_attribute(a.name, body)

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
            # an op with no half kernel in ONNX (Sin in bfloat16) reads its half inputs as float32
            uncastable = [v for i, v in enumerate(node.inputs) if i not in castable and v is not None]
            return F32 if any(v.elem_type == self.half and id(v) in self.versions for v in uncastable) else None
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


class HalfSums(Pass):
    """Accumulate the backward's sums of half gradients in float32."""

    name = "half_sums"
    requires = frozenset({"gradient", "precision"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph and build.options.precision_settings["precision"] != "fp32"

    def run(self, build: Build) -> None:
        type_everything(build.graph)  # a rule's builder leaves some values untyped
        widened = sum_in_float32(build.graph, build.new_names())
        build.record(replace(build.result(PrecisionResult), widened_sums=widened))


def sum_in_float32(graph: Graph, names: Names) -> int:
    """Give each backward reduction of a half gradient (SUMS: a broadcast's gradient, a scalar weight's, which
    add up every element of an activation) and each Sum of three or more half gradient contributions float32
    inputs, so that they accumulate in float32 rather than rounding at every addition (numpy does; a GPU's
    reduction kernels need not either way, and then this only makes the graph say what they do). The result
    stays float32 for the Casts to float32 that read it (a float32 parameter's gradient: those Casts go) and
    is cast back to half for the other readers. A Sum of two half values is left alone: one addition rounds
    once in half as it does after a float32 addition. Returns the number of nodes rewritten."""
    order: list[Node] = []
    dropped: dict[int, Node] = {}
    outputs = {id(v) for v in graph.outputs}
    widened = 0
    for node in list(graph.nodes):
        if id(node) in dropped:
            continue
        order.append(node)
        y = node.outputs[0] if node.outputs else None
        if (node.phase != BACKWARD or node.domain not in ("", "ai.onnx") or y is None or id(y) in outputs
                or y.elem_type not in HALF_TYPES.values() or not (node.op_type in SUMS or node.op_type == "Sum")):
            continue
        half = y.elem_type
        wide = {id(r): r for r, _ in y.uses if r.op_type == "Cast" and r.attr("to") == F32
                and r.domain in ("", "ai.onnx")}
        narrow = [(r, i) for r, i in y.uses if id(r) not in wide]
        if node.op_type == "Sum" and len(node.inputs) < 3 and narrow:
            continue
        if any(i >= len(r.inputs) for r, i in narrow):  # read by name inside a subgraph: its type must stay
            continue
        order.pop()
        op = Builder(graph, names, prefix=f"{node.name or node.op_type}/fp32", phase=BACKWARD)
        for i, v in enumerate(node.inputs):
            if v is not None and v.elem_type == half:
                c = op.Cast(v, to=F32)
                c.elem_type, c.shape = F32, v.shape
                node.set_input(i, c)
        order.extend(op.emitted)
        order.append(node)
        y.elem_type = F32
        if narrow:
            back = Builder(graph, names, prefix=f"{node.name or node.op_type}/{_short(half)}", phase=BACKWARD)
            h = back.Cast(y, to=half)
            h.elem_type, h.shape = half, y.shape
            for r, i in narrow:
                r.set_input(i, h)
            order.extend(back.emitted)
        for cast in wide.values():  # now a Cast of a float32 value to float32: its readers read the sum itself
            out = cast.outputs[0]
            if id(out) in outputs:
                if id(y) in outputs:
                    continue
                # the sum takes the output's name and place
                k = next(k for k, o in enumerate(graph.outputs) if o is out)
                name = out.name
                graph.rename(out, names.fresh(name + "/cast"))
                graph.rename(y, name)
                graph.outputs[k] = y
                outputs = {id(v) for v in graph.outputs}
            graph.replace_all_uses(out, y)
            dropped[id(cast)] = cast
        widened += 1
    graph.remove(dropped.values())
    graph.reorder([n for n in order if id(n) not in dropped])
    return widened


class RecomputeCasts(Pass):
    """Recompute in the backward, from their inputs, the forward Casts whose results the backward reads, where
    that makes the forward keep less: a widening Cast (half to float32) then keeps its half input, half the
    bytes, and a Cast of a value the step keeps anyway (a weight, a fed input, a value the backward reads
    itself) keeps nothing more. A mixed-precision graph has one such Cast per activation that a float32 op
    reads (BatchNormalization after a half Conv): without this, the forward would keep each of them twice, as
    the half value the next Conv's weight gradient reads and the float32 copy BatchNormalization's gradient
    reads. The plan goes through `memory.plan.apply`, as the mirror's does: the copies run in the recompute
    phase, placed before their first backward reader, and the schedule ties them to the gradient."""

    name = "recompute_casts"
    requires = frozenset({"gradient", "precision"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph and build.options.precision_settings["precision"] != "fp32"

    def run(self, build: Build) -> None:
        graph, names = build.graph, build.new_names()
        reasons = casts_to_recompute(graph)
        if reasons:
            name_every_node(graph, names)
            chosen = {n.name: reasons[id(n)] for n in graph.nodes if id(n) in reasons}
            order = plans.recompute_before_first_use(graph, set(chosen))
            plans.apply(graph, plans.Plan("precision casts", order, chosen), names)
        build.record(replace(build.result(PrecisionResult), recomputed_casts=len(reasons)))


def casts_to_recompute(graph: Graph) -> dict[int, str]:
    """The forward Casts worth recomputing in the backward (id(node) -> why): read directly by a backward
    node, and from an input smaller than the result or kept for the backward anyway."""
    outputs = {id(v) for v in graph.outputs}
    chosen: dict[int, str] = {}
    for n in graph.nodes:
        if n.op_type != "Cast" or n.domain not in ("", "ai.onnx") or n.phase != FORWARD or not n.inputs:
            continue
        x, y = n.inputs[0], n.outputs[0]
        phases = [r.phase for r, _ in y.uses]
        if (x is None or id(y) in outputs or BACKWARD not in phases or RECOMPUTE in phases
                or any(i >= len(r.inputs) for r, i in y.uses if r.phase != FORWARD)):
            continue
        if x.elem_type in HALF_TYPES.values() and y.elem_type == F32:
            chosen[id(n)] = "recomputed: a widening Cast keeps its half input instead of its float32 result"
        elif x.producer is None:
            chosen[id(n)] = "recomputed: its input is kept for the whole step"
        elif any(r.phase == BACKWARD for r, _ in x.uses):
            chosen[id(n)] = "recomputed: the backward keeps its input anyway"
    return chosen


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
