"""The stages that see protobuf: read the model, then bind and infer its shapes and make it a `Graph`; and the
lowering that rewrites forms the gradient rules do not take (recurrent ops, sequences, mask-less Dropout)."""
from __future__ import annotations

import json

from .. import loader, registry
from ..contract import (FORWARD, GRAD_SUFFIX, LOSS_KEY, LOSS_SCALE_INPUT, OPTIMIZER_KEY, PHASES_KEY, PRECISION_KEY,
                        SEED_TIE)
from ..errors import UsageError
from ..fold import fold_to_fixed_point
from ..ir import from_model
from ..pipeline import Build, Pass
from ..lowering import lower_for_gradient
from ..gradient import reaching_heads
from .results import GradientResult, LossResult, ReadResult


class Read(Pass):
    """Read and check the model, keep its large weights apart, and bring it to the supported opset."""

    name = "read"
    ensures = frozenset({"proto"})

    def run(self, build: Build) -> None:
        registry.all_rules()  # an unknown rule surfaces here, before the slow part
        proto, build.held, build.data_files = loader.read_apart(build.source)
        loader.check(proto)
        build.record(ReadResult(loader.model_opset(proto)))
        build.proto = loader.upgrade_opset(proto)


class Infer(Pass):
    """Bind the shapes asked for, infer every value's type and shape, fold the small shape computations that
    exporters write, then build the Graph that the following passes share."""

    name = "infer"
    requires = frozenset({"proto"})
    ensures = frozenset({"graph", "typed"})

    def run(self, build: Build) -> None:
        proto, o = build.proto, build.options
        loader.bind_shapes(proto, o.input_shapes, o.dims)
        proto = loader.type_loop_carries(loader.infer_shapes(proto))
        proto = fold_to_fixed_point(proto)  # exporters' little axes/shape subgraphs, until none is left
        build.graph = from_model(proto, build.held)
        build.proto = None


class Lower(Pass):
    """Rewrite the forms the rules do not take into plain ones, then find the values that reach the loss."""

    name = "lower"
    requires = frozenset({"graph", "heads"})
    ensures = frozenset({"lowered"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph

    def run(self, build: Build) -> None:
        lower_for_gradient(build.graph, build.heads)
        build.reaches_loss = reaching_heads(build.graph, build.heads)


class Adopt(Pass):
    """Take up a training graph written by build-grad (its metadata names the loss, its phases tell forward from
    backward): the heads, parameters and gradient come from the file instead of from the passes that made
    them. A forward model passes through unchanged."""

    name = "adopt"
    requires = frozenset({"graph"})

    def wanted(self, build: Build) -> bool:
        return PHASES_KEY in build.graph.metadata

    def run(self, build: Build) -> None:
        graph, o = build.graph, build.options
        if not any(n.phase != FORWARD for n in graph.nodes):
            raise UsageError(f"the model's {PHASES_KEY} metadata does not match its nodes; rebuild it with "
                             f"onnxgrad build-grad")
        asked = [flag for flag, value in (("--loss-fn", o.loss_fn), ("--requires-grad", o.requires_grad),
                                          ("--also-grad", o.also_grad), ("--frozen", o.frozen),
                                          ("--optimizer", o.optimizer)) if value]
        if asked:
            raise UsageError(f"{asked[0]}: the model is already a training graph (written by onnxgrad build-grad); "
                             f"give the forward model instead")
        heads = [name for name in graph.metadata.get(LOSS_KEY, "").split(",") if name]
        outputs = {v.name: v for v in graph.outputs}
        if not heads or any(h not in outputs for h in heads):
            raise UsageError(f"the training graph's {LOSS_KEY} metadata does not name its loss outputs")
        build.heads = [outputs[h] for h in heads]
        # the seeds: a fed `<loss>_grad` input, or the constant 1 the gradient pass wrote as "seed/..."
        build.seeds = [v for v in graph.inputs if v.name in {h + GRAD_SUFFIX for h in heads}]
        build.seeds += [o for n in graph.nodes if n.phase != FORWARD and n.name.startswith("seed/")
                        and f"/{SEED_TIE}/" not in n.name for o in n.outputs]
        if LOSS_SCALE_INPUT in graph.values and PRECISION_KEY in graph.metadata:  # the seed of a scaled loss
            build.seeds.append(graph.values[LOSS_SCALE_INPUT])
        names = [v.name[:-len(GRAD_SUFFIX)] for v in graph.outputs if v.name.endswith(GRAD_SUFFIX)]
        if OPTIMIZER_KEY in graph.metadata:  # a step graph: its gradients are not outputs
            names = json.loads(graph.metadata[OPTIMIZER_KEY]).get("parameters", [])
        build.parameters = [graph.values[name] for name in names if name in graph.values]
        build.training_graph = True
        build.facts |= {"heads", "lowered", "gradient"}
        build.record(LossResult(tuple(h.name for h in build.heads)))
        build.record(GradientResult(tuple(x.name for x in build.parameters)))
