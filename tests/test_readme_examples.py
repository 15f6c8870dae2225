"""The README's examples run as written, as a CI step would run them: every ```sh block with bash (`set -e`), every
```python block with the project's Python, and the `run:` steps of the GitHub Actions job, each section in a
fresh folder that holds the files its examples name (the shipped models, and small models made here for the
names the examples use: model.onnx, net.onnx, zoo.onnx, data.npz, ...). The reports of every command are checked
against the JSON Schema the README gives."""
from __future__ import annotations

import json
import os
import re
import shutil
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

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent

# Blocks not run here, each with the reason; a block is named by its section heading and its first line.
NOT_RUN = {
    ("onnxgrad", "make demo"): "the Makefile's targets: `make test` is this suite, and CI runs it (.ci/run)",
    ("Data-parallel training: `onnxgrad train` under torchrun", "# two machines"): "needs two machines",
}


def examples() -> list[tuple[str, str, str]]:
    """(section heading, language, code) of every sh, python and yaml block, in README order."""
    out, heading, block, lang = [], "", None, None
    for line in README.read_text().splitlines():
        if block is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            m = re.match(r"^```(sh|python|yaml)\s*$", line)
            if m:
                block, lang = [], m.group(1)
        elif line.startswith("```"):
            out.append((heading, lang, "\n".join(block)))
            block = None
        else:
            block.append(line)
    return out


def _id(example) -> str:
    heading, lang, code = example
    return f"{re.sub(r'[^a-z0-9]+', '-', heading.lower()).strip('-')[:40]}-{lang}"


# -- the files the examples name ---------------------------------------------------------------------------------
def _model(nodes, inputs, outputs, inits, opset=18):
    g = h.make_graph(nodes, "m", [h.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                     [h.make_tensor_value_info(n, t, s) for n, t, s in outputs],
                     [numpy_helper.from_array(v, n) for n, v in inits.items()])
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def embedding_model() -> onnx.ModelProto:
    """x[batch, 20] -> emb.weight (a linear embedding) -> two layers -> loss = mean((pred - target)^2): the
    "Using it" model. (A Gather embedding is not mirrored yet: the size of its gradient's Range is unknown.)"""
    rng = np.random.default_rng(0)
    inits = {"emb.weight": rng.standard_normal((20, 32)).astype(np.float32),
             "w1": (rng.standard_normal((32, 16)) / 6).astype(np.float32), "b1": np.zeros(16, np.float32),
             "w2": (rng.standard_normal((16, 1)) / 4).astype(np.float32)}
    nodes = [h.make_node("MatMul", ["x", "emb.weight"], ["e"]),
             h.make_node("Gemm", ["e", "w1", "b1"], ["z"]), h.make_node("Relu", ["z"], ["a"]),
             h.make_node("MatMul", ["a", "w2"], ["pred"]), h.make_node("Sub", ["pred", "target"], ["d"]),
             h.make_node("Mul", ["d", "d"], ["sq"]), h.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    return _model(nodes, [("x", T.FLOAT, ["batch", 20]), ("target", T.FLOAT, ["batch", 1])],
                  [("loss", T.FLOAT, [])], inits)


def cnn_classifier() -> onnx.ModelProto:
    """x[batch, 1, 8, 8] -> logits[batch, 10], with nodes named block3/act and block7/conv (the mirror section)."""
    rng = np.random.default_rng(1)
    inits = {"c1": (rng.standard_normal((4, 1, 3, 3)) / 3).astype(np.float32),
             "c2": (rng.standard_normal((4, 4, 3, 3)) / 6).astype(np.float32),
             "fc": (rng.standard_normal((256, 10)) / 16).astype(np.float32), "fcb": np.zeros(10, np.float32)}
    nodes = [h.make_node("Conv", ["x", "c1"], ["y1"], name="block1/conv", pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["y1"], ["a1"], name="block3/act"),
             h.make_node("Conv", ["a1", "c2"], ["y2"], name="block7/conv", pads=[1, 1, 1, 1]),
             h.make_node("Sigmoid", ["y2"], ["g2"], name="block7/gate"),
             h.make_node("Mul", ["y2", "g2"], ["a2"], name="block7/act"),
             h.make_node("Flatten", ["a2"], ["f"], name="flatten"),
             h.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], name="head")]
    return _model(nodes, [("x", T.FLOAT, ["batch", 1, 8, 8])], [("logits", T.FLOAT, ["batch", 10])], inits)


