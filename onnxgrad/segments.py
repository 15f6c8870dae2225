"""Segment checkpointing of loops: a Loop (or Scan) of T iterations becomes one of T/k segments of k iterations.

Differentiated as it is, a Loop stores its carry at every iteration (rules/loops.py). Written as a loop over
segments whose body is a loop over the segment's iterations, the outer loop stores only the carry each segment
starts from, and the backward of each segment recomputes the segment's inner loop, which stores its k carries
for the time that segment's backward runs: T/k + k carries alive instead of T, about 2√T at k = √T, for one
more forward pass of the loop. No gradient code is involved: both loops are differentiated by their rules.

Segmenting the outer loop again nests the levels: T = s * k2 * k1 runs as s segments, each a loop of k2
segments of k1 iterations. The forward stores s carries, the backward of a segment recomputes its k2, and the
backward of each of those its k1: about s + k2 + k1 carries alive, for one more forward pass of the loop per
level, the trade revolve makes between slots and passes within what nested equal segments can express.

`plan` decides (which loops, which k, √T by default); `schemes` lists a loop's schemes from the least
recomputation up (unsegmented, one level, two, ...), `next_schemes` steps a set of loops one level further (the
budget's retry, api.py), and `apply` rewrites one loop by its scheme, with `segment` (a Loop) or `segment_scan`
(a Scan) per level. Only Loops with a constant trip count that nothing ends early, and Scans whose scanned
tensors have static shapes, are segmented, and k divides T, so every segment has the same length (a loop's scan
outputs must have one shape across iterations); a T with no divisor near √T (a prime) is left as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .builder import Names
from .ir import Graph, Node, Value, attach_implicit_inputs, constant_value, known_value


@dataclass(frozen=True)
class LoopScheme:
    """How one loop of `trips` iterations is checkpointed: `lengths`, the segment lengths innermost first (() the
    loop as it is, (k,) T/k segments of k, (k1, k2) T/(k1 k2) segments of k2 segments of k1)."""

    trips: int
    lengths: tuple[int, ...] = ()

    @property
    def segments(self) -> int:
        """The outermost loop's iterations: the carries the forward stores."""
        return self.trips // math.prod(self.lengths)

    @property
    def carries(self) -> int:
        """Carries alive at most, in the count the docstring above gives: the stored ones and one level's each."""
        return self.segments + sum(self.lengths)

    @property
    def extra_passes(self) -> int:
        """Forward passes of the loop beyond the one an unsegmented loop's gradient runs: one per level."""
        return len(self.lengths)

    def describe(self) -> str:
        if not self.lengths:
            return f"{self.trips} iterations unsegmented"
        inner = " segments of ".join(str(k) for k in reversed(self.lengths))
        return f"{self.trips} iterations as {self.segments} segments of {inner}"

    def record(self) -> dict:
        return {"trips": self.trips, "segments": [self.segments, *reversed(self.lengths)], "carries": self.carries,
                "extra_passes": self.extra_passes}


def plan(graph: Graph, on_path: set[int]) -> dict[str, int]:
    """{Loop or Scan node name: k} for the loops on the gradient's path worth segmenting (k near √T)."""
    return {name: _segment_length(trips) for name, trips in segmentable(graph, on_path).items()}


def segmentable(graph: Graph, on_path: set[int]) -> dict[str, int]:
    """{Loop or Scan node name: trip count} for the loops on the gradient's path that can run as segments."""
    chosen = {}
    for node in graph.nodes:
        if node.op_type not in ("Loop", "Scan") or node.domain or not node.name or \
                not any(id(o) in on_path for o in node.outputs):
            continue
        if node.op_type == "Scan":
            trips = scan_length(node)
            if trips and _segment_length(trips) is not None:
                chosen[node.name] = trips
            continue
        trips = runs_to_trip_count(graph, node)
        k = _segment_length(trips) if trips else None
        dynamic = any(v.shape is None or not all(isinstance(d, int) for d in v.shape[1:])
                      for v in node.outputs[len(node.inputs) - 2:])
        if k is not None and not (dynamic and graph.opset < 15):
            chosen[node.name] = trips
    return chosen


