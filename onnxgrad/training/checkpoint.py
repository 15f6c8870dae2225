"""Checkpoints of a training run: an .npz of every state value (`state/<name>`) and a JSON record
(`onnxgrad.checkpoint`) of the step count, the learning rate, the epoch and batch position and what decides the
batches. Any trainer writes and reads the one format, so a run resumes on any number of processes."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from ..contract import CHECKPOINT_KEY
from ..errors import UsageError
from ..io import atomic_write_bytes
from .data import Batches, read_npz

CHECKPOINT_FORMAT = 1
STATE_PREFIX = "state/"


def write_checkpoint(path: str | os.PathLike, state: dict[str, np.ndarray], step: int, lr: float | None,
                     batches: Batches | None = None, resumed: dict | None = None) -> None:
    """The state after `step` steps; the batch position and what decides the batches from `batches`, else
    (saving outside `fit`) kept from the record the run was `resumed` from."""
    record = {"format": CHECKPOINT_FORMAT, "step": step, "lr": lr}
    if batches is not None:
        epoch, index = batches.position(step)
        record.update(batches.record(), epoch=epoch, batch_in_epoch=index)
    elif resumed is not None:
        record.update({k: v for k, v in resumed.items() if k not in record})
    arrays = {STATE_PREFIX + name: value for name, value in state.items()}
    arrays[CHECKPOINT_KEY] = np.array(json.dumps(record, sort_keys=True))
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(Path(path), buffer.getvalue())


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The record and the state values of a checkpoint written by `write_checkpoint`."""
    path = Path(path)
    files = read_npz(path, "--resume")
    try:
        record = json.loads(str(files.pop(CHECKPOINT_KEY)))
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError("no step count")
    except (KeyError, ValueError) as e:
        raise UsageError(f"--resume {path}: not an onnxgrad checkpoint ({type(e).__name__})") from None
    if record.get("format") != CHECKPOINT_FORMAT:
        raise UsageError(f"--resume {path}: checkpoint format {record.get('format')}, "
                         f"expected {CHECKPOINT_FORMAT}")
    return record, {k[len(STATE_PREFIX):]: v for k, v in files.items()}


def kept(checkpoint: str | os.PathLike | None, step: int | None) -> str:
    """What a stopped run leaves behind, for its message."""
    if checkpoint is None:
        return "no checkpoint asked for (--checkpoint)"
    if step is None:
        return f"{checkpoint} not written by this run"
    return f"{checkpoint} kept at step {step}"
