"""Which nodes of a graph onnxruntime's CUDA provider runs, and which it leaves to the CPU.

The CUDA provider claims a node when its kernel registry has a kernel for the node's op, for the opset version
that defines the op, and for the element types of the node's inputs and outputs; it then refuses a few attribute
forms (`_refused_form`). A node it does not claim runs on the CPU provider, with copies across the bus both
ways: correct, silent and slow. `cuda_fallbacks(model)` names each such node.

The kernel table, `data/cuda_kernels.txt` (package data), is the ai.onnx part of the CUDA provider's table as
onnxruntime generates it (`docs/OperatorKernels.md`, section "Operators implemented by CUDAExecutionProvider",
read at commit 001d12d2623fd411ce0f83d05abb5e82304a3389 of github.com/microsoft/onnxruntime); the refused forms
are those of `CUDAExecutionProvider::GetCapability` (`onnxruntime/core/providers/cuda/cuda_execution_provider.cc`,
read at commit 0018ddb68e9b). The installed onnxruntime-gpu (1.31.1) cannot list its own registry on a machine without a
GPU: loading the provider needs the CUDA libraries and the driver, and `get_all_opkernel_def()` then constructs
the provider, which needs a device. `bench/gpu_check.py` sets this table beside the placement onnxruntime
actually chooses, where a GPU is present.

Left out of the table: float8, 4-bit, string and sequence element types (no training graph of onnxgrad's carries
them); a node with such a type is reported. Not modelled: onnxruntime also places small shape computations
(int64 Shape -> Gather -> Concat chains) on the CPU on purpose (`GetCpuPreferredNodes`); those are cheap, by
design, and not reported here.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import onnx
from onnx import TensorProto, defs

from .protos import model_phases, subgraphs

SOURCE = ("onnxruntime docs/OperatorKernels.md (CUDAExecutionProvider, ai.onnx) at commit 001d12d2623f, and "
          "CUDAExecutionProvider::GetCapability's refused forms at commit 0018ddb68e9b")

_TYPE_CODES = {
    "bf16": TensorProto.BFLOAT16, "bool": TensorProto.BOOL, "f64": TensorProto.DOUBLE, "f32": TensorProto.FLOAT,
    "f16": TensorProto.FLOAT16, "i8": TensorProto.INT8, "i16": TensorProto.INT16, "i32": TensorProto.INT32,
    "i64": TensorProto.INT64, "u8": TensorProto.UINT8, "u16": TensorProto.UINT16, "u32": TensorProto.UINT32,
    "u64": TensorProto.UINT64,
}
# Shorthands for the type lists the table repeats.
_SETS = {
    "STD": "bf16 bool f64 f32 f16 i16 i32 i64 i8 u16 u32 u64 u8",  # every numeric type, bool and bfloat16
    "NUM": "bf16 f64 f32 f16 i16 i32 i64 i8 u16 u32 u64 u8",       # STD without bool
    "FL": "f64 f32 f16",
    "BFL": "bf16 f64 f32 f16",
    "CMP": "f64 f32 f16 i32 i64 u32 u64",                          # the comparison ops' types
}

# The kernel table, data/cuda_kernels.txt, has one line per kernel (blank lines and `#` comments aside):
# op [op ...] | opset versions of the kernel (as the op's since_version: "13+", "6-12", "9") | constraint=types; ...
# A constraint is a type parameter of the op's schema (T, T1, Tind, ...) or the name of an input or output;
# constraints the table does not name take any type; a type list may use the shorthands of `_SETS`.
KERNEL_TABLE = "data/cuda_kernels.txt"

# Ops that never reach a provider: onnxruntime turns Constant nodes into initializers when it loads the graph.
_NO_KERNEL_NEEDED = frozenset({"Constant"})


@dataclass(frozen=True)
class Kernel:
    since: int
    until: int
    types: dict  # constraint -> frozenset of element types


def _parse(text: str) -> dict[str, list[Kernel]]:
    table: dict[str, list[Kernel]] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        ops, versions, constraints = (part.strip() for part in line.split("|"))
        if versions.endswith("+"):
            since, until = int(versions[:-1]), 10**9
        elif "-" in versions:
            since, until = (int(v) for v in versions.split("-"))
        else:
            since = until = int(versions)
        types = {}
        for item in constraints.split(";"):
            name, _, listed = item.strip().partition("=")
            codes = " ".join(_SETS.get(code, code) for code in listed.split())
            types[name] = frozenset(_TYPE_CODES[code] for code in codes.split())
        for op in ops.split():
            table.setdefault(op, []).append(Kernel(since, until, types))
    return table


_TABLE = _parse(resources.files(__package__).joinpath(KERNEL_TABLE).read_text(encoding="utf-8"))


def _type_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type).lower()


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _refused_form(node: onnx.NodeProto) -> str | None:
    """The attribute forms the CUDA provider refuses although it has a kernel (GetCapability)."""
    if node.op_type == "ConvTranspose":
        pads = list(_attr(node, "pads", []))
        n = len(pads) // 2
        if any(pads[i] != pads[i + n] for i in range(n)):
            return f"asymmetric pads {pads} (cuDNN takes symmetric pads only)"
        auto_pad = _attr(node, "auto_pad", b"NOTSET")
        auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            return f"auto_pad={auto_pad} (may need asymmetric pads)"
    if node.op_type == "Cast" and _attr(node, "to") == TensorProto.STRING:
        return "Cast to string"
    if node.op_type in ("LSTM", "GRU", "RNN"):
        for name in ("activation_alpha", "activation_beta", "clip"):
            if _attr(node, name) is not None:
                return f"attribute {name}"
        if node.op_type == "GRU" and _attr(node, "linear_before_reset", 0) != 1:
            return "linear_before_reset=0 (cuDNN runs 1 only)"
        if node.op_type == "LSTM" and (_attr(node, "input_forget", 0) != 0
                                       or (len(node.input) > 7 and node.input[7])):
            return "input_forget or peepholes"
    return None


def _constraint_types(schema, node: onnx.NodeProto, types: dict[str, int]) -> dict[str, set[int]]:
    """For each type parameter and formal name of the schema: the element types the node gives it."""
    found: dict[str, set[int]] = {}

    def visit(formals, names):
        for i, name in enumerate(names):
            if not name:
                continue
            formal = formals[min(i, len(formals) - 1)] if formals else None
            if formal is None:
                continue
            t = types.get(name)
            if t is None:
                continue
            found.setdefault(formal.type_str, set()).add(t)
            found.setdefault(formal.name, set()).add(t)
    visit(schema.inputs, node.input)
    visit(schema.outputs, node.output)
    return found


def node_fallback(node: onnx.NodeProto, opset: int, types: dict[str, int]) -> str | None:
    """Why the CUDA provider would leave this node to the CPU, or None when it runs it."""
    if node.domain not in ("", "ai.onnx"):
        return f"domain {node.domain!r}: not in the CUDA table checked here"
    if node.op_type in _NO_KERNEL_NEEDED:
        return None
    kernels = _TABLE.get(node.op_type)
    if not kernels:
        return "no CUDA kernel for this op"
    try:
        schema = defs.get_schema(node.op_type, opset)
    except Exception:  # an op unknown to onnx at this opset: the checker would have refused the model
        return f"no schema at opset {opset}"
    version = schema.since_version
    matching = [k for k in kernels if k.since <= version <= k.until]
    if not matching:
        return f"no CUDA kernel for {node.op_type}-{version} (opset {opset})"
    given = _constraint_types(schema, node, types)
    misses = []
    for kernel in matching:
        bad = [f"{c}={_type_name(t)}" for c, allowed in kernel.types.items() for t in sorted(given.get(c, ()))
               if t not in allowed]
        if not bad:
            refused = _refused_form(node)
            return f"refused form: {refused}" if refused else None
        misses.append(", ".join(bad))
    return f"no CUDA kernel for the types {misses[0]}"


def _opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return 1


def _value_types(graph: onnx.GraphProto, outer: dict[str, int]) -> dict[str, int]:
    types = dict(outer)
    for vi in [*graph.input, *graph.value_info, *graph.output]:
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in graph.initializer:
        types[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant" and node.output:
            for a in node.attribute:
                if a.name == "value":
                    types[node.output[0]] = a.t.data_type
                elif a.name in ("value_int", "value_ints"):
                    types[node.output[0]] = TensorProto.INT64
                elif a.name in ("value_float", "value_floats"):
                    types[node.output[0]] = TensorProto.FLOAT
    return types


@dataclass(frozen=True)
class Fallback:
    """A node the CUDA provider would leave to the CPU."""
    node: str       # its name (its index, '#k', when it has none), prefixed by its subgraph's path
    op_type: str
    phase: str      # forward, recompute, backward or optimizer, as the graph records it; '' when it does not
    reason: str

    def __str__(self) -> str:
        phase = f" [{self.phase}]" if self.phase else ""
        return f"{self.op_type} node {self.node!r}{phase}: {self.reason}"


def _walk(graph: onnx.GraphProto, opset: int, outer: dict[str, int], path: str, phases, out: list) -> None:
    types = _value_types(graph, outer)
    for k, node in enumerate(graph.node):
        why = node_fallback(node, opset, types)
        if why is None:
            unknown = [n for n in [*node.input, *node.output] if n and n not in types]
            if unknown and node.op_type not in _NO_KERNEL_NEEDED:
                why = f"element type of {unknown[0]!r} unknown: not checked"
        name = f"{path}{node.name or f'#{k}'}"
        if why is not None:
            out.append(Fallback(name, node.op_type, phases[k] if phases is not None else "", why))
        for a in node.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                # a subgraph's nodes belong to the phase of the node that holds them
                inner = None if phases is None else [phases[k]] * len(sub.node)
                _walk(sub, opset, types, f"{name}/{a.name}/", inner, out)


def fallback_nodes(model: onnx.ModelProto) -> list[Fallback]:
    """Every node, subgraphs included, that onnxruntime's CUDA provider would not run."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # a model over 2 GB or one shape inference cannot take: use the types the file has
        inferred = model
    phases = model_phases(model)
    out: list[Fallback] = []
    _walk(inferred.graph, _opset(model), {}, "", phases, out)
    return out


def cuda_fallbacks(model: onnx.ModelProto) -> list[str]:
    """One line per node that onnxruntime's CUDA provider would not run (it falls back to the CPU)."""
    return [str(f) for f in fallback_nodes(model)]


def cuda_coverage(model: onnx.ModelProto) -> tuple[int, int]:
    """(nodes the CUDA provider runs, nodes in the graph, subgraphs included, Constants excluded)."""
    total = 0

    def count(graph):
        nonlocal total
        for node in graph.node:
            if node.op_type not in _NO_KERNEL_NEEDED:
                total += 1
            for sub in subgraphs(node):
                count(sub)
    count(model.graph)
    return total - len(fallback_nodes(model)), total