def silu_tail() -> onnx.ModelProto:
    """x[batch, 256] through 8 scaled SiLU layers to a scalar loss: activations outweigh the weights, so the
    budgets of the budget section can be met."""
    rng = np.random.default_rng(2)
    nodes, inits, x = [], {}, "x"
    for i in range(8):
        inits[f"s{i}"] = (1 + rng.standard_normal(256) / 8).astype(np.float32)
        inits[f"b{i}"] = np.zeros(256, np.float32)
        nodes += [h.make_node("Mul", [x, f"s{i}"], [f"m{i}"], name=f"scale{i}"),
                  h.make_node("Add", [f"m{i}", f"b{i}"], [f"z{i}"], name=f"shift{i}"),
                  h.make_node("Sigmoid", [f"z{i}"], [f"g{i}"], name=f"gate{i}"),
                  h.make_node("Mul", [f"z{i}", f"g{i}"], [f"h{i}"], name=f"silu{i}")]
        x = f"h{i}"
    nodes += [h.make_node("Mul", [x, x], ["sq"]), h.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    return _model(nodes, [("x", T.FLOAT, ["batch", 256])], [("loss", T.FLOAT, [])], inits)


def two_heads() -> onnx.ModelProto:
    """x[batch, 16] -> logits[batch, 10] and pred[batch, 4] (the losses section's net.onnx)."""
    rng = np.random.default_rng(3)
    inits = {"wl": (rng.standard_normal((16, 10)) / 4).astype(np.float32), "bl": np.zeros(10, np.float32),
             "wp": (rng.standard_normal((16, 4)) / 4).astype(np.float32), "bp": np.zeros(4, np.float32)}
    nodes = [h.make_node("Gemm", ["x", "wl", "bl"], ["logits"]), h.make_node("Gemm", ["x", "wp", "bp"], ["pred"])]
    return _model(nodes, [("x", T.FLOAT, ["batch", 16])],
                  [("logits", T.FLOAT, ["batch", 10]), ("pred", T.FLOAT, ["batch", 4])], inits)


def weightless() -> onnx.ModelProto:
    """A zoo-style light graph: its weight is a ConstantOfShape placeholder."""
    g = h.make_graph([h.make_node("ConstantOfShape", ["s"], ["w"], value=h.make_tensor("v", T.FLOAT, [1], [0.02])),
                      h.make_node("MatMul", ["x", "w"], ["y"])], "zoo", [h.make_tensor_value_info("x", T.FLOAT, [2, 4])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2, 3])], [numpy_helper.from_array(np.array([4, 3]), "s")])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 9)])


