"""Running training graphs in onnxruntime with the settings their metadata asks for."""
from __future__ import annotations

import json

import onnx
import onnxruntime as ort

from .contract import (ALLOCATOR_KEY, BUDGET_KEY, DISABLED_OPTIMIZERS_KEY, EXECUTION_ORDER_KEY, MEMORY_REUSE_KEY,
                       PRECISION_KEY)
from .errors import UsageError
from .memory.arena import SPLIT_ALWAYS

# glibc's malloc serves blocks above its mmap threshold with their own mapping and unmaps them on free, so the
# process's resident set follows the tensors alive. By default it raises that threshold after a large block is
# freed (up to 32 MiB), after which freed tensors stay in the heap and the resident set only grows: one
# ResNet-50 training step then held 1.4x the bytes ever alive at once. A fixed threshold turns that off.
MMAP_THRESHOLD = 64 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_malloc_fixed: bool | None = None


def follow_live_bytes() -> bool:
    """Fix glibc's mmap threshold for this process (once); False where the C library is not glibc."""
    global _malloc_fixed
    if _malloc_fixed is None:
        import ctypes
        import ctypes.util
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _malloc_fixed = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
        except (OSError, AttributeError):
            _malloc_fixed = False
    return _malloc_fixed


def providers(name: str = "auto") -> list[str]:
    """'cuda', 'cpu' or 'auto' (CUDA where onnxruntime can use it, else CPU)."""
    available = ort.get_available_providers()
    if name == "cpu":
        return ["CPUExecutionProvider"]
    if name == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise UsageError("--provider cuda: this onnxruntime has no CUDA provider")
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if name != "auto":
        raise UsageError(f"--provider {name}: expected cuda, cpu or auto")
    if "CUDAExecutionProvider" in available and _cuda_device_present():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def _cuda_device_present() -> bool:
    import ctypes.util
    return ctypes.util.find_library("cuda") is not None


def session_options(model: onnx.ModelProto, threads: int | None = None) -> tuple[ort.SessionOptions, dict]:
    """Options that make onnxruntime run the file's node order and keep recomputed copies apart."""
    hints = {p.key: p.value for p in model.metadata_props}
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    order = hints.get(EXECUTION_ORDER_KEY)
    if order:
        so.execution_order = getattr(ort.ExecutionOrder, order)
    if hints.get(MEMORY_REUSE_KEY) == "off":
        so.enable_mem_reuse = False
        # Memory patterns lay out a run's tensors in one block, planned from the first run; the arena keeps what
        # the first run took, so from the second run on the block comes on top of it: `onnxgrad train` on
        # ResNet-50's step graph held 1486 MiB with them and 762 without, at up to 5% more time a step
        # (BENCHMARKS.md).
        so.enable_mem_pattern = False
    if keeps_budget(model):
        # A graph that `mirror --budget` made to fit, memory patterns off as for every training graph. Made for
        # the live bytes (`--allocator exact`), its memory is what `memory.simulate` predicts when every tensor
        # is allocated when made and returned when freed: the CPU arena keeps freed blocks for later requests (a
        # ResNet-50 step held 1.14x the live bytes in it), so it is off too, and malloc gives memory back. That
        # costs time: every tensor's pages are mapped anew (the same step took 2.5-3.3x as long on the 2-core
        # machine of BENCHMARKS.md, 1.5-2.1x with huge pages: `hugepages`). A plan made for the arena
        # (`--allocator arena`) keeps it, splitting every chunk: the arena it needs fits the budget
        # (`memory.arena`).
        so.enable_mem_pattern = False
        if hints.get(ALLOCATOR_KEY) != "arena":
            so.enable_cpu_mem_arena = False
            follow_live_bytes()
        else:
            split_every_chunk(so)
    disabled = [s for s in hints.get(DISABLED_OPTIMIZERS_KEY, "").split(",") if s]
    return so, {"disabled_optimizers": disabled} if disabled else {}


def split_every_chunk(so: ort.SessionOptions) -> None:
    """Give the session a CPU arena that splits every free chunk down to the request (`memory.arena.SPLIT_ALWAYS`)
    where onnxruntime's default leaves a chunk whole when the rest is under 128 MiB and less than the request (a
    plan made by `mirror --allocator arena` fits both). BERT-base's 0.9x plan held 754 MiB of it, against 850 in the
    default arena, at the same step time (BENCHMARKS.md). The arena is registered with onnxruntime's environment,
    which hands it to the sessions made after that ask for it; one made earlier keeps the arena it was given."""
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    # no limit (0), kNextPowerOfTwo (0), the default first region (-1)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 0, -1, SPLIT_ALWAYS))
    so.add_session_config_entry("session.use_env_allocators", "1")


def keeps_budget(model: onnx.ModelProto) -> bool:
    """Whether the graph records a memory budget its runs must fit (`mirror --budget`)."""
    return any(p.key == BUDGET_KEY and p.value.isdigit() for p in model.metadata_props)


