"""Mixed-precision training graphs (--precision fp16/bf16, dynamic loss scaling), checked in numpy.

onnxruntime's CPU provider lacks half-precision kernels for some of these graphs' ops (bfloat16 MatMul, Gemm, Add;
float16 ScatterElements with add), so the numbers are checked with onnx.reference.ReferenceEvaluator (float16
natively, bfloat16 through ml_dtypes)."""
from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad.errors import UsageError
from onnxgrad.precision import NOT_IN_BF16
from precision_models import (blobs, conv_bn_block, initial_state, reference_steps, scaled_activation, shipped,
                              shipped_feeds, tanh_classifier)

HALF = {"fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
# ||g_half - g_fp32|| / ||g_fp32|| per parameter, the denominator at least 1% of the largest gradient's norm (a
# gradient that is zero in exact arithmetic, as attention's key bias, is compared at that scale). The
# half-precision rounding unit is 2^-11 (fp16) and 2^-8 (bf16); measured worst cases: 1.9e-3 and 1.2e-2.
GRAD_TOL = {"fp16": 5e-3, "bf16": 3e-2}
FORWARD_CAST = re.compile(r"/(fp16|bf16|fp32)/Cast(_\d+)?$")  # the Casts the precision pass writes
CE = {"loss_fn": "cross-entropy", "target": "logits"}


def types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    return {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output, *g.value_info]} | \
        {t.name: t.data_type for t in g.initializer}


def allows(op_type: str, opset: int, elem_type: int) -> bool:
    schema = onnx.defs.get_schema(op_type, opset)
    name = {TensorProto.FLOAT16: "tensor(float16)", TensorProto.BFLOAT16: "tensor(bfloat16)"}[elem_type]
    return all(name in c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == "T")


def gradients(model, precision, feeds, **options) -> dict[str, np.ndarray]:
    train = onnxgrad.build_gradient(model, precision=precision, **options)
    names = [o.name for o in train.graph.output if o.name.endswith("_grad")]
    return dict(zip(names, ReferenceEvaluator(train).run(names, feeds)))


def gradient_errors(ref: dict, got: dict) -> dict[str, float]:
    floor = 1e-2 * max(np.linalg.norm(v) for v in ref.values())
    return {k: float(np.linalg.norm(got[k].astype(np.float64) - ref[k]) / max(np.linalg.norm(ref[k]), floor))
            for k in ref}


# -- the rewrite ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("optimizer", [None, "adamw"])
def test_fp32_writes_the_same_bytes_as_before(optimizer):
    fwd = shipped("mlp")
    assert (onnxgrad.build_gradient(fwd, optimizer=optimizer, precision="fp32").SerializeToString()
            == onnxgrad.build_gradient(fwd, optimizer=optimizer).SerializeToString())


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_autocast_lists_and_master_weights(name, precision):
    fwd = shipped(name)
    step = onnxgrad.build_gradient(fwd, optimizer="adam", precision=precision)
    half, t = HALF[precision], types(step)
    opset = next(o.version for o in step.opset_import if o.domain in ("", "ai.onnx"))
    forward = [n for n in step.graph.node if n.name in {m.name for m in fwd.graph.node}]
    for n in forward:
        out = t[n.output[0]]
        if n.op_type in ("MatMul", "Gemm", "Conv"):
            if allows(n.op_type, opset, half) and not (precision == "bf16" and n.op_type in NOT_IN_BF16):
                assert out == half and all(t[i] == half for i in n.input), n.name
            else:  # Conv takes bfloat16 from opset 22 on, and its gradient has no bfloat16 CUDA kernel
                assert out == TensorProto.FLOAT and all(t[i] == TensorProto.FLOAT for i in n.input), n.name
        if n.op_type in ("LayerNormalization", "SoftmaxCrossEntropyLoss", "ReduceMean", "Softmax"):
            assert out == TensorProto.FLOAT and t[n.input[0]] == TensorProto.FLOAT, n.name
    # parameters, optimizer state and the graph's own outputs stay float32
    pairs, state = initial_state(step)
    for name in pairs:
        if name not in ("step", "loss_scale.good_steps", "loss_scale.skipped_steps"):
            assert t[name] == TensorProto.FLOAT and t[pairs[name]] == TensorProto.FLOAT, name
    for o in fwd.graph.output:
        assert t[o.name] == TensorProto.FLOAT
    # one Cast per value and precision, shared by its readers
    forward_casts = [n for n in step.graph.node if n.op_type == "Cast" and FORWARD_CAST.search(n.name)]
    casts = Counter((n.input[0], helper.get_attribute_value(n.attribute[0])) for n in forward_casts)
    assert casts and max(casts.values()) == 1
    assert any(t[v] == half for v in t)
    meta = {p.key: p.value for p in step.metadata_props}
    assert json.loads(meta["onnxgrad.precision"])["precision"] == precision


