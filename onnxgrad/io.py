"""Writing models safely: never over the input, never half-written (temp file, then rename)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import onnx

from .errors import OnnxgradError, UsageError


class OutputError(OnnxgradError):
    """The output cannot be written (unwritable folder, full disk)."""

    exit_code = 5


def check_output_path(out: str | os.PathLike, inputs: list[str | os.PathLike], force: bool) -> Path:
    """Refuse to write over an input, or over an existing file without --force; the folder must exist."""
    out = Path(out)
    for src in inputs:
        src = Path(src)
        if out.resolve() == src.resolve() or (out.exists() and src.exists() and os.path.samefile(src, out)):
            raise UsageError(f"{out}: is the input model; choose another output path")
    if out.is_dir():
        raise UsageError(f"{out}: is a directory; give a file name for the output")
    if out.exists() and not force:
        raise UsageError(f"{out}: exists; pass --force to replace it")
    if not out.parent.resolve().is_dir():
        raise OutputError(f"{out}: folder {out.parent} does not exist")
    if not os.access(out.parent.resolve(), os.W_OK):
        raise OutputError(f"{out}: folder {out.parent} is not writable")
    return out


def atomic_write_bytes(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent.resolve())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise OutputError(f"{path}: cannot write ({e.strerror or e})") from None
    except BaseException:
        _remove(tmp)
        raise


def save_model(model: onnx.ModelProto, path: Path) -> None:
    atomic_write_bytes(path, model.SerializeToString(deterministic=True))


def save_json(obj, path: Path) -> None:
    atomic_write_bytes(Path(path), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _remove(p: str) -> None:
    try:
        os.unlink(p)
    except OSError:
        pass
