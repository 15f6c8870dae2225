"""The last pass: write the Graph as a proto once, type every value onnx's shape inference can type (strict
mode: a type error in what the passes built fails here, with its reason), and run the checker."""
from __future__ import annotations

from onnx import helper, shape_inference

from .. import weights
from ..errors import InternalError
from ..contract import BACKWARD, FORWARD, OPTIMIZER, RECOMPUTE
from ..pipeline import Build, Pass
from ..shapes import read_types
from ..version import __version__
from .results import NodeCounts, ValidateResult


class Validate(Pass):
    name = "validate"
    requires = frozenset({"gradient", "scheduled"})
    ensures = frozenset({"validated"})

    def run(self, build: Build) -> None:
        graph = build.graph
        out = graph.to_model(weights_apart=True)
        out.ir_version = helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
        out.producer_name, out.producer_version = "onnxgrad", __version__
        try:
            out = shape_inference.infer_shapes(out, check_type=True, strict_mode=True)
            weights.check_model(out)
        except Exception as e:
            raise InternalError(f"the training graph fails the ONNX checker: {str(e).splitlines()[0]}") from None
        untyped = {v.name: v for n in graph.nodes for v in n.outputs if v.name and not v.is_typed}
        if untyped:
            read_types(out, untyped)
        build.proto = out
        phases = [n.phase for n in graph.nodes]
        nodes = NodeCounts(*(phases.count(phase) for phase in (FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER)))
        build.record(ValidateResult(tuple(o.name for o in out.graph.output), graph.opset, out.ir_version, nodes))
