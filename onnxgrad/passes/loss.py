"""Choose the heads the gradient is taken of: the loss the options append (mse, l1, cross-entropy,
bce-with-logits against a new target input), the output named by --loss, or the one scalar output."""
from __future__ import annotations

from ..errors import UsageError
from ..ir import Graph, Value
from ..losses import add_loss, find_output
from ..pipeline import Build, Pass
from .results import LossResult

LOSS_OPTIONS = {"target_input", "loss_output", "reduction", "class_weights", "ignore_index"}


class Heads(Pass):
    name = "heads"
    requires = frozenset({"graph", "typed"})
    ensures = frozenset({"heads"})

    def wanted(self, build: Build) -> bool:
        return not build.training_graph

    def run(self, build: Build) -> None:
        o, graph = build.options, build.graph
        loss = o.loss
        if o.loss_fn is not None:
            target = o.target
            if target is None:
                if len(graph.outputs) != 1:
                    raise UsageError(f"--loss-fn {o.loss_fn}: name the output to compare with --target "
                                     f"(outputs: {', '.join(v.name for v in graph.outputs)})")
                target = graph.outputs[0].name
            loss_output = o.loss_options.get("loss_output", "loss")
            if loss is not None and loss != loss_output:
                raise UsageError(f"--loss {loss}: with --loss-fn the gradient is taken of the appended loss "
                                 f"{loss_output!r}; drop --loss")
            loss = add_loss(graph, build.new_names(), o.loss_fn, target, **o.loss_options).name
        build.heads = select_heads(graph, loss)
        build.record(LossResult(tuple(h.name for h in build.heads)))


def select_heads(graph: Graph, loss: str | list[str] | None) -> list[Value]:
    """The ys: the loss, or several outputs (each non-scalar one seeded by a `<y>_grad` input)."""
    if isinstance(loss, (list, tuple)):
        if not loss:
            raise UsageError("--loss: no output named")
        return [select_loss(graph, name) for name in loss]
    return [select_loss(graph, loss)]


def select_loss(graph: Graph, name: str | None) -> Value:
    if name is not None:
        v = find_output(graph, name, "--loss")
    else:
        scalars = [v for v in graph.outputs if v.shape == () and v.is_float]
        if len(scalars) != 1:
            found = "no scalar output" if not scalars else f"{len(scalars)} scalar outputs"
            raise UsageError(f"cannot choose the loss: {found}; name it with --loss "
                             f"(candidates: {', '.join(o.name for o in (scalars or graph.outputs))})")
        v = scalars[0]
    if not v.is_float:
        raise UsageError(f"the loss {v.name!r} is not a floating-point tensor")
    return v
