"""The cross-entropy loss written as plain ops: the same outputs as the ONNX op (reference evaluator) for every
reduction, class weights and ignore_index, no SoftmaxCrossEntropyLoss left for onnxruntime to expand, the labels'
classes kept in the metadata, and the backward waiting for the loss as onnxruntime runs the graph."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad.api import load_graph
from onnxgrad.builder import Names
from onnxgrad.memory.simulate import sizes
from onnxgrad.passes.schedule import TIE_MIN_BYTES
from onnxgrad.contract import CLASS_LABELS_KEY
from onnxgrad.ir import from_model
from onnxgrad.passes.expand import expand_cross_entropy
from onnxgrad.protos import class_counts
from onnxgrad.runtime import session_options
from onnxgrad.shapes import type_everything
from test_budget import optimized_by_onnxruntime

N, C, D = 5, 7, 3


def sce_model(reduction: str, weights: bool, ignore: int | None, rank3: bool) -> onnx.ModelProto:
    shape = [N, C, D] if rank3 else [N, C]
    inputs = [h.make_tensor_value_info("scores", T.FLOAT, shape),
              h.make_tensor_value_info("labels", T.INT64, [shape[0], *shape[2:]])]
    names = ["scores", "labels"]
    if weights:
        inputs.append(h.make_tensor_value_info("w", T.FLOAT, [C]))
        names.append("w")
    attrs = {"reduction": reduction} | ({"ignore_index": ignore} if ignore is not None else {})
    node = h.make_node("SoftmaxCrossEntropyLoss", names, ["loss", "log_prob"], name="ce", **attrs)
    outputs = [h.make_tensor_value_info("loss", T.FLOAT, None), h.make_tensor_value_info("log_prob", T.FLOAT, None)]
    return h.make_model(h.make_graph([node], "ce", inputs, outputs), opset_imports=[h.make_opsetid("", 18)],
                        ir_version=8)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weights,ignore,rank3", [(False, None, False), (True, None, False), (False, 2, False),
                                                  (True, -100, True), (True, 0, True)])
def test_expansion_computes_what_the_op_computes(reduction, weights, ignore, rank3):
    model = sce_model(reduction, weights, ignore, rank3)
    graph = from_model(model)
    type_everything(graph)
    expand_cross_entropy(graph, Names([*graph.values, *(n.name for n in graph.nodes)]))
    assert not any(n.op_type == "SoftmaxCrossEntropyLoss" for n in graph.nodes)
    expanded = graph.to_model()
    onnx.checker.check_model(expanded, full_check=True)
    assert json.loads({p.key: p.value for p in expanded.metadata_props}[CLASS_LABELS_KEY]) == \
        {"labels": [C, ignore]}
    assert class_counts(expanded) == {"labels": C}
    rng = np.random.default_rng(0)
    shape = (N, C, D) if rank3 else (N, C)
    feeds = {"scores": rng.standard_normal(shape).astype(np.float32),
             "labels": rng.integers(0, C, (N, *shape[2:])).astype(np.int64)}
    if ignore is not None:
        feeds["labels"].flat[::3] = ignore
    if weights:
        feeds["w"] = rng.uniform(0.5, 2.0, C).astype(np.float32)
    want = ReferenceEvaluator(model).run(None, feeds)
    got = ort.InferenceSession(expanded.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def tied_head_model(batch: int = 64, width: int = 32, classes: int = 4096) -> onnx.ModelProto:
    """logits = x @ E^T (an output layer tied to an embedding table, as GPT-2's), then the cross-entropy:
    onnxruntime fuses the MatMul with the Transpose into a node numbered after the file's nodes."""
    rng = np.random.default_rng(1)
    e = numpy_helper.from_array((rng.standard_normal((classes, width)) / 8).astype(np.float32), "E")
    nodes = [h.make_node("Transpose", ["E"], ["Et"], perm=[1, 0], name="transpose"),
             h.make_node("MatMul", ["x", "Et"], ["logits"], name="head"),
             h.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], name="ce")]
    g = h.make_graph(nodes, "tied", [h.make_tensor_value_info("x", T.FLOAT, [batch, width]),
                                     h.make_tensor_value_info("labels", T.INT64, [batch])],
                     [h.make_tensor_value_info("loss", T.FLOAT, [])], [e])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=8)


def test_the_backward_runs_after_the_loss_as_onnxruntime_orders_it(tmp_path):
    """The gradient of a scalar loss starts from a constant; tied to the loss, no backward node with a result
    worth keeping apart (TIE_MIN_BYTES) runs before the loss is computed, even where onnxruntime numbers the
    logits' producer after every node of the file. Untied, the one-hot gradient (and the labels' one-hot mask)
    ran first."""
    train = onnxgrad.build_gradient(tied_head_model())
    phases = dict(zip((n.name for n in train.graph.node), onnxgrad.protos.model_phases(train)))
    path = tmp_path / "train.onnx"
    onnx.save(train, path)
    so, extra = session_options(train, 1)
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"], **extra)
    rng = np.random.default_rng(2)
    sess.run(None, {"x": rng.standard_normal((64, 32)).astype(np.float32),
                    "labels": rng.integers(0, 4096, 64).astype(np.int64)})
    events = json.load(open(sess.end_profiling()))
    ran = [e["name"][:-len("_kernel_time")] for e in sorted(events, key=lambda e: e["ts"])
           if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    graph = load_graph(str(path))
    nbytes = sizes(graph)
    large = {n.name for n in graph.nodes if any(nbytes.get(id(v), 0) >= TIE_MIN_BYTES for v in n.outputs)}
    loss_at = max(i for i, name in enumerate(ran) if name.startswith("ce/"))
    early = [name for name in ran[:loss_at] if phases.get(name) == "backward" and name in large]
    assert not early, early[:5]
    assert any(phases.get(name) == "backward" and name in large for name in ran[loss_at:])


def test_the_seed_is_tied_once_and_onnxruntime_keeps_the_tie(tmp_path):
    """A training graph taken up again (mirror on build-grad's output) keeps its one tie; tying the tied seed
    again made a chain onnxruntime folded into a constant, and GPT-2's gradient then ran before its loss."""
    train = tmp_path / "train.onnx"
    onnx.save(onnxgrad.build_gradient(tied_head_model()), train)
    mirrored = onnxgrad.build(str(train), mirror="mxnet").model
    ties = [n for n in mirrored.graph.node if "/after_loss/" in n.name and n.op_type == "Reshape"
            and any(i.startswith("seed/") and "/after_loss/" not in i for i in n.input)]
    assert len(ties) == 1
    assert ties[0].name in {n.name for n in optimized_by_onnxruntime(mirrored, tmp_path).graph.node}
