"""Shape folding: per dimension, and to a fixed point."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnxgrad
from onnxgrad import fold, loader


def _model(nodes, inputs, outputs, inits=(), opset=18):
    g = h.make_graph(nodes, "m", inputs, outputs, list(inits))
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    return loader.infer_shapes(m)


def _shape_of(model, name):
    for vi in [*model.graph.value_info, *model.graph.output]:
        if vi.name == name:
            return [d.dim_value if d.HasField("dim_value") else d.dim_param or None
                    for d in vi.type.tensor_type.shape.dim]
    return None


def _producers(model):
    return {o: n for n in model.graph.node for o in n.output}


def shuffle_chain(links: int, batch=2, groups=2) -> onnx.ModelProto:
    """x [batch, 8, 3] through `links` channel shuffles as the TorchScript exporter writes them: each Reshape
    target computed from Shape/Gather/Div/Concat of the previous output, so each link needs one more round."""
    consts = [h.make_tensor("g", T.INT64, [1], [groups]), h.make_tensor("i0", T.INT64, [], [0]),
              h.make_tensor("i1", T.INT64, [], [1]), h.make_tensor("i2", T.INT64, [], [2]),
              h.make_tensor("ax0", T.INT64, [1], [0]), h.make_tensor("m1", T.INT64, [1], [-1])]
    nodes, cur = [], "x"
    for k in range(links):
        p = f"l{k}_"
        nodes += [h.make_node("Shape", [cur], [p + "s"]),
                  h.make_node("Gather", [p + "s", "i0"], [p + "n"]), h.make_node("Gather", [p + "s", "i1"], [p + "c"]),
                  h.make_node("Gather", [p + "s", "i2"], [p + "w"]),
                  h.make_node("Unsqueeze", [p + "n", "ax0"], [p + "n1"]),
                  h.make_node("Unsqueeze", [p + "c", "ax0"], [p + "c1"]),
                  h.make_node("Unsqueeze", [p + "w", "ax0"], [p + "w1"]),
                  h.make_node("Div", [p + "c1", "g"], [p + "cg"]),
                  h.make_node("Concat", [p + "n1", "g", p + "cg", p + "w1"], [p + "t"], axis=0),
                  h.make_node("Reshape", [cur, p + "t"], [p + "r"]),
                  h.make_node("Transpose", [p + "r"], [p + "tr"], perm=[0, 2, 1, 3]),
                  h.make_node("Concat", [p + "n1", "m1", p + "w1"], [p + "t2"], axis=0),
                  h.make_node("Reshape", [p + "tr", p + "t2"], [p + "y"])]
        cur = p + "y"
    nodes += [h.make_node("Mul", [cur, "w"], ["scaled"]), h.make_node("ReduceSum", ["scaled"], ["loss"], keepdims=0)]
    w = h.make_tensor("w", T.FLOAT, [8, 3], np.linspace(-1, 1, 24).tolist())
    return _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [batch, 8, 3])],
                  [h.make_tensor_value_info("loss", T.FLOAT, [])], consts + [w])


def test_a_static_dim_of_a_partly_symbolic_shape_is_a_constant():
    m = _model([h.make_node("Shape", ["x"], ["s"]),
                h.make_node("Gather", ["s", "one"], ["c"]),
                h.make_node("Slice", ["s", "starts", "ends"], ["tail"]),
                h.make_node("Mul", ["c", "c"], ["cc"]),
                h.make_node("Identity", ["s"], ["s_out"])],
               [h.make_tensor_value_info("x", T.FLOAT, ["N", 3, 4])],
               [h.make_tensor_value_info(n, T.INT64, None) for n in ("c", "tail", "cc", "s_out")],
               [h.make_tensor("one", T.INT64, [], [1]), h.make_tensor("starts", T.INT64, [1], [1]),
                h.make_tensor("ends", T.INT64, [1], [3])])
    assert fold.fold_small_constants(m, 18) == 3
    nodes = _producers(m)
    values = {n: onnx.numpy_helper.to_array(nodes[n].attribute[0].t).tolist() for n in ("c", "tail", "cc")}
    assert values == {"c": 3, "tail": [3, 4], "cc": 9}
    assert nodes["s"].op_type == "Shape"   # the batch is still symbolic: Shape itself stays
    assert nodes["s_out"].op_type == "Identity"


def test_a_symbolic_batch_carried_into_a_reshape_target_stays_symbolic():
    m = shuffle_chain(3, batch="N")
    assert _shape_of(m, "l2_y") != ["N", 8, 3]
    m = fold.fold_to_fixed_point(m)
    assert _shape_of(m, "l2_y") == ["N", 8, 3]
    assert not any(n.op_type == "Shape" and n.output[0] in {"l2_t", "l2_t2"} for n in m.graph.node)


@pytest.mark.parametrize("batch", [2, "N"])
def test_folding_runs_to_a_fixed_point(batch):
    m = fold.fold_to_fixed_point(shuffle_chain(12, batch=batch))
    assert _shape_of(m, "l11_y") == [batch, 8, 3]   # 12 links: 12 rounds, more than the old 4
    assert fold.fold_small_constants(m, 18) == 0


def test_a_graph_that_keeps_folding_past_the_bound_is_refused():
    with pytest.raises(onnxgrad.UnsupportedError, match="shape folding did not settle after 3 rounds"):
        fold.fold_to_fixed_point(shuffle_chain(6), max_rounds=3)


def test_floats_fold_only_as_small_constants():
    """A float computed from constants and static sizes folds (a few elements); one that reads a float
    initializer (it may be a parameter) or has more elements does not."""
    m = _model([h.make_node("Shape", ["x"], ["s"]), h.make_node("Cast", ["s"], ["f"], to=T.FLOAT),
                h.make_node("Mul", ["f", "f"], ["ff"])],
               [h.make_tensor_value_info("x", T.FLOAT, [2, 3])], [h.make_tensor_value_info("ff", T.FLOAT, None)])
    fold.fold_to_fixed_point(m)
    assert [n.op_type for n in m.graph.node] == ["Constant"] * 3
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(m.graph.node[2].attribute[0].t), [4.0, 9.0])
    big = np.arange(fold.FLOAT_SCALARS + 1, dtype=np.float32)
    m = _model([h.make_node("Constant", [], ["two"], value=onnx.numpy_helper.from_array(np.float32(2.0), "")),
                h.make_node("Mul", ["a", "two"], ["a2"]),
                h.make_node("Constant", [], ["big"], value=onnx.numpy_helper.from_array(big, "")),
                h.make_node("Mul", ["big", "two"], ["big2"])],
               [], [h.make_tensor_value_info("a2", T.FLOAT, None), h.make_tensor_value_info("big2", T.FLOAT, None)],
               [onnx.numpy_helper.from_array(np.float32(0.5), "a")])
    fold.fold_to_fixed_point(m)
    assert [n.op_type for n in m.graph.node] == ["Constant", "Mul", "Constant", "Mul"]


def test_a_reshape_target_computed_in_floats_folds_and_the_conv_after_it_builds():
    """MobileViT's unfold as TorchScript writes it: the target's sizes are ceil(2.0) * 2.0 in floats, cast to
    int64. Without folding them, the Conv after the Reshape had unknown spatial dims and no gradient."""
    f32 = lambda v: onnx.numpy_helper.from_array(np.float32(v), "")  # noqa: E731
    i64 = lambda v: onnx.numpy_helper.from_array(np.array(v, np.int64), "")  # noqa: E731
    nodes = [h.make_node("Constant", [], ["two"], value=f32(2.0)),
             h.make_node("Ceil", ["two"], ["c"]), h.make_node("Mul", ["c", "two"], ["side"]),
             h.make_node("Cast", ["side"], ["side_i"], to=T.INT64),
             h.make_node("Constant", [], ["ax"], value=i64([0])),
             h.make_node("Unsqueeze", ["side_i", "ax"], ["s1"]),
             h.make_node("Constant", [], ["head"], value=i64([2, 3])),
             h.make_node("Concat", ["head", "s1", "s1"], ["target"], axis=0),
             h.make_node("Reshape", ["x", "target"], ["img"]),
             h.make_node("Conv", ["img", "w"], ["y"], pads=[1, 1, 1, 1]),
             h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    w = onnx.numpy_helper.from_array(np.linspace(-1, 1, 4 * 3 * 9, dtype=np.float32).reshape(4, 3, 3, 3), "w")
    m = _model(nodes, [h.make_tensor_value_info("x", T.FLOAT, [2, 48])],
               [h.make_tensor_value_info("loss", T.FLOAT, [])], [w])
    train = onnxgrad.build_gradient(m)
    import onnxruntime as ort
    x = np.random.default_rng(0).standard_normal((2, 48)).astype(np.float32)
    out = dict(zip([o.name for o in train.graph.output],
                   ort.InferenceSession(train.SerializeToString()).run(None, {"x": x})))
    img = np.pad(x.reshape(2, 3, 4, 4), ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.stack([img[:, :, i:i + 4, j:j + 4].sum(axis=(0, 2, 3)) for i in range(3) for j in range(3)], -1)
    np.testing.assert_allclose(out["w_grad"], np.broadcast_to(expected.reshape(1, 3, 3, 3), (4, 3, 3, 3)),
                               rtol=1e-5, atol=1e-5)


def test_a_deep_shuffle_chain_builds_and_matches_numpy():
    train = onnxgrad.build_gradient(shuffle_chain(10, batch="N"), dims={"N": 2})
    import onnxruntime as ort
    x = np.random.default_rng(0).standard_normal((2, 8, 3)).astype(np.float32)
    out = dict(zip([o.name for o in train.graph.output],
                   ort.InferenceSession(train.SerializeToString()).run(None, {"x": x})))
    y = x
    for _ in range(10):
        y = y.reshape(2, 2, 4, 3).transpose(0, 2, 1, 3).reshape(2, 8, 3)
    np.testing.assert_allclose(out["w_grad"], y.sum(0), rtol=1e-5)


def test_size_folds_only_when_every_dim_is_static():
    def size_model(shape):
        return _model([h.make_node("Size", ["x"], ["n"])], [h.make_tensor_value_info("x", T.FLOAT, shape)],
                      [h.make_tensor_value_info("n", T.INT64, [])])
    assert fold.fold_small_constants(size_model(["N", 3]), 18) == 0
    static = size_model([2, 3])
    assert fold.fold_small_constants(static, 18) == 1
    assert onnx.numpy_helper.to_array(static.graph.node[0].attribute[0].t) == 6
