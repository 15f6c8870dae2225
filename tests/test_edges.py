"""The edges of the command line: outputs that would destroy an input, IR 14 models, data files and
checkpoints that cannot be read, checks that must come before the work, flags that must not be ignored, the
conventional invocations, start-up, and what the sweep and memory commands print."""
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
from onnxgrad.cli import main
from test_bad_input import assert_one_line_error, snapshot
from test_external_data import mlp

MODELS = Path(__file__).resolve().parent.parent / "models"
README = Path(__file__).resolve().parent.parent / "README.md"


def rows_data(rows: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """Data for models/mlp.onnx's step graph: x[rows, 16] and labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    return {"x": x, "labels": (x @ rng.standard_normal((16, 10))).argmax(1).astype(np.int64)}


@pytest.fixture(scope="module")
def step_proto():
    return onnxgrad.build_gradient(MODELS / "mlp.onnx", optimizer="sgd", optimizer_options={"lr": 0.1})


@pytest.fixture
def step(tmp_path, step_proto):
    path, data = tmp_path / "step.onnx", tmp_path / "data.npz"
    onnx.save(step_proto, path)
    np.savez(data, **rows_data())
    return path, data


def run(capfd, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capfd.readouterr()
    return code, out, err


# -- 1. no output lands on a file an input reads ---------------------------------------------------------------
def external(tmp_path: Path, name: str = "tnet.onnx", location: str | None = None, model=None) -> Path:
    """A model whose weights live in an external-data file (as torch.onnx writes large models)."""
    path = tmp_path / name
    copy = onnx.ModelProto()
    copy.CopyFrom(model or mlp())  # onnx.save moves the weights of the proto it is given out to the file
    onnx.save(copy, path, save_as_external_data=True, location=location or f"{name}.data", size_threshold=0)
    return path


@pytest.mark.parametrize("args", [
    ["build-grad", "{m}", "-o", "{d}"],
    ["mirror", "{m}", "-o", "{d}"],
    ["build-grad", "{m}", "-o", "{dir}/t.onnx", "--report", "{d}"],
    ["mirror", "{m}", "-o", "{dir}/t.onnx", "--sweep", "{d}"],
    ["memory", "{m}", "--plot", "{d}"],
    ["memory", "{m}", "--report", "{d}"],
    ["materialize", "{m}", "-o", "{d}"],
], ids=["build-grad-o", "mirror-o", "build-grad-report", "mirror-sweep", "memory-plot", "memory-report",
        "materialize-o"])
def test_no_writer_overwrites_the_input_models_external_data(tmp_path, capfd, args):
    model = external(tmp_path)
    names = {"m": model, "d": tmp_path / "tnet.onnx.data", "dir": tmp_path}
    before = snapshot(tmp_path)
    code, out, err = run(capfd, *[a.format(**names) for a in args])
    assert_one_line_error(code, out, err, 2, f"{tmp_path}/tnet.onnx.data: is the external data of the input model "
                                             f"{model}; choose another output path")
    assert snapshot(tmp_path) == before


def test_training_graph_commands_refuse_its_external_data(tmp_path, capfd):
    train = tmp_path / "train.onnx"
    onnx.save(onnxgrad.build_gradient(mlp()), train, save_as_external_data=True, location="train.bin",
              size_threshold=0)
    before = snapshot(tmp_path)
    for args in (["run", train, "--report", tmp_path / "train.bin"], ["check", train, "--report", tmp_path / "train.bin"],
                 ["split", train, "-o", tmp_path]):
        code, out, err = run(capfd, *args)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert snapshot(tmp_path) == before


def test_train_refuses_the_data_of_its_step_and_forward_models(tmp_path, capfd, step_proto):
    sub = tmp_path / "sub"
    sub.mkdir()
    step = external(sub, "tstep.onnx", model=step_proto)
    forward = external(tmp_path, "fwd.onnx", model=onnx.load(MODELS / "mlp.onnx"))
    data = tmp_path / "d.npz"
    np.savez(data, **rows_data())
    before = snapshot(tmp_path)
    for flag, target, model in (("--checkpoint", sub / "tstep.onnx.data", step),
                                ("--report", sub / "tstep.onnx.data", step),
                                ("--export", tmp_path / "fwd.onnx.data", forward)):
        extra = ["--export", tmp_path / "e.onnx"] if flag != "--export" else []
        code, out, err = run(capfd, "train", step, "--data", data, "--steps", 2, flag, target, *extra,
                             "--forward", forward)
        assert_one_line_error(code, out, err, 2, f"{target}: is the external data of the input model {model}; "
                                                 f"choose another output path")
        assert snapshot(tmp_path) == before


def test_split_refuses_a_step_graph_whose_data_is_named_like_its_outputs(tmp_path, capfd, step_proto):
    step = external(tmp_path, "step.onnx", location="gradient.onnx", model=step_proto)
    before = snapshot(tmp_path)
    code, out, err = run(capfd, "split", step, "-o", tmp_path)
    assert_one_line_error(code, out, err, 2, f"{tmp_path}/gradient.onnx: is the external data of the input model "
                                             f"{step}; choose another output path")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["build-grad", "mirror"])
def test_the_outputs_own_external_data_never_lands_on_the_inputs(tmp_path, capfd, command):
    """-o out.onnx writes out.onnx.data: refused when that is the input's data file, before any work."""
    model = external(tmp_path, "victim.onnx", location="out.onnx.data")
    before = snapshot(tmp_path)
    code, out, err = run(capfd, command, model, "-o", tmp_path / "out.onnx", "--external-data")
    assert_one_line_error(code, out, err, 2, f"{tmp_path}/out.onnx.data: is the external data of the input model "
                                             f"{model}; choose another output path")
    assert snapshot(tmp_path) == before


def test_one_output_per_path_and_inputs_named_for_what_they_are(tmp_path, capfd, step):
    model = tmp_path / "m.onnx"
    onnx.save(mlp(), model)
    code, out, err = run(capfd, "mirror", model, "-o", tmp_path / "o.onnx", "--sweep", tmp_path / "o.onnx")
    assert_one_line_error(code, out, err, 2, f"--sweep {tmp_path}/o.onnx: is the output model; choose another path")
    path, data = step
    code, out, err = run(capfd, "train", path, "--data", data, "--export", data)
    assert_one_line_error(code, out, err, 2, f"{data}: is the --data file; choose another output path")
    # --checkpoint may be the --resume file: resuming in place is the usual way
    ck = tmp_path / "ck.npz"
    assert run(capfd, "train", path, "--data", data, "--steps", 2, "--checkpoint", ck)[0] == 0
    assert run(capfd, "train", path, "--data", data, "--steps", 3, "--checkpoint", ck, "--resume", ck)[0] == 0
    code, out, err = run(capfd, "train", path, "--data", data, "--steps", 4, "--resume", ck, "--report", ck)
    assert_one_line_error(code, out, err, 2, f"{ck}: is the --resume checkpoint; choose another output path")


# -- 2. IR version 14 (onnx 1.23's default) works everywhere ---------------------------------------------------
def ir14(model: onnx.ModelProto) -> onnx.ModelProto:
    model.ir_version = 14
    return model


def test_ir14_models_work_with_every_command(tmp_path, capfd):
    assert onnx.IR_VERSION >= 14 or pytest.fail("this test needs onnx >= 1.23")
    fwd, tr = tmp_path / "fwd.onnx", tmp_path / "transformer.onnx"
    onnx.save(ir14(onnx.load(MODELS / "mlp.onnx")), fwd)
    onnx.save(ir14(onnx.load(MODELS / "transformer.onnx")), tr)  # --cost profile: no op onnxruntime expands
    train, step = tmp_path / "train.onnx", tmp_path / "step.onnx"
    onnx.save(ir14(onnxgrad.build_gradient(fwd)), train)
    onnx.save(ir14(onnxgrad.build_gradient(fwd, optimizer="sgd")), step)
    data = tmp_path / "d.npz"
    np.savez(data, **rows_data())
    zoo = tmp_path / "zoo.onnx"
    g = h.make_graph([h.make_node("ConstantOfShape", ["s"], ["w"], value=h.make_tensor("v", T.FLOAT, [1], [0.02])),
                      h.make_node("MatMul", ["x", "w"], ["y"])], "zoo", [h.make_tensor_value_info("x", T.FLOAT, [2, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, 3])], [numpy_helper.from_array(np.array([4, 3]), "s")])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), zoo)
    assert {onnx.load(p).ir_version for p in (fwd, train, step, zoo)} == {14}
    commands = [
        ["build-grad", fwd, "-o", tmp_path / "a.onnx", "--dim", "N=8"],
        ["mirror", fwd, "-o", tmp_path / "b.onnx", "--dim", "N=8"],
        ["mirror", tr, "-o", tmp_path / "c.onnx", "--dim", "N=8", "--budget", "auto", "--cost", "profile"],
        ["memory", train, "--dim", "N=8"],
        ["run", train, "--steps", "2"],
        ["check", train],
        ["train", step, "--data", data, "--steps", "2", "--export", tmp_path / "e.onnx", "--forward", fwd],
        ["split", step, "-o", tmp_path / "parts"],
        ["materialize", zoo, "-o", tmp_path / "z.onnx"],
    ]
    for args in commands:
        code, out, err = run(capfd, "-q", *args)
        assert code == 0 and err == "", (args, err)
    import onnxruntime as ort
    ort.InferenceSession(str(tmp_path / "z.onnx"), providers=["CPUExecutionProvider"])  # materialize: a runnable IR


