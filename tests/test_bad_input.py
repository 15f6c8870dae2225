"""The bad-input matrix: every way a pipeline can hand onnxgrad something wrong.

Each case runs the command line in-process and checks the contract: exit code of its class (2 usage,
3 invalid model, 4 unsupported, 5 output not writable, 70 internal), exactly one line on stderr with the exact
message, nothing on stdout, the input untouched and no file left behind (no output, no report, no temp file).
A few cases also run in a fresh process, to see that no traceback and no stray output reach the terminal.
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.defs
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import onnxgrad.io
from onnxgrad.cli import main
from test_api import affine, scalar_model

NEWEST = onnx.defs.onnx_opset_version()


def model_of(nodes, inputs, outputs, inits=None, opset=18, ir_version=None):
    """inputs/outputs: {name: (elem type, shape)}; inits: {name: array}."""
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()],
                     [h.make_tensor_value_info(n, t, s) for n, (t, s) in outputs.items()],
                     [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = ir_version or h.find_min_ir_version_for(list(m.opset_import))
    return m


F = T.FLOAT


def two_inputs_sharing_n():
    """a[N, 3] + b[N, 3] -> loss (ReduceSum)."""
    return model_of([h.make_node("Add", ["a", "b"], ["s"]), h.make_node("Mul", ["s", "w"], ["y"]),
                     h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                    {"a": (F, ["N", 3]), "b": (F, ["N", 3])}, {"loss": (F, [])},
                    {"w": np.ones(3, np.float32)})


def conv_with_symbolic_spatial_dims():
    return model_of([h.make_node("Conv", ["x", "w"], ["y"], name="conv"),
                     h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                    {"x": (F, ["N", 1, "H", "W"])}, {"loss": (F, [])}, {"w": np.ones((2, 1, 3, 3), np.float32)})


def vector_output():
    return model_of([h.make_node("Mul", ["x", "w"], ["y"])], {"x": (F, [3])}, {"y": (F, [3])},
                    {"w": np.ones(3, np.float32)})


def with_integer_parts():
    """loss = x * w; k = Shape(x) (an int64 output); n an int64 initializer; s = Shape(x) inside."""
    return model_of([h.make_node("Mul", ["x", "w"], ["loss"]), h.make_node("Shape", ["x"], ["k"]),
                     h.make_node("Add", ["k", "n"], ["s"])],
                    {"x": (F, [])}, {"loss": (F, []), "k": (T.INT64, [0]), "s": (T.INT64, [0])},
                    {"w": np.array(2.0, np.float32), "n": np.array([1], np.int64)})


def unreachable_parameter():
    return scalar_model([h.make_node("Mul", ["x", "w"], ["loss"])], inits={"w": 1.0, "unused": 2.0})


def no_rule():
    return scalar_model([h.make_node("Mul", ["x", "w"], ["a"], name="scale"),
                         h.make_node("Atan", ["a"], ["b"], name="squash"),
                         h.make_node("Neg", ["b"], ["loss"], name="flip")], inits={"w": 1.0})


def custom_domain_op():
    m = scalar_model([h.make_node("Mul", ["x", "w"], ["a"], name="scale"),
                      h.make_node("Foo", ["a"], ["loss"], name="foo", domain="com.example")], inits={"w": 1.0})
    m.opset_import.append(h.make_opsetid("com.example", 1))
    return m


def old_opset_experimental_op():
    """Opset 8 with ImageScaler, an experimental op that no later opset has: cannot be converted to 13."""
    return model_of([h.make_node("ImageScaler", ["x"], ["y"], scale=2.0),
                     h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
                    {"x": (F, [1, 1, 2, 2])}, {"loss": (F, [])}, opset=8, ir_version=3)


def fails_checker():
    m = affine()
    m.graph.node[0].input[0] = "undefined_value"
    return m


def too_new_opset():
    return scalar_model([h.make_node("Mul", ["x", "w"], ["loss"])], inits={"w": 2.0}, opset=NEWEST + 1)


def two_scalar_outputs():
    return scalar_model([h.make_node("Mul", ["x", "w"], ["a"]), h.make_node("Neg", ["a"], ["b"])],
                        inits={"w": 1.0}, outputs=("a", "b"))


def no_parameters():
    return scalar_model([h.make_node("Mul", ["x", "x"], ["loss"])])


MODEL_BYTES = {
    "garbage": lambda: b"this is not a protobuf \xff\xfe",
    "truncated": lambda: affine().SerializeToString()[:40],
    "truncated-tail": lambda: affine().SerializeToString()[:-3],
    "empty": lambda: b"",
    "text": lambda: b"ir_version: 8\ngraph { }\n",
    "tensor": lambda: numpy_helper.from_array(np.ones(3, np.float32)).SerializeToString(),
    "raw-data-size": lambda: _with_raw_data(affine(), b"\0" * 8).SerializeToString(),
}


def _with_raw_data(m, data):
    m.graph.initializer[0].raw_data = data  # w is a float32 scalar: 4 bytes
    return m
MODELS = {
    "affine": affine, "fails-checker": fails_checker, "too-new-opset": too_new_opset,
    "old-opset-experimental-op": old_opset_experimental_op, "two-inputs-sharing-n": two_inputs_sharing_n,
    "conv-symbolic": conv_with_symbolic_spatial_dims, "vector-output": vector_output,
    "two-scalar-outputs": two_scalar_outputs, "integer-parts": with_integer_parts,
    "unreachable": unreachable_parameter, "no-rule": no_rule, "custom-op": custom_domain_op,
    "no-parameters": no_parameters,
}

BUILD = ["build-grad", "{model}", "-o", "{out}"]

# (id, model, extra arguments, exit code, the exact message after "onnxgrad: error: ")
MATRIX = [
    # the input path
    ("missing", "affine", ["build-grad", "{dir}/missing.onnx", "-o", "{out}"], 2, "{dir}/missing.onnx: no such file"),
    ("directory", "affine", ["build-grad", "{dir}", "-o", "{out}"], 2,
     "{dir}: is a directory, expected an .onnx file"),
    # not ONNX, truncated, empty, another protobuf, missing external data
    ("garbage", "garbage", BUILD, 3, "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("truncated", "truncated", BUILD, 3, "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("truncated-tail", "truncated-tail", BUILD, 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("text-format", "text", BUILD, 3, "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("empty", "empty", BUILD, 3, "{model}: empty file, not an ONNX model"),
    ("tensor-not-model", "tensor", BUILD, 3, "{model}: not an ONNX model (the protobuf holds no graph)"),
    ("external-data-missing", "external", BUILD, 3,
     "{model}: the external data file 'model.data' of tensor 'w' is missing (expected beside the model)"),
    ("raw-data-size", "raw-data-size", BUILD, 3,
     "tensor 'w': 8 bytes of data, but its shape [] and type FLOAT need 4"),
    # checker and opsets
    ("fails-checker", "fails-checker", BUILD, 3,
     "the model fails the ONNX checker: Nodes in a graph must be topologically sorted, however input "
     "'undefined_value' of node: name: mul OpType: Mul is not output of any previous nodes."),
    ("opset-not-convertible", "old-opset-experimental-op", BUILD, 3,
     "cannot convert opset 8 to 13: op ImageScaler has no version at opset 13 to convert to; export the model at "
     "opset 13 or newer"),
    ("opset-too-new", "too-new-opset", BUILD, 3,
     f"opset {NEWEST + 1} is newer than the newest opset the installed onnx {onnx.__version__} defines ({NEWEST})"),
    # symbolic dims that cannot be bound
    ("input-shape-rank", "two-inputs-sharing-n", BUILD + ["--input-shape", "a=2x3x1"], 2,
     "--input-shape a: rank 3 given, the model says rank 2"),
    ("input-shape-static-dim", "two-inputs-sharing-n", BUILD + ["--input-shape", "a=2x4"], 2,
     "--input-shape a: dim 3 cannot be bound to 4"),
    ("input-shape-conflicting-symbol", "two-inputs-sharing-n",
     BUILD + ["--input-shape", "a=2x3", "--input-shape", "b=5x3"], 2,
     "--input-shape b: dim 'N' cannot be 5: --input-shape a makes it 2"),
    ("input-shape-vs-dim", "two-inputs-sharing-n", BUILD + ["--dim", "N=2", "--input-shape", "b=5x3"], 2,
     "--input-shape b: dim 'N' cannot be 5: --dim N=2 makes it 2"),
    ("input-shape-unknown-input", "two-inputs-sharing-n", BUILD + ["--input-shape", "q=2"], 2,
     "--input-shape q: no graph input of that name (inputs: a, b)"),
    ("input-shape-malformed", "two-inputs-sharing-n", BUILD + ["--input-shape", "a=2y3"], 2,
     "--input-shape 'a=2y3': expected NAME=D1xD2x..., e.g. x=2x3x224x224"),
    ("dim-unknown-symbol", "two-inputs-sharing-n", BUILD + ["--dim", "B=3"], 2,
     "--dim B: no dimension of that name in the model's inputs or outputs"),
    ("dim-malformed", "two-inputs-sharing-n", BUILD + ["--dim", "N=-1"], 2,
     "--dim 'N=-1': expected SYMBOL=N, e.g. batch=8"),
    ("rule-needs-static-dims", "conv-symbolic", BUILD, 4,
     "no gradient for Conv node 'conv': the spatial dims of X 'x' must be static (shape Nx1xHxW): bind them with "
     "--input-shape or --dim"),
    # the loss
    ("no-scalar-output", "vector-output", BUILD, 2,
     "cannot choose the loss: no scalar output; name it with --loss (candidates: y)"),
    ("two-scalar-outputs", "two-scalar-outputs", BUILD, 2,
     "cannot choose the loss: 2 scalar outputs; name it with --loss (candidates: a, b)"),
    ("loss-names-nothing", "affine", BUILD + ["--loss", "q"], 2,
     "--loss q: no graph output of that name (outputs: loss)"),
    ("loss-is-integer", "integer-parts", BUILD + ["--loss", "k"], 2, "the loss 'k' is not a floating-point tensor"),
    # names that name nothing, or nothing differentiable
    ("requires-grad-names-nothing", "affine", BUILD + ["--requires-grad", "nope"], 2,
     "--requires-grad nope: no value of that name in the model"),
    ("frozen-names-nothing", "affine", BUILD + ["--frozen", "w,nope"], 2,
     "--frozen nope: no value of that name in the model"),
    ("also-grad-names-nothing", "affine", BUILD + ["--also-grad", "nope"], 2,
     "--also-grad nope: no value of that name in the model"),
    ("requires-grad-intermediate", "affine", BUILD + ["--requires-grad", "z"], 2,
     "--requires-grad z: not an initializer or a graph input (use --also-grad for intermediate values)"),
    ("requires-grad-unreachable", "unreachable", BUILD + ["--requires-grad", "w,unused"], 2,
     "--requires-grad unused: not reachable from the loss 'loss' through differentiable ops"),
    ("requires-grad-integer", "integer-parts", BUILD + ["--loss", "loss", "--requires-grad", "n"], 2,
     "--requires-grad n: has an integer type, so no gradient"),
    ("also-grad-integer", "integer-parts", BUILD + ["--loss", "loss", "--also-grad", "k"], 2,
     "--also-grad k: has a non-floating-point type, so no gradient"),
    ("everything-frozen", "affine", BUILD + ["--frozen", "w,b"], 2,
     "nothing to differentiate: no floating-point initializer reaches the loss 'loss' through differentiable ops "
     "(all frozen, or none); name graph inputs with --requires-grad"),
    ("no-parameters", "no-parameters", BUILD, 2,
     "nothing to differentiate: no floating-point initializer reaches the loss 'loss' through differentiable ops "
     "(all frozen, or none); name graph inputs with --requires-grad"),
    # a gradient crossing an op with no rule
    ("no-rule", "no-rule", BUILD, 4,
     "no gradient rule for Atan (opset 18) at node 'squash', reached by loss <- Neg(flip) <- Atan(squash)"),
    ("custom-domain-op", "custom-op", BUILD, 4,
     "no gradient rule for com.example.Foo (opset 18) at node 'foo', reached by loss <- Foo(foo)"),
    # the output path
    ("output-is-input", "affine", ["build-grad", "{model}", "-o", "{model}"], 2,
     "{model}: is the input model; choose another output path"),
    ("output-is-input-respelled", "affine", ["build-grad", "{model}", "-o", "{dir}/./sub/../model.onnx"], 2,
     "{dir}/sub/../model.onnx: is the input model; choose another output path"),
    ("output-is-input-by-link", "affine", ["build-grad", "{model}", "-o", "{dir}/link.onnx"], 2,
     "{dir}/link.onnx: is the input model; choose another output path"),
    ("output-is-directory", "affine", ["build-grad", "{model}", "-o", "{dir}/sub"], 2,
     "{dir}/sub: is a directory; give a file name for the output"),
    ("output-folder-missing", "affine", ["build-grad", "{model}", "-o", "{dir}/none/t.onnx"], 5,
     "{dir}/none/t.onnx: folder {dir}/none does not exist"),
    ("report-is-output", "affine", BUILD + ["--report", "{out}"], 2,
     "--report {out}: is the output model; choose another path"),
    ("report-is-input", "affine", BUILD + ["--report", "{model}"], 2,
     "{model}: is the input model; choose another output path"),
    # the other subcommands
    ("run-missing", "affine", ["run", "{dir}/missing.onnx"], 2, "{dir}/missing.onnx: no such file"),
    ("run-forward-model", "affine", ["run", "{model}"], 2,
     "the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?"),
    ("check-missing", "affine", ["check", "{dir}/missing.onnx"], 2, "{dir}/missing.onnx: no such file"),
    ("check-garbage", "garbage", ["check", "{model}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("check-forward-model", "affine", ["check", "{model}", "--loss", "loss"], 2,
     "the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?"),
    ("check-no-metadata", "affine", ["check", "{model}"], 2,
     "the model has no 'onnxgrad.loss' metadata (not written by onnxgrad build-grad?); name the loss output "
     "with --loss"),
    # an empty or truncated model, for every command that reads one
    ("mirror-empty", "empty", ["mirror", "{model}", "-o", "{out}"], 3, "{model}: empty file, not an ONNX model"),
    ("mirror-truncated", "truncated", ["mirror", "{model}", "-o", "{out}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("memory-empty", "empty", ["memory", "{model}"], 3, "{model}: empty file, not an ONNX model"),
    ("memory-truncated", "truncated", ["memory", "{model}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("run-empty", "empty", ["run", "{model}"], 3, "{model}: empty file, not an ONNX model"),
    ("run-truncated", "truncated", ["run", "{model}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("check-empty", "empty", ["check", "{model}"], 3, "{model}: empty file, not an ONNX model"),
    ("check-truncated", "truncated", ["check", "{model}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("train-empty", "empty", ["train", "{model}", "--data", "{dir}/d.npz"], 3, "{model}: empty file, not an ONNX model"),
    ("train-truncated", "truncated", ["train", "{model}", "--data", "{dir}/d.npz"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("split-empty", "empty", ["split", "{model}", "-o", "{dir}/parts"], 3, "{model}: empty file, not an ONNX model"),
    ("split-truncated", "truncated", ["split", "{model}", "-o", "{dir}/parts"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    ("materialize-empty", "empty", ["materialize", "{model}", "-o", "{out}"], 3, "{model}: empty file, not an ONNX model"),
    ("materialize-truncated", "truncated", ["materialize", "{model}", "-o", "{out}"], 3,
     "{model}: not a readable ONNX model (not an ONNX protobuf, or truncated)"),
    # flags
    ("missing-output-flag", "affine", ["build-grad", "{model}"], 2, "Missing option '-o' / '--output'."),
    ("unknown-flag", "affine", BUILD + ["--bogus"], 2, "No such option '--bogus'. Did you mean '--loss'?"),
    ("bad-number", "affine", ["check", "{model}", "--samples", "many"], 2,
     "Invalid value for '--samples': 'many' is not a valid integer range."),
]


def write_model(tmp_path: Path, which: str) -> Path:
    path = tmp_path / "model.onnx"
    if which in MODEL_BYTES:
        path.write_bytes(MODEL_BYTES[which]())
    elif which == "external":
        onnx.save(affine(), path, save_as_external_data=True, all_tensors_to_one_file=True, location="model.data",
                  size_threshold=0)
        (tmp_path / "model.data").unlink()
    else:
        onnx.save(MODELS[which](), path)
    return path


def prepare(tmp_path: Path, case_id: str, which: str) -> dict:
    model = write_model(tmp_path, which)
    (tmp_path / "sub").mkdir()
    if case_id == "output-exists":
        (tmp_path / "out.onnx").write_bytes(b"keep me")
    if case_id in ("report-exists", "ops-report-exists"):
        (tmp_path / "r.json").write_text("{}")
    if case_id == "output-is-input-by-link":
        (tmp_path / "link.onnx").symlink_to(model)
    return {"model": model, "out": tmp_path / "out.onnx", "dir": tmp_path}


def snapshot(folder: Path) -> dict:
    """Every file under the folder with its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.is_symlink()} | {p: "link" for p in folder.rglob("*") if p.is_symlink()}


