"""The optimizer pass: append the update of every parameter, so one run of the graph is one training step."""
from __future__ import annotations

from .. import optim
from ..pipeline import Build, Pass


class AppendOptimizer(Pass):
    name = "optimizer"
    requires = frozenset({"gradient", "scheduled"})
    ensures = frozenset({"optimizer"})

    def wanted(self, build: Build) -> bool:
        return build.options.optimizer is not None

    def run(self, build: Build) -> None:
        settings = optim.optimizer_settings(build.options.optimizer, build.options.optimizer_options)
        optim.add_optimizer(build.graph, build.new_names(), settings, [x.name for x in build.parameters],
                            scaler=build.options.precision_settings["loss_scale"])
