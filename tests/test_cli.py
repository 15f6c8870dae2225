"""The command line: results, one-line errors with their exit codes, and files never half-written."""
import json
import subprocess
import sys

import onnx
import pytest

from onnxgrad.cli import main
from test_api import affine, scalar_model
from onnx import helper as h


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", *map(str, args)], capture_output=True, text=True)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "model.onnx"
    onnx.save(affine(), path)
    return path


def listing(folder):
    return sorted(p.name for p in folder.iterdir())


def test_build_grad_writes_output_and_report(model, tmp_path):
    out, report = tmp_path / "train.onnx", tmp_path / "r.json"
    code, stdout, stderr = cli("build-grad", model, "-o", out, "--report", report)
    assert code == 0, stderr
    assert stdout.strip() == str(out)
    train = onnx.load(out)
    assert [o.name for o in train.graph.output] == ["loss", "w_grad", "b_grad"]
    r = json.loads(report.read_text())
    assert r["parameters"] == ["w", "b"] and r["loss"] == "loss" and r["output"] == str(out)
    assert listing(tmp_path) == ["model.onnx", "r.json", "train.onnx"]


def test_flags_take_repeated_or_comma_separated_names(model, tmp_path):
    out = tmp_path / "t.onnx"
    assert main(["build-grad", str(model), "-o", str(out), "--requires-grad", "w,b", "--also-grad", "z"]) == 0
    assert [o.name for o in onnx.load(out).graph.output] == ["loss", "w_grad", "b_grad", "z_grad"]


def test_run_prints_loss_and_gradient_norms(model, tmp_path):
    out = tmp_path / "t.onnx"
    assert main(["build-grad", str(model), "-o", str(out)]) == 0
    code, stdout, stderr = cli("run", out, "--steps", "3", "--lr", "0.01")
    assert code == 0, stderr
    losses = [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[2] < losses[0]
    assert "w_grad" in stdout and "b_grad" in stdout


def test_ops_lists_rules():
    code, stdout, _ = cli("ops")
    assert code == 0 and "Mul" in stdout and "Shape" in stdout


@pytest.mark.parametrize("setup, args, code, message", [
    (None, ["build-grad", "{missing}", "-o", "{out}"], 2, "{missing}: no such file"),
    (None, ["build-grad", "{dir}", "-o", "{out}"], 2, "{dir}: is a directory, expected an .onnx file"),
    ("garbage", ["build-grad", "{model}", "-o", "{out}"], 3, "{model}: not a readable ONNX model"),
    ("truncated", ["build-grad", "{model}", "-o", "{out}"], 3, "{model}: not a readable ONNX model"),
    ("invalid", ["build-grad", "{model}", "-o", "{out}"], 3, "the model fails the ONNX checker"),
    ("unsupported", ["build-grad", "{model}", "-o", "{out}"], 4, "no gradient rule for Atan (opset 18)"),
    (None, ["build-grad", "{model}", "-o", "{model}"], 2, "{model}: is the input model"),
    ("exists", ["build-grad", "{model}", "-o", "{out}", "--requires-grad", "nothing"], 2,
     "--requires-grad nothing: no value of that name in the model"),
    (None, ["build-grad", "{model}", "-o", "{dir}/none/t.onnx"], 5, "folder {dir}/none does not exist"),
    (None, ["build-grad", "{model}", "-o", "{out}", "--loss", "q"], 2, "--loss q: no graph output of that name"),
    (None, ["build-grad", "{model}", "-o", "{out}", "--dim", "N"], 2, "--dim 'N': expected SYMBOL=N"),
    (None, ["build-grad", "{model}"], 2, "Missing option '-o' / '--output'"),
    (None, ["build-grad", "{model}", "-o", "{out}", "--bogus"], 2, "No such option '--bogus'"),
])
def test_bad_input_is_one_line_and_leaves_no_file(tmp_path, model, setup, args, code, message):
    if setup == "garbage":
        model.write_bytes(b"this is not a protobuf \xff\xfe")
    elif setup == "truncated":
        model.write_bytes(model.read_bytes()[:40])
    elif setup == "invalid":
        m = affine()
        m.graph.node[0].input[0] = "undefined_value"
        onnx.save(m, model)
    elif setup == "unsupported":
        onnx.save(scalar_model([h.make_node("Atan", ["x"], ["loss"])]), model)
        args = args + ["--requires-grad", "x"]
    elif setup == "exists":
        (tmp_path / "out.onnx").write_bytes(b"keep me")
    names = {"missing": tmp_path / "missing.onnx", "dir": tmp_path, "model": model, "out": tmp_path / "out.onnx"}
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    got_code, stdout, stderr = cli(*[a.format(**names) for a in args])
    assert got_code == code, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxgrad: error: "), stderr
    assert message.format(**names) in lines[0]
    assert "Traceback" not in stderr and stdout == ""
    after = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # nothing written, nothing changed, no temp file left


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_an_existing_output_is_replaced(model, tmp_path, force):
    """A pipeline step that runs twice replaces its output, as compilers do; --force is accepted and changes
    nothing. (A failed run leaves an existing output as it was: the "exists" case above.)"""
    out, report = tmp_path / "out.onnx", tmp_path / "r.json"
    out.write_bytes(b"old")
    report.write_text("old")
    for _ in range(2):
        assert main(["build-grad", str(model), "-o", str(out), "--report", str(report), *force]) == 0
    assert onnx.load(out).graph.output[1].name == "w_grad"
    assert json.loads(report.read_text())["command"] == "build-grad"
