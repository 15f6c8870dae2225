"""The one gradient checker every rule test goes through.

A case is a single op. Its differentiable inputs become graph inputs, its other inputs initializers. The
training graph is built with every output as a head (each seeded by a `<y>_grad` input, or 1 for a scalar),
so the backward pass computes the vector-Jacobian product Jᵀc for a direction c that the test chooses.
Checks, all in float64:
- the inner-product test <t, Jᵀc> = <J t, c>, with J t from central finite differences, on random t and c;
- on tiny shapes, the full Jacobian: every row from the backward pass, every column by finite differences;
- the float32 training graph runs in stock onnxruntime and agrees with the float64 gradients.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxgrad
from onnxgrad import runtime
from onnxgrad.ir import FLOAT_TYPES


def away_from_zero(rng: np.random.Generator, shape) -> np.ndarray:
    """Values in ±[0.5, 1.5]: away from the kinks at 0 of Relu, Abs, Sign and friends."""
    return rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape)


def positive(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.uniform(0.5, 2.0, size=shape)


def distinct(rng: np.random.Generator, shape) -> np.ndarray:
    """Values with no ties, for Max, Min, TopK and pooling."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) - n / 2 + 0.5) * 0.25 + rng.uniform(-0.05, 0.05, size=shape)


@dataclass
class Case:
    op: str
    inputs: list            # per input: a shape (a float graph input, differentiated), an array (an
                            # initializer, not differentiated) or None (an absent optional input)
    attrs: dict = field(default_factory=dict)
    id: str = ""
    outputs: int = 1        # how many outputs to take gradients of (e.g. Split); None-named skipped
    sampler: Callable = away_from_zero
    opset: int = 18
    tol: float = 1e-6       # relative tolerance of the float64 checks
    tol32: float = 2e-3     # relative tolerance of the float32 onnxruntime run
    samplers: dict = field(default_factory=dict)  # per-input sampler overrides {index: sampler}
    output_names: list | None = None  # names for multi-output ops where some outputs are left empty
    dtype: type = np.float64  # float32 for ops with no float64 form (finite differences then use a larger step)

    def __str__(self):
        return self.id or self.op


