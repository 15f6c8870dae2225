"""Data-parallel training on torch.distributed: one process per device, each running the step graph on its
shard of every batch, launched by torchrun (`torchrun --nproc-per-node N -m onnxgrad train ...`).

The step graph is split (split.py) into a gradient graph and an update graph. A step is:

1. the gradient graph on this process's rows of the global batch (rows [r*B/W, (r+1)*B/W) of the batch a
   one-process run takes at that step), writing the loss and every `<p>_grad` straight into flat buckets;
2. an all-reduce of the buckets, launched one after the other in the order the backward pass produced the
   gradients, then divided by the world size (a `mean` loss; a `sum` loss is summed): every process now holds
   the gradient of the global batch, and the global batch's loss;
3. the update graph on the averaged gradients: gradient accumulation and clipping by global norm happen there,
   so they see the averaged gradient, as in a one-process run on the whole batch.

With accumulation over K micro-batches, each process accumulates its own gradients and step 2 runs on the
K-th micro-batch only, over the accumulated sums (this micro-batch's share added first); the others
all-reduce just the loss.

Buffers are PyTorch tensors shared with onnxruntime through DLPack (`OrtValue.from_dlpack`): onnxruntime writes
the gradients into the buckets that the collective reads, and reads the averaged values in place; nothing is
copied between the two libraries, on the CPU or on CUDA. As in the one-process trainer, the state is held in
two buffers and the step alternates between two pairs of IOBindings.

With ZeRO-1 (`zero1=True`) each parameter's optimizer state lives on one process only (parameters are dealt
to processes, largest first, to the least-loaded one); each process runs the part of the update graph that
updates the parameters it owns, then every owner broadcasts its new parameters. Accumulated gradients, the
step counters and the parameters themselves stay on every process.

`DataParallelExecutor` is this process's executor of the one training loop (training/trainer.py), which does
the batches, checkpoints, progress and export as in a one-process run. Checkpoints hold the whole state
(gathered from the owners under ZeRO-1) and are written by rank 0 in the one-process format, so a run resumes
on any number of processes, or in one. A collective that does not complete within `timeout` seconds (a process
died or hangs) ends every other process with one line.
"""
from __future__ import annotations

import json
import os
import re
import time
from datetime import timedelta
from typing import Callable, TypeVar

import numpy as np
import onnx
import onnxruntime as ort

from . import runtime
from .contract import GRAD_SUFFIX, LOSS_FN_KEY, OPTIMIZER_KEY
from .errors import OnnxgradError, UsageError
from .optim import state_kinds
from .split import restrict_update, split_step_graph
from .training.executor import StepExecutor
from .training.step import read_step_graph
from .training.trainer import StepGraphTrainer, TrainResult

DEFAULT_BUCKET_MB = 25.0
DEFAULT_TIMEOUT_S = 600.0
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


class DistributedError(OnnxgradError):
    """A collective across processes failed: another process stopped, hung or cannot be reached."""

    exit_code = 7
    # torch.distributed's threads may still wait on the dead peer; a normal interpreter exit then aborts in
    # their destructors, so the command line ends the process at once after the one-line message
    ends_process_at_once = True


def launched() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets its variables)."""
    return "WORLD_SIZE" in os.environ


def import_torch_distributed():
    """torch and torch.distributed, or a one-line error saying how to get them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise UsageError("data-parallel training needs PyTorch (torch.distributed): "
                         "pip install 'onnxgrad[distributed]'") from None
    if not dist.is_available():
        raise UsageError(f"this PyTorch ({torch.__version__}) was built without torch.distributed")
    return torch, dist


def partition(sizes: dict[str, int], world: int) -> dict[str, int]:
    """ZeRO-1's owner of each parameter: largest first, each to the process with the fewest elements so far
    (ties to the lower rank), so every process computes the same deal."""
    load = [0] * world
    owner = {}
    position = {name: i for i, name in enumerate(sizes)}
    for name in sorted(sizes, key=lambda n: (-sizes[n], position[n])):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += sizes[name]
    return owner


