"""Adding rows into a table in onnxruntime: which formulation is exact, repeatable and fast.

    .venv/bin/python bench/bench_scatter.py [--runs 5] [--bert [--no-kernels]]

An embedding's gradient sums the output gradient's rows (N tokens x width M) into the table's rows at the token
ids. Three formulations, each a small graph run by onnxruntime's CPU provider at 1 and 2 intra-op threads:
  ScatterND add        ScatterND(zeros, ids[:, None], updates, reduction="add")
  ScatterElements add  ScatterElements(zeros, expand(ids[:, None], [N, M]), updates, axis=0, reduction="add")
  one-hot MatMul       MatMul(Cast(Equal(range(R)[:, None], ids[None, :])), updates)
Printed per case: the median time of `--runs` runs, the largest relative L2 error against a float64 sum, and
whether every run gave the same bits. onnxgrad's rules use the one-hot MatMul up to
builder.ONE_HOT_MAX_ROWS rows and ScatterElements above.

`--bert` also checks the whole-model case: BERT-base from transformers (random weights, 8 x 128 tokens,
segment ids half 0 and half 1), exported by torch.onnx's TorchScript exporter, its training graph from
`onnxgrad build-grad` run three times at 2 threads; the token-type embedding's gradient against PyTorch
autograd on the same weights and inputs.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

CASES = [  # rows R, tokens N, width M, id distribution
    (2, 1024, 768, "all-equal"), (512, 1024, 768, "cycle"), (1024, 2048, 768, "cycle"),
    (4096, 2048, 768, "zipf"), (30522, 1024, 768, "zipf"), (50257, 1024, 768, "zipf")]


def _model(nodes, rows, width):
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"]),
              helper.make_tensor_value_info("upd", TensorProto.FLOAT, ["N", width])]
    graph = helper.make_graph(nodes, "scatter", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [rows, width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    return model.SerializeToString()


def _const(name, values):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                              [len(values)], values))


def formulations(rows: int, width: int) -> dict[str, bytes]:
    zero = helper.make_tensor("", TensorProto.FLOAT, [1], [0.0])
    table = [_const("shape", [rows, width]), helper.make_node("ConstantOfShape", ["shape"], ["zeros"], value=zero),
             _const("one", [1]), helper.make_node("Unsqueeze", ["ids", "one"], ["col"])]
    return {
        "ScatterND add": _model(table + [
            helper.make_node("ScatterND", ["zeros", "col", "upd"], ["out"], reduction="add")], rows, width),
        "ScatterElements add": _model(table + [
            helper.make_node("Shape", ["upd"], ["ushape"]), helper.make_node("Expand", ["col", "ushape"], ["spread"]),
            helper.make_node("ScatterElements", ["zeros", "spread", "upd"], ["out"], axis=0, reduction="add")],
            rows, width),
        "one-hot MatMul": _model([
            _const("range_args", [0, rows, 1]),
            helper.make_node("Split", ["range_args"], ["r0", "r1", "r2"], num_outputs=3),
            _const("zero_axis", [0]),
            helper.make_node("Squeeze", ["r0", "zero_axis"], ["s0"]), helper.make_node("Squeeze", ["r1", "zero_axis"], ["s1"]),
            helper.make_node("Squeeze", ["r2", "zero_axis"], ["s2"]),
            helper.make_node("Range", ["s0", "s1", "s2"], ["along"]), _const("one", [1]),
            helper.make_node("Unsqueeze", ["along", "one"], ["rows"]),
            helper.make_node("Unsqueeze", ["ids", "zero_axis"], ["ids_row"]),
            helper.make_node("Equal", ["rows", "ids_row"], ["hits"]),
            helper.make_node("Cast", ["hits"], ["one_hot"], to=TensorProto.FLOAT),
            helper.make_node("MatMul", ["one_hot", "upd"], ["out"])], rows, width),
    }


def ids_for(kind, rows, n, rng):
    if kind == "all-equal":
        return np.zeros(n, np.int64)
    if kind == "cycle":
        return (np.arange(n) % rows).astype(np.int64)
    return np.minimum(rng.zipf(1.3, n) - 1, rows - 1).astype(np.int64)


def kernels(runs: int) -> None:
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, CPU provider, {os.cpu_count()} cores")
    print(f"| rows | tokens | width | ids | formulation | threads | median ms | max rel. error | same bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rows, n, width, kind in CASES:
        upd = rng.standard_normal((n, width)).astype(np.float32)
        ids = ids_for(kind, rows, n, rng)
        want = np.zeros((rows, width))
        np.add.at(want, ids, upd.astype(np.float64))
        for name, model in formulations(rows, width).items():
            if name == "one-hot MatMul" and rows > 8192:
                continue  # a [rows, tokens] float matrix of hundreds of MB: not a candidate there
            for threads in (1, 2):
                so = ort.SessionOptions()
                so.intra_op_num_threads = threads
                sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
                sess.run(None, {"ids": ids, "upd": upd})
                outs, times = [], []
                for _ in range(runs):
                    start = time.perf_counter()
                    outs.append(sess.run(None, {"ids": ids, "upd": upd})[0])
                    times.append(time.perf_counter() - start)
                error = max(np.linalg.norm(o - want) / np.linalg.norm(want) for o in outs)
                same = all(np.array_equal(o, outs[0]) for o in outs)
                print(f"| {rows} | {n} | {width} | {kind} | {name} | {threads} | {1e3 * np.median(times):.2f} "
                      f"| {error:.1e} | {'yes' if same else 'no'} |", flush=True)


def bert(threads: int = 2) -> None:
    import onnx
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager")

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = BertModel(config)
            self.head = torch.nn.Linear(config.hidden_size, 2)

        def forward(self, input_ids, token_type_ids, labels):
            out = self.bert(input_ids=input_ids, token_type_ids=token_type_ids).pooler_output
            return torch.nn.functional.cross_entropy(self.head(out), labels)

    model = Classifier().eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (8, 128), generator=g)
    types = torch.zeros(8, 128, dtype=torch.int64)
    types[:, 64:] = 1
    labels = torch.randint(0, 2, (8,), generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        fwd, train = os.path.join(tmp, "bert.onnx"), os.path.join(tmp, "bert_train.onnx")
        torch.onnx.export(model, (ids, types, labels), fwd, input_names=["input_ids", "token_type_ids", "labels"],
                          output_names=["loss"], opset_version=17, dynamo=False)
        subprocess.run([sys.executable, "-m", "onnxgrad.cli", "build-grad", fwd, "-o", train], check=True,
                       stdout=subprocess.DEVNULL)
        from onnxgrad import runtime
        trained = onnx.load(train)
        sess = runtime.session(trained, "cpu", threads=threads)
        names = [o.name for o in sess.get_outputs()]
        feeds = {"input_ids": ids.numpy(), "token_type_ids": types.numpy(), "labels": labels.numpy()}
        key = next(n for n in names if n.endswith("token_type_embeddings.weight_grad"))
        runs = [dict(zip(names, sess.run(None, feeds))) for _ in range(3)]
    model.zero_grad()
    model(ids, types, labels).backward()
    theirs = model.bert.embeddings.token_type_embeddings.weight.grad.numpy()
    print(f"BERT-base, 8 x 128 tokens, {threads} threads: {key}")
    for k, outs in enumerate(runs, 1):
        ours = outs[key]
        print(f"  run {k}: norm {np.linalg.norm(ours):.6f}, torch {np.linalg.norm(theirs):.6f}, "
              f"relative L2 error {np.linalg.norm(ours - theirs) / np.linalg.norm(theirs):.1e}, "
              f"same bits as run 1: {'yes' if np.array_equal(ours, runs[0][key]) else 'no'}")
    worst = max(max(np.linalg.norm(a[n] - runs[0][n]) / max(np.linalg.norm(runs[0][n]), 1e-30)
                    for n in names) for a in runs[1:])
    print(f"  every output, runs 2-3 against run 1: largest relative difference {worst:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bert", action="store_true")
    ap.add_argument("--no-kernels", action="store_true", help="skip the table (with --bert)")
    args = ap.parse_args()
    if not args.no_kernels:
        kernels(args.runs)
    if args.bert:
        bert()


if __name__ == "__main__":
    main()
