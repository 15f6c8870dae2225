"""The output contract of build_gradient and the gradient pass's semantics (heads, xs, us, aggregation)."""
import subprocess
import sys

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxgrad
from onnxgrad import runtime


def scalar_model(nodes, inputs=("x",), inits=None, outputs=("loss",), opset=18, extra_outputs=()):
    """A model over scalars, so that no reduction is needed to reach a scalar loss."""
    inits = inits or {}
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, T.FLOAT, []) for n in inputs],
                     [h.make_tensor_value_info(n, T.FLOAT, []) for n in outputs] + list(extra_outputs),
                     [numpy_helper.from_array(np.asarray(v, dtype=np.float32), k) for k, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def affine():
    """loss = (x * w + b) * (x * w + b) ; w, b parameters."""
    return scalar_model([h.make_node("Mul", ["x", "w"], ["xw"], name="mul"),
                         h.make_node("Add", ["xw", "b"], ["z"], name="add"),
                         h.make_node("Mul", ["z", "z"], ["loss"], name="square")],
                        inits={"w": 2.0, "b": 0.5})


def run(model, feeds):
    sess = runtime.session(model)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def test_contract_outputs_inputs_and_values():
    train = onnxgrad.build_gradient(affine())
    assert [o.name for o in train.graph.output] == ["loss", "w_grad", "b_grad"]
    assert [i.name for i in train.graph.input] == ["x", "w", "b"]
    assert {t.name for t in train.graph.initializer} == {"w", "b"}
    onnx.checker.check_model(train, full_check=True)
    out = run(train, {"x": np.array(3.0, np.float32)})
    z = 3 * 2 + 0.5
    assert out["loss"] == pytest.approx(z * z)
    assert out["w_grad"] == pytest.approx(2 * z * 3)
    assert out["b_grad"] == pytest.approx(2 * z)
    # parameters can be fed as inputs
    out = run(train, {"x": np.array(3.0, np.float32), "w": np.array(1.0, np.float32)})
    assert out["loss"] == pytest.approx((3 + 0.5) ** 2)


def test_runtime_hints_and_ir_version():
    train = onnxgrad.build_gradient(affine())
    hints = {p.key: p.value for p in train.metadata_props}
    assert hints["onnxgrad.execution_order"] == "PRIORITY_BASED"
    assert hints["onnxgrad.disabled_optimizers"] == "CommonSubexpressionElimination,NchwcTransformer"
    assert hints["onnxgrad.loss"] == "loss"
    assert train.ir_version <= 11  # onnxruntime-gpu 1.31 refuses IR > 13; opset 18 needs IR 8


def test_byte_identical_across_runs_and_processes(tmp_path):
    a = onnxgrad.build_gradient(affine()).SerializeToString(deterministic=True)
    b = onnxgrad.build_gradient(affine()).SerializeToString(deterministic=True)
    assert a == b
    src = tmp_path / "m.onnx"
    onnx.save(affine(), src)
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"t{seed}.onnx"
        subprocess.run([sys.executable, "-m", "onnxgrad.cli", "build-grad", str(src), "-o", str(out)], check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}, capture_output=True)
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]


def test_gradients_of_one_value_summed_with_one_sum_node():
    # x used three times: one Sum of three contributions
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"]), h.make_node("Mul", ["a", "w"], ["b"]),
                      h.make_node("Add", ["b", "w"], ["loss"])], inits={"w": 3.0})
    train = onnxgrad.build_gradient(m)
    sums = [n for n in train.graph.node if n.op_type == "Sum"]
    assert len(sums) == 1 and len(sums[0].input) == 3
    # (the Add of the backward's tie to the loss only orders it)
    assert not any(n.op_type == "Add" and "/after_loss/" not in n.name for n in train.graph.node[3:])
    out = run(train, {"x": np.array(2.0, np.float32)})
    assert out["w_grad"] == pytest.approx(2 * 2 * 3 + 1)  # d(x w^2 + w)/dw


