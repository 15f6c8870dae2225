"""The data a step graph is fed: `.npz` arrays read and checked against its data inputs, and cut into
batches that follow from the step number alone (so a resumed run sees the same batches)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from ..errors import UsageError
from ..protos import class_counts, declared_dims, expanded_labels
from .step import StepGraph


class Batches:
    """Arrays that share their first dimension, cut into batches of `batch` rows.

    Epoch e visits the rows in the order `default_rng([seed, e]).permutation(rows)` (in order when `shuffle`
    is off), so the batch at any step follows from the step number alone and a resumed run sees the same
    batches. The last partial batch of an epoch is dropped (every step sees `batch` rows) unless `drop_last`
    is off."""

    def __init__(self, arrays: dict[str, np.ndarray], batch: int, seed: int = 0, shuffle: bool = True,
                 drop_last: bool = True):
        self.arrays, self.batch, self.seed, self.shuffle, self.drop_last = arrays, batch, seed, shuffle, drop_last
        self.rows = len(next(iter(arrays.values())))
        if batch < 1:
            raise UsageError(f"--batch {batch}: must be at least 1")
        if batch > self.rows and drop_last:
            raise UsageError(f"--batch {batch}: larger than the data's {self.rows} rows")
        self.per_epoch = self.rows // batch if drop_last else -(-self.rows // batch)
        self._order_epoch, self._order = None, None
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self.per_epoch

    def order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order_epoch = epoch
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.rows) if self.shuffle
                           else np.arange(self.rows))
        return self._order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index within the epoch) of the 0-based step."""
        return divmod(step, self.per_epoch)

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        epoch, index = self.position(step)
        rows = self.order(epoch)[index * self.batch:(index + 1) * self.batch]
        return {name: np.ascontiguousarray(a[rows]) for name, a in self.arrays.items()}

    def record(self) -> dict:
        """What a checkpoint keeps to check that a resumed run sees the same batches."""
        return {"seed": self.seed, "batch": self.batch, "rows": self.rows, "shuffle": self.shuffle,
                "drop_last": self.drop_last, "data": self.fingerprint()}

    def fingerprint(self) -> str:
        """A hash of the data (names, types, shapes and bytes, as fed), so that a resumed run on other data of
        the same row count is refused. Computed once, when a checkpoint is written or read."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=16)
            for name in sorted(self.arrays):
                a = np.ascontiguousarray(self.arrays[name])
                h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
                h.update(a.reshape(-1).view(np.uint8) if a.size else b"")
            self._fingerprint = h.hexdigest()
        return self._fingerprint


def load_data(path: str | os.PathLike, graph: StepGraph) -> dict[str, np.ndarray]:
    return check_data(read_npz(path, "--data"), graph, f"--data {path}")


def read_npz(path: str | os.PathLike, flag: str) -> dict[str, np.ndarray]:
    """The arrays of an .npz file; an empty, truncated or corrupt file, or one that is not an .npz archive (a
    lone .npy array, a pickle), is one usage error naming the flag and the file."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: {'is a directory' if path.is_dir() else 'no such file'}")
    if path.stat().st_size == 0:
        raise UsageError(f"{flag} {path}: empty file, not an .npz archive")
    try:
        with np.load(path, allow_pickle=False) as loaded:
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise UsageError(f"{flag} {path}: one .npy array, not an .npz archive of named arrays; write it with "
                                 f"numpy.savez(path, name=array, ...)")
            return {k: loaded[k] for k in loaded.files}
    except UsageError:
        raise
    except Exception as e:  # numpy and zipfile report a short or corrupt file with many exception types
        text = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise UsageError(f"{flag} {path}: not a readable .npz archive ({text})") from None


def check_data(arrays: dict[str, np.ndarray], graph: StepGraph, source: str = "data") -> dict[str, np.ndarray]:
    """One array per data input, sharing the first dimension, each cast to its input's type when that loses
    no kind (float to float, integer to integer)."""
    unknown = sorted(set(arrays) - set(graph.data))
    if unknown:
        raise UsageError(f"{source}: {unknown[0]!r} is not a data input of the step graph "
                         f"(data inputs: {', '.join(graph.data) or 'none'})")
    missing = [n for n in graph.data if n not in arrays]
    if missing:
        raise UsageError(f"{source}: no array for the step graph's input {missing[0]!r}")
    out, rows = {}, None
    for name, vi in graph.data.items():
        a = np.asarray(arrays[name])
        want = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        if a.ndim == 0:
            raise UsageError(f"{source}: {name!r} is a scalar; data arrays are sliced along their first dimension")
        if a.dtype != want:
            if np.dtype(want).kind != a.dtype.kind and not {a.dtype.kind, np.dtype(want).kind} <= {"i", "u"}:
                raise UsageError(f"{source}: {name!r} is {a.dtype}, the step graph wants {np.dtype(want)}")
            a = a.astype(want)
        dims = declared_dims(vi)
        if dims is not None:
            if len(dims) != a.ndim:
                raise UsageError(f"{source}: {name!r} has rank {a.ndim}, the step graph wants rank {len(dims)}")
            for axis, (d, size) in enumerate(zip(dims[1:], a.shape[1:]), start=1):
                if isinstance(d, int) and d != size:
                    raise UsageError(f"{source}: {name!r} has shape {list(a.shape)}, the step graph wants "
                                     f"{d} in dimension {axis}")
        if rows is not None and len(a) != rows:
            raise UsageError(f"{source}: {name!r} has {len(a)} rows, {next(iter(out))!r} has {rows}")
        rows = len(a)
        out[name] = a
    if not out:
        raise UsageError(f"{source}: the step graph has no data inputs to feed")
    check_labels(graph.model, out, source)
    return out


def check_labels(model: onnx.ModelProto, arrays: dict[str, np.ndarray], source: str) -> None:
    """Class labels that a cross-entropy node reads (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss) must
    lie in [0, C) for C classes, or equal the node's ignore_index; onnxruntime would fail in the middle of a
    run with a message that names neither the input nor the value."""
    classes = class_counts(model)
    ignore = {n.input[1]: next((a.i for a in n.attribute if a.name == "ignore_index"), None)
              for n in model.graph.node if n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
              and len(n.input) > 1}
    ignore.update({name: index for name, (_, index) in expanded_labels(model).items()})
    for name, count in classes.items():
        a = arrays.get(name)
        if a is None or a.size == 0 or a.dtype.kind not in "iu":
            continue
        bad = (a < 0) | (a >= count)
        if ignore.get(name) is not None:
            bad &= a != ignore[name]
        if bad.any():
            index = np.unravel_index(int(np.argmax(bad)), a.shape)
            kept = f", or the ignore_index {ignore[name]}" if ignore.get(name) is not None else ""
            raise UsageError(f"{source}: {name!r} holds {a[index]} at index {list(map(int, index))}, not a class "
                             f"index in [0, {count}) of the cross-entropy's {count} classes{kept}")
