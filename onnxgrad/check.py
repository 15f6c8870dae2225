"""`onnxgrad check`: verify a training graph's gradients against finite differences on random data.

The scalar checked is L = sum over the loss outputs y (metadata `onnxgrad.loss`) of <c, y>, where c is the
seeded random value fed to the graph input `<y>_grad`, or 1 for a scalar loss without one. For a seeded sample
of the elements of every parameter (an initializer or graph input with a `<name>_grad` output), the backward
output is compared with the central difference (L(p + h) - L(p - h)) / 2h of the forward part of the graph.
The numerical core (float64 conversion, running, perturbing) is onnxgrad.gradcheck's, which the rule tests use too.

The check runs in float64 when onnxruntime can run the graph converted to float64 (initializers, float inputs
and outputs, Cast targets, Constant and ConstantOfShape values), else in float32 with a larger step and a
looser tolerance; the table says which, and why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .contract import FLOAT_TYPES, GRAD_SUFFIX, LOSS_KEY
from .errors import InvalidModelError, UsageError
from .gradcheck import CannotRun, Runner, perturb, to_float64
from . import runtime
from .protos import cut_model, needed_subgraph, random_feeds

STEP = {"float64": 1e-6, "float32": 1e-3}  # relative to max(1, |p|)
DEFAULT_DIM = 2                            # size of a symbolic dim in the random data, unless --dim says


@dataclass
class ParamCheck:
    """The result for one parameter: the worst of its sampled elements."""
    name: str
    shape: tuple[int, ...]
    checked: int
    max_error: float
    worst_index: tuple[int, ...]
    backprop: float
    finite_difference: float
    ok: bool

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "checked": self.checked,
                "max_error": self.max_error, "worst_index": list(self.worst_index),
                "backprop": self.backprop, "finite_difference": self.finite_difference, "ok": self.ok}


@dataclass
class CheckResult:
    losses: list[str]
    precision: str                 # "float64", or the model's own type ("float32") where float64 cannot run
    fallback_reason: str | None    # why not float64
    step: float
    tol: float
    seed: int
    samples: int                   # per parameter; 0: every element
    params: list[ParamCheck] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)  # gradient outputs of intermediate values
    loss_value: float = 0.0        # the scalar checked, at the unperturbed point
    engine: str = "onnxruntime"    # or "fallback" (the float64_fallback runner)

    @property
    def passed(self) -> bool:
        return all(p.ok for p in self.params)

    @property
    def failed(self) -> list[str]:
        return [p.name for p in self.params if not p.ok]

    def to_json(self) -> dict:
        return {"loss": self.losses, "precision": self.precision, "fallback_reason": self.fallback_reason,
                "step": self.step, "tol": self.tol, "seed": self.seed, "samples": self.samples,
                "loss_value": self.loss_value, "parameters": [p.to_json() for p in self.params],
                "unchecked": self.unchecked, "passed": self.passed}

    def table(self) -> str:
        how = self.precision if self.fallback_reason is None else f"{self.precision} ({self.fallback_reason})"
        sample = "every element" if self.samples == 0 else f"{self.samples} elements per parameter"
        lines = [f"precision {how}; step {self.step:.0e}, tolerance {self.tol:.0e}; loss {', '.join(self.losses)}; "
                 f"{sample}, seed {self.seed}"]
        width = max([len("parameter")] + [len(p.name) for p in self.params])
        lines.append(f"{'parameter':{width}s}  {'shape':>12s}  {'checked':>7s}  {'max error':>9s}  "
                     f"{'worst at':>12s}  {'backprop':>12s}  {'finite diff':>12s}  result")
        for p in self.params:
            shape = "x".join(map(str, p.shape)) or "scalar"
            where = ",".join(map(str, p.worst_index)) or "-"
            lines.append(f"{p.name:{width}s}  {shape:>12s}  {p.checked:7d}  {p.max_error:9.2e}  {where:>12s}  "
                         f"{p.backprop:12.5e}  {p.finite_difference:12.5e}  {'ok' if p.ok else 'OFF'}")
        for name in self.unchecked:
            lines.append(f"{name + GRAD_SUFFIX}: not checked (the gradient of an intermediate value)")
        if self.passed:
            lines.append(f"all {len(self.params)} gradients within tolerance")
        else:
            lines.append(f"{len(self.failed)} of {len(self.params)} gradients off: {', '.join(self.failed)}")
        return "\n".join(lines) + "\n"


def check_training_graph(model: onnx.ModelProto, *, loss: list[str] | None = None, samples: int = 5,
                         seed: int = 0, tol: float = 1e-4, tol32: float = 1e-1,
                         dims: dict[str, int] | None = None, precision: str = "auto",
                         float64_fallback: Callable[[onnx.ModelProto], Callable] | None = None) -> CheckResult:
    """Check every `<param>_grad` output of `model` (a graph written by build-grad) by finite differences.

    precision: "auto" (float64 where onnxruntime can run it, else the model's own types), "float64", "float32".
    float64_fallback: model -> a function (output names or None, feeds) -> outputs, like InferenceSession.run,
    for float64 graphs that onnxruntime cannot run (the tests pass the onnx reference evaluator's); None: fall
    back to the model's own types.

    The steps: find the loss and the parameters; make the runners, in float64 where possible; draw the point
    checked (data, parameter values, loss seeds); run the backward pass there, twice, to refuse a graph that is
    not deterministic; then compare each parameter's sampled gradient elements with finite differences."""
    if precision not in ("auto", "float64", "float32"):
        raise UsageError(f"--precision {precision}: expected auto, float64 or float32")
    if samples < 0:
        raise UsageError(f"--samples {samples}: expected 0 (every element) or more")
    heads = _loss_names(model, loss)
    params, unchecked = _parameters(model)
    model = _with_param_inputs(model, params)
    train, fwd, dtype, reason = _runners(model, heads, precision, float64_fallback)
    rng = np.random.default_rng(seed)
    base, cs, prec = _point(model, params, heads, fwd, dims or {}, seed, dtype, rng)
    step, limit = STEP.get(prec, 5e-2), tol if prec == "float64" else tol32

    def objective(y: dict) -> float:
        return float(sum(np.sum(np.asarray(cs[h], np.float64) * np.asarray(y[h], np.float64)) for h in heads))

    grads = _deterministic_run(train, base)
    l0 = objective(grads)
    magnitude = float(sum(np.sum(np.abs(np.asarray(cs[h], np.float64) * np.asarray(grads[h], np.float64)))
                          for h in heads))
    eps_machine = float(np.finfo(prec).eps) if prec in ("float64", "float32", "float16") else 2.0 ** -7
    # the error is the disagreement beyond what rounding alone puts into a difference of two losses (measured:
    # under half of eps * |loss| / step for the central one)
    rounding = 2 * eps_machine * max(magnitude, abs(l0))

    def loss_at(p: str, value: np.ndarray) -> float:
        return objective(train({**base, p: value}, heads))

    result = CheckResult(heads, prec, reason, step, limit, seed, samples, unchecked=unchecked, loss_value=l0,
                         engine=train.engine)
    for p in params:
        result.params.append(_check_parameter(p, base[p], np.asarray(grads[p + GRAD_SUFFIX]), loss_at, l0, step,
                                              limit, rounding, samples, rng))
    return result


# -- the steps of the check --------------------------------------------------------------------------------------
def _runners(model: onnx.ModelProto, heads: list[str], precision: str, float64_fallback) -> tuple:
    """The training graph's runner and the forward graph's, the dtype they run in (None: the model's own types),
    and why not float64 when they do not run in it."""
    # the finite differences run the training graph itself (asking for the loss only), not a forward graph
    # cut from it: onnxruntime removes a training-mode Dropout whose mask nothing reads, so a cut graph could
    # compute another function; the cut graph only tells the loss's shape, for the seeds
    reason = None
    if precision != "float32":
        try:
            model64 = to_float64(model)
            train = Runner(model64, float64_fallback)
            fwd = Runner(forward_model(model64, heads), float64_fallback)
            return train, fwd, np.float64, None
        except CannotRun as e:
            if precision == "float64":
                raise UsageError(f"--precision float64: {e}") from None
            reason = str(e)
    runtime.refuse_half_precision_on_cpu(model)
    try:
        train, fwd = Runner(model), Runner(forward_model(model, heads))
    except CannotRun as e:
        raise InvalidModelError(f"onnxruntime cannot run the training graph: {e}") from None
    return train, fwd, None, reason


def _point(model, params, heads, fwd, dims, seed, dtype, rng) -> tuple[dict, dict, str]:
    """The feeds of the point checked (data, parameter values, the seeds `<loss>_grad`), the factor c of each
    loss in the scalar checked, and the precision the check runs in."""
    feeds, sizes = _data_feeds(model, params, heads, dims, seed, dtype)
    values = {p: _param_value(model, p, rng, dtype, sizes) for p in params}
    prec = "float64" if dtype is np.float64 else np.dtype(values[params[0]].dtype).name
    shapes = {h: np.shape(y) for h, y in fwd({**feeds, **values}).items()}
    seeds = {}
    for h in heads:
        if h + GRAD_SUFFIX in _input_names(model):
            seed_type = dtype or _input_dtype(model, h + GRAD_SUFFIX)
            seeds[h + GRAD_SUFFIX] = rng.standard_normal(shapes[h]).astype(seed_type)
    cs = {h: seeds.get(h + GRAD_SUFFIX, 1.0) for h in heads}
    return {**feeds, **values, **seeds}, cs, prec


def _deterministic_run(train, base: dict) -> dict:
    """The training graph's outputs at the point checked, after making sure a second run gives the same."""
    grads = train(base)
    again = train(base)
    if any(not np.array_equal(grads[k], again[k], equal_nan=True) for k in grads):
        raise UsageError("the training graph gives different results on the same data (random ops such as "
                         "Dropout in training mode?), so finite differences cannot check it")
    return grads


def _check_parameter(p: str, value: np.ndarray, g: np.ndarray, loss_at: Callable[[str, np.ndarray], float],
                     l0: float, step: float, limit: float, rounding: float, samples: int,
                     rng: np.random.Generator) -> ParamCheck:
    """The worst of `samples` elements of one parameter (every element for 0): backprop against the
    finite differences of the scalar checked."""
    if g.shape != value.shape:  # a gradient of the wrong shape is as wrong as a wrong value
        return ParamCheck(p, tuple(value.shape), 0, float("inf"), (), float("nan"), float("nan"), False)
    n = value.size
    picks = np.arange(n) if samples == 0 or samples >= n else np.sort(rng.choice(n, samples, replace=False))
    g_floor = 1e-2 * float(np.max(np.abs(g))) if g.size else 0.0
    worst = (-1.0, 0, 0.0, 0.0)
    for flat in picks:
        x = float(value.flat[flat])
        h = step * max(1.0, abs(x))
        plus, minus = perturb(value, int(flat), h)  # this element moved by ±h
        up, down = float(plus.flat[flat]) - x, x - float(minus.flat[flat])  # the steps the dtype really took
        l_plus, l_minus = loss_at(p, plus), loss_at(p, minus)
        bp = float(g.flat[flat])
        # central difference; where a kink (Relu, Max, Abs) lies within the step, the one-sided difference
        # on the side of p is the derivative at p, so an element passes when either agrees
        steps = [up + down, up, down]
        diffs = [(l_plus - l_minus) / steps[0], (l_plus - l0) / steps[1], (l0 - l_minus) / steps[2]]
        # the error beyond rounding is relative to the larger of the two values and of 1% of the parameter's
        # largest gradient element
        errs = []
        for fd, width in zip(diffs, steps):
            scale = max(abs(bp), abs(fd), g_floor, 1e-300)
            ok = np.isfinite(bp) and np.isfinite(fd)
            errs.append(max(0.0, abs(bp - fd) - rounding / width) / scale if ok else float("inf"))
        err = min(errs)
        if err > worst[0]:
            worst = (err, int(flat), bp, diffs[errs.index(err)])
    err, flat, bp, fd = worst
    err = max(err, 0.0)  # -1 when no element was checked (an empty parameter)
    index = tuple(int(i) for i in np.unravel_index(flat, value.shape)) if value.shape and n else ()
    return ParamCheck(p, tuple(value.shape), len(picks), err, index, bp, fd, err <= limit)


# -- the graph's loss, parameters and data ----------------------------------------------------------------------
def _loss_names(model: onnx.ModelProto, loss: list[str] | None) -> list[str]:
    outputs = [o.name for o in model.graph.output]
    if not loss:
        meta = {p.key: p.value for p in model.metadata_props}
        if LOSS_KEY not in meta:
            raise UsageError(f"the model has no {LOSS_KEY!r} metadata (not written by onnxgrad build-grad?); "
                             f"name the loss output with --loss")
        loss = [n for n in meta[LOSS_KEY].split(",") if n]
    for name in loss:
        if name not in outputs:
            raise UsageError(f"--loss {name}: no graph output of that name (outputs: {', '.join(outputs)})")
    return list(loss)


def _parameters(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    """Initializers and graph inputs with a `<name>_grad` output (initializer order, then input order), and
    the other `<name>_grad` outputs (gradients of intermediate values, which cannot be perturbed)."""
    outputs = {o.name for o in model.graph.output}
    types = {t.name: t.data_type for t in model.graph.initializer}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input if vi.name not in types})
    params = [n for n in types if n + GRAD_SUFFIX in outputs and types[n] in FLOAT_TYPES]
    if not params:
        raise UsageError("the model has no <param>_grad outputs: is it a graph written by onnxgrad build-grad?")
    unchecked = [o.name[: -len(GRAD_SUFFIX)] for o in model.graph.output
                 if o.name.endswith(GRAD_SUFFIX) and o.name[: -len(GRAD_SUFFIX)] not in types]
    return params, unchecked


def _input_names(model: onnx.ModelProto) -> set[str]:
    return {vi.name for vi in model.graph.input}


def _with_param_inputs(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    """Every parameter must be a graph input, so that the check can feed perturbed values."""
    missing = [t for t in model.graph.initializer if t.name in params and t.name not in _input_names(model)]
    if not missing:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in missing:
        out.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return out


def _data_feeds(model, params, heads, dims, seed, dtype) -> dict[str, np.ndarray]:
    symbols = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim if d.dim_param}
    sizes = {**{s: DEFAULT_DIM for s in symbols}, **dims}
    initialized = {t.name for t in model.graph.initializer}
    skip = set(params) | {h + GRAD_SUFFIX for h in heads} | initialized
    feeds = random_feeds(onnx.shape_inference.infer_shapes(model), sizes, seed, skip)  # shapes: label ranges
    if dtype is not None:
        feeds = {k: v.astype(dtype) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    return feeds, sizes


def _input_dtype(model: onnx.ModelProto, name: str) -> np.dtype:
    vi = next(vi for vi in model.graph.input if vi.name == name)
    return helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)


def _param_value(model, name, rng, dtype, sizes) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            value = numpy_helper.to_array(t)
            break
    else:  # a graph input: random data of its shape
        vi = next(vi for vi in model.graph.input if vi.name == name)
        shape = [d.dim_value if d.HasField("dim_value") else sizes.get(d.dim_param, DEFAULT_DIM)
                 for d in vi.type.tensor_type.shape.dim]
        value = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
    return np.array(value, dtype=dtype or value.dtype)


# -- graphs ----------------------------------------------------------------------------------------------------
def forward_model(model: onnx.ModelProto, heads: list[str]) -> onnx.ModelProto:
    """The part of `model` that computes `heads`: nodes, inputs and initializers the heads do not need go."""
    nodes, _ = needed_subgraph(model.graph, heads)
    return cut_model(model, nodes, heads, keep_metadata=[p.key for p in model.metadata_props])
