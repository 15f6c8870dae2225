"""Fuzzing: random forward graphs through build-grad and `check`, and mutated protobufs through the loader.

Graphs: hypothesis draws a DAG over ops that have gradient rules (element-wise and activations, MatMul, Gemm,
reductions, Softmax, LayerNormalization and the ops that move data) with random broadcast shapes, values read by
several nodes, branches the loss does not read and, sometimes, several non-scalar heads. For each graph,
build-grad either succeeds and every gradient agrees with finite differences on every element (onnxgrad.check
in float64; graphs with ops that onnxruntime cannot run in float64 go through the onnx reference evaluator), or
refuses with a documented error (UsageError, UnsupportedError, InvalidModelError). Anything else fails the test.

Protobufs: valid models with bits flipped, bytes overwritten, inserted or cut, fed to the loader and the whole
build: it must succeed or say what is wrong, never crash.

FUZZ_EXAMPLES sets the number of examples of each test (default 400, with the same examples on every run);
`make fuzz` runs 2,000 fresh ones and prints the counts (FUZZ_STATS=FILE.json also writes them).
"""
from __future__ import annotations

import collections
import json
import math
import os
import re
from dataclasses import dataclass

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun
from onnx.reference.ops._op import OpRunUnaryNum

import onnxgrad
from onnxgrad.check import check_training_graph
from onnxgrad.errors import InternalError, InvalidModelError, UnsupportedError, UsageError
from test_api import affine

FLOAT = TensorProto.FLOAT
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "400"))
settings.register_profile("onnxgrad-fuzz-ci", max_examples=EXAMPLES, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), database=None)
settings.register_profile("onnxgrad-fuzz", max_examples=EXAMPLES, deadline=None, derandomize=False,
                          suppress_health_check=list(HealthCheck))
PROFILE = settings.get_profile("onnxgrad-fuzz" if "FUZZ_EXAMPLES" in os.environ else "onnxgrad-fuzz-ci")
DOCUMENTED = (UsageError, UnsupportedError, InvalidModelError)
REFUSALS = (UsageError, UnsupportedError)  # a generated graph is valid, so InvalidModelError would be a bug


@pytest.fixture(scope="module")
def stats():
    """Outcome counts, printed at the end (pytest -s) and written to $FUZZ_STATS."""
    counts = collections.Counter()
    yield counts
    lines = [f"{n:6d}  {what}" for what, n in sorted(counts.items())]
    print("\nfuzz outcomes:\n" + "\n".join(lines))
    if os.environ.get("FUZZ_STATS"):
        with open(os.environ["FUZZ_STATS"], "w") as f:
            json.dump(dict(sorted(counts.items())), f, indent=2)


# -- float64 for ops that onnxruntime runs in float32 only ---------------------------------------------------
class Erf(OpRunUnaryNum):
    """The reference evaluator's Erf rounds to float32, which finite differences in float64 cannot use."""

    def _run(self, x):
        return (np.vectorize(math.erf, otypes=[np.float64])(x).astype(x.dtype),)


class Gelu(OpRun):
    """The reference evaluator expands Gelu into a function whose result is off by about 1e-3."""

    def _run(self, x, approximate="none"):
        if approximate == "tanh":
            return (0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),)
        erf = np.vectorize(math.erf, otypes=[np.float64])
        return ((0.5 * x * (1 + erf(x / np.sqrt(2)))).astype(x.dtype),)


class Softsign(OpRun):
    """The reference evaluator's Softsign fails on rank-0 tensors."""

    def _run(self, x):
        return (np.asarray(x / (1 + np.abs(x)), dtype=x.dtype),)


class Mean(OpRun):
    """The reference evaluator's Mean fails when the first input is the one that broadcasts."""

    def _run(self, *xs):
        return (np.mean(np.broadcast_arrays(*xs), axis=0).astype(xs[0].dtype),)


class Pad(OpRun):
    """The reference evaluator's Pad refuses negative pads (a crop), which Pad's gradient uses."""

    def _run(self, data, pads, constant_value=None, axes=None, mode="constant"):
        r = data.ndim
        axes = list(range(r)) if axes is None else [int(a) % r for a in axes]
        n = len(axes)
        crop, width = [slice(None)] * r, [(0, 0)] * r
        for i, ax in enumerate(axes):
            begin, end = int(pads[i]), int(pads[n + i])
            crop[ax] = slice(max(-begin, 0), data.shape[ax] - max(-end, 0))
            width[ax] = (max(begin, 0), max(end, 0))
        data = data[tuple(crop)]
        if mode == "constant":
            value = 0 if constant_value is None else constant_value
            return (np.pad(data, width, mode="constant", constant_values=value).astype(data.dtype),)
        return (np.pad(data, width, mode=mode).astype(data.dtype),)


def reference_runner(model: onnx.ModelProto):
    return ReferenceEvaluator(model, new_ops=[Erf, Gelu, Mean, Pad, Softsign]).run


# -- the random graph ------------------------------------------------------------------------------------------
@dataclass
class V:
    name: str
    shape: tuple
    mag: float          # a bound on |value|, to keep Exp, Pow and products finite
    lo: float | None    # a positive lower bound, when the value is known to be positive


