"""Which nodes of a graph onnxruntime's CUDA provider runs, and which it leaves to the CPU.

The CUDA provider claims a node when its kernel registry has a kernel for the node's op, for the opset version
that defines the op, and for the element types of the node's inputs and outputs; it then refuses a few attribute
forms (`_refused_form`). A node it does not claim runs on the CPU provider, with copies across the bus both
ways: correct, silent and slow. `cuda_fallbacks(model)` names each such node.

`KERNELS` below is the ai.onnx part of the CUDA provider's kernel table as onnxruntime generates it
(`docs/OperatorKernels.md`, section "Operators implemented by CUDAExecutionProvider", read at commit
001d12d2623fd411ce0f83d05abb5e82304a3389 of github.com/microsoft/onnxruntime), and the refused forms are those of
`CUDAExecutionProvider::GetCapability` (`onnxruntime/core/providers/cuda/cuda_execution_provider.cc`, read at
commit 0018ddb68e9b). The installed onnxruntime-gpu (1.31.1) cannot list its own registry on a machine without a
GPU: loading the provider needs the CUDA libraries and the driver, and `get_all_opkernel_def()` then constructs
the provider, which needs a device. `bench/gpu_check.py` sets this table beside the placement onnxruntime
actually chooses, where a GPU is present.

Left out of the table: float8, 4-bit, string and sequence element types (no training graph of onnxgrad's carries
them); a node with such a type is reported. Not modelled: onnxruntime also places small shape computations
(int64 Shape -> Gather -> Concat chains) on the CPU on purpose (`GetCpuPreferredNodes`); those are cheap, by
design, and not reported here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import onnx
from onnx import TensorProto, defs

from .contract import PHASES_KEY

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

# op | opset versions of the kernel (as the op's since_version: "13+", "6-12", "9") | constraint=types; ...
# A constraint is a type parameter of the op's schema (T, T1, Tind, ...) or the name of an input or output;
# constraints the table does not name take any type.
KERNELS = """
Abs | 13+ | T=NUM
Abs | 6-12 | T=f64 f32 f16 i16 i32 i64 i8 u16 u32 u64 u8
Add Sub Mul Div | 14+ | T=NUM
Add Sub Mul Div | 13 | T=bf16 f64 f32 f16 i32 i64 u32 u64
Add Sub Mul Div | 7-12 | T=CMP
Affine | 1+ | T=FL
And Or Xor | 7+ | T=bool; T1=bool
ArgMax ArgMin | 1+ | T=FL
Attention | 23+ | T1=bf16 f32 f16; T2=bf16 f32 f16; U=bf16 bool f32 f16
AveragePool | 22+ | T=BFL
AveragePool | 7-21 | T=FL
BatchNormalization | 15+ | T=FL; T1=FL; T2=FL
BatchNormalization | 14 | T=FL; U=FL
BatchNormalization | 7-13 | T=FL
Cast | 13+ | T1=STD; T2=STD
Cast | 6-12 | T1=f64 f32 f16 i16 i32 i64 i8 u16 u32 u64 u8 bool; T2=STD
Ceil Floor | 6+ | T=FL
Clip | 12+ | T=f64 f32 f16 i64 i8 u64 u8
Clip | 6-11 | T=f32
Compress | 9+ | T=STD; T1=bool
Concat | 4+ | T=STD
ConstantOfShape | 9+ | T1=i64; T2=STD
Conv | 22+ | T=BFL
Conv | 1-21 | T=FL
ConvTranspose | 1+ | T=FL
Cos Sin | 7+ | T=FL
Crop | 1+ | T=FL
CumSum | 14+ | T=CMP; T2=i32 i64
CumSum | 11-13 | T=f64 f32 i32 i64 u32 u64; T2=i32 i64
DepthToSpace SpaceToDepth | 1+ | T=FL
DequantizeLinear | 19+ | T1=i8 u8; T2=f32 f16
DequantizeLinear | 10-18 | T=i8 u8
Dropout | 13+ | T=BFL; T1=BFL; T2=bool
Dropout | 12 | T=FL; T1=FL; T2=bool
Dropout | 10-11 | T=FL; T1=bool
Dropout | 7-9 | T=FL
Einsum | 12+ | T=FL
Elu Selu LeakyRelu PRelu Softplus Softsign ThresholdedRelu | 1+ | T=FL
Equal | 11+ | T=bool f64 f32 f16 i32 i64 u32 u64; T1=bool
Equal | 7-10 | T=bool i32 i64
Erf Exp Sigmoid Tanh Sqrt | 13+ | T=BFL
Erf Exp Sigmoid Tanh Sqrt | 6-12 | T=FL
Expand | 8+ | T=STD
EyeLike | 9+ | T1=f64 f32 i32 i64 u64; T2=f64 f32 i32 i64 u64
Flatten | 1+ | T=STD
GRU LSTM RNN | 7+ | T=FL; T1=i32
Gather | 1+ | T=STD; Tind=i32 i64
GatherElements | 11+ | T=STD; Tind=i32 i64
GatherND | 13+ | T=bf16 bool f64 f32 f16 i64; indices=i64
GatherND | 11-12 | T=bool f64 f32 f16 i64; indices=i64
Gelu | 20+ | T=BFL
Gemm MatMul | 13+ | T=BFL
Gemm MatMul | 1-12 | T=FL
GlobalAveragePool GlobalMaxPool | 1+ | T=FL
Greater Less | 9+ | T=CMP; T1=bool
Greater Less | 7-8 | T=FL
GreaterOrEqual LessOrEqual | 12+ | T=CMP; T1=bool
GridSample | 16+ | T1=f32; T2=f32
HardSigmoid HardSwish | 22+ | T=BFL
HardSigmoid | 6-21 | T=FL
HardSwish | 14-21 | T=FL
Identity | 14+ | V=STD
Identity | 1-13 | T=STD
If | 1+ | B=bool; V=STD
ImageScaler | 1+ | T=FL
InstanceNormalization | 6+ | T=FL
IsInf | 20+ | T1=BFL; T2=bool
IsInf | 10-19 | T1=f64 f32; T2=bool
IsNaN | 13+ | T1=BFL; T2=bool
IsNaN | 9-12 | T1=FL; T2=bool
LRN | 1+ | T=FL
LayerNormalization | 17+ | T=BFL; U=f32
Log Reciprocal | 6+ | T=FL
LogSoftmax | 1+ | T=FL
Loop | 1+ | B=bool; I=i64; V=STD
MatMulInteger | 10+ | T1=i8; T2=i8; T3=i32
Max Min | 12+ | T=bf16 f64 f32 f16 i32 i64 u32 u64
Max Min | 6-11 | T=BFL
MaxPool | 12+ | T=f64 f32 f16 i8 u8; I=i64
MaxPool | 8-11 | T=FL; I=i64
MaxPool | 1-7 | T=FL
Mod | 13+ | T=bf16 f64 f32 f16 i32 i64 u32 u64
Mod | 10-12 | T=CMP
Neg | 13+ | T=bf16 f64 f32 f16 i16 i32 i64 i8
Neg | 6-12 | T=f64 f32 f16 i16 i32 i64 i8
NonZero | 9+ | T=bool f32 f16 i32 i64 u8
Not | 1+ | T=bool
OneHot | 11+ | T1=i32 i64; T2=i32 i64; T3=f32 f16 i64
Pad | 13+ | T=bool f64 f32 f16
Pad | 2-12 | T=FL
ParametricSoftplus ScaledTanh | 1+ | T=FL
Pow | 15+ | T=bf16 f64 f32 f16 i32 i64; T1=bf16 f64 f32 f16 i32 i64
Pow | 13-14 | T=bf16 f64 f32 f16 i32 i64; T1=f64 f32 f16 i32 i64
Pow | 12 | T=f64 f32 f16 i32 i64; T1=f64 f32 f16 i32 i64
Pow | 7-11 | T=FL
QuantizeLinear | 19+ | T1=f32 f16; T2=i8 u8
QuantizeLinear | 10-18 | T1=f32; T2=i8 u8
RMSNormalization | 23+ | T=BFL; V=BFL
RandomNormal RandomUniform | 1+ | T=FL
RandomNormalLike RandomUniformLike | 1+ | T1=STD; T2=FL
Range | 11+ | T=f64 f32 i16 i32 i64
ReduceL1 ReduceL2 ReduceMean ReduceProd | 1+ | T=f64 f32 f16 i32
ReduceLogSum ReduceLogSumExp ReduceSumSquare | 1+ | T=FL
ReduceMax | 1+ | T=f64 f32 f16 i32 i64
ReduceMin | 1+ | T=f64 f32 f16 i32 i64 i8 u8
ReduceSum | 13+ | T=bf16 f64 f32 f16 i32 i64
ReduceSum | 1-12 | T=f64 f32 f16 i32 i64
Relu | 13+ | T=BFL
Relu | 6-12 | T=FL
Reshape | 5+ | T=STD; shape=i64
Reshape | 1-4 | T=STD
Resize | 11+ | T1=f64 f32 f16 i32 u8
Resize | 10 | T=f64 f32 f16 i32 u8
ReverseSequence | 10+ | T=STD
RoiAlign | 10+ | T1=f64 f32; T2=i64
RotaryEmbedding | 23+ | T=bf16 f32 f16; M=i64
Round | 11+ | T=FL
Scan | 9+ | V=STD
Scan | 8 | I=i64; V=STD
Scatter | 9-10 | T=STD; Tind=i32 i64
ScatterElements | 11+ | T=STD; Tind=i32 i64
ScatterND | 11+ | T=STD
Shape | 1+ | T=STD; T1=i64
Shrink | 9+ | T=f64 f32 f16 i16 i32 i64 i8 u16 u32 u64 u8
Sign | 13+ | T=NUM
Size | 1+ | T=STD; T1=i64
Slice | 10+ | T=STD; Tind=i32 i64
Slice | 1-9 | T=STD
Softmax | 13+ | T=BFL
Softmax | 1-12 | T=FL
Split | 2+ | T=STD
Squeeze Unsqueeze | 1+ | T=STD
Sum | 6+ | T=BFL
TensorScatter | 24+ | T=STD
Tile | 13+ | T=bf16 f64 f32 f16 i32 i64; T1=i64
Tile | 6-12 | T=f64 f32 f16 i32 i64; T1=i64
TopK | 1+ | T=f64 f32 f16 i32 i64; I=i64
Transpose | 1+ | T=STD
Trilu | 14+ | T=STD
Upsample | 7-9 | T=f64 f32 f16 i32 u8
Where | 16+ | B=bool; T=bf16 f64 f32 f16 i32 i64 u8
Where | 9-15 | B=bool; T=f64 f32 f16 i32 i64 u8
"""

# Ops that never reach a provider: onnxruntime turns Constant nodes into initializers when it loads the graph.
_NO_KERNEL_NEEDED = frozenset({"Constant"})


@dataclass(frozen=True)
class Kernel:
    since: int
    until: int
    types: dict  # constraint -> frozenset of element types


def _parse(text: str) -> dict[str, list[Kernel]]:
    table: dict[str, list[Kernel]] = {}
    for line in text.strip().splitlines():
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


_TABLE = _parse(KERNELS)


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


def _phases(text: str, count: int) -> list[str] | None:
    """The phase of each node as the training graph records it (runs of [phase, count]), when it does."""
    try:
        phases = [p for p, k in json.loads(text) for _ in range(int(k))]
    except (ValueError, TypeError):
        return None
    return phases if len(phases) == count else None


def fallback_nodes(model: onnx.ModelProto) -> list[Fallback]:
    """Every node, subgraphs included, that onnxruntime's CUDA provider would not run."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception:  # a model over 2 GB or one shape inference cannot take: use the types the file has
        inferred = model
    metadata = {p.key: p.value for p in model.metadata_props}
    phases = _phases(metadata.get(PHASES_KEY, ""), len(model.graph.node))
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
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    count(sub)
    count(model.graph)
    return total - len(fallback_nodes(model)), total
