"""`build_gradient`: a forward model in, a training graph out.

The stages are listed in one place, `pipeline.training_pipeline`; this module turns the keywords into
`pipeline.Options`, runs the passes and shapes the result. `import onnxgrad` loads this module; onnx and the
passes are imported when a build starts, so that the command line's `--version` and `--help` need neither.
"""
from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import UsageError

if TYPE_CHECKING:
    import onnx


def __getattr__(name: str):
    # GRAD_SUFFIX and RUNTIME_HINTS are part of the API; contract.py imports onnx
    if name in ("GRAD_SUFFIX", "RUNTIME_HINTS"):
        from . import contract
        return getattr(contract, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class BuildResult:
    model: onnx.ModelProto
    report: dict = field(default_factory=dict)
    # with build(weights_apart=True): the data of the model's stubs by name (weights.py), and the input's
    # external data files; io.save_model writes them
    weights: dict[str, onnx.TensorProto] = field(default_factory=dict)
    external_data: list = field(default_factory=list)


def build_gradient(model: str | os.PathLike | onnx.ModelProto, *, loss: str | None = None,
                   requires_grad: list[str] | None = None, frozen: list[str] | None = None,
                   also_grad: list[str] | None = None, input_shapes: dict[str, list[int]] | None = None,
                   dims: dict[str, int] | None = None, loss_fn: str | None = None, target: str | None = None,
                   loss_options: dict | None = None, optimizer: str | None = None,
                   optimizer_options: dict | None = None, precision: str = "fp32", loss_scale: str | None = None,
                   loss_scale_options: dict | None = None) -> onnx.ModelProto:
    """Return the training graph of `model`: its outputs, then `<param>_grad` per parameter, then
    `<value>_grad` per `also_grad` value. See `build` for the report as well.

    `loss_fn` ('mse', 'l1', 'cross-entropy', 'bce-with-logits') first appends a loss comparing the output
    `target` with a new target input (`loss_options`: the keywords of `losses.append_loss`). `optimizer`
    ('sgd', 'momentum', 'adam', 'adamw') turns the result into a step graph (`optimizer_options`: lr, momentum,
    nesterov, betas, eps, weight_decay, clip_grad_norm, accumulate, keep_grads; see `optim.append_optimizer`).
    `precision` ('fp32', 'fp16', 'bf16'): compute in half precision where PyTorch's autocast would, with float32
    parameters and optimizer state; `loss_scale` ('dynamic', 'none'; default dynamic for fp16) and
    `loss_scale_options` (init_scale, growth_factor, backoff_factor, growth_interval): see `onnxgrad.precision`."""
    return build(model, loss=loss, requires_grad=requires_grad, frozen=frozen, also_grad=also_grad,
                 input_shapes=input_shapes, dims=dims, loss_fn=loss_fn, target=target, loss_options=loss_options,
                 optimizer=optimizer, optimizer_options=optimizer_options, precision=precision,
                 loss_scale=loss_scale, loss_scale_options=loss_scale_options).model


def build(model, *, loss=None, requires_grad=None, frozen=None, also_grad=None, input_shapes=None,
          dims=None, feed_head_grads: bool = False, loss_fn=None, target=None, loss_options=None,
          optimizer=None, optimizer_options=None, weights_apart: bool = False, mirror: str | None = None,
          mirror_options: dict | None = None, loop_bounds: dict[str, int] | None = None, precision: str = "fp32",
          loss_scale: str | None = None, loss_scale_options: dict | None = None) -> BuildResult:
    """Like `build_gradient`, with a report. `feed_head_grads` gives scalar losses a `<loss>_grad` input
    too (instead of the constant 1), e.g. to scale the loss or to compute vector-Jacobian products.
    `weights_apart`: leave the large weights out of `model` (stubs, see weights.py) and in `weights`, for
    `io.save_model` to stream to disk without another copy in memory. `loop_bounds`: Loop node name -> the
    most iterations it runs, for loops with a condition and no trip count (the loop stops at the bound)."""
    # A build makes millions of small objects that live until it ends; the cyclic collector would scan
    # them over and over (a quarter of the time at 100k nodes) and find nothing to free.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _build(model, loss=loss, requires_grad=requires_grad, frozen=frozen, also_grad=also_grad,
                      input_shapes=input_shapes, dims=dims, feed_head_grads=feed_head_grads, loss_fn=loss_fn,
                      target=target, loss_options=loss_options or {}, optimizer=optimizer,
                      optimizer_options=optimizer_options or {}, weights_apart=weights_apart, mirror=mirror,
                      mirror_options=mirror_options, loop_bounds=loop_bounds, precision=precision,
                      loss_scale=loss_scale, loss_scale_options=loss_scale_options)
    finally:
        if was_enabled:
            gc.enable()


