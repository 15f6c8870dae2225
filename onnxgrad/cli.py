"""The `onnxgrad` command line. Results go to stdout, messages to stderr; every failure is one line.

Exit codes: 0 success, 2 usage (bad flags, names that do not exist, paths refused, unreadable data), 3 invalid
model, 4 unsupported (an op or form with no gradient rule), 5 output cannot be written, 6 `check` found a gradient
off, 7 a data-parallel peer failed or timed out (`train` under torchrun), 8 `train` stopped on a NaN or infinite
loss, 70 internal error, 130 interrupted.

Every --report FILE.json has the keys `report_version`, `command` and `onnxgrad_version`, then the command's own
keys (README, "Reports"); it is written only when the command finishes its work (for `check`, also when a
gradient is off), together with the command's other outputs or not at all.

Every output path is checked before any work (`io.OutputPaths`): never a file an input reads (the model, the
external-data files it names, --data, --resume), never another output of the same command.

Start-up: this module imports only click and onnxgrad's own light modules; each command imports what it needs
(onnx, onnxruntime, numpy), so `onnxgrad --version` and `--help` answer at once.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import click

from . import __version__
from .errors import GradientCheckError, InternalError, OnnxgradError, UsageError
from .io import OutputError, OutputPaths, json_bytes, save_json, save_model, write_along

log = logging.getLogger("onnxgrad")

EXIT_CODES_HELP = ("Exit codes: 0 success, 2 usage error (a bad flag, a name not in the model, an output path "
                   "refused, unreadable data), 3 invalid model (unreadable, fails the checker or shape inference, "
                   "an opset that cannot be converted to 13 or is newer than the installed onnx defines), "
                   "4 unsupported op or form, 5 output not writable, 70 internal error, 130 interrupted.")
CHECK_EXIT_CODES_HELP = ("Exit codes: 0 every gradient within tolerance, 6 a gradient is off, 2 usage error "
                         "(e.g. not a training graph), 3 invalid model, 5 report not writable, 70 internal error.")
TRAIN_EXIT_CODES_HELP = EXIT_CODES_HELP.replace(
    "70 internal", "7 a collective failed (torchrun), 8 the loss or a parameter became NaN or infinite, 70 internal")
# run, train and check: how they allocate (runtime.session_options, hugepages.start_with_huge_pages)
MEMORY_HELP = ("Memory: a graph that mirror --budget fitted to the live bytes (its default --allocator) runs with "
               "onnxruntime's CPU arena off and each tensor mapped while it lives, so the process holds what the "
               "budget counted. On Linux with glibc 2.35 or later and transparent huge pages in madvise mode, the "
               "command starts again with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, so such maps are faulted in huge "
               "pages (faster, the same peak); GLIBC_TUNABLES=glibc.malloc.hugetlb=0 keeps them off.")
REPORT_VERSION = 1
# budgets above this are refused rather than printed as a size no machine has
LARGEST_BUDGET = 2**50
TIMED_SOLVERS = ("exact", "milp")   # the solvers --time-limit bounds


def _report(command: str, body: dict) -> dict:
    """A --report's contents: the keys every report has, then the command's own."""
    return {"report_version": REPORT_VERSION, "command": command, "onnxgrad_version": __version__, **body}


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _names(values: tuple[str, ...]) -> list[str]:
    """Flags that take names accept them repeated or comma-separated."""
    return [n for v in values for n in v.split(",") if n]


def _dims(values: tuple[str, ...]) -> dict[str, int]:
    """--dim SYMBOL=N, repeated or comma-separated (batch=8,seq=128). A symbol bound twice, even to the same
    size, and a size below 1 are errors."""
    dims: dict[str, int] = {}
    for spec in _names(values):
        name, sep, value = spec.partition("=")
        if not sep or not name or not value.isdigit():
            raise UsageError(f"--dim {spec!r}: expected SYMBOL=N, e.g. batch=8")
        if int(value) < 1:
            raise UsageError(f"--dim {spec}: a dimension has at least 1 element")
        if name in dims:
            raise UsageError(f"--dim {name}: bound twice ({name}={dims[name]} and {spec}); give each symbol once")
        dims[name] = int(value)
    return dims


def _loop_bounds(values: tuple[str, ...]) -> dict[str, int]:
    """--loop-bound NAME=N, repeated or comma-separated; a loop bound twice or a bound below 1 is an error."""
    bounds: dict[str, int] = {}
    for spec in _names(values):
        name, sep, value = spec.rpartition("=")
        if not sep or not name or not value.isdigit():
            raise UsageError(f"--loop-bound {spec!r}: expected NAME=N, e.g. decode=64")
        if int(value) < 1:
            raise UsageError(f"--loop-bound {spec}: a bound is at least 1 iteration")
        if name in bounds:
            raise UsageError(f"--loop-bound {name}: bound twice; give each loop once")
        bounds[name] = int(value)
    return bounds


def _shapes(values: tuple[str, ...]) -> dict[str, list[int]]:
    """--input-shape NAME=D1xD2..; an input given twice is an error."""
    from .loader import parse_shape_bindings

    seen: set[str] = set()
    for spec in values:
        name = spec.rpartition("=")[0]
        if name and name in seen:
            raise UsageError(f"--input-shape {name}: given twice; give each input once")
        seen.add(name)
    return parse_shape_bindings(list(values))


class _Kinds(click.Choice):
    """A click.Choice over names kept in a module that imports onnx (losses.LOSSES, optim.OPTIMIZERS), read
    when a command parses or shows its flags: `onnxgrad --version` and `--help` then never import onnx."""

    def __init__(self, module: str, names: str):
        self._where, self._choices = (module, names), None
        self.case_sensitive = True

    @property
    def choices(self) -> tuple[str, ...]:
        if self._choices is None:
            import importlib
            module, names = self._where
            self._choices = tuple(getattr(importlib.import_module(module, __package__), names))
        return self._choices


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="onnxgrad")
@click.option("-q", "--quiet", is_flag=True, help="Log errors only (results still go to stdout).")
@click.option("-v", "--verbose", is_flag=True, help="Print progress and, on an internal error, the traceback.")
@click.pass_context
def cli(ctx, quiet, verbose):
    """Build training graphs for stock onnxruntime from ONNX forward graphs.

    \b
      onnxgrad build-grad model.onnx -o train.onnx     forward graph -> forward + backward graph
      onnxgrad run train.onnx --steps 3                run training steps in onnxruntime
      onnxgrad check train.onnx                         verify its gradients by finite differences
      onnxgrad train step.onnx --data d.npz --epochs 5 train with a step graph (build-grad --optimizer)
      onnxgrad ops                                      list the ops that have gradient rules
    """
    level = logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="onnxgrad: %(message)s", stream=sys.stderr, force=True)
    ctx.obj = {"verbose": verbose}


def _floats(spec: str | None, flag: str, count: int | None = None) -> list[float] | None:
    """'0.9,0.999' -> [0.9, 0.999]."""
    if spec is None:
        return None
    try:
        values = [float(v) for v in spec.split(",")]
    except ValueError:
        values = None
    if values is None or (count is not None and len(values) != count):
        raise UsageError(f"{flag} {spec!r}: expected {count or 'one or more'} comma-separated numbers")
    return values


def _training_flags(command):
    """The options of --loss-fn and --optimizer (README, "Losses and optimizers")."""
    flags = [
        click.option("--loss-fn", type=_Kinds(".losses", "LOSSES"),
                     help="Append this loss to the model and differentiate it: mse, l1, bce-with-logits compare "
                          "--target with a float input of its shape; cross-entropy reads int64 class indices "
                          "(the output's shape without axis 1). As torch.nn.functional's losses."),
        click.option("--target", metavar="NAME", help="With --loss-fn: the output (predictions or logits) to "
                                                      "compare. Default: the only output."),
        click.option("--target-input", metavar="NAME", help="With --loss-fn: name of the added target input "
                                                            "[default: target]."),
        click.option("--loss-output", metavar="NAME", help="With --loss-fn: name of the added scalar loss "
                                                           "output [default: loss]."),
        click.option("--reduction", type=click.Choice(["mean", "sum"]),
                     help="With --loss-fn: mean or sum over the elements [default: mean]."),
        click.option("--class-weights", metavar="W0,W1,..", help="With --loss-fn cross-entropy: a weight per "
                                                                  "class; mean divides by the weights used."),
        click.option("--ignore-index", metavar="K", type=int,
                     help="With --loss-fn cross-entropy: targets equal to K add nothing [default: none]."),
        click.option("--optimizer", type=_Kinds(".optim", "OPTIMIZERS"),
                     help="Append this optimizer (as torch.optim; momentum = SGD with momentum 0.9) and write a "
                          "step graph: one run is one training step, with <p>.next and <state>.next outputs "
                          "to feed back (metadata onnxgrad.state). <param>_grad outputs are dropped."),
        click.option("--lr", type=float, help="With --optimizer: the learning rate stored as the lr input's "
                                              "value [default: 0.001]."),
        click.option("--momentum", type=float, help="With --optimizer sgd or momentum [default: 0, 0.9]."),
        click.option("--nesterov", is_flag=True, default=None, help="With --optimizer sgd or momentum: Nesterov "
                                                                    "momentum."),
        click.option("--betas", metavar="B1,B2", help="With --optimizer adam or adamw [default: 0.9,0.999]."),
        click.option("--eps", type=float, help="With --optimizer adam or adamw [default: 1e-8]."),
        click.option("--weight-decay", type=float, help="With --optimizer: L2 added to the gradient (sgd, "
                                                        "momentum, adam) or decoupled (adamw) [default: 0; adamw "
                                                        "0.01]."),
        click.option("--clip-grad-norm", metavar="MAX", type=float,
                     help="With --optimizer: scale all gradients together to an L2 norm of at most MAX first, as "
                          "torch.nn.utils.clip_grad_norm_."),
        click.option("--accumulate", metavar="K", type=click.IntRange(1),
                     help="With --optimizer: accumulate gradients over K runs (micro-batches) and update on "
                          "every K-th; counted by the state input micro_step."),
        click.option("--keep-grads", is_flag=True, default=None,
                     help="With --optimizer: keep the <param>_grad outputs, after the state outputs."),
    ]
    for flag in reversed(flags):
        command = flag(command)
    return command


def _training_options(o: dict) -> dict:
    """The Options fields of the --loss-fn and --optimizer flags; flags not given are left out."""
    loss_options = {"target_input": o["target_input"], "loss_output": o["loss_output"],
                    "reduction": o["reduction"], "class_weights": _floats(o["class_weights"], "--class-weights"),
                    "ignore_index": o["ignore_index"]}
    optimizer_options = {"lr": o["lr"], "momentum": o["momentum"], "nesterov": o["nesterov"],
                         "betas": _floats(o["betas"], "--betas", 2), "eps": o["eps"],
                         "weight_decay": o["weight_decay"], "clip_grad_norm": o["clip_grad_norm"],
                         "accumulate": o["accumulate"], "keep_grads": o["keep_grads"]}
    return {"loss_fn": o["loss_fn"], "target": o["target"], "optimizer": o["optimizer"],
            "loss_options": {k: v for k, v in loss_options.items() if v is not None},
            "optimizer_options": {k: v for k, v in optimizer_options.items() if v is not None}}


def _model_flags(command):
    """The flags of build-grad that the mirror command shares."""
    flags = [
        click.argument("model", type=click.Path(dir_okay=True, path_type=str)),
        click.option("-o", "--output", "output", required=True, type=click.Path(path_type=str),
                     help="Where to write the training graph (never the input; an existing file is replaced)."),
        click.option("--loss", metavar="NAME", help="The output to differentiate. Default: the only scalar output."),
        click.option("--requires-grad", metavar="NAME", multiple=True,
                     help="Differentiate with respect to these initializers or graph inputs only. Default: every "
                          "floating-point initializer the loss depends on, except scalars (rank 0) beside tensor "
                          "parameters: the constants torch.onnx's dynamo exporter stores as initializers, such as "
                          "an exponent or a mask's fill value (the report lists them as scalar_constants). "
                          "Repeatable or comma-separated."),
        click.option("--frozen", metavar="NAME", multiple=True, help="Initializers that get no gradient."),
        click.option("--tie-copies", is_flag=True,
                     help="Train a parameter that holds the same values as an earlier one, or its transpose, as "
                          "that one: a weight the model ties that its exporter wrote twice (the TorchScript exporter "
                          "writes GPT-2's output layer as a transposed copy of the token table). Without it such "
                          "pairs are trained apart, with a warning; the report lists them as parameter_copies."),
        click.option("--also-grad", metavar="NAME", multiple=True,
                     help="Intermediate values whose gradients are also output, as <NAME>_grad."),
        click.option("--input-shape", metavar="NAME=D1xD2..", multiple=True,
                     help="Fix a graph input's shape, e.g. x=2x3x224x224."),
        click.option("--dim", metavar="SYMBOL=N", multiple=True,
                     help="Bind a symbolic dimension, e.g. batch=8 (repeatable or comma-separated; once per symbol)."),
        click.option("--loop-bound", metavar="NAME=N", multiple=True,
                     help="The most iterations Loop node NAME runs, for a loop with a condition and no trip count "
                          "(its gradient stores one carry per iteration); the loop stops at N."),
        click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True,
                     help="Compute precision. fp16, bf16: MatMul, Gemm, Conv, ConvTranspose, Attention run in half "
                          "precision, reductions, Softmax, normalisations, Exp/Log/Pow and losses in float32, other "
                          "ops in their inputs' precision (as PyTorch's autocast); parameters and optimizer state "
                          "stay float32."),
        click.option("--loss-scale", type=click.Choice(["dynamic", "none"]),
                     help="Scale the loss by the input loss_scale and unscale the gradients; with --optimizer, skip "
                          "a step whose gradients overflow and adapt the scale (as torch's GradScaler) [default: "
                          "dynamic with --precision fp16, else none]."),
        click.option("--loss-scale-init", metavar="S", type=float, help="With dynamic loss scaling: the first "
                                                                        "scale [default: 65536]."),
        click.option("--loss-scale-interval", metavar="N", type=click.IntRange(1),
                     help="With dynamic loss scaling: double the scale after N steps without overflow; an overflow "
                          "halves it [default: 2000]."),
    ]
    tail = [
        click.option("--save", metavar="NODE", multiple=True,
                     help="With mirroring: keep this forward node's outputs, never recompute it."),
        click.option("--recompute", metavar="NODE", multiple=True,
                     help="With mirroring: recompute this forward node even if the policy would keep it."),
        click.option("--external-data", is_flag=True,
                     help="Write the weights to OUTPUT.data beside the output. Default: when the input model has "
                          "external data, or when one file would pass protobuf's 2 GB limit. Never onto a file the "
                          "input model reads."),
        click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
                     help="Also write a JSON report: loss, parameters, outputs, node counts, rules used, the "
                          "seconds of each pass, and with mirroring the plan with a reason per node."),
        click.option("-f", "--force", is_flag=True, hidden=True,
                     help="Accepted for old scripts; outputs are always replaced."),
    ]
    for flag in reversed(tail):
        command = flag(command)
    command = _training_flags(command)
    for flag in reversed(flags):
        command = flag(command)
    return command


@cli.command("build-grad", epilog=EXIT_CODES_HELP)
@_model_flags
@click.option("--mirror", is_flag=True,
              help="Recompute cheap activations in the backward pass instead of keeping them (MXNet's backward "
                   "mirroring; the same as `onnxgrad mirror`).")
def build_grad(mirror, **flags):
    """Write the training graph of MODEL: its outputs, then <param>_grad for each parameter (initializer
    order), then <value>_grad for each --also-grad value. Parameters stay initializers and are also graph
    inputs, so a caller can feed new values. A non-scalar --loss gets a <loss>_grad input to feed.

    --loss-fn first appends a loss (a `target` input, a `loss` output); --optimizer then writes a step graph
    that also updates the parameters, so one run is one training step (see `onnxgrad train`)."""
    _build_and_write("build-grad", _build_options(flags, "mxnet" if mirror else None), **_outputs(flags))


@cli.command("mirror", epilog=EXIT_CODES_HELP)
@_model_flags
@click.option("--policy", type=click.Choice(["mxnet", "budget"]), default=None,
              help="How to choose what to recompute. mxnet (the default without --budget): every op but the "
                   "compute-heavy ones (Conv, MatMul, Gemm, Einsum, attention, recurrent cells) and losses, less "
                   "the groups whose storage releases at least what it keeps. budget (the default with --budget): "
                   "the least recomputation whose simulated peak fits --budget. Random ops are never recomputed.")
@click.option("--budget", metavar="BYTES|0.4x|auto",
              help="The peak memory of one run to fit: bytes (16GiB, 1500MB, 2e9), a fraction of the unmirrored "
                   "peak (0.4x), or auto (the least peak at most one extra forward pass of recomputation "
                   "buys). The peak counts weights, inputs, gradients, saved activations and temporaries. A "
                   "budget below the least peak any schedule reaches is an error that prints that floor. Loops "
                   "with a fixed trip count run as they are if that fits, else as sqrt(T) segments, else as nested "
                   "levels of segments (one more forward pass of the loop per level); auto keeps sqrt(T).")
@click.option("--solver", "solver_name", type=_Kinds(".memory.solvers", "SOLVERS"),
              help="With --budget: fast (the default: a front of block-DP plans, segment schemes and a local "
                   "search, with the recomputations an earlier copy can serve taken out; seconds on 10k-node "
                   "graphs), dp (the block DP alone), exact (CP-SAT from the fast "
                   "plan: the optimum, or its gap, within --time-limit) or milp (Checkmate's mixed-integer "
                   "program through HiGHS, for small graphs; within --time-limit). Every solver's plan comes "
                   "with its gap to a lower bound on any plan's extra compute (in the report and on stderr); a "
                   "gap of 0 proves it optimal.")
@click.option("--time-limit", type=click.FloatRange(min=1),
              help="With --solver exact or milp: seconds the solver may take (the best schedule found then is "
                   "used, with its gap in the report) [default: 60].")
@click.option("--max-extra-passes", "max_extra_passes", type=click.FloatRange(min=0),
              help="With --budget: choose no plan that recomputes more than this many forward passes' worth "
                   "(in the cost's units). Near the floor a plan can reach a few MiB lower by recomputing the "
                   "forward pass from the inputs many times over; onnxruntime ran such graphs well above their "
                   "simulated peak (1.6-1.7x at 14 and 71 passes, BENCHMARKS.md) and 5-23x as long per step. A "
                   "budget only such plans meet is refused, with the least peak within the limit [default: 4].")
@click.option("--allocator", type=click.Choice(["exact", "arena"]),
              help="With --budget: what the budget must hold for. exact: the live bytes, as onnxgrad's CPU sessions "
                   "run a budgeted graph (onnxruntime's arena off, each tensor mapped while it lives); arena: also "
                   "onnxruntime's BFC arena, which CUDA always uses (and the CPU provider by default, 2-2.5x "
                   "faster than exact there): it keeps free chunks it cannot reuse for the next request, so a plan "
                   "of live bytes under the budget can need 1.1-1.3x the budget in the arena. The plan then fits "
                   "the arena as emulated (memory.arena), at more recomputation, and onnxgrad's CPU sessions run it "
                   "in an arena that splits every chunk to the request; the report gives CUDA's need too "
                   "[default: exact].")
@click.option("--cost", "cost", type=click.Choice(["model", "prices", "profile"]),
              help="With --budget or --sweep: the price of a recomputation. model: FLOPs of the heavy ops from the "
                   "shapes plus 20 x the bytes each op moves; prices: microseconds per FLOP and per byte for each "
                   "kernel class, fitted to onnxruntime's CPU profile of real training graphs; profile: each node's "
                   "time in onnxruntime on this machine (runs the graph a few times first, on seeded random data) "
                   "[default: model].")
@click.option("--sweep", metavar="OUT.png", type=click.Path(path_type=str),
              help="Also chart peak memory against extra compute over the budgets the fast solver reaches, with "
                   "MXNet's plan, checkpoints every sqrt(n) layers, store-all, the chosen plan, the budget and the "
                   "floor marked; the table goes to stdout before the paths written (needs matplotlib for the "
                   "chart).")
def mirror_cmd(policy, budget, solver_name, time_limit, max_extra_passes, allocator, cost, sweep, **flags):
    """Write MODEL's training graph with backward mirroring: forward values are recomputed in the backward
    pass, just before their use, instead of being kept from the forward pass. MODEL is a forward model (its
    gradient is built first, with any build-grad flag) or a training or step graph that build-grad wrote
    without mirroring. The report (--report, and one line on stderr) gives the simulated peak memory before and
    after; the written graph's metadata keeps the plan and the onnxruntime settings the saving needs (every
    onnxgrad runner applies them). Sizes need every dimension known: bind symbols with --dim."""
    if budget is not None:
        _check_budget(budget)
    policy = policy or ("budget" if budget is not None else "mxnet")
    if policy == "mxnet" and budget is not None:
        raise UsageError("--budget: goes with --policy budget, not mxnet")
    if solver_name is not None and policy != "budget":
        raise UsageError("--solver: chooses how a --budget is met; give --budget (or --policy budget)")
    if time_limit is not None and solver_name not in TIMED_SOLVERS:
        raise UsageError(f"--time-limit: bounds --solver {' or '.join(TIMED_SOLVERS)} only")
    if max_extra_passes is not None and policy != "budget":
        raise UsageError("--max-extra-passes: bounds the plan a --budget chooses; give --budget (or --policy budget)")
    if cost is not None and policy != "budget" and not sweep:
        raise UsageError("--cost: prices recomputation for --budget or --sweep; give one of them")
    options = {"budget": budget, "solver": solver_name or "fast", "time_limit": time_limit or 60.0,
               "cost": cost or "model", "sweep": sweep}
    if max_extra_passes is not None:
        options["max_extra_passes"] = max_extra_passes
    if allocator is not None:
        if policy != "budget":
            raise UsageError("--allocator: says what a --budget holds for; give --budget (or --policy budget)")
        options["allocator"] = allocator
    _build_and_write("mirror", _build_options(flags, policy, options), **_outputs(flags))


def _check_budget(text: str) -> None:
    """--budget is parsed at the edge: an empty one (an unset $BUDGET) is not taken for auto, and a size past any
    machine's memory is refused rather than printed."""
    from .memory.budget import parse_budget

    if not text.strip():
        raise UsageError(f"--budget {text!r}: empty (an unset variable?); give bytes (16GiB, 1500MB, 2e9), a "
                         f"fraction of the unmirrored peak (0.4x) or auto")
    budget = parse_budget(text)
    if budget.bytes is not None and budget.bytes > LARGEST_BUDGET:
        raise UsageError(f"--budget {text}: more than 1 PiB, past any machine's memory; give the peak one run must "
                         f"fit, a fraction (0.4x) or auto")


