"""What running an op once costs, from its inferred shapes: the recomputation solver's price of a recomputation.

The cost is a roofline sum in FLOP-equivalents: `flops + balance * bytes_moved`. FLOPs are counted
analytically for the ops that do arithmetic in bulk (Conv, ConvTranspose, Gemm, MatMul, Einsum, the opset-23
`Attention`; a multiply-add counts 2); every op also pays for the bytes it reads and writes, so memory-bound ops
(element-wise, normalisations, reshapes that copy) are not free, and an element-wise op costs its bytes moved.
`balance` is the machine's FLOPs per byte of memory traffic: peak FLOP/s over memory bandwidth. The default, 20,
is a float32 middle ground (a server CPU core set is about 10, an A100 without tensor cores about 13, an H100
about 20 for float32); the solver only compares costs, so what matters is the ratio, not the unit.
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from onnx import helper

from ..errors import UsageError
from ..ir import Node, Value

DEFAULT_BALANCE = 20.0  # FLOPs per byte moved


# Kernel classes: ops whose kernels spend their time alike, priced together by `Prices`.
KERNEL_CLASSES = {
    "matmul": ("MatMul", "Gemm", "Einsum", "Attention", "MatMulInteger", "QLinearMatMul"),
    "conv": ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv"),
    "pool": ("MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool", "MaxUnpool",
             "Resize", "Upsample", "GridSample", "Col2Im"),
    "norm": ("BatchNormalization", "LayerNormalization", "InstanceNormalization", "GroupNormalization",
             "RMSNormalization", "SkipLayerNormalization", "LpNormalization", "MeanVarianceNormalization",
             "Softmax", "LogSoftmax", "Hardmax", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"),
    "reduce": ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare", "ArgMax", "ArgMin", "CumSum", "TopK"),
    "move": ("Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "ScatterND",
             "ScatterElements", "Expand", "Tile", "Pad", "Where", "OneHot", "Trilu", "DepthToSpace",
             "SpaceToDepth", "ReverseSequence", "Compress", "NonZero", "Range", "ConstantOfShape"),
    "view": ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Shape", "Size", "Constant", "Cast",
             "CastLike"),
}
_CLASS_OF = {op: c for c, ops in KERNEL_CLASSES.items() for op in ops}


def kernel_class(node: Node) -> str:
    """The node's kernel class (KERNEL_CLASSES); every other op is "elementwise"."""
    return _CLASS_OF.get(node.op_type, "elementwise") if node.domain in ("", "ai.onnx") else "elementwise"


@dataclass(frozen=True)
class Prices:
    """Microseconds per FLOP and per byte moved for each kernel class, and per node run (the launch): a cost
    model fitted to onnxruntime's profile of real training graphs (`bench/bench_cost.py --calibrate`). A class
    missing here is priced as "elementwise"."""

    per_flop: dict[str, float]
    per_byte: dict[str, float]
    per_node: float

    def of(self, cls: str) -> tuple[float, float]:
        key = cls if cls in self.per_byte else "elementwise"
        return self.per_flop.get(key, 0.0), self.per_byte[key]


class CostModel:
    """`balance`: FLOPs per byte moved (see the module docstring). `symbols`: sizes for symbolic dimensions
    (a batch size, a sequence length) so that graphs with symbolic shapes can be priced. With `prices`, a node
    costs its class's price of its FLOPs and bytes plus a launch, in microseconds, instead of
    `flops + balance * bytes`."""

    def __init__(self, balance: float = DEFAULT_BALANCE, symbols: dict[str, int] | None = None,
                 prices: Prices | None = None):
        self.balance = balance
        self.symbols = dict(symbols or {})
        self.prices = prices

    def cost(self, node: Node) -> float:
        if self.prices is None:
            return self.flops(node) + self.balance * self.bytes_moved(node)
        per_flop, per_byte = self.prices.of(kernel_class(node))
        return per_flop * self.flops(node) + per_byte * self.bytes_moved(node) + self.prices.per_node

    def bytes_moved(self, node: Node) -> int:
        """Bytes of the node's inputs (present ones) and outputs."""
        return sum(self._nbytes(node, v) for v in (*node.inputs, *node.outputs) if v is not None and v.name)

    def flops(self, node: Node) -> float:
        """Arithmetic of the node; 0 for ops priced by their bytes alone."""
        count = _FLOPS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        return float(count(self, node)) if count else 0.0

    def shape(self, node: Node, value: Value) -> tuple[int, ...]:
        """The value's shape in integers, symbols bound through `symbols`; an error naming the node otherwise."""
        if value.shape is None:
            raise UsageError(f"cost of node {node.name!r} ({node.op_type}): the shape of {value.name!r} is unknown; "
                             f"run shape inference first")
        dims = []
        for d in value.shape:
            if isinstance(d, int):
                dims.append(d)
            elif isinstance(d, str) and d in self.symbols:
                dims.append(int(self.symbols[d]))
            else:
                what = f"symbolic dimension {d!r}" if isinstance(d, str) else "an unknown dimension"
                raise UsageError(f"cost of node {node.name!r} ({node.op_type}): {value.name!r} has {what}; "
                                 f"give its size (CostModel symbols)")
        return tuple(dims)

    def _nbytes(self, node: Node, value: Value) -> int:
        if not value.elem_type:
            raise UsageError(f"cost of node {node.name!r} ({node.op_type}): the element type of {value.name!r} "
                             f"is unknown; run shape inference first")
        itemsize = helper.tensor_dtype_to_np_dtype(value.elem_type).itemsize
        return math.prod(self.shape(node, value)) * itemsize