class GraphDraw:
    """Builds one forward graph from hypothesis draws; every value's shape is tracked in Python."""

    def __init__(self, data, opset: int):
        self.data, self.opset = data, opset
        self.nodes, self.inits, self.inputs, self.values = [], {}, {}, []
        self.count = 0
        self.rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="values seed"))

    # names and constants
    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def ints(self, values) -> str:
        name = self.fresh("i")
        self.inits[name] = np.asarray(values, np.int64)
        return name

    def const(self, value) -> str:
        """A float Constant node (not an initializer, so not a parameter)."""
        name = self.fresh("k")
        self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
            np.asarray(value, np.float32))))
        return name

    def draw(self, strategy, label=None):
        return self.data.draw(strategy, label=label)

    def node(self, op: str, inputs: list[str], shape, mag: float, lo=None, operand: bool = True, **attrs) -> V:
        """Append a node; its output becomes an operand for later nodes unless `operand` is false."""
        out = V(self.fresh(op.lower()), tuple(int(d) for d in shape), mag, lo)
        self.nodes.append(helper.make_node(op, inputs, [out.name], name=out.name, **attrs))
        if operand:
            self.values.append(out)
        return out

    # leaves
    def leaf(self, shape, kind: str) -> V:
        name = self.fresh("p" if kind == "param" else "x")
        values = self.rng.uniform(0.5, 1.5, shape) * self.rng.choice([-1.0, 1.0], shape)
        if kind == "param":
            self.inits[name] = values.astype(np.float32)
        else:
            self.inputs[name] = tuple(shape)
        v = V(name, tuple(shape), 1.5, None)
        self.values.append(v)
        return v

    def pick(self, label="operand", where=lambda v: True) -> V | None:
        choices = [v for v in self.values if where(v)]
        if not choices:
            return None
        return choices[self.draw(st.integers(0, len(choices) - 1), label=label)]

    # helpers that make an operand fit
    def positive(self, v: V) -> V:
        """v when it is surely positive, else Sigmoid(v) + 0.5 (in (0.5, 1.5))."""
        if v.lo is not None and v.lo >= 0.05:
            return v
        s = self.node("Sigmoid", [v.name], v.shape, 1.0)
        return self.node("Add", [s.name, self.const(0.5)], v.shape, 1.5, lo=0.5)

    def bounded(self, v: V, limit: float = 3.0) -> V:
        return v if v.mag <= limit else self.node("Tanh", [v.name], v.shape, 1.0)

    def squash(self, v: V) -> V:
        """Large values go through Tanh, so that nothing overflows further down."""
        return self.node("Tanh", [v.name], v.shape, 1.0) if v.mag > 1e3 else v

    def broadcast_partner(self, shape) -> V:
        """An operand that broadcasts against `shape`: an existing value, or a new parameter (a suffix of the
        shape, some dims 1, or a shape that broadcasts the other way)."""
        fits = [v for v in self.values if _broadcastable(v.shape, shape)]
        if fits and self.draw(st.booleans(), label="reuse a value"):
            return fits[self.draw(st.integers(0, len(fits) - 1), label="partner")]
        r = self.draw(st.integers(0, len(shape)), label="partner rank")
        dims = [d if self.draw(st.booleans(), label="keep dim") else 1 for d in shape[len(shape) - r:]]
        if self.draw(st.integers(0, 4), label="grow") == 0:  # the other operand broadcasts up to this one
            dims = [self.draw(st.integers(1, 3)) if d == 1 == full else d
                    for d, full in zip(dims, shape[len(shape) - r:])]
            if r == len(shape) and self.draw(st.booleans(), label="new leading axis"):
                dims = [self.draw(st.integers(1, 2))] + dims
        return self.leaf(tuple(dims), "param")

    # the ops ------------------------------------------------------------------------------------------------
    def unary(self, x: V) -> V:
        ops = ["Neg", "Abs", "Relu", "Tanh", "Sigmoid", "Sin", "Cos", "Softsign", "Softplus", "Elu", "Selu",
               "Celu", "LeakyRelu", "HardSigmoid", "ThresholdedRelu", "Identity", "Erf", "Exp", "Log", "Sqrt",
               "Reciprocal", "Clip", "Cast"]
        ops += ["HardSwish"] if self.opset >= 14 else []
        ops += ["Mish"] if self.opset >= 18 else []
        ops += ["Gelu"] if self.opset >= 20 else []
        op = self.draw(st.sampled_from(ops), label="unary op")
        s, m = x.shape, x.mag
        if op in ("Tanh", "Sigmoid", "Sin", "Cos", "Softsign", "Erf"):
            return self.node(op, [x.name], s, 1.0, lo=None)
        if op in ("Neg", "Identity"):
            return self.node(op, [x.name], s, m, lo=x.lo if op == "Identity" else None)
        if op in ("Abs", "Relu"):
            return self.node(op, [x.name], s, m, lo=x.lo)
        if op == "Softplus":
            return self.node(op, [x.name], s, m + 1.0)
        if op == "Elu":
            return self.node(op, [x.name], s, m + 1.0, alpha=self.draw(st.sampled_from([1.0, 0.5])))
        if op == "Selu":
            return self.node(op, [x.name], s, 1.06 * m + 1.76)
        if op == "Celu":
            return self.node(op, [x.name], s, m + 1.0, alpha=self.draw(st.sampled_from([1.0, 2.0])))
        if op == "LeakyRelu":
            return self.node(op, [x.name], s, m, alpha=self.draw(st.sampled_from([0.01, 0.3])))
        if op == "HardSigmoid":
            return self.node(op, [x.name], s, 1.0, alpha=0.3, beta=0.6)
        if op == "ThresholdedRelu":  # the jump at alpha: values are drawn away from it
            return self.node(op, [x.name], s, m, alpha=self.draw(st.sampled_from([0.1, 0.25])))
        if op == "HardSwish":
            return self.node(op, [x.name], s, m + 1.0)
        if op in ("Mish", "Gelu"):
            return self.node(op, [x.name], s, m + 1.0)
        if op == "Exp":
            b = self.bounded(x)
            return self.node(op, [b.name], s, math.exp(b.mag), lo=math.exp(-b.mag))
        if op in ("Log", "Sqrt", "Reciprocal"):
            p = self.positive(x)
            if op == "Log":
                return self.node(op, [p.name], s, max(abs(math.log(p.lo)), math.log(max(p.mag, 1.0))))
            if op == "Sqrt":
                return self.node(op, [p.name], s, math.sqrt(p.mag), lo=math.sqrt(p.lo))
            return self.node(op, [p.name], s, 1.0 / p.lo, lo=1.0 / p.mag)
        if op == "Clip":
            bounds = self.draw(st.sampled_from(["both", "min", "none"]), label="clip bounds")
            ins = [x.name] + ([self.const(-0.25), self.const(0.75)] if bounds == "both" else
                              [self.const(0.25)] if bounds == "min" else [])
            return self.node(op, ins, s, m)
        # Cast to double and back: both become double in the float64 check
        d = self.node("Cast", [x.name], s, m, lo=x.lo, operand=False, to=TensorProto.DOUBLE)
        return self.node("Cast", [d.name], s, m, lo=x.lo, to=FLOAT)

    def binary(self, a: V) -> V:
        op = self.draw(st.sampled_from(["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "PRelu", "Where",
                                        "Sum", "Mean"]), label="binary op")
        if op == "PRelu":  # the slope broadcasts to x, not the other way
            dims = tuple(d if self.draw(st.booleans()) else 1 for d in a.shape[len(a.shape) - self.draw(
                st.integers(0, len(a.shape))):])
            slope = self.leaf(dims, "param")
            return self.node(op, [a.name, slope.name], a.shape, a.mag * 1.5)
        b = self.broadcast_partner(a.shape)
        shape = np.broadcast_shapes(a.shape, b.shape)
        if self.draw(st.booleans(), label="swap"):
            a, b = b, a
        if op in ("Add", "Sub"):
            lo = a.lo + b.lo if op == "Add" and a.lo and b.lo else None
            return self.node(op, [a.name, b.name], shape, a.mag + b.mag, lo=lo)
        if op == "Mul":
            lo = a.lo * b.lo if a.lo and b.lo else None
            return self.squash(self.node(op, [a.name, b.name], shape, a.mag * b.mag, lo=lo))
        if op == "Div":
            d = self.positive(b)
            return self.squash(self.node(op, [a.name, d.name], shape, a.mag / d.lo))
        if op == "Pow":
            base, ex = self.positive(a), self.bounded(b, 2.0)
            mag = max(base.mag, 1 / base.lo) ** ex.mag
            return self.squash(self.node(op, [base.name, ex.name], shape, mag, lo=1 / mag))
        if op in ("Max", "Min"):
            if self.draw(st.integers(0, 3), label="tie") == 0:  # exact ties: the gradient is shared
                return self.node(op, [a.name, a.name], a.shape, a.mag)
            return self.node(op, [a.name, b.name], shape, max(a.mag, b.mag))
        if op in ("Sum", "Mean"):
            c = self.broadcast_partner(tuple(shape))
            shape = np.broadcast_shapes(shape, c.shape)
            mag = a.mag + b.mag + c.mag
            return self.node(op, [a.name, b.name, c.name], shape, mag if op == "Sum" else mag / 3)
        # Where: a condition that no gradient crosses, from a comparison of values or a constant mask
        if self.draw(st.booleans(), label="computed condition"):
            c1 = self.pick("condition operand", lambda v: _broadcastable(v.shape, shape))
            both = np.broadcast_shapes(c1.shape, shape)
            c2 = self.pick("condition operand", lambda v: _broadcastable(v.shape, both))
            cond = self.fresh("cond")
            self.nodes.append(helper.make_node("Greater", [c1.name, c2.name], [cond]))
            cshape = np.broadcast_shapes(c1.shape, c2.shape)
        else:
            cshape = tuple(self.draw(st.sampled_from([1, d])) for d in shape)
            cond = self.fresh("mask")
            self.inits[cond] = self.rng.random(cshape) < 0.5
        return self.node("Where", [cond, a.name, b.name], np.broadcast_shapes(cshape, shape), max(a.mag, b.mag))

    def matmul(self, a: V) -> V:
        if not a.shape:
            a = self.node("Unsqueeze", [a.name, self.ints([0])], (1,), a.mag, lo=a.lo)
        k = a.shape[-1]
        n = self.draw(st.integers(1, 3), label="columns")
        form = self.draw(st.sampled_from(["matrix", "vector", "batched", "left"]), label="matmul form")
        if form == "matrix":
            b = self.leaf((k, n), "param")
            return self.squash(self.node("MatMul", [a.name, b.name], a.shape[:-1] + (n,), a.mag * 1.5 * k))
        if form == "vector":
            b = self.leaf((k,), "param")
            return self.squash(self.node("MatMul", [a.name, b.name], a.shape[:-1], a.mag * 1.5 * k))
        if form == "batched":  # b has batch axes that broadcast against a's
            a_batch = a.shape[:-2]
            r = self.draw(st.integers(0, len(a_batch)), label="batch rank")
            batch = tuple(d if self.draw(st.booleans(), label="keep batch dim") else 1
                          for d in a_batch[len(a_batch) - r:])
            if r == len(a_batch) and (not batch or self.draw(st.booleans(), label="new batch axis")):
                batch = (self.draw(st.integers(1, 2)),) + batch
            b = self.leaf(batch + (k, n), "param")
            rows = a.shape[-2:-1] if len(a.shape) >= 2 else ()
            shape = np.broadcast_shapes(a_batch, batch) + rows + (n,)
            return self.squash(self.node("MatMul", [a.name, b.name], shape, a.mag * 1.5 * k))
        # a on the right: b @ a with a's second-to-last dim (or a 1-D a) contracting
        m = self.draw(st.integers(1, 3), label="rows")
        kk = a.shape[-2] if len(a.shape) >= 2 else a.shape[0]
        b = self.leaf((m, kk), "param")
        shape = a.shape[:-2] + (m, a.shape[-1]) if len(a.shape) >= 2 else (m,)
        return self.squash(self.node("MatMul", [b.name, a.name], shape, a.mag * 1.5 * kk))

    def gemm(self, a: V) -> V:
        if len(a.shape) != 2:
            a = self.node("Reshape", [a.name, self.ints([1, -1])], (1, int(np.prod(a.shape))), a.mag, lo=a.lo)
        trans_a, trans_b = self.draw(st.booleans(), label="transA"), self.draw(st.booleans(), label="transB")
        m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
        n = self.draw(st.integers(1, 3), label="gemm n")
        b = self.leaf((n, k) if trans_b else (k, n), "param")
        ins = [a.name, b.name]
        if self.draw(st.booleans(), label="with C"):
            ins.append(self.leaf(self.draw(st.sampled_from([(m, n), (n,), (1, n), (m, 1), ()])), "param").name)
        alpha, beta = self.draw(st.sampled_from([(1.0, 1.0), (0.5, 2.0)]), label="alpha, beta")
        return self.squash(self.node("Gemm", ins, (m, n), a.mag * 1.5 * k * alpha + 3, transA=int(trans_a),
                                     transB=int(trans_b), alpha=alpha, beta=beta))

    def reduce(self, a: V) -> V:
        if not a.shape:
            return self.unary(a)
        op = self.draw(st.sampled_from(["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd",
                                        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                                        "ReduceSumSquare"]), label="reduce op")
        r = len(a.shape)
        if op in ("ReduceMax", "ReduceMin") and self.draw(st.integers(0, 2), label="tie") == 0:
            # copies along an axis make exact ties for the reduction
            reps = [1] * r
            reps[self.draw(st.integers(0, r - 1), label="copied axis")] = 2
            a = self.node("Tile", [a.name, self.ints(reps)], tuple(d * k for d, k in zip(a.shape, reps)), a.mag, a.lo)
        axes = sorted(set(self.draw(st.lists(st.integers(0, r - 1), max_size=r), label="axes")))
        keep = self.draw(st.booleans(), label="keepdims")
        signed = [ax - r if self.draw(st.booleans(), label="negative axis") else ax for ax in axes]
        reduced = axes or list(range(r))
        n = int(np.prod([a.shape[ax] for ax in reduced]))
        shape = tuple(1 if i in reduced else d for i, d in enumerate(a.shape) if keep or i not in reduced)
        if op in ("ReduceLogSum",):
            a = self.positive(a)
        if op == "ReduceL2":  # away from 0, where its derivative is undefined
            a = self.positive(a)
        mag = {"ReduceSum": n * a.mag, "ReduceMean": a.mag, "ReduceMax": a.mag, "ReduceMin": a.mag,
               "ReduceProd": a.mag ** n, "ReduceL1": n * a.mag, "ReduceL2": math.sqrt(n) * a.mag,
               "ReduceLogSum": abs(math.log(a.lo or 1.0)) + math.log(n * max(a.mag, 1.0)),
               "ReduceLogSumExp": a.mag + math.log(n), "ReduceSumSquare": n * a.mag ** 2}[op]
        if op == "ReduceProd" and n > 6:
            a = self.bounded(a, 1.0)
        attrs = {"keepdims": int(keep)}
        ins = [a.name]
        if axes:
            if self.opset >= 18 or op == "ReduceSum":
                ins.append(self.ints(signed))
            else:
                attrs["axes"] = signed
        return self.squash(self.node(op, ins, shape, mag, **attrs))

    def softmax(self, a: V) -> V:
        if not a.shape:
            return self.unary(a)
        op = self.draw(st.sampled_from(["Softmax", "LogSoftmax"]), label="softmax op")
        r = len(a.shape)
        axis = self.draw(st.integers(-r, r - 1), label="softmax axis")
        if op == "Softmax":
            return self.node(op, [a.name], a.shape, 1.0, axis=axis)
        return self.node(op, [a.name], a.shape, 2 * a.mag + math.log(a.shape[axis]) + 1, axis=axis)

    def layer_norm(self, a: V) -> V:
        if not a.shape or self.opset < 17:
            return self.unary(a)
        r = len(a.shape)
        axis = self.draw(st.integers(-r, r - 1), label="norm axis")
        norm_shape = a.shape[axis:]
        if int(np.prod(norm_shape)) < 2:
            return self.unary(a)
        scale = self.leaf(norm_shape, "param")
        ins = [a.name, scale.name] + ([self.leaf(norm_shape, "param").name] if self.draw(st.booleans()) else [])
        return self.node("LayerNormalization", ins, a.shape, 1.5 * math.sqrt(np.prod(norm_shape)) + 1.5, axis=axis,
                         epsilon=1e-3)

    def move(self, a: V) -> V:
        """The ops that move data: Transpose, Reshape, Flatten, (Un)squeeze, Concat, Split, Slice, Expand,
        Tile, Pad, Gather, Trilu."""
        ops = ["Transpose", "Reshape", "Flatten", "Unsqueeze", "Squeeze", "Concat", "Split", "Slice", "Expand",
               "Tile", "Pad", "Gather"] + (["Trilu"] if self.opset >= 14 else [])
        op = self.draw(st.sampled_from(ops), label="data op")
        s, r, m, lo = a.shape, len(a.shape), a.mag, a.lo
        probe = np.empty(s)
        if op == "Transpose":
            perm = self.draw(st.permutations(range(r)), label="perm")
            if r and self.draw(st.booleans(), label="default perm"):  # absent: the axes reversed
                return self.node(op, [a.name], s[::-1], m, lo)
            return self.node(op, [a.name], tuple(s[p] for p in perm), m, lo, **({"perm": list(perm)} if r else {}))
        if op == "Reshape":
            n = int(np.prod(s))
            target = _factor(n, self.draw(st.integers(0, 3), label="target rank"), self.draw)
            spec = list(target)
            if spec and self.draw(st.booleans(), label="use -1"):
                spec[self.draw(st.integers(0, len(spec) - 1))] = -1
            return self.node(op, [a.name, self.ints(spec)], target, m, lo)
        if op == "Flatten":
            axis = self.draw(st.integers(-r, r), label="flatten axis") if r else 0
            k = axis + r if axis < 0 else axis
            return self.node(op, [a.name], (int(np.prod(s[:k])), int(np.prod(s[k:]))), m, lo, axis=axis)
        if op == "Unsqueeze":
            pos = self.draw(st.integers(0, r), label="unsqueeze at")
            axis = pos - (r + 1) if self.draw(st.booleans()) else pos
            return self.node(op, [a.name, self.ints([axis])], s[:pos] + (1,) + s[pos:], m, lo)
        if op == "Squeeze":
            ones = [i for i, d in enumerate(s) if d == 1]
            if not ones:
                return self.node("Unsqueeze", [a.name, self.ints([r])], s + (1,), m, lo)
            axis = self.draw(st.sampled_from(ones), label="squeeze axis")
            return self.node(op, [a.name, self.ints([axis - r])], s[:axis] + s[axis + 1:], m, lo)
        if op in ("Concat", "Split", "Slice", "Gather", "Trilu", "Pad") and r == 0:
            a = self.node("Unsqueeze", [a.name, self.ints([0])], (1,), m, lo)
            s, r, probe = a.shape, 1, np.empty((1,))
        if op == "Concat":
            axis = self.draw(st.integers(-r, r - 1), label="concat axis")
            same = [v for v in self.values if len(v.shape) == r and all(
                v.shape[i] == s[i] for i in range(r) if i != axis % r)]
            others = [same[self.draw(st.integers(0, len(same) - 1), label="concat part")] for _ in range(
                self.draw(st.integers(1, 2), label="parts"))]
            parts = [a] + others
            shape = list(s)
            shape[axis] = sum(p.shape[axis] for p in parts)
            return self.node(op, [p.name for p in parts], shape, max(p.mag for p in parts), axis=axis)
        if op == "Split":
            axes = [i for i, d in enumerate(s) if d >= 2]
            if not axes:
                return self.node("Identity", [a.name], s, m, lo)
            axis = self.draw(st.sampled_from(axes), label="split axis")
            d = s[axis]
            cut = self.draw(st.integers(1, d - 1), label="split at")
            sizes = [cut, d - cut]
            outs = [self.fresh("split"), self.fresh("split")]
            form = self.draw(st.sampled_from(["sizes", "equal"]), label="split form") if d % 2 == 0 else "sizes"
            attrs = {"axis": axis - r if self.draw(st.booleans()) else axis}
            ins = [a.name]
            if form == "equal":
                sizes = [d // 2, d // 2]
                if self.opset >= 18:
                    attrs["num_outputs"] = 2
            elif self.opset >= 13:
                ins.append(self.ints(sizes))
            self.nodes.append(helper.make_node("Split", ins, outs, name=outs[0], **attrs))
            made = []
            for name, size in zip(outs, sizes):
                shape = list(s)
                shape[axis] = size
                made.append(V(name, tuple(shape), m, lo))
            used = self.draw(st.sampled_from([[0, 1], [0], [1]]), label="split outputs used")
            self.values.extend(made[i] for i in used)  # an output nothing reads gets no gradient
            return made[used[0]]
        if op == "Slice":
            axis = self.draw(st.integers(0, r - 1), label="slice axis")
            d = s[axis]
            step = self.draw(st.sampled_from([1, 1, 2, -1, -2]), label="slice step")
            start = self.draw(st.integers(-d, d - 1), label="slice start")
            end = self.draw(st.sampled_from([d, -d - 1, 2**62, -2**62] + list(range(-d, d))), label="slice end")
            index = [slice(None)] * r
            index[axis] = slice(start, end if abs(end) < 2**60 else (None), step)
            if end == -2**62 and step > 0 or end == 2**62 and step < 0:
                index[axis] = slice(start, -d - 1 if step > 0 else d, step)
            shape = probe[tuple(index)].shape
            if 0 in shape:
                return self.node("Identity", [a.name], s, m, lo)
            ax = axis - r if self.draw(st.booleans()) else axis
            return self.node(op, [a.name, self.ints([start]), self.ints([end]), self.ints([ax]), self.ints([step])],
                             shape, m, lo)
        if op == "Expand":
            target = tuple(self.draw(st.integers(1, 3)) if d == 1 else d for d in s)
            if self.draw(st.booleans(), label="expand rank"):
                target = (self.draw(st.integers(1, 2)),) + target
            spec = [1 if self.draw(st.booleans()) and d == sd else d for d, sd in zip(target[len(target) - r:], s)]
            spec = list(target[:len(target) - r]) + spec
            return self.node(op, [a.name, self.ints(spec)], np.broadcast_shapes(s, tuple(spec)), m, lo)
        if op == "Tile":
            reps = [self.draw(st.integers(1, 2)) for _ in s]
            return self.node(op, [a.name, self.ints(reps)], tuple(d * k for d, k in zip(s, reps)), m, lo)
        if op == "Pad":
            mode = self.draw(st.sampled_from(["constant", "edge", "reflect"]), label="pad mode")
            pads = []
            for d in s * 2:
                top = d - 1 if mode == "reflect" else 2
                pads.append(self.draw(st.integers(-1 if d > 1 and mode == "constant" else 0, min(top, 2))))
            shape = tuple(d + pads[i] + pads[i + r] for i, d in enumerate(s))
            if min(shape) <= 0:
                return self.node("Identity", [a.name], s, m, lo)
            ins = [a.name, self.ints(pads)]
            if mode == "constant" and self.draw(st.booleans(), label="pad value"):
                ins.append(self.const(0.5))
            return self.node(op, ins, shape, max(m, 0.5), mode=mode)
        if op == "Gather":
            axis = self.draw(st.integers(-r, r - 1), label="gather axis")
            d = s[axis]
            idx = self.draw(st.lists(st.integers(-d, d - 1), min_size=1, max_size=3), label="indices")
            idx = np.array(idx, np.int64)
            if self.draw(st.booleans(), label="scalar index"):
                idx = idx[0]
            return self.node(op, [a.name, self.ints(idx)], np.take(probe, idx, axis=axis).shape, m, lo, axis=axis)
        # Trilu
        if r < 2:
            return self.node("Identity", [a.name], s, m, lo)
        k = self.draw(st.integers(-2, 2), label="trilu k")
        return self.node(op, [a.name, self.ints(k)], s, m, upper=int(self.draw(st.booleans(), label="upper")))

    # the whole graph --------------------------------------------------------------------------------------------
    def build(self):
        rank = self.draw(st.integers(0, 3), label="base rank")
        base = tuple(self.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank), label="base shape"))
        self.leaf(base, "param")
        for _ in range(self.draw(st.integers(0, 2), label="data inputs")):
            self.leaf(tuple(d if self.draw(st.booleans()) else 1 for d in base), "data")
        for _ in range(self.draw(st.integers(1, 7), label="ops")):
            a = self.pick()
            kind = self.draw(st.sampled_from(["unary", "unary", "binary", "binary", "matmul", "gemm", "reduce",
                                              "softmax", "layer_norm", "move", "move"]), label="op kind")
            getattr(self, kind)(a)
        # the heads: a scalar loss over some of the values nobody reads (others stay unused branches), or those
        # values themselves as non-scalar heads
        read = {i for n in self.nodes for i in n.input}
        sinks = [v for v in self.values if v.name not in read and v.name not in self.inits
                 and v.name not in self.inputs] or [self.values[-1]]
        trained = [v for v in sinks if any(a in self.inits for a in self.ancestors([v.name]))]
        sinks = trained or sinks  # a loss that some parameter reaches, where there is one
        chosen = [sinks[-1]] + [v for v in sinks[:-1] if self.draw(st.booleans(), label="also a head")]
        if self.draw(st.integers(0, 3), label="heads form") == 0:
            return [(v.name, v.shape) for v in chosen]
        parts = []
        for v in chosen:
            weights = self.rng.uniform(0.5, 1.5, v.shape) * self.rng.choice([-1.0, 1.0], v.shape)
            weighted = self.node("Mul", [v.name, self.const(weights)], v.shape, v.mag * 1.5)
            parts.append(self.node("ReduceSum", [weighted.name], (), 0, keepdims=0).name if v.shape else weighted.name)
        self.nodes.append(helper.make_node("Sum", parts, ["loss"], name="loss"))
        return [("loss", ())]

    def ancestors(self, names) -> set[str]:
        """The values the named values are computed from (themselves included)."""
        producers = {o: n for n in self.nodes for o in n.output}
        seen, todo = set(), list(names)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(i for i in (producers[name].input if name in producers else []) if i)
        return seen

    def model(self, heads) -> onnx.ModelProto:
        outputs = [helper.make_tensor_value_info(n, FLOAT, list(s)) for n, s in heads]
        heads = {n for n, _ in heads}
        others = [v for v in self.values if v.name not in heads | set(self.inits) | set(self.inputs)]
        if others and self.draw(st.booleans(), label="extra output"):  # a value besides the loss, as an output
            outputs.append(helper.make_tensor_value_info(others[-1].name, FLOAT, list(others[-1].shape)))
        g = helper.make_graph(self.nodes, "fuzz", [helper.make_tensor_value_info(n, FLOAT, list(s))
                                                   for n, s in self.inputs.items()], outputs,
                              [numpy_helper.from_array(np.asarray(a), n) for n, a in self.inits.items()])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        m.ir_version = helper.find_min_ir_version_for(list(m.opset_import))
        return m


