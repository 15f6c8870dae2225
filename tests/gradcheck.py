"""The one gradient checker every rule test goes through.

A case is a single op. Its differentiable inputs become graph inputs, its other inputs initializers. The
training graph is built with every output as a head (each seeded by a `<y>_grad` input, or 1 for a scalar),
so the backward pass computes the vector-Jacobian product Jᵀc for a direction c that the test chooses.
Checks, all in float64:
- the inner-product test <t, Jᵀc> = <J t, c>, with J t from central finite differences, on random t and c;
- on tiny shapes, the full Jacobian: every row from the backward pass, every column by finite differences;
- the float32 training graph runs in stock onnxruntime and agrees with the float64 gradients.
The numbers come from onnxgrad.gradcheck, the core `onnxgrad check` uses too; `check_model` runs the three
tests on any model (tests/test_control_flow.py's whole models go through it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

import onnxgrad
from onnxgrad import gradcheck
from onnxgrad.contract import FLOAT_TYPES, GRAD_SUFFIX


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
    """Runs a model in float64: onnxruntime where it has the kernels, the onnx reference evaluator otherwise.
    Called with feeds, gives every output, in the order of `outputs`; `sess` is None on the fallback."""

    def __init__(self, model: onnx.ModelProto):
        self.run = gradcheck.Runner(model, fallback=gradcheck.reference_evaluator)
        self.sess = self.run.session
        self.outputs = self.run.names

    def __call__(self, feeds: dict) -> list[np.ndarray]:
        return list(self.run(feeds).values())


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
    fwd32, _ = _model(case, np.float32)
    train32 = _build(fwd32, heads, wrt)

    x = {}
    for i, spec in enumerate(case.inputs):
        if isinstance(spec, tuple):
            x[f"in{i}"] = np.asarray(case.samplers.get(i, case.sampler)(rng, spec), dtype=case.dtype)

    def forward(feeds):
        return [y for o, y in zip(f.outputs, f(feeds)) if o in heads]
    y0 = forward(x)
    check_model(forward, lambda feeds: dict(zip(b.outputs, b(feeds))), x, wrt, heads,
                [np.shape(y) for y in y0], [y.dtype for y in y0], train32, rng,
                eps=1e-6 if case.dtype == np.float64 else 1e-2, tol=case.tol, tol32=case.tol32,
                full_jacobian_max=full_jacobian_max, label=str(case))


def check_model(forward: Callable, backward: Callable, x: dict, wrt: list[str], heads: list[str], out_shapes: list,
                seed_dtypes: list, train32: onnx.ModelProto, rng: np.random.Generator, *, eps: float, tol: float,
                tol32: float, full_jacobian_max: int = 48, label: str = "") -> None:
    """The checker's three tests of one model, at the point x (every graph input; wrt: the differentiated ones).
    forward: feeds -> the heads' values (a float64 forward pass, for the finite differences); backward: feeds ->
    {output: value} of the float64 training graph, whose `<head>_grad` inputs get c cast to seed_dtypes;
    train32: the float32 training graph, run in stock onnxruntime last. A failure names `label`."""
    where = f"{label}: " if label else ""

    def vjp(c: list[np.ndarray]) -> dict[str, np.ndarray]:
        feeds = dict(x)
        for name, ci, dtype in zip(heads, c, seed_dtypes):
            feeds[name + GRAD_SUFFIX] = np.asarray(ci, dtype=dtype)
        by_name = backward(feeds)
        return {n: by_name[n + GRAD_SUFFIX] for n in wrt}

    def jvp(t: dict[str, np.ndarray]) -> list[np.ndarray]:
        return gradcheck.central_difference(forward, x, t, eps)

    # inner-product test on random directions
    for _ in range(2):
        t, c = gradcheck.directions(rng, {n: x[n].shape for n in wrt}, out_shapes)
        g = vjp(c)
        for n in wrt:
            assert g[n].shape == x[n].shape, f"{where}gradient of {n} has shape {g[n].shape}, not {x[n].shape}"
        lhs, rhs, scale = gradcheck.inner_product(t, g, jvp(t), c)
        assert abs(lhs - rhs) <= tol * max(scale, 1.0) + 1e-9, \
            f"{where}<t, J^T c> = {lhs:.10g} but <J t, c> = {rhs:.10g}"

    # full Jacobian on tiny shapes
    n_in = sum(x[n].size for n in wrt)
    n_out = sum(int(np.prod(s)) for s in out_shapes)
    if n_in <= full_jacobian_max and n_out <= full_jacobian_max:
        jt_rows, j_fd = gradcheck.jacobian(vjp, jvp, {n: x[n] for n in wrt}, out_shapes)
        np.testing.assert_allclose(jt_rows, j_fd, rtol=tol * 10, atol=tol * 10,
                                   err_msg=f"{where}Jacobian rows (backward) differ from finite differences")

    # the float32 graph in stock onnxruntime agrees (None: a half-precision model, which its caller checks)
    if train32 is None:
        return
    c = [rng.standard_normal(s) for s in out_shapes]
    got = gradcheck.float32_vjp(train32, x, dict(zip(heads, c)), wrt)
    expect = vjp(c)
    for n in wrt:
        err = gradcheck.relative_error(got[n], expect[n])
        assert err <= tol32, f"{where}float32 onnxruntime gradient of {n} off by {err:.2e} (relative)"
