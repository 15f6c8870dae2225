"""What the training loop runs a step with: the `StepExecutor` interface, and `SessionExecutor`, which runs the
whole step graph in one onnxruntime session (the data-parallel executor is in distributed.py).

`SessionExecutor` keeps the state in two OrtValues per state input on the session's device. Two IOBindings are
made once: the first reads buffer 0 and writes buffer 1, the second the other way round, and the executor
alternates between them; so a step binds only its data batch, and nothing but the loss scalar crosses to the
host.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Callable, TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from .. import runtime
from ..errors import InvalidModelError, UsageError
from .step import StepGraph, read_step_graph

T = TypeVar("T")


class StepExecutor(ABC):
    """Runs the steps of one step graph and holds its state; the trainer (trainer.py) runs the loop around it.

    An executor that is one of several processes says how many equal shards a batch splits into (`shards`),
    which process writes (`lead`), and makes `from_lead` and `state_dict` collective."""

    graph: StepGraph
    device: str                 # where the state lives: "cuda" or "cpu"
    shards = 1                  # a batch must split into this many equal parts, one per process
    lead = True                 # the process that writes checkpoints

    @abstractmethod
    def step(self, feeds: dict[str, np.ndarray]) -> float:
        """One training step on one batch (an array per data input); returns the loss."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """A host copy of every state value, in the step graph's order."""

    @abstractmethod
    def load_state_dict(self, values: dict[str, np.ndarray], source: str = "the state") -> None:
        """Replace the state; `source` names where the values come from in errors."""

    @abstractmethod
    def parameters(self) -> dict[str, np.ndarray]:
        """A host copy of the trained parameters."""

    @property
    @abstractmethod
    def state(self) -> dict[str, ort.OrtValue]:
        """The state this process holds, as the OrtValues the next step reads."""

    @abstractmethod
    def feed_lr(self, value: np.ndarray) -> None:
        """Feed `value` (a scalar of the `lr` input's type) to the learning-rate input from the next step on."""

    def count_from(self, steps_done: int) -> None:
        """The steps run before the next one (restored from a checkpoint), for step numbers in messages."""

    def from_lead(self, read: Callable[[], T], what: str) -> T:
        """`read()` done by the lead process and its result shared with the others (`what` it is, for errors)."""
        return read()

    def close(self) -> None:
        """Release what the executor holds beyond its own memory (a process group)."""


class SessionExecutor(StepExecutor):
    """The step graph in one onnxruntime session, its state kept on the session's device between steps."""

    def __init__(self, model: str | os.PathLike | onnx.ModelProto, *, provider: str = "auto",
                 threads: int | None = None, profile_prefix: str | None = None, configure=None):
        self.graph = read_step_graph(model)
        self.session, self.device = runtime.training_session(self.graph.model, provider, threads, profile_prefix,
                                                             configure)
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

    def feed_lr(self, value: np.ndarray) -> None:
        self._lr_value = self._device_value(value)
        for binding in self._bindings:
            binding.bind_ortvalue_input(self.graph.lr, self._lr_value)

    def step(self, feeds: dict[str, np.ndarray]) -> float:
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
        return {name: buffers[self._current] for name, buffers in self._buffers.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: value.numpy().copy() for name, value in self.state.items()}

    def parameters(self) -> dict[str, np.ndarray]:
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
