"""`onnxgrad train` and onnxgrad.training.StepGraphTrainer: loss falls on the shipped models, state stays in
OrtValues bound with IOBinding, batches follow the seed, a resumed run equals a straight one, export gives a
runnable model."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxgrad
from onnxgrad.cli import main
from onnxgrad.errors import UsageError
from onnxgrad.training import Batches, StepExecutor, StepGraphTrainer, read_step_graph

MODELS = Path(__file__).resolve().parent.parent / "models"


def learnable_data(name: str, rows: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    """Data a few SGD steps can fit: labels from a fixed linear map of x, or a target that is a scaled x."""
    rng = np.random.default_rng(seed)
    if name == "transformer":
        x = rng.standard_normal((rows, 8, 16)).astype(np.float32)
        return {"x": x, "target": 0.5 * x}
    shape = (rows, 16) if name == "mlp" else (rows, 1, 8, 8)
    x = rng.standard_normal(shape).astype(np.float32)
    labels = (x.reshape(rows, -1) @ rng.standard_normal((x[0].size, 10))).argmax(1).astype(np.int64)
    return {"x": x, "labels": labels}


@pytest.fixture(scope="module")
def steps():
    """Step graphs of the shipped models: SGD (lr 0.1) for each, Adam for the MLP."""
    graphs = {name: onnxgrad.build_gradient(MODELS / f"{name}.onnx", optimizer="sgd", optimizer_options={"lr": 0.1})
              for name in ("mlp", "cnn", "transformer")}
    graphs["mlp-adam"] = onnxgrad.build_gradient(MODELS / "mlp.onnx", optimizer="adam",
                                                 optimizer_options={"lr": 0.01})
    return graphs


@pytest.fixture
def files(tmp_path, steps):
    step, data = tmp_path / "step.onnx", tmp_path / "data.npz"
    onnx.save(steps["mlp"], step)
    np.savez(data, **learnable_data("mlp"))
    return step, data


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "mlp-adam"])
def test_loss_falls_on_shipped_models(steps, name):
    trainer = StepGraphTrainer(steps[name], provider="cpu", threads=1)
    result = trainer.fit(learnable_data(name.split("-")[0]), epochs=8, batch=16)
    assert len(result.losses) == 32 and result.steps == 32 and result.epochs == 8
    assert np.mean(result.losses[-4:]) < 0.9 * np.mean(result.losses[:4])


def test_state_is_held_in_ortvalues_and_bound_with_iobinding(steps, monkeypatch):
    trainer = StepGraphTrainer(steps["mlp-adam"], provider="cpu", threads=1)
    graph = trainer.graph
    assert graph.parameters == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert set(graph.state) == set(graph.parameters) | {"step"} | {f"{p}.{k}" for p in graph.parameters
                                                                  for k in ("exp_avg", "exp_avg_sq")}
    start = trainer.state
    assert all(isinstance(v, ort.OrtValue) and v.device_name() == "cpu" for v in start.values())

    runs, host_copies = [], []
    session = trainer.executor.session
    real_run = session.run_with_iobinding
    monkeypatch.setattr(session, "run", lambda *a, **k: pytest.fail("a step ran without IOBinding"))
    monkeypatch.setattr(session, "run_with_iobinding", lambda io, *a: runs.append(io) or real_run(io, *a))
    real_numpy = ort.OrtValue.numpy
    monkeypatch.setattr(ort.OrtValue, "numpy", lambda self: host_copies.append(self) or real_numpy(self))
    batch = {k: v[:8] for k, v in learnable_data("mlp").items()}
    for _ in range(4):
        trainer.step(batch)
    monkeypatch.undo()

    assert len(runs) == 4 and runs[0] is runs[2] and runs[1] is runs[3] and runs[0] is not runs[1]
    assert len(host_copies) == 4 and not any(v is s for v in host_copies for s in start.values())
    # two preallocated buffers per state value, swapped after each step: the same OrtValues after 4 steps
    assert all(trainer.state[n] is start[n] for n in start)
    trainer.step(batch)
    assert all(trainer.state[n] is not start[n] for n in start)
    assert int(trainer.state_dict()["step"]) == 5
    stored = {t.name: numpy_helper.to_array(t) for t in steps["mlp-adam"].graph.initializer}
    assert np.array_equal(graph.initial["fc1.weight"], stored["fc1.weight"])  # the buffers do not alias it


def test_lr_override_feeds_the_lr_input(steps):
    still = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1, lr=0.0)
    before = still.parameters()
    still.fit(learnable_data("mlp"), steps=3, batch=8)
    assert all(np.array_equal(before[k], v) for k, v in still.parameters().items())
    moving = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1)
    assert moving.lr == pytest.approx(0.1)
    moving.fit(learnable_data("mlp"), steps=3, batch=8)
    assert not np.array_equal(before["fc1.weight"], moving.parameters()["fc1.weight"])


def test_batches_are_shuffled_by_seed_and_cover_each_epoch():
    arrays = {"x": np.arange(12, dtype=np.float32)[:, None], "y": np.arange(12)}
    a, b, c = Batches(arrays, 4, seed=1), Batches(arrays, 4, seed=1), Batches(arrays, 4, seed=2)
    epoch0 = np.concatenate([a[i]["y"] for i in range(3)])
    assert sorted(epoch0) == list(range(12)) and list(epoch0) != list(range(12))
    assert all(np.array_equal(a[i]["y"], b[i]["y"]) for i in range(9))
    assert any(not np.array_equal(a[i]["y"], c[i]["y"]) for i in range(3))
    epoch1 = np.concatenate([a[i]["y"] for i in range(3, 6)])
    assert sorted(epoch1) == list(range(12)) and list(epoch1) != list(epoch0)
    assert np.array_equal(a[4]["x"][:, 0], a[4]["y"])  # rows stay together across arrays
    ordered = Batches(arrays, 4, shuffle=False)
    assert list(ordered[1]["y"]) == [4, 5, 6, 7] and list(ordered[3]["y"]) == [0, 1, 2, 3]


def test_last_partial_batch_dropped_or_kept():
    arrays = {"y": np.arange(10)}
    dropped, kept = Batches(arrays, 4, shuffle=False), Batches(arrays, 4, shuffle=False, drop_last=False)
    assert len(dropped) == 2 and dropped.position(2) == (1, 0)
    assert len(kept) == 3 and list(kept[2]["y"]) == [8, 9] and kept.position(3) == (1, 0)
    with pytest.raises(UsageError, match="--batch 11: larger than the data's 10 rows"):
        Batches(arrays, 11)


def test_resume_continues_exactly_like_a_straight_run(steps, tmp_path):
    data = learnable_data("mlp", rows=24)   # batch 8: 3 steps an epoch, so the run crosses two epoch starts
    straight = StepGraphTrainer(steps["mlp-adam"], provider="cpu", threads=1)
    full = straight.fit(data, steps=10, batch=8, seed=3)

    first = StepGraphTrainer(steps["mlp-adam"], provider="cpu", threads=1)
    ck = tmp_path / "ck.npz"
    part = first.fit(data, steps=5, batch=8, seed=3, checkpoint=ck)
    second = StepGraphTrainer(steps["mlp-adam"], provider="cpu", threads=1)
    record = second.load_checkpoint(ck)
    assert record["step"] == 5 and record["epoch"] == 1 and record["batch_in_epoch"] == 2
    rest = second.fit(data, steps=10, batch=8, seed=3)

    assert rest.first_step == 6 and part.losses + rest.losses == full.losses
    end_straight, end_resumed = straight.state_dict(), second.state_dict()
    assert all(np.array_equal(end_straight[k], end_resumed[k]) for k in end_straight)
    other = StepGraphTrainer(steps["mlp-adam"], provider="cpu", threads=1)
    other.load_checkpoint(ck)
    with pytest.raises(UsageError, match="made with batch 8, this run has 4"):
        other.fit(data, steps=10, batch=4, seed=3)


def test_interrupt_saves_a_checkpoint_that_resumes_with_its_lr(steps, tmp_path):
    data, ck = learnable_data("mlp", rows=24), tmp_path / "ck.npz"
    straight = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1, lr=0.05).fit(data, steps=6, batch=8)
    first = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1, lr=0.05)
    real_step = first.step

    def step_then_ctrl_c(feeds):
        if first.steps_done == 4:
            raise KeyboardInterrupt
        return real_step(feeds)

    first.step = step_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        first.fit(data, steps=6, batch=8, checkpoint=ck)
    second = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1)      # no lr given: the checkpoint's 0.05
    assert second.load_checkpoint(ck)["step"] == 4 and second.lr == pytest.approx(0.05)
    assert second.fit(data, steps=6, batch=8).losses == straight.losses[4:]
    chosen = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1, lr=0.2)
    chosen.load_checkpoint(ck)
    assert chosen.lr == pytest.approx(0.2)


def test_checkpoint_every_n_steps(steps, tmp_path):
    ck = tmp_path / "ck.npz"
    saved = []
    trainer = StepGraphTrainer(steps["mlp"], provider="cpu", threads=1)
    real = trainer.save_checkpoint
    trainer.save_checkpoint = lambda path, batches=None: saved.append(trainer.steps_done) or real(path, batches)
    trainer.fit(learnable_data("mlp"), steps=7, batch=8, checkpoint=ck, checkpoint_every=3)
    assert saved == [3, 6, 7]
    with np.load(ck) as npz:
        assert json.loads(str(npz["onnxgrad.checkpoint"]))["step"] == 7
        assert set(npz.files) == {"onnxgrad.checkpoint"} | {f"state/{p}" for p in trainer.graph.state}


def test_export_runs_with_trained_weights(steps):
    trainer = StepGraphTrainer(steps["transformer"], provider="cpu", threads=1)
    trainer.fit(learnable_data("transformer"), steps=3, batch=8)
    stripped = trainer.export()
    substituted = trainer.export(forward=MODELS / "transformer.onnx")
    original = onnx.load(MODELS / "transformer.onnx")
    onnx.checker.check_model(stripped, full_check=True)
    assert [i.name for i in stripped.graph.input] == ["x", "target"]
    assert [o.name for o in stripped.graph.output] == ["loss", "pred"]
    assert not any(p.key.startswith("onnxgrad.") for p in stripped.metadata_props)
    assert {t.name for t in stripped.graph.initializer} == {t.name for t in original.graph.initializer}
    start = {t.name: numpy_helper.to_array(t) for t in original.graph.initializer}
    trained = {t.name: numpy_helper.to_array(t) for t in stripped.graph.initializer}
    assert not np.array_equal(start["mlp.fc1.weight"], trained["mlp.fc1.weight"])
    assert all(np.array_equal(trained[k], v) for k, v in trainer.parameters().items())
    feeds = {k: v[:4] for k, v in learnable_data("transformer", seed=1).items()}
    runs = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
            for m in (stripped, substituted, original)]
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-6)
    assert not np.allclose(runs[1][1], runs[2][1])


def test_export_drops_a_loss_that_build_grad_appended(tmp_path):
    forward = onnx.load(MODELS / "mlp.onnx")
    forward.graph.output.pop(0)   # logits only; build-grad appends the cross-entropy
    forward.graph.node.pop()
    forward.graph.input.pop()
    step = onnxgrad.build_gradient(forward, loss_fn="cross-entropy", optimizer="sgd", optimizer_options={"lr": 0.1})
    trainer = StepGraphTrainer(step, provider="cpu", threads=1)
    data = learnable_data("mlp")
    trainer.fit({"x": data["x"], "target": data["labels"]}, steps=2, batch=8)
    model = trainer.export()
    assert [i.name for i in model.graph.input] == ["x"] and [o.name for o in model.graph.output] == ["logits"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": data["x"]})[0].shape == (64, 10)


def test_cli_trains_reports_checkpoints_and_exports(files, tmp_path):
    step, data = files
    report, export, ck = tmp_path / "r.json", tmp_path / "trained.onnx", tmp_path / "ck.npz"
    proc = subprocess.run([sys.executable, "-m", "onnxgrad", "train", str(step), "--data", str(data), "--steps",
                           "12", "--batch", "8", "--threads", "1", "--report", str(report), "--export", str(export),
                           "--forward", str(MODELS / "mlp.onnx"), "--checkpoint", str(ck), "--log-every", "4"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [ln.split()[1] for ln in proc.stderr.splitlines()] == ["4/12", "8/12", "12/12"]
    assert all("loss" in ln and "samples/s" in ln for ln in proc.stderr.splitlines())
    assert proc.stdout.splitlines()[0].startswith("steps 1-12 (epoch 1.50, cpu): loss ")
    assert proc.stdout.splitlines()[1] == str(export)
    r = json.loads(report.read_text())
    assert r["command"] == "train" and r["report_version"] == 1 and r["onnxgrad_version"] == onnxgrad.__version__
    assert r["steps"] == 12 and len(r["losses"]) == 12 and len(r["step_seconds"]) == 12
    assert r["batch"] == 8 and r["samples_per_second"] > 0 and r["losses"][-1] < r["losses"][0]
    assert [t.name for t in onnx.load(export).graph.initializer] == \
        [t.name for t in onnx.load(MODELS / "mlp.onnx").graph.initializer]
    assert ck.exists()

    quiet = subprocess.run([sys.executable, "-m", "onnxgrad", "train", str(step), "--data", str(data),
                            "--steps", "14", "--batch", "8", "--resume", str(ck), "--quiet"],
                           capture_output=True, text=True)
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert quiet.stdout.startswith("steps 13-14 (epoch 1.75, cpu)")


@pytest.mark.parametrize("setup, args, message", [
    (None, ["{forward}", "--data", "{data}"], "not a step graph: no 'onnxgrad.state' metadata"),
    (None, ["{step}", "--data", "{tmp}/none.npz"], "--data {tmp}/none.npz: no such file"),
    ("wrong_key", ["{step}", "--data", "{data}"], "'images' is not a data input of the step graph"),
    ("float_labels", ["{step}", "--data", "{data}"], "'labels' is float32, the step graph wants int64"),
    ("short", ["{step}", "--data", "{data}"], "'labels' has 5 rows, 'x' has 64"),
    (None, ["{step}", "--data", "{data}", "--batch", "100"], "--batch 100: larger than the data's 64 rows"),
    (None, ["{step}", "--data", "{data}", "--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint"),
    (None, ["{step}", "--data", "{data}", "--resume", "{data}"], "not an onnxgrad checkpoint"),
    (None, ["{step}", "--data", "{data}", "--export", "{step}"], "{step}: is the input model"),
])
def test_bad_train_input_is_one_line(files, tmp_path, capsys, setup, args, message):
    step, data = files
    if setup:
        arrays = learnable_data("mlp")
        if setup == "wrong_key":
            arrays["images"] = arrays.pop("x")
        elif setup == "float_labels":
            arrays["labels"] = arrays["labels"].astype(np.float32)
        else:
            arrays["labels"] = arrays["labels"][:5]
        np.savez(data, **arrays)
    fill = {"forward": MODELS / "mlp.onnx", "step": step, "data": data, "tmp": tmp_path}
    assert main(["train", *(a.format(**fill) for a in args)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message.format(**fill) in err, err


def test_cuda_request_that_falls_back_to_cpu_is_an_error(steps, monkeypatch):
    """onnxruntime quietly runs on the CPU when its CUDA provider cannot start; --provider cuda must not."""
    monkeypatch.setattr("onnxgrad.runtime.providers", lambda name: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(ort.InferenceSession, "get_providers", lambda self: ["CPUExecutionProvider"])
    with pytest.raises(UsageError, match="--provider cuda: onnxruntime could not start its CUDA provider"):
        StepGraphTrainer(steps["mlp"], provider="cuda")


def test_step_graph_contract_is_read_from_metadata(steps):
    g = read_step_graph(steps["mlp-adam"])
    assert g.loss == "loss" and g.lr == "lr" and list(g.data) == ["x", "labels"]
    assert g.forward_outputs == ["loss", "logits"] and g.state["step"] == "step.next"
    assert g.initial["step"].dtype == np.int64 and g.initial["lr"] == np.float32(0.01)


class CountingExecutor(StepExecutor):
    """A stand-in for onnxruntime: the state is host arrays, a step adds the batch's mean of x to every
    parameter and counts in `step`; the loss is a function of the batch and the state. `shards` and `lead` as
    for one process of a data-parallel job when asked."""

    def __init__(self, graph, shards: int = 1, lead: bool = True):
        self.graph, self.device, self.shards, self.lead = graph, "cpu", shards, lead
        self.values = {name: graph.initial[name].copy() for name in graph.state}
        self.batches, self.lrs, self.counted_from, self.leads_read = [], [], None, 0

    def step(self, feeds):
        self.batches.append(feeds)
        shift = np.float32(feeds["x"].mean())
        for name in self.graph.parameters:
            self.values[name] = self.values[name] + shift
        self.values["step"] = self.values["step"] + 1
        return float(shift + self.values["fc1.bias"].sum())

    @property
    def state(self):
        return {name: ort.OrtValue.ortvalue_from_numpy(value) for name, value in self.values.items()}

    def state_dict(self):
        return {name: value.copy() for name, value in self.values.items()}

    def load_state_dict(self, values, source="the state"):
        self.values = {name: np.array(values[name]) for name in self.graph.state}

    def parameters(self):
        return {name: self.values[name].copy() for name in self.graph.parameters}

    def feed_lr(self, value):
        self.lrs.append(float(value))

    def count_from(self, steps_done):
        self.counted_from = steps_done

    def from_lead(self, read, what):
        self.leads_read += 1
        return read()


def test_the_loop_drives_any_executor_through_fit_checkpoint_and_resume(steps, tmp_path):
    """One loop for every executor: the data-parallel trainer only hands StepGraphTrainer its executor, and an
    executor that is not onnxruntime's gets the same batches, checkpoints and resume."""
    from onnxgrad.distributed import DataParallelExecutor, DataParallelTrainer
    from onnxgrad.training import SessionExecutor

    assert issubclass(DataParallelExecutor, StepExecutor) and issubclass(SessionExecutor, StepExecutor)
    assert issubclass(DataParallelTrainer, StepGraphTrainer)
    assert set(vars(DataParallelTrainer)) <= {"__module__", "__qualname__", "__doc__", "__init__"}
    assert isinstance(StepGraphTrainer(steps["mlp-adam"], provider="cpu").executor, SessionExecutor)

    graph = read_step_graph(steps["mlp-adam"])
    data = learnable_data("mlp")
    straight = StepGraphTrainer(CountingExecutor(graph), lr=0.5)
    whole = straight.fit(data, steps=6, batch=8, seed=3)
    batches = Batches(data, 8, seed=3)
    assert straight.executor.lrs == [0.5] and straight.steps_done == 6
    assert all(np.array_equal(fed["x"], batches[i]["x"]) for i, fed in enumerate(straight.executor.batches))

    first = StepGraphTrainer(CountingExecutor(graph), lr=0.5)
    first.fit(data, steps=3, batch=8, seed=3, checkpoint=tmp_path / "ck.npz")
    second = StepGraphTrainer(CountingExecutor(graph))
    record = second.load_checkpoint(tmp_path / "ck.npz")
    assert record["step"] == 3 and record["lr"] == 0.5 and second.lr == 0.5
    assert second.executor.counted_from == 3 and second.executor.leads_read == 1
    rest = second.fit(data, steps=6, batch=8, seed=3)
    assert rest.first_step == 4 and rest.losses == whole.losses[3:]
    assert all(np.array_equal(v, straight.state_dict()[k]) for k, v in second.state_dict().items())
    exported = {t.name: numpy_helper.to_array(t) for t in second.export().graph.initializer}
    assert all(np.array_equal(exported[k], v) for k, v in straight.parameters().items())

    # one of two processes, not the lead: the global batch must split in two, and it writes no checkpoint
    other = StepGraphTrainer(CountingExecutor(graph, shards=2, lead=False))
    with pytest.raises(UsageError, match="--batch 7: the global batch must split into 2 equal shards"):
        other.batches(data, 7)
    other.fit(data, steps=2, batch=8, checkpoint=tmp_path / "other.npz")
    assert not (tmp_path / "other.npz").exists()
