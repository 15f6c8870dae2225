"""Loading a forward model: read it, bring it to a supported opset, bind symbolic dims, infer shapes."""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import shape_inference, version_converter

from onnx.external_data_helper import (ExternalDataInfo, _get_all_tensors, load_external_data_for_tensor,
                                      uses_external_data)

from . import weights
from .errors import InvalidModelError, OnnxgradError, UnsupportedError, UsageError

log = logging.getLogger("onnxgrad")

MIN_OPSET = 13   # older models are upgraded to this opset
# The newest opset the installed onnx defines. Rules are registered per opset range, so an op whose newer version
# changed its meaning has a rule that stops at the last version it covers, and the gradient pass names that op.
MAX_OPSET = onnx.defs.onnx_opset_version()


def read_model(model: str | os.PathLike | onnx.ModelProto, *, load_external_data: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path (external data loaded from beside it, unless `load_external_data` is False)
    or a ModelProto (copied)."""
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy
    path = Path(model)
    if not path.exists():
        raise UsageError(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path}: is a directory, expected an .onnx file")
    try:
        if path.stat().st_size == 0:
            raise InvalidModelError(f"{path}: empty file, not an ONNX model")
        model = onnx.load(str(path), load_external_data=False)
        _check_external_data(model, path)
        if load_external_data:
            onnx.load_external_data_for_model(model, str(path.parent))
    except DecodeError:
        raise InvalidModelError(f"{path}: not a readable ONNX model (not an ONNX protobuf, or truncated)") from None
    except OnnxgradError:
        raise
    except Exception as e:  # external-data and OS errors come in many types
        raise InvalidModelError(f"{path}: not a readable ONNX model ({_first_line(e)})") from None
    if not model.HasField("graph"):
        raise InvalidModelError(f"{path}: not an ONNX model (the protobuf holds no graph)")
    field = _undecodable_text(model)
    if field:
        raise InvalidModelError(f"{path}: not a readable ONNX model (a {field} is not valid UTF-8 text)")
    return model


def _undecodable_text(msg) -> str | None:
    """The first string field that is not valid UTF-8, as 'NodeProto.name' (the checker does not look, and a
    corrupt name would otherwise surface deep inside the build). Bytes fields (tensor data) are not read."""
    from google.protobuf.descriptor import FieldDescriptor

    for fd in msg.DESCRIPTOR.fields:
        repeated = fd.is_repeated if hasattr(fd, "is_repeated") else fd.label == fd.LABEL_REPEATED
        if fd.type == FieldDescriptor.TYPE_MESSAGE:
            items = getattr(msg, fd.name) if repeated else [getattr(msg, fd.name)] if msg.HasField(fd.name) else []
            for item in items:
                found = _undecodable_text(item)
                if found:
                    return found
        elif fd.type == FieldDescriptor.TYPE_STRING:
            try:  # protobuf gives bytes for a proto2 string that is not UTF-8, or raises
                values = list(getattr(msg, fd.name)) if repeated else [getattr(msg, fd.name)]
            except UnicodeDecodeError:
                values = [b""]
            if any(isinstance(v, bytes) for v in values):
                return f"{msg.DESCRIPTOR.name}.{fd.name}"
    return None


def _check_external_data(model: onnx.ModelProto, path: Path) -> None:
    """Name the missing file, rather than let the loader fail on the first tensor it cannot read."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    for t in _tensors(model.graph):
        if uses_external_data(t):
            location = ExternalDataInfo(t).location
            if not (path.parent / location).is_file():
                raise InvalidModelError(f"{path}: the external data file {location!r} of tensor {t.name!r} is "
                                        f"missing (expected beside the model)")


def read_apart(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, weights.Weights, list[Path]]:
    """(skeleton, weights, external data files) of a model: the build's passes work on the skeleton, whose
    large float initializers are stubs, while their data stays in `weights` (onnxgrad/weights.py). A path's
    external data is loaded once, tensor by tensor; a ModelProto is neither copied nor changed."""
    if isinstance(model, onnx.ModelProto):
        skeleton, held = weights.split(model)
        return skeleton, held, []
    path = Path(model)
    proto = read_model(path, load_external_data=False)
    files = []
    for t in _external_tensors(proto):
        location = (path.parent / ExternalDataInfo(t).location).resolve()
        if location not in files:
            files.append(location)
        try:
            load_external_data_for_tensor(t, str(path.parent))
        except Exception as e:  # onnx reports short files and bad offsets with several exception types
            raise InvalidModelError(f"{path}: cannot read the external data of tensor {t.name!r} "
                                    f"({_first_line(e)})") from None
    skeleton, held = weights.split(proto)
    return skeleton, held, files


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in _get_all_tensors(model) if uses_external_data(t)]


