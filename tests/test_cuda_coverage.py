"""Every node onnxgrad writes has a kernel in onnxruntime's CUDA provider, in a form the provider accepts.

A node without one runs on the CPU provider, with copies across the bus both ways, and nothing says so. The
table of CUDA kernels and refused forms is onnxgrad/cuda.py (its source is named there). Checked here: the
backward nodes of every rule case, and the nodes onnxgrad adds to the shipped models and to the real-export
models (gradient, loss, optimizer). Nodes of the forward model itself are the model's own (a Pad of int64
labels; a SoftmaxCrossEntropyLoss is written as plain ops): `build-grad --verbose` names them, and the tests here list the ones they meet.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import onnxgrad
from gradcheck import _build, _model, float_outputs
from onnxgrad.cuda import cuda_coverage, cuda_fallbacks, fallback_nodes, node_fallback
from test_rules import ALL_CASES

MODELS_DIR = Path(__file__).resolve().parents[1] / "models"
# The forward models' own nodes that the CUDA provider has no kernel for (the training build has one).
# (their SoftmaxCrossEntropyLoss is written as plain ops, which the CUDA provider has)
FORWARD_FALLBACKS = {"mlp": set(), "cnn": set(), "transformer": set()}


def added_fallbacks(forward: onnx.ModelProto, train: onnx.ModelProto) -> list[str]:
    """Fallback nodes of `train` that are not nodes of `forward` (matched by name: onnxgrad keeps them)."""
    own = {n.name for n in forward.graph.node}
    return [str(f) for f in fallback_nodes(train) if f.node.split("/")[0] not in own]


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_backward_nodes_of_every_rule_case_run_on_cuda(case):
    fwd, wrt = _model(case, np.float32)
    train = _build(fwd, float_outputs(fwd), wrt)
    assert not added_fallbacks(fwd, train)


@pytest.mark.parametrize("name", sorted(FORWARD_FALLBACKS))
@pytest.mark.parametrize("optimizer", [None, "sgd", "adamw"])
def test_shipped_models_training_and_step_graphs(name, optimizer):
    fwd = onnx.load(str(MODELS_DIR / f"{name}.onnx"))
    train = onnxgrad.build_gradient(fwd, optimizer=optimizer)
    assert not added_fallbacks(fwd, train)
    assert {f.op_type for f in fallback_nodes(train)} == FORWARD_FALLBACKS[name]
    ran, total = cuda_coverage(train)
    assert total - ran == sum(f.op_type in FORWARD_FALLBACKS[name] for f in fallback_nodes(train))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_backward_nodes_of_every_rule_case_run_on_cuda_in_half_precision(case, precision):
    """build-grad --precision: the casts, the half-precision forward and its backward (fed head gradients, so no
    loss scale)."""
    fwd, wrt = _model(case, np.float32)
    train = onnxgrad.build(fwd, loss=float_outputs(fwd), requires_grad=wrt, feed_head_grads=True,
                           precision=precision, loss_scale="none").model
    assert not added_fallbacks(fwd, train)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", sorted(FORWARD_FALLBACKS))
@pytest.mark.parametrize("optimizer", [None, "sgd", "adamw"])
def test_shipped_models_half_precision_graphs(name, optimizer, precision):
    """The training and step graphs of --precision fp16 (with dynamic loss scaling) and bf16."""
    fwd = onnx.load(str(MODELS_DIR / f"{name}.onnx"))
    train = onnxgrad.build_gradient(fwd, optimizer=optimizer, precision=precision)
    assert any(vi.type.tensor_type.elem_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
               for vi in train.graph.value_info)
    assert not added_fallbacks(fwd, train)
    assert {f.op_type for f in fallback_nodes(train)} == FORWARD_FALLBACKS[name]


def test_appended_cross_entropy_runs_on_cuda():
    """The appended cross-entropy is a SoftmaxCrossEntropyLoss node, which the CUDA provider has no kernel for; the
    build writes it as plain ops."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 5])
    w = onnx.numpy_helper.from_array(np.ones((3, 5), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["logits"], name="mm")], "g", [x], [logits], [w])
    fwd = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    train = onnxgrad.build_gradient(fwd, loss_fn="cross-entropy", target="logits")
    assert not added_fallbacks(fwd, train)


# -- the real-export models (torch.onnx, dynamo) --------------------------------------------------------------

