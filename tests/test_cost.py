"""The cost model on hand-built nodes: FLOPs counted by hand, bytes moved, and errors that name the node."""
import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxgrad.errors import UsageError
from onnxgrad.ir import Node, Value
from onnxgrad.memory.cost import DEFAULT_BALANCE, CostModel, op_cost

F32 = TensorProto.FLOAT


def node(op, inputs, outputs, **attrs):
    """A node whose inputs and outputs are float32 values of the given shapes (None: an absent input)."""
    ins = [None if s is None else Value(f"x{i}", F32, s) for i, s in enumerate(inputs)]
    outs = [Value(f"y{i}", F32, s) for i, s in enumerate(outputs)]
    return Node(op, ins, outs, f"{op.lower()}_0", [helper.make_attribute(k, v) for k, v in attrs.items()])


def elements(*shapes):
    total = 0
    for s in shapes:
        count = 1
        for d in s:
            count *= d
        total += count
    return total


CASES = [
    # op, inputs, outputs, attributes, FLOPs by hand
    ("MatMul", [(2, 3, 4), (4, 5)], [(2, 3, 5)], {}, 2 * 2 * 3 * 5 * 4),
    ("MatMul", [(4,), (4, 5)], [(5,)], {}, 2 * 5 * 4),
    ("Gemm", [(3, 4), (4, 5), (5,)], [(3, 5)], {}, 2 * 3 * 5 * 4 + 2 * 15),
    ("Gemm", [(4, 3), (5, 4)], [(3, 5)], {"transA": 1, "transB": 1}, 2 * 3 * 5 * 4 + 15),
    # Conv: N=2, M=8, C=4, 3x3 kernel, 5x5 output, with bias
    ("Conv", [(2, 4, 7, 7), (8, 4, 3, 3), (8,)], [(2, 8, 5, 5)], {}, 2 * (2 * 8 * 25) * (4 * 9) + 2 * 8 * 25),
    # grouped Conv: group 2, so 2 input channels per output channel
    ("Conv", [(1, 4, 5, 5), (6, 2, 3, 3)], [(1, 6, 3, 3)], {"group": 2}, 2 * (6 * 9) * (2 * 9)),
    # ConvTranspose: each of the 1*4*3*3 input elements scatters into 2 * 2*2 outputs
    ("ConvTranspose", [(1, 4, 3, 3), (4, 2, 2, 2)], [(1, 2, 6, 6)], {"strides": [2, 2]}, 2 * (4 * 9) * (2 * 4)),
    ("Einsum", [(2, 3, 4), (2, 4, 5)], [(2, 3, 5)], {"equation": "bij,bjk->bik"}, 2 * 2 * 3 * 4 * 5),
    ("Einsum", [(6, 2, 3), (6, 3, 4)], [(6, 2, 4)], {"equation": "...ij,...jk->...ik"}, 2 * 6 * 2 * 3 * 4),
    ("Einsum", [(3, 4)], [(3,)], {"equation": "ij->i"}, 12),
    # Attention, 4-D: batch 2, 4 heads, 8 queries, 16 keys, head size 32 (values 16)
    ("Attention", [(2, 4, 8, 32), (2, 4, 16, 32), (2, 4, 16, 16)], [(2, 4, 8, 16)], {},
     2 * (2 * 4 * 8 * 16) * (32 + 16) + 5 * (2 * 4 * 8 * 16)),
    # Attention, 3-D: 4 query heads over 2 key/value heads, head size 8
    ("Attention", [(2, 8, 32), (2, 16, 16), (2, 16, 16)], [(2, 8, 32)], {"q_num_heads": 4, "kv_num_heads": 2},
     2 * (2 * 4 * 8 * 16) * (8 + 8) + 5 * (2 * 4 * 8 * 16)),
    ("Relu", [(4, 5)], [(4, 5)], {}, 0),
    ("Add", [(4, 5), (5,)], [(4, 5)], {}, 0),
]