def assert_one_line_error(code, out, err, want_code, message):
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line: {err!r}"
    assert code == want_code, err
    assert out == "", f"stdout must stay empty on an error: {out!r}"
    if message is not None:
        assert lines[0] == f"onnxgrad: error: {message}"
    else:
        assert lines[0].startswith("onnxgrad: error: ")


@pytest.mark.parametrize("case_id, which, args, code, message", MATRIX, ids=[c[0] for c in MATRIX])
def test_bad_input(tmp_path, capfd, case_id, which, args, code, message):
    names = prepare(tmp_path, case_id, which)
    before = snapshot(tmp_path)
    got = main([a.format(**names) for a in args])
    out, err = capfd.readouterr()
    assert_one_line_error(got, out, err, code, message and message.format(**names))
    assert snapshot(tmp_path) == before  # the input untouched, nothing written, no temp file left


def test_bound_symbol_reaches_every_input(tmp_path):
    """--input-shape a=2x3 binds N, so b[N, 3] becomes [2, 3] too."""
    names = prepare(tmp_path, "x", "two-inputs-sharing-n")
    assert main(["-q", "build-grad", str(names["model"]), "-o", str(names["out"]), "--input-shape", "a=2x3"]) == 0
    dims = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in onnx.load(names["out"]).graph.input}
    assert dims["a"] == [2, 3] and dims["b"] == [2, 3]


