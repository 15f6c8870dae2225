"""`build-grad` and `mirror --budget` across model families exported fresh from PyTorch, as a user runs them.

    .venv/bin/python bench/bench_families.py [--families convnext,swin,...] [--exporters torchscript,dynamo]
        [--budgets 0.7x,0.5x,least] [--batch-scale 1.0] [--threads 2] [--out DIR]

Each family is built from a transformers config with random weights (nothing is downloaded), small in width and
depth but at a batch whose activations are mostly over glibc's mmap threshold, with its loss inside the model, and
exported in its own process by torch.onnx's TorchScript exporter (opset 17) or its dynamo exporter (opset 18,
optimized). Then the commands a user runs: `onnxgrad build-grad model.onnx -o train.onnx`, `onnxgrad mirror
train.onnx --budget B` per budget ("least": the floor the solver reports, then what each refusal reports, as
`bench_real_budget.py` finds it), and `onnxgrad run` for one step of the plain graph. Each graph is measured in
a fresh onnxruntime process allocating as onnxgrad's sessions do for a budgeted graph (`memory.measure`, exact).

Printed per family and exporter: the command that failed and its exit status, else the plain graph's simulated
and measured peaks, and per budget the measured peak over the budget, the simulated dynamic peak over the
measured one, the step time over the plain graph's and the mirror command's seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
sys.path.insert(0, str(ROOT))

from bench_real_budget import EXPORT_LOSS, least_budget, mib, onnxgrad, run  # noqa: E402

EXPORT = r"""
import sys, warnings, torch, torch.nn.functional as F
warnings.simplefilter("ignore")
import transformers as T
name, batch, out, exporter = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.manual_seed(0)
text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=500)

def image(config, model, **kw):
    net = getattr(T, model)(getattr(T, config)(num_labels=10, **kw))
    loss = lambda pixel_values, labels: F.cross_entropy(net(pixel_values=pixel_values).logits, labels)
    return net, loss, (torch.randn(batch, 3, 128, 128), torch.randint(0, 10, (batch,))), ["pixel_values", "labels"]

def classify(config, model, **kw):
    net = getattr(T, model)(getattr(T, config)(num_labels=3, **kw))
    loss = lambda input_ids, labels: F.cross_entropy(net(input_ids=input_ids).logits, labels)
    return net, loss, (torch.randint(0, 500, (batch, 128)), torch.randint(0, 3, (batch,))), ["input_ids", "labels"]

def causal(config, model, **kw):
    net = getattr(T, model)(getattr(T, config)(**kw))
    loss = lambda input_ids, labels: net(input_ids=input_ids, labels=labels, use_cache=False).loss
    ids = torch.randint(0, 500, (batch, 128))
    return net, loss, (ids, ids), ["input_ids", "labels"]

