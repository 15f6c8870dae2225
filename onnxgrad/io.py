"""Writing outputs safely: never over a file an input reads, never half-written (temp file, then rename).

onnx is imported inside the functions that need it: the command line loads this module at start-up, and
`onnxgrad --version` should not wait for onnx.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import OnnxgradError, UsageError

if TYPE_CHECKING:
    import onnx


class OutputError(OnnxgradError):
    """The output cannot be written (unwritable folder, full disk)."""

    exit_code = 5


class OutputPaths:
    """The files one command writes, checked before any work. None may be a file that an input reads: an input
    model, an external-data file it names, a data file or a checkpoint it reads (writing there would destroy
    the input, and a model with external data still loads with garbage weights); none may be another output
    of the same command; the folder must exist and be writable. An existing output is replaced (atomically, by
    the writers below), as compilers and converters do, so a pipeline step can run twice.

    `inputs`: the model paths, or {path: what it is, e.g. "the --data file"}. The models' external-data files
    are read from their headers only when an output path already exists (only an existing file can be one)."""

    def __init__(self, inputs: list | dict):
        self.inputs = {Path(p): "the input model" for p in inputs} if not isinstance(inputs, dict) else \
            {Path(p): what for p, what in inputs.items() if p}
        self._data_files: list[tuple[Path, Path]] | None = None   # (data file, the model that names it)
        self.claimed: dict[Path, str] = {}

    def claim(self, path: str | os.PathLike, flag: str | None = None, what: str | None = None,
              *, reads: str | os.PathLike | None = None) -> Path:
        """Check `path` for `flag` (e.g. "--report") and keep it, so no later output of this command takes it.
        `what` names it in the message should a later output take the same path. `reads`: an input this output
        may replace (a --checkpoint that is also the --resume file)."""
        out = Path(path)
        label = f"{flag} {out}" if flag else str(out)
        for other, other_what in self.claimed.items():
            if _same_file(out, other):
                raise UsageError(f"{label}: is {other_what}; choose another path")
        for src, src_what in self.inputs.items():
            if reads is not None and _same_file(src, Path(reads)):
                continue
            if _same_file(out, src):
                raise UsageError(f"{out}: is {src_what}; choose another output path")
        if out.exists():
            for data, model in self._external_data():
                if _same_file(out, data):
                    raise UsageError(f"{out}: is the external data of the input model {model}; choose another "
                                     f"output path")
        if out.is_dir():
            raise UsageError(f"{out}: is a directory; give a file name for the output")
        if not out.parent.resolve().is_dir():
            raise OutputError(f"{out}: folder {out.parent} does not exist")
        if not os.access(out.parent.resolve(), os.W_OK):
            raise OutputError(f"{out}: folder {out.parent} is not writable")
        self.claimed[out] = what or (f"the {flag} output" if flag else "another output")
        return out

    def claim_data(self, model_path: Path) -> Path:
        """The external-data file `save_model` writes beside `model_path` (`data_path`), checked like an output."""
        return self.claim(data_path(model_path), None, f"the external data of {model_path}")

    def _external_data(self) -> list[tuple[Path, Path]]:
        if self._data_files is None:
            self._data_files = [(f, src) for src in self.inputs for f in external_data_files(src)]
        return self._data_files


def check_output_path(out: str | os.PathLike, inputs: list | dict, force: bool = False) -> Path:
    """One output checked against the inputs (see `OutputPaths`); `force` is accepted from callers written
    when replacing an output needed it, and changes nothing."""
    return OutputPaths(inputs).claim(out)


def external_data_files(model: str | os.PathLike) -> list[Path]:
    """The external-data files a model file names (resolved beside it); none for a file that is not a readable
    model (a data file, a checkpoint, a model the loader will refuse with its own message)."""
    path = Path(model)
    if not path.is_file():
        return []
    try:
        import onnx
        from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data
        proto = onnx.load(str(path), load_external_data=False)
        locations = {ExternalDataInfo(t).location for t in _get_all_tensors(proto) if uses_external_data(t)}
    except Exception:  # not a model: nothing more to protect than the file itself
        return []
    return [path.parent / location for location in sorted(locations) if location]


def _same_file(a: Path, b: Path) -> bool:
    """One file under two spellings (`./x`, `sub/../x`), a symbolic link or a hard link."""
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def atomic_write_bytes(path: Path, data: bytes) -> None:
    write_files({Path(path): data})


def write_files(files: dict[Path, bytes]) -> None:
    """Write each file to a temp file beside it; only when all are complete, rename them into place. A full
    disk or a refused folder leaves nothing behind, neither a temp file nor a partial set of outputs."""
    temps: dict[Path, str] = {}
    try:
        for path, data in files.items():
            temps[path] = _write_temp(path, data)
        for path, tmp in temps.items():
            try:
                os.replace(tmp, path)
            except OSError as e:
                raise _output_error(path, e) from None
    finally:
        for tmp in temps.values():
            _remove(tmp)  # a no-op for the temps already renamed


def _write_temp(path: Path, data: bytes) -> str:
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent.resolve())
        _usual_mode(tmp)
    except OSError as e:
        raise _output_error(path, e) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        _remove(tmp)
        raise _output_error(path, e) from None
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _output_error(path: Path, e: OSError) -> OutputError:
    return OutputError(f"{path}: cannot write ({e.strerror or e})")


def write_along(path: Path, data: bytes, write_others) -> None:
    """Write `data` to `path` together with the files `write_others()` writes atomically: `data` goes to a temp
    file first and is renamed into place only when they are written, so a failure leaves none of them."""
    tmp = _write_temp(Path(path), data)
    try:
        write_others()
        try:
            os.replace(tmp, path)
        except OSError as e:
            raise _output_error(Path(path), e) from None
    finally:
        _remove(tmp)  # a no-op once renamed


# protobuf refuses to serialize a message of 2 GiB or more; stay clear of it
PROTO_LIMIT = 2**31 - 64 * 2**20
DATA_ALIGN = 4096  # each tensor's offset in the data file, so a runtime may map it


def save_model(model: onnx.ModelProto, path: Path, weights: dict[str, onnx.TensorProto] | None = None,
               external_data: bool | None = None) -> None:
    """Write `model` atomically. Stubs (weights.py) take their data from `weights`. With `external_data`
    (default: only when one proto would pass 2 GB) every initializer of 1 KiB or more goes to
    `<path>.data` beside it (`data_path`); otherwise the model is one file. `model` is changed in place."""
    from . import weights as weight_store
    path = Path(path)
    held = weights or {}
    if external_data is None:
        external_data = needs_external_data(model, held)
    if not external_data:
        if weight_store.stubs(model):
            weight_store.join(model, held)
        atomic_write_bytes(path, model_bytes(model))
        return
    _save_with_external_data(model, path, held)


def data_path(path: str | os.PathLike) -> Path:
    """Where `save_model` puts a model's external data: `<path>.data`."""
    path = Path(path)
    return path.with_name(path.name + ".data")


