"""The two training loops of onnxgrad, one per kind of graph build-grad writes.

`run_training_graph` (`onnxgrad run`): a *training graph* (forward and backward, `<p>_grad` outputs) run step by
step with plain SGD applied on the host, `p -= lr * <p>_grad`; for trying a training graph out.

`StepGraphTrainer` (`onnxgrad train`): a *step graph* (written by `build-grad --optimizer`) does one whole
training step: forward, backward and the optimizer's update. Its metadata `onnxgrad.state` maps each state input
(parameters, optimizer state, `step`) to the output that replaces it after a step; `onnxgrad.loss` names the
loss output; an optional float scalar input `lr` carries the learning rate. Every other graph input is data,
fed from `.npz` arrays batch by batch.

The step-graph trainer keeps its state in two OrtValues per state input on the session's device. Two IOBindings
are made once: the first reads buffer 0 and writes buffer 1, the second the other way round, and the trainer
alternates between them; so a step binds only its data batch, and nothing but the loss scalar crosses to the
host.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from . import runtime
from .contract import (CHECKPOINT_KEY, GRAD_SUFFIX, LOSS_KEY, LOSS_SCALE_INPUT, LR_INPUT, STATE_KEY,
                       TRAINING_METADATA)
from .optim import SKIPPED_STEPS
from .errors import InvalidModelError, NonFiniteError, UsageError
from .io import atomic_write_bytes, save_model
from .loader import read_model
from .protos import class_counts as _class_counts, declared_dims as _dims, forward_outputs, random_feeds
from .protos import needed_subgraph as _needed

CHECKPOINT_FORMAT = 1
STATE_PREFIX = "state/"


# -- a training graph with plain SGD (`onnxgrad run`) --------------------------------------------------------

def training_graph_parameters(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers that have a `<name>_grad` output: the trainable parameters, in initializer order."""
    outs = {o.name for o in model.graph.output}
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name + GRAD_SUFFIX in outs}


def run_training_graph(model: onnx.ModelProto, steps: int = 1, lr: float = 0.1, data: str | None = None,
                       dims: dict[str, int] | None = None, seed: int = 0, provider: str = "auto") -> list[dict]:
    """`steps` runs of a training graph on fixed data (`data` arrays over seeded random ones), each followed by
    `p -= lr * <p>_grad` on the host; per step, the loss and the L2 norm of every gradient."""
    params = training_graph_parameters(model)
    if not params:
        raise UsageError("the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?")
    inferred = onnx.shape_inference.infer_shapes(model)
    # a loss scale (build-grad --loss-scale) keeps its stored value, as the parameters do
    stored = {t.name for t in model.graph.initializer}
    feeds = random_feeds(inferred, dims or {}, seed, skip=set(params) | ({LOSS_SCALE_INPUT} & stored))
    if data:
        arrays = read_npz(data, "--data")
        unknown = sorted(set(arrays) - set(feeds))
        if unknown:
            raise UsageError(f"--data {data}: {unknown[0]!r} is not a data input of the model")
        check_labels(inferred, arrays, f"--data {data}")
        feeds.update(arrays)
    sess = runtime.session(model, provider)
    outputs = [o.name for o in sess.get_outputs()]
    loss_name = outputs[0]
    history = []
    for _ in range(steps):
        result = dict(zip(outputs, sess.run(None, {**feeds, **params})))
        grads = {p: result[p + GRAD_SUFFIX] for p in params}
        history.append({"loss": float(np.asarray(result[loss_name]).reshape(-1)[0]),
                        "grad_norms": {p + GRAD_SUFFIX: float(np.linalg.norm(g)) for p, g in grads.items()}})
        params = {p: np.asarray(v - lr * grads[p], dtype=v.dtype) for p, v in params.items()}
    return history


# -- a step graph, its state kept on the device (`onnxgrad train`) ------------------------------------------

