"""Indexing and Einsum cases: every attribute form, negative axes and indices, repeated indices for the
adding scatters, and both sides of opset 16 (where ScatterElements and ScatterND learned reduction="add").

Beyond tests/gradcheck.py: it makes every array input an initializer (a constant to the rules) of the case's
float type, and every shape static. Rules take other paths for indices known only at run time and for symbolic
dims, and some inputs have a fixed float type (Resize's scales). `EditedCase` carries edits of the built
single-op model, after which shapes are inferred again; `_model` is wrapped below, for the test process only,
to apply them. `at_run_time(i)` reads input i through an Identity node, so no rule sees it as a constant;
`symbolic({i: {axis: name}})` declares dims of graph inputs symbolic (the data fed keeps the case's sizes). Only
the checker's own calls apply the edits.
Repeated GatherElements/GatherND indices at opsets 13-15 take the one-hot paths either way.
"""
import dataclasses
import sys
from typing import Callable

import numpy as np
import onnx
from onnx import helper

import gradcheck
from gradcheck import Case, distinct


def i64(values):
    return np.array(values, dtype=np.int64)


@dataclasses.dataclass
class EditedCase(Case):
    edits: tuple = ()  # each edit(model) changes the single-op model built by gradcheck


def edited(case: Case, *edits: Callable) -> EditedCase:
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(Case)}
    return EditedCase(**fields, edits=tuple(getattr(case, "edits", ())) + edits)


def at_run_time(*inputs: int) -> Callable:
    """An edit: the op reads these inputs through an Identity node instead of straight from the initializer."""
    def edit(model):
        graph = model.graph
        op = graph.node[-1]
        for i in inputs:
            name = op.input[i]
            op.input[i] = f"{name}_at_run_time"
            graph.node.insert(0, helper.make_node("Identity", [name], [op.input[i]], name=f"read_{name}"))
    return edit


def symbolic(dims: dict) -> Callable:
    """An edit: {input index: {axis: symbol}} makes those dims of the op's graph inputs symbolic."""
    def edit(model):
        by_name = {vi.name: vi for vi in model.graph.input}
        for i, axes in dims.items():
            shape = by_name[model.graph.node[-1].input[i]].type.tensor_type.shape
            for axis, name in axes.items():
                shape.dim[axis].Clear()
                shape.dim[axis].dim_param = name
    return edit


def runtime(case: Case, *inputs: int) -> EditedCase:
    return edited(case, at_run_time(*inputs))


def _model_with_edits(original):
    """gradcheck._model, applying a case's edits when the checker itself calls it.

    Other users of the function (tests/test_gradient_first.py takes node 0 for the forward op and sizes nodes
    by their static shapes) see the case as written: constant inputs, static dims.
    """
    def build(case, dtype):
        model, wrt = original(case, dtype)
        if not getattr(case, "edits", ()) or sys._getframe(1).f_code is not gradcheck.check_case.__code__:
            return model, wrt
        for edit in case.edits:
            edit(model)
        del model.graph.value_info[:]
        for out in model.graph.output:  # inferred again from the edited inputs
            out.type.tensor_type.ClearField("shape")
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True), wrt
    build.applies_edits = True
    return build


if not getattr(gradcheck._model, "applies_edits", False):
    gradcheck._model = _model_with_edits(gradcheck._model)


def einsum(id, equation, *shapes, opset=18, **kw):
    return Case("Einsum", list(shapes), {"equation": equation}, id=f"Einsum-{id}", opset=opset, **kw)


def case(op, id, inputs, opset=18, **attrs):
    return Case(op, inputs, attrs, id=f"{op}-{id}", opset=opset)


X34 = (3, 4)
DUP0 = i64([[0, 2, 0, 1], [2, 2, 0, 1]])        # along axis 0 of a (3, 4): repeats in every column but one
NEG1 = i64([[-1, 0, -1], [1, -4, 3], [2, 2, -2]])  # along axis 1 of a (3, 4), negative and repeated