def test_profile_costs_of_an_ir14_graph_in_a_fresh_process(tmp_path):
    """No stray onnxruntime log line (it printed one when the profiled session refused the model)."""
    fwd = tmp_path / "fwd.onnx"
    onnx.save(ir14(onnx.load(MODELS / "transformer.onnx")), fwd)
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "-q", "mirror", str(fwd), "-o", str(tmp_path / "t.onnx"),
                           "--dim", "N=8", "--budget", "auto", "--cost", "profile"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout == f"{tmp_path}/t.onnx\n"


# -- 3. data files and checkpoints that cannot be read; labels; NaN ----------------------------------------------
BAD_NPZ = {
    "empty": lambda good: b"",
    "truncated": lambda good: good[: len(good) // 2],
    "garbage": lambda good: b"PK\x03\x04 not really a zip",
    "npy": None,  # a lone .npy array
}


@pytest.mark.parametrize("flag", ["--data", "--resume"])
@pytest.mark.parametrize("how", list(BAD_NPZ))
def test_unreadable_data_and_checkpoints_are_one_line_exit_2(tmp_path, capfd, step, flag, how):
    path, data = step
    bad = tmp_path / "bad.npz"
    if how == "npy":
        np.save(tmp_path / "bad.npy", rows_data()["x"])
        bad = tmp_path / "bad.npy"
    else:
        ck = tmp_path / "ck.npz"
        assert main(["train", str(path), "--data", str(data), "--steps", "1", "--checkpoint", str(ck)]) == 0
        good = (ck if flag == "--resume" else data).read_bytes()
        bad.write_bytes(BAD_NPZ[how](good))
    capfd.readouterr()
    args = ["train", path, "--data", bad if flag == "--data" else data, "--steps", 2]
    if flag == "--resume":
        args += ["--resume", bad]
    before = snapshot(tmp_path)
    code, out, err = run(capfd, *args, "--checkpoint", tmp_path / "new.npz")
    assert_one_line_error(code, out, err, 2, None)
    assert err.startswith(f"onnxgrad: error: {flag} {bad}: "), err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("how", list(BAD_NPZ))
def test_run_with_unreadable_data(tmp_path, capfd, how):
    train = tmp_path / "t.onnx"
    onnx.save(onnxgrad.build_gradient(MODELS / "mlp.onnx"), train)
    bad = tmp_path / "bad.npz"
    if how == "npy":
        np.save(bad.with_suffix(".npy"), rows_data()["x"])
        bad = bad.with_suffix(".npy")
    else:
        np.savez(bad, **rows_data())
        bad.write_bytes(BAD_NPZ[how](bad.read_bytes()))
    code, out, err = run(capfd, "run", train, "--data", bad)
    assert_one_line_error(code, out, err, 2, None)
    assert err.startswith(f"onnxgrad: error: --data {bad}: "), err


def test_an_empty_file_is_not_an_interrupt(tmp_path):
    """It used to exit 130 "interrupted" (click turns an EOFError into an abort)."""
    step = tmp_path / "s.onnx"
    onnx.save(onnxgrad.build_gradient(MODELS / "mlp.onnx", optimizer="sgd"), step)
    (tmp_path / "empty.npz").write_bytes(b"")
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "train", str(step), "--data", str(tmp_path / "empty.npz")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == f"onnxgrad: error: --data {tmp_path}/empty.npz: empty file, not " \
                                                   f"an .npz archive\n", proc.stderr


def test_labels_out_of_range_are_named_before_the_first_step(tmp_path, capfd, step):
    path, data = step
    arrays = rows_data()
    arrays["labels"] = arrays["labels"] + 100          # 100..109 for 10 classes
    np.savez(data, **arrays)
    ck = tmp_path / "ck.npz"
    code, out, err = run(capfd, "train", path, "--data", data, "--checkpoint", ck)
    want = arrays["labels"][0]
    assert_one_line_error(code, out, err, 2, f"--data {data}: 'labels' holds {want} at index [0], not a class index "
                                             f"in [0, 10) of the cross-entropy's 10 classes")
    assert not ck.exists()
    arrays["labels"] = np.where(np.arange(64) % 2 == 0, -100, rows_data()["labels"])   # the ignore_index passes
    np.savez(data, **arrays)
    ignoring = tmp_path / "ignoring.onnx"
    onnx.save(_ignore_index_step(), ignoring)
    assert run(capfd, "train", ignoring, "--data", data, "--steps", 2)[0] == 0


def _ignore_index_step() -> onnx.ModelProto:
    """models/mlp.onnx's step graph with ignore_index -100 on its SoftmaxCrossEntropyLoss."""
    m = onnx.load(MODELS / "mlp.onnx")
    for n in m.graph.node:
        if n.op_type == "SoftmaxCrossEntropyLoss":
            n.attribute.append(h.make_attribute("ignore_index", -100))
    return onnxgrad.build_gradient(m, optimizer="sgd")


def test_run_checks_labels_too(tmp_path, capfd):
    train = tmp_path / "t.onnx"
    onnx.save(onnxgrad.build_gradient(MODELS / "mlp.onnx"), train)
    arrays = rows_data(4)
    arrays["labels"][2] = 10
    np.savez(tmp_path / "d.npz", **arrays)
    code, out, err = run(capfd, "run", train, "--data", tmp_path / "d.npz")
    assert_one_line_error(code, out, err, 2, f"--data {tmp_path}/d.npz: 'labels' holds 10 at index [2], not a class "
                                             f"index in [0, 10) of the cross-entropy's 10 classes")


def test_a_nan_loss_stops_with_exit_8_keeping_the_last_good_checkpoint(tmp_path, capfd, step):
    path, data = step
    arrays = rows_data()
    order = np.random.default_rng([0, 0]).permutation(64)   # epoch 0's order with --seed 0
    arrays["x"][order[4 * 8]] = np.nan                      # in the batch of step 5 (batch 8)
    np.savez(data, **arrays)
    ck = tmp_path / "ck.npz"
    code, out, err = run(capfd, "train", path, "--data", data, "--batch", 8, "--steps", 8, "--checkpoint", ck,
                         "--checkpoint-every", 2, "--export", tmp_path / "e.onnx", "--report", tmp_path / "r.json",
                         "--quiet")
    assert_one_line_error(code, out, err, 8, f"step 5: the loss is nan (NaN or infinite); training stopped, {ck} kept "
                                             f"at step 4; --allow-nonfinite trains on")
    from onnxgrad.training import read_checkpoint
    record, state = read_checkpoint(ck)
    assert record["step"] == 4 and all(np.isfinite(v).all() for v in state.values())
    assert not (tmp_path / "e.onnx").exists() and not (tmp_path / "r.json").exists()
    assert run(capfd, "-q", "train", path, "--data", data, "--batch", 8, "--steps", 8, "--allow-nonfinite")[0] == 0


def test_a_nan_learning_rate_stops_before_a_bad_checkpoint(tmp_path, capfd, step):
    """--lr nan: the first loss is finite, the parameters after it are not; no checkpoint holds them."""
    path, data = step
    ck = tmp_path / "ck.npz"
    code, out, err = run(capfd, "-q", "train", path, "--data", data, "--lr", "nan", "--steps", 4, "--checkpoint", ck,
                         "--checkpoint-every", 1)
    assert code == 8 and out == "" and err.count("\n") == 1, err
    assert err.startswith("onnxgrad: error: step 1: parameter 'fc1.weight' holds NaN or infinite values"), err
    assert not ck.exists()


# -- 4. checks that come before the work -----------------------------------------------------------------------
@pytest.mark.parametrize("forward, message", [
    ("{tmp}/nosuch.onnx", "{tmp}/nosuch.onnx: no such file"),
    ("{cnn}", "--forward: the model has no initializer 'fc1.weight' for the trained parameter"),
])
def test_train_export_checks_the_forward_model_before_training(tmp_path, capfd, step, forward, message):
    path, data = step
    fill = {"tmp": tmp_path, "cnn": MODELS / "cnn.onnx"}
    ck = tmp_path / "ck.npz"
    code, out, err = run(capfd, "train", path, "--data", data, "--steps", 50, "--checkpoint", ck, "--export",
                         tmp_path / "e.onnx", "--forward", forward.format(**fill))
    assert_one_line_error(code, out, err, 2, message.format(**fill))
    assert not ck.exists()   # not a step ran: the checkpoint at the end was never written


def test_run_checks_its_report_path_before_running(tmp_path, capfd):
    train = tmp_path / "t.onnx"
    onnx.save(onnxgrad.build_gradient(MODELS / "mlp.onnx"), train)
    code, out, err = run(capfd, "run", train, "--report", tmp_path / "none" / "r.json")
    assert_one_line_error(code, out, err, 5, f"{tmp_path}/none/r.json: folder {tmp_path}/none does not exist")


def test_resume_with_other_data_of_the_same_rows_is_refused(tmp_path, capfd, step):
    path, data = step
    ck = tmp_path / "ck.npz"
    assert run(capfd, "train", path, "--data", data, "--steps", 2, "--checkpoint", ck)[0] == 0
    other = tmp_path / "other.npz"
    np.savez(other, **rows_data(seed=1))
    code, out, err = run(capfd, "train", path, "--data", other, "--steps", 4, "--resume", ck)
    assert_one_line_error(code, out, err, 2, "--resume: the checkpoint was made with other data, this --data differs; "
                                             "the batches would differ")
    assert run(capfd, "-q", "train", path, "--data", data, "--steps", 4, "--resume", ck)[0] == 0


# -- 5. flags that were ignored or wrongly accepted ------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--budget", ""], "--budget '': empty (an unset variable?); give bytes (16GiB, 1500MB, 2e9), a fraction of the "
                       "unmirrored peak (0.4x) or auto"),
    (["--budget", " "], "--budget ' ': empty (an unset variable?); give bytes (16GiB, 1500MB, 2e9), a fraction of "
                        "the unmirrored peak (0.4x) or auto"),
    (["--solver", "milp"], "--solver: chooses how a --budget is met; give --budget (or --policy budget)"),
    (["--cost", "profile"], "--cost: prices recomputation for --budget or --sweep; give one of them"),
    (["--budget", "auto", "--time-limit", "5"], "--time-limit: bounds --solver exact or milp only"),
    (["--allocator", "arena"], "--allocator: says what a --budget holds for; give --budget (or --policy budget)"),
    (["--budget", "1e99"], "--budget 1e99: more than 1 PiB, past any machine's memory; give the peak one run must "
                           "fit, a fraction (0.4x) or auto"),
    (["--dim", "N=4", "--dim", "N=8"], "--dim N: bound twice (N=4 and N=8); give each symbol once"),
    (["--dim", "N=4,N=8"], "--dim N: bound twice (N=4 and N=8); give each symbol once"),
    (["--dim", "N=4", "--dim", "N=4"], "--dim N: bound twice (N=4 and N=4); give each symbol once"),
    (["--dim", "N=0"], "--dim N=0: a dimension has at least 1 element"),
    (["--input-shape", "x=4x16", "--input-shape", "x=8x16"], "--input-shape x: given twice; give each input once"),
])
def test_mirror_flags_are_checked_at_the_edge(tmp_path, capfd, extra, message):
    model = tmp_path / "m.onnx"
    onnx.save(onnx.load(MODELS / "mlp.onnx"), model)
    before = snapshot(tmp_path)
    code, out, err = run(capfd, "mirror", model, "-o", tmp_path / "o.onnx", *extra)
    assert_one_line_error(code, out, err, 2, message)
    assert snapshot(tmp_path) == before


