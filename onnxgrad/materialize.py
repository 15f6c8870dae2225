"""`onnxgrad materialize`: give a weightless model (the onnx model zoo's "light" graphs) random trainable weights.

The light graphs that ship inside the onnx wheel keep each weight as a `ConstantOfShape` node filling a shape
with 0.02, so they are tiny files. Here each such node (with a constant shape), and each `Constant` node
holding a float tensor of two or more elements, becomes an initializer of the same name with seeded random
values whose scale suits the weight's role, found from the nodes that read it:

| role (who reads the tensor) | values |
|---|---|
| Conv / ConvTranspose weight, Gemm / MatMul matrix | normal, std sqrt(2 / fan_in) (He) |
| Conv / Gemm bias, Add / Sub operand | normal, std 0.05 |
| BatchNormalization / InstanceNormalization / LayerNormalization scale, Mul operand | 1 + normal(0, 0.1) |
| BatchNormalization bias, mean | normal, std 0.1 |
| BatchNormalization variance | uniform(0.5, 1.5), so positive |
| PRelu slope | uniform(0.1, 0.3) |
| anything else | normal, std 0.05 |

Readers are found through shape-only ops (Unsqueeze, Reshape, ...), so the Caffe-style `Mul(x, Unsqueeze(s))`
scale after a BatchNormalization counts as a scale. Initializers the model already has (the zoo files keep a
few small real tensors) are kept as they are; the placeholders' shape tensors and initializers nothing reads
are dropped, and no initializer stays a graph input (IR >= 4).

Then, unless `calibrate=False`, one forward pass on a seeded N(0, 1) input rescales each Conv / Gemm / MatMul
weight so that the layer's output (before its bias) has a mean square of 1, every layer seeing the already
rescaled layers before it: without this, residual sums double the variance once per block (ResNet-50's
logits reach a std of ~2e4) and the final Softmax saturates to one-hot, where every gradient is ~0. The pass
runs a copy of the model in which each such layer also computes its scale (`y0 = Conv(x, W)`,
`s = sqrt(mean(y0^2))`, then the real `Conv(x, W / s, B)`), so every layer is calibrated in one run.

Each tensor's values come from its own generator seeded by (seed, crc32(name)), so one tensor's values do not
depend on the others and a seed gives the same file every time (across machines the calibrated scales may
differ in the last bits, as onnxruntime's kernels do).
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from . import runtime
from .errors import InvalidModelError, UsageError

log = logging.getLogger("onnxgrad")

# ops whose input 0 passes a tensor on without changing its values' meaning: follow them to the real reader
PASS_THROUGH = frozenset({"Unsqueeze", "Squeeze", "Reshape", "Flatten", "Identity", "Cast", "Transpose", "Expand"})
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
MATMUL_OPS = ("Conv", "Gemm", "MatMul")


@dataclass
class MaterializeReport:
    placeholders: int = 0           # ConstantOfShape nodes turned into initializers
    constants: int = 0              # Constant nodes turned into initializers
    parameters: int = 0             # elements written
    roles: dict[str, int] = field(default_factory=dict)
    calibrated: int = 0             # weights rescaled by the calibration pass

    def to_json(self) -> dict:
        return {"placeholders": self.placeholders, "constants": self.constants, "parameters": self.parameters,
                "roles": dict(sorted(self.roles.items())), "calibrated": self.calibrated}


def materialize(model: onnx.ModelProto, seed: int = 0, calibrate: bool = True) -> tuple[onnx.ModelProto,
                                                                                           MaterializeReport]:
    """A copy of `model` whose placeholder weights are seeded random initializers (see the module doc)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    report = MaterializeReport()
    consts = _constant_values(g)
    readers = _readers(g)
    keep, shape_names = [], set()
    weights: dict[str, np.ndarray] = {}   # kept as arrays until the end: the calibration run feeds them
    for node in g.node:
        made = _placeholder(node, consts)
        if made is None:
            keep.append(node)
            continue
        name, shape, dtype = made
        role, fan_in = _role(name, shape, readers, consts)
        weights[name] = _random(name, shape, role, fan_in, seed).astype(helper.tensor_dtype_to_np_dtype(dtype),
                                                                        copy=False)
        report.roles[role] = report.roles.get(role, 0) + 1
        report.parameters += weights[name].size
        if node.op_type == "ConstantOfShape":
            report.placeholders += 1
            shape_names.add(node.input[0])
        else:
            report.constants += 1
    if not weights:
        raise UsageError("the model has no placeholder weights (ConstantOfShape with a constant shape, or float "
                         "Constant nodes) to materialize")
    del g.node[:]
    g.node.extend(keep)
    # IR 3 lists every initializer as a graph input; IR 4 lets them be plain initializers (trainable weights
    # that a caller may still override through build-grad's parameter inputs)
    init_names = {t.name for t in g.initializer} | set(weights)
    _drop_unused(g, shape_names)
    data_inputs = [vi for vi in g.input if vi.name not in init_names]
    del g.input[:]
    g.input.extend(data_inputs)
    out.ir_version = max(min(out.ir_version, runtime.least_ir_version(out)), 4)  # one onnxruntime accepts
    if calibrate:
        report.calibrated = _calibrate(out, weights, seed)
    for name, values in weights.items():
        t = g.initializer.add()
        t.name, t.data_type = name, helper.np_dtype_to_tensor_dtype(values.dtype)
        t.dims.extend(values.shape)
        t.raw_data = values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
    return out, report


