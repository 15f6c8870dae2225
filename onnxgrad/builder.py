"""Building new nodes: a per-run name authority, an op builder, and the context a gradient rule sees."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .contract import FORWARD
from .errors import UnsupportedError
from .ir import Graph, Node, Value, constant_value
from .shapes import infer


class Names:
    """Hands out unique names, deterministically: base, base_1, base_2, ..."""

    def __init__(self, taken: Sequence[str] = ()):
        self._taken = set(taken)
        self._next: dict[str, int] = {}

    def reserve(self, name: str) -> None:
        self._taken.add(name)

    def taken(self, name: str) -> bool:
        return name in self._taken

    def fresh(self, base: str) -> str:
        if base not in self._taken:
            self._taken.add(base)
            return base
        k = self._next.get(base, 1)
        while f"{base}_{k}" in self._taken:
            k += 1
        self._next[base] = k + 1
        name = f"{base}_{k}"
        self._taken.add(name)
        return name


class Builder:
    """`op.Mul(a, b)` appends a Mul node to the graph and returns its output Value.

    `outputs=n` returns a tuple of n Values; other keywords become attributes.
    New nodes are named `<prefix>/<OpType>`, made unique by the name authority, belong to `phase`, and get
    their output types where `shapes.infer` knows the op.
    """

    def __init__(self, graph: Graph, names: Names, prefix: str = "", phase: str = FORWARD):
        self.graph = graph
        self.names = names
        self.prefix = prefix
        self.phase = phase
        self.emitted: list[Node] = []

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)

        def make(*inputs: Value | None, outputs: int = 1, **attrs):
            return self.node(op_type, inputs, outputs, **attrs)
        return make

    def node(self, op_type: str, inputs: Sequence[Value | None], outputs: int = 1, **attrs):
        base = f"{self.prefix}/{op_type}" if self.prefix else op_type
        name = self.names.fresh(base)
        outs = [Value(name if outputs == 1 else self.names.fresh(f"{name}:{i}")) for i in range(outputs)]
        attributes = [helper.make_attribute(k, v) for k, v in sorted(attrs.items()) if v is not None]
        node = Node(op_type, inputs, outs, name, attributes, phase=self.phase)
        infer(node, self.graph.opset)
        self.graph.add_node(node)
        self.emitted.append(node)
        return outs[0] if outputs == 1 else tuple(outs)

    def const(self, value, elem_type: int) -> Value:
        """A Constant node holding `value` with the given ONNX element type."""
        array = np.asarray(value, dtype=helper.tensor_dtype_to_np_dtype(elem_type))
        tensor = numpy_helper.from_array(array, name="")
        if elem_type == onnx.TensorProto.BFLOAT16:
            tensor = helper.make_tensor("", elem_type, array.shape, array.astype(np.float32).ravel().tolist())
        v = self.node("Constant", [], value=tensor)
        v.elem_type, v.shape = elem_type, tuple(array.shape)
        return v

    def ints(self, values: Sequence[int]) -> Value:
        """A 1-D int64 constant: axes, shapes, starts."""
        return self.const(np.asarray(list(values), dtype=np.int64), onnx.TensorProto.INT64)


class GradContext:
    """What a rule sees: forward inputs I(i), outputs O(i), output gradients GO(i), attributes, needs(i).

    Rules build nodes through `op` and must return one gradient (or None) per forward input.
    """

    def __init__(self, node: Node, out_grads: list[Value | None], needed: list[bool], op: Builder, opset: int):
        self.node = node
        self._out_grads = out_grads
        self._needed = needed
        self.op = op
        self.opset = opset

    # -- the vocabulary ---------------------------------------------------------------------------------
    def I(self, i: int) -> Value | None:  # noqa: E743 (the customary name)
        return self.node.input(i)

    def O(self, i: int) -> Value:  # noqa: E743
        return self.node.outputs[i]

    def GO(self, i: int) -> Value | None:
        return self._out_grads[i] if i < len(self._out_grads) else None

    def GO_or_zeros(self, i: int) -> Value:
        """The gradient of output i, materialised as zeros where none flows back."""
        g = self.GO(i)
        return g if g is not None else self.zeros_like(self.O(i))

    def needs(self, i: int) -> bool:
        return i < len(self._needed) and self._needed[i]

    def attr(self, name: str, default=None):
        return self.node.attr(name, default)

    @property
    def num_inputs(self) -> int:
        return len(self.node.inputs)

    def unsupported(self, what: str) -> UnsupportedError:
        return UnsupportedError(f"no gradient for {self.node.op_type} node {self.node.name!r}: {what}")

    # -- helpers built on the vocabulary ----------------------------------------------------------------
    def rank(self, v: Value) -> int:
        if v.rank is None:
            raise self.unsupported(f"the rank of {v.name!r} is unknown (bind it with --input-shape or --dim)")
        return v.rank

    def const_like(self, value, like: Value) -> Value:
        """A constant with the element type of a forward value."""
        return self.op.const(value, self.elem_type(like))

    def elem_type(self, v: Value) -> int:
        if not v.elem_type:
            raise self.unsupported(f"the element type of {v.name!r} is unknown")
        return v.elem_type

    def shape_of(self, v: Value) -> Value:
        """The shape of a forward value as an int64 tensor: a constant when static, else a Shape node."""
        static = v.static_shape
        return self.op.ints(static) if static is not None else self.op.Shape(v)

    def zeros_like(self, v: Value) -> Value:
        return self.zeros(self.shape_of(v), v)

    def zeros(self, shape: Value, like: Value) -> Value:
        """Zeros of a run-time shape (a 1-D int64 Value) with like's element type."""
        zero = helper.make_tensor("", self.elem_type(like), [1], [0])
        return self.op.ConstantOfShape(shape, value=zero)

    def reshape_like(self, g: Value, like: Value) -> Value:
        # allowzero: a 0 in a real shape is a zero-size dim, not "copy this dim"
        return self.op.Reshape(g, self.shape_of(like), allowzero=1 if self.opset >= 14 else None)

    def text_attr(self, name: str, default: str) -> str:
        """A string attribute as text (onnx stores it as bytes)."""
        value = self.attr(name, default)
        return value.decode() if isinstance(value, bytes) else value

    def cast(self, v: Value | None, from_type: int, to_type: int) -> Value | None:
        """v converted between two known element types (Cast, not CastLike, which needs opset 15).

        Values built by rules carry no element type, so callers name the type they know v has.
        """
        return v if v is None or from_type == to_type else self.op.Cast(v, to=to_type)

    def as_int64(self, v: Value) -> Value:
        """An integer forward value (indices, shapes) as int64."""
        return v if v.elem_type == TensorProto.INT64 else self.op.Cast(v, to=TensorProto.INT64)

    # -- dims and shapes: a dim is an int where the shape is static, else a 1-element int64 Value --------------
    def dim(self, v: Value, axis: int) -> int | Value:
        """v's size along axis: an int when static, else a 1-element int64 Value (a Shape slice, opset 15+)."""
        d = v.shape[axis] if v.shape is not None else None
        if isinstance(d, int):
            return d
        axis = axis % self.rank(v)
        return self.op.Shape(v, start=axis, end=axis + 1)

    def dim_tensor(self, v: Value, axis: int) -> Value:
        """v's size along axis as a 1-element int64 Value, also when static (a constant then); any opset."""
        d = v.shape[axis] if v.shape is not None else None
        if isinstance(d, int):
            return self.op.ints([d])
        return self.op.Gather(self.op.Shape(v), self.op.ints([axis]))

    def int64(self, value: int) -> Value:
        """An int64 scalar constant: the bounds of a Range, an index offset."""
        return self.op.const(np.int64(value), TensorProto.INT64)

    def dim_scalar(self, d: int | Value) -> Value:
        """A dim (an int, or a 1-element int64 Value as `dim` gives) as an int64 scalar."""
        if isinstance(d, int):
            return self.int64(d)
        return self.op.Squeeze(d, self.op.ints([0]))

    def make_shape(self, dims: Sequence[int | Value]) -> Value:
        """A 1-D int64 shape from dims: a constant when every dim is an int, else a Concat."""
        if all(isinstance(d, int) for d in dims):
            return self.op.ints(dims)
        return self.op.Concat(*[self.op.ints([d]) if isinstance(d, int) else d for d in dims], axis=0)

    def reshape(self, v: Value, dims: Sequence[int | Value]) -> Value:
        """Reshape v to dims; a 0 copies v's dim at that index and -1 takes the rest (allowzero=0)."""
        return self.op.Reshape(v, self.make_shape(dims))

    def normalize_axis(self, axis: int, rank: int) -> int:
        if not -rank <= axis < max(rank, 1):
            raise self.unsupported(f"axis {axis} out of range for rank {rank}")
        return axis + rank if axis < 0 else axis

    def const_input(self, i: int) -> np.ndarray | None:
        """The value of input i when it is an initializer or a Constant node's output, else None."""
        return self.const_value_of(self.I(i))

    def const_value_of(self, v: Value | None) -> np.ndarray | None:
        """The value of v when it is an initializer or a Constant node's output, else None."""
        if v is None:
            return None
        graph = self.op.graph
        if v.name in graph.initializers:
            return numpy_helper.to_array(graph.initializers[v.name])
        p = v.producer
        if p is not None and p.op_type == "Constant":
            return constant_value(p.attributes)
        return None

    def unbroadcast(self, g: Value, like: Value) -> Value:
        """Sum `g` (shaped like the broadcast result) down to the shape of `like`."""
        return unbroadcast(self, g, like, self.node.outputs[0])

    def scatter_add_rows(self, rows: Value, positions: Value, updates: Value, like: Value) -> Value:
        """Zeros of [rows, M] with row i of `updates` ([N, M]) added at row positions[i] (1-D, >= 0, may repeat)."""
        return scatter_add_rows(self, rows, positions, updates, like)


