"""Data-parallel training (onnxgrad.split, onnxgrad.distributed): the split step graph equals the step graph;
2 processes x B/2 rows give, over 20 steps, the losses and state of 1 process x B rows (sgd-momentum and adamw,
with and without ZeRO-1, with accumulation and clipping) on gloo; checkpoints resume on another world size; a
dead or hung process ends the others with one line; `onnxgrad train` runs under torchrun.

The processes are this file run as a script (`python test_distributed.py worker ...`) with the variables torchrun
sets; one pair of processes runs the whole equivalence matrix, so the suite pays PyTorch's start-up once."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / "models"
WORLD, STEPS, BATCH, ROWS = 2, 20, 8, 64
REL_TOL = 1e-5
# name: (optimizer, options, zero1)
CONFIGS = {
    "momentum": ("momentum", {"lr": 0.05}, False),
    "momentum-zero1": ("momentum", {"lr": 0.05}, True),
    "adamw": ("adamw", {"lr": 0.01}, False),
    "adamw-zero1": ("adamw", {"lr": 0.01}, True),
    "momentum-accumulate-clip": ("momentum", {"lr": 0.05, "accumulate": 2, "clip_grad_norm": 0.5}, False),
    "momentum-accumulate-clip-zero1": ("momentum", {"lr": 0.05, "accumulate": 2, "clip_grad_norm": 0.5}, True),
    "adamw-accumulate-clip": ("adamw", {"lr": 0.01, "accumulate": 2, "clip_grad_norm": 0.5}, False),
    "adamw-accumulate-clip-zero1": ("adamw", {"lr": 0.01, "accumulate": 2, "clip_grad_norm": 0.5}, True),
    "momentum-sum-loss": ("momentum", {"lr": 0.005, "accumulate": 2}, False),   # reduction sum: gradients summed
}
RESUME = "adamw-accumulate-clip"     # the optimizer of the checkpoint tests
HALF = 9                             # they stop after 9 micro-batches: between two updates
TINY_BUCKET_MB = 0.001               # ~1 KB: the MLP's gradients go to several buckets


def step_graph(name: str) -> onnx.ModelProto:
    import onnxgrad

    kind, options, _ = CONFIGS[name]
    if not name.endswith("sum-loss"):
        return onnxgrad.build_gradient(MODELS / "mlp.onnx", optimizer=kind, optimizer_options=options)
    forward = onnx.load(MODELS / "mlp.onnx")   # logits only; build-grad appends a summed cross-entropy
    forward.graph.output.pop(0)
    forward.graph.node.pop()
    forward.graph.input.pop()
    return onnxgrad.build_gradient(forward, loss_fn="cross-entropy", loss_options={"reduction": "sum"},
                                   optimizer=kind, optimizer_options=options)


def data_for(name: str) -> dict[str, np.ndarray]:
    data = learnable_data()
    return data if not name.endswith("sum-loss") else {"x": data["x"], "target": data["labels"]}


def learnable_data(rows: int = ROWS, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 16)).astype(np.float32)
    return {"x": x, "labels": (x @ rng.standard_normal((16, 10))).argmax(1).astype(np.int64)}


def rel_error(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) if np.any(a != b) else 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], world: int = WORLD, env: dict | None = None) -> list[subprocess.Popen]:
    """`world` processes running this file with torchrun's variables set."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "OMP_NUM_THREADS": "1", **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__)), *args], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


# -- the worker: one process of the job ----------------------------------------------------------------------

