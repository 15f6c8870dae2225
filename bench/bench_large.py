"""Peak memory of `onnxgrad build-grad` on a model over 2 GB stored with external data.

    .venv/bin/python bench/bench_large.py [--dir /tmp/onnxgrad-large] [--width 11776] [--layers 4] [--run] [--keep]

Writes an MLP (`--layers` square float32 matrices of `--width`, each followed by a bias and Relu but the
last, loss = ReduceSum(y * y)) as `model.onnx` + `model.onnx.data` into `--dir` (never into the repository):
the defaults give 4 x 11776^2 x 4 bytes = 2.22 GB of weights, over protobuf's 2 GiB limit. The weights are
seeded random values written straight to the data file a block of rows at a time, so this script never holds
them in memory. It then runs `onnxgrad build-grad model.onnx -o train.onnx` in a child process and prints the
model size, the child's peak resident memory (getrusage RUSAGE_CHILDREN ru_maxrss), their ratio and the
wall time. `--run` then checks the result in a second child: onnxruntime runs the training graph from its
path, and the loss and the last layer's weight gradient are compared with numpy reading the weights through
np.memmap. Needs about 2.3 GB of free disk for the model, as much again for the training graph.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
BATCH = 2
ROWS_PER_BLOCK = 1024


def write_model(folder: Path, width: int, layers: int, seed: int = 0) -> tuple[Path, int]:
    """The MLP with its weights in model.onnx.data; returns (path, bytes of weights)."""
    path, data = folder / "model.onnx", folder / "model.onnx.data"
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    scale = np.float32(1.0 / np.sqrt(width))
    with open(data, "wb") as f:
        for k in range(layers):
            for name, shape in ((f"w{k}", (width, width)), (f"b{k}", (width,))):
                start = f.tell()
                rows = shape[0] if len(shape) == 2 else 1
                cols = shape[-1]
                for r in range(0, rows, ROWS_PER_BLOCK):
                    n = min(ROWS_PER_BLOCK, rows - r)
                    block = rng.standard_normal((n, cols), dtype=np.float32) * scale
                    f.write(block.astype("<f4").tobytes())
                t = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape),
                                data_location=TensorProto.EXTERNAL)
                for key, value in (("location", data.name), ("offset", start), ("length", f.tell() - start)):
                    t.external_data.add(key=key, value=str(value))
                inits.append(t)
            x = "x" if k == 0 else f"h{k - 1}"
            nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"]))
            last = k == layers - 1
            nodes.append(helper.make_node("Add", [f"m{k}", f"b{k}"], ["y" if last else f"a{k}"]))
            if not last:
                nodes.append(helper.make_node("Relu", [f"a{k}"], [f"h{k}"]))
        offset = f.tell()
    nodes += [helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, width])
    graph = helper.make_graph(nodes, "large_mlp", [x], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    path.write_bytes(model.SerializeToString())
    return path, offset


def measure(cmd: list[str]) -> tuple[int, float, int, str, str]:
    """(exit code, wall seconds, peak RSS bytes of this child alone (os.wait4's rusage), stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return proc.returncode, wall, usage.ru_maxrss * 1024, out.read(), err.read()


CHECK = r'''
import sys, numpy as np, onnx, onnxruntime as ort
folder, width, layers, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
train = folder + "/train.onnx"
meta = onnx.load(train, load_external_data=False)
where = {}
for t in meta.graph.initializer:
    info = {e.key: e.value for e in t.external_data}
    where[t.name] = (folder + "/" + info["location"], int(info["offset"]), tuple(t.dims)) if info else None
def weight(name):
    path, offset, shape = where[name]
    return np.memmap(path, dtype="<f4", mode="r", offset=offset, shape=shape)
x = np.random.default_rng(1).standard_normal((batch, width)).astype(np.float32)
so = ort.SessionOptions()
sess = ort.InferenceSession(train, so, providers=["CPUExecutionProvider"])
names = [o.name for o in sess.get_outputs()]
got = dict(zip(names, sess.run(None, {"x": x})))
h = x.astype(np.float64)
for k in range(layers):
    h_in = h
    h = h @ weight(f"w{k}").astype(np.float64) + weight(f"b{k}").astype(np.float64)
    if k < layers - 1:
        h = np.maximum(h, 0)
loss = float((h * h).sum())
gw = h_in.T @ (2 * h)
err_loss = abs(got["loss"] - loss) / abs(loss)
g = got[f"w{layers - 1}_grad"]
err_grad = np.linalg.norm(g - gw) / np.linalg.norm(gw)
finite = all(np.isfinite(v).all() for v in got.values())
print(f"outputs {len(names)}, loss {got['loss']:.6g} (numpy {loss:.6g}, rel err {err_loss:.1e}), "
      f"w{layers - 1}_grad rel L2 err {err_grad:.1e}, all finite {finite}")
sys.exit(0 if err_loss < 1e-4 and err_grad < 1e-4 and finite else 1)
'''


def half_check(path: Path) -> str:
    """What a half-precision build wrote: the weights still float32 and external, Casts to half at their use, and
    onnx's checker passing on the file (by path: it cannot hold the model in one proto)."""
    import onnx
    from onnx.external_data_helper import uses_external_data
    model = onnx.load(str(path), load_external_data=False)
    weights = [t for t in model.graph.initializer if t.dims and len(t.dims) == 2]
    external = [t for t in weights if uses_external_data(t) and t.data_type == onnx.TensorProto.FLOAT]
    casts = sum(n.op_type == "Cast" for n in model.graph.node)
    onnx.checker.check_model(str(path))
    return (f"{len(external)} of {len(weights)} weight matrices float32 in external data, {casts} Casts, "
            f"onnx.checker passes")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/onnxgrad-large"), help="work folder (made and emptied)")
    ap.add_argument("--width", type=int, default=11776)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--run", action="store_true", help="also run the training graph and check it against numpy")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                    help="build-grad --precision; in half precision the written graph is checked instead of run")
    args = ap.parse_args()
    folder = args.dir.resolve()
    if ROOT in folder.parents or folder == ROOT:
        sys.exit("bench_large: --dir must be outside the repository")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    need = 2 * 4 * args.layers * args.width * (args.width + 1) + (1 << 28)
    free = shutil.disk_usage(folder).free
    if free < need:
        sys.exit(f"bench_large: {folder} has {free / 1e9:.1f} GB free, needs {need / 1e9:.1f} GB")
    try:
        t = time.perf_counter()
        model, size = write_model(folder, args.width, args.layers)
        print(f"model: {args.layers} x [{args.width}, {args.width}] float32 + biases, {size / 1e9:.3f} GB of "
              f"external data ({size / 2**30:.3f} GiB), written in {time.perf_counter() - t:.1f} s")
        out = folder / "train.onnx"
        cmd = [sys.executable, "-m", "onnxgrad.cli", "build-grad", str(model), "-o", str(out),
               "--precision", args.precision]
        code, wall, peak, _, stderr = measure(cmd)
        if code != 0:
            print(stderr.strip())
            return code
        written = sum(p.stat().st_size for p in folder.glob("train.onnx*"))
        print(f"build-grad: {wall:.1f} s, peak RSS {peak / 1e9:.3f} GB, ratio to model size "
              f"{peak / size:.2f}; wrote {', '.join(sorted(p.name for p in folder.glob('train.onnx*')))} "
              f"({written / 1e9:.3f} GB)")
        if args.precision != "fp32":
            print(f"written graph: {half_check(out)}")
        elif args.run:
            check = [sys.executable, "-c", CHECK, str(folder), str(args.width), str(args.layers), str(BATCH)]
            code, wall, peak, stdout, stderr = measure(check)
            print(f"run check: {stdout.strip()}; exit {code}, {wall:.1f} s, peak RSS {peak / 1e9:.3f} GB")
            if code != 0:
                print(stderr.strip()[-2000:])
                return code
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
