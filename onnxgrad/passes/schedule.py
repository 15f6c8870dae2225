"""The schedule: the order of `graph.nodes` is the order onnxruntime runs them in, under the settings this pass
records in the metadata (contract.RUNTIME_HINTS). The gradient pass appends the backward in reverse forward
order, which frees each activation soon after its last backward use; the mirror pass places each recomputed
node just before its first reader. This pass checks that the order is a valid one, repairs it when a pass left
a node before one of its inputs' producers (a stable topological sort that moves as little as possible), ties
the backward nodes that do not depend on the gradient to it (`anchor_to_gradient`) and those after a MatMul or
Conv onnxruntime fuses into a new node to that node's result (`wait_for_fused_nodes`), and writes the settings.

The file order is the run order only while every backward node depends on the incoming gradient. onnxruntime
numbers the nodes it creates after every node of the file: a function op it expands (SoftmaxCrossEntropyLoss
above opset 13), a fusion at ORT_ENABLE_EXTENDED and above. Until those late-numbered nodes run, the
gradient does not exist, and PRIORITY_BASED runs whatever else is ready: every recomputed node (they read
only stored values) and every backward node that reads only forward values. They then run during the forward
pass and keep their results alive, and the memory a plan saves is spent again."""
from __future__ import annotations

import heapq

from onnx import TensorProto

from ..builder import Builder
from ..contract import BACKWARD, FORWARD, LOSS_KEY, RECOMPUTE, RUNTIME_HINTS, SEED_TIE
from ..ir import Graph, Node, Value
from ..memory.simulate import ALIASES, constant_scalar, folded_transpose, fused_into_reader, shares_buffer
from ..pipeline import Build, Pass
from .results import ScheduleResult


class Schedule(Pass):
    name = "schedule"
    requires = frozenset({"gradient"})
    ensures = frozenset({"scheduled"})

    def run(self, build: Build) -> None:
        graph = build.graph
        if not is_topological(graph):
            graph.reorder(stable_topological_order(graph.nodes))
        names = build.new_names()
        tie_seeds_to_loss(graph, build.seeds, build.heads, names)
        build.record(ScheduleResult(anchor_to_gradient(graph, build.seeds, names),
                                    wait_for_fused_nodes(graph, names), keep_scaled_operands(graph, names)))
        graph.metadata.update(RUNTIME_HINTS)
        graph.metadata[LOSS_KEY] = ",".join(h.name for h in build.heads)


def is_topological(graph: Graph) -> bool:
    """Every node comes after the producers of all its inputs."""
    done: set[int] = set()
    for n in graph.nodes:
        for v in n.all_inputs:
            if v is not None and v.producer is not None and id(v.producer) not in done:
                return False
        done.add(id(n))
    return True


def stable_topological_order(nodes: list[Node]) -> list[Node]:
    """Kahn's algorithm, always taking the ready node that comes first in the current order."""
    position = {id(n): i for i, n in enumerate(nodes)}
    waiting = {}
    readers: dict[int, list[Node]] = {}
    ready = []
    for n in nodes:
        producers = {id(v.producer) for v in n.all_inputs
                     if v is not None and v.producer is not None and id(v.producer) in position}
        waiting[id(n)] = len(producers)
        for p in producers:
            readers.setdefault(p, []).append(n)
        if not producers:
            heapq.heappush(ready, (position[id(n)], n))
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for r in readers.get(id(n), ()):
            waiting[id(r)] -= 1
            if waiting[id(r)] == 0:
                heapq.heappush(ready, (position[id(r)], r))
    return order


