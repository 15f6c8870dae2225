"""Rewrites before the gradient pass: ops whose gradient is simplest as the gradient of plain ops.

`lower_for_gradient(graph, heads)` rewrites the nodes the heads depend on, in place in the node order:
- LSTM, GRU and RNN with a static sequence length are unrolled: one MatMul over all time steps for the input
  projection, then per step a MatMul with R, the gate activations and the state update; Y, Y_h and Y_c are
  rebuilt with Unsqueeze and Concat. The rules for those ops then give the gradient (backpropagation through
  time), and the recurrent weights' gradient is the sum of the per-step contributions.
- Chains of sequence ops whose positions and split sizes are constants become tensor ops: SplitToSequence is
  a Split, SequenceAt(i) picks the i-th tensor, ConcatFromSequence a Concat; SequenceConstruct, SequenceEmpty,
  SequenceInsert and SequenceErase only rearrange the list of tensors, and SequenceLength is a constant.
- A Dropout that may run in training mode and has no mask output gets one, so its rule knows what was dropped.
The original output values are kept (only their producers change), so consumers and graph outputs are
untouched. A node the rewrite cannot handle is left as it is; its rule (rules/control.py) then raises the
reason given by `why_not_lowered`, naming the form and what to do.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from .builder import Builder, Names
from .gradient import reaching_heads
from .ir import Dim, Graph, Node, Value, names_defined_in

RECURRENT = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
SEQUENCE_OPS = frozenset({"SequenceConstruct", "SequenceEmpty", "SplitToSequence", "SequenceInsert",
                          "SequenceErase", "SequenceAt", "SequenceLength", "ConcatFromSequence"})
# activation name -> (ONNX default alpha, default beta); None where the function takes no such value
ACTIVATIONS = {"Sigmoid": (None, None), "Tanh": (None, None), "Relu": (None, None), "Softsign": (None, None),
               "Softplus": (None, None), "LeakyRelu": (0.01, None), "ThresholdedRelu": (1.0, None),
               "Elu": (1.0, None), "HardSigmoid": (0.2, 0.5), "Affine": (1.0, 0.0), "ScaledTanh": (1.0, 1.0)}


def lower_for_gradient(graph: Graph, heads: list[Value]) -> bool:
    """Rewrite the recurrent ops, sequence chains and mask-less training Dropouts the heads depend on."""
    if not any(n.op_type in RECURRENT or n.op_type in SEQUENCE_OPS or n.op_type == "Dropout"
               for n in graph.nodes if not n.domain):
        return False
    reaches_loss = reaching_heads(graph, heads)
    taken = [*graph.values, *(n.name for n in graph.nodes)]
    taken += [name for n in graph.nodes for sub in n.subgraphs() for name in names_defined_in(sub)]
    rewriter = _Rewriter(graph, Names(taken))
    old, graph.nodes = graph.nodes, []
    for node in old:
        # SequenceLength's integer output is never on the path, but replacing it frees the sequence
        on_path = not node.domain and (any(id(o) in reaches_loss for o in node.outputs) or node.op_type == "SequenceLength")
        if on_path and rewriter.rewrite(node):
            continue
        graph.nodes.append(node)
    rewriter.remove_dead_sequence_nodes()
    return rewriter.changed


def why_not_lowered(node: Node, graph: Graph) -> str:
    """Why `lower_for_gradient` left this node as it is (for the error its rule raises)."""
    if node.op_type in RECURRENT:
        return _recurrent_refusal(node, graph) or "it was not on the path of the gradient when it was unrolled"
    if node.op_type in SEQUENCE_OPS:
        return ("sequence values are differentiated only in chains that can be rewritten to tensor ops: "
                "SplitToSequence with a static size along the axis and a constant split, SequenceAt and "
                "SequenceInsert/SequenceErase with constant positions, sequences built by SequenceConstruct, "
                "SequenceEmpty or SplitToSequence, and no Loop or graph output in between")
    return f"{node.op_type} is not differentiable"


class _Rewriter:
    def __init__(self, graph: Graph, names: Names):
        self.graph = graph
        self.names = names
        self.changed = False
        self.elements: dict[int, list[Value]] = {}  # sequence value id -> its tensors, where they are known
        self.emitted: list[Node] = []

    def rewrite(self, node: Node) -> bool:
        """Replace the node (True), or leave it in place, possibly given a Dropout mask output (False)."""
        if node.op_type in RECURRENT:
            if _recurrent_refusal(node, self.graph) is not None:
                return False
            _RecurrentUnroller(self, node).run()
        elif node.op_type in SEQUENCE_OPS:
            return self.rewrite_sequence(node)  # sets `changed` itself: producers only record their tensors
        elif node.op_type == "Dropout":
            self.add_dropout_mask(node)
            return False  # the node stays, with a mask output
        else:
            return False
        self.changed = True
        return True

    # -- building ---------------------------------------------------------------------------------------------
    def builder(self, node: Node) -> Builder:
        b = Builder(self.graph, self.names, prefix=f"{node.name or node.op_type}_unrolled")
        b.emitted = self.emitted  # one list, to find unused emitted nodes at the end
        return b

    def produce(self, op_type: str, inputs: list[Value | None], out: Value, **attrs) -> None:
        """A node whose output is an existing value (an output of the node being replaced)."""
        name = self.names.fresh(f"{out.name}_unrolled/{op_type}")
        attributes = [onnx.helper.make_attribute(k, v) for k, v in sorted(attrs.items())]
        self.graph.add_node(Node(op_type, inputs, [out], name, attributes))

    # -- sequences --------------------------------------------------------------------------------------------
    def rewrite_sequence(self, node: Node) -> bool:
        """Track the list of tensors each sequence holds; replace the consumers whose list is known (True)."""
        op_type, ins = node.op_type, node.inputs
        known = self.elements.get(id(ins[0])) if ins and ins[0] is not None else None
        out = node.outputs[0]
        if op_type == "SequenceConstruct":
            self.elements[id(out)] = list(ins)
        elif op_type == "SequenceEmpty":
            self.elements[id(out)] = []
        elif op_type == "SplitToSequence":
            pieces = self.split_to_sequence(node)
            if pieces is not None:
                self.elements[id(out)] = pieces
        elif op_type in ("SequenceInsert", "SequenceErase") and known is not None:
            inserting = op_type == "SequenceInsert"
            n, last = len(known), len(known) if inserting else len(known) - 1  # last valid position
            given = node.input(2 if inserting else 1)
            position = last if given is None else _constant_int(self.graph, given)
            if position is not None and position < 0:
                position += n
            if position is not None and 0 <= position <= last:
                items = list(known)
                if inserting:
                    items.insert(position, node.input(1))
                else:
                    del items[position]
                self.elements[id(out)] = items
        elif op_type == "SequenceAt" and known is not None:
            position = _constant_int(self.graph, node.input(1))
            if position is None or not -len(known) <= position < len(known):
                return False
            item = known[position]
            node.detach()
            self.produce("Identity", [item], out)
            _fill_type(out, item.elem_type, item.shape)
            self.changed = True
            return True
        elif op_type == "SequenceLength" and known is not None:
            node.detach()
            self.produce("Constant", [], out, value=numpy_helper.from_array(np.array(len(known), np.int64), ""))
            self.changed = True
            return True
        elif op_type == "ConcatFromSequence" and known:
            self.concat_from_sequence(node, known)
            self.changed = True
            return True
        return False  # a producer stays until `remove_dead_sequence_nodes` finds it unused

    def split_to_sequence(self, node: Node) -> list[Value] | None:
        x, split = node.input(0), node.input(1)
        rank = x.rank
        if rank is None:
            return None
        axis = node.attr("axis", 0)
        axis = axis + rank if axis < 0 else axis
        d = x.shape[axis]
        if not isinstance(d, int) or d == 0:
            return None
        squeeze = False
        if split is None:
            sizes, squeeze = [1] * d, node.attr("keepdims", 1) == 0
        else:
            value = _constant_array(self.graph, split)
            if value is None:
                return None
            if value.ndim == 0:
                step = int(value)
                sizes = [step] * (d // step) + ([d % step] if d % step else [])
            else:
                sizes = [int(s) for s in value.reshape(-1)]
            if sum(sizes) != d or any(s < 0 for s in sizes):
                return None
        op = self.builder(node)
        parts = op.Split(x, op.ints(sizes), axis=axis, outputs=len(sizes))
        parts = [parts] if len(sizes) == 1 else list(parts)
        for p, s in zip(parts, sizes):
            p.elem_type, p.shape = x.elem_type, _with(x.shape, axis, s)
        if squeeze:
            squeezed = []
            for p in parts:
                q = op.Squeeze(p, op.ints([axis]))
                q.elem_type, q.shape = x.elem_type, x.shape[:axis] + x.shape[axis + 1:]
                squeezed.append(q)
            parts = squeezed
        self.changed = True
        return parts

    def concat_from_sequence(self, node: Node, items: list[Value]) -> None:
        out = node.outputs[0]
        rank = items[0].rank
        axis = node.attr("axis")
        new_axis = node.attr("new_axis", 0)
        node.detach()
        if new_axis:  # stack: each tensor gets the new axis, then they are concatenated along it
            op = self.builder(node)
            out_rank = (rank or 0) + 1
            axis = axis + out_rank if axis < 0 else axis
            stacked = []
            for v in items:
                u = op.Unsqueeze(v, op.ints([axis]))
                u.elem_type = v.elem_type
                u.shape = None if v.shape is None else v.shape[:axis] + (1,) + v.shape[axis:]
                stacked.append(u)
            items = stacked
        self.produce("Concat", items, out, axis=axis)
        shapes = [v.shape for v in items]
        shape = None
        if axis >= 0 and all(sh is not None and len(sh) == len(shapes[0]) > axis for sh in shapes):
            sizes = [sh[axis] for sh in shapes]
            total = sum(sizes) if all(isinstance(d, int) for d in sizes) else None
            shape = shapes[0][:axis] + (total,) + shapes[0][axis + 1:]
        _fill_type(out, items[0].elem_type, shape)

    def remove_dead_sequence_nodes(self) -> None:
        """Sequence producers whose consumers were all replaced, and emitted nodes nothing reads, go."""
        outputs = {id(v) for v in self.graph.outputs}
        removable = {id(n) for n in self.emitted}
        removable |= {id(n) for n in self.graph.nodes if n.op_type in SEQUENCE_OPS}
        gone: list[Node] = []
        gone_ids: set[int] = set()
        for node in reversed(self.graph.nodes):
            if id(node) in removable and not any(id(o) in outputs or any(id(u) not in gone_ids for u, _ in o.uses)
                                                 for o in node.outputs):
                gone.append(node)
                gone_ids.add(id(node))
        if gone:
            self.graph.remove(gone)

    # -- Dropout ----------------------------------------------------------------------------------------------
    def add_dropout_mask(self, node: Node) -> None:
        training = node.input(2)
        known = _constant_array(self.graph, training)
        if training is None or (known is not None and not bool(known.reshape(-1)[0])):
            return  # inference form: Dropout is the identity
        if len(node.outputs) > 1 and node.outputs[1].name:
            return
        x = node.input(0)
        mask = Value(self.names.fresh(f"{node.outputs[0].name}_mask"), TensorProto.BOOL, x.shape)
        if len(node.outputs) > 1:
            node.outputs[1] = mask
        else:
            node.outputs.append(mask)
        mask.producer, mask.index = node, 1
        self.graph.values[mask.name] = mask
        self.changed = True


def _recurrent_refusal(node: Node, graph: Graph) -> str | None:
    """None when the recurrent node can be unrolled, else why not and what to do."""
    x = node.input(0)
    layout = node.attr("layout", 0)
    if x is None or x.shape is None or x.rank != 3:
        return f"the shape of X {getattr(x, 'name', '')!r} is unknown; bind the input shapes with --input-shape"
    if x.elem_type is None:
        return f"the element type of X {x.name!r} is unknown"
    seq = x.shape[1 if layout else 0]
    if not isinstance(seq, int):
        how = f"--dim {seq}=N" if isinstance(seq, str) else "--input-shape"
        return (f"the sequence length of X {x.name!r} is not static ({seq!r}), and recurrent ops are unrolled "
                f"over the time steps to be differentiated; bind it with {how} (or --input-shape)")
    lens = node.input(4)
    if lens is not None:
        value = _constant_array(graph, lens)
        if value is None:
            return (f"sequence_lens {lens.name!r} is not a constant; only full-length sequences are supported "
                    f"(remove sequence_lens, or make it a constant of {seq}s)")
        if np.any(value != seq):
            return (f"sequence_lens holds lengths other than the sequence length {seq}; only full-length "
                    f"sequences are supported (pad-free batches)")
    if node.attr("hidden_size") is None and _hidden_from_w(node) is None:
        return "hidden_size is absent and the shape of W does not give it; set the hidden_size attribute"
    if node.attr("direction", b"forward") not in (b"forward", b"reverse", b"bidirectional"):
        return f"direction {node.attr('direction')!r} is not forward, reverse or bidirectional"
    try:
        _activations(node)
    except ValueError as e:
        return str(e)
    return None


def _hidden_from_w(node: Node) -> int | None:
    w = node.input(1)
    rows = w.shape[1] if w is not None and w.rank == 3 else None
    return rows // GATES[node.op_type] if isinstance(rows, int) and rows % GATES[node.op_type] == 0 else None


def _activations(node: Node) -> list[Callable]:
    """One function per activation slot (f, g, h per direction), each building its op(s) with a builder."""
    defaults = RECURRENT[node.op_type]
    directions = 2 if node.attr("direction", b"forward") == b"bidirectional" else 1
    names = [a.decode() if isinstance(a, bytes) else a for a in node.attr("activations", [])]
    if not names:
        names = list(defaults) * directions
    if len(names) != len(defaults) * directions:
        raise ValueError(f"activations lists {len(names)} functions; {node.op_type} needs {len(defaults)} per "
                         f"direction ({len(defaults) * directions} in all)")
    alphas = list(node.attr("activation_alpha", []))
    betas = list(node.attr("activation_beta", []))
    by_lower = {k.lower(): k for k in ACTIVATIONS}
    funcs = []
    for name in names:
        canonical = by_lower.get(name.lower())
        if canonical is None:
            raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        default_alpha, default_beta = ACTIVATIONS[canonical]
        # alpha and beta values are consumed in order by the functions that take them
        alpha = (alphas.pop(0) if alphas else default_alpha) if default_alpha is not None else None
        beta = (betas.pop(0) if betas else default_beta) if default_beta is not None else None
        funcs.append(_activation(canonical, alpha, beta))
    return funcs


def _activation(name: str, alpha, beta) -> Callable:
    """apply(op, x, typed): the activation of x; `typed` gives each new value x's type and shape."""
    def apply(op: Builder, x: Value, typed: Callable[[Value], Value]) -> Value:
        if name == "Affine":
            return typed(op.Add(typed(op.Mul(x, _const_like(op, alpha, x))), _const_like(op, beta, x)))
        if name == "ScaledTanh":
            scaled = typed(op.Tanh(typed(op.Mul(x, _const_like(op, beta, x)))))
            return typed(op.Mul(scaled, _const_like(op, alpha, x)))
        attrs = {}
        if alpha is not None:
            attrs["alpha"] = float(alpha)
        if beta is not None:
            attrs["beta"] = float(beta)
        return typed(op.node(name, [x], **attrs))
    return apply


