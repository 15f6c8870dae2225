"""Rows of BENCHMARKS.md's CUDA coverage table for the shipped models, in each precision.

    .venv/bin/python bench/bench_cuda_coverage.py [--precisions fp32,fp16,bf16]

For the training graph and the AdamW step graph of each of models/{mlp,cnn,transformer}.onnx: the nodes
(subgraphs included, Constants excluded), how many onnxruntime's CUDA provider has a kernel for
(`onnxgrad.cuda`, its kernel table), how many of the nodes onnxgrad wrote fall back, and which of the forward
model's own ops do.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="fp32,fp16,bf16")
    args = ap.parse_args()
    import onnx
    import onnxgrad
    from onnxgrad.cuda import cuda_coverage, fallback_nodes
    print("| graph | nodes | run by CUDA | onnxgrad's nodes that fall back | the forward model's own that fall back |")
    print("|---|---:|---:|---:|---|")
    for precision in args.precisions.split(","):
        for name in ("mlp", "cnn", "transformer"):
            fwd = onnx.load(str(ROOT / "models" / f"{name}.onnx"))
            own = {n.name for n in fwd.graph.node}
            for optimizer in (None, "adamw"):
                train = onnxgrad.build_gradient(fwd, precision=precision, optimizer=optimizer)
                ran, total = cuda_coverage(train)
                falls = fallback_nodes(train)
                ours = [f for f in falls if f.node.split("/")[0] not in own]
                theirs = sorted({f.op_type for f in falls if f.node.split("/")[0] in own}) or ["none"]
                kind = "training graph" if optimizer is None else "AdamW step graph"
                label = f"models/{name}.onnx, {kind}" + ("" if precision == "fp32" else f", {precision}")
                print(f"| {label} | {total} | {ran} | {len(ours)} | {', '.join(theirs)} |", flush=True)


if __name__ == "__main__":
    main()
