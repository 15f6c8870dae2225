"""Mixed precision without a GPU: the simulated peak of the bench models' step graphs in fp32, fp16 and bf16, and
the numbers of half-precision training in onnx's ReferenceEvaluator (numpy; bfloat16 through ml_dtypes).

    .venv/bin/python bench/bench_precision.py [--models mlp32,resnet50,gpt12] [--image 224] [--steps 200] [--real]

Peaks: `onnxgrad.memory.simulate` on the step graph (loss, gradient, SGD update), at the batch of
bench_mirror.py, with each value at its element type's size; without and with `--mirror` (MXNet's policy).
"Kept" is what the forward keeps for the backward: the forward values a backward or recomputed node reads.
Numbers: the gradients of the shipped models and of a small Tanh classifier against the float32 graph's (||g - g32|| / ||g32||, the worst parameter, the
denominator at least 1% of the largest gradient's norm), and the loss after `--steps` full-batch Adam steps
(lr 0.01) of that classifier on 64 rows of four Gaussian blobs. `--real`: the gradients of fresh torch.onnx
exports of tests/real_models.py (training graphs without optimizer, fp16 fed loss_scale 1).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
import bench_mirror  # noqa: E402
from precision_models import blobs, reference_steps, shipped, shipped_feeds, tanh_classifier  # noqa: E402

import onnxgrad  # noqa: E402
from onnxgrad.ir import from_model  # noqa: E402
from onnxgrad.contract import BACKWARD, FORWARD, RECOMPUTE  # noqa: E402
from onnxgrad.memory.simulate import format_bytes, simulate, sizes  # noqa: E402
from onnxgrad.shapes import type_everything  # noqa: E402

PRECISIONS = ("fp32", "fp16", "bf16")
PRECISION_PASSES = ("precision", "half_sums", "recompute_casts")


def kept_bytes(graph, dims) -> int:
    """The bytes of the forward values that a backward or recomputed node reads."""
    nbytes = sizes(graph, dims)
    kept = {id(v) for n in graph.nodes if n.phase in (BACKWARD, RECOMPUTE) for v in n.all_inputs
            if v is not None and v.producer is not None and v.producer.phase == FORWARD}
    return sum(nbytes[k] for k in kept)


def peaks(name: str, args) -> list[dict]:
    make, dims, extra = bench_mirror.MODELS[name]
    forward = make(args)
    rows = []
    for precision in PRECISIONS:
        row = {"model": name, "precision": precision}
        for mirror in (None, "mxnet"):
            started = time.process_time()
            result = onnxgrad.build(forward, dims=dims, optimizer="sgd", precision=precision, mirror=mirror, **extra)
            seconds = time.process_time() - started
            graph = from_model(result.model)
            type_everything(graph)
            t = simulate(graph, dims)
            if mirror is None:
                row.update({"peak": t.peak, "dynamic": t.dynamic_peak, "saved": kept_bytes(graph, dims),
                            "build_s": seconds,
                            "precision_s": sum(result.report["passes"].get(p, 0.0) for p in PRECISION_PASSES)})
            else:
                row.update({"mirrored_dynamic": t.dynamic_peak, "mirrored_saved": kept_bytes(graph, dims)})
        rows.append(row)
    return rows


def gradient_errors(model, feeds, options) -> dict[str, float]:
    from onnx.reference import ReferenceEvaluator

    def grads(precision):
        train = onnxgrad.build_gradient(model, precision=precision, **options)
        names = [o.name for o in train.graph.output if o.name.endswith("_grad")]
        return dict(zip(names, ReferenceEvaluator(train).run(names, feeds)))
    ref = grads("fp32")
    floor = 1e-2 * max(np.linalg.norm(v) for v in ref.values())
    out = {}
    for precision in ("fp16", "bf16"):
        got = grads(precision)
        out[precision] = max(float(np.linalg.norm(got[k].astype(np.float64) - ref[k]) / max(np.linalg.norm(ref[k]),
                                                                                           floor)) for k in ref)
    return out


def real_export_errors(name: str) -> dict:
    """The worst gradient error of a fresh torch.onnx export of tests/real_models.py's `name` (the training graph
    without optimizer, loss_scale 1), over every parameter and over the non-scalar ones."""
    import contextlib
    import io
    import os
    import tempfile

    import onnx
    import torch
    from onnx.reference import ReferenceEvaluator

    import real_models
    model, args = real_models.make(name)
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
        path = os.path.join(tmp, f"{name}.onnx")
        torch.onnx.export(model, args, path, dynamo=True, optimize=True)
        forward = onnx.load(path)
    feeds = {i.name: a.numpy() for i, a in zip(forward.graph.input, args)}
    scalars = {t.name + "_grad" for t in forward.graph.initializer if not t.dims}

    def grads(precision):
        train = onnxgrad.build_gradient(forward, precision=precision)
        names = [o.name for o in train.graph.output if o.name.endswith("_grad")]
        extra = {"loss_scale": np.array(1.0, np.float32)} if precision == "fp16" else {}
        return dict(zip(names, ReferenceEvaluator(train).run(names, {**feeds, **extra})))
    ref = grads("fp32")
    floor = 1e-2 * max(np.linalg.norm(v) for v in ref.values())
    out = {}
    for precision in ("fp16", "bf16"):
        got = grads(precision)
        errors = {k: float(np.linalg.norm(got[k].astype(np.float64) - ref[k]) / max(np.linalg.norm(ref[k]), floor))
                  for k in ref}
        worst = max(errors, key=errors.get)
        out[precision] = (errors[worst], worst, max((e for k, e in errors.items() if k not in scalars), default=0.0))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp32,resnet50,gpt12")
    ap.add_argument("--image", type=int, default=224, help="resnet50's image size")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--real", action="store_true", help="also the fresh PyTorch exports of tests/real_models.py "
                    "(needs torch; about 30 s)")
    args = ap.parse_args(argv)

    print("| model | precision | simulated peak | dynamic peak | kept for the backward | with `--mirror` (mxnet): "
          "dynamic peak | kept | build CPU s (precision passes, wall s) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(",") if args.models else []:
        rows = peaks(name, args)
        base = rows[0]

        def vs(r, key):
            return "" if r is base else f" ({r[key] / base[key]:.2f}x)"
        for r in rows:
            print(f"| {name} | {r['precision']} | {format_bytes(r['peak'])} | {format_bytes(r['dynamic'])}"
                  f"{vs(r, 'dynamic')} | {format_bytes(r['saved'])} | {format_bytes(r['mirrored_dynamic'])}"
                  f"{vs(r, 'mirrored_dynamic')} | {format_bytes(r['mirrored_saved'])} | "
                  f"{r['build_s']:.2f} ({r['precision_s']:.2f}) |", flush=True)

    print("\n| model | worst gradient error fp16 | bf16 |")
    print("|---|---|---|")
    ce = {"loss_fn": "cross-entropy", "target": "logits"}
    cases = [("tanh classifier (batch 16)", tanh_classifier(), blobs(16), ce)]
    cases += [(f"{n} (batch 4)", shipped(n), shipped_feeds(n), {}) for n in ("mlp", "cnn", "transformer")]
    for label, model, feeds, options in cases:
        e = gradient_errors(model, feeds, options)
        print(f"| {label} | {e['fp16']:.1e} | {e['bf16']:.1e} |", flush=True)

    if args.real:
        import logging
        import warnings
        import real_models
        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        print("\n| real export | fp16 worst (parameter) | without scalar constants | bf16 worst (parameter) | "
              "without scalar constants |")
        print("|---|---|---|---|---|")
        for name in real_models.MODELS:
            e = real_export_errors(name)
            print(f"| {name} | " + " | ".join(f"{e[p][0]:.1e} ({e[p][1]}) | {e[p][2]:.1e}" for p in ("fp16", "bf16"))
                  + " |", flush=True)

    marks = sorted({k for k in (1, 50, 100, 150) if k < args.steps} | {args.steps})
    print("\n| precision | " + " | ".join(f"loss at step {k}" for k in marks) + " | vs fp32 | steps skipped | "
          "final scale |")
    print("|---|" + "---|" * (len(marks) + 3))
    final32 = None
    for precision in PRECISIONS:
        step = onnxgrad.build_gradient(tanh_classifier(), optimizer="adam", optimizer_options={"lr": 0.01},
                                       precision=precision, **ce)
        losses, state = reference_steps(step, blobs(64), args.steps)
        final32 = losses[-1] if final32 is None else final32
        picks = [losses[k - 1] for k in marks]
        scale = state.get("loss_scale")
        print(f"| {precision} | " + " | ".join(f"{v:.5f}" for v in picks) +
              f" | {(losses[-1] - final32) / final32:+.2%} | "
              f"{int(state['loss_scale.skipped_steps']) if scale is not None else '-'} | "
              f"{float(scale) if scale is not None else '-'} |", flush=True)


if __name__ == "__main__":
    main()
