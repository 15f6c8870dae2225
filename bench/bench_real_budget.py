"""`mirror --budget` on models exported fresh from PyTorch: does onnxruntime's real peak keep to the budget?

    .venv/bin/python bench/bench_real_budget.py [--models resnet50,gpt2,bert,vit] [--budgets 0.9x,0.7x,0.5x,0.4x,least]
        [--allocators exact,arena,glibc] [--train] [--batch-scale 1.0] [--threads 2] [--exporter torchscript|dynamo]
        [--plan-for exact|arena] [--gpt2-tokens 256] [--out DIR]

Each model is built from a transformers config with random weights (nothing is downloaded) and exported by
torch.onnx's TorchScript exporter at opset 17 (`--exporter dynamo`: its dynamo exporter at opset 18, optimized),
in its own process:
  resnet50  ResNetConfig (bottleneck 3-4-6-3, 100 classes), batch 8 x 3 x 224 x 224, training-mode
            BatchNormalization, cross-entropy inside the model
  gpt2      GPT-2 small (12 x 768), batch 4 x 256 tokens (`--gpt2-tokens`), its LM loss
  bert      BERT-base with a 2-class head, batch 8 x 128 tokens (token types half 0, half 1)
  vit       ViT-B/16 with 100 classes, batch 4 x 3 x 224 x 224
(`--batch-scale` multiplies the batch, for a quicker look.) Then, as a user would:
  `onnxgrad build-grad model.onnx -o train.onnx` and, per budget, `onnxgrad mirror train.onnx --budget B -o ...`
("least": the least peak the solver reports reaching when asked for the floor, then the larger of the figure
each refusal reports and 1% over the last request, until a plan fits).
Each graph, plain and mirrored, runs in a fresh onnxruntime process (CPU provider, the graph's own order, CSE
and optimization level as onnxgrad's sessions set them; `memory.measure`) under each allocator:
  exact  the CPU arena off and glibc's mmap threshold fixed: what onnxgrad's sessions use for a budgeted graph
  arena  onnxruntime's CPU arena on (a session's default) and glibc's default malloc
  glibc  the arena off and glibc's default malloc
Printed per graph: the budget, the simulated peak, per allocator the measured peak (static bytes plus what one
run adds) over the budget and the simulated dynamic peak over the measured one, the step time relative to the
plain graph's in the same allocator, and the solver's seconds (the whole mirror command).
`--plan-for arena` passes `--allocator arena` to every `mirror`: the plans are made to fit onnxruntime's arena
(`memory.arena`), and the step graphs of `--train` keep the CPU arena on as onnxgrad's sessions then do; the
steps are timed against the plain graph's in the arena.
`--train` also runs each budgeted graph as `onnxgrad train` does (a step graph with SGD from
`onnxgrad mirror ... --optimizer sgd`, two steps on random data, started as the command starts, with glibc's
huge-page tunable where it changes something): the process's resident set is read just
before its first step and at its end (VmHWM), and the rise is compared with the budget less the static bytes.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EXPORT = r"""
import sys, warnings, torch, torch.nn.functional as F
warnings.simplefilter("ignore")
name, batch, out, exporter = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
tokens = int(sys.argv[5])  # GPT-2's sequence length
torch.manual_seed(0)
train_mode = False
if name == "resnet50":
    from transformers import ResNetConfig, ResNetForImageClassification
    net = ResNetForImageClassification(ResNetConfig(num_labels=100, layer_type="bottleneck", depths=[3, 4, 6, 3],
                                                    hidden_sizes=[256, 512, 1024, 2048], embedding_size=64))
    loss = lambda pixel_values, labels: F.cross_entropy(net(pixel_values=pixel_values).logits, labels)
    args = (torch.randn(batch, 3, 224, 224), torch.randint(0, 100, (batch,)))
    names, train_mode = ["pixel_values", "labels"], True
elif name == "vit":
    from transformers import ViTConfig, ViTForImageClassification
    net = ViTForImageClassification(ViTConfig(num_labels=100, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0, attn_implementation="eager"))
    loss = lambda pixel_values, labels: F.cross_entropy(net(pixel_values=pixel_values).logits, labels)
    args = (torch.randn(batch, 3, 224, 224), torch.randint(0, 100, (batch,)))
    names = ["pixel_values", "labels"]
elif name == "gpt2":
    from transformers import GPT2Config, GPT2LMHeadModel
    net = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))
    loss = lambda input_ids, labels: net(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                         labels=labels, use_cache=False).loss
    ids = torch.randint(0, 50257, (batch, tokens))
    args, names = (ids, ids), ["input_ids", "labels"]
elif name == "bert":
    from transformers import BertConfig, BertForSequenceClassification
    net = BertForSequenceClassification(BertConfig(num_labels=2, hidden_dropout_prob=0.0,
                                                   attention_probs_dropout_prob=0.0, attn_implementation="eager"))
    loss = lambda input_ids, token_type_ids, labels: net(input_ids=input_ids, token_type_ids=token_type_ids,
                                                         labels=labels).loss
    ids = torch.randint(0, 30522, (batch, 128))
    types = torch.zeros_like(ids)
    types[:, 64:] = 1
    args, names = (ids, types, torch.randint(0, 2, (batch,))), ["input_ids", "token_type_ids", "labels"]
