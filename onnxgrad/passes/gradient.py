"""The gradient pass: choose the parameters, seed the heads, append the backward graph (`gradient.differentiate`)
and name each gradient as an output `<x>_grad`."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import segments
from ..builder import Builder, Names
from ..contract import BACKWARD, FORWARD, GRAD_SUFFIX
from ..errors import UnsupportedError, UsageError
from ..gradient import differentiate, reaching_heads
from ..ir import Graph, Node, Value, names_defined_in
from ..memory.budget import MirrorOptions, parse_budget
from ..memory.simulate import ALIASES
from ..pipeline import Build, Pass
from .results import GradientResult


class Gradient(Pass):
    name = "gradient"
    requires = frozenset({"graph", "heads", "lowered"})
    ensures = frozenset({"gradient"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph

    def run(self, build: Build) -> None:
        o, graph, heads = build.options, build.graph, build.heads
        names = build.new_names()
        for node in graph.nodes:  # names the rewrites below make must not shadow one a subgraph defines
            for sub in node.subgraphs():
                for name in names_defined_in(sub):
                    names.reserve(name)
        bound_loops(graph, o.loop_bounds, names)
        loop_segments = loop_schemes = None
        if o.mirror is not None:  # recomputation asked for: loops store a carry per segment, not per iteration
            loop_schemes = segment_loops(graph, build.reaches_loss, names, o.mirror, MirrorOptions.of(o.mirror_options))
            loop_segments = {name: s.lengths[0] for name, s in loop_schemes.items() if s.lengths}
            if loop_segments:
                build.reaches_loss = reaching_heads(graph, heads)
        xs, constants = select_parameters(graph, heads, build.reaches_loss, o.requires_grad, o.frozen)
        copies = parameter_copies(graph, xs)
        if o.tie_copies and copies:
            xs = tie_copies(graph, xs, copies, names)
            build.reaches_loss = reaching_heads(graph, heads)
        us = [find_value(graph, name, "--also-grad") for name in o.also_grad or []]
        for u in us:
            if u.elem_type is not None and not u.is_float:
                raise UsageError(f"--also-grad {u.name}: has a non-floating-point type, so no gradient")

        for v in xs + us:
            name = v.name + GRAD_SUFFIX
            if names.taken(name):
                raise UsageError(f"cannot name a gradient output {name!r}: the model already has a value of that name")
            names.reserve(name)

        head_grads = [seed_gradient(graph, h, names, o.feed_head_grads) for h in heads]
        build.seeds = head_grads
        result = differentiate(graph, heads, head_grads, xs + us, names, build.reaches_loss)
        for x in xs:
            if result.grads[x.name] is None:
                raise UsageError(f"{x.name!r} is not reachable from the loss {heads[0].name!r}: it has no gradient")
        finalize_outputs(graph, xs, us, result.grads, names)
        inputs = {id(v) for v in graph.inputs}
        graph.inputs.extend(x for x in xs if graph.is_initializer(x) and id(x) not in inputs)
        build.parameters, build.also = xs, us
        build.record(GradientResult(tuple(x.name for x in xs), tuple(u.name for u in us),
                                    dict(sorted(result.rules_used.items())), loop_segments, loop_schemes,
                                    constants, copies))


def select_parameters(graph: Graph, heads: list[Value], reaches_loss: set[int], requires_grad,
                      frozen) -> tuple[list[Value], tuple[str, ...]]:
    """The xs: requested names, or every floating-point initializer with a differentiable path to the loss
    (`reaches_loss`: the ids of the values the heads depend on) that is not a scalar constant; and the scalar
    constants so left out (`scalar_constants`; none when names are requested)."""
    frozen_set = set(frozen or [])
    for name in frozen_set:
        find_value(graph, name, "--frozen")
    constants: tuple[str, ...] = ()
    if requires_grad:
        xs = []
        for name in requires_grad:
            v = find_value(graph, name, "--requires-grad")
            if not (graph.is_initializer(v) or v in graph.inputs):
                raise UsageError(f"--requires-grad {name}: not an initializer or a graph input "
                                 f"(use --also-grad for intermediate values)")
            if v.elem_type is not None and not v.is_float:
                raise UsageError(f"--requires-grad {name}: {no_gradient_type(v.elem_type)}, so no gradient")
            if id(v) not in reaches_loss:
                not_reachable(graph, v, heads[0])
            if name not in frozen_set and v not in xs:
                xs.append(v)
    else:
        candidates = [name for name in graph.initializers if name not in frozen_set
                      and graph.values[name].is_float and id(graph.values[name]) in reaches_loss]
        constants = scalar_constants(graph, candidates)
        xs = [graph.values[name] for name in candidates if name not in constants]
    # parameters in initializer order, then graph inputs in input order
    order = {name: i for i, name in enumerate(graph.initializers)}
    order.update({v.name: len(order) + i for i, v in enumerate(graph.inputs) if v.name not in order})
    return sorted(xs, key=lambda v: order[v.name]), constants


COPY_MIN_ELEMENTS = 4096  # smaller matrices may match by chance or by design (a shared init)


def parameter_copies(graph: Graph, xs: list[Value]) -> tuple[tuple[str, str, str], ...]:
    """Pairs of parameter matrices that hold the same values, or one the other's transpose, as (first, second,
    "equal" or "transposed") in parameter order: most likely one weight the model ties that its exporter wrote
    twice (the TorchScript exporter writes GPT-2's output layer as a transposed copy of the token table). Each is
    then trained as a parameter of its own, and the two drift apart from the first update. Matrices of at least
    COPY_MIN_ELEMENTS whose values are not all equal (zeros or ones as an initial value tie nothing), matched on
    two corners before a full comparison."""
    arrays = {}
    for x in xs:
        t = graph.initializers.get(x.name)
        if t is None or len(t.dims) != 2 or t.dims[0] * t.dims[1] < COPY_MIN_ELEMENTS or x.elem_type is None:
            continue
        a = _matrix(t)
        if a is not None:
            arrays[x.name] = a
    seen: dict[tuple, list[str]] = {}
    pairs = []
    for name, a in arrays.items():  # each against the matrices before it
        for how, view in (("equal", a), ("transposed", a.T)):
            for other in seen.get(_corners(view), ()):
                b = arrays[other]
                if np.array_equal(b, view) and b.min() != b.max():
                    pairs.append((other, name, how))
        seen.setdefault(_corners(a), []).append(name)
    return tuple(pairs)


def _corners(m: np.ndarray) -> tuple:
    """A matrix's shape and its two 4 x 4 corners: a cheap key that equal matrices share."""
    return m.shape, m[:4, :4].tobytes(), m[-4:, -4:].tobytes()


def tie_copies(graph: Graph, xs: list[Value], copies, names: Names) -> list[Value]:
    """Read the second parameter of each pair as the first, or as Transpose(first) placed before its first
    reader, and drop it: the weight is one parameter again, and its gradient sums both uses. Returns the
    parameters left. A copy that a subgraph reads by name stays as it is."""
    gone: set[str] = set()
    for first, second, how in copies:
        if first in gone or second in gone:
            continue
        f, s = graph.values[first], graph.values[second]
        if any(i >= len(node.inputs) for node, i in s.uses) or s in graph.outputs:
            continue
        if how == "transposed":
            readers = {id(node) for node, _ in s.uses}
            t = Value(names.fresh(f"{second}_tied"), f.elem_type, None if f.shape is None else tuple(reversed(f.shape)))
            node = Node("Transpose", [f], [t], names.fresh(f"{second}_tied/Transpose"),
                        [helper.make_attribute("perm", [1, 0])], phase=FORWARD)
            at = next((n for n in graph.nodes if id(n) in readers), None)
            graph.replace_all_uses(s, t)
            if at is None:
                graph.add_node(node)
            else:
                graph.insert_before(at, [node])
        else:
            graph.replace_all_uses(s, f)
        del graph.initializers[second]
        del graph.values[second]
        graph.inputs = [v for v in graph.inputs if v is not s]
        gone.add(second)
    return [x for x in xs if x.name not in gone]


def _matrix(t) -> np.ndarray | None:
    """The initializer's values, without a copy where they are raw bytes; None when they are not in memory."""
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return None
    try:
        if t.raw_data:
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            return np.frombuffer(t.raw_data, dtype=dtype).reshape(tuple(t.dims))
        return numpy_helper.to_array(t)
    except (KeyError, TypeError, ValueError):  # an element type numpy does not hold
        return None


def scalar_constants(graph: Graph, candidates: list[str]) -> tuple[str, ...]:
    """The initializers of rank 0 among the parameter `candidates` (floating-point, on a path to the loss), when
    some candidate is a tensor: not parameters by default. torch.onnx's dynamo exporter stores a model's
    constants this way (GELU's exponent 3 and its coefficients, the attention scale, the mask's fill value
    -3.4e38); trained as parameters, one SGD step moved the fill value to -inf and GPT-2's next loss was NaN. A
    model of scalars alone keeps them as its parameters; a learned scalar beside tensors is named with
    --requires-grad."""
    scalars = tuple(name for name in candidates if not graph.initializers[name].dims)
    return scalars if len(scalars) < len(candidates) else ()


def no_gradient_type(elem_type: int) -> str:
    """'has an integer type', or the name of a type gradients do not flow through (float8, float4, bool)."""
    dtype = helper.tensor_dtype_to_np_dtype(elem_type)
    if dtype.kind in "iu":
        return "has an integer type"
    name = helper.tensor_dtype_to_string(elem_type).split(".")[-1].lower()
    return f"has the element type {name} (gradients flow through float, double, float16 and bfloat16)"


def not_reachable(graph: Graph, v: Value, head: Value) -> None:
    """Raise why `v` gets no gradient: nothing connects it to the loss (a usage error), or the loss reads it
    only through inputs that no rule differentiates (unsupported), e.g. an inference BatchNormalization's mean."""
    from ..gradient import differentiable_edge
    stopped = [(n, i) for n, i in v.uses if not differentiable_edge(n, i, graph.opset)
               and any(id(o) in graph_reaches(graph, head) for o in n.outputs)]
    if stopped:
        n, i = stopped[0]
        raise UnsupportedError(f"--requires-grad {v.name}: the loss {head.name!r} depends on it only through "
                               f"input {i} of {n.op_type} node {n.name!r}, which no gradient rule differentiates")
    raise UsageError(f"--requires-grad {v.name}: not reachable from the loss {head.name!r} through differentiable ops")


def graph_reaches(graph: Graph, head: Value) -> set[int]:
    """ids of every value the head depends on through any edge, differentiable or not."""
    needed = {id(head)}
    for n in reversed(graph.nodes):
        if any(id(o) in needed for o in n.outputs):
            needed.update(id(x) for x in n.all_inputs if x is not None)
    return needed


def seed_gradient(graph: Graph, head: Value, names: Names, feed: bool = False) -> Value:
    """1 for a scalar loss; otherwise (or when asked) a new graph input `<head>_grad` that the caller feeds."""
    if head.shape == () and not feed:
        return Builder(graph, names, prefix="seed", phase=BACKWARD).const(1.0, head.elem_type)
    name = head.name + GRAD_SUFFIX
    if names.taken(name):
        raise UsageError(f"cannot add the input {name!r} for the gradient of {head.name!r}: the name is taken")
    names.reserve(name)
    v = Value(name, head.elem_type, head.shape)
    graph.values[name] = v
    graph.inputs.append(v)
    return v


def finalize_outputs(graph: Graph, xs, us, grads: dict[str, Value | None], names: Names) -> None:
    """Name each gradient output; a value claimed twice, or not ours to rename, goes out through Identity."""
    claimed = {id(v) for v in graph.outputs} | {id(v) for v in graph.inputs}
    op = Builder(graph, names, prefix="grad_out", phase=BACKWARD)
    for v in list(xs) + list(us):
        g = grads[v.name]
        if g is None:  # an --also-grad value that the loss does not depend on
            g = op.ConstantOfShape(op.Shape(v), value=helper.make_tensor("", v.elem_type, [1], [0]))
        target = v.name + GRAD_SUFFIX
        g = _past_view(graph, g, v, claimed)
        if id(g) in claimed or g.producer is None or g.producer.phase != BACKWARD:
            g = op.Identity(g)
        graph.rename(g, target)
        g.elem_type, g.shape = v.elem_type, v.shape
        claimed.add(id(g))
        graph.outputs.append(g)


def _past_view(graph: Graph, g: Value, like: Value, claimed: set[int]) -> Value:
    """`g`, or the input of the Reshape-like node that makes it when that input already has `like`'s shape:
    onnxruntime gives a graph output a buffer of its own, so a view as the last node of a gradient copies it
    (measured: Reshape and Unsqueeze into an output hold both buffers; Identity does not, it is removed)."""
    node = g.producer
    if node is None or node.phase != BACKWARD or node.op_type not in ALIASES or node.domain or g.uses:
        return g
    source = node.inputs[0]
    if (source is None or id(source) in claimed or source.shape is None or like.shape is None
            or tuple(source.shape) != tuple(like.shape) or None in like.shape or source.elem_type != like.elem_type):
        return g
    graph.remove([node])
    return source


def bound_loops(graph: Graph, bounds: dict[str, int], names: Names) -> None:
    """--loop-bound NAME=N: Loop node NAME runs at most N iterations (its trip count becomes N, or the least of
    N and the trip count it has), so the carries its gradient stores are bounded."""
    loops = {n.name: n for n in graph.nodes if n.op_type == "Loop" and not n.domain}
    for name, bound in bounds.items():
        node = loops.get(name)
        if node is None:
            known = ", ".join(sorted(repr(k) for k in loops if k)) or "none"
            raise UsageError(f"--loop-bound {name}={bound}: no Loop node of that name (Loop nodes: {known})")
        limit = Value(names.fresh(f"{name}_bound"), TensorProto.INT64, ())
        graph.initializers[limit.name] = numpy_helper.from_array(np.array(bound, np.int64), limit.name)
        graph.values[limit.name] = limit
        if node.inputs[0] is not None:
            least = Value(names.fresh(f"{name}_bounded_trips"), TensorProto.INT64, ())
            graph.insert_before(node, [Node("Min", [node.inputs[0], limit], [least], names.fresh(f"{name}_bound/Min"))])
            limit = least
        node.set_input(0, limit)


def segment_loops(graph: Graph, reaches_loss: set[int], names: Names, policy: str,
                  options: MirrorOptions) -> dict[str, segments.LoopScheme]:
    """Rewrite the loops on the gradient's path into loops over segments (segments.py), and say how each runs:
    by the schemes the options give (the budget's retry, api.py); with a budget in bytes, unsegmented first (the
    least recomputation, which the retry steps up from); otherwise √T segments."""
    trips = segments.segmentable(graph, reaches_loss)
    if options.loops is not None:
        chosen = {name: segments.LoopScheme(t, tuple(options.loops.get(name, ()))) for name, t in trips.items()}
    elif policy == "budget" and not parse_budget(options.budget or "auto").auto:
        chosen = {name: segments.LoopScheme(t) for name, t in trips.items()}
    else:
        chosen = {name: segments.schemes(t)[1] for name, t in trips.items()}
    for name, scheme in chosen.items():
        segments.apply(graph, name, scheme, names)
    return chosen


def find_value(graph: Graph, name: str, flag: str) -> Value:
    v = graph.values.get(name)
    if v is None:
        raise UsageError(f"{flag} {name}: no value of that name in the model")
    return v