def mlp_data(rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    return {"x": x, "labels": (x @ rng.standard_normal((16, 10))).argmax(1).astype(np.int64)}


def prepare(heading: str, folder: Path) -> None:
    """The files a section's examples name, as a reader following that section would have them."""
    shutil.copytree(ROOT / "models", folder / "models", ignore=shutil.ignore_patterns("*.py"))
    save = lambda model, name: onnx.save(model, folder / name)  # noqa: E731
    if heading == "Using it":
        save(embedding_model(), "model.onnx")
        save(weightless(), "zoo.onnx")
        rng = np.random.default_rng(0)
        np.savez(folder / "data.npz", x=rng.standard_normal((64, 20)).astype(np.float32),
                 target=rng.standard_normal((64, 1)).astype(np.float32))
    elif heading.startswith("Backward mirroring"):
        save(cnn_classifier(), "model.onnx")
    elif heading.startswith("The least recomputation"):
        save(silu_tail(), "model.onnx")
    elif heading.startswith("Memory"):
        save(onnxgrad.build_gradient(silu_tail(), dims={"batch": 64}), "train.onnx")
        save(onnxgrad.build(silu_tail(), dims={"batch": 64}, mirror="mxnet").model, "mirrored.onnx")
        save(onnxgrad.build_gradient(silu_tail(), optimizer="sgd"), "step.onnx")
    elif heading.startswith("Mixed precision"):
        save(cnn_classifier(), "model.onnx")
    elif heading.startswith("Losses and optimizers"):
        save(two_heads(), "net.onnx")
    elif heading.startswith("Data-parallel training"):
        (folder / "out").mkdir()
        save(onnxgrad.build_gradient(ROOT / "models" / "mlp.onnx", optimizer="sgd"), "out/step.onnx")
        np.savez(folder / "data.npz", **mlp_data(512))
    elif heading.startswith("Checking a training graph"):
        save(onnxgrad.build_gradient(ROOT / "models" / "mlp.onnx"), "train.onnx")
    elif heading.startswith("Large models"):
        from test_external_data import mlp
        save(mlp(), "big.onnx")


# -- running them --------------------------------------------------------------------------------------------------
def shell(code: str, folder: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "MPLBACKEND": "Agg"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600)


def as_run(heading: str, lang: str, code: str) -> str:
    """The shell command that runs a block as written."""
    if lang == "sh":
        return code
    if lang == "python":
        script = f"python - <<'EXAMPLE'\n{code}\nEXAMPLE"
        if "under torchrun" in code:  # a block for every process of a job
            return f"cat > example.py <<'EXAMPLE'\n{code}\nEXAMPLE\ntorchrun --standalone --nproc-per-node 2 example.py"
        return script
    steps = []  # yaml: the `run:` steps of the job, less installing onnxgrad, which the environment has done
    lines = code.splitlines()
    for k, line in enumerate(lines):
        m = re.match(r"^(\s*)(?:- )?run: (.*)$", line)
        if not m:
            continue
        if m.group(2).strip() == "|":
            indent = len(lines[k + 1]) - len(lines[k + 1].lstrip())
            for body in lines[k + 1:]:
                if body.strip() and len(body) - len(body.lstrip()) < indent:
                    break
                steps.append(body.strip())
        elif not m.group(2).startswith("pip install"):
            steps.append(m.group(2))
    assert steps, "no run: steps in the yaml block"
    return "\n".join(steps)


EXAMPLES = examples()


def test_the_readme_has_the_examples_this_test_knows():
    """Every block left out is still in the README (else its entry goes), and the sections are all there."""
    for section, first in NOT_RUN:
        assert any(heading == section and code.startswith(first) for heading, _, code in EXAMPLES), (section, first)
    assert len(EXAMPLES) >= 15


@pytest.mark.parametrize("heading", sorted({e[0] for e in EXAMPLES}, key=[e[0] for e in EXAMPLES].index))
def test_readme_examples_run_as_written(tmp_path, heading):
    prepare(heading, tmp_path)
    ran = 0
    for section, lang, code in EXAMPLES:
        if section != heading:
            continue
        reason = next((why for (s, first), why in NOT_RUN.items() if s == section and code.startswith(first)), None)
        if reason:
            continue
        proc = shell(as_run(section, lang, code), tmp_path)
        assert proc.returncode == 0, f"{heading} ({lang}):\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"
        assert "Traceback" not in proc.stderr
        ran += 1
    assert ran or any(s == heading for s, _ in NOT_RUN)


# -- the report schema -----------------------------------------------------------------------------------------------
def readme_schema() -> dict:
    text = README.read_text()
    start = text.index("As a JSON Schema (draft 2020-12):")
    block = text[text.index("```json", start) + len("```json"):]
    return json.loads(block[:block.index("```")])


def validate(value, schema: dict, where: str = "report") -> None:
    """The part of JSON Schema the README's schema uses: type, enum, const, required, properties, items,
    additionalProperties, allOf with if/then."""
    kinds = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool,
             "null": type(None)}
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(isinstance(value, kinds[t]) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in types)
        assert ok, f"{where}: {value!r} is not {schema['type']}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{where}: lacks {key!r}"
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                validate(value[key], sub, f"{where}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, item in value.items():
                if key not in schema.get("properties", {}):
                    validate(item, extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for k, item in enumerate(value):
            validate(item, schema["items"], f"{where}[{k}]")
    for part in schema.get("allOf", []):
        try:
            validate(value, part["if"], where)
        except AssertionError:
            continue
        validate(value, part["then"], where)


def test_every_report_matches_the_readme_schema(tmp_path, capfd):
    schema = readme_schema()
    model, step, data = tmp_path / "m.onnx", tmp_path / "step.onnx", tmp_path / "d.npz"
    onnx.save(silu_tail(), model)
    onnx.save(onnxgrad.build_gradient(ROOT / "models" / "mlp.onnx", optimizer="sgd"), step)
    np.savez(data, **mlp_data(64))
    train = tmp_path / "t.onnx"
    commands = {
        "build-grad": ["build-grad", model, "-o", train, "--dim", "batch=8"],
        "mirror": ["mirror", model, "-o", tmp_path / "mi.onnx", "--dim", "batch=64", "--budget", "0.6x", "--sweep",
                   tmp_path / "s.png"],
        "memory": ["memory", train, tmp_path / "mi.onnx"],
        "run": ["run", train, "--steps", "2"],
        "check": ["check", train],
        "ops": ["ops"],
        "train": ["train", step, "--data", data, "--steps", "2"],
    }
    assert set(schema["properties"]["command"]["enum"]) == set(commands)
    for command, args in commands.items():
        report = tmp_path / f"{command}.json"
        assert main(["-q", *map(str, args), "--report", str(report)]) == 0, capfd.readouterr().err
        r = json.loads(report.read_text())
        validate(r, schema, command)
        assert r["command"] == command