def _tensors(g: onnx.GraphProto):
    """Initializers and tensor attributes, subgraphs included."""
    yield from g.initializer
    for node in g.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _tensors(sub)


def upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """Models below MIN_OPSET are converted up; models above MAX_OPSET are refused."""
    opset = model_opset(model)
    if opset > MAX_OPSET:
        raise InvalidModelError(f"opset {opset} is newer than the newest opset the installed onnx "
                                f"{onnx.__version__} defines ({MAX_OPSET})")
    if opset >= MIN_OPSET:
        return model
    if opset < 9:
        scan = next((n for n in _all_nodes(model.graph) if n.op_type == "Scan" and n.domain in ("", "ai.onnx")), None)
        if scan is not None:  # the converter's Scan 8 -> 9 adapter changes the ranks of the graph's inputs
            raise UnsupportedError(f"Scan node {scan.name!r} has opset 8's batched form, which onnx's version "
                                   f"converter does not convert faithfully; export the model at opset 9 or newer")
    try:
        with _stdout_to_log():
            converted = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:
        reason = _converter_reason(e, opset)
        raise InvalidModelError(f"cannot convert opset {opset} to {MIN_OPSET}: {reason}") from None
    return converted


def _all_nodes(g: onnx.GraphProto):
    for node in g.node:
        yield node
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                yield from _all_nodes(sub)


def _converter_reason(e: Exception, opset: int) -> str:
    """The converter's C++ assertion text, made readable: which op, or the assertion's message."""
    text = _first_line(e)
    m = re.search(rf"has no registered schema.*\.(\w+?){opset}{MIN_OPSET}$", text)
    if m:
        return f"op {m.group(1)} has no version at opset {MIN_OPSET} to convert to; export the model at opset " \
               f"{MIN_OPSET} or newer"
    return re.sub(r"^\S+\.(cc|h):\d+: \w+: (Assertion `.*` failed: )?", "", text)


def model_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise InvalidModelError("the model imports no ai.onnx opset")


def parse_shape_bindings(specs: list[str]) -> dict[str, list[int]]:
    """'x=2x3x224x224' -> {'x': [2, 3, 224, 224]}."""
    out = {}
    for spec in specs:
        name, sep, dims = spec.rpartition("=")
        try:
            shape = [int(d) for d in dims.split("x")] if dims else []
        except ValueError:
            shape = None
        if not sep or not name or shape is None or any(d < 0 for d in shape):
            raise UsageError(f"--input-shape {spec!r}: expected NAME=D1xD2x..., e.g. x=2x3x224x224")
        out[name] = shape
    return out


def parse_dim_bindings(specs: list[str]) -> dict[str, int]:
    """'batch=8' -> {'batch': 8}."""
    out = {}
    for spec in specs:
        name, sep, value = spec.rpartition("=")
        if not sep or not name or not value.isdigit():
            raise UsageError(f"--dim {spec!r}: expected SYMBOL=N, e.g. batch=8")
        out[name] = int(value)
    return out