CASES = [
    # Einsum: contractions, transposes, sums, outer products, ellipsis, diagonals, implicit outputs
    einsum("matmul", "ij,jk->ik", (2, 3), (3, 4)),
    einsum("batched-matmul", "bij,bjk->bik", (2, 2, 3), (2, 3, 2)),
    einsum("attention-scores", "bhqd,bhkd->bhqk", (1, 2, 3, 2), (1, 2, 4, 2)),
    einsum("attention-values", "bhqk,bhkd->bqhd", (1, 2, 3, 4), (1, 2, 4, 2)),
    einsum("transpose", "ij->ji", (2, 3)),
    einsum("row-sum", "ij->i", (2, 3)),
    einsum("total-sum", "ij->", (2, 3)),
    einsum("outer", "i,j->ij", (2,), (3,)),
    einsum("dot", "i,i->", (4,), (4,)),
    einsum("row-dot", "ij,ij->i", (2, 3), (2, 3)),
    einsum("bilinear", "bi,ij,bj->b", (2, 3), (3, 2), (2, 2)),
    einsum("chain", "ij,jk,kl->il", (2, 3), (3, 2), (2, 2)),
    einsum("summed-in-one", "ijk,jl->il", (2, 3, 2), (3, 2)),
    einsum("ellipsis-batch", "...ij,...jk->...ik", (2, 2, 3), (2, 3, 2)),
    einsum("ellipsis-broadcast", "...ij,...jk->...ik", (2, 1, 2, 3), (1, 3, 3, 2)),
    einsum("label-broadcast-summed", "ij,ij->", (2, 3), (1, 3)),
    einsum("ellipsis-broadcast-kept", "...i,...i->...", (1, 3), (2, 3)),
    einsum("ellipsis-middle", "b...d,d->b...", (2, 3, 2, 2), (2,)),
    einsum("ellipsis-sum", "...i->...", (2, 3, 2)),
    einsum("ellipsis-only-one", "...ij,jk->...ik", (2, 2, 3), (3, 2)),
    einsum("diagonal", "ii->i", (3, 3)),
    einsum("trace", "ii->", (3, 3)),
    einsum("diagonal-with-batch", "bii->bi", (2, 3, 3)),
    einsum("repeated-in-second", "ij,jj->ij", (2, 3), (3, 3)),
    einsum("triple-diagonal", "iii->i", (2, 2, 2)),
    einsum("implicit-matmul", "ij,jk", (2, 3), (3, 4)),
    einsum("implicit-transpose", "ba", (2, 3)),
    einsum("uppercase", "iJ,Jk->ik", (2, 3), (3, 2)),
    einsum("spaces", "ij, jk -> ik", (2, 3), (3, 2)),
    einsum("opset13", "bij,bjk->bik", (2, 2, 3), (2, 3, 2), opset=13),
    Case("Einsum", [(2, 3), np.linspace(-1, 1, 6).reshape(3, 2)], {"equation": "ij,jk->ik"},
         id="Einsum-second-frozen"),

    # CumSum: every exclusive x reverse, negative axis, an int32 axis
    case("CumSum", "axis0", [(3, 4), i64(0)]),
    case("CumSum", "axis1-exclusive", [(3, 4), i64(1)], exclusive=1),
    case("CumSum", "neg-axis-reverse", [(3, 4), i64(-1)], reverse=1),
    case("CumSum", "exclusive-reverse", [(2, 3, 4), i64(-2)], exclusive=1, reverse=1),
    case("CumSum", "int32-axis", [(2, 3), np.array(1, dtype=np.int32)]),
    case("CumSum", "opset13", [(3, 4), i64(-1)], opset=13, exclusive=1),
    case("CumSum", "1d", [(5,), i64(0)], reverse=1),

    # GatherElements: axes, negative indices, repeats, indices shorter than data on the other axes
    case("GatherElements", "axis0-repeats", [X34, DUP0]),
    case("GatherElements", "axis1-negative", [X34, NEG1], axis=1),
    case("GatherElements", "neg-axis", [X34, NEG1], axis=-1),
    case("GatherElements", "shorter-indices", [X34, i64([[0, 2, 2], [1, 1, 0]])], axis=0),
    case("GatherElements", "3d-axis1", [(2, 3, 2), i64([[[0, 2], [2, 2]], [[1, 0], [-1, 1]]])], axis=1),
    case("GatherElements", "opset16", [X34, DUP0], opset=16),
    case("GatherElements", "opset13-distinct", [X34, i64([[2, 0, 1, 1], [0, 1, 2, 0]])], opset=13),
    case("GatherElements", "opset13-repeats", [X34, DUP0], opset=13),
    case("GatherElements", "opset15-negative-shorter", [X34, i64([[-1, 0, -1], [1, -4, 3]])], opset=15, axis=1),
    runtime(case("GatherElements", "runtime-indices", [X34, NEG1], axis=1), 1),
    runtime(case("GatherElements", "runtime-opset13", [X34, NEG1], opset=13, axis=-1), 1),
    runtime(case("GatherElements", "runtime-opset13-shorter", [X34, i64([[0, 2, 2], [1, -1, 0]])], opset=13),
            1),

    # GatherND: slices and elements, negative and repeated tuples, batch_dims
    case("GatherND", "rows-repeats", [X34, i64([[2], [0], [2]])]),
    case("GatherND", "elements-negative", [X34, i64([[0, -1], [2, 1], [-3, -1]])]),
    case("GatherND", "3d-pairs", [(2, 3, 2), i64([[[1, 2], [0, 0]], [[1, 2], [1, -1]]])]),
    case("GatherND", "batch-dims1", [(2, 3, 2), i64([[[2], [0], [2]], [[1], [1], [0]]])], batch_dims=1),
    case("GatherND", "batch-dims1-elements", [(2, 3, 2), i64([[1, 1], [-1, 0]])], batch_dims=1),
    case("GatherND", "opset13-distinct", [X34, i64([[2], [0]])], opset=13),
    case("GatherND", "opset13-repeats", [X34, i64([[0, 1], [0, 1], [2, 3]])], opset=13),
    case("GatherND", "opset13-batch-dims1", [(2, 3, 2), i64([[[2], [2]], [[1], [0]]])], opset=13, batch_dims=1),
    runtime(case("GatherND", "runtime-negative", [X34, i64([[0, -1], [2, 1], [0, -1]])]), 1),
    runtime(case("GatherND", "runtime-batch-dims1", [(2, 3, 2), i64([[[-1], [0]], [[1], [1]]])], batch_dims=1),
            1),
    runtime(case("GatherND", "runtime-opset13", [X34, i64([[1], [-1], [1]])], opset=13), 1),
    # more than builder.ONE_HOT_MAX_ROWS addressed slices: added with ScatterElements
    case("GatherND", "large-table-repeats", [(30, 20, 2), i64([[29, 19], [0, 0], [29, 19], [29, -1]])]),
    runtime(case("GatherND", "runtime-large-table", [(600, 2), i64([[599], [3], [599]])]), 1),

    # ScatterND: data and updates; reduction none and add; rows and elements; negative indices
    case("ScatterND", "rows", [(4, 3), i64([[1], [3]]), (2, 3)]),
    case("ScatterND", "elements-negative", [(3, 4), i64([[0, -1], [2, 1]]), (2,)]),
    case("ScatterND", "add-repeats", [(4, 3), i64([[1], [3], [1]]), (3, 3)], opset=16, reduction="add"),
    case("ScatterND", "add-elements", [(3, 4), i64([[0, 1], [0, 1], [-1, 0]]), (3,)], reduction="add"),
    case("ScatterND", "opset13", [(4, 3), i64([[2], [0]]), (2, 3)], opset=13),
    case("ScatterND", "none-opset16", [(2, 3, 2), i64([[1, 0], [0, 2]]), (2, 2)], opset=16),
    Case("ScatterND", [(4, 3), i64([[1], [3]]), np.ones((2, 3))], id="ScatterND-data-only"),
    Case("ScatterND", [np.zeros((4, 3)), i64([[1], [3]]), (2, 3)], id="ScatterND-updates-only"),
    runtime(case("ScatterND", "runtime-indices", [(4, 3), i64([[1], [-1]]), (2, 3)], reduction="add"), 1),

    # ScatterElements: axes, negative indices, reduction none and add
    case("ScatterElements", "axis0", [X34, i64([[1, 0, 2, 1], [0, 2, 1, 2]]), (2, 4)]),
    case("ScatterElements", "axis1-negative", [X34, i64([[-1, 0], [1, 2], [0, -3]]), (3, 2)], axis=1),
    case("ScatterElements", "neg-axis-add-repeats", [X34, i64([[1, 1, 3], [0, 0, 0]]), (2, 3)], axis=-1,
         reduction="add"),
    case("ScatterElements", "add-opset16", [X34, DUP0, (2, 4)], opset=16, reduction="add"),
    case("ScatterElements", "opset13", [X34, i64([[2, 1], [0, 0]]), (2, 2)], opset=13),
    case("ScatterElements", "3d-axis1", [(2, 3, 2), i64([[[0, 2]], [[1, -1]]]), (2, 1, 2)], axis=1),
    runtime(case("ScatterElements", "runtime-indices", [X34, i64([[1, 0, 2, 1]]), (1, 4)]), 1),

    # TopK: largest and smallest, sorted or not, axes (negative too); the Indices output takes no gradient
    Case("TopK", [(2, 5), i64([2])], {}, id="TopK-last-axis", outputs=2, sampler=distinct),
    Case("TopK", [(2, 5), i64([3])], {"largest": 0}, id="TopK-smallest", outputs=2, sampler=distinct),
    Case("TopK", [(2, 5), i64([3])], {"sorted": 0}, id="TopK-unsorted", outputs=2, sampler=distinct),
    Case("TopK", [(4, 3), i64([2])], {"axis": 0}, id="TopK-axis0", outputs=2, sampler=distinct),
    Case("TopK", [(2, 4, 3), i64([2])], {"axis": -2, "largest": 0}, id="TopK-neg-axis", outputs=2,
         sampler=distinct),
    Case("TopK", [(2, 5), i64([5])], {}, id="TopK-all", outputs=2, sampler=distinct, opset=13),
    Case("TopK", [(3, 4), i64([1])], {"axis": 1}, id="TopK-opset13", outputs=2, sampler=distinct, opset=13),
]

