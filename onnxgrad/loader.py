"""Loading a forward model: read it, bring it to a supported opset, bind symbolic dims, infer shapes."""
from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx import shape_inference, version_converter

from .errors import InvalidModelError, UsageError

MIN_OPSET = 13   # older models are upgraded to this opset
MAX_OPSET = 23   # newest opset whose operator forms the rules cover


def read_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """A ModelProto from a path (external data loaded from beside it) or a ModelProto (copied)."""
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
        return onnx.load(str(path))
    except Exception as e:  # protobuf and external-data errors come in many types
        raise InvalidModelError(f"{path}: not a readable ONNX model ({_first_line(e)})") from None


def upgrade_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """Models below MIN_OPSET are converted up; models above MAX_OPSET are refused."""
    opset = model_opset(model)
    if opset > MAX_OPSET:
        raise InvalidModelError(f"opset {opset} is newer than the newest supported opset {MAX_OPSET}")
    if opset >= MIN_OPSET:
        return model
    try:
        converted = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:
        raise InvalidModelError(f"cannot convert opset {opset} to {MIN_OPSET}: {_first_line(e)}") from None
    return converted


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
        vi.type.tensor_type.shape.ClearField("dim")
        for size in shape:
            vi.type.tensor_type.shape.dim.add().dim_value = size
    if not dims:
        return
    seen = set()
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if not vi.type.tensor_type.HasField("shape"):
            continue
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dims:
                seen.add(d.dim_param)
                d.dim_value = dims[d.dim_param]
    missing = sorted(set(dims) - seen)
    if missing:
        raise UsageError(f"--dim {missing[0]}: no dimension of that name in the model's inputs or outputs")


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    except Exception as e:
        raise InvalidModelError(f"shape inference failed: {_first_line(e)}") from None


def check(model: onnx.ModelProto) -> None:
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        raise InvalidModelError(f"the model fails the ONNX checker: {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if len(lines) == 1 else " ".join(lines)[:300]
