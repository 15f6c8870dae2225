"""`onnxgrad check`, the reports of every subcommand, and byte-identical outputs across processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxgrad
from onnxgrad.protos import model_phases
from onnxgrad import gradcheck
from onnxgrad.check import check_training_graph, forward_model
from onnxgrad.gradcheck import to_float64
from onnxgrad.cli import main
from test_api import affine, scalar_model

MODELS = Path(__file__).parent.parent / "models"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Training graphs of the shipped models, written once by build-grad."""
    folder = tmp_path_factory.mktemp("train")
    paths = {}
    for name in ("mlp", "cnn", "transformer"):
        paths[name] = folder / f"{name}_train.onnx"
        assert main(["-q", "build-grad", str(MODELS / f"{name}.onnx"), "-o", str(paths[name])]) == 0
    return paths


def tampered(path: Path, param: str, factor: float, out: Path) -> Path:
    """The training graph with `<param>_grad` multiplied by `factor`: a wrong gradient to catch."""
    m = onnx.load(path)
    grad = param + "_grad"
    for node in m.graph.node:
        node.output[:] = [grad + "_true" if o == grad else o for o in node.output]
    factor_init = numpy_helper.from_array(np.array(factor, np.float32), "tamper_factor")
    m.graph.initializer.append(factor_init)
    m.graph.node.append(h.make_node("Mul", [grad + "_true", "tamper_factor"], [grad], name="tamper"))
    onnx.save(m, out)
    return out


def rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows by parameter name."""
    lines = stdout.splitlines()
    return {ln.split()[0]: ln.split() for ln in lines[2:] if ln.split() and ln.split()[-1] in ("ok", "OFF")}


def test_shipped_mlp_passes_in_float64(trained, capfd):
    assert main(["check", str(trained["mlp"])]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[0] == ("precision float64; step 1e-06, tolerance 1e-04; loss loss; 5 elements per "
                                   "parameter, seed 0")
    assert set(rows(out)) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert all(r[-1] == "ok" and r[2] == "5" for r in rows(out).values())
    assert out.splitlines()[-1] == "all 4 gradients within tolerance"
    assert err == ""


@pytest.mark.parametrize("name, reason", [("cnn", "onnxruntime has no float64 kernel for Conv"),
                                          ("transformer", "onnxruntime has no float64 kernel for Erf")])
def test_float32_fallback_says_why(trained, capfd, name, reason):
    assert main(["check", str(trained[name])]) == 0
    out, _ = capfd.readouterr()
    assert out.splitlines()[0].startswith(f"precision float32 ({reason}); step 1e-03, tolerance 1e-01; ")
    assert all(r[-1] == "ok" for r in rows(out).values())


def test_every_element_of_the_mlp(trained):
    result = check_training_graph(onnx.load(trained["mlp"]), samples=0, seed=3)
    assert [p.checked for p in result.params] == [512, 32, 320, 10]
    assert result.passed and max(p.max_error for p in result.params) < 1e-6


@pytest.mark.parametrize("name, param, factor", [("mlp", "fc1.bias", 1.01), ("mlp", "fc2.weight", -1.0),
                                                 ("cnn", "conv1.weight", 1.5), ("transformer", "ln1.weight", 0.5)])
def test_wrong_gradient_exits_6_with_table_and_report(trained, tmp_path, capfd, name, param, factor):
    bad = tampered(trained[name], param, factor, tmp_path / "bad.onnx")
    report = tmp_path / "check.json"
    assert main(["check", str(bad), "--report", str(report)]) == 6
    out, err = capfd.readouterr()
    table = rows(out)
    assert table[param][-1] == "OFF" and all(r[-1] == "ok" for p, r in table.items() if p != param)
    tol = "0.0001" if name == "mlp" else "0.1"
    assert err == f"onnxgrad: error: 1 of {len(table)} gradients off by more than {tol}: {param}\n"
    r = json.loads(report.read_text())
    assert r["command"] == "check" and r["exit_code"] == 6 and r["passed"] is False
    assert [p["name"] for p in r["parameters"] if not p["ok"]] == [param]


def test_tolerance_flag_and_forced_precision(trained, capfd):
    assert main(["check", str(trained["mlp"]), "--precision", "float32", "--samples", "3", "--seed", "1"]) == 0
    out, _ = capfd.readouterr()
    assert out.startswith("precision float32; step 1e-03, tolerance 1e-01; loss loss; 3 elements per parameter, "
                          "seed 1\n")
    assert main(["check", str(trained["cnn"]), "--precision", "float64"]) == 2
    _, err = capfd.readouterr()
    assert err == "onnxgrad: error: --precision float64: onnxruntime has no float64 kernel for Conv\n"


def test_graph_inputs_non_scalar_heads_and_also_grad(tmp_path, capfd):
    """A gradient w.r.t. a graph input is checked too; a non-scalar loss is seeded through <y>_grad;
    an --also-grad output is listed as not checked."""
    g = h.make_graph([h.make_node("Mul", ["x", "w"], ["z"]), h.make_node("Tanh", ["z"], ["y"])], "m",
                     [h.make_tensor_value_info("x", T.FLOAT, ["N", 3])],
                     [h.make_tensor_value_info("y", T.FLOAT, ["N", 3])],
                     [numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w")])
    src, out_path = tmp_path / "m.onnx", tmp_path / "t.onnx"
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 18)]), src)
    assert main(["-q", "build-grad", str(src), "-o", str(out_path), "--loss", "y", "--requires-grad", "w,x",
                 "--also-grad", "z"]) == 0
    capfd.readouterr()
    assert main(["check", str(out_path), "--dim", "N=3", "--samples", "0"]) == 0
    out, _ = capfd.readouterr()
    table = rows(out)
    assert table["w"][1:3] == ["3", "3"] and table["x"][1:3] == ["3x3", "9"]
    assert "z_grad: not checked (the gradient of an intermediate value)" in out.splitlines()


def test_random_ops_are_refused(tmp_path, capfd):
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"]), h.make_node("Dropout", ["a", "r", "t"], ["d", "mask"]),
                      h.make_node("Neg", ["d"], ["loss"])], inits={"w": 1.0})
    m.graph.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "r"),
                                numpy_helper.from_array(np.array(True), "t")])
    m.graph.input[0].type.tensor_type.shape.dim.add().dim_value = 64
    m.graph.input[0].type.tensor_type.shape.dim.add().dim_value = 64
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 64  # loss is [64, 64], seeded by loss_grad
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 64
    train = onnxgrad.build_gradient(m, loss="loss")
    onnx.save(train, tmp_path / "t.onnx")
    assert main(["check", str(tmp_path / "t.onnx")]) == 2
    _, err = capfd.readouterr()
    assert err == ("onnxgrad: error: the training graph gives different results on the same data (random ops such "
                   "as Dropout in training mode?), so finite differences cannot check it\n")


def test_float64_conversion_covers_constants_and_casts():
    nodes = [h.make_node("Constant", [], ["c"], value_float=0.5),
             h.make_node("Constant", [], ["d"], value=numpy_helper.from_array(np.array(2.0, np.float32))),
             h.make_node("Shape", ["x"], ["s"]),
             h.make_node("ConstantOfShape", ["s"], ["o"], value=h.make_tensor("", T.FLOAT, [1], [1.0])),
             h.make_node("Cast", ["x"], ["xf"], to=T.FLOAT),
             h.make_node("Mul", ["xf", "c"], ["a"]), h.make_node("Mul", ["a", "d"], ["b"]),
             h.make_node("Add", ["b", "o"], ["e"]), h.make_node("Mul", ["e", "w"], ["loss"])]
    m = scalar_model(nodes, inits={"w": 3.0})
    m64 = to_float64(onnxgrad.build_gradient(m))
    types = {i.name: i.type.tensor_type.elem_type for i in list(m64.graph.input) + list(m64.graph.output)}
    assert set(types.values()) == {T.DOUBLE}
    assert {t.data_type for t in m64.graph.initializer} == {T.DOUBLE}
    assert all(a.i == T.DOUBLE for n in m64.graph.node for a in n.attribute if a.name == "to")
    assert not any(a.t.data_type in (T.FLOAT, T.FLOAT16, T.BFLOAT16) for n in m64.graph.node for a in n.attribute
                   if a.type == a.TENSOR)
    result = check_training_graph(onnxgrad.build_gradient(m), samples=0)
    assert result.precision == "float64" and result.passed


def test_numerical_core_on_a_linear_map():
    """onnxgrad.gradcheck, which `onnxgrad check` and the rule tests share, on f(x) = A x (J = A): both
    Jacobians are A, the inner-product test balances, and one element moved by its index equals x ± eps e_j."""
    rng = np.random.default_rng(0)
    a, x = rng.standard_normal((3, 4)), {"x": rng.standard_normal(4), "flag": np.array(True)}

    def f(feeds):
        assert feeds["flag"] is x["flag"]  # inputs without a direction are fed unchanged
        return [a @ feeds["x"]]

    def vjp(c):
        return {"x": a.T @ c[0]}

    def jvp(t):
        return gradcheck.central_difference(f, x, t, 1e-6)
    rows, cols = gradcheck.jacobian(vjp, jvp, {"x": x["x"]}, [(3,)])
    np.testing.assert_array_equal(rows, a)
    np.testing.assert_allclose(cols, a, rtol=1e-8, atol=1e-9)
    t, c = gradcheck.directions(rng, {"x": (4,)}, [(3,)])
    lhs, rhs, scale = gradcheck.inner_product(t, vjp(c), jvp(t), c)
    assert abs(lhs - rhs) <= 1e-8 * max(scale, 1.0) and scale > 0
    value = rng.standard_normal((2, 3)).astype(np.float32)
    unit = np.zeros((2, 3))
    unit[1, 2] = 1.0
    for by_index, along_unit in zip(gradcheck.perturb(value, 5, 1e-3), gradcheck.perturb(value, unit, 1e-3)):
        assert by_index.dtype == np.float32
        np.testing.assert_array_equal(by_index, along_unit)
    assert gradcheck.relative_error(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0


def test_forward_model_keeps_only_what_the_loss_needs(trained):
    fwd = forward_model(onnx.load(trained["mlp"]), ["loss"])
    assert [o.name for o in fwd.graph.output] == ["loss"]
    assert not any(n.output[0].endswith("_grad") for n in fwd.graph.node)
    # the forward nodes of the training graph: the model's own, its cross-entropy written as plain ops
    train = onnx.load(trained["mlp"])
    forward = [n.name for n, p in zip(train.graph.node, model_phases(train)) if p == "forward"]
    assert [n.name for n in fwd.graph.node] == forward
    assert len(forward) > len(onnx.load(MODELS / "mlp.onnx").graph.node)


def test_table_is_deterministic(trained, capfd):
    outs = []
    for _ in range(2):
        assert main(["check", str(trained["transformer"]), "--samples", "3"]) == 0
        outs.append(capfd.readouterr().out)
    assert outs[0] == outs[1]


# -- reports ---------------------------------------------------------------------------------------------------
# The documented schema (README, "Reports"): every report has these keys, then the command's own.
COMMON = {"report_version": int, "command": str, "onnxgrad_version": str}
SCHEMA = {
    "build-grad": {"input": str, "output": str, "loss": str, "parameters": list, "also_grad": list, "outputs": list,
                   "source_opset": int, "opset": int, "ir_version": int, "forward_nodes": int,
                   "backward_nodes": int, "rules_used": dict, "seconds": float},
    "run": {"input": str, "steps": list},
    "ops": {"rules": list, "non_differentiable": list},
    "check": {"input": str, "exit_code": int, "loss": list, "precision": str, "fallback_reason": (str, type(None)),
              "step": float, "tol": float, "seed": int, "samples": int, "loss_value": float, "parameters": list,
              "unchecked": list, "passed": bool},
}
PARAM_ROW = {"name": str, "shape": list, "checked": int, "max_error": float, "worst_index": list, "backprop": float,
             "finite_difference": float, "ok": bool}
RULE_ROW = {"op": str, "since": int, "until": (int, type(None)), "inputs": (list, type(None)), "limits": str}


def assert_schema(obj: dict, schema: dict):
    for key, kind in schema.items():
        assert key in obj, f"report lacks {key!r}"
        assert isinstance(obj[key], kind), f"{key}: {obj[key]!r} is not {kind}"


def test_every_subcommand_writes_a_report_of_the_documented_schema(tmp_path, capfd):
    src = tmp_path / "m.onnx"
    onnx.save(affine(), src)
    train = tmp_path / "t.onnx"
    commands = {
        "build-grad": ["build-grad", str(src), "-o", str(train)],
        "run": ["run", str(train), "--steps", "2"],
        "ops": ["ops"],
        "check": ["check", str(train)],
    }
    for command, args in commands.items():
        report = tmp_path / f"{command}.json"
        assert main(args + ["--report", str(report)]) == 0, capfd.readouterr().err
        r = json.loads(report.read_text())
        assert_schema(r, COMMON)
        assert r["command"] == command and r["report_version"] == 1 and r["onnxgrad_version"] == onnxgrad.__version__
        assert_schema(r, SCHEMA[command])
    r = json.loads((tmp_path / "check.json").read_text())
    for row in r["parameters"]:
        assert_schema(row, PARAM_ROW)
    r = json.loads((tmp_path / "ops.json").read_text())
    for row in r["rules"]:
        assert_schema(row, RULE_ROW)
    assert {"op": "Mul", "since": 13, "until": None, "inputs": None, "limits": ""} in r["rules"]
    assert all(set(row) == {"op", "why"} for row in r["non_differentiable"])
    assert set(json.loads((tmp_path / "run.json").read_text())["steps"][0]) == {"loss", "grad_norms"}


def test_quiet_and_verbose_keep_results_on_stdout(tmp_path, capfd):
    src = tmp_path / "m.onnx"
    onnx.save(affine(), src)
    assert main(["-q", "build-grad", str(src), "-o", str(tmp_path / "q.onnx")]) == 0
    out, err = capfd.readouterr()
    assert out == f"{tmp_path / 'q.onnx'}\n" and err == ""
    assert main(["build-grad", str(src), "-o", str(tmp_path / "n.onnx")]) == 0
    out, err = capfd.readouterr()
    assert out == f"{tmp_path / 'n.onnx'}\n" and len(err.splitlines()) == 1 and err.startswith("onnxgrad: ")
    assert main(["-q", "check", str(tmp_path / "q.onnx")]) == 0
    out, err = capfd.readouterr()
    assert out.splitlines()[-1] == "all 2 gradients within tolerance" and err == ""


# -- determinism -----------------------------------------------------------------------------------------------
SCRIPT = """
import sys
from onnxgrad.cli import main
models = sys.argv[1]
for name in ("mlp", "cnn", "transformer"):
    assert main(["-q", "build-grad", f"{models}/{name}.onnx", "-o", f"{name}_train.onnx"]) == 0
    assert main(["-q", "check", f"{name}_train.onnx", "--samples", "2", "--report", f"{name}.json"]) == 0
"""


def test_shipped_models_byte_identical_across_processes(tmp_path):
    """Two processes with different hash seeds write the same bytes: training graphs, check tables, reports."""
    root = Path(__file__).parent.parent
    outputs = []
    for seed in ("1", "2"):
        out = tmp_path / seed
        out.mkdir()
        env = {"PYTHONHASHSEED": seed, "PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(root)}
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(MODELS)], cwd=out, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
        files = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        outputs.append((files, proc.stdout))
    (files1, stdout1), (files2, stdout2) = outputs
    assert sorted(files1) == sorted(f"{n}{s}" for n in ("mlp", "cnn", "transformer")
                                    for s in ("_train.onnx", ".json"))
    for name in files1:
        assert files1[name] == files2[name], f"{name} differs between processes"
    assert stdout1 == stdout2 and stdout1.count("within tolerance") == 3