def test_same_gradient_twice_is_an_identity_copy():
    m = scalar_model([h.make_node("Add", ["u", "v"], ["s"]), h.make_node("Add", ["s", "x"], ["loss"])],
                     inits={"u": 1.0, "v": 2.0})
    train = onnxgrad.build_gradient(m)
    producers = {o: n for n in train.graph.node for o in n.output}
    assert producers["v_grad"].op_type == "Identity"
    out = run(train, {"x": np.array(2.0, np.float32)})
    assert out["u_grad"] == 1 and out["v_grad"] == 1


def test_requires_grad_frozen_and_also_grad():
    train = onnxgrad.build_gradient(affine(), requires_grad=["x", "b"], also_grad=["z"])
    assert [o.name for o in train.graph.output] == ["loss", "b_grad", "x_grad", "z_grad"]
    out = run(train, {"x": np.array(3.0, np.float32)})
    assert out["x_grad"] == pytest.approx(2 * 6.5 * 2)
    assert out["z_grad"] == pytest.approx(2 * 6.5)
    frozen = onnxgrad.build_gradient(affine(), frozen=["w"])
    assert [o.name for o in frozen.graph.output] == ["loss", "b_grad"]
    assert [i.name for i in frozen.graph.input] == ["x", "b"]


def test_also_grad_the_loss_does_not_depend_on_is_zero():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["loss"]), h.make_node("Neg", ["x"], ["other"])],
                     inits={"w": 3.0}, outputs=("loss", "other"))
    train = onnxgrad.build_gradient(m, loss="loss", also_grad=["other"])
    out = run(train, {"x": np.array(2.0, np.float32)})
    assert out["other_grad"] == 0 and out["w_grad"] == 2


def test_non_scalar_loss_gets_a_gradient_input():
    g = h.make_graph([h.make_node("Mul", ["x", "w"], ["y"])], "m", [h.make_tensor_value_info("x", T.FLOAT, [3])],
                     [h.make_tensor_value_info("y", T.FLOAT, [3])],
                     [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w")])
    train = onnxgrad.build_gradient(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]), loss="y")
    assert [i.name for i in train.graph.input] == ["x", "y_grad", "w"]
    out = run(train, {"x": np.ones(3, np.float32), "y_grad": np.array([1, 10, 100], np.float32)})
    np.testing.assert_allclose(out["w_grad"], [1, 10, 100])


def test_symbolic_dims_bound_from_the_api():
    g = h.make_graph([h.make_node("Mul", ["x", "w"], ["y"]), h.make_node("Add", ["y", "w"], ["z"])], "m",
                     [h.make_tensor_value_info("x", T.FLOAT, ["N", 3])], [h.make_tensor_value_info("z", T.FLOAT, ["N", 3])],
                     [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    for kwargs in ({}, {"dims": {"N": 2}}, {"input_shapes": {"x": [2, 3]}}):
        train = onnxgrad.build_gradient(m, loss="z", **kwargs)
        out = run(train, {"x": np.ones((2, 3), np.float32), "z_grad": np.ones((2, 3), np.float32)})
        np.testing.assert_allclose(out["w_grad"], [4, 4, 4])


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": "nope"}, "--loss nope: no graph output of that name (outputs: loss)"),
    ({"requires_grad": ["nope"]}, "--requires-grad nope: no value of that name in the model"),
    ({"requires_grad": ["z"]}, "--requires-grad z: not an initializer or a graph input"),
    ({"frozen": ["nope"]}, "--frozen nope: no value of that name in the model"),
    ({"also_grad": ["nope"]}, "--also-grad nope: no value of that name in the model"),
    ({"dims": {"B": 3}}, "--dim B: no dimension of that name"),
    ({"input_shapes": {"q": [1]}}, "--input-shape q: no graph input of that name"),
])
def test_usage_errors_name_the_culprit(kwargs, message):
    with pytest.raises(onnxgrad.UsageError) as e:
        onnxgrad.build_gradient(affine(), **kwargs)
    assert message in str(e.value)


def test_loss_must_be_chosen_when_ambiguous():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"]), h.make_node("Neg", ["a"], ["b"])],
                     inits={"w": 1.0}, outputs=("a", "b"))
    with pytest.raises(onnxgrad.UsageError, match=r"cannot choose the loss: 2 scalar outputs; name it with --loss "
                                                  r"\(candidates: a, b\)"):
        onnxgrad.build_gradient(m)