@pytest.fixture(scope="module")
def real_exports(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import real_models
    out = {}
    for name in real_models.MODELS:
        model, args = real_models.make(name)
        path = str(tmp_path_factory.mktemp(name) / f"{name}.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, args, path, dynamo=True, optimize=True)
        out[name] = onnx.load(path)
    return out


def test_real_export_models_backward_runs_on_cuda(real_exports):
    problems = {}
    for name, fwd in real_exports.items():
        lines = added_fallbacks(fwd, onnxgrad.build_gradient(fwd))
        if lines:
            problems[name] = lines
    assert not problems


def test_real_export_models_half_precision_backward_runs_on_cuda(real_exports):
    problems = {}
    for name, fwd in real_exports.items():
        for precision in ("fp16", "bf16"):
            lines = added_fallbacks(fwd, onnxgrad.build_gradient(fwd, precision=precision))
            if lines:
                problems[f"{name} {precision}"] = lines
    assert not problems


# -- the table and the refused forms ---------------------------------------------------------------------------


def test_asymmetric_conv_transpose_is_refused_and_symmetric_runs():
    types = {"x": TensorProto.FLOAT, "w": TensorProto.FLOAT, "y": TensorProto.FLOAT}
    asym = helper.make_node("ConvTranspose", ["x", "w"], ["y"], pads=[1, 1, 0, 0], strides=[2, 2])
    sym = helper.make_node("ConvTranspose", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2],
                           output_padding=[1, 1])
    same = helper.make_node("ConvTranspose", ["x", "w"], ["y"], auto_pad="SAME_UPPER", strides=[2, 2])
    assert "asymmetric pads" in node_fallback(asym, 18, types)
    assert node_fallback(sym, 18, types) is None
    assert "auto_pad" in node_fallback(same, 18, types)


def test_types_versions_and_missing_ops():
    f32, i64, f64 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.DOUBLE
    pad = helper.make_node("Pad", ["a", "p"], ["b"])
    assert node_fallback(pad, 18, {"a": f32, "p": i64, "b": f32}) is None
    assert "T=int64" in node_fallback(pad, 18, {"a": i64, "p": i64, "b": i64})
    where = helper.make_node("Where", ["c", "a", "b"], ["y"])
    assert "T=bool" in node_fallback(where, 18, {"c": TensorProto.BOOL, "a": TensorProto.BOOL,
                                                 "b": TensorProto.BOOL, "y": TensorProto.BOOL})
    gelu = helper.make_node("Gelu", ["a"], ["b"])
    assert node_fallback(gelu, 20, {"a": f64, "b": f64}) is None
    sce = helper.make_node("SoftmaxCrossEntropyLoss", ["s", "l"], ["z"])
    assert "no CUDA kernel" in node_fallback(sce, 18, {"s": f32, "l": i64, "z": f32})
    clip = helper.make_node("Clip", ["a"], ["b"])
    assert "T=int32" in node_fallback(clip, 18, {"a": TensorProto.INT32, "b": TensorProto.INT32})
    assert node_fallback(helper.make_node("Constant", [], ["c"], value_float=1.0), 18, {}) is None


def test_fallback_lines_name_node_and_phase():
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.INT64, [2, 5])
    pads = onnx.numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads")
    graph = helper.make_graph([helper.make_node("Pad", ["x", "pads"], ["y"], name="pad_labels")], "g", [x], [y],
                              [pads])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    model.metadata_props.add(key="onnxgrad.phases", value='[["forward",1]]')
    assert cuda_fallbacks(model) == ["Pad node 'pad_labels' [forward]: no CUDA kernel for the types T=int64"]
    assert cuda_coverage(model) == (0, 1)


# -- bench/gpu_check.py, the parts that need no GPU ------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_check():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_names_missing_libraries_and_the_pip_line(gpu_check):
    assert gpu_check.cuda_major("13.0") == 13 and gpu_check.cuda_major(None) == 12
    present = {"libcuda.so.1", "libcudart.so.13", "libcurand.so.10"}

    def load(name):
        if name not in present:
            raise OSError(name)
    missing = gpu_check.missing_libraries(13, load)
    assert missing == ["libcublas.so.13", "libcublasLt.so.13", "libcudnn.so.9"]
    assert gpu_check.install_command("1.31.1", 13, missing) == \
        'pip install onnxruntime-gpu==1.31.1 "nvidia-cublas~=13.0" "nvidia-cudnn-cu13~=9.0"'


