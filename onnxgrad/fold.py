"""Folding small integer subgraphs into constants before the gradient pass.

Exporters compute axes, starts and shapes in little subgraphs (`Reshape(Constant([2, 3]), [-1])`,
`Cast(Constant(4))`, `Shape(x)` of a static x). Rules that need such an input to be known (the axes of a
ReduceMean with keepdims=0, the starts of a Slice) would see run-time data. This pass evaluates every node whose
inputs are all known and whose outputs are small integer or boolean tensors, and replaces it by a Constant node
with the same outputs. Floating-point values fold only as scalars computed from Constant nodes (a few elements):
initializers of a float type are never read, so parameters and activations stay as they are.

Shapes fold per dimension: `Shape(x)` of an x whose batch axis is symbolic is not a constant, but its static
entries are known, and so is anything that only moves or combines them (`Gather(Shape(x), 1)`,
`Slice(Shape(x), 1, 3)`, their products). Such partly known vectors are tracked element by element, and a value
folds as soon as every element of it is known.

Folding one value can make a later shape static (a Reshape whose target folded), which only shape inference
reveals, so `fold_to_fixed_point` alternates folding and inference until a round folds nothing.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .contract import FLOAT_TYPES
from .errors import UnsupportedError
from .ir import constant_value
from .protos import declared_dims

MAX_ELEMENTS = 4096  # larger integer tensors (index tables) are left to run time
# Each round folds at least one node, so the rounds are bounded by the node count; this bound is far above what
# exporters write (one round per link of a chain of shape computations, each reading the shape the last made).
MAX_ROUNDS = 1000
_NO_FOLD = {"Constant", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
            "Multinomial", "If", "Loop", "Scan"}
# Ops that move elements of their data inputs without combining them: applied to a 0/1 "known" mask, they move
# the mask the same way. The other inputs (indices, axes, shapes) must be fully known.
_MOVE_DATA_INPUTS = {"Gather": (0,), "Slice": (0,), "Reshape": (0,), "Squeeze": (0,), "Unsqueeze": (0,),
                     "Identity": (0,), "Cast": (0,), "Expand": (0,), "Tile": (0,), "Concat": None}
# Element-wise ops: an output element is known where the broadcast input elements are.
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Mod", "Max", "Min", "Neg", "Abs", "Equal", "Less", "Greater",
                "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or"}


def _small_int(a: np.ndarray) -> bool:
    return (a.dtype.kind in "iub") and a.size <= MAX_ELEMENTS


# Float constants of at most this many elements are folded too: scalar arithmetic on Constant nodes (never on
# initializers, which may be parameters), as TorchScript writes `ceil(h / p) * p` of a static size (MobileViT's
# unfold: Ceil(2.0) * 2.0, cast to int64, into a Reshape's target)
FLOAT_SCALARS = 16


def _foldable(a: np.ndarray) -> bool:
    return _small_int(a) or (a.dtype.kind == "f" and a.size <= FLOAT_SCALARS)


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    return constant_value(node.attribute)


def _dims(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Every value of known rank: its dims, a symbol's name where symbolic, None where unknown."""
    dims = {}
    g = model.graph
    for vi in [*g.value_info, *g.input, *g.output]:
        declared = declared_dims(vi)
        if declared is not None:
            dims[vi.name] = declared
    for init in g.initializer:
        dims[init.name] = list(init.dims)
    return dims


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


class _Partial:
    """A small integer tensor known element by element: `values` where `known`; where not, `symbols` may name
    the symbolic dim an element equals (it came straight from a Shape)."""

    __slots__ = ("values", "known", "symbols")

    def __init__(self, values: np.ndarray, known: np.ndarray, symbols: np.ndarray | None = None):
        self.values, self.known = values, known
        self.symbols = symbols if symbols is not None else np.full(values.shape, None, dtype=object)

    @classmethod
    def of(cls, full: np.ndarray) -> "_Partial":
        return cls(full, np.ones(full.shape, dtype=bool))


def _shape_partial(node: onnx.NodeProto, dims: list[int | str | None]) -> _Partial:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    picked = dims[attrs.get("start", 0):attrs.get("end", len(dims))] if dims else []
    return _Partial(np.asarray([d if isinstance(d, int) else 1 for d in picked], dtype=np.int64),
                    np.asarray([isinstance(d, int) for d in picked], dtype=bool),
                    np.asarray([d if isinstance(d, str) else None for d in picked] or [], dtype=object))


