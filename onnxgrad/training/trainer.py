"""The training loop of `onnxgrad train`: `StepGraphTrainer` runs a step graph's steps through a `StepExecutor`
(one onnxruntime session, or one process of a data-parallel job) and does the rest the same way for both:
batches, learning rate, checkpoints and resuming, progress, stopping on a non-finite loss, and export."""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ..contract import LOSS_SCALE_INPUT
from ..errors import InvalidModelError, NonFiniteError, UsageError
from ..io import save_model
from ..loader import read_model
from ..optim import SKIPPED_STEPS
from ..protos import declared_dims
from .checkpoint import kept, read_checkpoint, write_checkpoint
from .data import Batches, check_data, load_data
from .executor import SessionExecutor, StepExecutor
from .export import matching_initializers, strip_step_graph, substitute_parameters
from .progress import Progress


@dataclass
class TrainResult:
    """What `StepGraphTrainer.fit` did: the step numbers and losses of the steps it ran, and their timing."""

    first_step: int                       # 1-based number of the first step run by this call
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    batch: int = 0
    epochs: float = 0.0                   # epochs completed at the end, fractional
    # with a dynamic loss scaler (build-grad --precision fp16): steps skipped on overflow since the start of
    # training (a checkpoint keeps the count), and the scale at the end
    skipped_steps: int | None = None
    loss_scale: float | None = None

    @property
    def steps(self) -> int:
        return self.first_step - 1 + len(self.losses)

    @property
    def samples_per_second(self) -> float:
        total = sum(self.step_seconds)
        return self.batch * len(self.step_seconds) / total if total > 0 else 0.0

    def to_json(self) -> dict:
        return {"first_step": self.first_step, "steps": self.steps, "batch": self.batch,
                "epochs": round(self.epochs, 6), "losses": self.losses,
                "step_seconds": [round(s, 6) for s in self.step_seconds],
                "samples_per_second": round(self.samples_per_second, 3),
                **({"skipped_steps": self.skipped_steps, "loss_scale": self.loss_scale}
                   if self.skipped_steps is not None else {})}