def test_gpu_check_reads_placement_memory_and_prints_one_table(gpu_check):
    events = [{"cat": "Node", "name": f"{n}_kernel_time",
               "args": {"provider": p, "op_name": op, "output_type_shape": [{t: [2]}]}}
              for n, p, op, t in [("a", "CUDAExecutionProvider", "Conv", "float"),
                                  ("b", "CPUExecutionProvider", "Shape", "int64"),
                                  ("c", "CPUExecutionProvider", "SoftmaxCrossEntropyLoss", "float"),
                                  ("c", "CPUExecutionProvider", "SoftmaxCrossEntropyLoss", "float"),
                                  ("d", "CPUExecutionProvider", "MemcpyToHost", "float")]]
    by_provider = gpu_check.placement(events)
    assert by_provider["CUDAExecutionProvider"] == {"Conv": 1}
    assert gpu_check.cpu_nodes(by_provider) == ({"SoftmaxCrossEntropyLoss": 1}, {"Shape": 1})
    assert gpu_check.parse_compute_apps("12, 300\n7, 1024\n7, 10\n", 7) == 1034.0
    assert gpu_check.parse_compute_apps("12, 300\n", 7) is None
    table = gpu_check.format_table([{"model": "mlp", "table_fallbacks": "none", "cpu_nodes": {}, "grad_error": 1e-7,
                                     "ours_ms": 1.5, "torch_ms": 2.0, "ratio": 0.75, "ours_mib": 100.0,
                                     "torch_mib": None, "cli": "ok"}, {"model": "cnn", "cli": "failed: X"}])
    lines = table.splitlines()
    assert len(lines) == 4 and "| mlp | none | none | 1.0e-07 | 1.50 | 2.00 | 0.75x | 100 | n/a | ok |" == lines[2]
    assert lines[3].startswith("| cnn | n/a | none | n/a |")


def _loop_models():
    from test_control_flow import _make
    from test_loops import loop_graph, scan_graph
    return {"scan": (_make(scan_graph(in_dirs=(1, 0), out_axes=(1, 0)), np.float32, 18), ["x", "z", "a0", "w", "v"]),
            "loop": (_make(loop_graph("input", "data"), np.float32, 13), ["x", "h0", "w"])}


@pytest.mark.parametrize("name", ["scan", "loop"])
def test_scan_and_loop_training_graphs_run_on_cuda(name):
    """The forward loop with its stacked carries and the backward loop, bodies included, have CUDA kernels."""
    fwd, wrt = _loop_models()[name]
    train = onnxgrad.build(fwd, requires_grad=wrt).model
    assert not added_fallbacks(fwd, train)
    assert not fallback_nodes(train)
    ran, total = cuda_coverage(train)
    assert ran == total and total > 2 * len(fwd.graph.node)


def test_gpu_check_sets_half_precision_rows_against_float32(gpu_check):
    rows = [{"model": "mlp", "precision": "fp32", "ours_ms": 2.0, "ours_mib": 100.0, "torch_ms": 4.0,
             "torch_mib": 50.0},
            {"model": "mlp fp16", "precision": "fp16", "ours_ms": 1.0, "ours_mib": 60.0, "torch_ms": 2.0,
             "torch_mib": None},
            {"model": "cnn bf16", "precision": "bf16", "cli": "failed: X"}]
    lines = gpu_check.format_precision_table(rows).splitlines()
    assert lines[2] == "| mlp | fp16 | 0.50x | 0.60x | 0.50x | n/a |"
    assert lines[3] == "| cnn | bf16 | n/a | n/a | n/a | n/a |"
    skipped = gpu_check.check_model("mlp", 1, 1, 0.01, False, device="cpu", precision="fp16")
    assert skipped["model"] == "mlp fp16" and skipped["cli"].startswith("skipped: the CPU provider")


def test_gpu_check_runs_a_budgeted_graph_as_the_sessions_do(gpu_check):
    """Step 4's row on the CPU provider (the dry run): the graph planned for each allocator runs within its
    budget as onnxgrad's sessions run it, beside the budget and the emulated arena."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    rows = [gpu_check.check_budget("gpt", "0.7x", allocator, runs=2, device="cpu") for allocator in ("exact", "arena")]
    for row in rows:
        assert row["runs"] == "ran" and 0 < row["budget_mib"] and 0 < row["emulated_arena_mib"]
    table = gpu_check.format_budget_table(rows)
    assert table.count("\n") == 3 and "| gpt | 0.7x | arena |" in table