def worker(folder: Path) -> None:
    from onnxgrad.distributed import DataParallelTrainer

    data = dict(np.load(folder / "data.npz"))
    for name, (_, _, zero1) in CONFIGS.items():
        trainer = DataParallelTrainer(folder / f"{name}.onnx", provider="cpu", threads=1, zero1=zero1,
                                      bucket_mb=TINY_BUCKET_MB, timeout=60)
        result = trainer.fit(data_for(name), steps=STEPS, batch=BATCH, seed=0)
        state = trainer.state_dict()
        if trainer.executor.rank == 0:
            np.savez(folder / f"{name}.out.npz", losses=np.array(result.losses),
                     buckets=np.array(len(trainer.executor._buckets)),
                     comm_bytes=np.array(trainer.executor.comm_bytes),
                     **{f"state/{k}": v for k, v in state.items()})
    # checkpoints: written here after an odd number of micro-batches (ZeRO-1, each process holding its own
    # sums), and resumed here from a one-process checkpoint
    step = folder / f"{RESUME}.onnx"
    first = DataParallelTrainer(step, provider="cpu", threads=1, zero1=True, timeout=60)
    first.fit(data, steps=HALF, batch=BATCH, seed=0, checkpoint=folder / "dp_half.npz")
    second = DataParallelTrainer(step, provider="cpu", threads=1, zero1=True, timeout=60)
    second.load_checkpoint(folder / "one_half.npz")
    result = second.fit(data, steps=STEPS, batch=BATCH, seed=0)
    state = second.state_dict()
    if second.executor.rank == 0:
        np.savez(folder / "resumed.out.npz", losses=np.array(result.losses),
                 **{f"state/{k}": v for k, v in state.items()})
    second.close()


def cli_worker(stop: str, at_step: int, args: list[str]) -> int:
    """Rank 1 dies (`exit`) or hangs (`hang`) before step `at_step`; every rank runs `onnxgrad train`."""
    from onnxgrad import distributed
    from onnxgrad.cli import main

    if os.environ["RANK"] == "1":
        real = distributed.DataParallelExecutor.step
        started = []

        def step(self, feeds):
            started.append(feeds)
            if len(started) == at_step:
                if stop == "exit":
                    os._exit(3)
                time.sleep(600)
            return real(self, feeds)
        distributed.DataParallelExecutor.step = step
    return main(args)


# -- the tests -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Step graphs, data, the one-process reference runs and one 2-process run of every configuration."""
    from onnxgrad.training import StepGraphTrainer

    folder = tmp_path_factory.mktemp("dp")
    data = learnable_data()
    np.savez(folder / "data.npz", **data)
    reference = {}
    for name in CONFIGS:
        step = step_graph(name)
        onnx.save(step, folder / f"{name}.onnx")
        one = StepGraphTrainer(step, provider="cpu", threads=1)
        result = one.fit(data_for(name), steps=STEPS, batch=BATCH, seed=0)
        reference[name] = (result.losses, one.state_dict())
    one = StepGraphTrainer(folder / f"{RESUME}.onnx", provider="cpu", threads=1)
    one.fit(data, steps=HALF, batch=BATCH, seed=0, checkpoint=folder / "one_half.npz")
    results = finish(launch(["worker", str(folder)]), timeout=600)
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    return folder, reference


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_processes_equal_one_process(job, name):
    folder, reference = job
    losses, state = reference[name]
    with np.load(folder / f"{name}.out.npz") as out:
        assert int(out["buckets"]) > 1
        assert len(out["losses"]) == STEPS
        assert rel_error(out["losses"], losses) <= REL_TOL
        assert {k[len("state/"):] for k in out.files if k.startswith("state/")} == set(state)
        errors = {k: rel_error(out[f"state/{k}"], v) for k, v in state.items()}
        out_bytes = list(out["comm_bytes"])
    assert max(errors.values()) <= REL_TOL, errors
    if "clip" in name:  # the clipping was active: the run differs from one without it
        _, unclipped = reference[name.replace("-accumulate-clip", "")]
        assert rel_error(state["fc1.weight"], unclipped["fc1.weight"]) > 1e-3
    if "accumulate" in name:  # the 1st micro-batch of each pair all-reduces the loss; the 2nd the gradient sums
        sums = 4 * sum(v.size for k, v in state.items() if k.endswith(".grad_acc"))   # (+ ZeRO-1's broadcasts)
        assert set(out_bytes[0::2]) == {4} and set(out_bytes[1::2]) == {sums + 4 + (sums if "zero1" in name else 0)}
    if "sum-loss" in name:  # a summed loss: the loss of the global batch is the sum of the two halves'
        assert losses[0] > BATCH