class StepGraphTrainer:
    """Trains with a step graph: the loop around a `StepExecutor`, by default a `SessionExecutor` that keeps the
    state on the device between steps.

        trainer = StepGraphTrainer("step.onnx")             # CUDA where onnxruntime can use it, else CPU
        result = trainer.fit("data.npz", steps=100, batch=32)
        trainer.export("trained.onnx")                      # the forward model with the trained weights

    `model` is a step graph (then `provider`, `threads`, `profile_prefix` and `configure` make its session), or
    an executor that runs one."""

    def __init__(self, model: str | os.PathLike | onnx.ModelProto | StepExecutor, *, provider: str = "auto",
                 threads: int | None = None, lr: float | None = None, profile_prefix: str | None = None,
                 configure=None):
        if isinstance(model, StepExecutor):
            if (provider, threads, profile_prefix, configure) != ("auto", None, None, None):
                raise UsageError("provider, threads, profile_prefix and configure make a session for a step "
                                 "graph; an executor comes with its own")
            self.executor = model
        else:
            self.executor = SessionExecutor(model, provider=provider, threads=threads, profile_prefix=profile_prefix,
                                            configure=configure)
        self.graph = self.executor.graph
        self.device = self.executor.device
        self.steps_done = 0
        self.resumed: dict | None = None     # the checkpoint record this trainer was restored from
        self.lr = None
        self._lr_chosen = False              # by the caller: then a checkpoint's lr does not override it
        self._start_lr(lr)

    # -- the step -------------------------------------------------------------------------------------------

    def _start_lr(self, lr: float | None) -> None:
        """The learning rate of the first step: the caller's, else the step graph's stored default."""
        if lr is not None:
            self.set_lr(lr)
        elif self.graph.lr is not None:
            if self.graph.lr not in self.graph.initial:
                raise UsageError(f"the step graph's {self.graph.lr!r} input has no default; pass --lr")
            self._bind_lr(float(self.graph.initial[self.graph.lr]))

    def set_lr(self, lr: float) -> None:
        """Feed `lr` to the graph's learning-rate input from the next step on (e.g. a schedule)."""
        self._bind_lr(lr)
        self._lr_chosen = True

    def _bind_lr(self, lr: float) -> None:
        if self.graph.lr is None:
            raise UsageError("--lr: the step graph has no 'lr' input")
        vi = next(vi for vi in self.graph.model.graph.input if vi.name == self.graph.lr)
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        self.executor.feed_lr(np.array(lr, dtype=dtype))
        self.lr = float(lr)

    def step(self, feeds: dict[str, np.ndarray]) -> float:
        """One training step on one batch (an array per data input); returns the loss."""
        loss = self.executor.step(feeds)
        self.steps_done += 1
        return loss

    @property
    def state(self) -> dict[str, ort.OrtValue]:
        """The current state, as the OrtValues the next step reads (on the executor's device)."""
        return self.executor.state

    def state_dict(self) -> dict[str, np.ndarray]:
        """A host copy of every state value."""
        return self.executor.state_dict()

    def parameters(self) -> dict[str, np.ndarray]:
        """A host copy of the trained parameters."""
        return self.executor.parameters()

    def load_state_dict(self, values: dict[str, np.ndarray], source: str = "the state") -> None:
        self.executor.load_state_dict(values, source)

    def close(self) -> None:
        """Release what the executor holds beyond memory (a data-parallel process group)."""
        self.executor.close()

    # -- the loop -------------------------------------------------------------------------------------------

    def fit(self, data: str | os.PathLike | dict[str, np.ndarray] | Batches, *, steps: int | None = None,
            epochs: int | None = None, batch: int | None = None, seed: int = 0, shuffle: bool = True,
            drop_last: bool = True, checkpoint: str | os.PathLike | None = None,
            checkpoint_every: int | None = None, progress: str = "off", log_every: int | None = None,
            allow_nonfinite: bool = False) -> TrainResult:
        """Train until `steps` steps or `epochs` epochs have run since the start (whichever comes first; one
        epoch when neither is given), counting steps restored by `load_checkpoint`, so that the same call
        after a resume finishes an interrupted run. Saves a checkpoint every `checkpoint_every` steps and at
        the end when `checkpoint` is given. `progress`: "auto", "bar", "lines" or "off" (see `Progress`).
        `data` may be `Batches` made by `batches` (then `batch`, `seed`, `shuffle` and `drop_last` are its own).

        A loss that is NaN or infinite stops training with `NonFiniteError` (unless `allow_nonfinite`), and so
        does a checkpoint due while a parameter is: no checkpoint is written after the state went bad, so the
        last one written stays the last good one."""
        batches = data if isinstance(data, Batches) else self.batches(data, batch, seed, shuffle, drop_last)
        limits = [n for n in (steps, epochs * len(batches) if epochs is not None else None) if n is not None]
        target = min(limits) if limits else len(batches)
        result = TrainResult(first_step=self.steps_done + 1, batch=batches.batch)
        progress = Progress(target, batches.batch, mode=progress, every=log_every)
        saved = {"step": None}   # the step of the last checkpoint this call wrote

        def save() -> None:
            if not allow_nonfinite:
                bad = next((name for name, value in self.parameters().items() if not np.isfinite(value).all()), None)
                if bad is not None:
                    raise NonFiniteError(f"step {self.steps_done}: parameter {bad!r} holds NaN or infinite values; "
                                         f"training stopped, {kept(checkpoint, saved['step'])}; "
                                         f"--allow-nonfinite trains on")
            self.save_checkpoint(checkpoint, batches)
            saved["step"] = self.steps_done
        try:
            while self.steps_done < target:
                feeds = batches[self.steps_done]
                started = time.perf_counter()
                loss = self.step(feeds)
                result.step_seconds.append(time.perf_counter() - started)
                result.losses.append(loss)
                progress.update(self.steps_done, loss, result.step_seconds[-1])
                if not allow_nonfinite and not math.isfinite(loss):
                    progress.finish()
                    raise NonFiniteError(f"step {self.steps_done}: the loss is {loss} (NaN or infinite); training "
                                         f"stopped, {kept(checkpoint, saved['step'])}; --allow-nonfinite trains on")
                if checkpoint is not None and checkpoint_every and self.steps_done % checkpoint_every == 0:
                    save()
        except KeyboardInterrupt:
            # A step either completed (the buffers were swapped) or did not count, so the state is whole.
            progress.finish()
            if checkpoint is not None:
                self.save_checkpoint(checkpoint, batches)
            raise
        progress.finish()
        if checkpoint is not None:
            save()
        result.epochs = self.steps_done / len(batches)
        if SKIPPED_STEPS in self.graph.state:
            state = self.state
            result.skipped_steps = int(state[SKIPPED_STEPS].numpy())
            result.loss_scale = float(state[LOSS_SCALE_INPUT].numpy())
        return result

    def batches(self, data: str | os.PathLike | dict[str, np.ndarray], batch: int | None = None, seed: int = 0,
                shuffle: bool = True, drop_last: bool = True) -> Batches:
        """The data read and checked (arrays, labels in range), cut into batches; after `load_checkpoint`, also
        checked to be the data and settings the checkpoint was made with. `fit` calls it; a caller may call it
        first to fail before any other work."""
        arrays = load_data(data, self.graph) if not isinstance(data, dict) else check_data(data, self.graph)
        batches = Batches(arrays, self._batch_size(batch, arrays), seed, shuffle, drop_last)
        if self.resumed is not None:
            for key, value in batches.record().items():
                if key == "data" and "data" not in self.resumed:
                    continue  # a checkpoint written before fingerprints were kept
                if self.resumed.get(key) != value:
                    had = "other data" if key == "data" else f"{key} {self.resumed.get(key)}"
                    now = "this --data differs" if key == "data" else f"this run has {value}"
                    raise UsageError(f"--resume: the checkpoint was made with {had}, {now}; the batches would "
                                     f"differ")
        return batches

    def _batch_size(self, batch: int | None, arrays: dict[str, np.ndarray]) -> int:
        """--batch, or the first dimension the graph fixes for its data inputs, or 32 rows (at most all); a
        multiple of the executor's shards."""
        fixed = {declared_dims(vi)[0] for vi in self.graph.data.values() if declared_dims(vi) and isinstance(declared_dims(vi)[0], int)}
        if len(fixed) > 1:
            raise InvalidModelError(f"the step graph's data inputs fix different first dimensions {sorted(fixed)}")
        if batch is not None:
            if fixed and batch not in fixed:
                raise UsageError(f"--batch {batch}: the step graph fixes the batch dimension to {fixed.pop()}")
            size = batch
        else:
            size = fixed.pop() if fixed else min(32, len(next(iter(arrays.values()))))
        if size % self.executor.shards:
            raise UsageError(f"--batch {size}: the global batch must split into {self.executor.shards} equal shards "
                             f"(one per process)")
        return size

    # -- checkpoints ----------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike, batches: Batches | None = None) -> None:
        """An .npz of every state value (`state/<name>`) and a JSON record (`onnxgrad.checkpoint`): the step
        count, the epoch and batch position and what decides the batches. Collective under data parallelism:
        every process gathers, the lead one writes."""
        state = self.state_dict()
        if self.executor.lead:
            write_checkpoint(path, state, self.steps_done, self.lr, batches, self.resumed)

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore the state, the step count and the learning rate (unless the caller chose one); `fit` then
        checks that its batches match the record. Under data parallelism the lead process reads the file and
        sends it to the others (only its machine needs it)."""
        record, state = self.executor.from_lead(lambda: read_checkpoint(path), "the checkpoint")
        return self._restore(record, state, f"--resume {path}")

    def _restore(self, record: dict, state: dict[str, np.ndarray], source: str) -> dict:
        self.load_state_dict(state, source)
        self.steps_done = int(record["step"])
        self.executor.count_from(self.steps_done)
        self.resumed = record
        if record.get("lr") is not None and self.graph.lr is not None and not self._lr_chosen:
            self._bind_lr(record["lr"])
        return record

    # -- export ---------------------------------------------------------------------------------------------

    def export(self, path: str | os.PathLike | None = None,
               forward: str | os.PathLike | onnx.ModelProto | None = None) -> onnx.ModelProto:
        """The forward model with the trained parameters, written to `path` when given.

        With `forward` (the model the step graph was built from): that model unchanged but for the values of
        its initializers that are trained parameters, matched by name. Without it: the step graph cut back to
        its original outputs (those before the state outputs, less a loss that build-grad --loss-fn
        appended) and the nodes they need, the parameters as plain initializers, and no optimizer state,
        learning rate or training metadata."""
        params = self.parameters()
        model = substitute_parameters(read_model(forward), params) if forward is not None else \
            strip_step_graph(self.graph, params)
        if path is not None:
            save_model(model, Path(path))
        return model

    def check_export(self, forward: onnx.ModelProto | None = None) -> None:
        """What `export(forward=...)` would refuse, found before training: a trained parameter that `forward`
        lacks, or has with another shape or type."""
        if forward is not None:
            matching_initializers(forward, {name: self.graph.initial[name] for name in self.graph.parameters})