"""The GPU check: onnxgrad's step graphs on onnxruntime's CUDA provider, against its CPU provider and PyTorch eager.

    python3 bench/gpu_check.py                       # an interpreter with onnxruntime-gpu, onnx, numpy, click
                                                     # (and a CUDA torch, for the torch column)
    python3 bench/gpu_check.py --setup /tmp/gpu-venv # first build that venv from the package index, then run in it
    python3 bench/gpu_check.py --libraries-only      # only step 1

1. The environment: the GPU (nvidia-smi), the onnxruntime build and the CUDA major version it was built for, and
   every shared library its CUDA provider needs (after `onnxruntime.preload_dlls()`, which looks in the
   nvidia-* wheels' folders too), each found or missing. With one missing it prints the pip line that installs
   it and exits 2. onnxruntime-gpu 1.31 is built for CUDA 13: it needs the CUDA 13 wheels (nvidia-cublas,
   nvidia-cuda-runtime, nvidia-curand, nvidia-cudnn-cu13), not the -cu12 ones.
2. Per model (mlp, cnn, gpt of bench/bench_train.py, same weights and batches), one table row:
   - table: nodes of the SGD step graph the CUDA kernel table (onnxgrad/cuda.py) says fall back to the CPU;
   - placed on CPU: nodes onnxruntime actually ran on the CPU provider (its profiler's provider per node;
     Memcpy nodes and the int64 shape computations it keeps on the CPU on purpose are counted apart);
   - gradient error: the training graph on the CUDA provider (TF32 off) against the CPU provider, the largest
     relative L2 error over the parameters' gradients;
   - step ms: `StepGraphTrainer(provider="cuda")` (what `onnxgrad train --provider cuda` runs) against torch eager
     on the GPU, in paired rounds (blocks of steps taking turns), the ratio being the median over rounds; both
     sides TF32 as their defaults on this GPU would have it made equal: on;
   - memory: device memory our session holds after the steps (the CUDA arena's high-water mark and the
     libraries' workspaces: process memory from nvidia-smi, after minus before), and torch's
     `max_memory_reserved` (its caching allocator's high-water mark);
   - `onnxgrad train --provider cuda` runs 20 steps of the step graph from an .npz in a child process.
3. The same rows for the mixed-precision step graphs (`build-grad --precision fp16`, with dynamic loss scaling,
   and `bf16`; `--precisions` to choose), the gradient error taken against the float32 graph on the CPU provider
   and torch running under `torch.autocast` (with a GradScaler for fp16); then one table of each half-precision
   row against its model's float32 row: step time and memory, ours and torch's.
4. The budget on CUDA, per `--budgets` (gpt by default): the training graph planned by `mirror --budget B`
   for the live bytes and for the arena, run as onnxgrad's sessions run it (CUDA's arena with kNextPowerOfTwo and
   `gpu_mem_limit` = the budget): whether the runs stay within the limit, and the device memory held, against the
   emulated arena (`predicted.arena_peak_bytes`).
Takes 1-3 minutes on one GPU per precision. Nothing here needs a GPU to import: tests/test_cuda_coverage.py tests
the parts that do not.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = ("mlp", "cnn", "gpt")
PRECISIONS = ("fp32", "fp16", "bf16")

# The libraries onnxruntime's CUDA provider needs, per CUDA major version of the build, with the pip packages
# that carry them: those its library links (ldd libonnxruntime_providers_cuda.so) and cuDNN, which it opens
# for Conv. The driver, libcuda.so.1, comes with the NVIDIA driver, never from pip.
LIBRARIES = {
    13: {"libcudart.so.13": "nvidia-cuda-runtime~=13.0", "libcublas.so.13": "nvidia-cublas~=13.0",
         "libcublasLt.so.13": "nvidia-cublas~=13.0", "libcurand.so.10": "nvidia-curand~=10.0",
         "libcudnn.so.9": "nvidia-cudnn-cu13~=9.0"},
    12: {"libcudart.so.12": "nvidia-cuda-runtime-cu12", "libcublas.so.12": "nvidia-cublas-cu12",
         "libcublasLt.so.12": "nvidia-cublas-cu12", "libcurand.so.10": "nvidia-curand-cu12",
         "libcudnn.so.9": "nvidia-cudnn-cu12~=9.0"},
}
DRIVER = "libcuda.so.1"


# -- step 1: the environment ----------------------------------------------------------------------------------

def cuda_major(build_info_cuda_version: str | None) -> int:
    """The CUDA major version onnxruntime-gpu was built for ('13.0' -> 13); 12 when the build does not say."""
    try:
        return int(str(build_info_cuda_version).split(".")[0])
    except ValueError:
        return 12


def missing_libraries(major: int, load=None) -> list[str]:
    """The provider's libraries (and the driver) that cannot be loaded, in a fixed order."""
    load = load or (lambda name: ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL))
    missing = []
    for name in [DRIVER, *LIBRARIES[major]]:
        try:
            load(name)
        except OSError:
            missing.append(name)
    return missing