def test_checkpoints_resume_on_another_world_size(job):
    from onnxgrad.training import StepGraphTrainer

    folder, reference = job
    losses, state = reference[RESUME]
    # 2 processes (ZeRO-1) resumed from a one-process checkpoint
    with np.load(folder / "resumed.out.npz") as out:
        assert rel_error(out["losses"], losses[HALF:]) <= REL_TOL
        assert max(rel_error(out[f"state/{k}"], v) for k, v in state.items()) <= REL_TOL
    # one process resumed from the checkpoint rank 0 wrote for 2 processes (ZeRO-1: gathered from the owners)
    one = StepGraphTrainer(folder / f"{RESUME}.onnx", provider="cpu", threads=1)
    record = one.load_checkpoint(folder / "dp_half.npz")
    assert record["step"] == HALF and int(one.state_dict()["micro_step"]) == 1
    result = one.fit(learnable_data(), steps=STEPS, batch=BATCH, seed=0)
    assert rel_error(result.losses, losses[HALF:]) <= REL_TOL
    end = one.state_dict()
    assert max(rel_error(end[k], v) for k, v in state.items()) <= REL_TOL


@pytest.mark.parametrize("stop", ["exit", "hang"])
def test_a_dead_or_hung_process_ends_the_others_with_one_line(job, stop):
    folder, _ = job
    args = ["train", str(folder / "momentum.onnx"), "--data", str(folder / "data.npz"), "--steps", "6",
            "--batch", str(BATCH), "--threads", "1", "--timeout", "4", "--quiet"]
    started = time.monotonic()
    procs = launch(["cli", stop, "3", *args])
    code, stdout, stderr = finish(procs[:1], timeout=60)[0]
    elapsed = time.monotonic() - started
    procs[1].kill()
    finish(procs[1:])
    assert code == 7, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("onnxgrad: error: rank 0 of 2: step 3: the all-reduce"), stderr
    assert "another process stopped or hangs (collective timeout 4 s)" in lines[0]
    assert elapsed < 40


def test_cli_under_torchrun(job, tmp_path):
    folder, reference = job
    report, ck, export = tmp_path / "r.json", tmp_path / "ck.npz", tmp_path / "trained.onnx"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "onnxgrad.cli", "train", str(folder / "adamw.onnx"), "--data",
                           str(folder / "data.npz"), "--steps", str(STEPS), "--batch", str(BATCH), "--threads", "1",
                           "--zero1", "--report", str(report), "--checkpoint", str(ck), "--export", str(export)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"steps 1-{STEPS} (epoch 2.50, cpu, 2 processes): loss ")
    r = json.loads(report.read_text())
    assert r["world_size"] == 2 and r["zero1"] is True and r["batch"] == BATCH and 0 <= r["allreduce_share"] < 1
    assert len(r["allreduce_bytes"]) == STEPS and min(r["allreduce_bytes"]) > 4 * 800
    assert rel_error(r["losses"], reference["adamw"][0]) <= REL_TOL
    with np.load(ck) as npz:
        assert max(rel_error(npz[f"state/{k}"], v) for k, v in reference["adamw"][1].items()) <= REL_TOL
    assert [i.name for i in onnx.load(export).graph.input] == ["x", "labels"]


def test_split_graphs_run_as_the_step_graph():
    """Gradient graph then update graph = the step graph, bitwise; phases metadata and structure agree."""
    from onnxgrad import runtime
    from onnxgrad.contract import PHASES_KEY
    from onnxgrad.split import optimizer_node_mask, split_step_graph

    for name in CONFIGS:
        data = {k: v[:8] for k, v in data_for(name).items()}
        step = step_graph(name)
        split = split_step_graph(step)
        assert split.grads[0].startswith("fc2.") and split.phase_source == "metadata"
        run = {}
        for part, model in (("step", step), ("gradient", split.gradient), ("update", split.update)):
            onnx.checker.check_model(model, full_check=True)
            sess = runtime.session(model)
            feeds = data if part != "update" else {g: run["gradient"][g] for g in split.grads}
            run[part] = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        assert run["gradient"]["loss"] == run["step"]["loss"]
        assert all(np.array_equal(v, run["step"][k]) for k, v in run["update"].items())

        unmarked = onnx.ModelProto()
        unmarked.CopyFrom(step)
        kept = [p for p in unmarked.metadata_props if p.key != PHASES_KEY]
        del unmarked.metadata_props[:]
        unmarked.metadata_props.extend(kept)
        structural = split_step_graph(unmarked)
        assert structural.phase_source == "structure" and structural.update.graph.node == split.update.graph.node
        assert optimizer_node_mask(unmarked)[0] == optimizer_node_mask(step)[0]