def _build_options(flags: dict, mirror: str | None, mirror_extra: dict | None = None):
    """The build's Options from the flags of build-grad and mirror (what `_outputs` does not take)."""
    from .options import Options

    f = {k: v for k, v in flags.items() if k not in OUTPUT_FLAGS}
    save, recompute = _names(f.pop("save")), _names(f.pop("recompute"))
    if (save or recompute) and mirror is None:
        raise UsageError(f"{'--save' if save else '--recompute'}: needs --mirror (or the mirror command)")
    return Options(loss=f.pop("loss"), requires_grad=_names(f.pop("requires_grad")) or None,
                   frozen=_names(f.pop("frozen")), tie_copies=f.pop("tie_copies"),
                   also_grad=_names(f.pop("also_grad")),
                   input_shapes=_shapes(f.pop("input_shape")), dims=_dims(f.pop("dim")),
                   loop_bounds=_loop_bounds(f.pop("loop_bound")), mirror=mirror,
                   mirror_options={"save": save, "recompute": recompute, **(mirror_extra or {})},
                   precision=f.pop("precision"), loss_scale=f.pop("loss_scale"),
                   loss_scale_options={"init_scale": f.pop("loss_scale_init"),
                                       "growth_interval": f.pop("loss_scale_interval")},
                   **_training_options(f))