def test_half_activation_meeting_a_float32_activation_runs_in_float32():
    """A residual sum of a float32 input and a half MatMul result is promoted to float32 (as PyTorch does); a
    bias (an initializer) added to a half result runs in half."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    b = numpy_helper.from_array(np.ones(4, np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Add", ["y", "b"], ["yb"], name="bias"),
             helper.make_node("Add", ["yb", "x"], ["r"], name="residual"),
             helper.make_node("ReduceSum", ["r"], ["loss"], name="sum", keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w, b])
    train = onnxgrad.build_gradient(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                    precision="fp16")
    t = types(train)
    assert t["y"] == t["yb"] == TensorProto.FLOAT16
    assert t["r"] == TensorProto.FLOAT
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    # at the default scale (65536) the fp16 gradient of this sum (up to 10 per element) would overflow
    got = ReferenceEvaluator(train).run(["w_grad", "b_grad"], {"x": x, "loss_scale": np.array(1.0, np.float32)})
    assert np.allclose(got[0], np.repeat(x.sum(0)[:, None], 4, 1)) and np.allclose(got[1], 2)


# -- the numbers ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("name", ["tanh", "cnn", "transformer"])
def test_half_gradients_agree_with_float32(name, precision):
    if name == "tanh":
        model, data, options = tanh_classifier(), blobs(16), CE
    else:
        model, data, options = shipped(name), shipped_feeds(name), {}
    ref = gradients(model, "fp32", data, **options)
    got = gradients(model, precision, data, **options)
    assert set(got) == set(ref) and all(v.dtype == np.float32 for v in got.values())
    errors = gradient_errors(ref, got)
    assert max(errors.values()) < GRAD_TOL[precision], errors
    assert max(errors.values()) > 0  # half precision did run


def test_fp16_gradients_of_the_relu_mlp():
    """The Relu model in fp16 (bf16 flips the sign of near-zero pre-activations: BENCHMARKS.md gives the figures)."""
    ref = gradients(shipped("mlp"), "fp32", shipped_feeds("mlp"))
    got = gradients(shipped("mlp"), "fp16", shipped_feeds("mlp"))
    assert max(gradient_errors(ref, got).values()) < GRAD_TOL["fp16"]


def test_training_graph_loss_scale_is_unscaled():
    """Without an optimizer, an fp16 training graph has a loss_scale input; its gradients come out unscaled."""
    train = onnxgrad.build_gradient(tanh_classifier(), precision="fp16", **CE)
    assert "loss_scale" in [i.name for i in train.graph.input]
    data = blobs(16)
    ev = ReferenceEvaluator(train)
    a = ev.run(["w1_grad"], {**data, "loss_scale": np.array(1.0, np.float32)})[0]
    b = ev.run(["w1_grad"], {**data, "loss_scale": np.array(1000.0, np.float32)})[0]
    assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()
    assert not np.array_equal(a, b)  # fp16 rounds the scaled values otherwise: the scale reached the backward
    c = ev.run(["w1_grad"], {**data, "loss_scale": np.array(1e9, np.float32)})[0]
    assert not np.isfinite(c).all()  # and a scale too large overflows it


def train_losses(precision: str, steps: int = 200, **options) -> tuple[list[float], dict]:
    step = onnxgrad.build_gradient(tanh_classifier(), optimizer="adam", optimizer_options={"lr": 0.01},
                                   precision=precision, **CE, **options)
    return reference_steps(step, blobs(64), steps)


def test_200_steps_in_half_precision_end_within_1_percent_of_float32():
    final = {p: train_losses(p)[0][-1] for p in ("fp32", "fp16", "bf16")}
    assert final["fp32"] < 0.1  # it learned
    for p in ("fp16", "bf16"):
        assert abs(final[p] - final["fp32"]) <= 0.01 * final["fp32"], final


# -- dynamic loss scaling -----------------------------------------------------------------------------------------

def test_overflow_skips_exactly_that_step_and_halves_the_scale():
    step = onnxgrad.build_gradient(tanh_classifier(), optimizer="adam", precision="fp16", **CE)
    pairs, state = initial_state(step)
    ev = ReferenceEvaluator(step)
    data = blobs(16)
    names = list(pairs.values())

    def run(state):
        out = dict(zip(names, ev.run(names, {**data, **state})))
        return {name: out[nxt] for name, nxt in pairs.items()}

    state = run(state)                                    # a good step
    assert state["step"] == 1 and state["loss_scale.good_steps"] == 1
    before = dict(state, loss_scale=np.array(3e38, np.float32))  # the fp16 gradients overflow at this scale
    after = run(before)
    for name in pairs:
        if not name.startswith("loss_scale"):
            assert after[name].dtype == before[name].dtype and after[name].tobytes() == before[name].tobytes(), name
    assert after["loss_scale"] == np.float32(1.5e38)
    assert after["loss_scale.good_steps"] == 0 and after["loss_scale.skipped_steps"] == 1
    again = run(dict(after, loss_scale=np.array(65536.0, np.float32)))  # the next step updates again
    assert again["step"] == 2 and again["loss_scale.skipped_steps"] == 1
    assert not np.array_equal(again["w1"], after["w1"])


def test_scale_grows_after_the_interval():
    losses, state = train_losses("fp16", steps=6, loss_scale_options={"growth_interval": 2, "init_scale": 8.0})
    assert state["loss_scale"] == 64.0 and state["loss_scale.good_steps"] == 0
    assert state["loss_scale.skipped_steps"] == 0


def test_bf16_has_no_loss_scale_unless_asked():
    step = onnxgrad.build_gradient(tanh_classifier(), optimizer="sgd", precision="bf16", **CE)
    assert "loss_scale" not in [i.name for i in step.graph.input]
    step = onnxgrad.build_gradient(tanh_classifier(), optimizer="sgd", precision="bf16", loss_scale="dynamic", **CE)
    assert "loss_scale.next" in [o.name for o in step.graph.output]


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp8"}, "--precision fp8: expected one of fp32, fp16, bf16"),
    ({"precision": "fp16", "loss_scale": "static"}, "--loss-scale static"),
    ({"precision": "bf16", "loss_scale_options": {"init_scale": 8.0}}, "--loss-scale-init: needs dynamic"),
    ({"precision": "fp16", "loss_scale_options": {"init_scale": -1.0}}, "--loss-scale-init -1: must be"),
    ({"precision": "fp16", "loss_scale_options": {"growth_interval": 0}}, "--loss-scale-interval 0"),
    ({"precision": "fp16", "loss_scale_options": {"warmup": 3}}, "loss scaler option 'warmup'"),
])
def test_bad_precision_options(kwargs, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        onnxgrad.build_gradient(tanh_classifier(), **CE, **kwargs)


def test_precision_of_a_training_graph_is_refused():
    train = onnxgrad.build_gradient(tanh_classifier(), **CE)
    with pytest.raises(UsageError, match="--precision fp16: the model is already a training graph"):
        onnxgrad.build_gradient(train, precision="fp16")


def test_cli_precision(tmp_path):
    from click.testing import CliRunner
    from onnxgrad.cli import cli
    src = tmp_path / "m.onnx"
    onnx.save(tanh_classifier(), src)
    out = tmp_path / "step.onnx"
    r = CliRunner().invoke(cli, ["build-grad", str(src), "-o", str(out), "--loss-fn", "cross-entropy",
                                 "--optimizer", "sgd", "--precision", "fp16", "--loss-scale-interval", "50",
                                 "--report", str(tmp_path / "r.json")])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["precision"]["precision"] == "fp16" and report["precision"]["loss_scale"]["growth_interval"] == 50
    assert report["precision"]["half_nodes"] >= 2
    r = CliRunner().invoke(cli, ["build-grad", str(src), "-o", str(out), "--precision", "fp8"])
    assert r.exit_code == 2 and "fp8" in r.output


# -- train: the scaler's state is checkpointed and the skipped steps reported (in onnxruntime: loss scaling in
# fp32 changes only the scale, and the CPU provider runs it) ------------------------------------------------------

def scaled_fp32_step() -> onnx.ModelProto:
    # 2^127, next to float32's largest, and a summed loss: the first steps overflow (skipped, the scale halves
    # each time), then training goes on
    return onnxgrad.build_gradient(tanh_classifier(), **CE, loss_options={"reduction": "sum"}, optimizer="adam",
                                   optimizer_options={"lr": 0.01}, loss_scale="dynamic",
                                   loss_scale_options={"init_scale": 2.0 ** 127, "growth_interval": 3})


def overflowing_data(rows: int) -> dict[str, np.ndarray]:
    data = blobs(rows)
    return {"x": data["x"] * 100, "target": data["target"]}


def test_train_reports_skipped_steps_and_resumes_the_scaler(tmp_path):
    from onnxgrad.training import StepGraphTrainer
    step = scaled_fp32_step()
    data = overflowing_data(24)
    straight = StepGraphTrainer(step, provider="cpu", threads=1)
    full = straight.fit(data, steps=12, batch=8, seed=3)
    assert 0 < full.skipped_steps < 12 and full.to_json()["skipped_steps"] == full.skipped_steps
    assert full.loss_scale < 2.0 ** 127 and full.losses[-1] < full.losses[0]

    first = StepGraphTrainer(step, provider="cpu", threads=1)
    ck = tmp_path / "ck.npz"
    first.fit(data, steps=5, batch=8, seed=3, checkpoint=ck)
    second = StepGraphTrainer(step, provider="cpu", threads=1)
    second.load_checkpoint(ck)
    rest = second.fit(data, steps=12, batch=8, seed=3)
    assert rest.skipped_steps == full.skipped_steps and rest.loss_scale == full.loss_scale
    a, b = straight.state_dict(), second.state_dict()
    assert {"loss_scale", "loss_scale.good_steps", "loss_scale.skipped_steps"} <= set(a)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_cli_train_prints_skipped_steps(tmp_path):
    from click.testing import CliRunner
    from onnxgrad.cli import cli
    onnx.save(scaled_fp32_step(), tmp_path / "step.onnx")
    np.savez(tmp_path / "d.npz", **overflowing_data(16))
    r = CliRunner().invoke(cli, ["train", str(tmp_path / "step.onnx"), "--data", str(tmp_path / "d.npz"),
                                 "--steps", "4", "--batch", "8", "--quiet", "--provider", "cpu"])
    assert r.exit_code == 0, r.output
    assert "steps skipped on overflow (loss scale" in r.output


def test_bf16_pad_and_comparisons_run_on_float32_copies():
    """onnxruntime's CUDA provider has no bfloat16 Pad, Greater or ArgMax: Slice's gradient (a Pad) runs in
    float32 between Casts, comparisons read float32 copies, and the gradients are unchanged."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
             helper.make_node("Slice", ["y", "starts", "ends", "axes"], ["s"], name="slice"),
             helper.make_node("Relu", ["s"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r"], ["loss"], name="mean", keepdims=0)]
    ints = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("starts", 1), ("ends", 5), ("axes", 1))]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w, *ints])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    train = onnxgrad.build_gradient(model, precision="bf16")
    t = types(train)
    for n in train.graph.node:
        if n.op_type in ("Pad", "Greater", "ArgMax"):
            assert t[n.input[0]] == TensorProto.FLOAT, n.name
    assert any(n.op_type == "Pad" for n in train.graph.node)
    from onnxgrad.cuda import fallback_nodes
    assert not fallback_nodes(train)
    x = {"x": np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)}
    ref, got = gradients(model, "fp32", x), gradients(model, "bf16", x)
    assert max(gradient_errors(ref, got).values()) < GRAD_TOL["bf16"]