def schemes(trips: int) -> list[LoopScheme]:
    """The schemes of a loop from the least recomputation up: unsegmented, √T segments, then for each further
    level the factorisation into equal segments with the fewest carries alive (ties: the fewest stored for the
    whole backward), while a level lowers that count. The other divisors of a level cost the same passes and keep
    more carries alive, so they are not listed."""
    out = [LoopScheme(trips)]
    k = _segment_length(trips)
    if k is None:
        return out
    out.append(LoopScheme(trips, (k,)))
    levels = 2
    while True:
        factors = _factorisations(trips, levels + 1)
        if not factors:
            return out
        best = min((LoopScheme(trips, tuple(f[1:])) for f in factors),
                   key=lambda s: (s.carries, s.segments, s.lengths))
        if best.carries >= out[-1].carries:
            return out
        out.append(best)
        levels += 1


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write n as a product of `parts` factors of at least 2, in order (outermost first)."""
    if parts == 1:
        return [(n,)] if n >= 2 else []
    return [(d, *rest) for d in range(2, n + 1) if n % d == 0 for rest in _factorisations(n // d, parts - 1)]


def next_schemes(current: dict[str, LoopScheme]) -> dict[str, LoopScheme] | None:
    """The loops' schemes with one loop a level further: the one holding the most carries alive among those
    with a further level (ties: the one with fewer levels, then by name); None when every loop is at its last
    level."""
    further = {name: schemes(s.trips) for name, s in current.items()}
    further = {name: levels[len(current[name].lengths) + 1] for name, levels in further.items()
               if len(levels) > len(current[name].lengths) + 1}
    if not further:
        return None
    name = min(further, key=lambda n: (-current[n].carries, len(current[n].lengths), n))
    return {**current, name: further[name]}


def apply(graph: Graph, name: str, scheme: LoopScheme, names: Names) -> None:
    """Rewrite loop `name` by its scheme: segment it by the innermost length, then the outer loop by the next.
    Unsegmented, a Loop's scan outputs get the trip count as their length where it was unknown, as segmenting
    gives them, so the budget can size them."""
    if not scheme.lengths:
        node = next(n for n in graph.nodes if n.name == name and n.op_type in ("Loop", "Scan"))
        if node.op_type == "Loop":
            for v in node.outputs[len(node.inputs) - 2:]:
                if v.shape is not None and (v.shape[0] is None or isinstance(v.shape[0], str)):
                    v.shape = (scheme.trips, *v.shape[1:])
    for k in scheme.lengths:
        node = next(n for n in graph.nodes if n.name == name and n.op_type in ("Loop", "Scan"))
        (segment if node.op_type == "Loop" else segment_scan)(graph, node, k, names)


def _segment_length(trips: int) -> int | None:
    """The divisor of `trips` nearest √trips, if it leaves at least two segments of at least two iterations."""
    root = math.sqrt(trips)
    divisors = [d for d in range(2, trips // 2 + 1) if trips % d == 0]
    return min(divisors, key=lambda d: (abs(d - root), d)) if trips >= 8 and divisors else None


def runs_to_trip_count(graph: Graph, node: Node) -> int | None:
    """The trip count of a Loop that always runs all of it (a constant, no condition that can end it early)."""
    trips = known_value(graph, node.inputs[0])
    if trips is None or int(trips.reshape(-1)[0]) >= 2**62:
        return None
    if node.inputs[1] is not None:
        cond = known_value(graph, node.inputs[1])
        if cond is None or not bool(cond.reshape(-1)[0]):
            return None
    body = node.attr("body")
    producers = {o: n for n in body.node for o in n.output}
    out = body.output[0].name
    while out in producers and producers[out].op_type == "Identity":
        out = producers[out].input[0]
    if out != body.input[1].name:
        if out in producers:
            value = constant_value(producers[out].attribute) if producers[out].op_type == "Constant" else None
        else:
            value = known_value(graph, graph.values.get(out))
        if value is None or not bool(value.reshape(-1)[0]):
            return None
    return int(trips.reshape(-1)[0])


def segment(graph: Graph, node: Node, k: int, names: Names) -> None:
    """Rewrite Loop `node` (T iterations, T divisible by k) into a Loop over T/k segments of an inner Loop of k."""
    trips = runs_to_trip_count(graph, node)
    body = node.attr("body")
    n = len(node.inputs) - 2
    segments = trips // k

    # the inner body: the old body, its iteration number offset by the segment's first iteration
    inner = onnx.GraphProto()
    inner.CopyFrom(body)
    local_i = names.fresh(f"{node.name}/segment_iteration")
    first = names.fresh(f"{node.name}/segment_first")
    old_i = inner.input[0].name
    inner.input[0].name = local_i
    offset = helper.make_node("Add", [local_i, first], [old_i], name=names.fresh(f"{node.name}/iteration"))
    # the condition stays true (runs_to_trip_count): say so where the inner loop's rule can see it
    go_on = names.fresh(f"{node.name}/segment_go_on")
    kept = [onnx.NodeProto() for _ in inner.node]
    for copy, n_ in zip(kept, inner.node):
        copy.CopyFrom(n_)
    del inner.node[:]
    inner.node.extend([offset] + kept + [helper.make_node("Identity", [inner.input[1].name], [go_on], name=go_on)])
    inner.output[0].name = go_on
    inner.name = f"{body.name or 'body'}_segment"

    # the outer body: s, cond, carries -> cond, the inner loop's carries, its k-row scan outputs
    s = names.fresh(f"{node.name}/segment")
    cond_in, cond_out = names.fresh(f"{node.name}/segment_cond"), names.fresh(f"{node.name}/segment_cond_out")
    k_name, carry_in = names.fresh(f"{node.name}/segment_length"), [names.fresh(f"{vi.name}_segment")
                                                                      for vi in body.input[2:]]
    carry_out = [names.fresh(f"{vi.name}_segment") for vi in body.output[1:1 + n]]
    scan_out = [names.fresh(f"{vi.name}_segment") for vi in body.output[1 + n:]]
    nodes = [helper.make_node("Constant", [], [k_name], name=k_name,
                              value=numpy_helper.from_array(np.array(k, np.int64))),
             helper.make_node("Mul", [s, k_name], [first], name=first),
             helper.make_node("Loop", [k_name, ""] + carry_in, carry_out + scan_out, body=inner,
                              name=names.fresh(f"{node.name}/segment_loop")),
             helper.make_node("Identity", [cond_in], [cond_out], name=cond_out)]
    inputs = [helper.make_tensor_value_info(s, TensorProto.INT64, []),
              helper.make_tensor_value_info(cond_in, TensorProto.BOOL, [])]
    inputs += [_renamed_info(vi, name) for vi, name in zip(body.input[2:], carry_in)]
    outputs = [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, [])]
    outputs += [_renamed_info(vi, name) for vi, name in zip(body.output[1:1 + n], carry_out)]
    outputs += [_renamed_info(vi, name, lead=k) for vi, name in zip(body.output[1 + n:], scan_out)]
    outer_body = helper.make_graph(nodes, f"{body.name or 'body'}_segments", inputs, outputs)

    count = Value(names.fresh(f"{node.name}/segments"), TensorProto.INT64, ())
    graph.initializers[count.name] = numpy_helper.from_array(np.array(segments, np.int64), count.name)
    graph.values[count.name] = count
    stacked = [Value(names.fresh(f"{v.name}_by_segment"), v.elem_type,
                     None if v.shape is None else (segments, k, *v.shape[1:])) for v in node.outputs[n:]]
    loop = Node("Loop", [count, node.inputs[1], *node.inputs[2:]], [*node.outputs[:n], *stacked], node.name,
                [helper.make_attribute("body", outer_body)], phase=node.phase)
    flats = []
    for v, by_segment in zip(node.outputs[n:], stacked):
        rest = None if v.shape is None else v.shape[1:]
        target = Value(names.fresh(f"{v.name}_rows_shape"), TensorProto.INT64,
                       (None,) if rest is None else (len(rest) + 1,))
        if rest is not None and all(isinstance(d, int) for d in rest):
            graph.initializers[target.name] = numpy_helper.from_array(np.array([trips, *rest], np.int64), target.name)
            graph.values[target.name] = target
        else:  # Shape's start attribute: opset 15 and later (`plan` leaves such loops alone before)
            rows = Value(names.fresh(f"{v.name}_rows"), TensorProto.INT64, (1,))
            graph.initializers[rows.name] = numpy_helper.from_array(np.array([trips], np.int64), rows.name)
            graph.values[rows.name] = rows
            tail = Value(names.fresh(f"{v.name}_row_shape"), TensorProto.INT64, (None,) if rest is None else (len(rest),))
            flats += [Node("Shape", [by_segment], [tail], names.fresh(f"{v.name}/Shape"),
                           [helper.make_attribute("start", 2)], phase=node.phase),
                      Node("Concat", [rows, tail], [target], names.fresh(f"{v.name}/Concat"),
                           [helper.make_attribute("axis", 0)], phase=node.phase)]
        flats.append(Node("Reshape", [by_segment, target], [v], names.fresh(f"{v.name}/Reshape"), phase=node.phase))
        if rest is not None:
            v.shape = (trips, *rest)
    graph.insert_before(node, [loop] + flats)
    node.detach()
    graph.reorder([x for x in graph.nodes if x is not node])
    attach_implicit_inputs(graph, loop)


def _renamed_info(vi: onnx.ValueInfoProto, name: str, lead: int | None = None) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(vi)
    out.name = name
    if lead is not None and out.type.tensor_type.HasField("shape"):
        dims = [d for d in out.type.tensor_type.shape.dim]
        copies = [onnx.TensorShapeProto.Dimension() for _ in dims]
        for c, d in zip(copies, dims):
            c.CopyFrom(d)
        del out.type.tensor_type.shape.dim[:]
        out.type.tensor_type.shape.dim.add().dim_value = lead
        out.type.tensor_type.shape.dim.extend(copies)
    return out


def scan_length(node: Node) -> int | None:
    """The static length of a Scan whose scan inputs and outputs all have static shapes (what `segment_scan`
    needs to reshape them), else None."""
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    n = len(node.inputs) - m
    axes = list(node.attr("scan_input_axes") or [0] * m)
    lengths = set()
    for v, a in zip(node.inputs[n:], axes):
        if v is None or v.static_shape is None:
            return None
        lengths.add(v.static_shape[a % len(v.static_shape)])
    if len(lengths) != 1 or any(v.static_shape is None for v in node.outputs[n:len(body.output)]):
        return None
    return lengths.pop()


def segment_scan(graph: Graph, node: Node, k: int, names: Names) -> None:
    """Rewrite Scan `node` (length T, T divisible by k) into a Scan over T/k segments whose body is the Scan of
    one segment: each scan input is reshaped so its scanned axis becomes (T/k, k), each scan output back."""
    body = node.attr("body")
    m = node.attr("num_scan_inputs")
    n = len(node.inputs) - m
    outs = len(body.output) - n
    trips = scan_length(node)
    segments = trips // k
    in_axes = [a % len(v.static_shape) for a, v in zip(node.attr("scan_input_axes") or [0] * m, node.inputs[n:])]
    out_axes = [b % len(v.static_shape) for b, v in zip(node.attr("scan_output_axes") or [0] * outs,
                                                          node.outputs[n:])]
    in_dirs = list(node.attr("scan_input_directions") or [0] * m)
    out_dirs = list(node.attr("scan_output_directions") or [0] * outs)

    def split(shape, axis):  # the scanned axis T as (segments, k)
        return [*shape[:axis], segments, k, *shape[axis + 1:]]

    before, reshaped = [], []
    for v, a in zip(node.inputs[n:], in_axes):
        target = _int_initializer(graph, names, f"{v.name}_segments_shape", split(v.static_shape, a))
        r = Value(names.fresh(f"{v.name}_by_segment"), v.elem_type, tuple(split(v.static_shape, a)))
        before.append(Node("Reshape", [v, target], [r], names.fresh(f"{v.name}/Reshape"), phase=node.phase))
        reshaped.append(r)

    state_in = [names.fresh(f"{vi.name}_segment") for vi in body.input[:n]]
    slice_in = [names.fresh(f"{vi.name}_segment") for vi in body.input[n:]]
    state_out = [names.fresh(f"{vi.name}_segment") for vi in body.output[:n]]
    slice_out = [names.fresh(f"{vi.name}_segment") for vi in body.output[n:]]
    inner = helper.make_node("Scan", state_in + slice_in, state_out + slice_out,
                             name=names.fresh(f"{node.name}/segment_scan"), body=body, num_scan_inputs=m,
                             scan_input_axes=in_axes, scan_input_directions=in_dirs,
                             scan_output_axes=[b for b in out_axes], scan_output_directions=out_dirs)
    inputs = [_renamed_info(vi, name) for vi, name in zip(body.input[:n], state_in)]
    inputs += [helper.make_tensor_value_info(name, v.elem_type, [k if i == a else d for i, d in
                                                                 enumerate(v.static_shape)])
               for name, v, a in zip(slice_in, node.inputs[n:], in_axes)]
    outputs = [_renamed_info(vi, name) for vi, name in zip(body.output[:n], state_out)]
    outputs += [helper.make_tensor_value_info(name, v.elem_type, [k if i == b else d for i, d in
                                                                  enumerate(v.static_shape)])
                for name, v, b in zip(slice_out, node.outputs[n:], out_axes)]
    outer_body = helper.make_graph([inner], f"{body.name or 'body'}_segments", inputs, outputs)

    stacked = [Value(names.fresh(f"{v.name}_by_segment"), v.elem_type, tuple(split(v.static_shape, b)))
               for v, b in zip(node.outputs[n:], out_axes)]
    scan = Node("Scan", [*node.inputs[:n], *reshaped], [*node.outputs[:n], *stacked], node.name,
                [helper.make_attribute("body", outer_body), helper.make_attribute("num_scan_inputs", m),
                 helper.make_attribute("scan_input_axes", in_axes),
                 helper.make_attribute("scan_input_directions", in_dirs),
                 helper.make_attribute("scan_output_axes", out_axes),
                 helper.make_attribute("scan_output_directions", out_dirs)], phase=node.phase)
    after = []
    for v, s in zip(node.outputs[n:], stacked):
        target = _int_initializer(graph, names, f"{v.name}_rows_shape", list(v.static_shape))
        after.append(Node("Reshape", [s, target], [v], names.fresh(f"{v.name}/Reshape"), phase=node.phase))
    graph.insert_before(node, before + [scan] + after)
    node.detach()
    graph.reorder([x for x in graph.nodes if x is not node])
    attach_implicit_inputs(graph, scan)


def _int_initializer(graph: Graph, names: Names, base: str, values: list[int]) -> Value:
    v = Value(names.fresh(base), TensorProto.INT64, (len(values),))
    graph.initializers[v.name] = numpy_helper.from_array(np.array(values, np.int64), v.name)
    graph.values[v.name] = v
    return v