def _placeholder(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> tuple[str, tuple[int, ...], int] | None:
    """(name, shape, dtype) when the node is a placeholder weight, else None."""
    if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx") and node.input[0] in consts:
        dtype = TensorProto.FLOAT
        for a in node.attribute:
            if a.name == "value":
                dtype = a.t.data_type
        if dtype not in FLOAT_TYPES:
            return None
        shape = tuple(int(d) for d in consts[node.input[0]].reshape(-1))
        return node.output[0], shape, dtype
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        for a in node.attribute:
            if a.name == "value" and a.t.data_type in FLOAT_TYPES and int(np.prod(a.t.dims)) >= 2:
                return node.output[0], tuple(a.t.dims), a.t.data_type
    return None


def _constant_values(g: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Small integer tensors known without running the graph: initializers and Constant outputs."""
    values = {t.name: numpy_helper.to_array(t) for t in g.initializer
              if t.data_type in (TensorProto.INT64, TensorProto.INT32)}
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value" and a.t.data_type in (TensorProto.INT64, TensorProto.INT32):
                    values[n.output[0]] = numpy_helper.to_array(a.t)
    return values


def _readers(g: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for n in g.node:
        for i, name in enumerate(n.input):
            if name:
                readers.setdefault(name, []).append((n, i))
    return readers


def _role(name: str, shape: tuple[int, ...], readers, consts) -> tuple[str, int]:
    """The weight's role and fan-in, from the first reader past any shape-only ops (whose effect on the
    shape is followed where it is known, so a Reshape'd Gemm matrix gets the right fan-in)."""
    seen = set()
    frontier = [(name, shape)]
    while frontier:
        current, cur_shape = frontier.pop(0)
        if current in seen:
            continue
        seen.add(current)
        for node, i in readers.get(current, []):
            if node.op_type in PASS_THROUGH and i == 0:
                out_shape = _passed_shape(node, cur_shape, consts)
                frontier.extend((o, out_shape) for o in node.output)
                continue
            if cur_shape is None:  # lost track of the shape: a conv-like fan-in of the stored shape
                return _role_at(node, i, shape)[0], int(np.prod(shape[1:], dtype=np.int64))
            return _role_at(node, i, cur_shape)
    return "other", 0


def _passed_shape(node: onnx.NodeProto, shape: tuple[int, ...] | None, consts) -> tuple[int, ...] | None:
    """The output shape of a shape-only op, where it follows from the input shape and constants alone."""
    if shape is None:
        return None
    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in ("Identity", "Cast"):
        return shape
    if op == "Flatten":
        axis = attrs.get("axis", 1) % (len(shape) + 1) if shape else 0
        return (int(np.prod(shape[:axis], dtype=np.int64)), int(np.prod(shape[axis:], dtype=np.int64)))
    if op == "Transpose":
        perm = attrs.get("perm", list(range(len(shape)))[::-1])
        return tuple(shape[p] for p in perm)
    if op == "Reshape" and len(node.input) > 1 and node.input[1] in consts:
        target = [int(d) for d in consts[node.input[1]].reshape(-1)]
        target = [shape[k] if d == 0 and k < len(shape) else d for k, d in enumerate(target)]
        if target.count(-1) == 1:
            known = int(np.prod([d for d in target if d != -1], dtype=np.int64))
            target[target.index(-1)] = int(np.prod(shape, dtype=np.int64)) // max(known, 1)
        return tuple(target) if -1 not in target else None
    return None


def _role_at(node: onnx.NodeProto, i: int, shape: tuple[int, ...]) -> tuple[str, int]:
    op = node.op_type
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in ("Conv", "ConvTranspose"):
        if i == 1:
            return "conv weight", int(np.prod(shape[1:], dtype=np.int64))
        return "bias", 0
    if op == "Gemm":
        if i == 2:
            return "bias", 0
        if len(shape) != 2:
            return "other", 0
        if i == 1:
            return "matrix", shape[1] if attrs.get("transB", 0) else shape[0]
        return "matrix", shape[0] if attrs.get("transA", 0) else shape[1]
    if op == "MatMul" and len(shape) >= 2:
        return "matrix", shape[-2] if i == 1 else shape[-1]
    if op in ("BatchNormalization",):
        return {1: ("norm scale", 0), 2: ("norm bias", 0), 3: ("mean", 0), 4: ("variance", 0)}.get(i, ("other", 0))
    if op in ("InstanceNormalization", "LayerNormalization", "GroupNormalization"):
        return ("norm scale", 0) if i == 1 else ("norm bias", 0)
    if op == "Mul":
        return "norm scale", 0
    if op in ("Add", "Sub", "Sum"):
        return "bias", 0
    if op == "PRelu" and i == 1:
        return "slope", 0
    return "other", 0


def _random(name: str, shape: tuple[int, ...], role: str, fan_in: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if role in ("conv weight", "matrix"):
        std = np.sqrt(2.0 / max(fan_in, 1))
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))
    if role == "norm scale":
        return 1 + rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    if role in ("norm bias", "mean"):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
    if role == "variance":
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if role == "slope":
        return rng.uniform(0.1, 0.3, shape).astype(np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)


def _drop_unused(g: onnx.GraphProto, candidates: set[str]) -> None:
    """Drop the placeholders' shape tensors and any initializer that nothing reads (subgraphs included):
    leftovers of the zoo's converter, which onnxruntime warns about."""
    read = {o.name for o in g.output}
    stack = [g]
    while stack:
        sub = stack.pop()
        for n in sub.node:
            read.update(n.input)
            for a in n.attribute:
                stack.extend([a.g] if a.type == onnx.AttributeProto.GRAPH else a.graphs)
    unused = (candidates | {t.name for t in g.initializer}) - read
    if unused:
        kept = [t for t in g.initializer if t.name not in unused]
        del g.initializer[:]
        g.initializer.extend(kept)
        kept_nodes = [n for n in g.node if not (n.op_type == "Constant" and n.output[0] in unused)]
        del g.node[:]
        g.node.extend(kept_nodes)


def _calibrate(model: onnx.ModelProto, weights: dict[str, np.ndarray], seed: int) -> int:
    """Divide the weights of Conv, Gemm and MatMul layers, in place, by their output's root mean square
    (module doc). The calibration graph takes the weights as inputs, so they are never copied into protos."""
    import onnxruntime as ort

    g = model.graph
    uses: dict[str, int] = {}
    for n in g.node:
        for name in n.input:
            uses[name] = uses.get(name, 0) + 1
    producer = {o: n for n in g.node for o in n.output}
    feeds = {}
    rng = np.random.default_rng([seed, 0x5EED])
    for vi in g.input:
        t = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if t.elem_type not in FLOAT_TYPES or any(d is None for d in dims):
            log.info("materialize: input %s is not a float tensor of fixed shape; weights left uncalibrated",
                     vi.name)
            return 0
        feeds[vi.name] = rng.standard_normal(dims).astype(helper.tensor_dtype_to_np_dtype(t.elem_type))
    probe = helper.make_graph([], g.name, list(g.input), [], list(g.initializer))
    for name, values in weights.items():
        probe.input.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(values.dtype),
                                                         list(values.shape)))
        feeds[name] = values
    scales = []   # (weight name, scale output name)
    for k, n in enumerate(g.node):
        w = _weight_input(n, weights, producer, uses)
        if w is None:
            probe.node.append(n)
            continue
        i, wname = w
        tag = f"__calib{k}"
        y0 = tag + "_y0"
        plain = probe.node.add()
        plain.CopyFrom(n)
        plain.name = tag + "_plain"
        del plain.output[:]
        plain.output.append(y0)
        if n.op_type == "Conv":
            del plain.input[2:]
        elif n.op_type == "Gemm" and len(n.input) > 2 and n.input[2]:  # Gemm's C is not optional at opset 9
            probe.node.append(helper.make_node("Sub", [y0, n.input[2]], [tag + "_y0b"]))
            y0 = tag + "_y0b"
        probe.node.extend([
            helper.make_node("Mul", [y0, y0], [tag + "_sq"]),
            helper.make_node("ReduceMean", [tag + "_sq"], [tag + "_ms"], keepdims=0),
            helper.make_node("Sqrt", [tag + "_ms"], [tag + "_s"]),
            helper.make_node("Div", [n.input[i], tag + "_s"], [tag + "_w"]),
        ])
        real = probe.node.add()
        real.CopyFrom(n)
        real.input[i] = tag + "_w"
        scales.append((wname, tag + "_s"))
    if not scales:
        return 0
    for wname, s in scales:
        probe.output.append(helper.make_tensor_value_info(s, helper.np_dtype_to_tensor_dtype(weights[wname].dtype),
                                                          []))
    probe_model = helper.make_model(probe, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(runtime.model_bytes(probe_model), so, providers=["CPUExecutionProvider"])
        values = sess.run([s for _, s in scales], feeds)
    except Exception as e:  # onnxruntime reports many kinds of failure
        raise InvalidModelError(f"materialize: the calibration run failed: {str(e).splitlines()[0]}") from None
    for (wname, _), s in zip(scales, values):
        s = float(s)
        if not np.isfinite(s) or s <= 0:
            raise InvalidModelError(f"materialize: layer weight {wname!r} gives a non-finite or zero output "
                                    f"during calibration (root mean square {s})")
        weights[wname] /= weights[wname].dtype.type(s)
    return len(scales)


def _weight_input(n: onnx.NodeProto, weights: dict[str, np.ndarray], producer, uses) -> tuple[int, str] | None:
    """(input index, weight name) when the layer's weight input is a materialized weight, possibly through
    shape-only ops (all linear, so dividing their output divides the weight), that nothing else reads."""
    if n.op_type not in MATMUL_OPS or n.domain not in ("", "ai.onnx"):
        return None
    for i in ((1,) if n.op_type in ("Conv", "Gemm") else (1, 0)):
        v = n.input[i] if i < len(n.input) else ""
        while v and uses.get(v, 0) == 1 and v not in weights:
            p = producer.get(v)
            v = p.input[0] if p is not None and p.op_type in PASS_THROUGH and p.op_type != "Expand" else ""
        if v and uses.get(v, 0) == 1:
            return i, v
    return None
