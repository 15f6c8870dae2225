"""The stages that see protobuf: read the model, then bind and infer its shapes and make it a `Graph`; and the
lowering that rewrites forms the gradient rules do not take (recurrent ops, sequences, mask-less Dropout)."""
from __future__ import annotations

from .. import loader, registry
from ..fold import fold_to_fixed_point
from ..ir import from_model
from ..pipeline import Build, Pass
from ..unroll import lower_for_gradient
from ..gradient import reaching_heads


class Read(Pass):
    """Read and check the model, keep its large weights apart, and bring it to the supported opset."""

    name = "read"
    ensures = frozenset({"proto"})

    def run(self, build: Build) -> None:
        registry.all_rules()  # an unknown rule surfaces here, before the slow part
        proto, build.held, build.data_files = loader.read_apart(build.source)
        loader.check(proto)
        build.report["source_opset"] = loader.model_opset(proto)
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
        proto = loader.infer_shapes(proto)
        proto = fold_to_fixed_point(proto)  # exporters' little axes/shape subgraphs, until none is left
        build.graph = from_model(proto, build.held)
        build.proto = None
        build.report["forward_nodes"] = len(build.graph.nodes)


class Lower(Pass):
    """Rewrite the forms the rules do not take into plain ones, then find the values that reach the loss."""

    name = "lower"
    requires = frozenset({"graph", "heads"})
    ensures = frozenset({"lowered"})

    def run(self, build: Build) -> None:
        lower_for_gradient(build.graph, build.heads)
        build.reaches_loss = reaching_heads(build.graph, build.heads)
        build.report["forward_nodes"] = len(build.graph.nodes)
