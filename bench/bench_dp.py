"""Data-parallel scaling on the CPU: 2 processes x 1 thread against 1 process x 1 thread, same global batch.

    .venv/bin/python bench/bench_dp.py [--models gpt,mlp] [--batch gpt=16,mlp=128] [--steps 20] [--rounds 3]
    .venv/bin/python bench/bench_dp.py --estimate        # the paper scale-out estimate for GPT-2 small only

Each model (bench_train.py's, with an AdamW step graph from `onnxgrad.build_gradient`) runs as
  fused    one process, StepGraphTrainer on the whole step graph (the one-process `onnxgrad train`)
  1 rank   one process, DataParallelTrainer (split graphs, no collective): the cost of the split
  2 ranks  two processes on gloo, each B/2 rows of every global batch of B, gradients all-reduced
with onnxruntime at 1 intra-op thread per process, processes started with torchrun's variables. Every run
takes 3 warm-up steps, then `--steps` timed steps; the sides take turns `--rounds` times and each figure is the
median over rounds of the per-run median step. Global samples/s = B / step time. The all-reduce share is the
part of rank 0's step spent waiting for the all-reduce (and ZeRO-1's broadcasts, not used here).
Scaling = samples/s of 2 ranks / samples/s of 1 rank; 2.0 is perfect on 2 cores, when nothing else runs.
On a machine shared with other work the wall-clock figures follow the load; "by CPU time" = rank 0's process
CPU time per step (all its threads, gloo's included) at 1 rank over that at 2 ranks, which is what 2 ranks
would reach with a core each: an upper bound, as time blocked in the all-reduce costs no CPU.

`--estimate` prints the step-time model for GPT-2 small (124M parameters, gradients in float32) on GPUs:
compute 6 * params * tokens / achieved FLOP/s, ring all-reduce 2 (W-1)/W * bytes / bus bandwidth, no overlap
of the two (the runner all-reduces after the backward pass).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
WARMUP = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(name: str, rows: int) -> dict[str, np.ndarray]:
    from bench_train import GPT
    rng = np.random.default_rng(0)
    if name == "gpt":
        tokens = rng.integers(0, GPT["vocab"], (rows, GPT["t"] + 1)).astype(np.int64)
        return {"tokens": tokens[:, :-1].copy(), "labels": tokens[:, 1:].copy()}
    return {"x": rng.standard_normal((rows, 784)).astype(np.float32),
            "labels": rng.integers(0, 10, rows).astype(np.int64)}


def worker(folder: Path, name: str, batch: int, steps: int, kind: str) -> None:
    """One process of a run; rank 0 writes the timings."""
    from onnxgrad.training import Batches, StepGraphTrainer

    data = dict(np.load(folder / f"{name}.npz"))
    batches = Batches(data, batch, shuffle=False)
    if kind == "fused":
        trainer = StepGraphTrainer(folder / f"{name}.onnx", provider="cpu", threads=1)
    else:
        from onnxgrad.distributed import DataParallelTrainer
        trainer = DataParallelTrainer(folder / f"{name}.onnx", provider="cpu", threads=1)
    seconds, cpu = [], []
    for i in range(WARMUP + steps):
        started, started_cpu = time.perf_counter(), time.process_time()
        trainer.step(batches[i])
        seconds.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    comm = getattr(trainer.executor, "comm_seconds", [0.0] * len(seconds))
    if kind == "fused" or trainer.executor.rank == 0:
        out = {"step_seconds": seconds[WARMUP:], "comm_seconds": comm[WARMUP:], "cpu_seconds": cpu[WARMUP:]}
        (folder / f"{name}.{kind}.json").write_text(json.dumps(out))
    if kind != "fused":
        trainer.close()


def run(folder: Path, name: str, batch: int, steps: int, kind: str) -> dict:
    world = 2 if kind == "2 ranks" else 1
    tag = {"fused": "fused", "1 rank": "rank1", "2 ranks": "rank2"}[kind]
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        if kind != "fused":
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", str(folder), name, str(batch),
                                       str(steps), "fused" if kind == "fused" else tag], env=env))
    for p in procs:
        if p.wait() != 0:
            sys.exit(f"bench_dp: a {kind} process of {name} failed")
    out = json.loads((folder / f"{name}.{'fused' if kind == 'fused' else tag}.json").read_text())
    step = float(np.median(out["step_seconds"]))
    return {"step_s": step, "samples_per_s": batch / step, "cpu_s": float(np.median(out["cpu_seconds"])),
            "allreduce_share": float(np.sum(out["comm_seconds"]) / np.sum(out["step_seconds"]))}


def gpt2_small_parameters(vocab=50257, d=768, t=1024, layers=12) -> int:
    """GPT-2 small's parameters in bench_train's GPT layout, the LM head tied to the token embedding as in
    GPT-2 (124,439,808; 163M with an untied head)."""
    block = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return vocab * d + t * d + layers * block + 2 * d


def estimate() -> None:
    params = gpt2_small_parameters()
    grad_bytes = 4 * params
    tokens = 8 * 1024                      # per GPU and step: 8 sequences of 1024 tokens
    print(f"GPT-2 small step graph: {params:,} parameters, {grad_bytes / 1e9:.2f} GB of float32 gradients; "
          f"{tokens} tokens per GPU and step")
    print(f"{'setting':44s} {'compute':>9s} {'all-reduce':>11s} {'efficiency':>10s}")
    for flops_name, flops in (("40 TFLOP/s achieved (fp32/TF32)", 40e12), ("150 TFLOP/s achieved", 150e12)):
        compute = 6 * params * tokens / flops
        for setting, world, bus in (("1 machine, 8 GPUs, NVLink (~350 GB/s bus)", 8, 350e9),
                                    ("2 machines x 8 GPUs, 400 Gb/s IB per GPU", 16, 45e9)):
            comm = 2 * (world - 1) / world * grad_bytes / bus
            print(f"{setting:44s} {compute * 1e3:7.0f}ms {comm * 1e3:9.1f}ms {compute / (compute + comm):9.1%}"
                  f"   [{flops_name}]")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,mlp")
    ap.add_argument("--batch", default="gpt=16,mlp=128", help="global batch per model")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--estimate", action="store_true", help="only print the GPT-2 small estimate")
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.estimate:
        estimate()
        return
    import onnxgrad
    from bench_train import MODELS

    batch_of = {k: int(v) for k, v in (item.split("=") for item in args.batch.split(","))}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"{args.steps} steps x {args.rounds} rounds")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models.split(","):
            batch = batch_of[name]
            step = onnxgrad.build_gradient(MODELS[name](), optimizer="adamw", optimizer_options={"lr": 1e-3})
            onnx.save(step, folder / f"{name}.onnx")
            np.savez(folder / f"{name}.npz", **make_data(name, batch * (WARMUP + args.steps)))
            rounds = {kind: [] for kind in ("fused", "1 rank", "2 ranks")}
            for _ in range(args.rounds):
                for kind in rounds:
                    rounds[kind].append(run(folder, name, batch, args.steps, kind))
            row = {kind: {key: float(np.median([r[key] for r in rs])) for key in rs[0]}
                   for kind, rs in rounds.items()}
            row["scaling"] = row["2 ranks"]["samples_per_s"] / row["1 rank"]["samples_per_s"]
            row["scaling_vs_fused"] = row["2 ranks"]["samples_per_s"] / row["fused"]["samples_per_s"]
            # What 2 ranks would reach with a core each: the work of a step (process CPU time, all threads)
            row["cpu_scaling"] = row["1 rank"]["cpu_s"] / row["2 ranks"]["cpu_s"]
            row["batch"] = batch
            results[name] = row
            print(f"{name} (global batch {batch}, 2 ranks: {batch // 2} each): "
                  + ", ".join(f"{kind} {row[kind]['step_s'] * 1e3:.1f} ms/step ({row[kind]['cpu_s'] * 1e3:.1f} ms "
                              f"CPU) {row[kind]['samples_per_s']:.0f} samples/s" for kind in rounds)
                  + f"; all-reduce share (2 ranks) {row['2 ranks']['allreduce_share']:.1%}; scaling "
                    f"{row['scaling']:.2f}x over 1 rank, {row['scaling_vs_fused']:.2f}x over fused; "
                    f"by CPU time {row['cpu_scaling']:.2f}x")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    else:
        main()