OUTPUT_FLAGS = ("model", "output", "external_data", "report", "force")


def _outputs(flags: dict) -> dict:
    """The flags of build-grad and mirror that say what to read and where to write."""
    return {k: flags[k] for k in OUTPUT_FLAGS if k != "force"}


def _build_and_write(command, options, model, output, external_data, report):
    """Build `model` with `options`, then write the training graph to `output` (and the report, and the
    --sweep chart the options ask for), and log a summary."""
    from .api import build

    paths = OutputPaths([model])
    out = paths.claim(output, "-o", "the output model")
    paths.claim_data(out)  # written when the input has external data, with --external-data, or past 2 GB
    report_path = paths.claim(report, "--report", "the report") if report else None
    sweep = options.mirror_options.get("sweep")
    sweep_path = paths.claim(sweep, "--sweep", "the --sweep chart") if sweep else None
    from .memory.budget import BudgetError
    try:
        result = build(model, options, weights_apart=True)
    except BudgetError as e:
        if report_path:  # a CI step reads why: fits false, the floor, the least peak found
            save_json(_report(command, {"input": str(model), "output": None, "error": _one_line(e),
                                        "mirror": {"policy": "budget", **e.report.record(),
                                                   "solve_seconds": e.report.solve_seconds}}), report_path)
        raise

    def write_model():
        _save_training_graph(result, out, external_data)
    if report_path:  # the report and the model, or neither
        write_along(report_path, json_bytes(_report(command, {"input": str(model), "output": str(out),
                                                                  **result.report})),
                    write_model)
    else:
        write_model()
    nodes = result.written.nodes
    counts = [f"{n} {phase}" for phase, n in (("forward", nodes.forward), ("recompute", nodes.recompute),
                                              ("backward", nodes.backward), ("optimizer", nodes.optimizer))
              if n or phase in ("forward", "backward")]
    log.info("%s: loss %s, %d parameters, %s nodes, %.2f s", out, result.loss.loss, len(result.gradient.parameters),
             " + ".join(counts), result.seconds)
    for first, second, how in result.gradient.parameter_copies:
        same = " (one transposed)" if how == "transposed" else ""
        if second in result.gradient.parameters:
            log.warning("warning: parameters %r and %r hold the same values%s: one weight written twice by the "
                        "exporter? They are trained apart and differ after the first update (--tie-copies trains "
                        "them as one)", first, second, same)
        else:
            log.info("%s: %r holds the same values as %r%s: trained as that one (--tie-copies)", out, second,
                     first, same)
    if log.isEnabledFor(logging.DEBUG):
        from .cuda import cuda_fallbacks
        for line in cuda_fallbacks(result.model):
            log.debug("not on the CUDA provider: %s", line)
    m = result.mirror
    if m is not None:
        log.info("%s: %d forward nodes recomputed; simulated peak %s -> %s (saved for the backward %s -> %s)", out,
                 len(m.recomputed), _mib(m.unmirrored_peak_bytes), _mib(m.peak_bytes),
                 _mib(m.unmirrored_saved_bytes), _mib(m.saved_bytes))
        schemes = result.gradient.loop_schemes
        if schemes:  # rewritten before the gradient, so the peaks above already include it
            log.info("%s: loops: %s", out, "; ".join(
                f"{name} {s.describe()} (about {s.carries} carries alive, {s.extra_passes} extra forward "
                f"pass{'' if s.extra_passes == 1 else 'es'} of the loop)" for name, s in schemes.items()))
        b = m.budget
        if b is not None:
            log.info("%s: budget %s (%s), floor %s; %.2f extra forward passes of recomputation (%s solver%s)",
                     out, b.budget, _mib(b.budget_bytes) if b.budget_bytes else "auto",
                     _mib(b.floor_bytes), b.extra_forward_passes, b.solver,
                     "" if b.gap is None else f", gap {b.gap:.2%} to the lower bound on any plan's extra compute")
            if b.allocator == "arena":
                log.info("%s: in onnxgrad's CPU arena a process holds about %s for it, static bytes included",
                         out, _mib(m.plan.predicted["cpu_resident_bytes"]))
    if m is not None and m.sweep is not None:
        from .memory.sweep import chart
        chart(m.sweep.rows, sweep_path, f"{os.path.basename(model)}: peak memory against recomputation",
              m.sweep.budget_bytes)
        click.echo(m.sweep.table + "\n")
        click.echo(str(sweep_path))
    click.echo(str(out))