def _broadcastable(a, b) -> bool:
    try:
        np.broadcast_shapes(a, b)
        return True
    except ValueError:
        return False


def _factor(n: int, rank: int, draw) -> tuple:
    """A shape of `rank` dims whose product is n."""
    dims = []
    for _ in range(max(rank - 1, 0)):
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divisors))
        dims.append(d)
        n //= d
    return tuple(dims + [n]) if rank else (() if n == 1 else (n,))


def refusal(e: Exception) -> str:
    """A documented error, by class and the fixed start of its message (names, numbers and paths left out)."""
    text = re.sub(r"\S+\.onnx\b", "FILE", str(e))
    text = re.sub(r"'[^']*'|\"[^\"]*\"|\d+", "_", text)
    return f"refused: {type(e).__name__}: {text[:70]}"


def describe(model: onnx.ModelProto) -> str:
    """The graph in a few lines, for a failure message."""
    inputs = [(i.name, [d.dim_value for d in i.type.tensor_type.shape.dim]) for i in model.graph.input]
    lines = [f"opset {model.opset_import[0].version}; inputs {inputs}",
             f"initializers {[(t.name, list(t.dims)) for t in model.graph.initializer]}"]
    lines += [f"  {n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)} "
              f"{ {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name != 'value'} }"
              for n in model.graph.node]
    return "\n".join(lines)