def test_unreachable_and_integer_parameters_are_refused():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["loss"])], inits={"w": 1.0, "unused": 2.0})
    with pytest.raises(onnxgrad.UsageError, match="--requires-grad unused: not reachable from the loss 'loss'"):
        onnxgrad.build_gradient(m, requires_grad=["unused"])
    m.graph.initializer.append(numpy_helper.from_array(np.array(3, np.int64), "k"))
    with pytest.raises(onnxgrad.UsageError, match="--requires-grad k: has an integer type"):
        onnxgrad.build_gradient(m, requires_grad=["k"])
    # by default only what the loss reaches
    assert [o.name for o in onnxgrad.build_gradient(m).graph.output] == ["loss", "w_grad"]


def test_missing_rule_error_names_op_node_and_path():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"], name="scale"),
                      h.make_node("Atan", ["a"], ["b"], name="squash"),
                      h.make_node("Neg", ["b"], ["loss"], name="flip")], inits={"w": 1.0})
    with pytest.raises(onnxgrad.UnsupportedError) as e:
        onnxgrad.build_gradient(m)
    assert str(e.value) == ("no gradient rule for Atan (opset 18) at node 'squash', "
                            "reached by loss <- Neg(flip) <- Atan(squash)")


def test_non_differentiable_ops_pass_no_gradient():
    # the Shape -> ConstantOfShape branch carries no gradient, so w gets only the Mul path
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"]), h.make_node("Shape", ["a"], ["s"]),
                      h.make_node("ConstantOfShape", ["s"], ["c"], value=h.make_tensor("", T.FLOAT, [1], [2.0])),
                      h.make_node("Mul", ["a", "c"], ["loss"])], inits={"w": 1.0})
    out = run(onnxgrad.build_gradient(m), {"x": np.array(3.0, np.float32)})
    assert out["w_grad"] == pytest.approx(6.0)


def test_old_opset_is_upgraded():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["loss"])], inits={"w": 2.0}, opset=9)
    m.ir_version = 4
    train = onnxgrad.build_gradient(m)
    assert train.opset_import[0].version == 13
    assert run(train, {"x": np.array(5.0, np.float32)})["w_grad"] == pytest.approx(5.0)


def test_too_new_opset_is_refused():
    newest = onnx.defs.onnx_opset_version()
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["loss"])], inits={"w": 2.0}, opset=newest + 1)
    with pytest.raises(onnxgrad.InvalidModelError, match=f"opset {newest + 1} is newer than the newest opset the "
                                                          f"installed onnx"):
        onnxgrad.build_gradient(m)


def test_run_time_unbroadcast_when_dims_are_symbolic():
    # Neither operand's dims are known, so which axis broadcasts is decided at run time.
    g = h.make_graph([h.make_node("Mul", ["a", "b"], ["y"])], "m",
                     [h.make_tensor_value_info("a", T.FLOAT, ["A", 3]), h.make_tensor_value_info("b", T.FLOAT, ["B", 3])],
                     [h.make_tensor_value_info("y", T.FLOAT, [None, 3])])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    train = onnxgrad.build_gradient(m, loss="y", requires_grad=["a", "b"])
    assert any(n.op_type == "NonZero" for n in train.graph.node)
    rng = np.random.default_rng(0)
    for na, nb in [(1, 4), (4, 1), (4, 4), (1, 1)]:
        a = rng.standard_normal((na, 3)).astype(np.float32)
        b = rng.standard_normal((nb, 3)).astype(np.float32)
        gy = rng.standard_normal((max(na, nb), 3)).astype(np.float32)
        out = run(train, {"a": a, "b": b, "y_grad": gy})
        np.testing.assert_allclose(out["a_grad"], (gy * b).sum(axis=0, keepdims=True) if na == 1 < nb else gy * b,
                                   rtol=1e-5)
        np.testing.assert_allclose(out["b_grad"], (gy * a).sum(axis=0, keepdims=True) if nb == 1 < na else gy * a,
                                   rtol=1e-5)