def _mib(n: int) -> str:
    from .memory.simulate import format_bytes
    return format_bytes(n)


def _save_training_graph(result, out: Path, external_data: bool) -> None:
    """Write build-grad's result, streaming its weights (never a second copy of them in memory); the weights
    go to <out>.data when asked, when the input had external data, or when one file would pass 2 GB."""
    from .io import needs_external_data

    external = external_data or bool(result.external_data) or needs_external_data(result.model, result.weights)
    save_model(result.model, out, weights=result.weights, external_data=external)


@cli.command("memory", epilog=EXIT_CODES_HELP)
@click.argument("graphs", nargs=-1, required=True, type=click.Path(path_type=str))
@click.option("--dim", metavar="SYMBOL=N", multiple=True,
              help="Bind a symbolic dimension, e.g. N=8 (repeatable or comma-separated; once per symbol).")
@click.option("--top", default=8, show_default=True, type=click.IntRange(0), help="Saved values to list.")
@click.option("--plot", metavar="OUT.png", type=click.Path(path_type=str),
              help="Draw the live memory of every graph along its schedule on one chart (needs matplotlib: "
                   "pip install 'onnxgrad[plot]').")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the figures as JSON.")
def memory_cmd(graphs, dim, top, plot, report):
    """Simulate the memory of one run of each graph (a training or step graph, or any model) in the order its
    nodes are listed, as onnxruntime runs it with the settings build-grad records: the peak, where it happens,
    what is alive then (parameters, inputs, gradients, activations the backward reads, temporaries) and the
    largest forward values kept for the backward pass. Graph inputs and weights count for the whole run; a
    value is freed after its last reader."""
    from .api import load_graph
    from .memory.simulate import plot as draw, simulate

    dims = _dims(dim)
    paths = OutputPaths(list(graphs))
    plot_path = paths.claim(plot, "--plot", "the --plot chart") if plot else None
    report_path = paths.claim(report, "--report", "the report") if report else None
    timelines, body = {}, {}
    for path in graphs:
        graph = load_graph(path, dims)
        t = simulate(graph, dims)
        timelines[os.path.basename(path)] = t
        node = graph.nodes[t.peak_index] if graph.nodes else None
        body[path] = {**t.summary(), "peak_phase": node.phase if node else None, "top_saved": t.saved[:top]}
        where = "" if node is None else f"at node {t.peak_index} " + (
            f"{node.name!r} ({node.op_type}, {node.phase})" if node.name else f"(an unnamed {node.op_type}, "
                                                                             f"{node.phase})")
        click.echo(f"{path}: peak {_mib(t.peak)} {where}; static {_mib(t.static)} (inputs and weights), one run "
                   f"adds {_mib(t.dynamic_peak)}")
        click.echo("  at the peak: " + ", ".join(f"{AT_PEAK.get(k, k)} {_mib(v)}" for k, v in t.at_peak.items()))
        saved = sum(b for _, b in t.saved)
        click.echo(f"  saved for the backward: {len(t.saved)} values, {_mib(saved)} (forward values kept for it; "
                   f"recomputed values are not counted)"
                   + ("; largest: " + ", ".join(f"{n} {_mib(b)}" for n, b in t.saved[:top]) if top and t.saved
                      else ""))
    if plot_path:
        draw(timelines, plot_path)
        click.echo(str(plot_path))
    if report_path:
        save_json(_report("memory", {"graphs": body, "dims": dims}), report_path)