def tie_seeds_to_loss(graph: Graph, seeds: list[Value], heads: list[Value], names) -> int:
    """Make the backward start only once the loss exists: every reader of a seed reads it through a Reshape
    that waits for the loss (as `anchor_to_gradient` ties a node to a gradient). The seed of a scalar loss is
    a constant, so without this the gradient's first nodes depend on the labels but not on the forward pass,
    and whenever onnxruntime holds the file order back (a node it numbers after the file's nodes, as its
    MatMul + Transpose fusion makes of GPT-2's tied output layer), it runs them during the forward: GPT-2's
    cross-entropy gradient wrote its 196 MiB one-hot gradient before the logits existed. Returns the number
    of seeds tied."""
    # (a head that may hold no element has no element to wait for)
    heads = [h for h in heads if h.producer is not None and h.shape is not None
             and not any(d == 0 or not isinstance(d, int) for d in h.shape)]
    if not heads:
        return 0
    position = {id(n): k for k, n in enumerate(graph.nodes)}
    last_head = max(position[id(h.producer)] for h in heads)
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None:
                readers.setdefault(id(v), []).append(n)
    before: dict[int, list[Node]] = {}  # id(first reader) -> the tie's nodes, placed just before it
    tied = 0
    for seed in seeds:
        users = [n for n in readers.get(id(seed), []) if seed not in n.implicit_inputs]
        if not users or all(SEED_TIE in n.name for n in users):
            continue  # none, or tied already (a training graph taken up again)
        first = min(users, key=lambda n: position[id(n)])
        if position[id(first)] <= last_head:
            continue
        op = Builder(graph, names, prefix=f"{seed.name}/{SEED_TIE}", phase=BACKWARD)
        zero = _zero_from(op, heads[0])
        for h in heads[1:]:
            zero = op.Add(zero, _zero_from(op, h))
        tied_seed = _waiting(op, seed, zero)
        for n in users:
            for i, v in enumerate(n.inputs):
                if v is seed:
                    n.set_input(i, tied_seed)
        before.setdefault(id(first), []).extend(op.emitted)
        tied += 1
    if tied:
        emitted = {id(m) for ms in before.values() for m in ms}
        graph.reorder([m for n in graph.nodes if id(n) not in emitted for m in before.get(id(n), []) + [n]])
    return tied


def anchor_to_gradient(graph: Graph, seeds: list[Value], names) -> int:
    """Make every backward or recomputed node that reads a forward value but nothing that depends on the loss,
    and writes a result large enough to matter, wait for the gradient computed just before it in the file: one
    of its forward inputs is read through a Reshape to its own shape plus 0 (a Reshape of a forward value takes
    its own target plus 0 instead), the 0 being the ArgMax of one element of that gradient. Reshape shares its
    input's buffer in onnxruntime, and the one-element slice costs nothing, so the node only gains an ordering
    edge. A node depends on the gradient when it reads, through any path, one of the `seeds` (the constant 1 of
    a scalar loss, or a fed `<loss>_grad`). A view (Reshape, Identity, ...) is never the gradient tied to:
    onnxruntime's basic optimizations replace such nodes by new ones numbered after every node of the file,
    which then run late and hold back the tied node, while the nodes after it run early (on a ResNet-50 near its
    floor that kept 20% more than the plan). Nor is a Transpose (UNSTABLE_SOURCES): the transpose optimizer
    pushes it through the tie's Slice, and the tie then waits for a new Transpose (a dynamo ResNet-50 at 0.7x
    kept 39% more than its budget). A view (Reshape, Squeeze, ...) whose every reader depends on the gradient is
    not tied: it holds no buffer of its own and its readers wait anyway (tied through a Reshape before it, as
    every view once was, a Reshape made a pair onnxruntime merged into one late-numbered node without the tie: a
    depthwise Conv's weight gradient then waited for it while all 49 slices of dy ran). Returns the number of
    nodes so tied."""
    waits_anyway = _views_read_after_the_gradient(graph, seeds)
    dependent = {id(v) for v in seeds}
    order: list[Node] = []
    zero_of: dict[int, Value] = {}  # id(gradient value) -> its one-element ArgMax (an int64 [1] holding 0)
    source: Value | None = None
    tied = 0
    for node in list(graph.nodes):
        inputs = [v for v in node.all_inputs if v is not None]
        if (node.phase in (BACKWARD, RECOMPUTE) and source is not None and _large(node)
                and not any(id(v) in dependent for v in inputs) and id(node) not in waits_anyway):
            # a float activation: shape tensors stay as they are (small, and onnxruntime's Reshape fusion
            # mistypes a Reshape whose shape input is itself tied)
            # (a forward value, else a graph input or weight: a recomputed first layer reads only those, and
            # untied it runs as soon as anything holds the file order back, every copy at once)
            floats = [i for i, v in enumerate(node.inputs) if v is not None and v.is_float]
            i = next((i for i in floats if node.inputs[i].producer is not None
                      and node.inputs[i].producer.phase in (FORWARD, RECOMPUTE)),
                     next((i for i in floats if node.inputs[i].producer is None), None))
            # a node that reads no float value (the cross-entropy gradient's one-hot Equal of the labels, 49 MiB
            # on GPT-2; a ConstantOfShape) waits through its first input when that is int64 data: x + 0
            first = node.inputs[0] if node.inputs else None
            added = (i is None and not floats and node.op_type not in SHAPE_READERS and first is not None
                     and first.elem_type == TensorProto.INT64 and first.shape is not None and len(first.shape) >= 1)
            if i is not None or added:
                op = Builder(graph, names, prefix=f"{node.name}/after_gradient", phase=node.phase)
                if id(source) not in zero_of:
                    zero_of[id(source)] = _zero_from(op, source)
                if i == 0 and node.op_type == "Reshape" and len(node.inputs) > 1 and node.inputs[1] is not None:
                    # a Reshape waits through its target: target + 0. A Reshape read through the tie's Reshape
                    # is a pair onnxruntime merges (at ORT_ENABLE_BASIC) into one node with a constant target,
                    # numbered after the file's nodes: the tie is lost and the node runs last (a grouped
                    # Conv's weight gradient then kept x and a copy of dy to the end: 40.5 MiB measured on a
                    # 4-layer stack where 28.0 were simulated)
                    target = node.inputs[1]
                    node.set_input(1, op.Add(target, zero_of[id(source)]))
                    node.inputs[1].elem_type, node.inputs[1].shape = target.elem_type, target.shape
                elif i is not None:
                    node.set_input(i, _waiting(op, node.inputs[i], zero_of[id(source)]))
                else:
                    node.set_input(0, op.Add(first, zero_of[id(source)]))
                    node.inputs[0].elem_type, node.inputs[0].shape = first.elem_type, first.shape
                order.extend(op.emitted)
                tied += 1
        order.append(node)
        if any(id(v) in dependent for v in node.all_inputs if v is not None):
            for o in node.outputs:
                dependent.add(id(o))
                if (node.phase == BACKWARD and o.name and o.is_float and o.shape is not None
                        and not shares_buffer(node) and node.op_type not in UNSTABLE_SOURCES
                        and not _folds_a_transpose(node)):
                    source = o
    if tied:
        graph.reorder(order)
    return tied