def test_dims_bind_in_the_comma_form(tmp_path, capfd):
    model = tmp_path / "m.onnx"
    onnx.save(onnx.load(MODELS / "transformer.onnx"), model)
    assert run(capfd, "-q", "memory", model, "--dim", "N=2,N2=3")[0] == 2  # N2 is no symbol of the model
    assert run(capfd, "-q", "build-grad", model, "-o", tmp_path / "t.onnx", "--dim", "N=2")[0] == 0
    for command in (["run", tmp_path / "t.onnx"], ["check", tmp_path / "t.onnx"], ["memory", tmp_path / "t.onnx"]):
        code, out, err = run(capfd, *command, "--dim", "N=2", "--dim", "N=3")
        assert_one_line_error(code, out, err, 2, "--dim N: bound twice (N=2 and N=3); give each symbol once")


def test_nothing_to_differentiate_comes_before_the_budget(tmp_path, capfd):
    model = tmp_path / "noparams.onnx"
    g = h.make_graph([h.make_node("Mul", ["x", "x"], ["y"]), h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, [4, 16])], [h.make_tensor_value_info("loss", T.FLOAT, [])])
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), model)
    code, out, err = run(capfd, "mirror", model, "-o", tmp_path / "o.onnx", "--budget", "0.5x")
    assert_one_line_error(code, out, err, 2, "nothing to differentiate: no floating-point initializer reaches the loss "
                                             "'loss' through differentiable ops (all frozen, or none); name graph inputs "
                                             "with --requires-grad")