def _propagate(node: onnx.NodeProto, inputs: list, opset: int) -> _Partial | None:
    """The output of a moving or element-wise node whose inputs are partly known (None: not derivable)."""
    op = node.op_type
    if op == "Cast":
        values = _evaluate(node, [inputs[0].values], opset)
        return None if values is None else _Partial(values[0], inputs[0].known, inputs[0].symbols)
    if op in _MOVE_DATA_INPUTS:
        data = _MOVE_DATA_INPUTS[op] or tuple(range(len(inputs)))
        if any(i not in data and isinstance(v, _Partial) for i, v in enumerate(inputs)):
            return None  # an index or shape input that is only partly known
        # run the op on element ids to learn where each output element comes from
        pool, ids, offset = [], [], 0
        for i, v in enumerate(inputs):
            if i not in data or v is None:
                ids.append(v)
                continue
            p = v if isinstance(v, _Partial) else _Partial.of(v)
            pool.append(p)
            ids.append(np.arange(offset, offset + p.values.size, dtype=np.int64).reshape(p.values.shape))
            offset += p.values.size
        moved = _evaluate(node, ids, opset)
        if moved is None:
            return None
        where = moved[0]
        flat = [np.concatenate([p.values.reshape(-1) for p in pool]),
                np.concatenate([p.known.reshape(-1) for p in pool]),
                np.concatenate([p.symbols.reshape(-1) for p in pool])]
        values, known, symbols = (a[where.reshape(-1)].reshape(where.shape) for a in flat)
        return _Partial(values.astype(pool[0].values.dtype), known, symbols)
    if op in _ELEMENTWISE:
        values = _evaluate(node, [v.values if isinstance(v, _Partial) else v for v in inputs], opset)
        if values is None:
            return None
        known = np.ones((), dtype=bool)
        for v in inputs:
            known = np.logical_and(known, v.known if isinstance(v, _Partial) else np.ones(v.shape, bool))
        return _Partial(values[0], np.broadcast_to(known, values[0].shape).copy())
    return None


def _reshape_target(node: onnx.NodeProto, target: _Partial, data_dims: list | None) -> np.ndarray | None:
    """A Reshape target whose unknown elements each equal the data's dim at the same index (a batch carried
    through), written with 0 for "copy that dim", so shape inference keeps the symbol; None if not so."""
    allowzero = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "allowzero"), 0)
    if allowzero or data_dims is None or target.values.ndim != 1:
        return None
    values = target.values.copy()
    for i in np.flatnonzero(~target.known):
        sym = target.symbols[i]
        if sym is None or i >= len(data_dims) or data_dims[i] != sym:
            return None
        values[i] = 0
    return values


def fold_small_constants(model: onnx.ModelProto, opset: int) -> int:
    """Fold in place; returns how many nodes became constants. Shapes must have been inferred."""
    g = model.graph
    known: dict[str, np.ndarray] = {}
    for init in g.initializer:
        if init.data_type not in FLOAT_TYPES and np.prod(init.dims, dtype=np.int64) <= MAX_ELEMENTS:
            known[init.name] = numpy_helper.to_array(init)
    partial: dict[str, _Partial] = {}
    dims = _dims(model)
    taken = {n for node in g.node for n in [*node.input, *node.output]} | {t.name for t in g.initializer}
    folded = 0
    for k, node in enumerate(g.node):
        if node.domain not in ("", "ai.onnx") or node.op_type in _NO_FOLD:
            if node.op_type == "Constant" and len(node.output) == 1:
                value = _constant_value(node)
                if value is not None and _foldable(value):
                    known[node.output[0]] = value
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            continue
        outputs: list[np.ndarray] | None = None
        if node.op_type in ("Shape", "Size") and node.input[0] in dims:
            shape = dims[node.input[0]]
            if node.op_type == "Size":
                if all(isinstance(d, int) for d in shape):
                    outputs = [np.asarray(np.prod(shape, dtype=np.int64), dtype=np.int64)]
            else:
                p = _shape_partial(node, shape)
                if p.known.all():
                    outputs = [p.values]
                elif p.values.size:
                    partial[node.output[0]] = p
        elif node.input and all(not n or n in known for n in node.input):
            outputs = _evaluate(node, [known[n] if n else None for n in node.input], opset)
        elif node.op_type == "Reshape" and len(node.input) == 2 and node.input[1] in partial \
                and node.input[0] not in partial:
            values = _reshape_target(node, partial[node.input[1]], dims.get(node.input[0]))
            if values is not None:
                name = _fresh(node.input[1] + "_folded", taken)
                g.initializer.append(numpy_helper.from_array(values, name))
                known[name] = values
                node.input[1] = name
                folded += 1
            continue
        elif node.input and len(node.output) == 1 and all(not n or n in known or n in partial for n in node.input) \
                and any(n in partial for n in node.input):
            p = _propagate(node, [known.get(n, partial.get(n)) if n else None for n in node.input], opset)
            if p is not None and _small_int(p.values):
                if p.known.all():
                    outputs = [p.values]
                else:
                    partial[node.output[0]] = p
        if not outputs or len(outputs) != len(node.output) or not all(_foldable(o) for o in outputs):
            continue
        if len(node.output) != 1:
            continue
        replacement = helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                       value=numpy_helper.from_array(outputs[0], ""))
        g.node[k].CopyFrom(replacement)
        known[node.output[0]] = outputs[0]
        folded += 1
    return folded


def _fresh(base: str, taken: set) -> str:
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def fold_to_fixed_point(model: onnx.ModelProto, max_rounds: int = MAX_ROUNDS) -> onnx.ModelProto:
    """Fold and re-infer shapes until a round folds nothing; returns the model with its shapes inferred.

    The model's shapes must have been inferred. A graph that keeps folding for `max_rounds` rounds is refused
    with an error that says how to cut it short."""
    from . import loader

    opset = loader.model_opset(model)
    for _ in range(max_rounds):
        if not fold_small_constants(model, opset):
            return model
        model = loader.infer_shapes(model)
    raise UnsupportedError(f"shape folding did not settle after {max_rounds} rounds (each round made another "
                           f"shape computation constant); bind the symbolic dims with --input-shape or --dim")