# -- the output cannot be written ------------------------------------------------------------------------------
def _fail_writes(monkeypatch, error: OSError, only: str | None = None):
    """Make writing the temp file fail (for every file, or only for the one whose name contains `only`)."""
    real_fdopen = os.fdopen

    class Failing:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            raise error

    def fdopen(fd, mode):
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.exists(f"/proc/self/fd/{fd}") else ""
        f = real_fdopen(fd, mode)
        return Failing(f) if only is None or only in name else f
    monkeypatch.setattr(onnxgrad.io.os, "fdopen", fdopen)


@pytest.mark.parametrize("how, report, message", [
    ("access", False, "{out}: folder {dir} is not writable"),                # refused before any work
    ("mkstemp", False, "{out}: cannot write (Permission denied)"),           # e.g. a read-only mount
    ("full-disk", False, "{out}: cannot write (No space left on device)"),
    ("full-disk-on-model", True, "{out}: cannot write (No space left on device)"),
    ("full-disk-on-report", True, "{dir}/r.json: cannot write (No space left on device)"),
    ("rename", False, "{out}: cannot write (Invalid cross-device link)"),
])
def test_output_not_writable(tmp_path, capfd, monkeypatch, how, report, message):
    names = prepare(tmp_path, "x", "affine")
    if how == "access":  # as root, a folder with mode 0o555 is still writable: say the folder is not
        real_access = os.access
        monkeypatch.setattr(onnxgrad.io.os, "access",
                            lambda p, mode: False if mode == os.W_OK else real_access(p, mode))
    elif how == "mkstemp":
        def refuse(*a, **k):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        monkeypatch.setattr(onnxgrad.io.tempfile, "mkstemp", refuse)
    elif how.startswith("full-disk"):
        only = {"full-disk": None, "full-disk-on-model": ".out.onnx.", "full-disk-on-report": ".r.json."}[how]
        _fail_writes(monkeypatch, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), only=only)
    elif how == "rename":
        def replace(src, dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        monkeypatch.setattr(onnxgrad.io.os, "replace", replace)
    before = snapshot(tmp_path)
    args = ["build-grad", str(names["model"]), "-o", str(names["out"])]
    code = main(args + (["--report", str(tmp_path / "r.json")] if report else []))
    out, err = capfd.readouterr()
    assert_one_line_error(code, out, err, 5, message.format(**names))
    assert snapshot(tmp_path) == before  # neither the model nor the report, and no temp file


def test_readonly_folder_when_not_root(tmp_path, capfd):
    """Without root, a read-only folder is refused before any work; as root the folder is writable anyway,
    so the monkeypatched cases above stand in for it."""
    names = prepare(tmp_path, "x", "affine")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        code = main(["build-grad", str(names["model"]), "-o", str(ro / "t.onnx")])
        out, err = capfd.readouterr()
        if os.access(ro, os.W_OK):  # root: writing succeeds, and the file is complete
            assert code == 0 and onnx.load(ro / "t.onnx").graph.output[1].name == "w_grad"
        else:
            assert_one_line_error(code, out, err, 5, f"{ro}/t.onnx: folder {ro} is not writable")
            assert list(ro.iterdir()) == []
    finally:
        ro.chmod(0o755)


# -- internal errors -------------------------------------------------------------------------------------------
def test_internal_error_is_one_line(tmp_path, capfd, monkeypatch):
    import onnxgrad.passes.gradient

    def broken(*a, **k):
        raise ValueError("boom\nsecond line")
    monkeypatch.setattr(onnxgrad.passes.gradient, "differentiate", broken)
    names = prepare(tmp_path, "x", "affine")
    before = snapshot(tmp_path)
    code = main(["build-grad", str(names["model"]), "-o", str(names["out"])])
    out, err = capfd.readouterr()
    assert code == 70 and out == ""
    assert err == "onnxgrad: internal error: ValueError: boom (rerun with --verbose and report it)\n"
    assert snapshot(tmp_path) == before
    assert main(["--verbose", "build-grad", str(names["model"]), "-o", str(names["out"])]) == 70
    _, err = capfd.readouterr()
    assert "Traceback" in err and err.rstrip().endswith("(rerun with --verbose and report it)")


def test_multiline_messages_become_one_line(tmp_path, capfd, monkeypatch):
    import onnxgrad.loader
    from onnxgrad.errors import InvalidModelError

    def failing(model):
        raise InvalidModelError("shape inference failed: first\n  second\n")
    monkeypatch.setattr(onnxgrad.loader, "infer_shapes", failing)
    names = prepare(tmp_path, "x", "affine")
    assert main(["build-grad", str(names["model"]), "-o", str(names["out"])]) == 3
    out, err = capfd.readouterr()
    assert err == "onnxgrad: error: shape inference failed: first second\n" and out == ""


def test_keyboard_interrupt(tmp_path, capfd, monkeypatch):
    import onnxgrad.passes.gradient

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(onnxgrad.passes.gradient, "differentiate", interrupted)
    names = prepare(tmp_path, "x", "affine")
    before = snapshot(tmp_path)
    assert main(["build-grad", str(names["model"]), "-o", str(names["out"])]) == 130
    assert capfd.readouterr().err.lstrip("\n") == "onnxgrad: interrupted\n"  # click ends the ^C line first
    assert snapshot(tmp_path) == before


# -- in a fresh process ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case_id", ["truncated", "opset-not-convertible", "no-rule", "output-is-directory"])
def test_in_a_fresh_process(tmp_path, case_id):
    """The same contract seen from outside: no traceback, no stray line from a C++ library on either stream."""
    _, which, args, code, message = next(c for c in MATRIX if c[0] == case_id)
    names = prepare(tmp_path, case_id, which)
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", *[a.format(**names) for a in args]],
                          capture_output=True, text=True)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, code, message.format(**names))
    assert snapshot(tmp_path) == before
