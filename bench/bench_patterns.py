"""onnxruntime's memory patterns on a training step: what `onnxgrad train` holds and how long a step takes.

    .venv/bin/python bench/bench_patterns.py MODEL.onnx [--batch 8] [--steps 4] [--rounds 2] [--threads 2]
        [--work DIR]

The model is a forward model with its loss (for instance an export of bench/bench_real_budget.py). It is turned
into a step graph with SGD (`onnxgrad build-grad --optimizer sgd`) and trained for `--steps` steps on seeded random
data, each run in a fresh process as a user runs `onnxgrad train`: with onnxgrad's session settings (memory
patterns off) and with memory patterns on (onnxruntime's default), in turn, `--rounds` times. Printed per
setting: the rise of the process's VmHWM over its resident set before the first step, and the median step time
after the first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_real_budget import TRAIN

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="where the step graph and data go (default: a temporary folder)")
    args = ap.parse_args()
    import numpy as np
    import onnx
    from onnxgrad.protos import random_feeds
    work = Path(args.work or tempfile.mkdtemp())
    step = work / (Path(args.model).stem + "_sgd_step.onnx")
    subprocess.run([sys.executable, "-m", "onnxgrad", "-q", "build-grad", args.model, "--optimizer", "sgd", "-o",
                    str(step)], check=True, capture_output=True)
    model = onnx.load(str(step), load_external_data=False)
    feeds = random_feeds(model, {}, 0, {t.name for t in model.graph.initializer})
    data = work / (Path(args.model).stem + "_data.npz")
    np.savez(data, **{k: np.concatenate([v] * args.steps) for k, v in feeds.items()})
    seen: dict[str, list] = {"off": [], "on": []}
    record = work / "train_record.json"
    for _ in range(args.rounds):
        for patterns in seen:
            subprocess.run([sys.executable, "-c", TRAIN, str(record), "train", str(step), "--data", str(data),
                            "--steps", str(args.steps), "--batch", str(args.batch), "--provider", "cpu",
                            "--threads", str(args.threads), "--no-shuffle", "--quiet"],
                           capture_output=True, text=True, check=True, env={**os.environ, "MEMORY_PATTERNS": patterns})
            run = json.loads(record.read_text())
            seen[patterns].append({"rise": run["hwm"] - run["before"], "times": run["times"]})
    print("| memory patterns | rise MiB | step s (median after the first) |")
    print("|---|---|---|")
    for patterns, runs in seen.items():
        rise = max(r["rise"] for r in runs) / 2 ** 20
        step_s = statistics.median(t for r in runs for t in r["times"][1:])
        label = "off (onnxgrad's sessions)" if patterns == "off" else "on (onnxruntime's default)"
        print(f"| {label} | {rise:.0f} | {step_s:.2f} |")


if __name__ == "__main__":
    main()