# what `memory` prints for a category of simulate.CATEGORIES: the activations alive at the peak include the
# recomputed ones, which the "saved for the backward" line (the forward values kept for it) does not count
AT_PEAK = {"saved activations": "activations the backward reads (kept or recomputed)"}


@cli.command("run", epilog=MEMORY_HELP + "\n\n" + EXIT_CODES_HELP)
@click.argument("train_model", type=click.Path(path_type=str))
@click.option("--steps", default=1, show_default=True, type=click.IntRange(1), help="Training steps to run.")
@click.option("--lr", default=0.1, show_default=True, type=float, help="Learning rate of the plain SGD update.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False, path_type=str),
              help="An .npz file with one array per graph input; inputs it lacks get seeded random data.")
@click.option("--dim", metavar="SYMBOL=N", multiple=True,
              help="Size of a symbolic dimension for the random data (default 4; once per symbol).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random data.")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime execution provider.")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the per-step losses and gradient norms as JSON.")
def run_cmd(train_model, steps, lr, data, dim, seed, provider, report):
    """Run training steps of a graph written by build-grad in onnxruntime: each step runs forward and
    backward, prints the loss and the gradient norms, and applies param -= lr * grad."""
    from .loader import read_model
    from .runner import run_training_graph

    dims = _dims(dim)
    report_path = OutputPaths({train_model: "the input model", data: "the --data file"}).claim(
        report, "--report", "the report") if report else None
    model = read_model(train_model)
    history = run_training_graph(model, steps=steps, lr=lr, data=data, dims=dims, seed=seed, provider=provider)
    for k, step in enumerate(history):
        click.echo(f"step {k + 1}: loss {step['loss']:.6g}")
    click.echo(f"{'gradient':40s} {'L2 norm':>12s}")
    for name, norm in history[0]["grad_norms"].items():
        click.echo(f"{name:40s} {norm:12.6g}")
    if report_path:
        save_json(_report("run", {"input": train_model, "steps": history}), report_path)