def _const_like(op: Builder, value: float, like: Value) -> Value:
    """A constant of like's element type, as a rule's `ctx.const_like` gives (the rewrite has no rule context)."""
    return op.const(np.asarray(value), like.elem_type)


class _RecurrentUnroller:
    """One LSTM, GRU or RNN node as plain ops: see the ONNX operator definitions for the equations."""

    def __init__(self, rewriter: _Rewriter, node: Node):
        self.rw, self.node = rewriter, node
        self.kind = node.op_type
        self.x = node.input(0)
        self.layout = node.attr("layout", 0)
        self.elem_type = self.x.elem_type
        self.gates = GATES[self.kind]
        self.hidden = node.attr("hidden_size") or _hidden_from_w(node)
        direction = node.attr("direction", b"forward")
        self.directions = [False, True] if direction == b"bidirectional" else [direction == b"reverse"]
        self.seq = self.x.shape[1 if self.layout else 0]
        self.batch = self.x.shape[0 if self.layout else 1]
        self.clip = node.attr("clip")
        self.funcs = _activations(node)
        self.op = rewriter.builder(node)

    def typed(self, v: Value, *shape: Dim) -> Value:
        v.elem_type, v.shape = self.elem_type, tuple(shape)
        return v

    def per_direction(self, i: int, rank: int, state: bool = False) -> list[Value | None]:
        """Input i split into its per-direction slices (direction axis removed), or Nones when absent.
        A `state` (initial_h, initial_c) is batch-major in layout 1 and is brought to (directions, batch, H)."""
        v = self.node.input(i)
        if v is None:
            return [None] * len(self.directions)
        op = self.op
        shape = v.shape if v.shape is not None else (None,) * rank
        if state and self.layout:
            v = self.typed(op.Transpose(v, perm=[1, 0, 2]), shape[1], shape[0], shape[2])
            shape = v.shape
        rest = shape[1:]
        if len(self.directions) == 1:
            return [self.typed(op.Squeeze(v, op.ints([0])), *rest)]
        parts = op.Split(v, op.ints([1, 1]), axis=0, outputs=2)
        return [self.typed(op.Squeeze(self.typed(p, 1, *rest), op.ints([0])), *rest) for p in parts]

    def split(self, v: Value, sizes: list[int], axis: int) -> list[Value]:
        parts = self.op.Split(v, self.op.ints(sizes), axis=axis, outputs=len(sizes))
        parts = [parts] if len(sizes) == 1 else list(parts)
        return [self.typed(p, *_with(v.shape, axis, s)) for p, s in zip(parts, sizes)]

    def activation(self, k: int, x: Value, clip: bool = True) -> Value:
        """Activation slot k, with the cell clip applied to a gate's input. onnxruntime clips the gates'
        inputs only, not the cell state that LSTM's h() reads, and its LSTM is the reference followed here."""
        op, shape = self.op, x.shape
        if self.clip is not None and clip:
            x = self.typed(op.Clip(x, _const_like(op, -self.clip, x), _const_like(op, self.clip, x)), *shape)
        return self.funcs[k](op, x, lambda v: self.typed(v, *shape))

    def binary(self, op_type: str, a: Value, b: Value) -> Value:
        return self.typed(self.op.node(op_type, [a, b]), self.batch, self.hidden)

    def run(self) -> None:
        node, op, x = self.node, self.op, self.x
        if self.layout:
            x = self.typed(op.Transpose(x, perm=[1, 0, 2]), self.seq, self.batch, x.shape[2])
        ws, rs, bs = self.per_direction(1, 3), self.per_direction(2, 3), self.per_direction(3, 2)
        h0s = self.per_direction(5, 3, state=True)
        none = [None] * len(self.directions)
        c0s = self.per_direction(6, 3, state=True) if self.kind == "LSTM" else none
        ps = self.per_direction(7, 2) if self.kind == "LSTM" else none
        ys, hs, cs = [], [], []
        for d, backward in enumerate(self.directions):
            self.slot = d * len(RECURRENT[self.kind])  # the first of this direction's activation functions
            steps_h, h_last, c_last = self.direction(x, ws[d], rs[d], bs[d], h0s[d], c0s[d], ps[d], backward)
            ys.append(steps_h)
            hs.append(h_last)
            cs.append(c_last)
        node.detach()
        self.emit_outputs(ys, hs, cs)

    def direction(self, x, w, r, b, h, c, p, backward):
        """Unroll one direction; returns (the per-time-step Ht in time order, the last Ht, the last Ct)."""
        op, H, S, B, G = self.op, self.hidden, self.seq, self.batch, self.gates
        wt = self.typed(op.Transpose(w, perm=[1, 0]), x.shape[2], G * H)
        rt = self.typed(op.Transpose(r, perm=[1, 0]), H, G * H)
        xw = self.typed(op.MatMul(x, wt), S, B, G * H)  # every time step's input projection at once
        if self.kind == "GRU":
            return self.gru(xw, rt, b, h, backward)
        if b is not None:
            wb, rb = self.split(b, [G * H, G * H], 0)
            xw = self.typed(op.Add(xw, self.typed(op.Add(wb, rb), G * H)), S, B, G * H)
        steps = self.time_steps(xw)
        out = [None] * S
        for t in (range(S - 1, -1, -1) if backward else range(S)):
            gates = steps[t] if h is None else self.typed(
                op.Add(steps[t], self.typed(op.MatMul(h, rt), B, G * H)), B, G * H)
            if self.kind == "RNN":
                h = self.activation(self.slot, gates)
            else:
                h, c = self.lstm_step(gates, c, p)
            out[t] = h
        return out, h, c

    def time_steps(self, v: Value) -> list[Value]:
        """(S, B, n) -> S tensors of (B, n)."""
        op = self.op
        parts = self.split(v, [1] * self.seq, 0)
        return [self.typed(op.Squeeze(s, op.ints([0])), *v.shape[1:]) for s in parts]

    def lstm_step(self, gates, c, p):
        """it, ot, ft, ct = gates (iofc order); Ct = ft*C + it*ct; Ht = ot * h(Ct), with optional peepholes."""
        H = self.hidden
        gi, go, gf, gc = self.split(gates, [H] * 4, 1)
        pi = po = pf = None
        if p is not None:
            pi, po, pf = self.split(p, [H] * 3, 0)
        if pi is not None and c is not None:
            gi = self.binary("Add", gi, self.binary("Mul", c, pi))
        i = self.activation(self.slot, gi)
        if self.node.attr("input_forget", 0):  # coupled gates: ft = 1 - it
            f = self.typed(self.op.Sub(_const_like(self.op, 1.0, self.x), i), self.batch, H)
        else:
            if pf is not None and c is not None:
                gf = self.binary("Add", gf, self.binary("Mul", c, pf))
            f = self.activation(self.slot, gf)
        candidate = self.activation(self.slot + 1, gc)
        new_c = self.binary("Mul", i, candidate)
        if c is not None:
            new_c = self.binary("Add", self.binary("Mul", f, c), new_c)
        if po is not None:
            go = self.binary("Add", go, self.binary("Mul", new_c, po))
        o = self.activation(self.slot, go)
        new_h = self.binary("Mul", o, self.activation(self.slot + 2, new_c, clip=False))
        return new_h, new_c

    def gru(self, xw, rt, b, h, backward):
        """zt, rt, ht gates (zrh order); Ht = ht + zt * (H - ht), i.e. (1 - zt) * ht + zt * H."""
        op, H, S, B = self.op, self.hidden, self.seq, self.batch
        xz, xr, xh = self.split(xw, [H] * 3, 2)
        rt_zr, rt_h = self.split(rt, [2 * H, H], 1)
        linear_before_reset = self.node.attr("linear_before_reset", 0)
        rbh = None
        if b is not None:
            wbz, wbr, wbh, rbz, rbr, rbh = self.split(b, [H] * 6, 0)
            xz = self.typed(op.Add(xz, self.typed(op.Add(wbz, rbz), H)), S, B, H)
            xr = self.typed(op.Add(xr, self.typed(op.Add(wbr, rbr), H)), S, B, H)
            if linear_before_reset:
                xh = self.typed(op.Add(xh, wbh), S, B, H)
            else:
                xh = self.typed(op.Add(xh, self.typed(op.Add(wbh, rbh), H)), S, B, H)
                rbh = None
        zs, rs, hs = self.time_steps(xz), self.time_steps(xr), self.time_steps(xh)
        out = [None] * S
        for t in (range(S - 1, -1, -1) if backward else range(S)):
            gz, gr, gh = zs[t], rs[t], hs[t]
            if h is not None:
                rec_z, rec_r = self.split(self.typed(op.MatMul(h, rt_zr), B, 2 * H), [H, H], 1)
                gz, gr = self.binary("Add", gz, rec_z), self.binary("Add", gr, rec_r)
            z = self.activation(self.slot, gz)
            r = self.activation(self.slot, gr)
            if linear_before_reset:
                rec_h = None if h is None else self.typed(op.MatMul(h, rt_h), B, H)
                if rbh is not None:
                    rec_h = self.typed(op.Add(rbh, rec_h), B, H) if rec_h is not None else rbh
                if rec_h is not None:
                    gh = self.binary("Add", gh, self.binary("Mul", r, rec_h))
            elif h is not None:
                gh = self.binary("Add", gh, self.typed(op.MatMul(self.binary("Mul", r, h), rt_h), B, H))
            candidate = self.activation(self.slot + 1, gh)
            if h is None:
                h = self.binary("Sub", candidate, self.binary("Mul", z, candidate))
            else:
                h = self.binary("Add", candidate, self.binary("Mul", z, self.binary("Sub", h, candidate)))
            out[t] = h
        return out, h, None

    def emit_outputs(self, ys, hs, cs) -> None:
        """Y (S, D, B, H) [layout 1: (B, S, D, H)], Y_h and Y_c (D, B, H) [layout 1: (B, D, H)]."""
        op, H, S, B, D = self.op, self.hidden, self.seq, self.batch, len(self.directions)
        outs = self.node.outputs
        named = [outs[k] if k < len(outs) and outs[k].name else None for k in range(3)]
        if named[0] is not None:
            per_dir = []
            for steps in ys:
                lifted = [self.typed(op.Unsqueeze(h, op.ints([0, 1])), 1, 1, B, H) for h in steps]
                per_dir.append(self.typed(op.Concat(*lifted, axis=0), S, 1, B, H) if S > 1 else lifted[0])
            self.finish(named[0], per_dir, 1, [2, 0, 1, 3], (S, D, B, H))
        for out, lasts in ((named[1], hs), (named[2], cs)):
            if out is not None:
                lifted = [self.typed(op.Unsqueeze(v, op.ints([0])), 1, B, H) for v in lasts]
                self.finish(out, lifted, 0, [1, 0, 2], (D, B, H))

    def finish(self, out: Value, parts: list[Value], axis: int, layout_perm: list[int], shape) -> None:
        """Concatenate the directions along `axis` into `out`, transposed to layout 1 where asked."""
        rw = self.rw
        if self.layout:
            whole = parts[0] if len(parts) == 1 else self.typed(self.op.Concat(*parts, axis=axis), *shape)
            rw.produce("Transpose", [whole], out, perm=layout_perm)
            _fill_type(out, self.elem_type, tuple(shape[k] for k in layout_perm))
        else:
            if len(parts) == 1:
                rw.produce("Identity", parts, out)
            else:
                rw.produce("Concat", parts, out, axis=axis)
            _fill_type(out, self.elem_type, tuple(shape))


def _with(shape: tuple[Dim, ...], axis: int, size: int) -> tuple[Dim, ...]:
    return shape[:axis] + (size,) + shape[axis + 1:]


def _fill_type(v: Value, elem_type: int | None, shape) -> None:
    v.elem_type = v.elem_type or elem_type
    if v.shape is None:
        v.shape = shape


def _constant_array(graph: Graph, v: Value | None) -> np.ndarray | None:
    if v is None:
        return None
    if v.name in graph.initializers:
        return numpy_helper.to_array(graph.initializers[v.name])
    p = v.producer
    if p is not None and p.op_type == "Constant":
        if p.has_attr("value"):
            return numpy_helper.to_array(p.attr("value"))
        for key in ("value_int", "value_ints"):
            if p.has_attr(key):
                return np.asarray(p.attr(key), dtype=np.int64)
    return None


def _constant_int(graph: Graph, v: Value | None) -> int | None:
    value = _constant_array(graph, v)
    return None if value is None or value.size != 1 else int(value.reshape(-1)[0])