def _build(model, *, loss, requires_grad, frozen, also_grad, input_shapes, dims, feed_head_grads, loss_fn, target,
           loss_options, optimizer, optimizer_options, weights_apart=False, mirror=None,
           mirror_options=None, loop_bounds=None, precision="fp32", loss_scale=None,
           loss_scale_options=None) -> BuildResult:
    from . import pipeline, weights
    from .contract import BACKWARD, FORWARD, OPTIMIZER, RECOMPUTE
    from .precision import precision_settings

    started = time.perf_counter()
    _check_training_options(loss_fn, target, loss_options, optimizer, optimizer_options)
    options = pipeline.Options(loss=loss, requires_grad=requires_grad, frozen=frozen, also_grad=also_grad,
                               input_shapes=input_shapes or {}, dims=dims or {}, feed_head_grads=feed_head_grads,
                               loss_fn=loss_fn, target=target, loss_options=loss_options, optimizer=optimizer,
                               optimizer_options=optimizer_options, mirror=mirror,
                               mirror_options=mirror_options or {}, loop_bounds=loop_bounds or {},
                               precision=precision_settings(precision, loss_scale, loss_scale_options))
    passes = pipeline.training_pipeline()
    # a graph with nothing to differentiate is refused before the later stages (a mirror budget) report on it
    cut = next(k for k, p in enumerate(passes) if "gradient" in p.ensures) + 1
    build = pipeline.run(pipeline.Build(model, options), passes[:cut])
    seconds = build.report.pop("passes")
    if not build.parameters and not build.also:
        raise UsageError(f"nothing to differentiate: no floating-point initializer reaches the loss "
                         f"{build.heads[0].name!r} through differentiable ops (all frozen, or none); name graph "
                         f"inputs with --requires-grad")
    pipeline.run(build, passes[cut:])
    build.report["passes"] = {**seconds, **build.report["passes"]}
    graph, out = build.graph, build.proto
    report = {
        "loss": build.heads[0].name,
        "parameters": build.report["parameters"],
        "also_grad": build.report["also_grad"],
        "loss_fn": loss_fn,
        "optimizer": optimizer,
        "outputs": build.report["outputs"],
        "source_opset": build.report["source_opset"],
        "opset": build.report["opset"],
        "ir_version": build.report["ir_version"],
        # the written graph's nodes by phase, counted the same way for a forward model and a training graph
        "forward_nodes": sum(n.phase == FORWARD for n in graph.nodes),
        "recompute_nodes": sum(n.phase == RECOMPUTE for n in graph.nodes),
        "backward_nodes": sum(n.phase == BACKWARD for n in graph.nodes),
        "optimizer_nodes": sum(n.phase == OPTIMIZER for n in graph.nodes),
        "rules_used": build.report["rules_used"],
        **{k: build.report[k] for k in ("mirror", "loop_segments", "precision") if k in build.report},
        "passes": build.report["passes"],
        "seconds": round(time.perf_counter() - started, 4),
    }
    if "sweep" in build.report:
        from .memory.sweep import with_choice
        report["sweep"] = with_choice(build.report["sweep"], build.report.get("mirror"))
    if weights_apart:
        return BuildResult(out, report, weights=graph.initializers, external_data=build.data_files)
    weights.join(out, graph.initializers)
    return BuildResult(out, report)


def _check_training_options(loss_fn, target, loss_options, optimizer, optimizer_options) -> None:
    """Fail before the slow part: options without their --loss-fn / --optimizer, or optimizer values refused."""
    from . import optim
    from .passes.loss import LOSS_OPTIONS

    if loss_fn is None and (target is not None or loss_options):
        flag = "--target" if target is not None else "--" + next(iter(loss_options)).replace("_", "-")
        raise UsageError(f"{flag}: needs --loss-fn")
    unknown = sorted(set(loss_options) - LOSS_OPTIONS)
    if unknown:
        raise UsageError(f"loss option {unknown[0]!r}: expected one of {', '.join(sorted(LOSS_OPTIONS))}")
    if optimizer is None and optimizer_options:
        raise UsageError(f"--{next(iter(optimizer_options)).replace('_', '-')}: needs --optimizer")
    if optimizer is not None:
        optim.optimizer_settings(optimizer, optimizer_options)


