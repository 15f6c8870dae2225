"""Large weights kept apart from the graph proto while the build runs.

Every protobuf round trip of a model (the checker, the version converter, shape inference, CopyFrom,
SerializeToString) copies its tensors; upb, protobuf's Python runtime, frees a message's memory only with
the whole message; and a proto over 2 GB cannot be serialized at all. So the passes work on a *skeleton*: a
copy of the model in which each large floating-point initializer is a stub (name, type and dims, with
`data_location` EXTERNAL at `STUB_LOCATION`), while the data stays in the TensorProto it was loaded into, found
by name in a weights map. The checker, the converter and shape inference never read those tensors' data;
`from_model` puts the real tensors into the Graph, so rules and passes see values as before; `to_model` writes
stubs again; and the output is written by streaming each stub's data into the external-data file
(`io.save_model`), or, for an in-memory result, joined back into one proto (`join`).
"""
from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import TensorProto, helper, numpy_helper

from .errors import InternalError

STUB_LOCATION = "onnxgrad-weights-apart"   # a stub's external_data location: "the data is held in memory"
MIN_BYTES = 1024                           # smaller tensors stay inline (onnx's own external-data threshold)
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})

Weights = dict[str, TensorProto]


def nbytes(t: TensorProto) -> int:
    """Bytes of the tensor's data, from its type and dims (0 for types without a fixed size)."""
    try:
        itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return 0
    return math.prod(t.dims) * itemsize


def is_stub(t: TensorProto) -> bool:
    return (t.data_location == TensorProto.EXTERNAL and len(t.external_data) > 0
            and any(e.key == "location" and e.value == STUB_LOCATION for e in t.external_data))


def should_stub(t: TensorProto) -> bool:
    """A large floating-point tensor whose data is in memory (not already external, not a stub)."""
    return (t.data_type in FLOAT_TYPES and t.data_location != TensorProto.EXTERNAL and nbytes(t) >= MIN_BYTES)


DATA_FIELDS = frozenset({"raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data",
                         "uint64_data", "external_data", "data_location"})


def stub_of(t: TensorProto) -> TensorProto:
    """The tensor without its data (name, type, dims and the rest kept); its data is looked up by name."""
    s = TensorProto()
    copy_fields(t, s, DATA_FIELDS)
    s.data_location = TensorProto.EXTERNAL
    s.external_data.add(key="location", value=STUB_LOCATION)
    return s


def copy_fields(src: Message, dst: Message, skip: frozenset[str] | set[str]) -> None:
    """Copy every set field of `src` into `dst` except those named in `skip` (no copy of what is skipped)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if isinstance(value, Message):
            getattr(dst, fd.name).CopyFrom(value)
        elif isinstance(value, (str, bytes, int, float, bool)):
            setattr(dst, fd.name, value)
        else:  # a repeated field
            getattr(dst, fd.name).extend(value)


def split(model: onnx.ModelProto) -> tuple[onnx.ModelProto, Weights]:
    """(skeleton, weights): the skeleton is a new model with stubs for the large float initializers of the
    main graph; `weights` maps their names to `model`'s own tensors (not copied; `model` is not changed)."""
    skeleton = onnx.ModelProto()
    copy_fields(model, skeleton, {"graph"})
    copy_fields(model.graph, skeleton.graph, {"initializer"})
    weights: Weights = {}
    for t in model.graph.initializer:
        if should_stub(t):
            skeleton.graph.initializer.append(stub_of(t))
            weights[t.name] = t
        else:
            skeleton.graph.initializer.append(t)
    return skeleton, weights


def stubs(model: onnx.ModelProto) -> list[TensorProto]:
    return [t for t in model.graph.initializer if is_stub(t)]


def raw_bytes(t: TensorProto) -> bytes:
    """The tensor's data in ONNX's raw (little-endian) layout."""
    if t.HasField("raw_data"):
        return t.raw_data
    a = numpy_helper.to_array(t)
    return a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def data_of(stub: TensorProto, weights: Weights) -> TensorProto:
    t = weights.get(stub.name)
    if t is None:
        raise InternalError(f"no data for the initializer {stub.name!r} (a stub without its weight)")
    return t


def join(model: onnx.ModelProto, weights: Weights) -> None:
    """Put the data back into the model's stubs, in place (this copies the data into `model`)."""
    for s in stubs(model):
        data = raw_bytes(data_of(s, weights))
        del s.external_data[:]
        s.ClearField("data_location")
        s.raw_data = data


def check_model(model: onnx.ModelProto, full_check: bool = False) -> None:
    """onnx.checker.check_model, also for a skeleton: the checker wants the file of every external tensor to
    exist (it reads none of them), so a skeleton with stubs is checked from a temporary folder that holds the
    skeleton and an empty file at STUB_LOCATION."""
    if not stubs(model):
        onnx.checker.check_model(model, full_check=full_check)
        return
    with tempfile.TemporaryDirectory(prefix="onnxgrad-check-") as folder:
        path = Path(folder) / "model.onnx"
        path.write_bytes(model.SerializeToString())
        (Path(folder) / STUB_LOCATION).touch()
        onnx.checker.check_model(os.fspath(path), full_check=full_check)


def total_bytes(model: onnx.ModelProto, weights: Weights) -> int:
    """Size of the model as one proto: the skeleton plus the data of its stubs."""
    return model.ByteSize() + sum(nbytes(s) for s in stubs(model))
