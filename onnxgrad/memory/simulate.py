"""The memory a schedule needs: live bytes after each node, the peak, and what is alive at the peak.

The model is what onnxruntime does with a training graph whose node order is the schedule (PRIORITY_BASED, see
contract.RUNTIME_HINTS), the CPU arena and memory patterns off:
- initializers and graph inputs are alive for the whole run (`static`);
- a node's outputs are allocated when it runs and freed right after the last node that reads them; a graph
  output stays alive to the end; an output nobody reads is freed right after its node;
- while a node runs, its inputs and its outputs are alive together, so the peak is taken during each node.
onnxruntime may also run an element-wise node in place, writing its output over an input it is the last
reader of; that saves one tensor at that node and is not modelled, so the simulation errs on the high side.

Bytes need every shape known: symbolic dimensions are bound by `dims` (the `--dim` values).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..contract import BACKWARD, FORWARD, GRAD_SUFFIX, OPTIMIZER, RECOMPUTE
from ..errors import UsageError
from ..ir import Graph, Node, Value

CATEGORIES = ("parameters", "inputs", "gradients", "saved activations", "temporaries")


@dataclass
class Timeline:
    """The simulated memory of one run of a graph."""

    live_after: list[int]                  # bytes alive after each node (static bytes excluded)
    during: list[int]                      # bytes alive while each node runs (static excluded)
    static: int                            # initializers and graph inputs
    peak: int                              # static + max(during)
    peak_index: int
    peak_node: str
    at_peak: dict[str, int]                # CATEGORIES -> bytes alive while the peak node runs
    saved: list[tuple[str, int]] = field(default_factory=list)  # forward values the backward reads, by size

    @property
    def dynamic_peak(self) -> int:
        """The peak less the static bytes: what one run adds to the memory a session already holds."""
        return self.peak - self.static

    def summary(self) -> dict:
        return {"peak_bytes": self.peak, "static_bytes": self.static, "dynamic_peak_bytes": self.dynamic_peak,
                "peak_node": self.peak_node, "peak_index": self.peak_index, "at_peak": self.at_peak,
                "saved_bytes": sum(b for _, b in self.saved), "saved_values": len(self.saved)}


def sizes(graph: Graph, dims: dict[str, int] | None = None) -> dict[int, int]:
    """id(value) -> bytes, for every value of the graph; an error names the first value whose size is unknown."""
    dims = dims or {}
    out: dict[int, int] = {}
    unknown: list[Value] = []
    for v in _all_values(graph):
        b = v.bytes_with(dims)
        if b is None:
            unknown.append(v)
        else:
            out[id(v)] = b
    if unknown:
        v = unknown[0]
        symbols = sorted({d for u in unknown if u.shape for d in u.shape if isinstance(d, str) and d not in dims})
        hint = (f"bind {', '.join(symbols)} with --dim" if symbols
                else "its shape is not known after shape inference")
        raise UsageError(f"the size of {v.name!r} is unknown ({len(unknown)} values like it): {hint}")
    return out


def _all_values(graph: Graph):
    seen = set()
    for v in graph.inputs:
        seen.add(id(v))
        yield v
    for name in graph.initializers:
        v = graph.values.get(name)
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            yield v
    for n in graph.nodes:
        for v in n.outputs:
            if v.name and id(v) not in seen:
                seen.add(id(v))
                yield v


def simulate(graph: Graph, dims: dict[str, int] | None = None, nbytes: dict[int, int] | None = None) -> Timeline:
    """Run the schedule `graph.nodes` on paper."""
    nbytes = nbytes if nbytes is not None else sizes(graph, dims)
    static_values = {id(v) for v in graph.inputs} | {id(graph.values[n]) for n in graph.initializers
                                                     if n in graph.values}
    static = sum(nbytes[i] for i in static_values)
    kept = {id(v) for v in graph.outputs}
    last_read: dict[int, int] = {}
    for k, n in enumerate(graph.nodes):
        for v in n.all_inputs:
            if v is not None:
                last_read[id(v)] = k
    frees: dict[int, list[int]] = {}
    for k, n in enumerate(graph.nodes):
        for v in n.outputs:
            if v.name and id(v) not in kept:
                frees.setdefault(last_read.get(id(v), k), []).append(id(v))

    live = 0
    live_after, during = [], []
    for k, n in enumerate(graph.nodes):
        live += sum(nbytes[id(v)] for v in n.outputs if v.name)
        during.append(live)
        live -= sum(nbytes[i] for i in frees.get(k, ()))
        live_after.append(live)
    peak_index = max(range(len(during)), key=during.__getitem__) if during else 0
    readers = _reader_phases(graph)
    at_peak = _alive_at(graph, peak_index, nbytes, last_read, kept, readers) if during else {}
    saved = saved_values(graph, nbytes, readers)
    return Timeline(live_after, during, static, static + (during[peak_index] if during else 0), peak_index,
                    graph.nodes[peak_index].name if graph.nodes else "", at_peak, saved)


def _alive_at(graph: Graph, k: int, nbytes: dict[int, int], last_read: dict[int, int], kept: set[int],
              readers_phase: dict[int, set[str]]) -> dict:
    """Bytes per category alive while node k runs."""
    out = dict.fromkeys(CATEGORIES, 0)
    inputs = {id(v) for v in graph.inputs}
    for v in graph.inputs:
        out["parameters" if v.name in graph.initializers else "inputs"] += nbytes[id(v)]
    for name in graph.initializers:
        v = graph.values.get(name)
        if v is not None and id(v) not in inputs:
            out["parameters"] += nbytes[id(v)]
    for j, n in enumerate(graph.nodes[:k + 1]):
        for v in n.outputs:
            if not v.name or (id(v) not in kept and last_read.get(id(v), j) < k):
                continue
            out[_category(n, v, kept, readers_phase)] += nbytes[id(v)]
    return out


def _category(n: Node, v: Value, kept: set[int], readers_phase: dict[int, set[str]]) -> str:
    if n.phase in (FORWARD, RECOMPUTE):
        return "saved activations" if BACKWARD in readers_phase.get(id(v), ()) else "temporaries"
    if id(v) in kept and (n.phase == OPTIMIZER or v.name.endswith(GRAD_SUFFIX)):
        return "gradients"
    return "temporaries"


def _reader_phases(graph: Graph) -> dict[int, set[str]]:
    phases: dict[int, set[str]] = {}
    for n in graph.nodes:
        for v in n.all_inputs:
            if v is not None:
                phases.setdefault(id(v), set()).add(n.phase)
    return phases


def saved_values(graph: Graph, nbytes: dict[int, int],
                 readers: dict[int, set[str]] | None = None) -> list[tuple[str, int]]:
    """The forward values the backward reads (kept from the forward pass to the backward), largest first."""
    readers = readers if readers is not None else _reader_phases(graph)
    out = [(v.name, nbytes[id(v)]) for n in graph.nodes if n.phase == FORWARD for v in n.outputs
           if v.name and BACKWARD in readers.get(id(v), ())]
    return sorted(out, key=lambda kv: -kv[1])


def load(model, dims: dict[str, int] | None = None) -> Graph:
    """A model from a path (or a ModelProto) as a typed Graph with its symbolic dims bound: the read and infer
    stages of the build, then onnx's shape inference for anything still untyped."""
    from ..passes.frontend import Infer, Read
    from ..pipeline import Build, Options, run
    from ..shapes import type_everything
    build = run(Build(model, Options(dims=dict(dims or {}))), [Read(), Infer()])
    type_everything(build.graph)
    return build.graph