# -- memory ---------------------------------------------------------------------------------------------------

def test_simulated_activation_peak_of_a_half_precision_graph_is_about_half():
    """The simulator sizes each value by its element type, so the half-precision activations count 2 bytes."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from bench_mirror import mlp32
    from onnxgrad.ir import from_model
    from onnxgrad.memory.simulate import simulate
    from onnxgrad.shapes import type_everything

    timelines = {}
    for precision in ("fp32", "fp16", "bf16"):
        step = onnxgrad.build_gradient(mlp32(layers=16, width=64), loss_fn="mse", optimizer="sgd",
                                       precision=precision, dims={"N": 512})
        graph = from_model(step)
        type_everything(graph)
        timelines[precision] = simulate(graph)
    base = timelines["fp32"]
    for precision in ("fp16", "bf16"):
        t = timelines[precision]
        saved = sum(b for _, b in t.saved) / sum(b for _, b in base.saved)
        assert 0.45 < t.dynamic_peak / base.dynamic_peak < 0.6 and 0.45 < saved < 0.6, (precision, saved)
        assert t.static >= base.static  # float32 master weights (and the scaler's state in fp16)


# -- half activations, float32 sums -------------------------------------------------------------------------------

def block_feeds(rows: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 3, 8, 8)).astype(np.float32), "target": np.arange(rows) % 4}


def typed_graph(model: onnx.ModelProto):
    from onnxgrad.ir import from_model
    from onnxgrad.shapes import type_everything
    graph = from_model(model)
    type_everything(graph)
    return graph


def kept_for_the_backward(graph) -> dict[str, object]:
    """The forward values a backward or recomputed node reads: what the forward keeps for the backward."""
    return {v.name: v for n in graph.nodes if n.phase in ("backward", "recompute") for v in n.all_inputs
            if v is not None and v.producer is not None and v.producer.phase == "forward"}


def test_fp16_conv_block_keeps_only_half_activations():
    """BatchNormalization runs in float32 and hands its result back in half, so the Relus and the residual Add run
    in half; the float32 copies BatchNormalization's gradient reads are recomputed in the backward from the half
    Conv outputs, and so are the half copies of the weights and of the input (kept anyway in float32)."""
    train = onnxgrad.build_gradient(conv_bn_block(), precision="fp16", loss_fn="cross-entropy", dims={"N": 16})
    graph = typed_graph(train)
    by = {n.name: n for n in graph.nodes}
    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    for name in ("relu1", "residual", "relu2"):
        assert by[name].outputs[0].elem_type == f16, name
    for name in ("bn1", "bn2"):
        assert by[name].inputs[0].elem_type == f32 and by[name].outputs[0].elem_type == f32
        assert [r.op_type for r, _ in by[name].outputs[0].uses] == ["Cast"]
    kept = kept_for_the_backward(graph)
    # the loss's input, [N, 4], and the loss (a scalar the backward waits for)
    assert {name for name, v in kept.items() if v.elem_type != f16} == {"logits", "loss"}
    assert {"c1", "c2", "r1", "r2"} <= set(kept)
    recomputed = {n.inputs[0].name for n in graph.nodes if n.phase == "recompute"}
    assert all(by_op == "Cast" for by_op in (n.op_type for n in graph.nodes if n.phase == "recompute"))
    assert {"c1", "c2", "x", "w2", "wf"} <= recomputed
    report = onnxgrad.build(conv_bn_block(), precision="fp16", loss_fn="cross-entropy", dims={"N": 16}).precision
    assert report.recomputed_casts == len(recomputed)

    step32, step16 = (typed_graph(onnxgrad.build_gradient(conv_bn_block(), precision=p, loss_fn="cross-entropy",
                                                          optimizer="sgd", dims={"N": 64})) for p in ("fp32", "fp16"))
    kept32, kept16 = (sum(v.nbytes for v in kept_for_the_backward(g).values()) for g in (step32, step16))
    assert kept16 / kept32 < 0.52, (kept16, kept32)


@pytest.mark.parametrize("mirror", [None, "mxnet"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_conv_block_gradients_agree_with_float32(precision, mirror):
    """The block with Tanh (no kinks to flip), also mirrored: the recomputed Casts give the same numbers."""
    options = {"loss_fn": "cross-entropy", "mirror": mirror, "dims": {"N": 16}}
    model = conv_bn_block(activation="Tanh")
    ref = gradients(model, "fp32", block_feeds(), **options)
    got = gradients(model, precision, block_feeds(), **options)
    errors = gradient_errors(ref, got)
    assert 0 < max(errors.values()) < GRAD_TOL[precision], errors


def test_mirroring_an_fp16_training_graph_with_recomputed_casts():
    """mirror takes up a training graph whose Casts build-grad already recomputes; the gradients stay right."""
    train = onnxgrad.build_gradient(conv_bn_block(), precision="fp16", loss_fn="cross-entropy")
    mirrored = onnxgrad.build(train, mirror="mxnet", dims={"N": 16}).model
    recomputed = Counter(n.name for n in train.graph.node if n.name.endswith("_mirror"))
    assert len(mirrored.graph.node) > len(train.graph.node) and recomputed
    feeds = {**block_feeds(), "loss_scale": np.array(1.0, np.float32)}
    names = [o.name for o in train.graph.output if o.name.endswith("_grad")]
    before = dict(zip(names, ReferenceEvaluator(train).run(names, feeds)))
    after = dict(zip(names, ReferenceEvaluator(mirrored).run(names, feeds)))
    for k in names:
        np.testing.assert_array_equal(before[k], after[k])


LEARNED = ["w", "half_"]  # scaled_activation's parameters, its scalar included


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_backward_sums_of_half_gradients_accumulate_in_float32(precision):
    """A scalar weight's gradient adds up every element of an activation (64 x 256 here), and a value read three
    times adds three contributions: both sums read float32 inputs, and a float32 parameter's gradient is the
    float32 sum itself (no Cast back and forth). The scalar beside a tensor parameter is named to be learned (by
    default it would be taken for a constant)."""
    train = onnxgrad.build_gradient(scaled_activation(), precision=precision, loss_fn="mse", requires_grad=LEARNED)
    graph = typed_graph(train)
    half = HALF[precision]
    sums = [n for n in graph.nodes if n.phase == "backward" and n.op_type in ("ReduceSum", "Sum")]
    assert any(len(n.inputs) >= 3 for n in sums if n.op_type == "Sum")
    for n in sums:
        assert n.inputs[0].elem_type == TensorProto.FLOAT, n.name
        assert n.op_type == "Sum" or all(r.op_type != "Cast" or r.attr("to") == half for r, _ in n.outputs[0].uses)
    assert not [n.name for n in graph.nodes if n.op_type == "Cast" and n.inputs[0].elem_type == n.attr("to")]
    summed = [n for n in sums if n.op_type == "ReduceSum" and n.inputs[0].shape == ("N", 256)]
    built = onnxgrad.build(scaled_activation(), precision=precision, loss_fn="mse", requires_grad=LEARNED)
    assert summed and built.precision.widened_sums >= len(summed) + 1
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 256)).astype(np.float32),
             "target": rng.standard_normal((64, 256)).astype(np.float32)}
    if precision == "fp16":
        feeds["loss_scale"] = np.array(1.0, np.float32)
    ref = gradients(scaled_activation(), "fp32", {k: v for k, v in feeds.items() if k != "loss_scale"},
                    loss_fn="mse", requires_grad=LEARNED)
    got = gradients(scaled_activation(), precision, feeds, loss_fn="mse", requires_grad=LEARNED)
    errors = gradient_errors(ref, got)
    assert errors["half__grad"] < GRAD_TOL[precision] / 3, errors


# -- every rule case --------------------------------------------------------------------------------------------

# Attention with a float mask that broadcasts: the mask's gradient sums the half-precision softmax gradient
# over the broadcast axes (measured 8.2e-3)
CASE_TOL = {("Attention-float-mask-broadcast", "fp16"): 1e-2}


def test_every_rule_case_in_half_precision_agrees_with_float32():
    """The one-op graphs of the rule table (tests/cases), forward in fp16 and bf16 by the autocast lists, their
    gradients for the same inputs and head gradients against the float32 graph's. A case the reference evaluator
    cannot run in float32 either (its Pad with negative pads, GatherElements with shorter indices, ...) is
    counted, not checked."""
    import warnings
    from gradcheck import _model, float_outputs
    from test_rules import ALL_CASES
    off, not_run, ran = {}, [], 0
    for case in ALL_CASES:
        fwd, wrt = _model(case, np.float32)
        heads = float_outputs(fwd)
        rng = np.random.default_rng(0)
        x = {f"in{i}": np.asarray(case.samplers.get(i, case.sampler)(rng, spec), dtype=np.float32)
             for i, spec in enumerate(case.inputs) if isinstance(spec, tuple)}
        names = [w + "_grad" for w in wrt]
        graphs = {p: onnxgrad.build(fwd, loss=heads, requires_grad=wrt, feed_head_grads=True, precision=p,
                                    loss_scale="none").model for p in ("fp32", "fp16", "bf16")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                y = dict(zip(heads, ReferenceEvaluator(fwd).run(heads, x)))
                feeds = {**x, **{h + "_grad": rng.standard_normal(np.shape(y[h])).astype(np.float32) for h in heads}}
                ref = dict(zip(names, ReferenceEvaluator(graphs["fp32"]).run(names, feeds)))
            except Exception:  # the evaluator's own limits, in float32
                not_run.append(str(case))
                continue
            for p in ("fp16", "bf16"):
                got = dict(zip(names, ReferenceEvaluator(graphs[p]).run(names, feeds)))
                if any(np.any(v) for v in ref.values()):
                    err = max(gradient_errors(ref, got).values())
                else:  # every gradient is zero (or empty): so must the half ones be
                    err = max((float(np.abs(g).max()) for g in got.values() if g.size), default=0.0)
                if not err <= CASE_TOL.get((str(case), p), GRAD_TOL[p]):
                    off[(str(case), p)] = err
        ran += 1
    assert not off, off
    assert ran >= 890 and len(not_run) <= 26, (ran, not_run)


def test_values_an_if_reads_stay_float32():
    """The producers of the outer values an If's branches read run in float32 (a branch reads them by name, with
    their type), and the MatMul before them still runs in half; branches of float32 ops are left as they are."""
    vi = helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("Mul", ["a", "a"], ["t"])], "then", [],
                             [vi("t", TensorProto.FLOAT, [4, 3])])
    other = helper.make_graph([helper.make_node("Neg", ["a"], ["t"])], "else", [], [vi("t", TensorProto.FLOAT, [4, 3])])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32), "w")
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Tanh", ["h"], ["a"], name="act"),
             helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0, name="sx"),
             helper.make_node("Greater", ["sx", "zero"], ["cond"], name="cond"),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="loss")]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4, 5])], [vi("loss", TensorProto.FLOAT, [])],
                          [w, zero])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    train = onnxgrad.build_gradient(model, precision="fp16", requires_grad=["w"])
    t = types(train)
    assert t["h"] == TensorProto.FLOAT16 and t["a"] == TensorProto.FLOAT and t["y"] == TensorProto.FLOAT
    for sign in (1.0, -1.0):
        x = {"x": sign * np.abs(np.random.default_rng(1).standard_normal((4, 5))).astype(np.float32),
             "loss_scale": np.array(1.0, np.float32)}
        ref = gradients(model, "fp32", {"x": x["x"]}, requires_grad=["w"])
        got = dict(zip(["w_grad"], ReferenceEvaluator(train).run(["w_grad"], x)))
        assert max(gradient_errors(ref, got).values()) < GRAD_TOL["fp16"]


def test_an_output_computed_in_half_keeps_its_name_and_type_also_when_listed_twice():
    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="sum")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in
                           (("loss", []), ("y", [2, 3]), ("y", [2, 3]))], [w])
    train = onnxgrad.build_gradient(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]),
                                    precision="bf16")
    outs = [(o.name, o.type.tensor_type.elem_type) for o in train.graph.output]
    assert outs[:3] == [("loss", TensorProto.FLOAT), ("y", TensorProto.FLOAT), ("y", TensorProto.FLOAT)]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y, wg = ReferenceEvaluator(train).run(["y", "w_grad"], {"x": x})
    assert np.array_equal(y, x) and np.array_equal(wg, np.repeat(x.sum(0)[:, None], 3, 1))


def test_run_feeds_no_random_loss_scale():
    """`onnxgrad run` on a training graph with a loss_scale input keeps its stored scale (a power of two, so the
    unscaled float32 gradients are those of the graph without scaling, bit for bit)."""
    from onnxgrad.runner import run_training_graph
    plain = run_training_graph(onnxgrad.build_gradient(shipped("mlp")), steps=3, provider="cpu")
    scaled = run_training_graph(onnxgrad.build_gradient(shipped("mlp"), loss_scale="dynamic"), steps=3,
                                provider="cpu")
    assert scaled == plain


@pytest.mark.parametrize("command", ["run", "check", "train"])
def test_half_precision_graphs_on_the_cpu_provider_are_refused_in_one_line(command, tmp_path, capsys):
    """The CPU provider lacks half kernels (the cnn's MaxPool gradient, a ScatterElements add, has none in fp16);
    `check` first tries float64, where it can, and refuses only when it would run the graph's own types."""
    from onnxgrad.cli import main
    optimizer = "sgd" if command == "train" else None
    onnx.save(onnxgrad.build_gradient(shipped("cnn"), precision="fp16", optimizer=optimizer), tmp_path / "g.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((8, 1, 8, 8), np.float32), labels=np.arange(8) % 10)
    args = [command, str(tmp_path / "g.onnx")] + (["--data", str(tmp_path / "d.npz"), "--batch", "8",
                                                    "--provider", "cpu"] if command == "train" else [])
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "the graph computes in fp16 (build-grad --precision fp16)" in err and "--provider cuda" in err


def test_check_verifies_a_half_precision_training_graph_in_float64(tmp_path, capsys):
    from onnxgrad.cli import main
    onnx.save(onnxgrad.build_gradient(shipped("mlp"), precision="fp16"), tmp_path / "g.onnx")
    assert main(["check", str(tmp_path / "g.onnx")]) == 0
    assert "precision float64" in capsys.readouterr().out


def test_append_optimizer_to_a_loss_scaled_training_graph_adds_the_scaler():
    from onnxgrad.optim import append_optimizer
    train = onnxgrad.build_gradient(tanh_classifier(), precision="fp16", **CE,
                                    loss_scale_options={"growth_interval": 7})
    step = append_optimizer(train, "sgd")
    direct = onnxgrad.build_gradient(tanh_classifier(), precision="fp16", **CE, optimizer="sgd",
                                     loss_scale_options={"growth_interval": 7})
    pairs, _ = initial_state(step)
    assert pairs == initial_state(direct)[0] and "loss_scale" in pairs
    a, _ = reference_steps(step, blobs(16), 3)
    b, _ = reference_steps(direct, blobs(16), 3)
    assert a == b


def test_mirroring_a_bf16_step_graph_widens_its_new_nodes_too():
    """mirror takes up a step graph build-grad wrote in bf16 (no --precision given): the widening pass runs on
    it too, so the ordering ties and comparisons it adds read float32; the result has every node on CUDA."""
    from onnxgrad import pipeline
    from onnxgrad.cuda import fallback_nodes
    from onnxgrad.ir import from_model
    from onnxgrad.passes.precision import WidenBfloat16
    step = onnxgrad.build_gradient(shipped("transformer"), optimizer="sgd", precision="bf16")
    adopted = pipeline.Build(step, pipeline.Options())
    adopted.graph = from_model(step)
    assert WidenBfloat16().wanted(adopted)
    adopted.graph.metadata.pop("onnxgrad.precision")
    assert not WidenBfloat16().wanted(adopted)
    mirrored = onnxgrad.build(step, mirror="mxnet", dims={"N": 4})
    assert "widen_bf16" in mirrored.report["passes"]
    assert any(n.name.endswith("_mirror") for n in mirrored.model.graph.node)
    assert not fallback_nodes(mirrored.model)


def test_split_loss_scaled_step_graph_runs_as_the_step_graph():
    """Data-parallel training splits a step graph at the gradients (split.py): the gradient graph reads the
    loss scale, the update graph skips and rescales; one run of each is one run of the step graph, bitwise, also
    on a step that overflows."""
    from onnxgrad import runtime
    from onnxgrad.split import split_step_graph
    step = scaled_fp32_step()
    split = split_step_graph(step)
    assert "loss_scale" in [i.name for i in split.gradient.graph.input]
    data = overflowing_data(8)
    pairs, state = initial_state(step)
    for scale in (2.0 ** 127, 1.0):  # an overflowing step, then a good one
        feeds = {**data, **state, "loss_scale": np.array(scale, np.float32)}
        run = {}
        for part, model in (("step", step), ("gradient", split.gradient), ("update", split.update)):
            sess = runtime.session(model)
            names = [i.name for i in model.graph.input]  # state inputs too (overridable initializers)
            given = {k: v for k, v in feeds.items() if k in names}
            if part == "update":
                given.update({g: run["gradient"][g] for g in split.grads})
            run[part] = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, given)))
        assert all(np.array_equal(v, run["step"][k]) for k, v in run["update"].items())
        skipped = run["step"]["loss_scale.skipped_steps.next"]
        assert skipped == (1 if scale > 1 else 0)