def op_cost(node: Node, model: CostModel | None = None) -> float:
    """Cost of running `node` once under `model` (the default balance, no symbols, when None)."""
    return (model or CostModel()).cost(node)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs per op


def _conv(model: CostModel, node: Node) -> int:
    """2 * output elements * (input channels per group * kernel elements), plus the bias."""
    w = model.shape(node, node.inputs[1])
    out = model.shape(node, node.outputs[0])
    flops = 2 * math.prod(out) * math.prod(w[1:])
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        flops += math.prod(out)
    return flops


def _conv_transpose(model: CostModel, node: Node) -> int:
    """Each input element scatters into (output channels per group * kernel elements) outputs."""
    x = model.shape(node, node.inputs[0])
    w = model.shape(node, node.inputs[1])
    flops = 2 * math.prod(x) * math.prod(w[1:])
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        flops += math.prod(model.shape(node, node.outputs[0]))
    return flops


def _gemm(model: CostModel, node: Node) -> int:
    """2*M*N*K for alpha*A@B, plus M*N for each of the alpha scaling and the beta*C term."""
    a = model.shape(node, node.inputs[0])
    k = a[0] if node.attr("transA", 0) else a[1]
    out = math.prod(model.shape(node, node.outputs[0]))
    flops = 2 * out * k + out
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        flops += out
    return flops


def _matmul(model: CostModel, node: Node) -> int:
    """2 * output elements * the contracted size (the last dimension of A), batch broadcasting included."""
    a = model.shape(node, node.inputs[0])
    return 2 * math.prod(model.shape(node, node.outputs[0])) * a[-1]


def _einsum(model: CostModel, node: Node) -> int:
    """One multiply-add per point of the full index space for each operand after the first (a naive
    contraction); a single operand (a sum or a transposition) costs one addition per input element."""
    equation = node.attr("equation")
    equation = equation.decode() if isinstance(equation, bytes) else equation
    terms = equation.replace(" ", "").split("->")[0].split(",")
    sizes: dict[str, int] = {}
    for term, value in zip(terms, node.inputs):
        shape = model.shape(node, value)
        letters = re.findall(r"\.\.\.|[A-Za-z]", term)
        if "..." in letters:
            # ellipsis dimensions broadcast from the right across operands: name them by distance from the right
            at = letters.index("...")
            width = len(shape) - (len(letters) - 1)
            letters = letters[:at] + [f"...{width - 1 - j}" for j in range(width)] + letters[at + 1:]
        if len(letters) != len(shape):
            raise UsageError(f"cost of node {node.name!r} (Einsum): term {term!r} does not match the rank of "
                             f"{value.name!r} ({len(shape)})")
        for letter, d in zip(letters, shape):
            sizes[letter] = max(sizes.get(letter, 1), d)
    space = math.prod(sizes.values())
    return space if len(terms) == 1 else 2 * space * (len(terms) - 1)


def _attention(model: CostModel, node: Node) -> int:
    """Q@K^T and P@V as batched matrix products, plus about 5 FLOPs per score for scaling, masking and the
    softmax. Inputs are 4-D (batch, heads, sequence, head size) or 3-D (batch, sequence, heads * head size)."""
    q = model.shape(node, node.inputs[0])
    k = model.shape(node, node.inputs[1])
    v = model.shape(node, node.inputs[2])
    if len(q) == 4:
        batch, heads, q_len, qk_size = q
        kv_len, v_size = k[2], v[3]
    else:
        heads = node.attr("q_num_heads")
        kv_heads = node.attr("kv_num_heads")
        if not heads or not kv_heads:
            raise UsageError(f"cost of node {node.name!r} (Attention): 3-D inputs need q_num_heads and "
                             f"kv_num_heads")
        batch, q_len, hidden = q
        kv_len = k[1]
        qk_size, v_size = hidden // heads, v[2] // kv_heads
    scores = batch * heads * q_len * kv_len
    return 2 * scores * (qk_size + v_size) + 5 * scores


_FLOPS = {
    "Conv": _conv,
    "ConvTranspose": _conv_transpose,
    "Gemm": _gemm,
    "MatMul": _matmul,
    "Einsum": _einsum,
    "Attention": _attention,
}


