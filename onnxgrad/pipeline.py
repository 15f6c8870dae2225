"""The pass infrastructure: a `Pass`, the `Build` the passes share, and `run`, which runs a list of passes over
one build. It knows no concrete pass: the list of the training build is `passes.training_pipeline()`.

`read` and `infer` are the only stages that see protobuf (onnx's checker, version converter and shape inference
work on protos); from `infer` on, every pass edits the same `ir.Graph`, and `validate` writes it back once.
Each pass declares the facts it needs (`requires`) and the facts it makes true (`ensures`); `run` checks them, so
a pass put in the wrong place fails at once with the missing fact's name instead of producing a wrong graph.
Optional passes say in `wanted` whether the build's options ask for them. A pass records what it did as a
small typed result (`Build.record`); the report is rendered from those results.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TypeVar

import onnx

from .builder import Names
from .errors import InternalError
from .ir import Graph, Value
from .options import Options

__all__ = ["Build", "Options", "Pass", "run"]

R = TypeVar("R")


@dataclass
class Build:
    """The state the passes share: the model (a proto until `infer` makes it a Graph), what the passes
    decided, their results and their seconds."""

    source: object                               # a path or a ModelProto, as given
    options: Options
    proto: onnx.ModelProto | None = None
    held: dict = field(default_factory=dict)     # the data of the skeleton's stubs (weights.py)
    data_files: list = field(default_factory=list)
    graph: Graph | None = None
    names: Names | None = None
    heads: list[Value] = field(default_factory=list)
    parameters: list[Value] = field(default_factory=list)
    also: list[Value] = field(default_factory=list)
    reaches_loss: set[int] = field(default_factory=set)
    seeds: list[Value] = field(default_factory=list)   # the gradients the backward starts from (1, or fed inputs)
    training_graph: bool = False                 # the input was written by build-grad (phases in its metadata)
    plan: object = None                          # the recomputation plan the mirror pass applied
    results: dict[type, object] = field(default_factory=dict)  # result type -> the result a pass recorded
    seconds: dict[str, float] = field(default_factory=dict)    # pass name -> its seconds, in running order
    facts: set[str] = field(default_factory=set)

    def new_names(self) -> Names:
        """The run's name authority, made once the graph exists."""
        if self.names is None:
            self.names = Names([*self.graph.values, *(n.name for n in self.graph.nodes)])
        return self.names

    def record(self, result: object) -> None:
        """Keep a pass's result, one per result type (a later pass of the same kind replaces it)."""
        self.results[type(result)] = result

    def result(self, kind: type[R]) -> R | None:
        """The result of that type a pass recorded, or None when no pass did."""
        return self.results.get(kind)


class Pass:
    """One stage of the build. `run` edits `build` in place."""

    name = "pass"
    requires: frozenset[str] = frozenset()
    ensures: frozenset[str] = frozenset()

    def wanted(self, build: Build) -> bool:
        """Whether this build needs the stage (always, for the stages that are not optional)."""
        return True

    def run(self, build: Build) -> None:
        raise NotImplementedError


def run(build: Build, passes: list[Pass]) -> Build:
    """Run the wanted passes in order, checking each one's requirements; the seconds of each go into
    `build.seconds`."""
    for p in passes:
        if not p.wanted(build):
            continue
        missing = sorted(p.requires - build.facts)
        if missing:
            raise InternalError(f"the {p.name} pass needs {', '.join(missing)}, which no earlier pass ensures")
        started = time.perf_counter()
        p.run(build)
        build.seconds[p.name] = round(time.perf_counter() - started, 4)
        build.facts |= p.ensures
    return build
