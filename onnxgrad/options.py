"""`Options`: what a build is asked to do, written once. `api.build` and `build_gradient` take one (or their
keywords, which are the same names), the command line parses its flags into one, and the passes read it.

This module imports neither onnx nor the passes, so `import onnxgrad` stays light."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property


@dataclass
class Options:
    """The options of a build.

    `loss`: the output to differentiate (or several); default the only scalar output. `requires_grad`: the
    initializers or graph inputs to differentiate with respect to (default: every floating-point initializer
    the loss depends on); `frozen`: initializers that get none; `also_grad`: intermediate values whose
    gradients are also output. `input_shapes`, `dims`: input shapes and symbolic dimensions to bind.
    `loop_bounds`: Loop node name -> the most iterations it runs, for loops with a condition and no trip count.
    `tie_copies`: read each parameter that holds the same values as an earlier one (or its transpose) as that
    one, so that the weight an exporter wrote twice is trained as one (`passes.gradient.parameter_copies`).
    `feed_head_grads`: give scalar losses a `<loss>_grad` input too (instead of the constant 1).

    `loss_fn` ('mse', 'l1', 'cross-entropy', 'bce-with-logits') first appends a loss comparing the output
    `target` with a new target input (`loss_options`: the keywords of `losses.append_loss`). `optimizer`
    ('sgd', 'momentum', 'adam', 'adamw') turns the result into a step graph (`optimizer_options`: lr, momentum,
    nesterov, betas, eps, weight_decay, clip_grad_norm, accumulate, keep_grads; see `optim.append_optimizer`).
    `mirror`: a recomputation policy ('mxnet', 'budget') with its `mirror_options` (`memory.budget.MirrorOptions`
    or its fields as a dict). `precision` ('fp32', 'fp16', 'bf16'): compute in half precision where PyTorch's
    autocast would; `loss_scale` ('dynamic', 'none'; default dynamic for fp16) and `loss_scale_options`
    (init_scale, growth_factor, backoff_factor, growth_interval): see `onnxgrad.precision`."""

    loss: str | list[str] | None = None
    requires_grad: list[str] | None = None
    frozen: list[str] | None = None
    also_grad: list[str] | None = None
    input_shapes: dict[str, list[int]] | None = None
    dims: dict[str, int] | None = None
    loop_bounds: dict[str, int] | None = None
    feed_head_grads: bool = False
    tie_copies: bool = False
    loss_fn: str | None = None
    target: str | None = None
    loss_options: dict | None = None
    optimizer: str | None = None
    optimizer_options: dict | None = None
    mirror: str | None = None
    mirror_options: object = None
    precision: str = "fp32"
    loss_scale: str | None = None
    loss_scale_options: dict | None = None

    def __post_init__(self) -> None:
        # None and an empty mapping mean the same: callers pass either
        for name in ("input_shapes", "dims", "loop_bounds", "loss_options", "optimizer_options"):
            setattr(self, name, dict(getattr(self, name) or {}))
        if self.mirror_options is None:
            self.mirror_options = {}

    @classmethod
    def of(cls, options: Options | None = None, **keywords) -> Options:
        """`options` with `keywords` (the field names) put in: the one place the API's keywords become
        Options."""
        unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(options or cls(), **keywords)

    @cached_property
    def precision_settings(self) -> dict:
        """The compute precision and the loss scaler (None: no loss scaling), as
        `precision.precision_settings` checks and completes them."""
        from .precision import precision_settings
        return precision_settings(self.precision, self.loss_scale, self.loss_scale_options)