# ---------------------------------------------------------------------------------------------------------------
# Measured costs (`--cost profile`)


def profile_costs(model, symbols: dict[str, int] | None = None, feeds: dict | None = None, runs: int = 5,
                  provider: str = "cpu", seed: int = 0, threads: int | None = None) -> dict[str, float]:
    """Microseconds per run of each node, measured by onnxruntime's profiler: the median over `runs` runs after
    a warm-up run (a median, so one slow run does not move the plan). `model` is a ModelProto or a path. Graph
    optimisations are off, so that every node runs as itself and its time is its own. Inputs not in `feeds` get seeded random data (zeros for integer and bool
    inputs, which are usually indices and masks), their symbolic dimensions sized through `symbols`."""
    import json
    import os
    import tempfile

    import numpy as np
    import onnx
    import onnxruntime as ort

    from ..protos import random_feeds
    from ..runtime import model_bytes, providers

    if not isinstance(model, onnx.ModelProto):
        model = onnx.load(str(model))
    symbols = symbols or {}
    initializers = {t.name for t in model.graph.initializer}
    feeds = dict(feeds or {})
    for vi in model.graph.input:
        if vi.name in initializers or vi.name in feeds:
            continue
        for d in vi.type.tensor_type.shape.dim:
            if not d.HasField("dim_value") and d.dim_param not in symbols:
                raise UsageError(f"--cost profile: input {vi.name!r} has dimension {d.dim_param or '?'!r}; give its "
                                 f"size")
    feeds.update(random_feeds(model, symbols, seed, initializers | set(feeds)))
    with tempfile.TemporaryDirectory() as folder:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.enable_profiling = True
        if threads:
            so.intra_op_num_threads = threads
        so.profile_file_prefix = os.path.join(folder, "profile")
        session = ort.InferenceSession(model_bytes(model), so, providers=providers(provider))
        for _ in range(runs + 1):
            session.run(None, feeds)
        with open(session.end_profiling()) as f:
            events = json.load(f)
    times: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            name = e.get("args", {}).get("node_name") or e["name"][:-len("_kernel_time")]
            times.setdefault(name, []).append(float(e["dur"]))
    # the first run of each node is the warm-up
    return {name: statistics.median(t[1:]) if len(t) > 1 else t[0] for name, t in times.items()}


@dataclass
class ProfiledCosts:
    """Costs measured by `profile_costs`, in the interface of `CostModel`. A node onnxruntime runs as nodes of its
    own (a function op it expands, such as SoftmaxCrossEntropyLoss) is in `expanded`: it is priced by `model`,
    scaled to microseconds by `scale`. Any other node that was not timed is an error naming it, not a zero."""

    microseconds: dict[str, float]
    expanded: frozenset[str] = frozenset()
    model: CostModel | None = None
    scale: float = 0.0  # microseconds per unit of `model`'s cost, over the timed nodes

    @classmethod
    def of_graph(cls, graph, microseconds: dict[str, float], model: CostModel) -> ProfiledCosts:
        """The profile of `graph`, with the nodes it could not time because onnxruntime expanded them."""
        import onnx
        timed = [n for n in graph.nodes if n.name in microseconds]
        expanded = set()
        for n in graph.nodes:
            if n.name in microseconds or n.op_type == "Constant":
                continue
            try:
                schema = onnx.defs.get_schema(n.op_type, graph.opset, n.domain or "")
            except onnx.defs.SchemaError:
                continue
            if schema.has_function or schema.has_context_dependent_function:
                expanded.add(n.name)
        modelled = sum(model.cost(n) for n in timed)
        scale = sum(microseconds[n.name] for n in timed) / modelled if modelled else 0.0
        return cls(microseconds, frozenset(expanded), model, scale)

    def cost(self, node: Node) -> float:
        if node.name in self.microseconds:
            return self.microseconds[node.name]
        if node.name in self.expanded and self.model is not None:
            return self.model.cost(node) * self.scale
        raise UsageError(f"--cost profile: node {node.name!r} ({node.op_type}) was not timed; nodes need unique "
                         f"names, and the profile must come from the same graph")


# Fitted by `bench/bench_cost.py --calibrate` to onnxruntime 1.31's CPU profile (1 thread, graph optimisations
# off) of the training graphs of ResNet-50, BERT-base, ViT-B/16 and GPT-2 small exported by torch.onnx
# (BENCHMARKS.md, "The cost model against onnxruntime"). Microseconds.
CPU_PRICES = Prices(
    per_flop={"matmul": 2.134e-05, "conv": 2.177e-05},
    per_byte={"matmul": 0.0, "conv": 0.0002627, "pool": 0.001019, "norm": 0.000119, "reduce": 6.179e-05,
              "move": 2.418e-05, "view": 7.867e-05, "elementwise": 7.062e-05},
    per_node=0.0,
)