# -- 6. conventions --------------------------------------------------------------------------------------------
def test_python_dash_m_onnxgrad(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == f"onnxgrad, version {onnxgrad.__version__}\n"
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "build-grad", str(MODELS / "mlp.onnx"), "-o",
                           str(tmp_path / "t.onnx"), "-q"], capture_output=True, text=True)
    assert proc.returncode == 2 and "No such option '-q'" in proc.stderr  # -q goes before the command, as documented


def test_split_makes_its_folder_and_leaves_none_on_failure(tmp_path, capfd, step):
    path, _ = step
    parts = tmp_path / "parts"
    code, out, err = run(capfd, "-q", "split", path, "-o", f"{parts}/")
    assert code == 0 and out.splitlines() == [f"{parts}/gradient.onnx", f"{parts}/update.onnx"], err
    code, out, err = run(capfd, "split", path, "-o", tmp_path / "no" / "parts")
    assert_one_line_error(code, out, err, 5, f"--output-dir {tmp_path}/no/parts: folder {tmp_path}/no does not exist")
    forward = tmp_path / "fwd.onnx"
    onnx.save(onnx.load(MODELS / "mlp.onnx"), forward)
    code, out, err = run(capfd, "split", forward, "-o", tmp_path / "fresh")
    assert code == 2 and not (tmp_path / "fresh").exists(), err