@cli.command("train", epilog=MEMORY_HELP + "\n\n" + TRAIN_EXIT_CODES_HELP)
@click.argument("step_model", type=click.Path(path_type=str))
@click.option("--data", required=True, type=click.Path(path_type=str),
              help="An .npz file with one array per data input of the step graph, all with the same first dim.")
@click.option("--steps", type=click.IntRange(1), help="Stop after this many steps, counted from the start of "
              "training (a resumed run counts the checkpoint's steps).")
@click.option("--epochs", type=click.IntRange(1), help="Stop after this many epochs (whichever of --steps and "
              "--epochs comes first). Default without either: one epoch.")
@click.option("--batch", type=click.IntRange(1), help="Rows per step. Default: the graph's fixed batch dim, "
              "else 32 (at most all rows). The last partial batch of each epoch is dropped.")
@click.option("--keep-last-batch", is_flag=True, help="Run the last partial batch of each epoch too.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the per-epoch shuffle.")
@click.option("--no-shuffle", is_flag=True, help="Visit the rows in order every epoch.")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime execution provider; auto: CUDA where onnxruntime can use it.")
@click.option("--threads", type=click.IntRange(1), help="onnxruntime intra-op threads (default: its own).")
@click.option("--lr", type=float, help="Feed this learning rate to the graph's lr input (default: its stored value).")
@click.option("--checkpoint", metavar="PATH.npz", type=click.Path(path_type=str),
              help="Save parameters, optimizer state and the data position here at the end (and every "
                   "--checkpoint-every steps).")
@click.option("--checkpoint-every", metavar="N", type=click.IntRange(1), help="Also checkpoint every N steps.")
@click.option("--resume", metavar="PATH.npz", type=click.Path(path_type=str),
              help="Restore a checkpoint and continue as if never interrupted (the same --data, checked by a "
                   "fingerprint, --batch and --seed).")
@click.option("--export", metavar="MODEL.onnx", type=click.Path(path_type=str),
              help="At the end, write the forward model with the trained weights.")
@click.option("--forward", metavar="MODEL.onnx", type=click.Path(path_type=str),
              help="For --export: the forward model the step graph was built from; its initializers get the "
                   "trained values. Default: the step graph cut back to its forward outputs.")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the per-step losses, step times and throughput as JSON.")
@click.option("--log-every", metavar="N", type=click.IntRange(1),
              help="When stderr is not a terminal, print a progress line every N steps (default: 10 lines).")
@click.option("--quiet", "quiet_train", is_flag=True, help="No progress output.")
@click.option("--allow-nonfinite", is_flag=True,
              help="Train on when the loss or a parameter becomes NaN or infinite. Default: stop with exit code 8 "
                   "and no checkpoint written after it, so the last one written is the last good one.")
@click.option("--zero1", is_flag=True, help="Under torchrun: keep each parameter's optimizer state on one process "
              "only (ZeRO-1); owners broadcast their updated parameters.")
@click.option("--bucket-mb", metavar="MB", type=click.FloatRange(0, min_open=True),
              help="Under torchrun: gradients are all-reduced in buckets of about MB megabytes, in backward "
                   "order [default: 25].")
@click.option("--timeout", "timeout_s", metavar="SECONDS", type=click.FloatRange(0, min_open=True),
              help="Under torchrun: a collective that takes longer (a process died or hangs) ends the run "
                   "[default: 600].")
