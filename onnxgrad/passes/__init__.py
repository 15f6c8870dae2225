"""The passes of the build, one module per stage, and their order: `training_pipeline()`.

    read -> infer -> [adopt] -> [heads] -> [lower] -> [precision] -> [gradient] -> [loss_scale] -> [half_sums]
         -> [mirror] -> [recompute_casts] -> schedule -> [optimizer] -> [widen_bf16] -> validate

The bracketed stages run when the build's options (or the input, for adopt) ask for them. `pipeline.run` runs
the list; each pass records its typed result (`passes.results`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..pipeline import Pass


def training_pipeline() -> list[Pass]:
    """The build of a training graph (or a step graph), in order. A training graph that build-grad wrote is
    taken up where it was left (`frontend.Adopt`): the heads, lowering and gradient stages then have nothing
    to do, and the later stages (mirror) run on it."""
    from . import expand, frontend, gradient, loss, mirror, optimizer, precision, schedule, validate
    return [
        frontend.Read(),
        frontend.Infer(),
        frontend.Adopt(),
        loss.Heads(),
        frontend.Lower(),
        precision.Precision(),
        gradient.Gradient(),
        precision.LossScale(),
        precision.HalfSums(),
        expand.ExpandLoss(),
        mirror.Mirror(),
        precision.RecomputeCasts(),
        schedule.Schedule(),
        optimizer.AppendOptimizer(),
        precision.WidenBfloat16(),
        validate.Validate(),
    ]