def install_command(ort_version: str, major: int, missing: list[str]) -> str:
    """The pip line that installs what is missing (the driver excepted)."""
    packages = sorted({LIBRARIES[major][name] for name in missing if name in LIBRARIES[major]})
    return " ".join(["pip install", f"onnxruntime-gpu=={ort_version}", *(f'"{p}"' for p in packages)])


def gpu_description() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip() or out.stderr.strip() or "nvidia-smi printed nothing"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi not available ({e})"


def process_device_mib(pid: int | None = None) -> float | None:
    """Device memory this process holds (MiB), from nvidia-smi; None where nvidia-smi cannot say."""
    pid = pid or os.getpid()
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_compute_apps(out, pid)


def parse_compute_apps(text: str, pid: int) -> float | None:
    total, seen = 0.0, False
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            try:
                total += float(parts[1])
                seen = True
            except ValueError:
                pass
    return total if seen else None


def setup_venv(folder: Path) -> Path:
    """A venv with onnxruntime-gpu, its CUDA wheels, onnx, numpy, click and a CUDA torch; returns its python."""
    import venv
    if not (folder / "bin" / "python").exists():
        venv.create(folder, with_pip=True)
    python = folder / "bin" / "python"
    version = "1.31.1"
    try:
        import onnxruntime
        version = onnxruntime.__version__
    except ImportError:
        pass
    packages = [f"onnxruntime-gpu[cuda,cudnn]=={version}", "nvidia-cublas~=13.0", "onnx", "numpy", "click", "torch"]
    print("$", python, "-m pip install", *packages, flush=True)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", *packages])
    if done.returncode:
        sys.exit(f"gpu_check: pip could not install {packages} (no package index here?); install them by hand")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(ROOT)], check=True)
    return python


# -- step 2: the models --------------------------------------------------------------------------------------

INTEGER_TYPES = {"int64", "int32", "bool"}
SHAPE_VALUES = "CPUExecutionProvider, small integer outputs"