def test_if_branches_are_rewritten_too():
    """A MatMul inside an If branch runs in half (its outer inputs are cast inside the branch); the branch's
    outputs and the outer values it reads stay float32; the gradients through both branches agree."""
    vi = helper.make_tensor_value_info
    then = helper.make_graph([helper.make_node("MatMul", ["a", "w2"], ["m"], name="then_mm"),
                              helper.make_node("Tanh", ["m"], ["t"], name="then_tanh")], "then", [],
                             [vi("t", TensorProto.FLOAT, [4, 2])])
    other = helper.make_graph([helper.make_node("ReduceSum", ["a", "axes"], ["t"], keepdims=1, name="else_sum")],
                              "else", [], [vi("t", TensorProto.FLOAT, [4, 1])])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((5, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("ReduceSum", ["x"], ["sx"], keepdims=0, name="sx"),
             helper.make_node("Greater", ["sx", "zero"], ["cond"], name="cond"),
             helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0, name="loss")]
    g = helper.make_graph(nodes, "g", [vi("x", TensorProto.FLOAT, [4, 5])], [vi("loss", TensorProto.FLOAT, [])],
                          inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    for precision in ("fp16", "bf16"):
        train = onnxgrad.build_gradient(model, precision=precision, requires_grad=["w", "w2"],
                                        loss_scale="none")
        forward_if = next(n for n in train.graph.node if n.name == "branch")
        branch = next(helper.get_attribute_value(a) for a in forward_if.attribute if a.name == "then_branch")
        bt = {v.name: v.type.tensor_type.elem_type for v in [*branch.value_info, *branch.output]}
        mm = next(n for n in branch.node if n.name == "then_mm")
        assert all(bt[i] == HALF[precision] for i in mm.input) and bt["t"] == TensorProto.FLOAT
        assert types(train)["a"] == TensorProto.FLOAT  # read by name in the branches: pinned
        for sign in (1.0, -1.0):
            x = {"x": sign * np.abs(rng.standard_normal((4, 5))).astype(np.float32)}
            ref = gradients(model, "fp32", x, requires_grad=["w", "w2"])
            got = dict(zip(["w_grad", "w2_grad"], ReferenceEvaluator(train).run(["w_grad", "w2_grad"], x)))
            errors = gradient_errors(ref, got)
            assert max(errors.values()) < GRAD_TOL[precision], (precision, sign, errors)
            if sign > 0:  # the then branch ran its MatMul in half, forward and in the backward If
                assert errors["w_grad"] > 0 and errors["w2_grad"] > 0
            else:  # the else branch is all float32 (the MatMul before the If writes a pinned value)
                assert errors["w_grad"] == 0 and not np.any(got["w2_grad"])


@pytest.mark.parametrize("kind", ["Loop", "Scan"])
def test_loop_and_scan_bodies_are_rewritten_too(kind):
    """A recurrence h <- tanh(h W + x_t) over 6 steps: the MatMul inside the body runs in half (the carry and the
    weight are cast inside the body), the body's inputs and outputs stay float32, so the loop's types and the
    carries it stores do not change. onnxruntime's CPU provider runs a half MatMul between Casts as float32 (it
    inserts Casts around kernels it lacks and drops the pairs that cancel), so there the gradients equal float32's:
    the rewrite changed the types and nothing else. (The reference evaluator, which would round, returns zero
    gradients for these backward loops in float32 already, and runs no reversed Scan.)"""
    vi = helper.make_tensor_value_info
    F = TensorProto.FLOAT
    steps = 6
    body_nodes = [helper.make_node("MatMul", ["h_in", "w"], ["m"], name="body_mm"),
                  helper.make_node("Add", ["m", "xt"], ["s"], name="body_add"),
                  helper.make_node("Tanh", ["s"], ["h_out"], name="body_tanh"),
                  helper.make_node("Identity", ["h_out"], ["h_seen"], name="body_seen")]
    if kind == "Loop":
        body_nodes = [helper.make_node("Gather", ["xs", "i"], ["xt"], axis=0, name="body_slice"),
                      helper.make_node("Identity", ["c_in"], ["c_out"], name="body_cond"), *body_nodes]
        body = helper.make_graph(body_nodes, "body", [vi("i", TensorProto.INT64, []), vi("c_in", TensorProto.BOOL, []),
                                                      vi("h_in", F, [4, 3])],
                                 [vi("c_out", TensorProto.BOOL, []), vi("h_out", F, [4, 3]), vi("h_seen", F, [4, 3])])
        loop = helper.make_node("Loop", ["trips", "true", "h0"], ["h_last", "hs"], body=body, name="recur")
    else:
        body = helper.make_graph(body_nodes, "body", [vi("h_in", F, [4, 3]), vi("xt", F, [4, 3])],
                                 [vi("h_out", F, [4, 3]), vi("h_seen", F, [4, 3])])
        loop = helper.make_node("Scan", ["h0", "xs"], ["h_last", "hs"], body=body, num_scan_inputs=1, name="recur")
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal((3, 3))).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(steps, np.int64), "trips"),
             numpy_helper.from_array(np.array(True), "true")]
    nodes = [loop, helper.make_node("ReduceSum", ["hs"], ["loss"], keepdims=0, name="loss")]
    g = helper.make_graph(nodes, "g", [vi("h0", F, [4, 3]), vi("xs", F, [steps, 4, 3])],
                          [vi("loss", F, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    feeds = {"h0": rng.standard_normal((4, 3)).astype(np.float32),
             "xs": rng.standard_normal((steps, 4, 3)).astype(np.float32)}
    import onnxruntime

    def run(train: onnx.ModelProto) -> dict[str, np.ndarray]:
        session = onnxruntime.InferenceSession(train.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip(["w_grad", "h0_grad"], session.run(["w_grad", "h0_grad"], feeds)))

    ref = run(onnxgrad.build_gradient(model, requires_grad=["w", "h0"]))
    for precision in ("fp16", "bf16"):
        train = onnxgrad.build_gradient(model, precision=precision, requires_grad=["w", "h0"], loss_scale="none")
        forward = next(n for n in train.graph.node if n.name == "recur")
        fbody = next(helper.get_attribute_value(a) for a in forward.attribute if a.name == "body")
        bt = {v.name: v.type.tensor_type.elem_type for v in [*fbody.value_info, *fbody.input, *fbody.output]}
        mm = next(n for n in fbody.node if n.name == "body_mm")
        assert all(bt[i] == HALF[precision] for i in mm.input), (precision, mm.input)
        assert [v.type.tensor_type.elem_type for v in fbody.input] == [v.type.tensor_type.elem_type for v in body.input]
        kept = [v.type.tensor_type.elem_type for v in fbody.output[:len(body.output)]]  # the residuals follow
        assert kept == [v.type.tensor_type.elem_type for v in body.output]
        assert types(train)["hs"] == F
        from onnxgrad.cuda import fallback_nodes
        assert not fallback_nodes(train), [str(f) for f in fallback_nodes(train)]  # bodies included
        if precision == "bf16":  # no bfloat16 MatMul on the CPU provider, not even through Casts
            continue
        errors = gradient_errors(ref, run(train))
        assert max(errors.values()) < 1e-6, (precision, errors)