def needs_external_data(model: onnx.ModelProto, weights: dict[str, onnx.TensorProto] | None = None) -> bool:
    from . import weights as weight_store
    return weight_store.total_bytes(model, weights or {}) >= PROTO_LIMIT


def _save_with_external_data(model: onnx.ModelProto, path: Path, weights: dict[str, onnx.TensorProto]) -> None:
    """Stream each large tensor's data into a temp file beside `path` (one tensor in memory at a time),
    point the model's tensors at it, write the model to a second temp file, then rename both into place:
    the data first, so that the model file never names data that is not there."""
    import onnx

    from . import weights as weight_store
    target = data_path(path)
    temps: dict[Path, str] = {}
    try:
        temps[target] = _new_temp(target)
        try:
            with open(temps[target], "wb") as f:
                offset = 0
                for t in model.graph.initializer:
                    stub = weight_store.is_stub(t)
                    if not stub and (t.data_location == onnx.TensorProto.EXTERNAL
                                     or weight_store.nbytes(t) < weight_store.MIN_BYTES):
                        continue
                    data = weight_store.raw_bytes(weight_store.data_of(t, weights) if stub else t)
                    pad = -offset % DATA_ALIGN
                    f.write(b"\0" * pad)
                    offset += pad
                    f.write(data)
                    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data",
                                  "uint64_data", "string_data"):
                        t.ClearField(field)
                    del t.external_data[:]
                    t.data_location = onnx.TensorProto.EXTERNAL
                    for key, value in (("location", target.name), ("offset", offset), ("length", len(data))):
                        t.external_data.add(key=key, value=str(value))
                    offset += len(data)
                    del data
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise _output_error(target, e) from None
        temps[path] = _write_temp(path, model_bytes(model))
        for final in (target, path):
            try:
                os.replace(temps[final], final)
            except OSError as e:
                raise _output_error(final, e) from None
    finally:
        for tmp in temps.values():
            _remove(tmp)  # a no-op for the temps already renamed


def _new_temp(path: Path) -> str:
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent.resolve())
    except OSError as e:
        raise _output_error(path, e) from None
    os.close(fd)
    _usual_mode(tmp)
    return tmp


def _usual_mode(tmp: str) -> None:
    """mkstemp makes files only their owner may read (0600); an output gets the mode open() would give it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)


def save_json(obj, path: Path) -> None:
    atomic_write_bytes(Path(path), json_bytes(obj))


def model_bytes(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


def json_bytes(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _remove(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