# Tables with at most this many rows (known statically) take their gradient through a one-hot MatMul: faster
# than ScatterElements there, and bit-identical on every provider (bench/bench_scatter.py measures both).
ONE_HOT_MAX_ROWS = 512


def scatter_add_rows(ctx: GradContext, rows: Value, positions: Value, updates: Value, like: Value) -> Value:
    """Sum the rows of `updates` into a zero table of `rows` rows, at `positions`: an embedding's gradient.

    Never ScatterND with reduction="add": onnxruntime's CPU kernel splits the updates across threads and loses
    some of them when positions repeat (every token of one segment id, every sequence at one position).
    Small tables use a one-hot matrix [rows, N] and one MatMul, which sums in a fixed order. Larger ones never
    hold a second table beside the result: each position is given one slot among the N updates (the slot of
    some update at that position, -1 where none lands), the updates are summed into N slot rows with
    ScatterElements and reduction="add", which the CPU provider runs in one loop (exact, repeatable at any
    thread count; CUDA adds with atomics, so the sums are right but their order is not fixed), and the table is
    gathered from the slot rows and one zero row after them (row -1). Which update's slot a position gets does
    not matter, only that all of its updates read the same one, which they do: they read it from one table.
    Beside the result, only the N + 1 slot rows and int64 indices (one per row, one per update element) are
    made.
    """
    op = ctx.op
    static_rows = ctx.const_value_of(rows)
    count = int(static_rows.reshape(-1)[0]) if static_rows is not None else None
    if ctx.opset < 16 or (count is not None and count <= ONE_HOT_MAX_ROWS):
        if count is not None:  # a constant, so every size downstream is known to the memory planner
            along = op.const(np.arange(count, dtype=np.int64), TensorProto.INT64)
        else:
            along = op.Range(op.const(np.int64(0), TensorProto.INT64), op.Squeeze(rows),
                             op.const(np.int64(1), TensorProto.INT64))
        hits = op.Equal(op.Unsqueeze(along, op.ints([1])), op.Unsqueeze(positions, op.ints([0])))
        return op.MatMul(op.Cast(hits, to=ctx.elem_type(like)), updates)
    shape = op.Shape(updates)
    ones = op.Expand(op.const(np.array([1], np.int64), TensorProto.INT64), op.Shape(positions))
    each = op.Sub(op.CumSum(ones, op.const(np.int64(0), TensorProto.INT64)), ones)  # 0 .. N-1
    none = helper.make_tensor("", TensorProto.INT64, [1], [-1])
    slot_of_row = op.ScatterElements(op.ConstantOfShape(rows, value=none), positions, each, axis=0)
    spread = op.Expand(op.Unsqueeze(op.Gather(slot_of_row, positions, axis=0), op.ints([1])), shape)
    zero = helper.make_tensor("", ctx.elem_type(like), [1], [0])
    sums = op.ScatterElements(op.ConstantOfShape(shape, value=zero), spread, updates, axis=0, reduction="add")
    # row N (-1): zeros, for the rows no update lands in
    sums = op.Concat(sums, op.ConstantOfShape(op.Concat(op.ints([1]), op.Slice(shape, op.ints([1]), op.ints([2])),
                                                        axis=0), value=zero), axis=0)
    table = op.Gather(sums, slot_of_row, axis=0)
    if table.shape is None and count is not None and updates.shape is not None and len(updates.shape) == 2:
        table.elem_type, table.shape = ctx.elem_type(like), (count, updates.shape[1])
    return table