def bind_shapes(model: onnx.ModelProto, input_shapes: dict[str, list[int]], dims: dict[str, int]) -> None:
    """Fix graph-input shapes and replace symbolic dims by sizes, in place."""
    g = model.graph
    inputs = {vi.name: vi for vi in g.input}
    # a symbol stands for one size everywhere: --input-shape x=2x3 on x[N, 3] also binds N elsewhere
    bound = {sym: (size, f"--dim {sym}={size}") for sym, size in dims.items()}
    for name, shape in input_shapes.items():
        vi = inputs.get(name)
        if vi is None:
            raise UsageError(f"--input-shape {name}: no graph input of that name "
                             f"(inputs: {', '.join(inputs) or 'none'})")
        old = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and len(old) != len(shape):
            raise UsageError(f"--input-shape {name}: rank {len(shape)} given, the model says rank {len(old)}")
        for d, size in zip(old, shape):
            if d.HasField("dim_value") and d.dim_value != size:
                raise UsageError(f"--input-shape {name}: dim {d.dim_value} cannot be bound to {size}")
            if d.HasField("dim_param") and d.dim_param:
                prev = bound.setdefault(d.dim_param, (size, f"--input-shape {name}"))
                if prev[0] != size:
                    raise UsageError(f"--input-shape {name}: dim {d.dim_param!r} cannot be {size}: "
                                     f"{prev[1]} makes it {prev[0]}")
        vi.type.tensor_type.shape.ClearField("dim")
        for size in shape:
            vi.type.tensor_type.shape.dim.add().dim_value = size
    if not bound:
        return
    seen = set()
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if not vi.type.tensor_type.HasField("shape"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in bound:
                seen.add(d.dim_param)
                d.dim_value = bound[d.dim_param][0]
    missing = sorted(set(dims) - seen)
    if missing:
        raise UsageError(f"--dim {missing[0]}: no dimension of that name in the model's inputs or outputs")


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        raise InvalidModelError(f"shape inference failed: {_first_line(e)}") from None


def type_loop_carries(model: onnx.ModelProto) -> onnx.ModelProto:
    """Type the carried outputs of Loop and Scan nodes that onnx's inference leaves unshaped (it keeps only the
    element type of a Loop's carries, and TorchScript's exports leave the body's carries unshaped too).

    A body carry without a shape gets its initial value's type; where the inferred body then gives each carry
    back with the shape it received (a fixed point, so every iteration sees that shape), the loop's output
    takes it, and the graph is inferred again. A carry whose shape changes leaves the model as it was."""
    graph = model.graph
    types = {vi.name: vi.type for vi in [*graph.input, *graph.value_info]}
    types.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer})
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _constants_into_bodies(out.graph)
    fixed: dict[str, onnx.TypeProto] = {}
    for node in out.graph.node:
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        carries = _carries(node)
        if not carries:
            continue
        first = 1 if node.op_type == "Loop" else 0
        for k, (body_in, initial) in enumerate(carries):
            t = types.get(initial)
            if body_in.type.HasField("tensor_type") and not body_in.type.tensor_type.HasField("shape") and \
                    t is not None and t.HasField("tensor_type") and t.tensor_type.HasField("shape"):
                body_in.type.CopyFrom(t)
            if k < len(node.output) and node.output[k] and first + k < len(body.output) and \
                    body_in.type.tensor_type.HasField("shape"):
                fixed[node.output[k]] = (node.name, body.output[first + k].name, body_in.type)
    if not fixed:
        return model
    inferred = infer_shapes(out)
    bodies = {n.name: next(a.g for a in n.attribute if a.name == "body") for n in inferred.graph.node if _carries(n)}
    for name, (node_name, body_out, carry_type) in list(fixed.items()):
        body = bodies[node_name]
        got = next((vi.type for vi in [*body.output, *body.value_info] if vi.name == body_out), None)
        if got is None or got.tensor_type.shape != carry_type.tensor_type.shape:
            return model
    known = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    changed = False
    for name, (_, _, carry_type) in fixed.items():
        vi = known.get(name)
        if vi is not None and vi.type.tensor_type.HasField("shape"):
            continue
        if vi is None:
            vi = inferred.graph.value_info.add(name=name)
        vi.type.CopyFrom(carry_type)
        changed = True
    return infer_shapes(inferred) if changed else inferred


