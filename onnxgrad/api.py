"""`build_gradient` and `build`: a forward model in, a training graph out; `load_graph`: a model as a typed
graph, for the memory simulator.

The stages are listed in one place, `passes.training_pipeline`; this module takes the options (an `Options`, or
its fields as keywords), runs the passes and hands out their typed results, from which the report is rendered.
`import onnxgrad` loads this module; onnx and the passes are imported when a build starts, so that the command
line's `--version` and `--help` need neither.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from .errors import UsageError
from .options import Options

if TYPE_CHECKING:
    import onnx

    from .ir import Graph
    from .passes.results import (GradientResult, LossResult, MirrorResult, PrecisionResult, ReadResult,
                                 ValidateResult, WidenResult)


def __getattr__(name: str):
    # GRAD_SUFFIX and RUNTIME_HINTS are part of the API; contract.py imports onnx
    if name in ("GRAD_SUFFIX", "RUNTIME_HINTS"):
        from . import contract
        return getattr(contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class BuildResult:
    """The training graph and what each pass recorded: `loss` (the heads), `gradient` (parameters, rules
    used, loop segments), `written` (outputs, opset, nodes by phase), and, when they ran, `precision`,
    `widened`, `mirror`; `passes`: the seconds of each pass. `report` renders them as the --report JSON."""

    model: onnx.ModelProto
    options: Options
    read: ReadResult
    loss: LossResult
    gradient: GradientResult
    written: ValidateResult
    precision: PrecisionResult | None = None
    widened: WidenResult | None = None
    mirror: MirrorResult | None = None
    passes: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    # with build(weights_apart=True): the data of the model's stubs by name (weights.py), and the input's
    # external data files; io.save_model writes them
    weights: dict[str, onnx.TensorProto] = field(default_factory=dict)
    external_data: list = field(default_factory=list)

    @cached_property
    def report(self) -> dict:
        """The build's report (README, "The report"): the one place its keys are spelled."""
        nodes = self.written.nodes
        report = {
            "loss": self.loss.loss,
            "parameters": list(self.gradient.parameters),
            "scalar_constants": list(self.gradient.scalar_constants),
            "parameter_copies": [list(c) for c in self.gradient.parameter_copies],
            "also_grad": list(self.gradient.also_grad),
            "loss_fn": self.options.loss_fn,
            "optimizer": self.options.optimizer,
            "outputs": list(self.written.outputs),
            "source_opset": self.read.source_opset,
            "opset": self.written.opset,
            "ir_version": self.written.ir_version,
            "forward_nodes": nodes.forward,
            "recompute_nodes": nodes.recompute,
            "backward_nodes": nodes.backward,
            "optimizer_nodes": nodes.optimizer,
            "rules_used": self.gradient.rules_used,
        }
        if self.mirror is not None:
            plan = self.mirror.plan
            report["mirror"] = {**plan.record(), "reasons": plan.reasons, **self.mirror.timings}
        if self.gradient.loop_segments is not None:
            report["loop_segments"] = self.gradient.loop_segments
        if self.gradient.loop_schemes:
            report["loop_schemes"] = {name: s.record() for name, s in self.gradient.loop_schemes.items()}
        if self.precision is not None or self.widened is not None:
            report["precision"] = {}
            if self.precision is not None:
                p = self.precision
                report["precision"].update({"precision": p.precision, "loss_scale": p.loss_scale,
                                            "half_nodes": p.half_nodes, "casts": p.casts})
            if self.widened is not None:
                report["precision"]["widened_inputs"] = self.widened.widened_inputs
        report["passes"] = self.passes
        report["seconds"] = self.seconds
        if self.mirror is not None and self.mirror.sweep is not None:
            s = self.mirror.sweep
            report["sweep"] = {"rows": s.rows, "table": s.table, "budget_bytes": s.budget_bytes}
        return report


def build_gradient(model: str | os.PathLike | onnx.ModelProto, options: Options | None = None,
                   **keywords) -> onnx.ModelProto:
    """Return the training graph of `model`: its outputs, then `<param>_grad` per parameter, then
    `<value>_grad` per `also_grad` value. `options`: an `Options`; `keywords`: its fields (loss, requires_grad,
    loss_fn, optimizer, precision, ...), which replace those of `options`. See `build` for the report too."""
    return build(model, options, **keywords).model


def build(model: str | os.PathLike | onnx.ModelProto, options: Options | None = None, *,
          weights_apart: bool = False, **keywords) -> BuildResult:
    """Like `build_gradient`, with the passes' results and the report. `weights_apart`: leave the large weights
    out of `model` (stubs, see weights.py) and in `weights`, for `io.save_model` to stream to disk without
    another copy in memory."""
    options = Options.of(options, **keywords)
    # A build makes millions of small objects that live until it ends; the cyclic collector would scan
    # them over and over (a quarter of the time at 100k nodes) and find nothing to free.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(model, options, weights_apart)
    finally:
        if was_enabled:
            gc.enable()