def rows_added(v: Value) -> tuple[Value, Value, Value] | None:
    """(rows, positions, updates) when `v` is the table `scatter_add_rows` gathers from its slot rows, or a
    Reshape of it: the pattern that function writes, read back."""
    node = v.producer
    if node is not None and node.op_type == "Reshape":
        node = node.inputs[0].producer
    if node is None or node.op_type != "Gather" or node.inputs[0].producer is None:
        return None
    padded, slot_of_row = node.inputs[0].producer, node.inputs[1].producer
    if padded.op_type != "Concat" or slot_of_row is None or slot_of_row.op_type != "ScatterElements":
        return None
    sums = padded.inputs[0].producer
    unset = slot_of_row.inputs[0].producer
    if (sums is None or sums.op_type != "ScatterElements" or unset is None or unset.op_type != "ConstantOfShape"
            or sums.attr("reduction") not in ("add", b"add")):
        return None
    return unset.inputs[0], slot_of_row.inputs[1], sums.inputs[2]


def sum_gradients(op: Builder, parts: list[Value]) -> tuple[Value, Value | None]:
    """The sum of a value's gradient contributions, and the contribution it no longer reads, if any. Where one
    contribution is a table's rows added by `scatter_add_rows` (an embedding) and others are dense (a tied
    output layer), the rows are added into the sum of the others by ScatterElements with reduction="add":
    beside the result, one table-sized buffer (the dense sum) instead of two (it and the gathered table)."""
    for k, part in enumerate(parts):
        found = rows_added(part)
        if found is None:
            continue
        rows, positions, updates = found
        others = parts[:k] + parts[k + 1:]
        dense = others[0] if len(others) == 1 else op.Sum(*others)
        shape = op.Shape(updates)
        spread = op.Expand(op.Unsqueeze(positions, op.ints([1])), shape)
        # a 2-D table gets no Reshape around it: onnxruntime would fuse one with the Transpose that makes a tied
        # output layer's gradient into a node of its own, run after the whole backward with the Gemm's result alive
        flat = dense if dense.rank == 2 else op.Reshape(
            dense, op.Concat(rows, op.Slice(shape, op.ints([1]), op.ints([2])), axis=0))
        added = op.ScatterElements(flat, spread, updates, axis=0, reduction="add")
        if flat is not dense:
            return op.Reshape(added, op.Shape(dense)), part
        added.elem_type, added.shape = dense.elem_type, dense.shape
        return added, part
    return op.Sum(*parts), None