@settings(PROFILE)
@given(st.data())
def test_random_graphs_build_and_check_or_refuse(stats, data):
    opset = data.draw(st.sampled_from([13, 15, 17, 18, 20, 21]), label="opset")
    g = GraphDraw(data, opset)
    heads = g.build()
    model = g.model(heads)
    loss = [n for n, _ in heads]
    try:
        result = onnxgrad.build(model, loss=loss)
        params = result.report["parameters"]
        reaching = sorted(set(g.inputs) & g.ancestors(loss))
        if reaching and data.draw(st.integers(0, 3), label="input wrt") == 0:  # and a graph input
            result = onnxgrad.build(model, loss=loss, requires_grad=params + [data.draw(st.sampled_from(reaching),
                                                                                        label="input")])
        elif len(params) > 1 and data.draw(st.integers(0, 4), label="freeze") == 0:
            result = onnxgrad.build(model, loss=loss, frozen=[data.draw(st.sampled_from(params), label="frozen")])
    except REFUSALS as e:
        stats[refusal(e)] += 1
        return
    train = result.model
    if not any(o.name.endswith("_grad") for o in train.graph.output):
        stats["built, no parameter reaches the loss"] += 1
        return
    result = check_training_graph(train, samples=0, seed=data.draw(st.integers(0, 100), label="check seed"),
                                  precision="float64", float64_fallback=reference_runner)
    if not np.isfinite(result.loss_value) or abs(result.loss_value) > 1e6:
        stats["rejected: loss not finite or too large"] += 1
        assume(False)
    assert result.passed, f"gradients off:\n{result.table()}\n{describe(model)}"
    engine = "onnxruntime" if result.engine == "onnxruntime" else "onnx reference evaluator"
    stats[f"built and checked in float64 ({engine})"] += 1


