"""Errors that reach the user as one line on stderr, each class with its own exit code."""


class OnnxgradError(Exception):
    """Base class: the message is the whole story, shown without a traceback."""

    exit_code = 1


class UsageError(OnnxgradError):
    """The command line or API call asks for something that does not exist or cannot be done."""

    exit_code = 2


class InvalidModelError(OnnxgradError):
    """The input is not a valid ONNX model, or cannot be brought to a supported opset."""

    exit_code = 3


class UnsupportedError(OnnxgradError):
    """The model is valid, but needs an operator form onnxgrad has no gradient rule for."""

    exit_code = 4


class GradientCheckError(OnnxgradError):
    """`onnxgrad check`: a gradient of the training graph disagrees with finite differences."""

    exit_code = 6


class NonFiniteError(OnnxgradError):
    """`onnxgrad train`: the loss or a parameter became NaN or infinite, so training stopped."""

    exit_code = 8


class InternalError(OnnxgradError):
    """onnxgrad produced something wrong: a bug to report."""

    exit_code = 70