"""

# the export of `loss(*args)` as a model (net's parameters its initializers), in the mode `train_mode` says; the
# tail of every export script here and in bench_families.py
EXPORT_LOSS = r"""
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = net
    def forward(self, *inputs):
        return loss(*inputs)

model = Model().train(train_mode)
if exporter == "dynamo":  # torch.export's graph, as it traces the module in its mode (train for ResNet-50)
    torch.onnx.export(model, args, out, input_names=names, output_names=["loss"], opset_version=18, dynamo=True,
                      optimize=True, external_data=False)
else:
    extra = dict(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False) if train_mode else {}
    torch.onnx.export(model, args, out, input_names=names, output_names=["loss"], opset_version=17, dynamo=False,
                      **extra)
"""
EXPORT += EXPORT_LOSS

BATCH = {"resnet50": 8, "gpt2": 4, "bert": 8, "vit": 4}
GPT2_TOKENS = 256

# `onnxgrad train` ARGS in a process that records, in the JSON file RECORD, its resident set before the first step
# ("before"), its high-water mark at the end ("hwm") and each step's seconds; MEMORY_PATTERNS=on turns
# onnxruntime's memory patterns on in its sessions (bench_patterns.py)
TRAIN = r"""
import json, os, sys, time
from onnxgrad import hugepages
hugepages.start_with_huge_pages()  # as the `onnxgrad train` command starts (cli.main with arguments does not)
from onnxgrad import cli, runtime
from onnxgrad.training import StepGraphTrainer

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

if os.environ.get("MEMORY_PATTERNS") == "on":
    settings = runtime.session_options
    def with_patterns(model, threads=None):
        so, extra = settings(model, threads)
        so.enable_mem_pattern = True
        return so, extra
    runtime.session_options = with_patterns
seen = {"times": []}
step = StepGraphTrainer.step
def observed(self, feeds):
    if "before" not in seen:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        seen["before"] = status("VmRSS")
    start = time.perf_counter()
    out = step(self, feeds)
    seen["times"].append(time.perf_counter() - start)
    return out
StepGraphTrainer.step = observed
try:
    code = cli.main(sys.argv[2:])
finally:
    json.dump({"before": seen.get("before"), "hwm": status("VmHWM"), "times": seen["times"]},
              open(sys.argv[1], "w"))