def _constants_into_bodies(graph: onnx.GraphProto) -> None:
    """Copy the small integer constants (axes, shapes) that Loop and Scan bodies read from outside into the bodies,
    so onnx's inference of a body sees their values (it does not look outside the body for them)."""
    import numpy as np

    from .ir import names_defined_in

    small = {}
    for n in graph.node:
        if n.op_type == "Constant" and len(n.output) == 1:
            a = next((a for a in n.attribute if a.name == "value" and a.type == onnx.AttributeProto.TENSOR), None)
            if a is not None and a.t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and \
                    int(np.prod(a.t.dims, dtype=np.int64)) <= 64 and len(a.t.dims) <= 1:
                small[n.output[0]] = a.t
    if not small:
        return
    taken = {o for n in graph.node for o in n.output} | {v.name for v in graph.input}
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                taken |= names_defined_in(a.g)
    for n in graph.node:
        body = next((a.g for a in n.attribute if a.name == "body"), None) if _carries(n) else None
        if body is None:
            continue
        local = {}
        for node in body.node:
            for k, name in enumerate(node.input):
                if name in small and name not in local:
                    fresh, i = f"{name}_in_body", 1
                    while fresh in taken:
                        fresh, i = f"{name}_in_body_{i}", i + 1
                    taken.add(fresh)
                    local[name] = fresh
                if name in local:
                    node.input[k] = local[name]
        copies = [onnx.helper.make_node("Constant", [], [local[name]], name=local[name], value=small[name])
                  for name in local]
        kept = [onnx.NodeProto() for _ in body.node]
        for copy, node in zip(kept, body.node):
            copy.CopyFrom(node)
        del body.node[:]
        body.node.extend(copies + kept)


def _carries(node: onnx.NodeProto):
    """(body input, outer initial value) of each carried value of a Loop or Scan node."""
    body = next((a.g for a in node.attribute if a.name == "body"), None)
    if body is None or node.domain not in ("", "ai.onnx"):
        return []
    if node.op_type == "Loop":
        return [(body.input[2 + i], name) for i, name in enumerate(node.input[2:]) if 2 + i < len(body.input)]
    if node.op_type == "Scan":
        m = next((a.i for a in node.attribute if a.name == "num_scan_inputs"), 0)
        return [(body.input[i], name) for i, name in enumerate(node.input[:len(node.input) - m])]
    return []


def check(model: onnx.ModelProto) -> None:
    try:
        with _stdout_to_log():
            weights.check_model(model)  # a skeleton's stubs need a folder to be checked from
    except Exception as e:
        raise InvalidModelError(f"the model fails the ONNX checker: {_first_line(e)}") from None
    _check_data_sizes(model)


def _check_data_sizes(model: onnx.ModelProto) -> None:
    """The checker lets a tensor's raw data disagree with its shape; onnxruntime would refuse it later."""
    import numpy as np

    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4, getattr(onnx.TensorProto, "FLOAT4E2M1", -1): 4}
    for t in _tensors(model.graph):
        if not t.HasField("raw_data") or t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        try:
            width = bits.get(t.data_type) or 8 * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        except (KeyError, ValueError, TypeError):  # strings, unknown types: the checker's business
            continue
        need = (int(np.prod(t.dims, dtype=np.int64)) * width + 7) // 8
        if len(t.raw_data) != need:
            raise InvalidModelError(f"tensor {t.name!r}: {len(t.raw_data)} bytes of data, but its shape "
                                    f"{list(t.dims)} and type {onnx.TensorProto.DataType.Name(t.data_type)} "
                                    f"need {need}")


@contextlib.contextmanager
def _stdout_to_log():
    """onnx's C++ code prints warnings to stdout ("Model contains experimental ops"); stdout is for results,
    so catch them at the file-descriptor level and log them (shown with --verbose)."""
    fd = 1  # where C++ writes, whatever sys.stdout is
    try:
        os.fstat(fd)
        sys.stdout.flush()
    except (OSError, ValueError):  # no stdout at all
        yield
        return
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), fd)
        try:
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved, fd)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
    for line in text.splitlines():
        if line.strip():
            log.debug("onnx: %s", line.strip())


def _flush_c_stdio() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else " ".join(lines)[:300]
