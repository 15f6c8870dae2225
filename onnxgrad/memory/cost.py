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
from dataclasses import dataclass, field

from onnx import helper

from ..errors import UsageError
from ..ir import Node, Value

DEFAULT_BALANCE = 20.0  # FLOPs per byte moved


@dataclass
class CostModel:
    """`balance`: FLOPs per byte moved (see the module docstring). `symbols`: sizes for symbolic dimensions
    (a batch size, a sequence length) so that graphs with symbolic shapes can be priced."""

    balance: float = DEFAULT_BALANCE
    symbols: dict[str, int] = field(default_factory=dict)

    def cost(self, node: Node) -> float:
        return self.flops(node) + self.balance * self.bytes_moved(node)

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
