"""The build as one list of passes over one typed `Graph`.

    read -> infer -> [loss] -> lower -> [precision] -> gradient -> [loss_scale] -> [mirror] -> schedule
         -> [optimizer] -> validate

`read` and `infer` are the only stages that see protobuf (onnx's checker, version converter and shape inference
work on protos); from `infer` on, every pass edits the same `ir.Graph`, and `validate` writes it back once.
Each pass declares the facts it needs (`requires`) and the facts it makes true (`ensures`); `run` checks them, so
a pass put in the wrong place fails at once with the missing fact's name instead of producing a wrong graph.
Optional passes (the bracketed ones) say whether the build's options ask for them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import onnx

from .builder import Names
from .errors import InternalError
from .ir import Graph, Value


@dataclass
class Options:
    """What a build is asked to do (the keywords of `api.build`)."""

    loss: str | list[str] | None = None
    requires_grad: list[str] | None = None
    frozen: list[str] | None = None
    also_grad: list[str] | None = None
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    dims: dict[str, int] = field(default_factory=dict)
    loop_bounds: dict[str, int] = field(default_factory=dict)  # Loop node name -> most iterations
    feed_head_grads: bool = False
    loss_fn: str | None = None
    target: str | None = None
    loss_options: dict = field(default_factory=dict)
    optimizer: str | None = None
    optimizer_options: dict = field(default_factory=dict)
    mirror: str | None = None                    # a recomputation policy ("mxnet") or None
    mirror_options: dict = field(default_factory=dict)
    # precision.precision_settings: the compute precision and the loss scaler (None: no loss scaling)
    precision: dict = field(default_factory=lambda: {"precision": "fp32", "loss_scale": None})


@dataclass
class Build:
    """The state the passes share: the model (a proto until `infer` makes it a Graph), what the passes
    decided, and the report."""

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
    report: dict = field(default_factory=dict)
    facts: set[str] = field(default_factory=set)

    def new_names(self) -> Names:
        """The run's name authority, made once the graph exists."""
        if self.names is None:
            self.names = Names([*self.graph.values, *(n.name for n in self.graph.nodes)])
        return self.names


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
    """Run the wanted passes in order, checking each one's requirements; the seconds of each go into the
    report under "passes"."""
    seconds: dict[str, float] = {}
    for p in passes:
        if not p.wanted(build):
            continue
        missing = sorted(p.requires - build.facts)
        if missing:
            raise InternalError(f"the {p.name} pass needs {', '.join(missing)}, which no earlier pass ensures")
        started = time.perf_counter()
        p.run(build)
        seconds[p.name] = round(time.perf_counter() - started, 4)
        build.facts |= p.ensures
    build.report["passes"] = seconds
    return build


def training_pipeline() -> list[Pass]:
    """The build of a training graph (or a step graph), in order. A training graph that build-grad wrote is
    taken up where it was left (`frontend.Adopt`): the loss, lowering and gradient stages then have nothing
    to do, and the later stages (mirror) run on it."""
    from .passes import frontend, gradient, loss, mirror, optimizer, precision, schedule, validate
    return [
        frontend.Read(),
        frontend.Infer(),
        frontend.Adopt(),
        loss.Heads(),
        frontend.Lower(),
        precision.Precision(),
        gradient.Gradient(),
        precision.LossScale(),
        mirror.Mirror(),
        schedule.Schedule(),
        optimizer.AppendOptimizer(),
        precision.WidenBfloat16(),
        validate.Validate(),
    ]
