"""Gradient rules: linalg ops."""
from __future__ import annotations

from ..registry import rule