sys.exit(code)
"""


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def onnxgrad(*args):
    return [sys.executable, "-m", "onnxgrad", "-q", *args]


def mib(n):
    return f"{n / 2**20:.0f}"


PLAN_FOR: list[str] = []  # --plan-for arena: ["--allocator", "arena"], passed to every mirror


def least_budget(train: Path, out: Path, report: Path) -> tuple[str | None, float]:
    """The smallest budget the solver meets: the least peak it reports reaching (asked at the floor, read from
    the report in bytes), then, while no plan fits, the least peak the last refusal reports or 1% over the last
    request, whichever is larger (in the arena the figure depends on the budget asked)."""
    start = time.perf_counter()

    def mirror(budget: str) -> tuple[int, dict]:
        p = run(onnxgrad("mirror", str(train), "-o", str(out), "--budget", budget, "--report", str(report), *PLAN_FOR))
        return p.returncode, json.loads(report.read_text()).get("mirror") or {}

    _, r = mirror("0.01x")
    if not r.get("floor_bytes"):
        return None, time.perf_counter() - start
    floor = r["floor_bytes"] + 1
    code, r = mirror(str(floor))
    if code == 0:
        return str(floor), time.perf_counter() - start
    budget = r.get("least_peak_found_bytes") or floor
    for _ in range(8):
        code, r = mirror(str(budget))
        if code == 0:
            return str(budget), time.perf_counter() - start
        budget = max(r.get("least_peak_found_bytes") or 0, int(budget * 1.01))
    return None, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2,bert,vit")
    ap.add_argument("--budgets", default="0.9x,0.7x,0.5x,0.4x,least")
    ap.add_argument("--allocators", default="exact,arena,glibc")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--batch-scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                    help="torch.onnx's TorchScript exporter (opset 17) or its dynamo exporter (opset 18)")
    ap.add_argument("--gpt2-tokens", type=int, default=GPT2_TOKENS, help="GPT-2's sequence length")
    ap.add_argument("--out", default=None, help="keep the models here (default: a temporary folder)")
    ap.add_argument("--plan-for", choices=("exact", "arena"), default="exact",
                    help="the allocator the plans are made for (mirror --allocator)")
    args = ap.parse_args()
    if args.plan_for == "arena":
        PLAN_FOR[:] = ["--allocator", "arena"]

    from onnxgrad.api import load_graph
    from onnxgrad.memory import measure, simulate
    allocators = args.allocators.split(",")
    work = Path(args.out or tempfile.mkdtemp(prefix="bench_real_budget_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"onnxgrad mirror --budget on fresh exports; {os.cpu_count()} cores, {args.threads} threads, "
          f"each graph at the optimization level onnxgrad's sessions give it; peaks in MiB (static bytes included); "
          f"measured/budget and simulated/measured per allocator")
    header = "| model | budget | budget MiB | simulated | " + " | ".join(
        f"{a}: measured, /budget, sim/meas, step x" for a in allocators) + " | solver s |" + (
        " train: rise MiB, /(budget-static) |" if args.train else "")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for name in args.models.split(","):
        batch = max(1, round(BATCH[name] * args.batch_scale))
        tag = f"{name}_b{batch}" + ("_dynamo" if args.exporter == "dynamo" else "") + (
            f"_t{args.gpt2_tokens}" if name == "gpt2" and args.gpt2_tokens != GPT2_TOKENS else "")
        fwd, train = work / f"{tag}.onnx", work / f"{tag}_train.onnx"
        if not fwd.exists():
            p = run([sys.executable, "-c", EXPORT, name, str(batch), str(fwd), args.exporter, str(args.gpt2_tokens)])
            if p.returncode:
                print(f"| {name} | export failed: {p.stderr.strip().splitlines()[-1:]} |")
                continue
        if not train.exists():
            run(onnxgrad("build-grad", str(fwd), "-o", str(train)), check=True)
        graphs = [("plain", train, None, 0.0)]
        for budget in args.budgets.split(","):
            out, report = work / f"{tag}_{budget}.onnx", work / f"{tag}_{budget}.json"
            if budget == "least":
                value, seconds = least_budget(train, out, report)
                if value is None:
                    print(f"| {name} | least | no budget met near the floor |")
                    continue
                graphs.append((f"least ({mib(int(value))} MiB)", out, int(value), seconds))
                continue
            start = time.perf_counter()
            p = run(onnxgrad("mirror", str(train), "-o", str(out), "--budget", budget, "--report", str(report),
                             *PLAN_FOR))
            seconds = time.perf_counter() - start
            if p.returncode:
                print(f"| {name} | {budget} | exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]} |")
                continue
            graphs.append((budget, out, json.loads(report.read_text())["mirror"]["budget_bytes"], seconds))
        plain_time = {}
        for label, path, budget_bytes, seconds in graphs:
            t = simulate.simulate(load_graph(str(path)))
            cells = [name, label, mib(budget_bytes) if budget_bytes else "-", mib(t.peak)]
            for a in allocators:
                m = measure.measure(path, level="GRAPH", threads=args.threads, runs=3, allocator=a)
                peak = t.static + m["peak_bytes"]
                step = float(np.median(m["seconds"][1:]))
                plain_time.setdefault(a, step)
                cells.append(f"{mib(peak)}, {peak / budget_bytes:.2f}" if budget_bytes else f"{mib(peak)}, -")
                cells[-1] += f", {t.dynamic_peak / max(m['peak_bytes'], 1):.2f}, {step / plain_time[a]:.2f}"
            cells.append(f"{seconds:.1f}" if budget_bytes else "-")
            if args.train and budget_bytes:
                cells.append(train_rise(fwd, work, name, batch, budget_bytes, args.threads))
            elif args.train:
                cells.append("-")
            print("| " + " | ".join(cells) + " |", flush=True)


def train_rise(fwd: Path, work: Path, name: str, batch: int, budget: int, threads: int) -> str:
    """`onnxgrad train` on a budgeted step graph: the rise of the resident set from its first step on."""
    import onnx
    from onnxgrad.api import load_graph
    from onnxgrad.memory import simulate
    from onnxgrad.protos import random_feeds
    step = work / f"{fwd.stem}_{budget}{'_arena' if PLAN_FOR else ''}_step.onnx"
    p = run(onnxgrad("mirror", str(fwd), "-o", str(step), "--budget", str(budget), "--optimizer", "sgd", *PLAN_FOR))
    if p.returncode:
        return f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
    model = onnx.load(str(step), load_external_data=False)
    data = work / f"{fwd.stem}_data.npz"
    feeds = random_feeds(model, {}, 0, {t.name for t in model.graph.initializer})
    np.savez(data, **{k: np.concatenate([v, v]) for k, v in feeds.items()})
    static = simulate.simulate(load_graph(str(step))).static
    record = work / f"{fwd.stem}_train_rss.json"
    p = run([sys.executable, "-c", TRAIN, str(record), "train", str(step), "--data", str(data), "--steps", "2",
             "--batch", str(batch), "--provider", "cpu", "--threads", str(threads), "--no-shuffle", "--quiet"])
    if p.returncode:
        return f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
    seen = json.loads(record.read_text())
    rise = seen["hwm"] - seen["before"]
    return f"{mib(rise)}, {rise / max(budget - static, 1):.2f}"


if __name__ == "__main__":
    main()
