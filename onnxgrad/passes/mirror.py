"""The mirror pass: recompute cheap forward values in the backward pass instead of keeping them.

A policy decides (`memory.mxnet`: MXNet's mirroring) and returns a `memory.plan.Plan`; `memory.plan.apply`
rewrites the graph to run it. The pass puts the simulated peak before and after into the plan, which the
written graph keeps in its metadata and the report shows.
"""
from __future__ import annotations

import json

from ..contract import MIRROR_KEY
from ..errors import UsageError
from ..memory import plan as plans
from ..memory.mxnet import MirrorFunction, mxnet_plan
from ..memory.simulate import simulate, sizes
from ..pipeline import Build, Pass
from ..shapes import type_everything

POLICIES = ("mxnet",)


class Mirror(Pass):
    name = "mirror"
    requires = frozenset({"gradient"})
    ensures = frozenset({"mirrored"})

    def wanted(self, build: Build) -> bool:
        return build.options.mirror is not None

    def run(self, build: Build) -> None:
        graph, o = build.graph, build.options
        if MIRROR_KEY in graph.metadata:
            raise UsageError("the training graph is mirrored already (metadata onnxgrad.mirror); give the graph "
                             "build-grad wrote without --mirror, or the forward model")
        if o.mirror not in POLICIES:
            raise UsageError(f"--policy {o.mirror}: expected one of {', '.join(POLICIES)}")
        type_everything(graph)
        name_every_node(graph, build.new_names())
        nbytes = sizes(graph, o.dims)
        before = simulate(graph, nbytes=nbytes)
        mirror = MirrorFunction(graph, set(o.mirror_options.get("save", ())),
                                set(o.mirror_options.get("recompute", ())))
        plan = mxnet_plan(graph, nbytes, mirror)
        plans.apply(graph, plan, build.new_names())
        after = simulate(graph, nbytes=sizes(graph, o.dims))
        plan.predicted = {"peak_bytes": after.peak, "unmirrored_peak_bytes": before.peak,
                          "saved_bytes": sum(b for _, b in after.saved),
                          "unmirrored_saved_bytes": sum(b for _, b in before.saved)}
        graph.metadata[MIRROR_KEY] = json.dumps(plan.record(), separators=(",", ":"))
        build.plan = plan
        build.report["mirror"] = {**plan.record(), "reasons": plan.reasons}


def name_every_node(graph, names) -> None:
    """A plan, --save and --recompute address nodes by name: give unnamed nodes, and all but the first of
    nodes that share a name, a name of their own."""
    seen: set[str] = set()
    for n in graph.nodes:
        if not n.name or n.name in seen:
            n.name = names.fresh(n.name or n.op_type)
        seen.add(n.name)
