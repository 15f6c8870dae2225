"""The `onnxgrad` command line. Results go to stdout, messages to stderr; every failure is one line.

Exit codes: 0 success, 2 usage (bad flags, names that do not exist, paths refused), 3 invalid model,
4 unsupported (an op or form with no gradient rule), 5 output cannot be written, 70 internal error.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback

import click

from . import __version__
from .errors import InternalError, OnnxgradError, UsageError
from .io import check_output_path, save_json, save_model

log = logging.getLogger("onnxgrad")

EXIT_CODES_HELP = ("Exit codes: 0 success, 2 usage error, 3 invalid model, 4 unsupported op or form, "
                   "5 output not writable, 70 internal error.")


def _names(values: tuple[str, ...]) -> list[str]:
    """Flags that take names accept them repeated or comma-separated."""
    return [n for v in values for n in v.split(",") if n]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
             epilog=EXIT_CODES_HELP)
@click.version_option(__version__, prog_name="onnxgrad")
@click.option("-q", "--quiet", is_flag=True, help="Print errors only.")
@click.option("-v", "--verbose", is_flag=True, help="Print progress and, on an internal error, the traceback.")
@click.pass_context
def cli(ctx, quiet, verbose):
    """Build training graphs for stock onnxruntime from ONNX forward graphs.

    \b
      onnxgrad build-grad model.onnx -o train.onnx     forward graph -> forward + backward graph
      onnxgrad run train.onnx --steps 3                run training steps in onnxruntime
      onnxgrad ops                                      list the ops that have gradient rules
    """
    level = logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="onnxgrad: %(message)s", stream=sys.stderr, force=True)
    ctx.obj = {"verbose": verbose}


@cli.command("build-grad", epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@click.option("-o", "--output", "output", required=True, type=click.Path(path_type=str),
              help="Where to write the training graph (never the input; an existing file needs --force).")
@click.option("--loss", metavar="NAME", help="The output to differentiate. Default: the only scalar output.")
@click.option("--requires-grad", metavar="NAME", multiple=True,
              help="Differentiate with respect to these initializers or graph inputs only. "
                   "Default: every floating-point initializer the loss depends on. Repeatable or comma-separated.")
@click.option("--frozen", metavar="NAME", multiple=True, help="Initializers that get no gradient.")
@click.option("--also-grad", metavar="NAME", multiple=True,
              help="Intermediate values whose gradients are also output, as <NAME>_grad.")
@click.option("--input-shape", metavar="NAME=D1xD2..", multiple=True,
              help="Fix a graph input's shape, e.g. x=2x3x224x224.")
@click.option("--dim", metavar="SYMBOL=N", multiple=True, help="Bind a symbolic dimension, e.g. batch=8.")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write a JSON report: loss, parameters, outputs, node counts, rules used, seconds.")
@click.option("-f", "--force", is_flag=True, help="Replace the output file if it exists.")
def build_grad(model, output, loss, requires_grad, frozen, also_grad, input_shape, dim, report, force):
    """Write the training graph of MODEL: its outputs, then <param>_grad for each parameter (initializer
    order), then <value>_grad for each --also-grad value. Parameters stay initializers and are also graph
    inputs, so a caller can feed new values. A non-scalar --loss gets a <loss>_grad input to feed."""
    from .api import build
    from .loader import parse_dim_bindings, parse_shape_bindings

    out = check_output_path(output, [model], force)
    report_path = check_output_path(report, [model, output], force) if report else None
    result = build(model, loss=loss, requires_grad=_names(requires_grad) or None, frozen=_names(frozen),
                   also_grad=_names(also_grad), input_shapes=parse_shape_bindings(list(input_shape)),
                   dims=parse_dim_bindings(list(dim)))
    save_model(result.model, out)
    r = result.report
    log.info("%s: loss %s, %d parameters, %d forward + %d backward nodes, %.2f s", out, r["loss"],
             len(r["parameters"]), r["forward_nodes"], r["backward_nodes"], r["seconds"])
    if report_path:
        save_json({"command": "build-grad", "input": str(model), "output": str(out), **r}, report_path)
    click.echo(str(out))


@cli.command("run", epilog=EXIT_CODES_HELP)
@click.argument("train_model", type=click.Path(path_type=str))
@click.option("--steps", default=1, show_default=True, type=click.IntRange(1), help="Training steps to run.")
@click.option("--lr", default=0.1, show_default=True, type=float, help="Learning rate of the plain SGD update.")
@click.option("--data", type=click.Path(exists=True, dir_okay=False, path_type=str),
              help="An .npz file with one array per graph input; inputs it lacks get seeded random data.")
@click.option("--dim", metavar="SYMBOL=N", multiple=True,
              help="Size of a symbolic dimension for the random data (default 4).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random data.")
@click.option("--provider", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="onnxruntime execution provider.")
@click.option("--report", metavar="FILE.json", type=click.Path(path_type=str),
              help="Also write the per-step losses and gradient norms as JSON.")
def run_cmd(train_model, steps, lr, data, dim, seed, provider, report):
    """Run training steps of a graph written by build-grad in onnxruntime: each step runs forward and
    backward, prints the loss and the gradient norms, and applies param -= lr * grad."""
    from .loader import parse_dim_bindings, read_model
    from .train import run_steps

    model = read_model(train_model)
    history = run_steps(model, steps=steps, lr=lr, data=data, dims=parse_dim_bindings(list(dim)), seed=seed,
                        provider=provider)
    for k, step in enumerate(history):
        click.echo(f"step {k + 1}: loss {step['loss']:.6g}")
    click.echo(f"{'gradient':40s} {'L2 norm':>12s}")
    for name, norm in history[0]["grad_norms"].items():
        click.echo(f"{name:40s} {norm:12.6g}")
    if report:
        save_json({"command": "run", "input": train_model, "steps": history}, check_output_path(report, [], True))


@cli.command("ops")
@click.option("--markdown", is_flag=True, help="Print the table as Markdown (as in the README).")
def ops_cmd(markdown):
    """List every op with a gradient rule, its opset range and limits, and the ops that pass no gradient."""
    from .ops_table import ops_table
    click.echo(ops_table(markdown), nl=False)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")
    verbose = "-v" in (argv or sys.argv[1:]) or "--verbose" in (argv or sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="onnxgrad", standalone_mode=False)
        return 0
    except OnnxgradError as e:
        click.echo(f"onnxgrad: error: {e}", err=True)
        return e.exit_code
    except click.exceptions.Abort:
        click.echo("onnxgrad: interrupted", err=True)
        return 130
    except click.ClickException as e:
        click.echo(f"onnxgrad: error: {e.format_message()}", err=True)
        return UsageError.exit_code
    except KeyboardInterrupt:
        click.echo("onnxgrad: interrupted", err=True)
        return 130
    except Exception as e:  # a bug: still one line, unless --verbose
        if verbose:
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"onnxgrad: internal error: {type(e).__name__}: {first} (rerun with --verbose and report it)",
                   err=True)
        return InternalError.exit_code


if __name__ == "__main__":
    sys.exit(main())