def test_quiet_silences_the_sweep_progress(tmp_path):
    model = tmp_path / "m.onnx"
    onnx.save(onnx.load(MODELS / "transformer.onnx"), model)
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "-q", "mirror", str(model), "-o", str(tmp_path / "o.onnx"),
                           "--dim", "N=8", "--sweep", str(tmp_path / "s.png")], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.splitlines()[-2:] == [f"{tmp_path}/s.png", f"{tmp_path}/o.onnx"]


def test_readme_exit_codes_say_what_the_code_does():
    text = README.read_text()
    assert "is newer than 23" not in text
    assert "| 8 | training diverged |" in text
    from onnxgrad.cli import EXIT_CODES_HELP, TRAIN_EXIT_CODES_HELP
    assert "newer than the installed onnx defines" in EXIT_CODES_HELP and "8 the loss" in TRAIN_EXIT_CODES_HELP


# -- 7. start-up -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [["--version"], ["--help"]])
def test_version_and_help_import_neither_onnx_nor_onnxruntime(args):
    code = ("import sys; from onnxgrad.cli import main; code = main(%r); "
            "print(sorted(m for m in ('onnx', 'onnxruntime', 'numpy', 'ml_dtypes') if m in sys.modules))" % args)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]"


# -- 8. what the sweep and memory print ------------------------------------------------------------------------
def test_sweep_marks_the_chosen_plan_the_budget_and_the_floor(tmp_path, capfd, monkeypatch):
    from matplotlib.figure import Figure
    legends = []
    real = Figure.savefig

    def savefig(self, *a, **k):
        legends.extend(t.get_text() for ax in self.axes for t in ax.get_legend().get_texts())
        return real(self, *a, **k)
    monkeypatch.setattr(Figure, "savefig", savefig)
    model, report = tmp_path / "m.onnx", tmp_path / "r.json"
    onnx.save(onnx.load(MODELS / "transformer.onnx"), model)
    code, out, err = run(capfd, "-q", "mirror", model, "-o", tmp_path / "o.onnx", "--dim", "N=8", "--budget", "0.7x",
                         "--sweep", tmp_path / "s.png", "--report", report)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[-2:] == [f"{tmp_path}/s.png", f"{tmp_path}/o.onnx"] and lines[-3] == ""
    table = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| schedule")]
    chosen = [ln for ln in table if ln.startswith("| **chosen** (budget) |")]
    assert len(chosen) == 1 and any(ln.startswith("| floor (no schedule goes lower) |") for ln in table)
    peaks = {}
    for ln in table:  # rows of different peaks read differently
        cells = [c.strip() for c in ln.strip("|").split("|")]
        peaks.setdefault(cells[1], set()).add(cells[0])
    sweep = json.loads(report.read_text())["sweep"]
    distinct = {r["peak_bytes"] for r in sweep["rows"]}
    assert len(peaks) == len(distinct)
    assert sweep["budget_bytes"] and any(r["what"] == "chosen" and r["plan"] == "budget" for r in sweep["rows"])
    assert any(t.startswith("chosen (budget)") for t in legends)
    assert any(t.startswith("budget ") for t in legends) and any(t.startswith("floor ") for t in legends)