def provider_options(model: onnx.ModelProto, names: list[str]) -> list:
    """The providers with the options a graph written here needs. A graph that records a memory budget
    (`mirror --budget`) gets it as CUDA's arena limit, so a run above it fails instead of spilling over, and the
    arena grows by doubling regions, each cut to what the limit leaves: onnxruntime's BFC arena then needs the
    least memory beyond the live bytes, and `memory.arena` emulates it best (kSameAsRequested, a region per
    request, needed up to 1.56x the live bytes on ResNet-50 and was emulated 12% low on GPT-2: BENCHMARKS.md).
    Without a budget the arena grows by what each request asks, since doubling without a limit can reserve up
    to twice the peak."""
    hints = {p.key: p.value for p in model.metadata_props}
    if hints.get(MEMORY_REUSE_KEY) != "off":
        return list(names)
    out = []
    for name in names:
        if name == "CUDAExecutionProvider":
            options = {"arena_extend_strategy": "kSameAsRequested"}
            if hints.get(BUDGET_KEY, "").isdigit():
                options = {"arena_extend_strategy": "kNextPowerOfTwo", "gpu_mem_limit": hints[BUDGET_KEY]}
            out.append((name, options))
        else:
            out.append(name)
    return out


def least_ir_version(model: onnx.ModelProto) -> int:
    """The lowest IR version the model's opsets allow (they decide what it may contain; local functions need
    IR 8): what every onnxruntime that runs those opsets accepts."""
    least = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    return max(least, 8) if len(model.functions) else least


def model_bytes(model: onnx.ModelProto) -> bytes:
    """The model as every onnxruntime session here takes it: serialized at `least_ir_version` when its own IR
    version is higher (onnx 1.23's make_model writes IR 14, which onnxruntime 1.31 refuses). The caller's model
    is left as it is."""
    least = least_ir_version(model)
    if model.ir_version <= least:
        return model.SerializeToString()
    own = model.ir_version
    model.ir_version = least  # set for the serialization only: no copy of the weights
    try:
        return model.SerializeToString()
    finally:
        model.ir_version = own


def refuse_half_precision_on_cpu(model: onnx.ModelProto) -> None:
    """A graph build-grad wrote with --precision fp16 or bf16 needs the CUDA provider: the CPU provider lacks
    half-precision kernels for some of the ops it holds (in onnxruntime 1.31: bfloat16 MatMul, Gemm, Add and Mul,
    float16 ScatterElements with add), and what it has is no guide to the CUDA numbers or speed."""
    settings = next((p.value for p in model.metadata_props if p.key == PRECISION_KEY), None)
    precision = json.loads(settings).get("precision") if settings else None
    if precision in ("fp16", "bf16"):
        raise UsageError(f"the graph computes in {precision} (build-grad --precision {precision}), and "
                         f"onnxruntime's CPU provider lacks {precision} kernels for some of its ops; run it on the "
                         f"CUDA provider (--provider cuda), or build it with --precision fp32")


def session(model: onnx.ModelProto, provider: str = "cpu", threads: int | None = None) -> ort.InferenceSession:
    if "CUDAExecutionProvider" not in providers(provider):
        refuse_half_precision_on_cpu(model)
    so, extra = session_options(model, threads)
    return ort.InferenceSession(model_bytes(model), so, providers=provider_options(model, providers(provider)),
                                **extra)


def training_session(model: onnx.ModelProto, provider: str = "auto", threads: int | None = None,
                     profile_prefix: str | None = None, configure=None) -> tuple[ort.InferenceSession, str]:
    """A session for a step graph and the device ('cuda' or 'cpu') its state must live on. onnxruntime falls
    back to the CPU when the CUDA provider cannot start; an explicit `cuda` makes that an error instead.
    `configure(so)` may change the session options last (benchmarks try other settings with it)."""
    so, extra = session_options(model, threads)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if configure is not None:
        configure(so)
    wanted = providers(provider)
    if "CUDAExecutionProvider" in wanted:
        # A CUDA provider that cannot start logs screenfuls before onnxruntime falls back to the CPU; the
        # error below says why in one line. 2 (warnings) is onnxruntime's default level.
        ort.set_default_logger_severity(4)
    try:
        sess = ort.InferenceSession(model_bytes(model), so, providers=provider_options(model, wanted), **extra)
    finally:
        ort.set_default_logger_severity(2)
    on_cuda = "CUDAExecutionProvider" in sess.get_providers()
    if provider == "cuda" and not on_cuda:
        raise UsageError(f"--provider cuda: onnxruntime could not start its CUDA provider "
                         f"({_cuda_failure()}); use --provider cpu")
    if not on_cuda:
        refuse_half_precision_on_cpu(model)
    return sess, "cuda" if on_cuda else "cpu"


def _cuda_failure() -> str:
    """Why the CUDA provider library does not load, e.g. a missing libcublasLt.so.13, or a missing GPU."""
    import ctypes
    from pathlib import Path
    library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if not library.exists():
        return "this onnxruntime has no CUDA provider library"
    try:
        ctypes.CDLL(str(library))
    except OSError as e:
        return str(e)
    return "no usable CUDA device"