# Symbolic dims: identities built at run time (EyeLike), expansions and paddings to Shape(x), run-time strides.
N0 = {0: {0: "N"}}
CASES += [
    edited(einsum("diagonal-symbolic", "ii->i", (3, 3)), symbolic({0: {0: "D", 1: "D"}})),
    edited(einsum("trace-symbolic", "bii->b", (2, 3, 3)), symbolic({0: {0: "B", 1: "D", 2: "D"}})),
    edited(einsum("row-sum-symbolic", "ij->i", (2, 3)), symbolic({0: {0: "I", 1: "J"}})),
    edited(einsum("attention-symbolic", "bhqd,bhkd->bhqk", (1, 2, 3, 2), (1, 2, 4, 2)),
           symbolic({0: {0: "B", 2: "Q"}, 1: {0: "B", 2: "K"}})),
    edited(einsum("ellipsis-symbolic", "...ij,jk->...ik", (2, 2, 3), (3, 2)), symbolic(N0)),
    edited(case("CumSum", "symbolic", [(3, 4), i64(-1)], exclusive=1), symbolic({0: {0: "N", 1: "M"}})),
    edited(Case("TopK", [(2, 5), i64([2])], {}, id="TopK-symbolic", outputs=2, sampler=distinct), symbolic(N0)),
    edited(case("GatherElements", "symbolic", [X34, NEG1], axis=1), at_run_time(1), symbolic({0: {0: "R", 1: "C"}})),
    edited(case("GatherElements", "symbolic-opset13-shorter", [X34, i64([[0, 2, 2], [1, -1, 0]])], opset=13),
           at_run_time(1), symbolic({0: {0: "R", 1: "C"}})),
    edited(case("GatherND", "symbolic-negative", [X34, i64([[0, -1], [2, 1], [0, -1]])]),
           symbolic({0: {0: "R", 1: "C"}})),
    edited(case("GatherND", "symbolic-opset13", [X34, i64([[1, -1], [-1, 0], [1, 3]])], opset=13),
           at_run_time(1), symbolic({0: {0: "R", 1: "C"}})),
    edited(case("GatherND", "symbolic-opset13-rows", [(3, 2, 2), i64([[1], [-1], [1]])], opset=13),
           at_run_time(1), symbolic({0: {0: "R", 2: "C"}})),
    edited(case("GatherND", "symbolic-batch-dims1", [(2, 3, 2), i64([[[-1], [0]], [[1], [1]]])], batch_dims=1),
           at_run_time(1), symbolic({0: {0: "B", 1: "R"}})),
    edited(case("ScatterND", "symbolic", [(4, 3), i64([[1], [3]]), (2, 3)]), symbolic({0: {0: "R"}, 2: {0: "U"}})),
    edited(case("ScatterElements", "symbolic", [X34, i64([[1, 0, 2, 1]]), (1, 4)], axis=0),
           symbolic({0: {0: "R"}, 2: {0: "U"}})),
]

CASES += [
    # TensorScatter (opset 24): a key/value cache update
    Case("TensorScatter", [(2, 2, 5, 3), (2, 2, 2, 3), np.array([1, 3])], id="TensorScatter", opset=24),
    Case("TensorScatter", [(2, 5, 3), (2, 2, 3), np.array([4, 0])], {"axis": 1, "mode": "circular"},
         id="TensorScatter-circular-axis1", opset=24),
    Case("TensorScatter", [(2, 4, 3), (2, 3, 3)], {"axis": 1}, id="TensorScatter-no-indices", opset=24),
]