# -- mutated protobufs -----------------------------------------------------------------------------------------
def _seed_models() -> list[bytes]:
    from pathlib import Path

    root = Path(__file__).parent.parent / "models"
    attrs = helper.make_model(helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones((2, 3), np.float32))),
         helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]), helper.make_node("MatMul", ["c", "t"], ["y"]),
         helper.make_node("Softmax", ["y"], ["s"], axis=-1),
         helper.make_node("ReduceMean", ["s", "axes"], ["loss"], keepdims=0)], "m",
        [helper.make_tensor_value_info("x", FLOAT, ["N", 3])], [helper.make_tensor_value_info("loss", FLOAT, [])],
        [numpy_helper.from_array(np.array([0, 1], np.int64), "axes")]), opset_imports=[helper.make_opsetid("", 18)])
    attrs.ir_version = 8
    return [affine().SerializeToString(), attrs.SerializeToString(), (root / "mlp.onnx").read_bytes()]


SEEDS = _seed_models()


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(SEEDS), label="seed model"))
    for _ in range(draw(st.integers(1, 4), label="mutations")):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]), label="mutation")
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1), label="position")
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[at] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        else:
            del data[at:]
    return bytes(data)


@st.composite
def edited(draw):
    """A seed model with one field changed: an attribute, an op type, a name, a dim, a type, an opset."""
    m = onnx.ModelProto()
    m.ParseFromString(draw(st.sampled_from(SEEDS), label="seed model"))
    g = m.graph
    names = sorted({i for n in g.node for i in n.input} | {o for n in g.node for o in n.output})
    what = draw(st.sampled_from(["attribute", "op_type", "input", "output", "dims", "data_type", "opset",
                                 "ir_version", "io_type", "drop_node", "drop_initializer"]), label="edit")
    node = g.node[draw(st.integers(0, len(g.node) - 1), label="node")]
    if what == "attribute" and node.attribute:
        a = node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        if a.type == onnx.AttributeProto.INT:
            a.i = draw(st.integers(-3, 3))
        elif a.type == onnx.AttributeProto.INTS:
            a.ints[:] = draw(st.lists(st.integers(-3, 3), max_size=4))
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
        else:
            a.type = draw(st.sampled_from([1, 2, 3, 7]))
    elif what == "op_type":
        node.op_type = draw(st.sampled_from(["Add", "Relu", "MatMul", "Gemm", "Softmax", "Reshape", "Atan",
                                             "Concat", "If", "Loop", "Foo"]))
    elif what in ("input", "output"):
        field = node.input if what == "input" else node.output
        if field:
            field[draw(st.integers(0, len(field) - 1))] = draw(st.sampled_from(names + ["", "nowhere"]))
    elif what == "dims" and g.initializer:
        t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
        t.dims[:] = draw(st.lists(st.integers(0, 70), max_size=3))
    elif what == "data_type" and g.initializer:
        g.initializer[draw(st.integers(0, len(g.initializer) - 1))].data_type = draw(st.integers(0, 25))
    elif what == "opset":
        m.opset_import[0].version = draw(st.integers(0, 26))
    elif what == "ir_version":
        m.ir_version = draw(st.integers(0, 20))
    elif what == "io_type":
        vi = draw(st.sampled_from(list(g.input) + list(g.output)))
        vi.type.tensor_type.elem_type = draw(st.integers(0, 25))
    elif what == "drop_node":
        g.node.remove(node)
    elif what == "drop_initializer" and g.initializer:
        g.initializer.remove(g.initializer[draw(st.integers(0, len(g.initializer) - 1))])
    return m.SerializeToString()