def test_model_with_external_data(tmp_path):
    m = affine()
    onnx.save(m, tmp_path / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    assert (tmp_path / "m.data").exists()
    train = onnxgrad.build_gradient(str(tmp_path / "m.onnx"))
    out = run(train, {"x": np.array(3.0, np.float32)})
    assert out["w_grad"] == pytest.approx(2 * 6.5 * 3)


def test_small_integer_subgraphs_are_folded_so_rules_see_constants():
    # axes = Reshape(Constant([1]), [-1]), as exporters write them: ReduceMean keepdims=0 needs them known
    nodes = [h.make_node("Constant", [], ["a0"], value=h.make_tensor("", T.INT64, [1], [1])),
             h.make_node("Constant", [], ["flat"], value=h.make_tensor("", T.INT64, [1], [-1])),
             h.make_node("Reshape", ["a0", "flat"], ["axes"]),
             h.make_node("Mul", ["x", "w"], ["y"]),
             h.make_node("ReduceMean", ["y", "axes"], ["m"], keepdims=0),
             h.make_node("Shape", ["m"], ["s"]),
             h.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                     [h.make_tensor_value_info("loss", T.FLOAT, []), h.make_tensor_value_info("s", T.INT64, [1])],
                     [numpy_helper.from_array(np.array([1, 2, 3], np.float32), "w")])
    train = onnxgrad.build_gradient(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]))
    producers = {o: n.op_type for n in train.graph.node for o in n.output}
    assert producers["axes"] == "Constant" and producers["s"] == "Constant"
    out = run(train, {"x": np.ones((2, 3), np.float32)})
    np.testing.assert_allclose(out["w_grad"], [2 / 3] * 3, rtol=1e-6)
    assert list(out["s"]) == [2]


def test_one_options_object_or_its_keywords():
    """build() takes an Options, or its fields as keywords (which replace the object's); both write the same
    graph, and a keyword that is no option is refused by name."""
    by_keywords = onnxgrad.build(affine(), requires_grad=["w"], optimizer="sgd")
    options = onnxgrad.Options(requires_grad=["w"], optimizer="sgd")
    by_options = onnxgrad.build(affine(), options)
    assert by_options.model.SerializeToString() == by_keywords.model.SerializeToString()
    assert onnxgrad.build(affine(), options, requires_grad=["b"]).gradient.parameters == ("b",)
    assert options.requires_grad == ["w"]  # the caller's object is left as it was
    with pytest.raises(TypeError, match="'requires_gard'"):
        onnxgrad.build(affine(), requires_gard=["w"])
    with pytest.raises(onnxgrad.UsageError, match="--precision"):
        onnxgrad.build(affine(), onnxgrad.Options(precision="fp8"))


def test_the_report_is_rendered_from_the_typed_results():
    result = onnxgrad.build(affine(), also_grad=["z"], mirror="mxnet")
    r = result.report
    assert r["loss"] == result.loss.loss == "loss" and result.loss.heads == ("loss",)
    assert r["parameters"] == list(result.gradient.parameters) == ["w", "b"]
    assert r["also_grad"] == list(result.gradient.also_grad) == ["z"]
    assert r["outputs"] == list(result.written.outputs) and r["opset"] == result.written.opset
    assert (r["forward_nodes"], r["backward_nodes"]) == (result.written.nodes.forward, result.written.nodes.backward)
    assert r["rules_used"] == result.gradient.rules_used and r["loop_segments"] == result.gradient.loop_segments
    assert r["mirror"]["predicted"]["peak_bytes"] == result.mirror.peak_bytes
    assert r["mirror"]["recomputed"] == result.mirror.recomputed
    assert list(r["passes"]) == list(result.passes) and "heads" in r["passes"]
    assert result.precision is None and "precision" not in r


def test_load_graph_reads_and_types_a_model():
    graph = onnxgrad.load_graph(onnxgrad.build_gradient(affine()))
    assert graph.nodes and all(v.is_typed for n in graph.nodes for v in n.outputs if v.name)