@click.option("-f", "--force", is_flag=True, hidden=True, help="Accepted for old scripts; outputs are always replaced.")
def train_cmd(step_model, data, resume, checkpoint, export, forward, report, **flags):
    """Train with a step graph (written by build-grad --optimizer) in onnxruntime: parameters and optimizer
    state stay on the device between steps; progress (loss, samples/s) goes to stderr, a summary to stdout.

    Under torchrun, data-parallel: each process runs its share of every batch (--batch is the global batch)
    and the gradients are averaged across processes; rank 0 prints, checkpoints, exports and reports.

    Everything that can be checked is checked before the first step: the paths, the data (labels in range),
    the checkpoint to resume and the data it was made with, and the --forward model for --export."""
    from .loader import read_model

    options = _TrainOptions.from_flags(flags, checkpoint=checkpoint, export=export, forward=forward)
    paths = OutputPaths({step_model: "the input model", data: "the --data file", forward: "the --forward model",
                         resume: "the --resume checkpoint"})
    export_path = paths.claim(export, "--export", "the exported model") if export else None
    if export_path:
        paths.claim_data(export_path)
    report_path = paths.claim(report, "--report", "the report") if report else None
    checkpoint_path = paths.claim(checkpoint, "--checkpoint", "the checkpoint", reads=resume) if checkpoint else None
    forward_model = read_model(forward) if forward else None
    trainer = options.trainer(step_model)
    lead = trainer.executor.lead        # the process that prints and writes
    if resume:
        trainer.load_checkpoint(resume)
    batches = trainer.batches(data, options.batch, options.seed, shuffle=options.shuffle,
                              drop_last=options.drop_last)
    trainer.check_export(forward_model)
    quiet = options.quiet or not log.isEnabledFor(logging.INFO) or not lead
    result = trainer.fit(batches, steps=options.steps, epochs=options.epochs, checkpoint=checkpoint_path,
                         checkpoint_every=options.checkpoint_every, progress="off" if quiet else "auto",
                         log_every=options.log_every, allow_nonfinite=options.allow_nonfinite)
    trainer.close()
    if not lead:
        return
    where = f"{trainer.device}, {trainer.executor.world} processes" if options.parallel else trainer.device
    if result.losses:
        click.echo(f"steps {result.first_step}-{result.steps} (epoch {result.epochs:.2f}, {where}): "
                   f"loss {result.losses[0]:.6g} -> {result.losses[-1]:.6g}, "
                   f"{result.samples_per_second:,.0f} samples/s"
                   + (f", {result.skipped_steps} steps skipped on overflow (loss scale {result.loss_scale:g})"
                      if result.skipped_steps is not None else ""))
    else:
        click.echo(f"nothing to run: the checkpoint is at step {trainer.steps_done}")
    if export_path:
        save_model(trainer.export(forward=forward_model), export_path)
        click.echo(str(export_path))
    if report_path:
        communication = trainer.executor.report(result) if options.parallel else {}
        save_json(_report("train", {"input": step_model, "data": data, "device": trainer.device, "lr": trainer.lr,
                                    "seed": options.seed, "resumed_from": resume, "checkpoint": checkpoint,
                                    "export": export, **result.to_json(), **communication}), report_path)


@dataclass(frozen=True)
class _TrainOptions:
    """`onnxgrad train`'s flags other than its paths, checked once: for the trainer, its batches and `fit`."""

    parallel: bool                  # launched by torchrun: one process of a data-parallel job
    provider: str
    threads: int | None
    lr: float | None
    batch: int | None
    seed: int
    shuffle: bool
    drop_last: bool
    steps: int | None
    epochs: int | None
    checkpoint_every: int | None
    log_every: int | None
    quiet: bool
    allow_nonfinite: bool
    zero1: bool
    bucket_mb: float | None         # None: the data-parallel default
    timeout: float | None

    @classmethod
    def from_flags(cls, flags: dict, checkpoint: str | None, export: str | None,
                   forward: str | None) -> _TrainOptions:
        from . import distributed

        parallel = distributed.launched()
        if not parallel:
            given = [flag for flag, value in (("--zero1", flags["zero1"]), ("--bucket-mb", flags["bucket_mb"]),
                                              ("--timeout", flags["timeout_s"])) if value]
            if given:
                raise UsageError(f"{given[0]}: only under torchrun (data-parallel training); see the README, "
                                 f"\"Data-parallel training\"")
        if flags["checkpoint_every"] and not checkpoint:
            raise UsageError("--checkpoint-every needs --checkpoint PATH")
        if forward and not export:
            raise UsageError("--forward is only used with --export")
        return cls(parallel=parallel, provider=flags["provider"], threads=flags["threads"], lr=flags["lr"],
                   batch=flags["batch"], seed=flags["seed"], shuffle=not flags["no_shuffle"],
                   drop_last=not flags["keep_last_batch"], steps=flags["steps"], epochs=flags["epochs"],
                   checkpoint_every=flags["checkpoint_every"], log_every=flags["log_every"],
                   quiet=flags["quiet_train"], allow_nonfinite=flags["allow_nonfinite"], zero1=flags["zero1"],
                   bucket_mb=flags["bucket_mb"], timeout=flags["timeout_s"])

    def trainer(self, step_model: str):
        """The one-process trainer, or under torchrun this process's data-parallel one."""
        from . import distributed
        from .training.trainer import StepGraphTrainer

        if not self.parallel:
            return StepGraphTrainer(step_model, provider=self.provider, threads=self.threads, lr=self.lr)
        return distributed.DataParallelTrainer(
            step_model, provider=self.provider, threads=self.threads, lr=self.lr, zero1=self.zero1,
            bucket_mb=self.bucket_mb or distributed.DEFAULT_BUCKET_MB,
            timeout=self.timeout or distributed.DEFAULT_TIMEOUT_S)


@cli.command("split", epilog=EXIT_CODES_HELP)
@click.argument("step_model", type=click.Path(path_type=str))
@click.option("-o", "--output-dir", "output_dir", required=True, type=click.Path(path_type=str),
              help="The folder to write gradient.onnx and update.onnx to (created when missing; its parent must "
                   "exist).")
@click.option("-f", "--force", is_flag=True, hidden=True, help="Accepted for old scripts; outputs are always replaced.")
def split_cmd(step_model, output_dir, force):
    """Cut a step graph (build-grad --optimizer) in two at the gradients: gradient.onnx (data and parameters
    in; the loss, the forward outputs and <p>_grad out, in backward order) and update.onnx (<p>_grad,
    parameters, optimizer state and lr in; every .next output out, metadata onnxgrad.state). Running the
    first, then the second on its gradients, is one run of the step graph; a data-parallel runner averages
    the gradients in between (as `onnxgrad train` does under torchrun)."""
    from .loader import read_model
    from .split import split_step_graph

    folder = Path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output-dir {folder}: is a file; give a folder (it is created when missing)")
    created = not folder.exists()
    if created:
        if not folder.parent.resolve().is_dir():
            raise OutputError(f"--output-dir {folder}: folder {folder.parent} does not exist")
        try:
            folder.mkdir()
        except OSError as e:
            raise OutputError(f"--output-dir {folder}: cannot create it ({e.strerror or e})") from None
    try:
        paths = OutputPaths([step_model])
        targets = {name: paths.claim(folder / f"{name}.onnx", None, f"the {name} graph")
                   for name in ("gradient", "update")}
        for target in list(targets.values()):
            paths.claim_data(target)
        split = split_step_graph(read_model(step_model))
        for name, model in (("gradient", split.gradient), ("update", split.update)):
            save_model(model, targets[name])
            click.echo(str(targets[name]))
    except BaseException:
        if created and not any(folder.iterdir()):  # a failed run leaves no folder behind either
            folder.rmdir()
        raise
    log.info("%d parameters; optimizer nodes from the %s; %d + %d nodes", len(split.parameters),
             "onnxgrad.phases metadata" if split.phase_source == "metadata" else "graph's structure",
             len(split.gradient.graph.node), len(split.update.graph.node))


