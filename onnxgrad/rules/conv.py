"""Gradient rules: conv ops."""
from __future__ import annotations

from ..registry import rule
