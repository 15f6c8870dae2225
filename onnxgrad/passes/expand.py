"""Expand the cross-entropy loss into the ops it is made of, in the file, where the loss is.

onnxruntime has no SoftmaxCrossEntropyLoss kernel in its stock builds: it expands the node into the op's
function body when it loads the graph. That body holds three scores-sized tensors at once (a transposed copy,
the log-probabilities, and those transposed back: 589 MiB for GPT-2's 196 MiB logits at 4 x 256 tokens), and
its nodes are numbered after every node of the file, so under PRIORITY_BASED they run last, after the whole
backward, and the scores they read stay alive until then. Written here instead, the loss is a LogSoftmax, one
GatherElements of the label's column and a few reductions of one value per label: one scores-sized tensor,
run where the file puts it, and seen by the memory simulator and the budget like any other node.

The gradient is already written by then (the SoftmaxCrossEntropyLoss rule reads the scores and the log_prob
output), so the expansion only has to compute the same outputs under the same names. The class labels the
node read are recorded in the metadata (contract.CLASS_LABELS_KEY), so that random data and `--data` checks
still know their number of classes.
"""
from __future__ import annotations

import json

from onnx import TensorProto

from ..builder import Builder, Names
from ..contract import CLASS_LABELS_KEY
from ..ir import Graph, Node, Value
from ..pipeline import Build, Pass


class ExpandLoss(Pass):
    name = "expand_loss"
    requires = frozenset({"gradient"})

    def run(self, build: Build) -> None:
        expanded = expand_cross_entropy(build.graph, build.new_names())
        build.heads = [expanded.get(id(h), h) for h in build.heads]


def expand_cross_entropy(graph: Graph, names: Names) -> dict[int, Value]:
    """Replace each SoftmaxCrossEntropyLoss of the main graph whose scores have a known rank by its expansion;
    returns {id(old output): new output}, the new outputs renamed to the old names."""
    replaced: dict[int, Value] = {}
    labels = json.loads(graph.metadata.get(CLASS_LABELS_KEY, "{}"))
    for node in list(graph.nodes):
        if node.op_type != "SoftmaxCrossEntropyLoss" or node.domain not in ("", "ai.onnx"):
            continue
        scores = node.inputs[0]
        if scores.rank is None or scores.rank < 2:
            continue
        op = Builder(graph, names, prefix=node.name or "cross_entropy", phase=node.phase)
        outputs = _expansion(op, node)
        at = graph.nodes.index(node)
        emitted = {id(n) for n in op.emitted}
        kept = [n for n in graph.nodes if id(n) not in emitted]
        graph.reorder(kept[:at] + op.emitted + kept[at:])
        classes = scores.shape[1] if scores.shape is not None and isinstance(scores.shape[1], int) else None
        ignore = node.attr("ignore_index")
        labels[node.inputs[1].name] = [classes, ignore]
        olds = list(node.outputs)
        for old, new in zip(olds, outputs):
            if old.name:
                graph.replace_all_uses(old, new)
                graph.outputs = [new if v is old else v for v in graph.outputs]
        graph.remove([node])
        for old, new in zip(olds, outputs):
            if old.name:
                graph.rename(new, old.name)
                new.elem_type, new.shape = old.elem_type, old.shape
                replaced[id(old)] = new
    if labels:
        graph.metadata[CLASS_LABELS_KEY] = json.dumps(labels, sort_keys=True)
    return replaced


def _expansion(op: Builder, node: Node) -> list[Value]:
    """loss = reduce(-log_softmax(scores)[n, label[n, ...], ...] * w[n, ...]); w = weight[label] (or 1),
    times 0 where the label is ignore_index. mean divides by the sum of w, as PyTorch does."""
    scores, label = node.inputs[0], node.inputs[1]
    weight = node.inputs[2] if len(node.inputs) > 2 else None
    reduction = node.attr("reduction", "mean")
    if isinstance(reduction, bytes):
        reduction = reduction.decode()
    ignore = node.attr("ignore_index")
    log_prob = op.LogSoftmax(scores, axis=1)
    index = label
    keep = None
    if ignore is not None:
        ignored = op.Equal(label, op.const(ignore, label.elem_type))
        index = op.Where(ignored, op.const(0, label.elem_type), label)
        keep = op.Cast(op.Not(ignored), to=scores.elem_type)
    if index.elem_type != TensorProto.INT64:
        index = op.Cast(index, to=TensorProto.INT64)
    axis = op.ints([1])
    picked = op.Squeeze(op.GatherElements(log_prob, op.Unsqueeze(index, axis), axis=1), axis)
    loss = op.Neg(picked)
    w = None
    if weight is not None:
        w = op.Gather(weight, index, axis=0)
    if keep is not None:
        w = keep if w is None else op.Mul(w, keep)
    if w is not None:
        loss = op.Mul(loss, w)
    if reduction == "sum":
        loss = op.ReduceSum(loss, keepdims=0)
    elif reduction == "mean":
        loss = op.ReduceMean(loss, keepdims=0) if w is None else \
            op.Div(op.ReduceSum(loss, keepdims=0), op.ReduceSum(w, keepdims=0))
    return [loss, log_prob]