@settings(PROFILE)
@given(blob=st.one_of(mutated(), edited()))
def test_mutated_protobufs_load_or_say_what_is_wrong(stats, tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("mutant") / "m.onnx"
    path.write_bytes(blob)
    try:
        onnxgrad.build(str(path))
    except DOCUMENTED as e:
        message = str(e)
        assert message and "\n" not in message.strip()
        stats[f"mutant {refusal(e)}"] += 1
        return
    except InternalError as e:
        # a model that passes onnx's checker and shape inference but is still invalid (e.g. a Gemm C that does
        # not broadcast to the output) is caught only by the final check of the training graph; accepted
        # only when onnxruntime cannot run the forward model either
        assert not onnxruntime_runs(path), f"internal error on a model onnxruntime runs: {e}"
        stats[f"mutant {refusal(e)} (the model is invalid: onnxruntime refuses it too)"] += 1
        return
    stats["mutant built"] += 1


def onnxruntime_runs(path) -> bool:
    import onnxruntime as ort

    from onnxgrad.protos import random_feeds
    try:
        model = onnx.shape_inference.infer_shapes(onnx.load(path))
        so = ort.SessionOptions()
        so.log_severity_level = 4  # its refusal is the expected outcome, not news
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        sess.run(None, random_feeds(model, {}, 0, skip={t.name for t in model.graph.initializer}))
        return True
    except Exception:
        return False
