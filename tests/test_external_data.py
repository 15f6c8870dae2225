"""Models with external data, and weights kept apart from the proto during a build (onnxgrad/weights.py).

The > 2 GB case itself is measured by bench/bench_large.py, not here: these models are a few KB.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxgrad import api, io, loader, weights
from onnxgrad.cli import main

W1 = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
W2 = np.random.default_rng(1).standard_normal((32, 1)).astype(np.float32)
X = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)


def mlp() -> onnx.ModelProto:
    """loss = sum(relu(x @ W1 + b) @ W2): W1 (2 KB) is large enough to go to external data, W2 and b not."""
    inits = [numpy_helper.from_array(W1, "W1"), numpy_helper.from_array(W2, "W2"),
             numpy_helper.from_array(np.full(32, 0.1, np.float32), "b")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def expected_grads() -> dict[str, np.ndarray]:
    a = X @ W1 + 0.1
    h = np.maximum(a, 0)
    gh = np.ones((4, 1)) @ W2.T
    ga = gh * (a > 0)
    return {"W1": X.T @ ga, "W2": h.T @ np.ones((4, 1)), "b": ga.sum(0)}


@pytest.fixture
def external_model(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(mlp(), path, save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path


def run(path) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": X})))


def test_build_grad_of_an_external_data_model_writes_external_data(external_model, tmp_path):
    out = tmp_path / "train.onnx"
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "build-grad", str(external_model), "-o", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "train.onnx", "train.onnx.data", "weights.bin"]
    umask = os.umask(0)
    os.umask(umask)
    assert {(tmp_path / n).stat().st_mode & 0o777 for n in ("train.onnx", "train.onnx.data")} == {0o666 & ~umask}
    header = onnx.load(str(out), load_external_data=False)
    where = {t.name: {e.key: e.value for e in t.external_data} for t in header.graph.initializer}
    assert where["W1"]["location"] == "train.onnx.data" and int(where["W1"]["length"]) == W1.nbytes
    assert where["W2"] == {} and where["b"] == {}  # under 1 KiB: inline, as onnx.save does by default
    onnx.checker.check_model(str(out), full_check=True)
    loaded = onnx.load(str(out))
    np.testing.assert_array_equal(numpy_helper.to_array(loaded.graph.initializer[0]), W1)
    got = run(out)
    for name, g in expected_grads().items():
        np.testing.assert_allclose(got[name + "_grad"], g, rtol=1e-5, atol=1e-5)


def test_external_data_flag_and_the_in_file_output_agree(tmp_path):
    src = tmp_path / "model.onnx"
    onnx.save(mlp(), src)
    single, split = tmp_path / "single.onnx", tmp_path / "split.onnx"
    assert main(["build-grad", str(src), "-o", str(single)]) == 0
    assert main(["build-grad", str(src), "-o", str(split), "--external-data"]) == 0
    assert not (tmp_path / "single.onnx.data").exists() and (tmp_path / "split.onnx.data").exists()
    a, b = onnx.load(str(single)), onnx.load(str(split))
    for t in b.graph.initializer:  # onnx.load marks the tensors it loaded as DEFAULT explicitly
        t.ClearField("data_location")
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert single.read_bytes() == api.build_gradient(mlp()).SerializeToString(deterministic=True)


def test_an_existing_data_file_is_replaced_and_the_input_data_is_never_overwritten(external_model, tmp_path):
    out = tmp_path / "train.onnx"
    (tmp_path / "train.onnx.data").write_bytes(b"old data")
    assert main(["build-grad", str(external_model), "-o", str(out)]) == 0
    assert onnx.load(out).graph.output and (tmp_path / "train.onnx.data").read_bytes() != b"old data"
    # a model whose data file is called <out>.data: writing <out> would destroy the input's weights
    victim = tmp_path / "victim.onnx"
    onnx.save(mlp(), victim, save_as_external_data=True, location="other.onnx.data", size_threshold=0)
    before = (tmp_path / "other.onnx.data").read_bytes()
    assert main(["build-grad", str(victim), "-o", str(tmp_path / "other.onnx"), "--force"]) == 2
    assert (tmp_path / "other.onnx.data").read_bytes() == before
    assert not (tmp_path / "other.onnx").exists()


def test_a_failed_write_leaves_neither_file_nor_temp(external_model, tmp_path, monkeypatch):
    def full_disk(t):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(weights, "raw_bytes", full_disk)
    assert main(["build-grad", str(external_model), "-o", str(tmp_path / "train.onnx")]) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "weights.bin"]


def test_missing_or_short_data_file_is_an_invalid_model(external_model, tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(data.read_bytes()[:100])
    assert main(["build-grad", str(external_model), "-o", str(tmp_path / "t.onnx")]) == 3
    data.unlink()
    assert main(["build-grad", str(external_model), "-o", str(tmp_path / "t.onnx")]) == 3


def test_build_keeps_weights_apart_and_leaves_the_input_alone():
    model = mlp()
    before = model.SerializeToString()
    result = api.build(model, weights_apart=True)
    assert model.SerializeToString() == before
    stubs = weights.stubs(result.model)
    assert [t.name for t in stubs] == ["W1"] and not stubs[0].HasField("raw_data")
    assert result.weights["W1"] is model.graph.initializer[0]  # the caller's tensor itself, not a copy
    weights.check_model(result.model, full_check=True)
    with pytest.raises(Exception):
        onnx.checker.check_model(result.model)  # the stub's file exists only in check_model's folder
    joined = api.build_gradient(model)
    assert not weights.stubs(joined)
    weights.join(result.model, result.weights)
    assert result.model.SerializeToString(deterministic=True) == joined.SerializeToString(deterministic=True)


def test_split_skeleton_goes_through_the_loader():
    skeleton, held = weights.split(mlp())
    assert list(held) == ["W1"] and skeleton.ByteSize() < 1024
    loader.check(skeleton)
    old = onnx.ModelProto()
    old.CopyFrom(skeleton)
    old.opset_import[0].version = 11
    upgraded = loader.infer_shapes(loader.upgrade_opset(old))
    assert weights.stubs(upgraded)[0].name == "W1"  # the converter and shape inference keep the stub


def test_save_model_streams_stubs(tmp_path):
    result = api.build(mlp(), weights_apart=True)
    out = tmp_path / "t.onnx"
    io.save_model(result.model, out, weights=result.weights, external_data=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.onnx", "t.onnx.data"]
    assert os.path.getsize(tmp_path / "t.onnx.data") == W1.nbytes
    got = run(out)
    np.testing.assert_allclose(got["W1_grad"], expected_grads()["W1"], rtol=1e-5, atol=1e-5)