FAMILIES = {
    "convnext": lambda: image("ConvNextConfig", "ConvNextForImageClassification", hidden_sizes=[16, 32, 64, 128],
                              depths=[1, 1, 2, 1]),
    "mobilenetv2": lambda: image("MobileNetV2Config", "MobileNetV2ForImageClassification", depth_multiplier=0.35),
    "mobilevit": lambda: image("MobileViTConfig", "MobileViTForImageClassification", image_size=128),
    "regnet": lambda: image("RegNetConfig", "RegNetForImageClassification", hidden_sizes=[16, 32, 64, 128],
                            depths=[1, 1, 1, 1], groups_width=8),
    "swin": lambda: image("SwinConfig", "SwinForImageClassification", image_size=128, embed_dim=32,
                          depths=[1, 1, 2, 1], num_heads=[2, 2, 4, 4], window_size=4),
    "deit": lambda: image("DeiTConfig", "DeiTForImageClassification", image_size=128, patch_size=16,
                          **{k: v for k, v in text.items() if k != "vocab_size"}),
    "distilbert": lambda: classify("DistilBertConfig", "DistilBertForSequenceClassification", dim=64, n_layers=2,
                                   n_heads=4, hidden_dim=128, vocab_size=500),
    "roberta": lambda: classify("RobertaConfig", "RobertaForSequenceClassification", **text),
    "albert": lambda: classify("AlbertConfig", "AlbertForSequenceClassification", embedding_size=32, **text),
    "electra": lambda: classify("ElectraConfig", "ElectraForSequenceClassification", embedding_size=32, **text),
    "llama": lambda: causal("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **text),
    "qwen2": lambda: causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, **text),
    "opt": lambda: causal("OPTConfig", "OPTForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          ffn_dim=128, vocab_size=500, word_embed_proj_dim=64),
    "bloom": lambda: causal("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4, vocab_size=500),
    "t5": lambda: (lambda net: (net, lambda input_ids, labels: net(input_ids=input_ids, labels=labels,
                                                                   use_cache=False).loss,
                                (torch.randint(0, 500, (batch, 128)), torch.randint(0, 500, (batch, 32))),
                                ["input_ids", "labels"]))(
        T.T5ForConditionalGeneration(T.T5Config(vocab_size=500, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0))),
}
net, loss, args, names = FAMILIES[name]()
train_mode = False
"""
EXPORT += EXPORT_LOSS


# the batch per family: activations of tens of MiB at the widths above
BATCH = {"convnext": 32, "mobilenetv2": 32, "mobilevit": 32, "regnet": 32, "swin": 32, "deit": 32,
         "distilbert": 32, "roberta": 32, "albert": 32, "electra": 32, "llama": 16, "qwen2": 16, "opt": 16,
         "bloom": 16, "t5": 16}
# families torch.onnx's TorchScript exporter cannot export (aten::diff in the causal mask)
NO_TORCHSCRIPT = {"llama", "qwen2"}


def tail(p: subprocess.CompletedProcess) -> str:
    lines = (p.stderr or p.stdout).strip().splitlines()
    return lines[-1][:160] if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(BATCH))
    ap.add_argument("--exporters", default="torchscript,dynamo")
    ap.add_argument("--budgets", default="0.7x,0.5x,least")
    ap.add_argument("--batch-scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="keep the models here (default: a temporary folder)")
    args = ap.parse_args()

    from onnxgrad.api import load_graph
    from onnxgrad.memory import measure, simulate
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_families_"))
    work.mkdir(parents=True, exist_ok=True)
    budgets = args.budgets.split(",")
    print(f"build-grad and mirror --budget on fresh exports; {os.cpu_count()} cores, {args.threads} threads; "
          f"peaks in MiB with the static bytes; measured in onnxruntime as onnxgrad's sessions allocate (exact)")
    header = ("| family | exporter | batch | plain: simulated, measured | "
              + " | ".join(f"{b}: budget MiB, measured/budget, sim/meas, step x, solve s" for b in budgets) + " |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for exporter in args.exporters.split(","):
        for name in args.families.split(","):
            if exporter == "torchscript" and name in NO_TORCHSCRIPT:
                continue
            batch = max(1, round(BATCH[name] * args.batch_scale))
            tag = f"{name}_{exporter}_b{batch}"
            fwd, train = work / f"{tag}.onnx", work / f"{tag}_train.onnx"
            cells = [name, exporter, str(batch)]
            if not fwd.exists():
                p = run([sys.executable, "-c", EXPORT, name, str(batch), str(fwd), exporter])
                if p.returncode:
                    print("| " + " | ".join(cells + [f"export failed: {tail(p)}"]) + " |", flush=True)
                    continue
            p = run(onnxgrad("build-grad", str(fwd), "-o", str(train)))
            if p.returncode:
                print("| " + " | ".join(cells + [f"build-grad exit {p.returncode}: {tail(p)}"]) + " |", flush=True)
                continue
            p = run(onnxgrad("run", str(train), "--steps", "1"))
            if p.returncode:
                print("| " + " | ".join(cells + [f"run exit {p.returncode}: {tail(p)}"]) + " |", flush=True)
                continue
            t = simulate.simulate(load_graph(str(train)))
            m = measure.measure(train, level="GRAPH", threads=args.threads, runs=3, allocator="exact")
            plain_step = float(np.median(m["seconds"][1:]))
            cells.append(f"{mib(t.peak)}, {mib(t.static + m['peak_bytes'])}")
            for budget in budgets:
                out, report = work / f"{tag}_{budget}.onnx", work / f"{tag}_{budget}.json"
                start = time.perf_counter()
                if budget == "least":
                    value, _ = least_budget(train, out, report)
                    if value is None:
                        cells.append("no budget met near the floor")
                        continue
                    budget_bytes = int(value)
                else:
                    p = run(onnxgrad("mirror", str(train), "-o", str(out), "--budget", budget, "--report",
                                     str(report)))
                    if p.returncode:
                        cells.append(f"exit {p.returncode}: {tail(p)}")
                        continue
                    budget_bytes = json.loads(report.read_text())["mirror"]["budget_bytes"]
                seconds = time.perf_counter() - start
                p = run(onnxgrad("run", str(out), "--steps", "1"))
                if p.returncode:
                    cells.append(f"run exit {p.returncode}: {tail(p)}")
                    continue
                tb = simulate.simulate(load_graph(str(out)))
                mb = measure.measure(out, level="GRAPH", threads=args.threads, runs=3, allocator="exact")
                peak = tb.static + mb["peak_bytes"]
                step = float(np.median(mb["seconds"][1:]))
                cells.append(f"{mib(budget_bytes)}, {peak / budget_bytes:.2f}, "
                             f"{tb.dynamic_peak / max(mb['peak_bytes'], 1):.2f}, {step / plain_step:.2f}, "
                             f"{seconds:.1f}")
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