def _views_read_after_the_gradient(graph: Graph, seeds: list[Value]) -> set[int]:
    """ids of the view nodes (ALIASES, Identity) that do not depend on the gradient but whose outputs are read,
    and only read, by nodes that do; no graph output among them."""
    dependent = {id(v) for v in seeds}
    readers: dict[int, list[Node]] = {}
    for node in graph.nodes:
        for v in node.all_inputs:
            if v is not None:
                readers.setdefault(id(v), []).append(node)
        if any(v is not None and id(v) in dependent for v in node.all_inputs):
            dependent.update(id(o) for o in node.outputs)
    outputs = {id(v) for v in graph.outputs}
    views = set()
    for node in graph.nodes:
        if ((node.op_type in ALIASES or node.op_type == "Identity") and node.domain in ("", "ai.onnx")
                and not any(id(o) in dependent or id(o) in outputs for o in node.outputs)):
            read = [r for o in node.outputs for r in readers.get(id(o), [])]
            if read and all(any(v is not None and id(v) in dependent for v in r.all_inputs) for r in read):
                views.add(id(node))
    return views


def wait_for_fused_nodes(graph: Graph, names) -> int:
    """Make every large backward or recomputed node that follows, in the file, a MatMul or Conv onnxruntime fuses
    into a new node, and does not depend on it, wait for its result (the tie of `anchor_to_gradient`).
    onnxruntime numbers the nodes its fusions make after every node of the file, and PRIORITY_BASED then runs one
    only once no other node is ready: every node after it that does not need it runs first, and holds its result
    until it does. The nodes (`_fused_nodes`): a backward MatMul reading a Transpose it folds (FusedMatMul), a
    backward or recomputed MatMul whose only reader adds a bias or scales it (Gemm, FusedMatMul), a backward or
    recomputed Conv whose only reader is an activation or an Add (FusedConv); for the last two the reader's
    result is waited for. In an attention layer's backward the transposed products are the score gradients,
    eight hidden states each at width 64: a small DistilBERT's training graph held 63.4 MiB where 54.2 were
    simulated. A MobileViT's least plan, recomputing a residual block seven times, held 396 MiB where 291 were
    simulated, 286 with its Convs waited for. A fused node that itself follows one is tied to it, so they run in
    the file's order too. Returns the number of nodes so tied."""
    late = _fused_nodes(graph)
    order: list[Node] = []
    fused: Value | None = None  # the result of the last fused node
    at = 0  # its place in `order`: the one-element ArgMax is taken just after it, and so holds nothing alive
    after: set[int] = set()  # ids of the values that depend on it
    zero: Value | None = None
    tied = 0
    for node in list(graph.nodes):
        inputs = [v for v in node.all_inputs if v is not None]
        reads_it = any(id(v) in after for v in inputs)
        if fused is not None and node.phase in (BACKWARD, RECOMPUTE) and not reads_it and _large(node):
            # (not an operand onnxruntime folds into this node: a Transpose, a MatMul fused into it)
            i = next((i for i, v in enumerate(node.inputs) if v is not None and v.is_float
                      and v.producer is not None and not (i == 0 and node.op_type == "Reshape")
                      and not folded_transpose(v.producer) and late.get(id(node)) is not v.producer), None)
            if i is not None:
                if zero is None:
                    op = Builder(graph, names, prefix=f"{fused.name}/fused", phase=fused.producer.phase)
                    zero = _zero_from(op, fused)
                    order[at:at] = op.emitted
                op = Builder(graph, names, prefix=f"{node.name}/after_fused", phase=node.phase)
                node.set_input(i, _waiting(op, node.inputs[i], zero))
                order.extend(op.emitted)
                tied += 1
                reads_it = True
        order.append(node)
        if reads_it:
            after.update(id(o) for o in node.outputs)
        if id(node) in late:
            fused, at, after, zero = node.outputs[0], len(order), {id(node.outputs[0])}, None
    if tied:
        graph.reorder(order)
    return tied