def plan_buckets(grads: list[tuple[str, tuple, np.dtype]], cap_bytes: int, loss: tuple[str, tuple, np.dtype]
                 ) -> list[tuple[np.dtype, list[tuple[str, tuple]]]]:
    """All-reduce buckets: consecutive gradients (in the order given: backward order) of one element type, a new
    bucket when the next would pass `cap_bytes` (a gradient larger than that gets one of its own); the loss
    rides in the last bucket of its type (one collective less), else in a bucket of its own."""
    plan: list[tuple[np.dtype, list[tuple[str, tuple]]]] = []
    filled = 0
    for name, shape, dtype in grads:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not plan or plan[-1][0] != dtype or (filled + size > cap_bytes and plan[-1][1]):
            plan.append((dtype, []))
            filled = 0
        plan[-1][1].append((name, tuple(shape)))
        filled += size
    last_of_type = {dtype: i for i, (dtype, _) in enumerate(plan)}
    name, shape, dtype = loss
    if dtype in last_of_type:
        plan[last_of_type[dtype]][1].append((name, tuple(shape)))
    else:
        plan.append((dtype, [(name, tuple(shape))]))
    return plan


class DataParallelExecutor(StepExecutor):
    """One process of a torch.distributed job as the executor of the training loop: `step` takes the global
    batch, runs this process's shard and returns the global batch's loss."""

    def __init__(self, model: str | os.PathLike | onnx.ModelProto, *, provider: str = "auto",
                 threads: int | None = None, zero1: bool = False, bucket_mb: float = DEFAULT_BUCKET_MB,
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.torch, self.dist = import_torch_distributed()
        if bucket_mb <= 0:
            raise UsageError(f"--bucket-mb {bucket_mb:g}: must be > 0")
        self.graph = read_step_graph(model)
        self.split = split_step_graph(self.graph.model)
        meta = {p.key: p.value for p in self.graph.model.metadata_props}
        settings = json.loads(meta[OPTIMIZER_KEY])
        loss_fn = json.loads(meta.get(LOSS_FN_KEY, "{}"))
        self.reduce_mean = loss_fn.get("reduction", "mean") != "sum"
        self.timeout, self.zero1, self._bucket_bytes = timeout, zero1, int(bucket_mb * 2**20)
        self._join(provider, timeout)
        self.shards, self.lead = self.world, self.rank == 0
        if threads is None and self.device == "cpu":
            threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))

        # Which state this process holds and which `.next` outputs its update graph computes.
        params = self.split.parameters
        sizes = {p: int(np.prod(self.graph.initial[p].shape)) for p in params}
        self.owner = partition(sizes, self.world) if zero1 else {p: 0 for p in params}
        sharded = {f"{p}.{k}": p for p in params for k in state_kinds(settings) if k != "grad_acc"}
        self.held = [name for name in self.graph.state
                     if name not in sharded or not zero1 or self.owner[sharded[name]] == self.rank]
        computed = [name for name in self.held if not zero1 or name not in sizes or self.owner[name] == self.rank]
        update = self.split.update if not zero1 else \
            restrict_update(self.split.update, [self.graph.state[name] for name in computed])
        self._computed = computed

        self.grad_session = self._session(self.split.gradient, provider, threads)
        self.update_session = self._session(update, provider, threads)
        # graph inputs, with those that have a stored value (session.get_inputs() leaves these out)
        self._inputs = {"gradient": [vi.name for vi in self.split.gradient.graph.input],
                        "update": [vi.name for vi in update.graph.input]}
        self.steps_done = 0                         # for the step numbers in messages
        self.comm_seconds: list[float] = []         # per step: waiting for collectives
        self.comm_bytes: list[int] = []             # per step: bytes this process all-reduced or broadcast
        self._current = 0
        # With accumulation over K micro-batches, each process sums its own gradients and the sums are
        # all-reduced on the K-th only (their average is the average of the sums): K times less traffic.
        accumulate = settings["accumulate"]
        self._accumulate = accumulate if self.world > 1 else 1
        self._acc_names = [f"{p}.grad_acc" for p in params] if self._accumulate > 1 else []
        self._micro = int(self.graph.initial["micro_step"]) if self._accumulate > 1 else 0
        self._allocate()
        self._grad_bindings = [self._gradient_binding(b) for b in (0, 1)]
        self._bindings = [self._update_binding(b) for b in (0, 1)]

    # -- joining the job ------------------------------------------------------------------------------------

    def _join(self, provider: str, timeout: float) -> None:
        torch, dist = self.torch, self.dist
        wants_cuda = "CUDAExecutionProvider" in runtime.providers(provider)
        if provider == "cuda" and not torch.cuda.is_available():
            raise UsageError("--provider cuda: this PyTorch has no CUDA device to hold the shared buffers")
        self.device = "cuda" if wants_cuda and torch.cuda.is_available() else "cpu"
        self.device_id = int(os.environ.get("LOCAL_RANK", 0)) if self.device == "cuda" else 0
        if not dist.is_initialized():
            missing = [v for v in LAUNCH_VARIABLES if v not in os.environ]
            if missing:
                raise UsageError(f"data-parallel training is launched by torchrun, which sets {', '.join(missing)}: "
                                 f"torchrun --nproc-per-node N -m onnxgrad train ...")
            if self.device == "cuda":
                torch.cuda.set_device(self.device_id)
            try:
                dist.init_process_group("nccl" if self.device == "cuda" else "gloo",
                                        timeout=timedelta(seconds=timeout))
            except (RuntimeError, ValueError) as e:
                raise DistributedError(f"cannot join the process group at {os.environ['MASTER_ADDR']}:"
                                       f"{os.environ['MASTER_PORT']} ({_first_line(e)})") from None
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._tdevice = torch.device(self.device, self.device_id) if self.device == "cuda" else torch.device("cpu")

    def _session(self, model: onnx.ModelProto, provider: str, threads: int | None) -> ort.InferenceSession:
        so, extra = runtime.session_options(model, threads)
        if self.device == "cuda":
            providers = [("CUDAExecutionProvider", {"device_id": self.device_id}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        sess = ort.InferenceSession(runtime.model_bytes(model), so, providers=providers, **extra)
        if self.device == "cuda" and "CUDAExecutionProvider" not in sess.get_providers():
            raise UsageError(f"--provider {provider}: onnxruntime could not start its CUDA provider on device "
                             f"{self.device_id}; use --provider cpu")
        return sess

    def close(self) -> None:
        """Leave the process group (the job's other processes leave theirs)."""
        if self.dist.is_initialized():
            self.dist.destroy_process_group()

    # -- buffers --------------------------------------------------------------------------------------------

    def _tensor(self, array: np.ndarray):
        return self.torch.from_numpy(np.array(array, order="C")).to(self._tdevice)

    def _empty(self, count: int, dtype: np.dtype):
        return self.torch.empty(count, dtype=self.torch.from_numpy(np.zeros(0, dtype)).dtype, device=self._tdevice)

    def _allocate(self) -> None:
        """Parameters: two flat buffers per element type, ordered by owner, so that an owner's parameters are one
        contiguous range to broadcast. Accumulated gradients (when all-reduced once per K micro-batches): two
        flat buffers per type too. Other state: two tensors each. Gradients: flat buckets in backward order.
        Every onnxruntime value is a view of these (DLPack)."""
        graph, params = self.graph, self.split.parameters
        self._tensors: dict[str, list] = {}
        position = {p: i for i, p in enumerate(params)}
        ordered = sorted(params, key=lambda p: (self.owner[p], position[p]))
        self._segments = [(flats, start, length, owner)           # (the two flat buffers, start, length, owner)
                          for flats, ranges in self._flat(ordered, self.owner.get)
                          for start, length, owner in ranges]
        self._acc_flats = [flats for flats, _ in self._flat(self._acc_names, lambda name: 0)]
        for name in self.held:
            if name not in self._tensors:
                first = self._tensor(graph.initial[name])
                self._tensors[name] = [first, self.torch.empty_like(first)]
        self._buffers = {name: [self._shared(t) for t in pair] for name, pair in self._tensors.items()}

        entries = [(g, graph.initial[p].shape, graph.initial[p].dtype)
                   for g, p in zip(self.split.grads, self.split.grad_parameters)]
        plan = plan_buckets(entries, self._bucket_bytes, (graph.loss, graph.loss_shape, graph.loss_dtype))
        self._buckets, self._grad_values = [], {}
        for dtype, members in plan:
            flat = self._empty(sum(int(np.prod(s)) for _, s in members), dtype)
            flat.zero_()
            offset = 0
            for name, shape in members:
                size = int(np.prod(shape))
                view = flat[offset:offset + size].view(shape)
                self._grad_values[name] = (view, self._shared(view))
                offset += size
            self._buckets.append(flat)
        self._loss_tensor = self._grad_values[graph.loss][0]

    def _flat(self, names: list[str], group) -> list[tuple[list, list[tuple[int, int, int]]]]:
        """State values `names` as views of two flat buffers per element type, in their order, the first buffer
        holding the initial values; per type, the buffers and the (start, length, group) ranges of
        consecutive names of one `group(name)`."""
        initial = self.graph.initial
        by_type: dict[np.dtype, list[str]] = {}
        for name in names:
            by_type.setdefault(initial[name].dtype, []).append(name)
        out = []
        for dtype, members in by_type.items():
            flats = [self._empty(sum(initial[n].size for n in members), dtype) for _ in (0, 1)]
            ranges, offset = [], 0
            for name in members:
                size = initial[name].size
                views = [f[offset:offset + size].view(initial[name].shape) for f in flats]
                views[0].copy_(self._tensor(initial[name]))
                self._tensors[name] = views
                if ranges and ranges[-1][2] == group(name):
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + size, ranges[-1][2])
                else:
                    ranges.append((offset, size, group(name)))
                offset += size
            out.append((flats, ranges))
        return out

    def _shared(self, tensor) -> ort.OrtValue:
        """An OrtValue on the tensor's memory (DLPack; on the CPU, numpy's buffer where onnxruntime has no
        DLPack import)."""
        if hasattr(ort.OrtValue, "from_dlpack"):
            return ort.OrtValue.from_dlpack(tensor)
        if self.device == "cpu":
            return ort.OrtValue.ortvalue_from_numpy(tensor.numpy())
        raise UsageError(f"onnxruntime {ort.__version__} cannot share CUDA memory with PyTorch "
                         f"(no OrtValue.from_dlpack); upgrade onnxruntime-gpu")

    def _gradient_binding(self, source: int) -> ort.IOBinding:
        binding = self.grad_session.io_binding()
        for name in self._inputs["gradient"]:
            if name in self._buffers:
                binding.bind_ortvalue_input(name, self._buffers[name][source])
        for name, (_, value) in self._grad_values.items():
            binding.bind_ortvalue_output(name, value)
        return binding

    def _update_binding(self, source: int) -> ort.IOBinding:
        binding = self.update_session.io_binding()
        for name in self._inputs["update"]:
            if name in self._buffers:
                binding.bind_ortvalue_input(name, self._buffers[name][source])
            elif name in self._grad_values:
                binding.bind_ortvalue_input(name, self._grad_values[name][1])
        for name in self._computed:
            binding.bind_ortvalue_output(self.graph.state[name], self._buffers[name][1 - source])
        return binding

    def _device_value(self, array: np.ndarray) -> ort.OrtValue:
        return ort.OrtValue.ortvalue_from_numpy(np.asarray(array, order="C"), self.device, self.device_id)

    def feed_lr(self, value: np.ndarray) -> None:
        """The learning rate is read by the update graph only."""
        self._lr_value = self._device_value(value)
        for binding in self._bindings:
            binding.bind_ortvalue_input(self.graph.lr, self._lr_value)

    # -- the step -------------------------------------------------------------------------------------------

    def step(self, feeds: dict[str, np.ndarray]) -> float:
        """One step on one global batch (this process runs its shard); returns the global batch's loss."""
        missing = [n for n in self.graph.data if n not in feeds]
        if missing:
            raise UsageError(f"no data for the step graph's input {missing[0]!r}")
        rows = len(feeds[next(iter(self.graph.data))])
        if rows % self.world:
            raise UsageError(f"a batch of {rows} rows does not split into {self.world} equal shards "
                             f"(one per process); choose a --batch divisible by {self.world}")
        share = rows // self.world
        lo = self.rank * share
        binding = self._grad_bindings[self._current]
        batch = {name: self._device_value(feeds[name][lo:lo + share]) for name in self.graph.data}
        for name, value in batch.items():
            binding.bind_ortvalue_input(name, value)
        self.grad_session.run_with_iobinding(binding)
        started = time.perf_counter()
        apply = (self._micro + 1) % self._accumulate == 0    # this micro-batch updates the parameters
        self._all_reduce(apply)
        comm = time.perf_counter() - started
        self.update_session.run_with_iobinding(self._bindings[self._current])
        if self.zero1 and self.world > 1 and apply:
            started = time.perf_counter()
            self._collective("broadcast of the updated parameters",
                             lambda: [self.dist.broadcast(flats[1 - self._current][start:start + length],
                                                          src=owner, async_op=True)
                                      for flats, start, length, owner in self._segments])
            comm += time.perf_counter() - started
            self.comm_bytes[-1] += sum(n * flats[0].element_size() for flats, _, n, _ in self._segments)
        elif self.zero1 and self.world > 1:  # no update: the others' parameters carry over unchanged
            for flats, start, length, owner in self._segments:
                if owner != self.rank:
                    flats[1 - self._current][start:start + length].copy_(flats[self._current][start:start + length])
        self.comm_seconds.append(comm)
        self._micro = (self._micro + 1) % self._accumulate
        self._current = 1 - self._current
        self.steps_done += 1
        return float(self._loss_tensor.reshape(-1)[0].item())

    def _all_reduce(self, apply: bool) -> None:
        """The gradient buckets (under accumulation: the gradient sums) on a micro-batch that updates; only the
        loss on the others."""
        if self.world == 1:
            self.comm_bytes.append(0)
            return
        if self.device == "cuda":
            self.torch.cuda.synchronize(self._tdevice)
        if not apply:
            tensors = [self._loss_tensor.reshape(-1)]
        elif self._acc_names:
            # The update graph adds g/K to the sums; adding it here first (the same float32 ops) and feeding
            # zeros instead leaves one tensor per parameter to all-reduce, the sums.
            for name, p in zip(self._acc_names, self.split.parameters):
                g = self._grad_values[p + GRAD_SUFFIX][0]
                self._tensors[name][self._current].add_(g / self._accumulate)
                g.zero_()
            tensors = [flats[self._current] for flats in self._acc_flats] + [self._loss_tensor.reshape(-1)]
        else:
            tensors = self._buckets
        self._collective("all-reduce of the gradients",
                         lambda: [self.dist.all_reduce(t, async_op=True) for t in tensors])
        if self.reduce_mean:
            for t in tensors:
                t.div_(self.world)
        self.comm_bytes.append(sum(t.numel() * t.element_size() for t in tensors))
        if self.device == "cuda":  # onnxruntime's stream does not wait for PyTorch's
            self.torch.cuda.synchronize(self._tdevice)

    def _collective(self, what: str, launch) -> None:
        """Run `launch()` (which starts collectives and returns their works) and wait for them; a failure or a
        timeout becomes one line."""
        try:
            for work in launch():
                work.wait()
        except RuntimeError as e:
            raise DistributedError(f"rank {self.rank} of {self.world}: step {self.steps_done + 1}: the {what} "
                                   f"failed ({_first_line(e)}); another process stopped or hangs "
                                   f"(collective timeout {self.timeout:g} s)") from None
        if self.device == "cuda" and what.startswith("broadcast"):
            self.torch.cuda.synchronize(self._tdevice)

    # -- state ----------------------------------------------------------------------------------------------

    @property
    def state(self) -> dict[str, ort.OrtValue]:
        """The state this process holds (all of it without ZeRO-1), as the OrtValues the next step reads."""
        return {name: buffers[self._current] for name, buffers in self._buffers.items()}

    def parameters(self) -> dict[str, np.ndarray]:
        return {p: self._tensors[p][self._current].cpu().numpy().copy() for p in self.graph.parameters}

    def state_dict(self) -> dict[str, np.ndarray]:
        """A host copy of the whole state, in the step graph's order; gathered from the owners under ZeRO-1
        (collective)."""
        local = {name: self._tensors[name][self._current].cpu().numpy().copy() for name in self.held}
        if self._acc_names and self._micro:
            # between updates each process holds its own sums: the state is their average (their sum for a
            # summed loss), which any number of processes continues from
            summed = {name: self._tensors[name][self._current].clone() for name in self._acc_names}
            self._collective("all-reduce of the accumulated gradients",
                             lambda: [self.dist.all_reduce(t, async_op=True) for t in summed.values()])
            for name, t in summed.items():
                local[name] = (t / self.world if self.reduce_mean else t).cpu().numpy()
        if self.zero1 and self.world > 1:
            gathered = [None] * self.world
            try:
                self.dist.all_gather_object(gathered, local)
            except RuntimeError as e:
                raise DistributedError(f"rank {self.rank} of {self.world}: gathering the optimizer state failed "
                                       f"({_first_line(e)})") from None
            for part in gathered:
                local.update(part)
        return {name: local[name] for name in self.graph.state}

    def load_state_dict(self, values: dict[str, np.ndarray], source: str = "the state") -> None:
        names, expected = set(values), set(self.graph.state)
        if names != expected:
            odd = sorted(names ^ expected)[0]
            raise UsageError(f"{source}: {'has no value for' if odd in expected else 'has an unknown value'} "
                             f"{odd!r}")
        for name in self.held:
            current, value, want = self._tensors[name][self._current], values[name], self.graph.initial[name]
            if tuple(value.shape) != tuple(want.shape) or value.dtype != want.dtype:
                raise UsageError(f"{source}: {name!r} is {value.dtype}{list(value.shape)}, the step graph "
                                 f"wants {want.dtype}{list(want.shape)}")
            current.copy_(self._tensor(value))
        if self._acc_names:
            self._micro = int(values["micro_step"])
            if not self.reduce_mean and self.rank != 0:  # summed across processes later: rank 0 brings it
                for name in self._acc_names:
                    self._tensors[name][self._current].zero_()

    def count_from(self, steps_done: int) -> None:
        self.steps_done = steps_done

    def from_lead(self, read: Callable[[], T], what: str) -> T:
        """Rank 0 reads (a checkpoint: only its machine needs the file) and sends the result, or its usage
        error, to the others."""
        payload = [None]
        if self.rank == 0:
            try:
                payload = [("ok", read())]
            except OnnxgradError as e:
                payload = [("error", str(e))]
        if self.world > 1:
            try:
                self.dist.broadcast_object_list(payload, src=0)
            except RuntimeError as e:
                raise DistributedError(f"rank {self.rank} of {self.world}: receiving {what} from rank 0 "
                                       f"failed ({_first_line(e)})") from None
        if payload[0][0] == "error":
            raise UsageError(payload[0][1])
        return payload[0][1]

    def report(self, result: TrainResult) -> dict:
        """What the steps of `result` waited for and sent, for `onnxgrad train --report`: per step the seconds
        spent in collectives and the bytes this process all-reduced or broadcast, and the share of the step
        time the collectives took."""
        ran = len(self.comm_seconds) - len(result.losses)
        comm = self.comm_seconds[ran:]
        return {"world_size": self.world, "zero1": self.zero1, "allreduce_seconds": [round(s, 6) for s in comm],
                "allreduce_bytes": self.comm_bytes[ran:],
                "allreduce_share": round(sum(comm) / max(sum(result.step_seconds), 1e-12), 6)}


class DataParallelTrainer(StepGraphTrainer):
    """The training loop over this process's `DataParallelExecutor`: `fit` and `step` take the global batch and
    run this process's shard of it; losses are those of the global batch.

        trainer = DataParallelTrainer("step.onnx", zero1=True)  # under torchrun
        trainer.fit("data.npz", steps=100, batch=64)             # 64 rows a step over all processes
        trainer.close()

    `state_dict`, `save_checkpoint`, `load_checkpoint` and `fit` are collective: every process must call them."""

    def __init__(self, model: str | os.PathLike | onnx.ModelProto, *, provider: str = "auto",
                 threads: int | None = None, lr: float | None = None, zero1: bool = False,
                 bucket_mb: float = DEFAULT_BUCKET_MB, timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(DataParallelExecutor(model, provider=provider, threads=threads, zero1=zero1,
                                              bucket_mb=bucket_mb, timeout=timeout), lr=lr)


def _first_line(e: BaseException) -> str:
    """The gist of a backend's message: its first sentence, without the source location in brackets."""
    text = str(e).strip().splitlines()
    if not text:
        return type(e).__name__
    gist = re.sub(r"^\[[^\]]*\]\s*", "", text[0]).split(". ")[0]
    return gist[:300]