def _build(model, options: Options, weights_apart: bool) -> BuildResult:
    from . import pipeline, weights
    from .passes import results, training_pipeline

    started = time.perf_counter()
    check_options(options)
    passes = training_pipeline()
    # a graph with nothing to differentiate is refused before the later stages (a mirror budget) report on it
    cut = next(k for k, p in enumerate(passes) if "gradient" in p.ensures) + 1
    build = pipeline.run(pipeline.Build(model, options), passes[:cut])
    if not build.parameters and not build.also:
        raise UsageError(f"nothing to differentiate: no floating-point initializer reaches the loss "
                         f"{build.heads[0].name!r} through differentiable ops (all frozen, or none); name graph "
                         f"inputs with --requires-grad")
    try:
        pipeline.run(build, passes[cut:])
    except UsageError as e:
        build = _retry_loop_schemes(model, options, build, e)
    result = BuildResult(
        build.proto, options, read=build.result(results.ReadResult), loss=build.result(results.LossResult),
        gradient=build.result(results.GradientResult), written=build.result(results.ValidateResult),
        precision=build.result(results.PrecisionResult), widened=build.result(results.WidenResult),
        mirror=build.result(results.MirrorResult), passes=build.seconds,
        seconds=round(time.perf_counter() - started, 4))
    if weights_apart:
        result.weights, result.external_data = build.graph.initializers, build.data_files
    else:
        weights.join(result.model, build.graph.initializers)
    return result


def _retry_loop_schemes(model, options: Options, build, error: UsageError):
    """`mirror --budget` on a graph whose loops can run as segments: the gradient pass left them unsegmented (the
    least recomputation) and the budget did not fit, so the build is run again from the model with one loop a
    level of segments further each time (segments.next_schemes: √T segments, then nested levels, one more forward
    pass of the loop per level), until the budget policy's plan fits. The fraction of a "0.4x" budget stays that of
    the unsegmented graph's peak. No loop to segment, or no level left: the last error, naming the schemes tried."""
    import dataclasses

    from . import pipeline
    from .memory.budget import BudgetError, MirrorOptions
    from .passes import results, training_pipeline
    from .segments import next_schemes

    schemes = build.result(results.GradientResult).loop_schemes
    mirror_options = MirrorOptions.of(options.mirror_options)
    if not isinstance(error, BudgetError) or not schemes or mirror_options.loops is not None:
        raise error
    reference = error.report.unmirrored_peak_bytes
    tried = [schemes]
    while (schemes := next_schemes(schemes)) is not None:
        tried.append(schemes)
        retry = dataclasses.replace(mirror_options, fraction_of=reference,
                                    loops={name: s.lengths for name, s in schemes.items()})
        try:
            return pipeline.run(pipeline.Build(model, Options.of(options, mirror_options=retry)), training_pipeline())
        except BudgetError as e:
            error = e
    names = sorted(tried[0])
    ways = "; ".join(", ".join(f"{name} {t[name].describe()}" for name in names) for t in tried)
    raise BudgetError(f"{error} (loops tried: {ways})", error.report) from None


def check_options(options: Options) -> None:
    """Fail before the slow part: options without their --loss-fn / --optimizer, optimizer values refused, or
    precision settings refused."""
    from . import optim
    from .passes.loss import LOSS_OPTIONS

    o = options
    if o.loss_fn is None and (o.target is not None or o.loss_options):
        flag = "--target" if o.target is not None else "--" + next(iter(o.loss_options)).replace("_", "-")
        raise UsageError(f"{flag}: needs --loss-fn")
    unknown = sorted(set(o.loss_options) - LOSS_OPTIONS)
    if unknown:
        raise UsageError(f"loss option {unknown[0]!r}: expected one of {', '.join(sorted(LOSS_OPTIONS))}")
    if o.optimizer is None and o.optimizer_options:
        raise UsageError(f"--{next(iter(o.optimizer_options)).replace('_', '-')}: needs --optimizer")
    if o.optimizer is not None:
        optim.optimizer_settings(o.optimizer, o.optimizer_options)
    o.precision_settings  # noqa: B018 (parsed once, and refused here rather than after the slow part)


def load_graph(model: str | os.PathLike | onnx.ModelProto, dims: dict[str, int] | None = None) -> Graph:
    """A model from a path (or a ModelProto) as a typed Graph with its symbolic dims bound, for the memory
    simulator (`memory.simulate`): the read and infer stages of the build, then onnx's shape inference for
    anything still untyped."""
    from . import pipeline
    from .passes.frontend import Infer, Read
    from .shapes import type_everything

    build = pipeline.run(pipeline.Build(model, Options(dims=dict(dims or {}))), [Read(), Infer()])
    type_everything(build.graph)
    return build.graph
