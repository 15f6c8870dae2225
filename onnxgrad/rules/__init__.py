"""Gradient rules, one module per op family; importing this package registers them all."""
from . import activation, conv, elementwise, linalg, nn, nondiff, norm, reduction, shape  # noqa: F401
