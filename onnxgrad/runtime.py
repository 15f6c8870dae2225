"""Running training graphs in onnxruntime with the settings their metadata asks for."""
from __future__ import annotations

import onnx
import onnxruntime as ort

from .contract import DISABLED_OPTIMIZERS_KEY, EXECUTION_ORDER_KEY, MEMORY_REUSE_KEY
from .errors import UsageError


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
    disabled = [s for s in hints.get(DISABLED_OPTIMIZERS_KEY, "").split(",") if s]
    return so, {"disabled_optimizers": disabled} if disabled else {}


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


def session(model: onnx.ModelProto, provider: str = "cpu", threads: int | None = None) -> ort.InferenceSession:
    so, extra = session_options(model, threads)
    return ort.InferenceSession(model_bytes(model), so, providers=providers(provider), **extra)


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
        sess = ort.InferenceSession(model_bytes(model), so, providers=wanted, **extra)
    finally:
        ort.set_default_logger_severity(2)
    on_cuda = "CUDAExecutionProvider" in sess.get_providers()
    if provider == "cuda" and not on_cuda:
        raise UsageError(f"--provider cuda: onnxruntime could not start its CUDA provider "
                         f"({_cuda_failure()}); use --provider cpu")
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