@pytest.mark.parametrize("op,inputs,outputs,attrs,flops", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_flops_and_bytes(op, inputs, outputs, attrs, flops):
    n = node(op, inputs, outputs, **attrs)
    model = CostModel()
    assert model.flops(n) == flops
    moved = 4 * elements(*[s for s in inputs if s is not None], *outputs)
    assert model.bytes_moved(n) == moved
    assert op_cost(n) == pytest.approx(flops + DEFAULT_BALANCE * moved)


def test_elementwise_ops_cost_their_bytes():
    small = node("Relu", [(10,)], [(10,)])
    large = node("Relu", [(1000,)], [(1000,)])
    assert op_cost(small) == DEFAULT_BALANCE * 80
    assert op_cost(large) == 100 * op_cost(small)


def test_balance_prices_memory_traffic():
    matmul = node("MatMul", [(64, 64), (64, 64)], [(64, 64)])
    relu = node("Relu", [(64, 64)], [(64, 64)])
    for balance in (1.0, 100.0):
        model = CostModel(balance=balance)
        assert model.cost(relu) == balance * 2 * 64 * 64 * 4
        assert model.cost(matmul) == 2 * 64 ** 3 + balance * 3 * 64 * 64 * 4


def test_absent_inputs_are_not_counted():
    n = node("Conv", [(1, 1, 3, 3), (1, 1, 1, 1), None], [(1, 1, 3, 3)])
    assert CostModel().bytes_moved(n) == 4 * (9 + 1 + 9)


def test_element_type_sets_the_bytes():
    x = Value("x", TensorProto.FLOAT16, (8, 8))
    y = Value("y", TensorProto.FLOAT16, (8, 8))
    assert CostModel().bytes_moved(Node("Relu", [x], [y], "relu_half")) == 2 * 64 * 2


def test_symbolic_dims_need_sizes():
    n = node("MatMul", [("batch", 4), (4, 5)], [("batch", 5)])
    with pytest.raises(UsageError, match=r"matmul_0.*symbolic dimension 'batch'"):
        op_cost(n)
    assert CostModel(symbols={"batch": 3}).flops(n) == 2 * 3 * 5 * 4


@pytest.mark.parametrize("shape", [None, (None, 4)], ids=["no-shape", "unknown-dim"])
def test_unknown_shapes_name_the_node(shape):
    n = node("Relu", [(4, 4)], [(4, 4)])
    n.inputs[0].shape = shape
    with pytest.raises(UsageError, match=r"'relu_0' \(Relu\).*'x0'"):
        op_cost(n)


def test_unknown_element_type_names_the_node():
    n = node("Relu", [(4, 4)], [(4, 4)])
    n.outputs[0].elem_type = None
    with pytest.raises(UsageError, match=r"relu_0.*element type of 'y0'"):
        op_cost(n)


def test_other_domains_cost_bytes_only():
    n = node("MatMul", [(4, 4), (4, 4)], [(4, 4)])
    n.domain = "com.example"
    assert CostModel().flops(n) == 0


def test_profile_costs_times_every_node():
    from onnx import TensorProto as T

    from onnxgrad.memory.cost import ProfiledCosts, profile_costs
    x = helper.make_tensor_value_info("x", T.FLOAT, ["batch", 64])
    y = helper.make_tensor_value_info("y", T.FLOAT, ["batch", 64])
    w = helper.make_tensor("w", T.FLOAT, [64, 64], [0.01] * 64 * 64)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                               helper.make_node("Relu", ["h"], ["y"], name="relu")], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(UsageError, match="'x' has dimension 'batch'"):
        profile_costs(model)
    times = profile_costs(model, symbols={"batch": 8}, runs=2)
    assert set(times) == {"mm", "relu"} and all(t > 0 for t in times.values())
    costs = ProfiledCosts(times)
    assert costs.cost(Node("Relu", [], [], "relu")) == times["relu"]
    with pytest.raises(UsageError, match="'other' .* was not timed"):
        costs.cost(Node("Relu", [], [], "other"))


