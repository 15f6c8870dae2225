"""Gradient rules, one module per op family; importing this package registers them all."""
from . import (activation, attention, control, conv, elementwise, indexing, linalg, loops, nn, nondiff,  # noqa: F401
               norm, reduction, resample, shape)
