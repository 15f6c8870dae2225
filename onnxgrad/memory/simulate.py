"""The memory a schedule needs: live bytes after each node, the peak, and what is alive at the peak.

The model is what onnxruntime does with a training graph whose node order is the schedule (PRIORITY_BASED, see
contract.RUNTIME_HINTS), the CPU arena and memory patterns off:
- initializers and graph inputs are alive for the whole run (`static`);
- a node's outputs are allocated when it runs and freed right after the last node that reads them; a graph
  output stays alive to the end, and so does an output nobody reads (onnxruntime holds it to the end of the run:
  measured, a 32 MiB output no node read stayed mapped through the nodes after it);
- while a node runs, its inputs and its outputs are alive together, so the peak is taken during each node.
- some kernels take working memory of their own while they run (`scratch_bytes`, measured on onnxruntime's
  CPU kernels): Where selects into two output-sized buffers, taken before its output, then merges them into it;
  ConvTranspose unfolds each image into a column buffer; ScatterElements copies its indices into an int64 buffer
  of its own, from malloc rather than onnxruntime's allocator (`OutsideAllocator`: never in the arena). A loop's
  is its body's peak; a Loop also keeps every iteration's scan outputs and concatenates them after its last
  iteration (`loop_bytes`).
The view ops (Reshape, Flatten, Squeeze, Unsqueeze) share their input's buffer, except into a graph output, which
gets a buffer of its own; so do the nodes onnxruntime's basic optimizations remove (Identity, a Cast to the type
its input has). onnxruntime also runs some nodes in place, writing the output over input 0 when the node is that
buffer's last reader and the output is no graph output: the activations (Softmax, LogSoftmax, Tanh, Relu,
Sigmoid, LeakyRelu, Elu, Softplus, HardSigmoid) and ScatterElements, not Gelu, Erf, Exp, Neg, the binary
arithmetic ops or ScatterND (measured: bench/bench_inplace.py). The live bytes do not count it, so they err on the
high side while such a node runs; `allocations`, which the arena's emulation reads, makes no buffer for it.

Bytes need every shape known: symbolic dimensions are bound by `dims` (the `--dim` values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..contract import BACKWARD, FORWARD, GRAD_SUFFIX, OPTIMIZER, RECOMPUTE
from ..errors import UsageError
from ..ir import Graph, Node, Value, itemsize

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


def format_bytes(n: int | float) -> str:
    """Bytes for people: KiB below a MiB, MiB below 10 GiB, else GiB; rounded up at the place shown, so a figure
    a refusal gives can be asked for as written (`--budget 1057.7MiB`), where 1.0 GiB would stand for budgets
    from 1000 to 1075 MiB."""
    for unit, above, size in (("GiB", 10 * 2**30, 2**30), ("MiB", 2**20, 2**20), ("KiB", 0, 2**10)):
        if n >= above or unit == "KiB":
            return f"{math.ceil(n * 10 / size) / 10:.1f} {unit}"


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
        symbols = sorted({d for u in unknown if u.shape for d in u.shape
                          if isinstance(d, str) and d not in dims and not d.startswith("unk__")})
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


ALIASES = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze"})  # output shares input 0's buffer
# written over input 0 when the node is that buffer's last reader (bench/bench_inplace.py)
IN_PLACE = frozenset({"Softmax", "LogSoftmax", "Tanh", "Relu", "Sigmoid", "LeakyRelu", "Elu", "Softplus",
                      "HardSigmoid", "ScatterElements"})


def fused_into_reader(node: Node, outputs: set[int], constants: set[str]) -> bool:
    """Whether onnxruntime's fusions (ORT_ENABLE_EXTENDED and above) never make this node's output: a MatMul of a
    2-D weight whose only reader adds a bias of rank 1 (MatMulAddFusion: one Gemm), or whose only reader scales it
    by a constant scalar (MatMulScaleFusion: FusedMatMul's alpha). On BERT-base's 0.9x plan all 75 such MatMuls ran
    fused, and the arena's emulation came within 0.7% of onnxruntime's (9.9% high with their outputs counted)."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    out = node.outputs[0] if node.outputs else None
    if out is None or not out.name or id(out) in outputs or len(out.uses) != 1:
        return False
    reader = out.uses[0][0]
    others = [v for v in reader.inputs if v is not None and v is not out]
    if reader.domain not in ("", "ai.onnx") or len(others) != 1:
        return False
    other = others[0]
    if reader.op_type == "Add":
        return other.rank == 1 and node.inputs[1] is not None and node.inputs[1].rank == 2
    if reader.op_type in ("Mul", "Div"):
        return constant_scalar(other, constants)
    return False


def constant_scalar(v: Value, constants: set[str]) -> bool:
    """An initializer (`constants`: their names) or a Constant node's output holding one element: a scale
    onnxruntime's MatMulScaleFusion moves into FusedMatMul's alpha."""
    constant = v.name in constants or (v.producer is not None and v.producer.op_type == "Constant")
    return constant and v.static_shape is not None and all(d == 1 for d in v.static_shape)


def in_place_candidate(node: Node, outputs: set[int]) -> bool:
    """Whether onnxruntime may write the node's output over its input 0 (`IN_PLACE`; not into a graph output)."""
    return (node.op_type in IN_PLACE and node.domain in ("", "ai.onnx") and bool(node.inputs)
            and node.inputs[0] is not None and bool(node.outputs) and bool(node.outputs[0].name)
            and id(node.outputs[0]) not in outputs)


def shares_buffer(node: Node) -> bool:
    """Whether onnxruntime gives the node's output its first input's buffer: the view ops, the nodes its basic
    optimizations remove (`passes_through`) and folded transposes."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None or not node.outputs:
        return False
    return node.op_type in ALIASES or passes_through(node) or folded_transpose(node)


def passes_through(node: Node) -> bool:
    """A node whose output is its input, which onnxruntime's basic optimizations remove: Identity, and a Cast to
    the type its input already has (as `x.float()` exports)."""
    if node.domain not in ("", "ai.onnx") or not node.inputs or node.inputs[0] is None or not node.outputs:
        return False
    if node.op_type == "Identity":
        return True
    source = node.inputs[0].elem_type
    return node.op_type == "Cast" and bool(source) and node.attr("to") == source


def folded_transpose(node: Node) -> bool:
    """A Transpose of the last two axes that only MatMuls (or, in 2-D, Gemms that fold it) read: onnxruntime's
    fusions at ORT_ENABLE_EXTENDED and above fold it into each reader (FusedMatMul, Gemm's trans flags), so its
    result is never made and the readers read its input. GPT-2's output layer reads the embedding table so: the
    147 MiB transposed table the simulator counted was never allocated."""
    if node.op_type != "Transpose" or not node.outputs[0].name:
        return False
    rank = node.inputs[0].rank
    if rank is None or rank < 2:
        return False
    perm = node.attr("perm")
    if list(perm if perm is not None else reversed(range(rank))) != [*range(rank - 2), rank - 1, rank - 2]:
        return False
    uses = node.outputs[0].uses
    return bool(uses) and all(i in (0, 1) and (r.op_type == "MatMul" or (r.op_type == "Gemm" and rank == 2
                                                                          and _gemm_folds(r)))
                              and r.domain in ("", "ai.onnx") for r, i in uses)


# activations onnxruntime fuses into a Gemm before it (FusedGemm), which then keeps a Transpose it reads
GEMM_ACTIVATIONS = frozenset({"Relu", "LeakyRelu", "Sigmoid", "Tanh", "HardSigmoid", "Elu", "Selu", "Softsign",
                              "Softplus", "ThresholdedRelu"})


def _gemm_folds(gemm: Node) -> bool:
    """Whether onnxruntime folds a Transpose into this Gemm's trans flags: only when the Gemm's result has at
    most one reader, and not an activation it fuses into the Gemm (measured on onnxruntime 1.31's optimized
    graphs: a second reader, such as a tie's Slice, or a Relu after it keeps the Transpose)."""
    uses = gemm.outputs[0].uses if gemm.outputs and gemm.outputs[0].name else []
    return len(uses) <= 1 and all(r.op_type not in GEMM_ACTIVATIONS for r, _ in uses)


def view_of_input(node: Node, outputs: set[int]) -> bool:
    """`shares_buffer` within a graph whose outputs are `outputs` (ids): a graph output gets a buffer of its own,
    so a view op (or a Transpose that would be folded into its readers) that writes one is a copy. Identity and
    the no-op Cast are removed by onnxruntime's basic optimizations and stay views."""
    return shares_buffer(node) and not (node.op_type in ALIASES | {"Transpose"} and id(node.outputs[0]) in outputs)


class _Buffers:
    """Values to buffers: an alias op's output shares its input's buffer, which lives while any of them does."""

    def __init__(self):
        self.root: dict = {}

    def find(self, key):
        while key in self.root:
            key = self.root[key]
        return key


def _profile(steps, size, kept, buffers: _Buffers):
    """Live bytes while and after each step. `steps`: (reads, writes, aliased, scratch) per node, where writes
    are keys of new values and `aliased` maps a write to the read whose buffer it shares; `size[key]` gives
    bytes. Returns (during, live_after, last step reading each buffer)."""
    last, freed = _frees(steps, kept, buffers)
    frees = {k: sum(size[w] for w in keys) for k, keys in freed.items()}
    live = 0
    during, live_after = [], []
    for k, (_, writes, aliased, scratch) in enumerate(steps):
        live += sum(size[w] for w in writes if w not in aliased)
        during.append(live + scratch)
        live -= frees.get(k, 0)
        live_after.append(live)
    return during, live_after, last


def _steps_of(graph: Graph, nbytes: dict[int, int]):
    steps = []
    outputs = {id(v) for v in graph.outputs}
    for n in graph.nodes:
        writes = [id(v) for v in n.outputs if v.name]
        aliased = {}
        if writes and view_of_input(n, outputs):
            aliased[writes[0]] = id(n.inputs[0])
        steps.append(([id(v) for v in n.all_inputs if v is not None], writes, aliased, scratch_bytes(n, nbytes)))
    return steps


def allocations(graph: Graph, nbytes: dict[int, int]) -> list[tuple[object, int]]:
    """The schedule's allocations and frees as onnxruntime makes them, as (key, bytes) for an allocation and
    (key, 0) for the free of that key's buffer: each node's outputs (not the views that share a buffer), its
    working memory (freed as it ends; a `Working` kernel's comes before its outputs), then the buffers whose last
    reader it was. Initializers, graph inputs and empty tensors are never allocated here; graph outputs and
    outputs nobody reads are never freed. Unlike `simulate`, an `IN_PLACE` node that is the last reader of its
    input's buffer writes over it, as onnxruntime runs it, and a MatMul that onnxruntime fuses with its reader
    (`fused_into_reader`) makes no buffer. That changes the live bytes only while such a node runs, but where the
    next buffers go in an arena (bench/bench_arena.py)."""
    static_values, kept = _static_and_kept(graph)
    in_place, fused = _run_as(graph, graph.nodes)
    return _events(_steps_of(graph, nbytes), nbytes, kept, static_values, in_place, fused)


def _run_as(graph: Graph, nodes: list[Node]) -> tuple[set[int], set[int]]:
    """(the steps of `nodes`, run in `graph`, that onnxruntime may write over their input 0, those whose output
    it fuses into their reader)."""
    outputs = {id(v) for v in graph.outputs}
    constants = set(graph.initializers)
    return ({k for k, n in enumerate(nodes) if in_place_candidate(n, outputs)},
            {k for k, n in enumerate(nodes) if fused_into_reader(n, outputs, constants)})


def live_peak(events: list[tuple[object, int]]) -> int:
    """The most bytes alive at once along `allocations` (or `allocations_of_plan`): the dynamic peak `simulate`
    gives for the same schedule."""
    held: dict = {}
    live = peak = 0
    for key, n in events:
        if n:
            held[key] = n
            live += n
            peak = max(peak, live)
        else:
            live -= held.pop(key)
    return peak


def _static_and_kept(graph: Graph) -> tuple[set[int], set[int]]:
    """(the values alive for the whole run: graph inputs and initializers, those and the graph outputs: the
    values never freed)."""
    static_values = {id(v) for v in graph.inputs} | {id(graph.values[n]) for n in graph.initializers
                                                     if n in graph.values}
    return static_values, {id(v) for v in graph.outputs} | static_values


def _frees(steps, kept, buffers: _Buffers) -> tuple[dict, dict[int, list]]:
    """(last step reading each buffer, the buffers freed after each step): a buffer goes after its last reader,
    unless it is kept; an output nobody reads stays to the end, as a kept one."""
    last: dict = {}
    for _, _, aliased, _ in steps:
        buffers.root.update(aliased)
    for k, (reads, _, _, _) in enumerate(steps):
        for r in reads:
            last[buffers.find(r)] = k
    kept_roots = {buffers.find(key) for key in kept}
    frees: dict[int, list] = {}
    for k, (_, writes, aliased, _) in enumerate(steps):
        for w in writes:
            if w not in aliased and w not in kept_roots and w in last:
                frees.setdefault(max(last[w], k), []).append(w)
    return last, frees


def _written_in_place(steps, kept, static, in_place: set[int]):
    """`steps` with each in-place candidate (step numbers `in_place`) that is the last reader of its input 0's
    buffer, which is no kept or static value, writing over that buffer (an alias of it)."""
    if not in_place:
        return steps
    buffers = _Buffers()
    last, _ = _frees(steps, kept, buffers)
    kept_roots = {buffers.find(key) for key in kept} | {buffers.find(key) for key in static}
    out = list(steps)
    for k in sorted(in_place):
        reads, writes, aliased, scratch = out[k]
        if not reads or not writes or writes[0] in aliased:
            continue
        source = buffers.find(reads[0])
        if source in kept_roots or last.get(source) != k:
            continue
        out[k] = (reads, writes, {**aliased, writes[0]: reads[0]}, scratch)
        buffers.root[writes[0]] = source
        last[source] = max(k, last.get(writes[0], k))
    return out


def _events(steps, size, kept, static, in_place: set[int] = frozenset(),
            fused: set[int] = frozenset()) -> list[tuple[object, int]]:
    """`steps` as allocations and frees; the steps `in_place` may write over their input 0, those `fused` make
    no buffer for their output 0."""
    steps = _written_in_place(steps, kept, static, in_place)
    _, frees = _frees(steps, kept, _Buffers())
    never = {steps[k][1][0] for k in fused if steps[k][1]}
    out: list[tuple[object, int]] = []
    for k, (_, writes, aliased, scratch) in enumerate(steps):
        before = scratch.parts if isinstance(scratch, Working) else ()
        tag = scratch.key if isinstance(scratch, Working) else "scratch"
        out += [((tag, k, i), b) for i, b in enumerate(before)]
        out += [(w, size[w]) for w in writes if w not in aliased and w not in static and size[w] and w not in never]
        if before:
            out += [((tag, k, i), 0) for i in reversed(range(len(before)))]
        elif scratch:
            out += [(("scratch", k), scratch), (("scratch", k), 0)]
        out += [(w, 0) for w in frees.get(k, ()) if size[w] and w not in never]
    return out


def simulate(graph: Graph, dims: dict[str, int] | None = None, nbytes: dict[int, int] | None = None) -> Timeline:
    """Run the schedule `graph.nodes` on paper."""
    nbytes = nbytes if nbytes is not None else sizes(graph, dims)
    static_values, kept = _static_and_kept(graph)
    static = sum(nbytes[i] for i in static_values)
    buffers = _Buffers()
    steps = _steps_of(graph, nbytes)
    during, live_after, last = _profile(steps, nbytes, kept, buffers)
    peak_index = max(range(len(during)), key=during.__getitem__) if during else 0
    readers = _reader_phases(graph)
    at_peak = _alive_at(graph, peak_index, nbytes, last, kept, readers, buffers) if during else {}
    saved = saved_values(graph, nbytes, readers)
    return Timeline(live_after, during, static, static + (during[peak_index] if during else 0), peak_index,
                    graph.nodes[peak_index].name if graph.nodes else "", at_peak, saved)


class Working(int):
    """Working memory a kernel takes as buffers of its own before it allocates its outputs, freed the last first
    once it has written them; as an int, their total."""

    parts: tuple[int, ...]
    key = "scratch"  # how `allocations` names these buffers

    def __new__(cls, parts: tuple[int, ...]):
        working = super().__new__(cls, sum(parts))
        working.parts = tuple(parts)
        return working


OUTSIDE = "outside"


class OutsideAllocator(Working):
    """`Working` memory a kernel takes from malloc, not from onnxruntime's allocator: live bytes like any other
    (with the arena off every buffer comes from malloc), but never the arena's. `allocations` names these buffers
    (OUTSIDE, step, part); `arena` leaves them out of the regions and counts them beside."""

    key = OUTSIDE


def scratch_bytes(node: Node, nbytes: dict[int, int]) -> int:
    """Working memory an onnxruntime CPU kernel allocates for itself while it runs (measured with
    `memory.measure` on single nodes): Where writes both selections into output-sized buffers before it allocates
    its output and merges them into it (`Working`: the order matters to an arena, bench/bench_arena.py);
    ConvTranspose unfolds each image into a (C_out/group * kernel) x (input positions) column buffer;
    ScatterElements copies its indices into an int64 buffer before its output, from malloc (`OutsideAllocator`:
    12.25 MiB for ResNet-50's MaxPool gradient at batch 8, traced outside the arena with `strace -k`)."""
    if node.domain not in ("", "ai.onnx"):
        return 0
    if node.op_type == "ScatterElements" and len(node.inputs) > 1 and node.inputs[1] is not None:
        indices = node.inputs[1]
        count = nbytes.get(id(indices), 0) // max(itemsize(indices.elem_type), 1) if indices.elem_type else 0
        return OutsideAllocator((8 * count,)) if count else 0
    if node.op_type == "Where" and node.outputs[0].name:
        selection = nbytes[id(node.outputs[0])]
        return Working((selection, selection)) if selection else 0
    if node.op_type in ("Loop", "Scan"):
        return loop_bytes(node, nbytes)
    if node.op_type == "ConvTranspose":
        x, w = node.inputs[0], node.inputs[1]
        if x.shape and w.shape and all(isinstance(d, int) for d in (*x.shape, *w.shape)):
            columns = w.shape[1] * math.prod(w.shape[2:])  # ConvTranspose's weight is [C_in, C_out/group, k...]
            return columns * math.prod(x.shape[2:]) * itemsize(x.elem_type)
    return 0


def loop_bytes(node: Node, nbytes: dict[int, int]) -> int:
    """A loop's working memory beyond its outputs, which the caller counts for the whole node: for a Scan, which
    writes each iteration's scan outputs into its own outputs, its body's peak; for a Loop, `_loop_working`. A body
    whose sizes are not all known counts zero there (a Loop: its scan outputs once more), so the figure errs low."""
    from ..ir import from_model
    import onnx
    try:
        body = from_model(onnx.helper.make_model(node.attr("body"), opset_imports=[onnx.helper.make_opsetid("", 21)]))
        body_bytes = sizes(body)
    except UsageError:
        return sum(nbytes.get(id(v), 0) for v in node.outputs[len(node.inputs) - 2:]) if node.op_type == "Loop" else 0
    body_peak = simulate(body, nbytes=body_bytes).dynamic_peak
    if node.op_type != "Loop":
        return body_peak
    return _loop_working(node, body, body_bytes, body_peak, nbytes)


def _loop_working(node: Node, body: Graph, body_bytes: dict[int, int], body_peak: int,
                  nbytes: dict[int, int]) -> int:
    """What a Loop holds beyond its outputs, as onnxruntime runs it (measured with `memory.measure` on Loops alone).

    A Loop cannot allocate its outputs before the last iteration ends: each iteration runs the body on the carries
    the previous one returned and the Loop keeps every iteration's scan outputs; at the end it allocates its
    outputs, copies the last carries into them and concatenates the kept scan outputs, with the last iteration's
    inputs and outputs still held. A body output that is a view of a body input (`Identity(h)` as a scan output,
    which is how a carry is stored) is no new buffer: it keeps the carry the iteration before returned; a view of
    another body output is a copy. So the peak is the larger of the last iteration (the body's peak, its inputs, the earlier scan outputs) and the end
    (all of those buffers, the last outputs, and the Loop's outputs): never the body's temporaries and the
    concatenated copy together. Buffers are named (body buffer, iteration) and counted once each."""
    n = len(node.inputs) - 2
    returned_ids = {id(v) for v in body.outputs}
    aliases = _Buffers()
    for m in body.nodes:  # a view of a value the body also returns is a copy: two outputs never share a buffer
        if m.outputs and m.outputs[0].name and shares_buffer(m) and \
                not (id(m.outputs[0]) in returned_ids and id(m.inputs[0]) in returned_ids):
            aliases.root[id(m.outputs[0])] = id(m.inputs[0])
    made = {id(v) for m in body.nodes for v in m.outputs if v.name}
    carry_in = {id(v): j for j, v in enumerate(body.inputs[2:2 + n])}
    carry_out, scan_out = body.outputs[1:1 + n], body.outputs[1 + n:]

    def buffer(v: Value, t: int):
        """(body buffer, iteration) that value `v` of iteration `t` lives in; None for the Loop's inputs (and for a
        carry the body passes on unchanged, which stays the Loop's input)."""
        passed = set()
        while t >= 0:
            root = aliases.find(id(v))
            if root in made:
                return root, t
            if root not in carry_in or root in passed:
                return None
            passed.add(root)
            v, t = carry_out[carry_in[root]], t - 1  # the carry the iteration before returned
        return None

    def size(held) -> int:
        return sum(body_bytes[b[0]] for b in held if b is not None)

    per_iteration = [body_bytes.get(id(v), 0) for v in scan_out]
    stacked = [nbytes.get(id(v), 0) for v in node.outputs[n:]]
    trips = next((s // p for s, p in zip(stacked, per_iteration) if p), 2)  # without scan outputs: at least 2
    outputs = sum(nbytes.get(id(v), 0) for v in node.outputs)
    kept = {buffer(v, t) for v in scan_out for t in range(trips - 1)}
    fed = {buffer(v, trips - 1) for v in body.inputs[2:2 + n]}
    returned = {buffer(v, trips - 1) for v in body.outputs}
    last_iteration = size(kept | fed) + body_peak
    end = size(kept | fed | returned) + outputs
    return max(last_iteration, end) - outputs


def _alive_at(graph: Graph, k: int, nbytes: dict[int, int], last: dict, kept: set[int],
              readers_phase: dict[int, set[str]], buffers: _Buffers) -> dict:
    """Bytes per category alive while node k runs (a buffer counts once, under the value that made it)."""
    out = dict.fromkeys(CATEGORIES, 0)
    inputs = {id(v) for v in graph.inputs}
    for v in graph.inputs:
        out["parameters" if v.name in graph.initializers else "inputs"] += nbytes[id(v)]
    for name in graph.initializers:
        v = graph.values.get(name)
        if v is not None and id(v) not in inputs:
            out["parameters"] += nbytes[id(v)]
    kept_roots = {buffers.find(key) for key in kept}
    for j, n in enumerate(graph.nodes[:k + 1]):
        for v in n.outputs:
            if not v.name or buffers.find(id(v)) != id(v):
                continue
            if id(v) not in kept_roots and id(v) in last and max(last[id(v)], j) < k:
                continue  # freed after its last reader (a value nobody reads stays, as in `_profile`)
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
    steps, size, kept, static, _ = _plan_steps(graph, order, nbytes)
    during, _, _ = _profile(steps, size, kept, _Buffers())
    return static + max(during, default=0)


def allocations_of_plan(graph: Graph, order: list, nbytes: dict[int, int]) -> tuple[int, list[tuple[object, int]]]:
    """(static bytes, `allocations`) of the graph after `plan.apply(graph, Plan(order=order))`, without changing
    the graph."""
    steps, size, kept, static, statics = _plan_steps(graph, order, nbytes)
    by_name = {n.name: n for n in graph.nodes}
    in_place, fused = _run_as(graph, [by_name[step[0] if isinstance(step, tuple) else step] for step in order])
    readers: dict = {}
    for reads, _, _, _ in steps:
        for r in set(reads):
            readers[r] = readers.get(r, 0) + 1
    # fused where the written graph's MatMul has one reader too: a copy of the Add that reads the MatMul's first
    # run gives that a second reader
    fused = {k for k in fused if steps[k][1] and readers.get(steps[k][1][0]) == 1}
    return static, _events(steps, size, kept, statics, in_place, fused)


def _plan_steps(graph: Graph, order: list, nbytes: dict[int, int]):
    by_name = {n.name: n for n in graph.nodes}
    statics = [id(v) for v in graph.inputs] + [id(graph.values[t]) for t in graph.initializers if t in graph.values]
    static = sum(nbytes[i] for i in set(statics))
    kept = {(id(v), 0) for v in graph.outputs} | {(i, 0) for i in statics}
    outputs = {id(v) for v in graph.outputs}
    latest: dict[int, int] = {}          # id(original value) -> current version number
    steps = []
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
        aliased = {}
        if writes and view_of_input(node, outputs):
            aliased[writes[0]] = reads[0]
        steps.append((reads, writes, aliased, scratch_bytes(node, nbytes)))
    return steps, _VersionSizes(nbytes), kept, static, {(i, 0) for i in statics}


class _VersionSizes:
    """Bytes of (value, version) keys: every copy of a value has its size."""

    def __init__(self, nbytes: dict[int, int]):
        self.nbytes = nbytes

    def __getitem__(self, key) -> int:
        return self.nbytes[key[0]]