@dataclass
class StepGraph:
    """What the runner needs to know about a step graph, read from its inputs, outputs and metadata."""

    model: onnx.ModelProto
    state: dict[str, str]                      # state input -> the output that replaces it after a step
    loss: str
    loss_shape: tuple[int, ...]
    loss_dtype: np.dtype
    lr: str | None                             # the learning-rate input, when the graph has one
    data: dict[str, onnx.ValueInfoProto]       # the inputs fed from the data (no initializer), in graph order
    parameters: list[str]                      # state inputs the forward outputs depend on (not optimizer state)
    initial: dict[str, np.ndarray]             # initializer values of the state inputs and of `lr`
    forward_outputs: list[str]                 # the forward model's outputs, without a loss build-grad appended


def read_step_graph(model: str | os.PathLike | onnx.ModelProto) -> StepGraph:
    proto = read_model(model)
    g = proto.graph
    meta = {p.key: p.value for p in proto.metadata_props}
    if STATE_KEY not in meta:
        raise UsageError(f"not a step graph: no {STATE_KEY!r} metadata; write one with "
                         f"`onnxgrad build-grad MODEL -o STEP.onnx --optimizer sgd`")
    try:
        state = json.loads(meta[STATE_KEY])
    except json.JSONDecodeError:
        state = None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in state.items()):
        raise InvalidModelError(f"metadata {STATE_KEY!r} is not a JSON object of input -> output names")
    inputs = {vi.name: vi for vi in g.input}
    outputs = {vi.name: vi for vi in g.output}
    inits = {t.name: t for t in g.initializer}
    for name, nxt in state.items():
        if name not in inputs:
            raise InvalidModelError(f"{STATE_KEY}: {name!r} is not a graph input")
        if nxt not in outputs:
            raise InvalidModelError(f"{STATE_KEY}: {nxt!r} (the next value of {name!r}) is not a graph output")
        if name not in inits:
            raise InvalidModelError(f"{STATE_KEY}: {name!r} has no initializer to start from")
        if outputs[nxt].type.tensor_type.elem_type not in (0, inits[name].data_type):
            raise InvalidModelError(f"{STATE_KEY}: {nxt!r} has another element type than {name!r}")
    loss = meta.get(LOSS_KEY, "")
    if not loss or "," in loss or loss not in outputs:
        raise InvalidModelError(f"metadata {LOSS_KEY!r} must name one graph output (found {loss!r})")
    loss_type = outputs[loss].type.tensor_type
    loss_dims = _dims(outputs[loss])
    if loss_dims is None or not all(isinstance(d, int) for d in loss_dims) or int(np.prod(loss_dims)) != 1 \
            or not loss_type.elem_type:
        raise InvalidModelError(f"the loss output {loss!r} must be declared a scalar (a static shape of one "
                                f"element) with its element type")
    loss_dtype = np.dtype(helper.tensor_dtype_to_np_dtype(loss_type.elem_type))
    lr = LR_INPUT if LR_INPUT in inputs and LR_INPUT not in state else None
    # Other inputs with a stored value (an initializer) keep it; the rest are fed from the data.
    data = {n: vi for n, vi in inputs.items() if n not in state and n != lr and n not in inits}
    initial = {name: numpy_helper.to_array(inits[name]) for name in state}
    if lr is not None and lr in inits:
        initial[lr] = numpy_helper.to_array(inits[lr])
    forward = forward_outputs(proto, state)
    needed = _needed(g, forward)[1]
    parameters = [name for name in state if name in needed]
    return StepGraph(proto, state, loss, tuple(loss_dims), loss_dtype, lr, data, parameters, initial, forward)


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
    """Runs a step graph in onnxruntime, keeping its state on the device between steps.

        trainer = StepGraphTrainer("step.onnx")                      # CUDA where onnxruntime can use it, else CPU
        result = trainer.fit("data.npz", steps=100, batch=32)
        trainer.export("trained.onnx")                      # the forward model with the trained weights
    """

    def __init__(self, model: str | os.PathLike | onnx.ModelProto, *, provider: str = "auto",
                 threads: int | None = None, lr: float | None = None, profile_prefix: str | None = None,
                 configure=None):
        self.graph = read_step_graph(model)
        self.session, self.device = runtime.training_session(self.graph.model, provider, threads, profile_prefix,
                                                             configure)
        self.steps_done = 0
        self.resumed: dict | None = None     # the checkpoint record this trainer was restored from
        # On the CPU an OrtValue wraps the numpy array it is made from: copy, so graph.initial stays initial.
        self._buffers = {name: [self._device_value(value.copy()), self._device_value(np.zeros_like(value))]
                         for name, value in self.graph.initial.items() if name in self.graph.state}
        # The loss too goes to a buffer of its own per binding: asking a binding for the outputs that
        # onnxruntime allocated costs more than a small step (wrapping every output again).
        self._loss_buffers = [self._device_value(np.zeros(self.graph.loss_shape, self.graph.loss_dtype))
                              for _ in range(2)]
        self._current = 0                    # which of the two buffers holds the current state
        self._checked = False
        self._bindings = [self._binding(0), self._binding(1)]
        self.lr = None
        self._lr_chosen = False              # by the caller: then a checkpoint's lr does not override it
        self._start_lr(lr)

    # -- the step -------------------------------------------------------------------------------------------

    def _device_value(self, array: np.ndarray) -> ort.OrtValue:
        # np.asarray keeps a 0-d array 0-d (np.ascontiguousarray would make it 1-d)
        return ort.OrtValue.ortvalue_from_numpy(np.asarray(array, order="C"), self.device, 0)

    def _binding(self, source: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        binding.bind_ortvalue_output(self.graph.loss, self._loss_buffers[source])
        for name, nxt in self.graph.state.items():
            binding.bind_ortvalue_input(name, self._buffers[name][source])
            binding.bind_ortvalue_output(nxt, self._buffers[name][1 - source])
        return binding

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
        self._lr_value = self._device_value(np.array(lr, dtype=dtype))
        for binding in self._bindings:
            binding.bind_ortvalue_input(self.graph.lr, self._lr_value)
        self.lr = float(lr)

    def step(self, feeds: dict[str, np.ndarray]) -> float:
        """One training step on one batch (an array per data input); returns the loss."""
        binding = self._bindings[self._current]
        missing = [n for n in self.graph.data if n not in feeds]
        if missing:
            raise UsageError(f"no data for the step graph's input {missing[0]!r}")
        batch = {name: self._device_value(feeds[name]) for name in self.graph.data}  # alive until the run ends
        for name, value in batch.items():
            binding.bind_ortvalue_input(name, value)
        self.session.run_with_iobinding(binding)
        self._current = 1 - self._current
        if not self._checked:
            self._check_next_shapes()
        self.steps_done += 1
        return float(self._loss_buffers[1 - self._current].numpy().reshape(-1)[0])

    def _check_next_shapes(self) -> None:
        """Once: every `.next` output came out with its state input's shape (else the next step would read a
        state of another shape)."""
        for name, buffers in self._buffers.items():
            if buffers[0].shape() != buffers[1].shape():
                raise InvalidModelError(f"the step graph's output {self.graph.state[name]!r} has shape "
                                        f"{buffers[self._current].shape()}, its state input {name!r} has "
                                        f"{buffers[1 - self._current].shape()}")
        self._checked = True

    @property
    def state(self) -> dict[str, ort.OrtValue]:
        """The current state, as the OrtValues the next step reads (on the session's device)."""
        return {name: buffers[self._current] for name, buffers in self._buffers.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        """A host copy of every state value."""
        return {name: value.numpy().copy() for name, value in self.state.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        """A host copy of the trained parameters."""
        state = self.state
        return {name: state[name].numpy().copy() for name in self.graph.parameters}

    def load_state_dict(self, values: dict[str, np.ndarray], source: str = "the state") -> None:
        names, expected = set(values), set(self._buffers)
        if names != expected:
            odd = sorted(names ^ expected)[0]
            raise UsageError(f"{source}: {'has no value for' if odd in expected else 'has an unknown value'} "
                             f"{odd!r}")
        for name, value in values.items():
            current = self._buffers[name][self._current]
            if tuple(value.shape) != tuple(current.shape()) or value.dtype != current.numpy().dtype:
                raise UsageError(f"{source}: {name!r} is {value.dtype}{list(value.shape)}, the step graph "
                                 f"wants {current.numpy().dtype}{list(current.shape())}")
            current.update_inplace(np.asarray(value, order="C"))

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
                                         f"training stopped, {_kept(checkpoint, saved['step'])}; "
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
                                         f"stopped, {_kept(checkpoint, saved['step'])}; --allow-nonfinite trains on")
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
        """--batch, or the first dimension the graph fixes for its data inputs, or 32 rows (at most all)."""
        fixed = {_dims(vi)[0] for vi in self.graph.data.values() if _dims(vi) and isinstance(_dims(vi)[0], int)}
        if len(fixed) > 1:
            raise InvalidModelError(f"the step graph's data inputs fix different first dimensions {sorted(fixed)}")
        if batch is not None:
            if fixed and batch not in fixed:
                raise UsageError(f"--batch {batch}: the step graph fixes the batch dimension to {fixed.pop()}")
            return batch
        if fixed:
            return fixed.pop()
        return min(32, len(next(iter(arrays.values()))))

    # -- checkpoints ----------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike, batches: Batches | None = None) -> None:
        """An .npz of every state value (`state/<name>`) and a JSON record (`onnxgrad.checkpoint`): the step
        count, the epoch and batch position and what decides the batches."""
        self._write_checkpoint(path, self.state_dict(), batches)

    def _write_checkpoint(self, path: str | os.PathLike, state: dict[str, np.ndarray],
                          batches: Batches | None) -> None:
        record = {"format": CHECKPOINT_FORMAT, "step": self.steps_done, "lr": self.lr}
        if batches is not None:
            epoch, index = batches.position(self.steps_done)
            record.update(batches.record(), epoch=epoch, batch_in_epoch=index)
        elif self.resumed is not None:
            record.update({k: v for k, v in self.resumed.items() if k not in record})
        arrays = {STATE_PREFIX + name: value for name, value in state.items()}
        arrays[CHECKPOINT_KEY] = np.array(json.dumps(record, sort_keys=True))
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        atomic_write_bytes(Path(path), buffer.getvalue())

    def load_checkpoint(self, path: str | os.PathLike) -> dict:
        """Restore the state, the step count and the learning rate (unless the caller chose one); `fit` then
        checks that its batches match the record."""
        record, state = read_checkpoint(path)
        return self._restore(record, state, f"--resume {path}")

    def _restore(self, record: dict, state: dict[str, np.ndarray], source: str) -> dict:
        self.load_state_dict(state, source)
        self.steps_done = int(record["step"])
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
        model = _substitute(read_model(forward), params) if forward is not None else \
            strip_step_graph(self.graph, params)
        if path is not None:
            save_model(model, Path(path))
        return model

    def check_export(self, forward: onnx.ModelProto | None = None) -> None:
        """What `export(forward=...)` would refuse, found before training: a trained parameter that `forward`
        lacks, or has with another shape or type."""
        if forward is not None:
            _matching_initializers(forward, {name: self.graph.initial[name] for name in self.graph.parameters})


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """The record and the state values of a checkpoint written by `save_checkpoint`."""
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


# -- data ----------------------------------------------------------------------------------------------------

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
        dims = _dims(vi)
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
    classes = _class_counts(model)
    ignore = {n.input[1]: next((a.i for a in n.attribute if a.name == "ignore_index"), None)
              for n in model.graph.node if n.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
              and len(n.input) > 1}
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


def _kept(checkpoint: str | os.PathLike | None, step: int | None) -> str:
    """What a stopped run leaves behind, for its message."""
    if checkpoint is None:
        return "no checkpoint asked for (--checkpoint)"
    if step is None:
        return f"{checkpoint} not written by this run"
    return f"{checkpoint} kept at step {step}"


# -- export --------------------------------------------------------------------------------------------------

def strip_step_graph(graph: StepGraph, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The step graph cut back to its forward outputs, with `params` as its initializers."""
    src = graph.model
    keep = set(graph.forward_outputs)
    outputs = [o for o in src.graph.output if o.name in keep]
    nodes, names = _needed(src.graph, [o.name for o in outputs])
    inits = []
    for t in src.graph.initializer:
        if t.name in names:
            inits.append(numpy_helper.from_array(params[t.name], t.name) if t.name in params else t)
    inputs = [vi for vi in src.graph.input if vi.name in names and vi.name not in params]
    value_info = [vi for vi in src.graph.value_info if vi.name in names]
    g = helper.make_graph(nodes, src.graph.name, inputs, outputs, inits, doc_string=src.graph.doc_string,
                          value_info=value_info)
    model = helper.make_model(g, opset_imports=list(src.opset_import), ir_version=src.ir_version,
                              producer_name=src.producer_name, producer_version=src.producer_version,
                              doc_string=src.doc_string)
    for p in src.metadata_props:
        if p.key not in TRAINING_METADATA:
            model.metadata_props.add(key=p.key, value=p.value)
    model.functions.extend(src.functions)
    return model


def _substitute(forward: onnx.ModelProto, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """`forward` with the values of its initializers named like a trained parameter replaced."""
    inits = _matching_initializers(forward, params)
    for name, value in params.items():
        inits[name].CopyFrom(numpy_helper.from_array(value, name))
    return forward


def _matching_initializers(forward: onnx.ModelProto, params: dict[str, np.ndarray]) -> dict[str, onnx.TensorProto]:
    """The initializers of `forward` by name, after checking that each parameter has one of its shape and type."""
    inits = {t.name: t for t in forward.graph.initializer}
    for name, value in params.items():
        t = inits.get(name)
        if t is None:
            raise UsageError(f"--forward: the model has no initializer {name!r} for the trained parameter")
        shape, dtype = tuple(t.dims), np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        if shape != value.shape or dtype != value.dtype:
            raise UsageError(f"--forward: initializer {name!r} is {dtype}{list(shape)}, the trained "
                             f"parameter is {value.dtype}{list(value.shape)}")
    return inits


# -- progress ------------------------------------------------------------------------------------------------

class Progress:
    """Loss and throughput on stderr: a bar redrawn in place on a terminal ("bar"), a line every `every`
    steps otherwise ("lines"), or nothing ("off"). The loss shown is the mean over the steps since the last
    update; samples/s counts the same steps."""

    def __init__(self, total: int, batch: int, mode: str = "auto", every: int | None = None, stream=None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.total, self.batch = mode, total, batch
        self.every = every or max(1, total // 10)
        self._losses, self._seconds, self._drawn = [], 0.0, 0.0

    def update(self, done: int, loss: float, seconds: float) -> None:
        if self.mode == "off":
            return
        self._losses.append(loss)
        self._seconds += seconds
        now = time.monotonic()
        if self.mode == "bar" and (now - self._drawn >= 0.1 or done == self.total):
            self._drawn = now
            width = 24
            filled = int(width * done / max(self.total, 1))
            left = (self.total - done) * self._seconds / len(self._losses)
            self.stream.write(f"\r{done}/{self.total} [{'#' * filled}{'.' * (width - filled)}] {self._text()}  "
                              f"ETA {int(left) // 60}:{int(left) % 60:02d}\033[K")
            self.stream.flush()
        elif self.mode == "lines" and (done % self.every == 0 or done == self.total):
            self.stream.write(f"step {done}/{self.total}  {self._text()}\n")
            self.stream.flush()
        else:
            return
        self._losses, self._seconds = [], 0.0

    def _text(self) -> str:
        rate = self.batch * len(self._losses) / self._seconds if self._seconds > 0 else math.inf
        return f"loss {sum(self._losses) / len(self._losses):.6g}  {rate:,.0f} samples/s"

    def finish(self) -> None:
        if self.mode == "bar":
            self.stream.write("\n")
            self.stream.flush()
