"""The gradient-rule registry: one function per op, registered with the opset range it covers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

INF = 10**9


@dataclass(frozen=True)
class Rule:
    op_type: str
    since: int
    until: int
    fn: Callable
    wrt: tuple[int, ...] | None  # inputs the rule differentiates; None: every input
    limits: str                  # forms the rule refuses, for `onnxgrad ops`

    def differentiates(self, i: int) -> bool:
        return self.wrt is None or i in self.wrt


_RULES: dict[str, list[Rule]] = {}
_NON_DIFFERENTIABLE: dict[str, str] = {}


def rule(op_type: str, since: int = 1, until: int = INF, wrt: tuple[int, ...] | None = None, limits: str = ""):
    """Register `fn(ctx)` as the gradient of `op_type` for opsets since..until (inclusive)."""
    def register(fn):
        for other in _RULES.get(op_type, []):
            if not (until < other.since or since > other.until):
                raise ValueError(f"overlapping gradient rules for {op_type}")
        _RULES.setdefault(op_type, []).append(Rule(op_type, since, until, fn, wrt, limits))
        _RULES[op_type].sort(key=lambda r: r.since)
        return fn
    return register


def non_differentiable(*op_types: str, why: str = "output is not differentiable") -> None:
    """Ops whose outputs never carry a gradient (shapes, masks, indices)."""
    for op in op_types:
        _NON_DIFFERENTIABLE[op] = why


def lookup(op_type: str, opset: int, domain: str = "") -> Rule | None:
    if domain not in ("", "ai.onnx"):
        return None
    _load_rules()
    for r in _RULES.get(op_type, []):
        if r.since <= opset <= r.until:
            return r
    return None


def is_non_differentiable(op_type: str, domain: str = "") -> bool:
    _load_rules()
    return domain in ("", "ai.onnx") and op_type in _NON_DIFFERENTIABLE


def all_rules() -> list[Rule]:
    _load_rules()
    return [r for op in sorted(_RULES) for r in _RULES[op]]


def all_non_differentiable() -> dict[str, str]:
    _load_rules()
    return dict(sorted(_NON_DIFFERENTIABLE.items()))


_loaded = False


def _load_rules() -> None:
    """Import the rule modules once, on the first question asked of the registry."""
    global _loaded
    if not _loaded:
        _loaded = True
        from . import rules  # noqa: F401  (importing registers every rule)
