"""onnxgrad: training graphs for stock onnxruntime, built from ONNX forward graphs."""
from .version import __version__

from .api import BuildResult, build, build_gradient, load_graph  # noqa: E402
from .errors import (InternalError, InvalidModelError, OnnxgradError,  # noqa: E402
                     UnsupportedError, UsageError)
from .options import Options  # noqa: E402

__all__ = ["build_gradient", "build", "BuildResult", "Options", "load_graph", "OnnxgradError", "UsageError",
           "InvalidModelError", "UnsupportedError", "InternalError", "__version__"]