def test_sweep_table_tells_close_peaks_apart():
    from onnxgrad.memory.sweep import table
    rows = [{"what": "front", "peak_bytes": 2**20 - k * 700, "extra_forward_passes": k / 1000, "recomputations": k}
            for k in range(4)]
    peaks = [ln.split("|")[2].strip() for ln in table(rows).splitlines()[2:]]
    assert len(set(peaks)) == 4 and table(rows).startswith("| schedule | peak MiB |")


def test_memory_names_unnamed_nodes_and_says_what_each_figure_counts(tmp_path, capfd):
    model = tmp_path / "m.onnx"
    m = onnxgrad.build_gradient(onnx.load(MODELS / "mlp.onnx"), dims={"N": 8})
    for n in m.graph.node:
        n.name = ""
    onnx.save(m, model)
    code, out, err = run(capfd, "memory", model)
    assert code == 0, err
    assert "''" not in out and "(an unnamed " in out
    assert "activations the backward reads (kept or recomputed)" in out
    assert "saved for the backward: " in out and "recomputed values are not counted" in out


def test_node_counts_agree_for_a_forward_model_and_a_training_graph(tmp_path, capfd):
    fwd, train = tmp_path / "f.onnx", tmp_path / "t.onnx"
    onnx.save(onnx.load(MODELS / "transformer.onnx"), fwd)
    assert run(capfd, "-q", "build-grad", fwd, "-o", train, "--dim", "N=8")[0] == 0
    reports = {}
    for name, source, dims in (("from-forward", fwd, ["--dim", "N=8"]), ("from-training", train, [])):
        report = tmp_path / f"{name}.json"
        code, out, err = run(capfd, "mirror", source, "-o", tmp_path / f"{name}.onnx", *dims, "--report", report)
        assert code == 0, err
        r = json.loads(report.read_text())
        reports[name] = r
        written = onnx.load(tmp_path / f"{name}.onnx")
        total = r["forward_nodes"] + r["recompute_nodes"] + r["backward_nodes"] + r["optimizer_nodes"]
        assert total == len(written.graph.node) and r["recompute_nodes"] > 0
        assert f"{r['forward_nodes']} forward + {r['recompute_nodes']} recompute + {r['backward_nodes']} backward " \
               f"nodes" in err
        phases = {}
        for phase, count in json.loads({p.key: p.value for p in written.metadata_props}["onnxgrad.phases"]):
            phases[phase] = phases.get(phase, 0) + count
        assert {k: r[f"{k}_nodes"] for k in ("forward", "recompute", "backward", "optimizer")} == \
            {k: phases.get(k, 0) for k in ("forward", "recompute", "backward", "optimizer")}
    # the same forward nodes and the same recomputations, whichever the mirror command was given
    keys = ("forward_nodes", "recompute_nodes")
    assert [reports["from-forward"][k] for k in keys] == [reports["from-training"][k] for k in keys]


def test_mirror_for_the_arena_says_what_a_cpu_process_holds(tmp_path):
    """`mirror --allocator arena` tells the user what a CPU process holds for the plan (the report's
    predicted.cpu_resident_bytes), which is under the budget it met."""
    out = tmp_path / "t.onnx"
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "mirror", str(MODELS / "transformer.onnx"), "--dim",
                           "N=1024", "--budget", "0.8x", "--allocator", "arena", "-o", str(out), "--report",
                           str(tmp_path / "r.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "r.json").read_text())["mirror"]
    held = report["predicted"]["cpu_resident_bytes"]
    assert held <= report["budget_bytes"]
    from onnxgrad.memory.simulate import format_bytes
    assert f"in onnxgrad's CPU arena a process holds about {format_bytes(held)} for it" in proc.stderr