def test_profile_prices_a_cross_entropy_loss_that_onnxruntime_expands():
    """onnxruntime runs SoftmaxCrossEntropyLoss as nodes of its own names: the node is priced by the cost model,
    scaled by what the timed nodes measured, and mirror --budget --cost profile works on a classifier."""
    import onnxgrad
    from onnx import TensorProto as T
    x = helper.make_tensor_value_info("x", T.FLOAT, [64, 256])
    labels = helper.make_tensor_value_info("labels", T.INT64, [64])
    loss = helper.make_tensor_value_info("loss", T.FLOAT, [])
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(f"w{i}", T.FLOAT, [256, 256], rng.standard_normal(256 * 256) * 0.05) for i in range(3)]
    nodes = []
    h = "x"
    for i in range(3):
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        h = f"t{i}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [h, "labels"], ["loss"], name="xent"))
    model = helper.make_model(helper.make_graph(nodes, "g", [x, labels], [loss], inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = onnxgrad.build(model, mirror="budget", mirror_options={"budget": "auto", "cost": "profile"})
    assert result.report["mirror"]["fits"] and result.report["mirror"]["cost_units"].startswith("microseconds")


def test_prices_charge_each_kernel_class_its_own_rates():
    from onnxgrad.memory.cost import CPU_PRICES, Prices, kernel_class
    prices = Prices(per_flop={"matmul": 1e-3}, per_byte={"matmul": 0.0, "view": 0.0, "elementwise": 2e-3},
                    per_node=5.0)
    model = CostModel(prices=prices)
    mm = node("MatMul", [(8, 16), (16, 4)], [(8, 4)])
    relu = node("Relu", [(8, 4)], [(8, 4)])
    reshape = node("Reshape", [(8, 4), (2,)], [(32,)])
    softmax = node("Softmax", [(8, 4)], [(8, 4)])
    assert [kernel_class(n) for n in (mm, relu, reshape, softmax)] == ["matmul", "elementwise", "view", "norm"]
    assert model.cost(mm) == pytest.approx(1e-3 * 2 * 8 * 4 * 16 + 5.0)
    assert model.cost(relu) == pytest.approx(2e-3 * 2 * 32 * 4 + 5.0)
    assert model.cost(reshape) == pytest.approx(5.0)
    # a class the prices leave out is priced as element-wise
    assert model.cost(softmax) == pytest.approx(model.cost(relu))
    # the shipped CPU prices make a large MatMul dearer than a Relu over its output
    shipped = CostModel(prices=CPU_PRICES)
    big = node("MatMul", [(256, 256), (256, 256)], [(256, 256)])
    assert shipped.cost(big) > 10 * shipped.cost(node("Relu", [(256, 256)], [(256, 256)]))


def test_mirror_budget_with_the_fitted_prices():
    import onnxgrad
    from onnx import TensorProto as T
    x = helper.make_tensor_value_info("x", T.FLOAT, [64, 256])
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(f"w{i}", T.FLOAT, [256, 256], rng.standard_normal(256 * 256) * 0.05) for i in range(4)]
    nodes, h = [], "x"
    for i in range(4):
        nodes += [helper.make_node("MatMul", [h, f"w{i}"], [f"m{i}"], name=f"mm{i}"),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"], name=f"tanh{i}")]
        h = f"t{i}"
    nodes.append(helper.make_node("ReduceSum", [h], ["loss"], name="sum", keepdims=0))
    loss = helper.make_tensor_value_info("loss", T.FLOAT, [])
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [loss], inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    result = onnxgrad.build(model, mirror="budget", mirror_options={"budget": "auto", "cost": "prices"})
    report = result.report["mirror"]
    assert report["fits"] and report["cost_units"].startswith("microseconds (per-kernel-class")
