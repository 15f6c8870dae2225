"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activation, control, conv, elementwise, fused, indexing, linalg, loops, nn, nondiff, norm,  # noqa: F401
               reduction, resample, shape)