def plot(timelines: dict[str, Timeline], path) -> None:
    """Live bytes against the step of the schedule, one line per graph, into a PNG."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'onnxgrad[plot]'") from None
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for label, t in timelines.items():
        ax.plot([(t.static + b) / 2**20 for b in t.during], label=f"{label} (peak {t.peak / 2**20:.1f} MiB)",
                linewidth=1.2)
        ax.scatter([t.peak_index], [t.peak / 2**20], s=14)
    ax.set_xlabel("node of the schedule")
    ax.set_ylabel("live memory, MiB")
    ax.set_title("simulated memory of one run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def peak_of_plan(graph: Graph, order: list, nbytes: dict[int, int]) -> int:
    """The peak `simulate` would give for the graph after `plan.apply(graph, Plan(order=order))`, without
    changing the graph: copies and the reads `apply` rewires are followed as versions of the original values."""
    by_name = {n.name: n for n in graph.nodes}
    kept = {id(v) for v in graph.outputs}
    static = sum(nbytes[id(v)] for v in graph.inputs) + sum(
        nbytes[id(graph.values[t])] for t in graph.initializers
        if t in graph.values and graph.values[t] not in graph.inputs)
    latest: dict[int, int] = {}          # id(original value) -> current version number
    steps: list[tuple[list[tuple[int, int]], list[tuple[int, int]]]] = []  # (reads, writes) as (value, version)
    for step in order:
        copy = isinstance(step, tuple)
        node = by_name[step[0] if copy else step]
        rewired = copy or node.phase == BACKWARD
        reads = [(id(v), latest.get(id(v), 0) if rewired else 0) for v in node.all_inputs if v is not None]
        writes = []
        for v in node.outputs:
            if v.name:
                version = latest.get(id(v), 0) + 1 if copy else 0
                if copy:
                    latest[id(v)] = version
                writes.append((id(v), version))
        steps.append((reads, writes))
    last: dict[tuple[int, int], int] = {}
    for k, (reads, _) in enumerate(steps):
        for r in reads:
            last[r] = k
    frees: dict[int, list[int]] = {}
    for k, (_, writes) in enumerate(steps):
        for w in writes:
            if not (w[1] == 0 and w[0] in kept):
                frees.setdefault(last.get(w, k), []).append(nbytes[w[0]])
    live = peak = 0
    for k, (_, writes) in enumerate(steps):
        live += sum(nbytes[w[0]] for w in writes)
        peak = max(peak, live)
        live -= sum(frees.get(k, ()))
    return static + peak
