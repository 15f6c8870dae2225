"""onnxgrad: training graphs for stock onnxruntime, built from ONNX forward graphs."""
__version__ = "0.1.0"

from .api import BuildResult, build, build_gradient  # noqa: E402
from .errors import (InternalError, InvalidModelError, OnnxgradError,  # noqa: E402
                     UnsupportedError, UsageError)

__all__ = ["build_gradient", "build", "BuildResult", "OnnxgradError", "UsageError", "InvalidModelError",
           "UnsupportedError", "InternalError", "__version__"]