# Readers onnxruntime fuses a Conv into when the Conv's result has no other reader (FusedConv: an activation, or
# an Add as its sum input)
CONV_FUSED_READERS = frozenset({"Add", "Relu", "Sigmoid", "Tanh", "LeakyRelu", "Clip", "HardSigmoid"})


def _fused_nodes(graph: Graph) -> dict[int, Node]:
    """{id(node): the MatMul or Conv fused into it} for the nodes onnxruntime replaces by a late-numbered one: a
    backward MatMul reading a folded Transpose (FusedMatMul; the MatMul itself), the reader a backward or
    recomputed MatMul is fused into (`fused_into_reader`: Gemm, or FusedMatMul with alpha), the reader a backward
    or recomputed Conv is fused into (FusedConv: `CONV_FUSED_READERS`)."""
    outputs = {id(v) for v in graph.outputs}
    constants = set(graph.initializers)
    late: dict[int, Node] = {}
    for node in graph.nodes:
        if (node.op_type == "Conv" and node.domain in ("", "ai.onnx") and node.phase in (BACKWARD, RECOMPUTE)
                and node.outputs[0].name and id(node.outputs[0]) not in outputs and len(node.outputs[0].uses) == 1):
            reader = node.outputs[0].uses[0][0]
            if (reader.op_type in CONV_FUSED_READERS and reader.domain in ("", "ai.onnx") and reader.outputs
                    and reader.outputs[0].name):
                late[id(reader)] = node
            continue
        if (node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.phase not in (BACKWARD, RECOMPUTE)
                or not node.outputs[0].name or not node.outputs[0].is_float or node.outputs[0].shape is None):
            continue
        if fused_into_reader(node, outputs, constants):
            reader = node.outputs[0].uses[0][0]
            if reader.outputs and reader.outputs[0].name:
                late[id(reader)] = node
        elif node.phase == BACKWARD and any(v is not None and v.producer is not None and folded_transpose(v.producer)
                                            for v in node.inputs[:2]):
            late[id(node)] = node
    return late


