"""Running training graphs in onnxruntime with the settings their metadata asks for."""
from __future__ import annotations

import onnx
import onnxruntime as ort

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
    order = hints.get("onnxgrad.execution_order")
    if order:
        so.execution_order = getattr(ort.ExecutionOrder, order)
    disabled = [s for s in hints.get("onnxgrad.disabled_optimizers", "").split(",") if s]
    return so, {"disabled_optimizers": disabled} if disabled else {}


def session(model: onnx.ModelProto, provider: str = "cpu", threads: int | None = None) -> ort.InferenceSession:
    so, extra = session_options(model, threads)
    return ort.InferenceSession(model.SerializeToString(), so, providers=providers(provider), **extra)