def unbroadcast(ctx: GradContext, g: Value, like: Value, result: Value) -> Value:
    """Reduce a gradient of a broadcast result to an operand's shape.

    Leading axes the operand lacks are summed away statically. Among the aligned axes, an axis is summed when
    the operand has size 1 and the result does not: decided statically where both sizes are known, else at run
    time by summing over every axis where Shape(operand) == 1 (summing a size-1 axis of the result changes
    nothing, so over-including such axes is harmless).
    """
    op = ctx.op
    r_like, r_out = ctx.rank(like), ctx.rank(result)
    lead = r_out - r_like
    if lead < 0:
        raise ctx.unsupported(f"{like.name!r} has a higher rank than the broadcast result")
    if lead:
        g = op.ReduceSum(g, op.ints(range(lead)), keepdims=0)
    axes, dynamic = [], False
    for i, (dl, do) in enumerate(zip(like.shape, result.shape[lead:])):
        if dl == 1:
            if do != 1:
                axes.append(i)
        elif isinstance(dl, int) or (dl is not None and dl == do):
            continue
        else:
            dynamic = True
    if dynamic:
        mask = op.Equal(op.Shape(like), op.ints([1]))
        dyn_axes = op.Reshape(op.NonZero(mask), op.ints([-1]))
        g = op.ReduceSum(g, dyn_axes, keepdims=1, noop_with_empty_axes=1)
        return g
    if axes:
        g = op.ReduceSum(g, op.ints(axes), keepdims=1)
    return g