def test_cli_split_writes_the_two_graphs(tmp_path, capsys):
    from onnxgrad.cli import main
    from onnxgrad.contract import STATE_KEY

    onnx.save(step_graph("adamw-accumulate-clip"), tmp_path / "step.onnx")
    assert main(["split", str(tmp_path / "step.onnx"), "-o", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "gradient.onnx"), str(tmp_path / "update.onnx")]
    gradient, update = onnx.load(tmp_path / "gradient.onnx"), onnx.load(tmp_path / "update.onnx")
    assert [o.name for o in gradient.graph.output][:2] == ["loss", "logits"]
    assert {i.name for i in update.graph.input} >= {o.name for o in gradient.graph.output[2:]}
    assert STATE_KEY in {p.key for p in update.metadata_props}
    assert main(["split", str(MODELS / "mlp.onnx"), "-o", str(tmp_path)]) == 2
    assert "not a step graph" in capsys.readouterr().err


def test_zero1_deals_parameters_largest_first_to_the_least_loaded():
    from onnxgrad.distributed import partition

    sizes = {"a.weight": 100, "a.bias": 10, "b.weight": 100, "b.bias": 10, "c.weight": 50}
    assert partition(sizes, 2) == {"a.weight": 0, "b.weight": 1, "c.weight": 0, "a.bias": 1, "b.bias": 1}
    assert set(partition(sizes, 1).values()) == {0}
    assert sorted(partition(sizes, 8).values())[:3] == [0, 1, 2]


def test_buckets_follow_backward_order_and_element_type():
    from onnxgrad.distributed import plan_buckets

    f32, f16 = np.dtype(np.float32), np.dtype(np.float16)
    grads = [("c_grad", (256,), f32), ("b_grad", (10, 10), f32), ("a_grad", (300,), f32), ("h_grad", (4,), f16)]
    plan = plan_buckets(grads, 1600, ("loss", (), f32))
    assert plan == [(f32, [("c_grad", (256,)), ("b_grad", (10, 10))]), (f32, [("a_grad", (300,)), ("loss", ())]),
                    (f16, [("h_grad", (4,))])]
    assert plan_buckets(grads[:1], 8, ("loss", (), f16)) == [(f32, [("c_grad", (256,))]), (f16, [("loss", ())])]


def test_bad_phases_metadata_and_missing_torch(monkeypatch, tmp_path, capsys):
    import onnxgrad
    from onnxgrad.cli import main
    from onnxgrad.contract import PHASES_KEY
    from onnxgrad.errors import InvalidModelError
    from onnxgrad.split import split_step_graph

    step = onnxgrad.build_gradient(MODELS / "mlp.onnx", optimizer="sgd")
    onnx.save(step, tmp_path / "step.onnx")
    np.savez(tmp_path / "data.npz", **learnable_data())
    step.metadata_props.add(key=PHASES_KEY, value=json.dumps([["forward", 3], ["optimizer", 1]]))
    with pytest.raises(InvalidModelError, match="covers 4 nodes, the graph has"):
        split_step_graph(step)

    args = ["train", str(tmp_path / "step.onnx"), "--data", str(tmp_path / "data.npz"), "--steps", "1"]
    assert main([*args, "--zero1"]) == 2
    assert "--zero1: only under torchrun" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs PyTorch (torch.distributed): pip install 'onnxgrad[distributed]'" in err


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(Path(sys.argv[2]))
    elif sys.argv[1] == "cli":
        sys.exit(cli_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