def keep_scaled_operands(graph: Graph, names) -> int:
    """Make every backward or recomputed MatMul that reads a value scaled by a constant scalar read it through
    a Reshape to its own shape (+0, the ArgMax of one of its elements), so that it reads the scaled value.
    onnxruntime's MatMulScaleFusion otherwise rewires such a MatMul to the unscaled input, moving the scale
    into FusedMatMul's alpha, and keeps the Mul for its other readers: a recomputed attention score that reads
    the scaled keys kept the unscaled keys alive from the forward pass to the backward, a second copy the plan
    never held (a small DeiT's 0.7x plan measured 1.13 of its budget). Returns the number of reads so kept."""
    constants = set(graph.initializers)
    order: list[Node] = []
    kept = 0
    for node in list(graph.nodes):
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.phase in (BACKWARD, RECOMPUTE):
            for i, v in enumerate(node.inputs[:2]):
                if v is not None and v.producer is not None and _scaled(v.producer, constants):
                    op = Builder(graph, names, prefix=f"{node.name}/unscaled_{i}", phase=node.phase)
                    node.set_input(i, _waiting(op, v, _zero_from(op, v)))
                    order.extend(op.emitted)
                    kept += 1
        order.append(node)
    if kept:
        graph.reorder(order)
    return kept


def _scaled(node: Node, constants: set[str]) -> bool:
    """A Mul by a constant scalar, or a Div by one: the scales MatMulScaleFusion moves into a MatMul."""
    if node.domain not in ("", "ai.onnx") or len(node.inputs) != 2 or node.op_type not in ("Mul", "Div"):
        return False
    scales = node.inputs if node.op_type == "Mul" else node.inputs[1:]
    return any(v is not None and constant_scalar(v, constants) for v in scales)


# Producers whose results onnxruntime's optimizers rewrite into new, late-numbered nodes when a tie reads
# them: the transpose optimizer pushes a Transpose through the tie's Slice.
UNSTABLE_SOURCES = frozenset({"Transpose"})


def _folds_a_transpose(node: Node) -> bool:
    """A Gemm that reads a Transpose's output: onnxruntime folds that Transpose into the Gemm's trans flags only
    while nothing else reads the Gemm's result. A tie reading it kept GPT-2's 147 MiB transposed embedding table
    alive through the backward of its budgeted step graphs (1.19x the budget)."""
    return node.op_type == "Gemm" and any(v is not None and v.producer is not None
                                          and v.producer.op_type == "Transpose" for v in node.inputs[:2])


# Ops whose first input is read as a shape, axes or indices that onnxruntime folds when it is constant
SHAPE_READERS = frozenset({"Reshape", "Expand", "Tile", "Slice", "Squeeze", "Unsqueeze", "Range", "Resize", "Pad",
                           "Shape", "Size", "NonZero", "Gather", "GatherElements", "GatherND", "OneHot"})
TIE_MIN_BYTES = 64 * 1024  # smaller results cost little memory wherever they run


def _large(node: Node) -> bool:
    """A node worth tying: an output of at least TIE_MIN_BYTES, or of a size not known statically."""
    sizes = [v.nbytes for v in node.outputs if v.name]
    return any(b is None or b >= TIE_MIN_BYTES for b in sizes)


def _waiting(op: Builder, x: Value, zero: Value) -> Value:
    """x read through Reshape(x, Shape(x) + zero): the same tensor in x's buffer, made only once `zero` exists."""
    y = op.Reshape(x, op.Add(op.Shape(x), zero))
    y.elem_type, y.shape = x.elem_type, x.shape
    return y


def _zero_from(op: Builder, g: Value) -> Value:
    """An int64 [1] tensor holding 0 that onnxruntime can only compute once `g` exists."""
    rank = len(g.shape)
    one = g
    if rank:
        one = op.Slice(g, op.ints([0] * rank), op.ints([1] * rank), op.ints(range(rank)))
    flat = op.Reshape(one, op.ints([-1]))
    if g.elem_type not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        flat = op.Cast(flat, to=TensorProto.FLOAT)  # onnxruntime's ArgMax takes neither bfloat16 nor every int type
    return op.ArgMax(flat, axis=0, keepdims=1)