def _model(case: Case, dtype) -> tuple[onnx.ModelProto, list[str]]:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    names, graph_inputs, inits, wrt = [], [], [], []
    for i, spec in enumerate(case.inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        if isinstance(spec, tuple):
            graph_inputs.append(helper.make_tensor_value_info(name, elem, list(spec)))
            wrt.append(name)
        else:
            array = np.asarray(spec)
            if array.dtype.kind == "f":
                array = array.astype(dtype)
            inits.append(numpy_helper.from_array(array, name))
    out_names = case.output_names or [f"out{k}" for k in range(case.outputs)]
    node = helper.make_node(case.op, names, out_names, name="op", **case.attrs)
    outputs = [helper.make_value_info(n, onnx.TypeProto()) for n in out_names if n]
    graph = helper.make_graph([node], "case", graph_inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", case.opset)])
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    for o in model.graph.output:  # onnx infers no type for some ops (GroupNormalization): like the first input
        if not o.type.tensor_type.elem_type and graph_inputs:
            o.type.CopyFrom(graph_inputs[0].type)
    return model, wrt


class Runner:
    """Runs a model in float64: onnxruntime where it has the kernels, the onnx reference evaluator otherwise."""

    def __init__(self, model: onnx.ModelProto):
        try:
            self.sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
            self.ref = None
        except Exception:
            self.sess, self.ref = None, ReferenceEvaluator(model)
        self.outputs = [o.name for o in model.graph.output]

    def __call__(self, feeds: dict) -> list[np.ndarray]:
        if self.sess is not None:
            return self.sess.run(None, feeds)
        return [np.asarray(v) for v in self.ref.run(None, feeds)]


def float_outputs(model: onnx.ModelProto) -> list[str]:
    """The outputs that can be heads of the loss (not indices or masks)."""
    return [o.name for o in model.graph.output if o.type.tensor_type.elem_type in FLOAT_TYPES]


def _build(model: onnx.ModelProto, heads: list[str], wrt: list[str]) -> onnx.ModelProto:
    """Every head, scalar or not, gets a `<head>_grad` input, so the test chooses each direction."""
    return onnxgrad.build(model, loss=heads, requires_grad=wrt, feed_head_grads=True).model


def check_case(case: Case, seed: int = 0, full_jacobian_max: int = 48) -> None:
    rng = np.random.default_rng(seed)
    fwd, wrt = _model(case, case.dtype)
    heads = float_outputs(fwd)
    train = _build(fwd, heads, wrt)
    f, b = Runner(fwd), Runner(train)

    x = {}
    for i, spec in enumerate(case.inputs):
        if isinstance(spec, tuple):
            x[f"in{i}"] = np.asarray(case.samplers.get(i, case.sampler)(rng, spec), dtype=case.dtype)
    y0 = [y for o, y in zip(f.outputs, f(x)) if o in heads]
    out_shapes = [np.shape(y) for y in y0]

    def vjp(c: list[np.ndarray]) -> dict[str, np.ndarray]:
        feeds = dict(x)
        for name, ci, y in zip(heads, c, y0):
            feeds[name + "_grad"] = np.asarray(ci, dtype=y.dtype)
        res = b(feeds)
        by_name = dict(zip(b.outputs, res))
        return {n: by_name[n + "_grad"] for n in wrt}

    def jvp(t: dict[str, np.ndarray]) -> list[np.ndarray]:
        eps = 1e-6 if case.dtype == np.float64 else 1e-2
        plus = f({n: np.asarray(x[n] + eps * t.get(n, 0), dtype=x[n].dtype) for n in x})
        minus = f({n: np.asarray(x[n] - eps * t.get(n, 0), dtype=x[n].dtype) for n in x})
        keep = [k for k, o in enumerate(f.outputs) if o in heads]
        plus, minus = [plus[k] for k in keep], [minus[k] for k in keep]
        return [(p - m) / (2 * eps) for p, m in zip(plus, minus)]

    # inner-product test on random directions
    for _ in range(2):
        t = {n: rng.standard_normal(x[n].shape) for n in wrt}
        c = [rng.standard_normal(s) for s in out_shapes]
        g = vjp(c)
        for n in wrt:
            assert g[n].shape == x[n].shape, f"{case}: gradient of {n} has shape {g[n].shape}, not {x[n].shape}"
        lhs = sum(float(np.sum(t[n] * g[n].astype(np.float64))) for n in wrt)
        rhs = sum(float(np.sum(jt.astype(np.float64) * ci)) for jt, ci in zip(jvp(t), c))
        scale = sum(float(np.sum(np.abs(t[n] * g[n]))) for n in wrt) + 1e-12
        assert abs(lhs - rhs) <= case.tol * max(scale, 1.0) + 1e-9, \
            f"{case}: <t, J^T c> = {lhs:.10g} but <J t, c> = {rhs:.10g}"

    # full Jacobian on tiny shapes
    n_in = sum(x[n].size for n in wrt)
    n_out = sum(int(np.prod(s)) for s in out_shapes)
    if n_in <= full_jacobian_max and n_out <= full_jacobian_max:
        rows = []
        for k, s in enumerate(out_shapes):
            for j in range(int(np.prod(s))):
                c = [np.zeros(sh) for sh in out_shapes]
                c[k].reshape(-1)[j] = 1.0
                g = vjp(c)
                rows.append(np.concatenate([g[n].reshape(-1) for n in wrt]))
        jt_rows = np.array(rows)
        cols = []
        for n in wrt:
            for j in range(x[n].size):
                t = {m: np.zeros_like(x[m]) for m in wrt}
                t[n].reshape(-1)[j] = 1.0
                cols.append(np.concatenate([v.reshape(-1) for v in jvp(t)]))
        j_fd = np.array(cols).T
        np.testing.assert_allclose(jt_rows, j_fd, rtol=case.tol * 10, atol=case.tol * 10,
                                   err_msg=f"{case}: Jacobian rows (backward) differ from finite differences")

    # the float32 graph in stock onnxruntime agrees
    fwd32, _ = _model(case, np.float32)
    train32 = _build(fwd32, heads, wrt)
    sess = runtime.session(train32)
    c = [rng.standard_normal(s) for s in out_shapes]
    feeds = {n: v.astype(np.float32) for n, v in x.items()}
    out_types = {o.name: o.type.tensor_type.elem_type for o in fwd32.graph.output}
    for name, ci in zip(heads, c):
        feeds[name + "_grad"] = ci.astype(helper.tensor_dtype_to_np_dtype(out_types[name]))
    by_name = dict(zip([o.name for o in train32.graph.output], sess.run(None, feeds)))
    expect = vjp(c)
    for n in wrt:
        got, want = by_name[n + "_grad"], expect[n]
        err = np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-6)
        assert err <= case.tol32, f"{case}: float32 onnxruntime gradient of {n} off by {err:.2e} (relative)"
