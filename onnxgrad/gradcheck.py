"""The numerical core of gradient checking, shared by `onnxgrad check` (onnxgrad.check) and the rule tests.

- `to_float64`: a copy of a graph computing in float64, so that finite differences are not lost to rounding;
- `Runner`: runs a graph in onnxruntime (one thread, deterministic), or in a fallback where onnxruntime has no
  kernel (the onnx reference evaluator: `reference_evaluator`);
- `perturb` and `central_difference`: J t ≈ (f(x + eps t) - f(x - eps t)) / 2 eps, inputs kept in their dtypes;
- `directions` and `inner_product`: the test <t, Jᵀc> = <J t, c> on random directions t and c;
- `jacobian`: on tiny shapes, every row of J from the backward pass and every column by finite differences;
- `float32_vjp` and `relative_error`: the float32 training graph as a user runs it, in stock onnxruntime.

Here a vjp is c -> {input: Jᵀc} (the training graph with c fed to the `<head>_grad` inputs) and a jvp is
t -> [J t per head]; the tolerances are the caller's.
"""
from __future__ import annotations

import re
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from . import runtime
from .contract import FLOAT_TYPES, GRAD_SUFFIX


# -- float64 -------------------------------------------------------------------------------------------------------
def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` computing in float64: float tensors, types, Cast targets and constants converted."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph_to_float64(out.graph)
    return out


def _graph_to_float64(g: onnx.GraphProto) -> None:
    for k, t in enumerate(g.initializer):
        if t.data_type in FLOAT_TYPES and t.data_type != TensorProto.DOUBLE:
            g.initializer[k].CopyFrom(_tensor_to_float64(t))
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        _type_to_float64(vi.type)
    for node in g.node:
        if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
            # the default value is a float32 zero
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros(1, np.float64))))
        for a in list(node.attribute):
            if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in FLOAT_TYPES:
                a.i = TensorProto.DOUBLE
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FLOAT_TYPES:
                a.t.CopyFrom(_tensor_to_float64(a.t))
            elif a.type == onnx.AttributeProto.TENSORS:
                for t in a.tensors:
                    if t.data_type in FLOAT_TYPES:
                        t.CopyFrom(_tensor_to_float64(t))
            elif a.type == onnx.AttributeProto.GRAPH:
                _graph_to_float64(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    _graph_to_float64(sub)
            elif node.op_type == "Constant" and a.name in ("value_float", "value_floats"):
                value = np.array(a.f if a.name == "value_float" else list(a.floats), np.float64)
                node.attribute.remove(a)
                node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(value)))


def _tensor_to_float64(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name)


def _type_to_float64(tp: onnx.TypeProto) -> None:
    which = tp.WhichOneof("value")
    if which == "tensor_type" and tp.tensor_type.elem_type in FLOAT_TYPES:
        tp.tensor_type.elem_type = TensorProto.DOUBLE
    elif which == "sequence_type":
        _type_to_float64(tp.sequence_type.elem_type)
    elif which == "optional_type":
        _type_to_float64(tp.optional_type.elem_type)


# -- running -------------------------------------------------------------------------------------------------------
class CannotRun(Exception):
    """onnxruntime refuses the graph; the message says why, in a few words."""


class Runner:
    """Runs a graph: (feeds, output names or None for all) -> {output name: array}. onnxruntime with one
    thread, so that runs are deterministic; or the fallback, where one is given and onnxruntime refuses.

    fallback: model -> a function (output names or None, feeds) -> outputs, like InferenceSession.run."""

    def __init__(self, model: onnx.ModelProto, fallback: Callable | None = None):
        self.names = [o.name for o in model.graph.output]
        self.inputs = {vi.name for vi in model.graph.input} | {t.name for t in model.graph.initializer}
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        try:
            self.session = ort.InferenceSession(runtime.model_bytes(model), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            if fallback is None:
                raise CannotRun(_why_not(e)) from None
            self.session = None
            self.engine, self.run = "fallback", fallback(model)
        else:
            self.engine, self.run = "onnxruntime", self.session.run

    def __call__(self, feeds: dict, outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        values = self.run(outputs, {k: v for k, v in feeds.items() if k in self.inputs})
        return dict(zip(outputs or self.names, (np.asarray(v) for v in values)))


def reference_evaluator(model: onnx.ModelProto) -> Callable:
    """A `Runner` fallback: the onnx reference evaluator, which runs float64 forms onnxruntime has no kernel for."""
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(model).run


def _why_not(e: Exception) -> str:
    text = str(e)
    m = re.search(r"Could not find an implementation for (\w+)\(\d+\)", text)
    if m:
        return f"onnxruntime has no float64 kernel for {m.group(1)}"
    m = re.search(r"of operator \((\w+)\)", text)
    if m:
        return f"{m.group(1)} has no float64 form"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:200]


# -- finite differences --------------------------------------------------------------------------------------------
def perturb(value: np.ndarray, t: np.ndarray | int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """value + eps t and value - eps t, rounded to value's dtype (the caller can read the step really taken).
    t: a direction of value's shape, or the flat index of one element: the unit direction there, which moves
    that element alone (no array of value's size is made for the direction)."""
    if isinstance(t, (int, np.integer)):
        plus, minus = value.copy(), value.copy()
        x = float(value.flat[t])
        plus.flat[t], minus.flat[t] = x + eps, x - eps
        return plus, minus
    return np.asarray(value + eps * t, dtype=value.dtype), np.asarray(value - eps * t, dtype=value.dtype)


def central_difference(f: Callable, x: dict, t: dict, eps: float) -> list[np.ndarray]:
    """J t ≈ (f(x + eps t) - f(x - eps t)) / 2 eps, for f: feeds -> a list of outputs. Inputs that t does not
    name are fed unchanged."""
    moved = {n: perturb(x[n], t[n], eps) for n in x if n in t}
    plus = f({n: moved[n][0] if n in moved else v for n, v in x.items()})
    minus = f({n: moved[n][1] if n in moved else v for n, v in x.items()})
    return [(p - m) / (2 * eps) for p, m in zip(plus, minus)]


# -- the inner-product test ----------------------------------------------------------------------------------------
def directions(rng: np.random.Generator, in_shapes: dict, out_shapes: list) -> tuple[dict, list]:
    """Random directions: t (standard normal) for every input, then c for every output, in that order."""
    t = {n: rng.standard_normal(s) for n, s in in_shapes.items()}
    c = [rng.standard_normal(s) for s in out_shapes]
    return t, c


def inner_product(t: dict, g: dict, jt: list, c: list) -> tuple[float, float, float]:
    """<t, Jᵀc> and <J t, c> in float64, with g = Jᵀc and jt = J t; and sum |t * Jᵀc|, the scale their
    difference is measured against."""
    g64 = {n: np.asarray(g[n], np.float64) for n in t}
    lhs = sum(float(np.sum(t[n] * g64[n])) for n in t)
    rhs = sum(float(np.sum(np.asarray(j, np.float64) * ci)) for j, ci in zip(jt, c))
    scale = sum(float(np.sum(np.abs(t[n] * g64[n]))) for n in t) + 1e-12
    return lhs, rhs, scale


def jacobian(vjp: Callable, jvp: Callable, x: dict, out_shapes: list) -> tuple[np.ndarray, np.ndarray]:
    """J twice, as (outputs x inputs) matrices over the flattened outputs and inputs x (in order): row by row
    from the backward pass (vjp of every unit c), column by column by finite differences (jvp of every unit t)."""
    rows = []
    for k, s in enumerate(out_shapes):
        for j in range(int(np.prod(s))):
            c = [np.zeros(sh) for sh in out_shapes]
            c[k].reshape(-1)[j] = 1.0
            g = vjp(c)
            rows.append(np.concatenate([g[n].reshape(-1) for n in x]))
    cols = []
    for n in x:
        for j in range(x[n].size):
            t = {m: np.zeros_like(x[m]) for m in x}
            t[n].reshape(-1)[j] = 1.0
            cols.append(np.concatenate([v.reshape(-1) for v in jvp(t)]))
    return np.array(rows), np.array(cols).T


# -- the float32 run -----------------------------------------------------------------------------------------------
def float32_vjp(train32: onnx.ModelProto, feeds: dict, seeds: dict, wrt: list[str]) -> dict[str, np.ndarray]:
    """Jᵀc from the float32 training graph in stock onnxruntime, with the settings its metadata asks for: float
    feeds cast to float32, each seed c (by head) to its `<head>_grad` input's type."""
    types = {vi.name: helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type) for vi in train32.graph.input}
    feeds32 = {n: v.astype(np.float32) if v.dtype.kind == "f" else v for n, v in feeds.items()}
    feeds32.update({h + GRAD_SUFFIX: np.asarray(c).astype(types[h + GRAD_SUFFIX]) for h, c in seeds.items()})
    out = dict(zip([o.name for o in train32.graph.output], runtime.session(train32).run(None, feeds32)))
    return {n: out[n + GRAD_SUFFIX] for n in wrt}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """|got - want| / (|want| + 1e-6), in the 2-norm."""
    return float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-6))
