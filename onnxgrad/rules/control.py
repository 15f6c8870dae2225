"""Gradient rules: control ops."""
from __future__ import annotations

from ..registry import rule  # noqa: F401