@cli.command("ops")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown (as in the README).")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the table as JSON: rules (op, opsets, inputs, limits) and ops with no gradient.")
@click.option("-f", "--force", is_flag=True, hidden=True, help="Accepted for old scripts; outputs are always replaced.")
def ops_cmd(markdown, report, force):
    """List every op with a gradient rule, its opset range and limits, and the ops that pass no gradient."""
    from . import registry
    from .ops_table import ops_table
    report_path = OutputPaths([]).claim(report, "--report", "the report") if report else None
    text = ops_table(markdown)
    if report_path:
        rules = [{"op": r.op_type, "since": r.since, "until": None if r.until >= registry.INF else r.until,
                  "inputs": None if r.wrt is None else list(r.wrt), "limits": r.limits}
                 for r in registry.all_rules()]
        none = [{"op": op, "why": why} for op, why in registry.all_non_differentiable().items()]
        save_json(_report("ops", {"rules": rules, "non_differentiable": none}), report_path)
    click.echo(text, nl=False)


@cli.command("check", epilog=MEMORY_HELP + "\n\n" + CHECK_EXIT_CODES_HELP)
@click.argument("train_model", type=click.Path(path_type=str))
@click.option("--samples", default=5, show_default=True, type=click.IntRange(0),
              help="Elements checked per parameter, chosen at random (0: every element).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the data, directions and samples.")
@click.option("--tol", default=1e-4, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest relative error allowed in float64.")
@click.option("--tol32", default=1e-1, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Largest relative error allowed where the check runs in float32.")
@click.option("--precision", type=click.Choice(["auto", "float64", "float32"]), default="auto", show_default=True,
              help="auto: float64 where onnxruntime can run the graph in float64, else the model's own types.")
@click.option("--loss", metavar="NAME", multiple=True,
              help="The loss output(s). Default: the onnxgrad.loss metadata that build-grad writes.")
@click.option("--dim", metavar="SYMBOL=N", multiple=True,
              help="Size of a symbolic dimension for the random data (default 2; once per symbol).")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the table as JSON (written when a gradient is off, too).")
@click.option("-f", "--force", is_flag=True, hidden=True, help="Accepted for old scripts; outputs are always replaced.")
def check_cmd(train_model, samples, seed, tol, tol32, precision, loss, dim, report, force):
    """Check the gradients of a training graph (written by build-grad) numerically: on seeded random data,
    compare each <param>_grad output with central finite differences of the loss, for a sample of elements
    of every parameter; in float64 where the graph allows. Prints a table; exits 6 when a gradient is off."""
    from .check import check_training_graph
    from .loader import read_model

    dims = _dims(dim)
    report_path = OutputPaths([train_model]).claim(report, "--report", "the report") if report else None
    model = read_model(train_model)
    result = check_training_graph(model, loss=_names(loss) or None, samples=samples, seed=seed, tol=tol,
                                  tol32=tol32, dims=dims, precision=precision)
    code = 0 if result.passed else GradientCheckError.exit_code
    if report_path:
        save_json(_report("check", {"input": train_model, "exit_code": code, **result.to_json()}), report_path)
    click.echo(result.table(), nl=False)
    if not result.passed:
        raise GradientCheckError(f"{len(result.failed)} of {len(result.params)} gradients off by more than "
                                 f"{result.tol:g}: {', '.join(result.failed)}")


@cli.command("materialize", epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(path_type=str))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=str),
              help="Where to write the model with weights (never the input; an existing file is replaced).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random weights.")
@click.option("--no-calibrate", is_flag=True,
              help="Skip the forward pass that rescales each Conv/Gemm/MatMul weight to unit output scale.")
@click.option("-f", "--force", is_flag=True, hidden=True, help="Accepted for old scripts; outputs are always replaced.")
def materialize_cmd(model, output, seed, no_calibrate, force):
    """Give a weightless model random trainable weights: each ConstantOfShape placeholder (as in the onnx
    model zoo's light graphs shipped inside the onnx wheel) and each float Constant of 2+ elements becomes
    an initializer, scaled for its role (He for Conv/Gemm/MatMul; BatchNormalization variance positive,
    scale near 1, mean near 0). The same seed gives the same file."""
    from .loader import read_model
    from .materialize import materialize

    paths = OutputPaths([model])
    out = paths.claim(output, "-o", "the output model")
    paths.claim_data(out)
    result, report = materialize(read_model(model), seed=seed, calibrate=not no_calibrate)
    save_model(result, out)
    log.info("%s: %d placeholders and %d constants -> initializers, %s parameters, %d layers calibrated", out,
             report.placeholders, report.constants, f"{report.parameters:,}", report.calibrated)
    click.echo(str(out))


# Commands that run graphs in onnxruntime: their process starts again with huge pages for glibc's maps, where that
# changes something (`hugepages.start_with_huge_pages`).
RUNS_GRAPHS = {"run", "train", "check"}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if argv is None and _command(sys.argv[1:]) in RUNS_GRAPHS:
        from . import hugepages
        hugepages.start_with_huge_pages()
    verbose = "-v" in (argv or sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="onnxgrad", standalone_mode=False)
        return 0
    except OnnxgradError as e:
        click.echo(f"onnxgrad: error: {_one_line(e)}", err=True)
        if getattr(e, "ends_process_at_once", False):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        return e.exit_code
    except click.exceptions.Abort as e:
        if isinstance(e.__cause__, EOFError):  # click turns an EOFError from anywhere into Abort: not a Ctrl-C
            return _internal_error(e.__cause__, verbose)
        click.echo("onnxgrad: interrupted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"onnxgrad: error: {_one_line(e.format_message())}", err=True)
        return UsageError.exit_code
    except KeyboardInterrupt:
        click.echo("onnxgrad: interrupted", err=True)
        return 130
    except Exception as e:  # a bug: still one line, unless --verbose
        return _internal_error(e, verbose)


def _command(args: list[str]) -> str | None:
    """The subcommand of a command line: its first word that is not one of the group's options."""
    return next((a for a in args if not a.startswith("-")), None)


def _internal_error(e: BaseException, verbose: bool) -> int:
    if verbose:
        traceback.print_exception(e)
    first = str(e).splitlines()[0] if str(e) else ""
    click.echo(f"onnxgrad: internal error: {type(e).__name__}: {first} (rerun with --verbose and report it)",
               err=True)
    return InternalError.exit_code


if __name__ == "__main__":
    sys.exit(main())
