"""Gradients are the same on every run and every thread count, and exact where indices repeat.

onnxruntime's CPU ScatterND with reduction="add" loses updates when indices repeat and more than one thread
runs it (bench/bench_scatter.py shows it), so no rule may emit it: the guard below checks every case of the
rule table. The embedding cases sum many rows into few (every index equal, as a segment embedding) and follow
a Zipf-like token distribution, on tables on both sides of builder.ONE_HOT_MAX_ROWS, and compare with an exact
sum. The shipped models and the bench models run through tests/repeat.py's check as well;
tests/test_real_models.py runs it on the real exports.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxgrad
from gradcheck import _build, _model, float_outputs
from onnxgrad.builder import ONE_HOT_MAX_ROWS
from onnxgrad.protos import random_feeds
from repeat import assert_repeatable, rel_l2
from test_rules import ALL_CASES

ROOT = Path(__file__).resolve().parents[1]


# -- the guard -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_no_rule_scatters_with_a_reduction_in_scatternd(case):
    fwd, wrt = _model(case, np.float32)
    train = _build(fwd, float_outputs(fwd), wrt)
    forward = {n.name for n in fwd.graph.node}
    bad = [n.name for n in train.graph.node if n.op_type == "ScatterND" and n.name not in forward
           and any(a.name == "reduction" and a.s not in (b"", b"none") for a in n.attribute)]
    assert not bad, f"{case}: backward ScatterND with a reduction (races on repeated indices): {bad}"


# -- embeddings ------------------------------------------------------------------------------------------------
BATCH, TOKENS, WIDTH = 8, 128, 768


def embedding_model(rows: int) -> onnx.ModelProto:
    """loss = sum(Gather(table, ids) * w): the table's gradient is w's rows summed at the ids."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((rows, WIDTH)).astype(np.float32),
                                    "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("Mul", ["rows", "w"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [BATCH, TOKENS]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [BATCH, TOKENS, WIDTH])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def ids_for(kind: str, rows: int, rng) -> np.ndarray:
    if kind == "all-equal":
        return np.zeros((BATCH, TOKENS), np.int64)
    # token frequencies fall off as a power of the rank, as in text
    return np.minimum(rng.zipf(1.3, (BATCH, TOKENS)) - 1, rows - 1).astype(np.int64)


@pytest.mark.parametrize("rows", [2, ONE_HOT_MAX_ROWS, 1000], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("kind", ["all-equal", "zipf"])
def test_embedding_gradient_is_exact_and_repeatable(rows, kind):
    rng = np.random.default_rng(1)
    ids = ids_for(kind, rows, rng)
    w = rng.standard_normal((BATCH, TOKENS, WIDTH)).astype(np.float32)
    train = onnxgrad.build_gradient(embedding_model(rows))
    outs = assert_repeatable(train, {"ids": ids, "w": w}, f"embedding {kind} rows={rows}")
    names = [o.name for o in train.graph.output]
    want = np.zeros((rows, WIDTH))
    np.add.at(want, ids.reshape(-1), w.reshape(-1, WIDTH).astype(np.float64))
    assert rel_l2(outs[names.index("table_grad")], want) < 1e-6


# -- shipped and bench models ----------------------------------------------------------------------------------
def _bench_train():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_train
    finally:
        sys.path.pop(0)
    return bench_train


SHIPPED = ["mlp", "cnn", "transformer"]
BENCH = ["mlp", "cnn", "gpt", "resnet50", "mobilenet"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_is_repeatable(name):
    train = onnxgrad.build_gradient(str(ROOT / "models" / f"{name}.onnx"), dims={"N": 4})
    feeds = random_feeds(train, {"N": 4}, seed=0, skip={t.name for t in train.graph.initializer})
    assert_repeatable(train, feeds, f"models/{name}.onnx")


@pytest.mark.parametrize("name", BENCH)
def test_bench_model_is_repeatable(name):
    bench = _bench_train()
    train = onnxgrad.build_gradient(bench.MODELS[name](), dims={"N": 2})
    feeds = random_feeds(train, {"N": 2}, seed=0, skip={t.name for t in train.graph.initializer})
    assert_repeatable(train, feeds, f"bench model {name}")


@pytest.mark.parametrize("rows", [2, 1000], ids=lambda r: f"rows{r}")
def test_embedding_gradient_sizes_are_known(rows):
    """The mirror pass sizes every value of the graph the gradient pass typed: the one-hot rows are a constant."""
    result = onnxgrad.build(embedding_model(rows), mirror="mxnet")
    assert result.report["mirror"]["predicted"]["peak_bytes"] > 0


def test_a_large_table_gradient_holds_one_table(tmp_path):
    """Above ONE_HOT_MAX_ROWS the gradient is gathered from the updates summed per slot, and goes out without a
    Reshape (onnxruntime would copy it into the graph output): the backward never holds a second table (a
    zero table to scatter into, or the copy), simulated and as onnxruntime runs it."""
    from onnxgrad.api import load_graph
    from onnxgrad.memory.measure import measure
    from onnxgrad.memory.simulate import simulate
    rows = 20000
    table = rows * WIDTH * 4
    train = onnxgrad.build_gradient(embedding_model(rows))
    assert simulate(load_graph(train)).dynamic_peak < 1.5 * table
    path = tmp_path / "embedding.onnx"
    onnx.save(train, str(path))
    assert measure(path, level="ALL")["peak_bytes"] < 1.5 * table


def tied_model(rows: int, width: int, tokens: int) -> onnx.ModelProto:
    """loss = sum((Gather(table, ids) @ table^T) * w): an embedding tied to the output layer."""
    table = numpy_helper.from_array(
        np.random.default_rng(2).standard_normal((rows, width)).astype(np.float32) * 0.1, "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("Transpose", ["table"], ["head"], perm=[1, 0]),
             helper.make_node("MatMul", ["rows", "head"], ["logits"]),
             helper.make_node("Mul", ["logits", "w"], ["weighted"]),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [tokens]),
                        helper.make_tensor_value_info("w", TensorProto.FLOAT, [tokens, rows])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def test_a_tied_table_adds_its_rows_into_the_output_layer_gradient():
    """The embedding's rows are added into the tied output layer's gradient, not gathered into a second table
    and summed: two table-sized buffers at once instead of three, and the gradient is autograd's."""
    import torch
    from onnxgrad.api import load_graph
    from onnxgrad.memory.simulate import simulate
    rows, width, tokens = 4000, 256, 64
    model = tied_model(rows, width, tokens)
    train = onnxgrad.build_gradient(model)
    assert simulate(load_graph(train)).dynamic_peak < 2.5 * rows * width * 4
    rng = np.random.default_rng(3)
    ids = np.minimum(rng.zipf(1.3, tokens) - 1, rows - 1).astype(np.int64)
    w = rng.standard_normal((tokens, rows)).astype(np.float32)
    outs = assert_repeatable(train, {"ids": ids, "w": w}, "tied embedding")
    table = torch.tensor(numpy_helper.to_array(model.graph.initializer[0]), dtype=torch.float64,
                         requires_grad=True)
    (table[torch.tensor(ids)] @ table.T * torch.tensor(w, dtype=torch.float64)).sum().backward()
    names = [o.name for o in train.graph.output]
    assert rel_l2(outs[names.index("table_grad")], table.grad.numpy()) < 1e-5