def _elements(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def placement(events: list[dict]) -> dict[str, dict[str, int]]:
    """Per provider, the op types of the nodes it ran (onnxruntime profiler events of one or more runs, each
    node counted once). CPU nodes whose outputs are all small integer or boolean tensors (shape arithmetic,
    which onnxruntime keeps on the CPU on purpose) are counted under SHAPE_VALUES."""
    seen, out = set(), {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        name = e["name"][:-len("_kernel_time")]
        if name in seen:
            continue
        seen.add(name)
        provider = args.get("provider", "?")
        outputs = [(t, shape) for o in args.get("output_type_shape", []) for t, shape in o.items()]
        if provider == "CPUExecutionProvider" and outputs and all(
                t in INTEGER_TYPES and _elements(shape) <= 64 for t, shape in outputs):
            provider = SHAPE_VALUES
        op = args.get("op_name", "?")
        out.setdefault(provider, {})
        out[provider][op] = out[provider].get(op, 0) + 1
    return out


def cpu_nodes(by_provider: dict[str, dict[str, int]]) -> tuple[dict[str, int], dict[str, int]]:
    """(nodes with float outputs the CPU provider ran, Memcpy aside; the shape arithmetic it ran) by op type."""
    cpu = by_provider.get("CPUExecutionProvider", {})
    return {op: n for op, n in cpu.items() if not op.startswith("Memcpy")}, dict(by_provider.get(SHAPE_VALUES, {}))


def relative_l2(a, b) -> float:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def format_table(rows: list[dict]) -> str:
    head = ("| model | table: fallbacks | placed on CPU (besides shape ops) | gradient error CUDA vs CPU | ours ms | "
            "torch ms | ours / torch | ours MiB | torch MiB | `train --provider cuda` |")
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]

    def num(v, fmt):
        return "n/a" if v is None else format(v, fmt)
    for r in rows:
        cpu = ", ".join(f"{op} x{n}" for op, n in sorted(r.get("cpu_nodes", {}).items())) or "none"
        lines.append(f"| {r['model']} | {r.get('table_fallbacks', 'n/a')} | {cpu} | {num(r.get('grad_error'), '.1e')} | "
                     f"{num(r.get('ours_ms'), '.2f')} | {num(r.get('torch_ms'), '.2f')} | "
                     f"{num(r.get('ratio'), '.2f')}{'x' if r.get('ratio') is not None else ''} | "
                     f"{num(r.get('ours_mib'), '.0f')} | {num(r.get('torch_mib'), '.0f')} | {r.get('cli', 'n/a')} |")
    return "\n".join(lines)


def format_precision_table(rows: list[dict]) -> str:
    """Each half-precision row against its model's float32 row: the step time and memory of ours and of torch
    (autocast against eager float32)."""
    base = {r["model"]: r for r in rows if r.get("precision", "fp32") == "fp32"}
    lines = ["| model | precision | ours ms vs fp32 | ours MiB vs fp32 | torch ms vs fp32 | torch MiB vs fp32 |",
             "|---|---|---:|---:|---:|---:|"]

    def ratio(r, b, key):
        if b is None or r.get(key) is None or not b.get(key):
            return "n/a"
        return f"{r[key] / b[key]:.2f}x"
    for r in rows:
        precision = r.get("precision", "fp32")
        if precision == "fp32":
            continue
        name = r["model"].split()[0]
        b = base.get(name)
        lines.append(f"| {name} | {precision} | {ratio(r, b, 'ours_ms')} | {ratio(r, b, 'ours_mib')} | "
                     f"{ratio(r, b, 'torch_ms')} | {ratio(r, b, 'torch_mib')} |")
    return "\n".join(lines)


def check_model(name: str, steps: int, rounds: int, lr: float, use_torch: bool, device: str = "cuda",
                precision: str = "fp32") -> dict:
    """One row of the table. device="cpu" runs the same steps on the CPU provider (and torch on the CPU): a dry
    run of this script where there is no GPU (float32 only: the CPU provider has no half-precision kernels).
    `precision`: the step graph's --precision; its gradients are compared with the float32 graph's on the CPU."""
    row: dict = {"model": name if precision == "fp32" else f"{name} {precision}", "precision": precision}
    if device == "cpu" and precision != "fp32":
        row["cli"] = "skipped: the CPU provider has no half-precision kernels"
        return row
    import numpy as np
    import onnxruntime as ort

    import bench_train
    import onnxgrad
    from onnxgrad import runtime
    from onnxgrad.cuda import fallback_nodes
    from onnxgrad.training import StepGraphTrainer

    model = bench_train.MODELS[name]()
    batch = bench_train.batch_for(name, np.random.default_rng(0))
    step = bench_train.step_graph(model, lr, precision)
    table = fallback_nodes(step)
    row["table_fallbacks"] = ", ".join(sorted({f.op_type for f in table})) or "none"

    # gradients: CUDA (TF32 off) against CPU (the float32 graph: the CPU provider has no half kernels)
    train = onnxgrad.build_gradient(model, precision=precision)
    train32 = train if precision == "fp32" else onnxgrad.build_gradient(model)
    so, extra = runtime.session_options(train, None)
    first_choice = [("CUDAExecutionProvider", {"use_tf32": "0"})] if device == "cuda" else []
    cuda_sess = ort.InferenceSession(train.SerializeToString(), so,
                                     providers=[*first_choice, "CPUExecutionProvider"], **extra)
    cpu_sess = ort.InferenceSession(train32.SerializeToString(), so, providers=["CPUExecutionProvider"], **extra)
    names = [o.name for o in train.graph.output]
    got = dict(zip(names, cuda_sess.run(None, batch)))
    want = dict(zip([o.name for o in train32.graph.output], cpu_sess.run(None, batch)))
    row["grad_error"] = max(relative_l2(got[n], want[n]) for n in names if n.endswith("_grad"))
    del cuda_sess, cpu_sess
    gc.collect()

    # placement, from the profiler of a CUDA step-graph session
    with tempfile.TemporaryDirectory() as tmp:
        profiled = StepGraphTrainer(step, provider=device, profile_prefix=os.path.join(tmp, "p"))
        for _ in range(2):
            profiled.step(batch)
        events = json.loads(Path(profiled.executor.session.end_profiling()).read_text())
        del profiled
        gc.collect()
    heavy, light = cpu_nodes(placement(events))
    row["cpu_nodes"], row["cpu_shape_nodes"] = heavy, light

    # step time and memory
    before = process_device_mib()
    ours = StepGraphTrainer(step, provider=device)
    first = {"ours": ours.step(batch)}
    for _ in range(3):
        ours.step(batch)
    after = process_device_mib()
    row["ours_mib"] = None if before is None or after is None else after - before
    sides = {"ours": lambda n, cpu: bench_train.timed(lambda: ours.step(batch), n, cpu)}
    theirs = None
    if use_torch:
        import torch
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        theirs = bench_train.TorchSide(name, model, batch, lr, device=device,
                                       amp=None if precision == "fp32" else precision)
        first["torch"] = theirs.step()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            theirs.step()
        sides["torch"] = lambda n, cpu: bench_train.timed(theirs.step, n, cpu)
    times, blocks, _ = bench_train.measure(sides, steps, rounds)
    row["ours_ms"] = bench_train.ms(times["ours"])
    row["first_loss"] = first
    if theirs is not None:
        import torch
        row["torch_ms"] = bench_train.ms(times["torch"])
        row["ratio"] = float(np.median(np.array(blocks["ours"]) / np.array(blocks["torch"])))
        row["torch_mib"] = torch.cuda.max_memory_reserved() / 2**20 if device == "cuda" else None
    del ours, theirs
    gc.collect()

    # the command line, in a child process
    with tempfile.TemporaryDirectory() as tmp:
        path, data = os.path.join(tmp, "step.onnx"), os.path.join(tmp, "data.npz")
        import onnx
        onnx.save(step, path)
        np.savez(data, **batch)
        n = len(next(iter(batch.values())))
        done = subprocess.run([sys.executable, "-c", "import sys; from onnxgrad.cli import main; sys.exit(main())",
                               "train", path, "--data", data, "--steps", "20", "--batch", str(n), "--provider",
                               device, "--quiet"], capture_output=True, text=True, timeout=300)
        row["cli"] = "ok" if done.returncode == 0 else f"exit {done.returncode}: " + \
            (done.stderr.strip().splitlines() or ["?"])[-1][:80]
    return row


def check_budget(name: str, budget: str, allocator: str, runs: int = 3, device: str = "cuda") -> dict:
    """A budgeted training graph as onnxgrad's sessions run it: `mirror --budget B --allocator A` on the model's
    training graph, then `runs` runs in `runtime.session` (on CUDA: the arena with kNextPowerOfTwo and
    `gpu_mem_limit` = the budget). Whether the runs stay within the arena's limit, and the device memory the
    process holds after them (nvidia-smi, after minus before the session), against the budget and the emulated
    arena of the report. device="cpu": the same on the CPU provider (the dry run)."""
    import numpy as np

    import bench_train
    import onnxgrad
    from onnxgrad import runtime

    row: dict = {"model": name, "budget": budget, "allocator": allocator}
    model = bench_train.MODELS[name]()
    feeds = bench_train.batch_for(name, np.random.default_rng(0))
    dims = {d.dim_param: feeds[i.name].shape[k] for i in model.graph.input if i.name in feeds
            for k, d in enumerate(i.type.tensor_type.shape.dim) if d.dim_param}
    built = onnxgrad.build(model, dims=dims, mirror="budget",
                           mirror_options={"budget": budget, "allocator": allocator})
    plan = built.report["mirror"]
    row["budget_mib"] = plan["budget_bytes"] / 2 ** 20
    row["emulated_arena_mib"] = plan["predicted"]["arena_peak_bytes"]["kNextPowerOfTwo"] / 2 ** 20
    before = process_device_mib()
    sess = runtime.session(built.model, provider=device)
    try:
        for _ in range(runs):
            sess.run(None, feeds)
        row["runs"] = "ran"
    except Exception as e:  # the arena refused a request: the budget did not hold
        row["runs"] = f"failed: {str(e).splitlines()[0][-120:]}"
    after = process_device_mib()
    row["device_mib"] = after - before if after is not None and before is not None else None
    return row


def format_budget_table(rows: list[dict]) -> str:
    lines = ["| model | budget | allocator | budget MiB | emulated arena MiB | runs | device MiB held |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        held = r.get("device_mib")
        lines.append(f"| {r['model']} | {r['budget']} | {r['allocator']} | {r.get('budget_mib', 0):.1f} | "
                     f"{r.get('emulated_arena_mib', 0):.1f} | {r.get('runs', '-')} | "
                     f"{'-' if held is None else f'{held:.0f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", metavar="VENV", help="create VENV from the package index and run there")
    ap.add_argument("--libraries-only", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--precisions", default=",".join(PRECISIONS), help="step graphs to check, of fp32, fp16, bf16")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--budgets", default="0.9x,0.7x", help="budgets the budget check (step 4) runs the training "
                    "graphs of --budget-models at, with both --allocator settings; empty: none")
    ap.add_argument("--budget-models", default="gpt", help="models of the budget check (the mlp and cnn are "
                    "below their floors at 0.9x)")
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU provider (no GPU needed): checks the "
                    "script itself; the CUDA columns then describe the CPU")
    args = ap.parse_args(argv)
    if args.setup:
        python = setup_venv(Path(args.setup))
        rest = list(argv if argv is not None else sys.argv[1:])
        i = rest.index("--setup")
        del rest[i:i + 2]
        return subprocess.run([str(python), __file__, *rest]).returncode

    started = time.time()
    print(f"# GPU: {gpu_description()}")
    try:
        import onnxruntime as ort
    except ImportError:
        print("gpu_check: onnxruntime is not installed here; pip install onnxruntime-gpu (or use --setup VENV)")
        return 2
    from onnxruntime.capi import build_and_package_info as info
    major = cuda_major(getattr(info, "cuda_version", None))
    print(f"# onnxruntime {ort.__version__} ({getattr(info, 'package_name', '?')}, built for CUDA "
          f"{getattr(info, 'cuda_version', '?')}), providers {ort.get_available_providers()}")
    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception as e:  # it warns rather than fails on most problems; report and go on to the list
            print(f"# preload_dlls: {e}")
    missing = [] if args.cpu else missing_libraries(major)
    for lib in [DRIVER, *LIBRARIES[major]]:
        print(f"#   {lib}: {'MISSING' if lib in missing else 'found'}")
    if missing:
        if DRIVER in missing:
            print("gpu_check: libcuda.so.1 (the NVIDIA driver) is missing: no usable GPU driver on this machine")
        rest = [m for m in missing if m != DRIVER]
        if rest:
            print(f"gpu_check: missing {', '.join(rest)}; install with:\n  {install_command(ort.__version__, major, rest)}")
        return 2
    if args.libraries_only:
        return 0
    use_torch = False
    try:
        import torch
        use_torch = args.cpu or torch.cuda.is_available()
        print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, available: {use_torch}")
    except ImportError:
        print("# torch not installed: no torch column")
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(ROOT))
    precisions = args.precisions.split(",")
    unknown = sorted(set(precisions) - set(PRECISIONS))
    if unknown:
        print(f"gpu_check: --precisions {unknown[0]}: expected some of {', '.join(PRECISIONS)}")
        return 2
    rows = []
    for name in args.models.split(","):
        for precision in precisions:
            label = name if precision == "fp32" else f"{name} {precision}"
            try:
                rows.append(check_model(name, args.steps, args.rounds, args.lr, use_torch,
                                        "cpu" if args.cpu else "cuda", precision))
            except Exception as e:  # one model's failure is a row, not the end of the check
                rows.append({"model": label, "precision": precision,
                             "cli": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"})
            print(f"# {label} done at {time.time() - started:.0f} s", flush=True)
    print()
    print(format_table(rows))
    if any(r["precision"] != "fp32" for r in rows):
        print()
        print(format_precision_table(rows))
    for r in rows:
        if r.get("cpu_shape_nodes"):
            print(f"- {r['model']}: shape arithmetic on the CPU provider (by design): {r['cpu_shape_nodes']}")
        if r.get("first_loss"):
            print(f"- {r['model']}: first-step loss {r['first_loss']}")
    budget_rows = []
    for name in args.budget_models.split(",") if args.budgets else []:
        for budget in args.budgets.split(","):
            for allocator in ("exact", "arena"):
                try:
                    budget_rows.append(check_budget(name, budget, allocator, device="cpu" if args.cpu else "cuda"))
                except Exception as e:  # a plan the solver cannot make is a row too
                    budget_rows.append({"model": name, "budget": budget, "allocator": allocator,
                                        "runs": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"})
    if budget_rows:
        print()
        print(format_budget_table(budget_rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": rows, "budgets": budget_rows}, indent=1, default=str))
    print(f"# {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