def test_a_weight_written_twice_is_reported_and_warned(tmp_path, capfd):
    # the TorchScript exporter writes GPT-2's tied output layer as a transposed copy of the token table: trained
    # as two parameters they differ after the first update. Matrices of one repeated value (zeros, ones) are
    # equal without being one weight, and are not reported.
    from onnxgrad.cli import main
    rng = np.random.default_rng(0)
    e = rng.standard_normal((128, 64)).astype(np.float32)
    inits = [numpy_helper.from_array(e, "E"), numpy_helper.from_array(np.ascontiguousarray(e.T), "Et"),
             numpy_helper.from_array(np.zeros((64, 64), np.float32), "Z1"),
             numpy_helper.from_array(np.zeros((64, 64), np.float32), "Z2")]
    nodes = [h.make_node("MatMul", ["x", "Et"], ["a"]), h.make_node("MatMul", ["a", "E"], ["b"]),
             h.make_node("MatMul", ["b", "Z1"], ["c"]), h.make_node("MatMul", ["c", "Z2"], ["d"]),
             h.make_node("Add", ["b", "d"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, [4, 64])],
                     [h.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    assert onnxgrad.build(model).report["parameter_copies"] == [["E", "Et", "transposed"]]
    assert onnxgrad.build(affine()).report["parameter_copies"] == []
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert main(["build-grad", str(path), "-o", str(tmp_path / "t.onnx")]) == 0
    err = capfd.readouterr().err
    assert "warning: parameters 'E' and 'Et' hold the same values (one transposed)" in err
    # --tie-copies: Et is read as Transpose(E), and E's gradient sums both uses (autograd's, with E tied)
    import torch
    tied = onnxgrad.build(model, tie_copies=True)
    assert tied.report["parameters"] == ["E", "Z1", "Z2"] and "Et" not in {t.name for t in tied.model.graph.initializer}
    x = rng.standard_normal((4, 64)).astype(np.float32)
    got = dict(zip([o.name for o in tied.model.graph.output],
                   runtime.session(tied.model).run(None, {"x": x})))
    et = torch.tensor(e, dtype=torch.float64, requires_grad=True)
    (torch.tensor(x, dtype=torch.float64) @ et.T @ et).sum().backward()
    np.testing.assert_allclose(got["E_grad"], et.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert main(["build-grad", str(path), "-o", str(tmp_path / "t2.onnx"), "--tie-copies"]) == 0
    assert "'Et' holds the same values as 'E' (one transposed): trained as that one" in capfd.readouterr().err


def test_scalar_initializers_beside_tensors_are_constants_by_default():
    # torch.onnx's dynamo exporter stores constants as rank-0 initializers (GELU's exponent and coefficients,
    # the attention scale, the mask's fill value); trained as parameters, one SGD step took GPT-2's fill value
    # -3.4e38 to -inf and the next loss was NaN
    w = numpy_helper.from_array(np.array([[0.5, -1.0], [2.0, 0.25]], np.float32), "w")
    scalars = [numpy_helper.from_array(np.asarray(v, np.float32), k)
               for k, v in (("three", 3.0), ("half", 0.5), ("fill", -3.4e38))]
    nodes = [h.make_node("MatMul", ["x", "w"], ["y"]), h.make_node("Pow", ["y", "three"], ["y3"]),
             h.make_node("Mul", ["y3", "half"], ["z"]), h.make_node("Greater", ["z", "x"], ["keep"]),
             h.make_node("Where", ["keep", "z", "fill"], ["masked"]), h.make_node("Softmax", ["masked"], ["p"]),
             h.make_node("ReduceSumSquare", ["p"], ["loss"], keepdims=0)]
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, [3, 2])],
                     [h.make_tensor_value_info("loss", T.FLOAT, [])], [w] + scalars)
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    report = onnxgrad.build(model).report
    assert report["parameters"] == ["w"] and report["scalar_constants"] == ["three", "half", "fill"]
    named = onnxgrad.build(model, requires_grad=["w", "half"]).report
    assert named["parameters"] == ["w", "half"] and named["scalar_constants"] == []
    # a model of scalars alone keeps them as its parameters
    assert onnxgrad.build(affine()).report["parameters"] == ["w", "b"]
