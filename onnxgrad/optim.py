"""Optimizers appended to a training graph, so that one run of the step graph is one full training step.

`append_optimizer` runs on build-grad's output. `optimizer_settings` decides (defaults, checks: the plan that is
recorded in the metadata); the rest only writes that plan as standard ops. The update of each optimizer follows
torch.optim's single-tensor code line by line, in the same order of floating-point operations where ONNX has
them, so a step graph and PyTorch agree to float32 rounding (tests/test_optim.py). Parameters, optimizer state
and the step count are graph inputs backed by initializers, and come out as `<name>.next` outputs that the
caller feeds back; metadata `onnxgrad.state` pairs them (see README, "The step graph").
"""
from __future__ import annotations

import json
import math
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .builder import Builder, Names
from .errors import UsageError
from .contract import GRAD_SUFFIX, LOSS_SCALE_INPUT, NEXT_SUFFIX, OPTIMIZER, OPTIMIZER_KEY, PRECISION_KEY, STATE_KEY
from .ir import Graph, Value, from_model
from .weights import should_stub, stub_of

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
CLIP_EPS = 1e-6  # added to the total norm by torch.nn.utils.clip_grad_norm_

# Defaults are torch.optim's, except `momentum`, which is SGD with momentum 0.9 unless told otherwise.
DEFAULTS: dict[str, dict] = {
    "sgd": {"lr": 1e-3, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0},
    "momentum": {"lr": 1e-3, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0},
    "adam": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0},
    "adamw": {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2},
}
COMMON = {"clip_grad_norm": None, "accumulate": 1, "keep_grads": False}


def optimizer_settings(kind: str, hyper: dict) -> dict:
    """The full, checked settings of an optimizer: `hyper` (None means 'the default') over the defaults."""
    if kind not in OPTIMIZERS:
        raise UsageError(f"--optimizer {kind}: expected one of {', '.join(OPTIMIZERS)}")
    settings = {"kind": kind, **DEFAULTS[kind], **COMMON}
    for key, value in hyper.items():
        if key not in settings or key == "kind":
            options = ", ".join("--" + k.replace("_", "-") for k in [*DEFAULTS[kind], *COMMON])
            raise UsageError(f"--{key.replace('_', '-')}: not an option of --optimizer {kind} (its options: {options})")
        if value is not None:
            settings[key] = value
    try:
        return _checked(settings)
    except (TypeError, ValueError):
        raise UsageError(f"--optimizer {kind}: a hyper-parameter has the wrong type "
                         f"({', '.join(f'{k}={v!r}' for k, v in hyper.items())})") from None


def _checked(s: dict) -> dict:
    def number(key: str, low: float, low_ok: bool = True, hint: str = "") -> None:
        v = s[key] = float(s[key])
        if not (math.isfinite(v) and (v >= low if low_ok else v > low)):
            raise UsageError(f"--{key.replace('_', '-')} {v:g}: must be {'>=' if low_ok else '>'} {low:g}{hint}")

    number("lr", 0.0)
    if "momentum" in s:
        number("momentum", 0.0, low_ok=s["kind"] != "momentum", hint=" (--optimizer sgd has no momentum)")
        s["nesterov"] = bool(s["nesterov"])
        if s["nesterov"] and s["momentum"] == 0:
            raise UsageError("--nesterov: needs a momentum > 0 (as torch.optim.SGD)")
    if "betas" in s:
        betas = [float(b) for b in s["betas"]]
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise UsageError(f"--betas {','.join(f'{b:g}' for b in betas)}: expected two values in [0, 1)")
        s["betas"] = betas
        number("eps", 0.0)
    number("weight_decay", 0.0)
    if s["clip_grad_norm"] is not None:
        number("clip_grad_norm", 0.0, low_ok=False)
    if isinstance(s["accumulate"], bool) or int(s["accumulate"]) != s["accumulate"] or s["accumulate"] < 1:
        raise UsageError(f"--accumulate {s['accumulate']}: expected a whole number of micro-batches >= 1")
    s["accumulate"] = int(s["accumulate"])
    s["keep_grads"] = bool(s["keep_grads"])
    return s


def state_kinds(settings: dict) -> tuple[str, ...]:
    """The per-parameter state inputs `<p>.<kind>`, in order."""
    if settings["kind"] in ("adam", "adamw"):
        kinds = ("exp_avg", "exp_avg_sq")
    else:
        kinds = ("momentum",) if settings["momentum"] else ()
    return kinds + (("grad_acc",) if settings["accumulate"] > 1 else ())


def append_optimizer(train: onnx.ModelProto, kind: str, *, parameters: list[str] | None = None,
                     weights: dict[str, onnx.TensorProto] | None = None, **hyper) -> onnx.ModelProto:
    """Return the step graph of a training graph written by build-grad: `kind` ('sgd', 'momentum', 'adam',
    'adamw') applied to each parameter (default: every initializer with a `<p>_grad` output), with hyper
    parameters lr, momentum, nesterov, betas, eps, weight_decay, clip_grad_norm, accumulate, keep_grads.
    `weights`: for a skeleton (weights.py), the map that holds its stubs' data; large new state tensors go
    there too, and into the step graph as stubs. A training graph built with dynamic loss scaling (its
    `onnxgrad.precision` metadata) gets the loss scaler's update too."""
    settings = optimizer_settings(kind, hyper)
    graph = from_model(train)
    names = Names([*graph.values, *(n.name for n in graph.nodes)])
    scaler = json.loads(graph.metadata[PRECISION_KEY]).get("loss_scale") if PRECISION_KEY in graph.metadata else None
    add_optimizer(graph, names, settings, parameters, weights, scaler)
    return graph.to_model()


def add_optimizer(graph: Graph, names: Names, settings: dict, parameters: list[str] | None = None,
                  weights: dict[str, onnx.TensorProto] | None = None, scaler: dict | None = None) -> None:
    """Append the update of `settings` (from `optimizer_settings`) to a training graph: the pass behind
    `append_optimizer`. New nodes are in the optimizer phase; the graph's outputs become the step graph's.
    `scaler` (a dynamic loss scaler's settings, `precision.precision_settings`): the graph's gradients were
    taken of loss * loss_scale and unscaled (passes/precision.py); a step whose gradients are not all finite
    leaves every other state value as it was, and the scale is updated as torch.cuda.amp.GradScaler does."""
    kind = settings["kind"]
    if OPTIMIZER_KEY in graph.metadata:
        raise UsageError("the model already has an optimizer (metadata onnxgrad.optimizer)")
    params = _parameters(graph, parameters)
    adam = kind in ("adam", "adamw")
    accumulate = settings["accumulate"]

    # The state inputs in their documented order, each paired with the output that replaces it.
    state = {p.name: p.name + NEXT_SUFFIX for p, _ in params}
    scalars = (["step"] if adam else []) + (["micro_step"] if accumulate > 1 else [])
    per_param = [f"{p.name}.{k}" for p, _ in params for k in state_kinds(settings)]
    state.update({name: name + NEXT_SUFFIX for name in per_param + scalars})
    scaler_state = [LOSS_SCALE_INPUT, *SCALER_COUNTERS] if scaler is not None else []
    if scaler is not None and LOSS_SCALE_INPUT not in graph.initializers:
        raise UsageError(f"loss scaling: the training graph has no {LOSS_SCALE_INPUT!r} input "
                         f"(build it with --precision fp16)")
    state.update({name: name + NEXT_SUFFIX for name in scaler_state})
    for name in ["lr", *scalars, *per_param, *scaler_state[1:], *state.values()]:
        if names.taken(name):
            raise UsageError(f"cannot add the optimizer's {name!r}: the model already has a value of that name")
        names.reserve(name)

    original, kept, extra = _split_outputs(graph, params)
    lr = _add_state(graph, "lr", np.array(settings["lr"], np.float32))
    step = _add_state(graph, "step", np.array(0, np.int64)) if adam else None
    micro = _add_state(graph, "micro_step", np.array(0, np.int64)) if accumulate > 1 else None
    inputs = {}
    for p, _ in params:
        zeros = np.zeros(p.shape, helper.tensor_dtype_to_np_dtype(p.elem_type))
        for k in state_kinds(settings):
            inputs[f"{p.name}.{k}"] = _add_state(graph, f"{p.name}.{k}", zeros, weights)

    op = Builder(graph, names, prefix="optimizer", phase=OPTIMIZER)
    results: dict[str, Value] = {}  # state input name -> its next value
    grads = [g for _, g in params]
    apply = None
    if accumulate > 1:
        apply, results["micro_step"] = _count_micro_batch(op, micro, accumulate)
        grads = _accumulate(op, params, grads, inputs, results, apply, accumulate)
    if settings["clip_grad_norm"] is not None:
        grads = _clip_grad_norm(op, grads, [p.elem_type for p, _ in params], settings["clip_grad_norm"])
    hp = Hyper(op, settings, lr, step)
    update = UPDATES[kind]
    for (p, _), g in zip(params, grads):
        pop = Builder(graph, names, prefix=f"optimizer/{p.name}", phase=OPTIMIZER)
        own = {k: inputs[f"{p.name}.{k}"] for k in state_kinds(settings) if k != "grad_acc"}
        p_next, own_next = update(pop, hp, p, g, own)
        updated = [(p.name, p, p_next)] + [(f"{p.name}.{k}", own[k], v) for k, v in own_next.items()]
        for name, old, new in updated:  # with accumulation, only the K-th micro-batch changes them
            results[name] = new if apply is None else pop.Where(apply, new, old)
    if adam:
        results["step"] = hp.step_next if apply is None else op.Where(apply, hp.step_next, step)
    if scaler is not None:
        _skip_on_overflow(graph, op, scaler, [g for _, g in params], results)

    for name, next_name in state.items():
        v = results[name]
        like = graph.values[name]
        graph.rename(v, next_name)
        v.elem_type, v.shape = like.elem_type, like.shape
    kept = kept if settings["keep_grads"] else []
    graph.outputs[:] = original + [results[name] for name in state] + kept + extra
    settings = {**settings, "parameters": [p.name for p, _ in params]}
    graph.metadata[OPTIMIZER_KEY] = json.dumps(settings)
    graph.metadata[STATE_KEY] = json.dumps(state)


# -- the updates: (builder, hyper-parameters, p, g, own state) -> (p.next, own state.next) -----------------
class Hyper:
    """Hyper-parameters as scalars of each parameter's type, each built once per type; Adam's step terms."""

    def __init__(self, op: Builder, settings: dict, lr: Value, step: Value | None):
        self.op, self.s = op, settings
        self._cache: dict[tuple, Value] = {}
        self._scalars: dict[str, Value] = {"lr": lr}  # run-time scalars, each with its elem_type set
        if step is not None:
            self.step_next = op.Add(step, op.const(1, TensorProto.INT64))
            self._step_terms(lr)

    def __getitem__(self, key: str):
        return self.s[key]

    def const(self, value: float, elem_type: int) -> Value:
        key = ("const", float(value), elem_type)
        if key not in self._cache:
            self._cache[key] = self.op.const(value, elem_type)
        return self._cache[key]

    def scalar(self, name: str, elem_type: int) -> Value:
        """A run-time scalar (lr, step_size, bc2_sqrt, decay) cast to elem_type."""
        key = (name, elem_type)
        if key not in self._cache:
            source = self._scalars[name]
            self._cache[key] = source if source.elem_type == elem_type else self.op.Cast(source, to=elem_type)
        return self._cache[key]

    def _step_terms(self, lr: Value) -> None:
        """step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t), decay = 1 - lr*wd, in float64 as torch
        computes them (in Python)."""
        op, f64 = self.op, TensorProto.DOUBLE
        b1, b2 = self.s["betas"]
        t = op.Cast(self.step_next, to=f64)
        lr = op.Cast(lr, to=f64)
        one = op.const(1.0, f64)
        terms = {"step_size": op.Div(lr, op.Sub(one, op.Pow(op.const(b1, f64), t))),
                 "bc2_sqrt": op.Sqrt(op.Sub(one, op.Pow(op.const(b2, f64), t)))}
        if self.s["kind"] == "adamw" and self.s["weight_decay"]:
            terms["decay"] = op.Sub(one, op.Mul(lr, op.const(self.s["weight_decay"], f64)))
        for name, v in terms.items():
            v.elem_type = f64
            self._scalars[name] = v


def sgd(op: Builder, hp: Hyper, p: Value, g: Value, state: dict):
    """torch.optim.SGD, dampening 0: g += wd*p; buf = g + m*buf; g = g + m*buf if nesterov else buf; p -= lr*g"""
    dt = p.elem_type
    if hp["weight_decay"]:
        g = op.Add(g, op.Mul(p, hp.const(hp["weight_decay"], dt)))
    new_state = {}
    if hp["momentum"]:
        # buf starts at zeros, so the first step gives buf = g, as torch's clone of the first gradient.
        m = hp.const(hp["momentum"], dt)
        buf = new_state["momentum"] = op.Add(g, op.Mul(state["momentum"], m))
        g = op.Add(g, op.Mul(buf, m)) if hp["nesterov"] else buf
    return op.Sub(p, op.Mul(g, hp.scalar("lr", dt))), new_state


def adam(op: Builder, hp: Hyper, p: Value, g: Value, state: dict):
    """torch.optim.Adam / AdamW: m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g*g;
    p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps); wd: g += wd*p (adam), p *= 1 - lr*wd first (adamw)"""
    dt, (b1, b2) = p.elem_type, hp["betas"]
    wd, decoupled = hp["weight_decay"], hp["kind"] == "adamw"
    if wd and not decoupled:
        g = op.Add(g, op.Mul(p, hp.const(wd, dt)))
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    w = 1.0 - b1
    if abs(w) < 0.5:  # torch's lerp kernel, both branches
        m = op.Add(exp_avg, op.Mul(op.Sub(g, exp_avg), hp.const(w, dt)))
    else:
        m = op.Sub(g, op.Mul(op.Sub(g, exp_avg), hp.const(1.0 - w, dt)))
    v = op.Add(op.Mul(op.Mul(g, hp.const(1.0 - b2, dt)), g), op.Mul(exp_avg_sq, hp.const(b2, dt)))
    denom = op.Add(op.Div(op.Sqrt(v), hp.scalar("bc2_sqrt", dt)), hp.const(hp["eps"], dt))
    if wd and decoupled:
        p = op.Mul(p, hp.scalar("decay", dt))
    return op.Sub(p, op.Mul(op.Div(m, denom), hp.scalar("step_size", dt))), {"exp_avg": m, "exp_avg_sq": v}


UPDATES: dict[str, Callable] = {"sgd": sgd, "momentum": sgd, "adam": adam, "adamw": adam}


# -- mixed precision: skip a step whose gradients overflowed, and update the loss scale ----------------------
SKIPPED_STEPS = "loss_scale.skipped_steps"
SCALER_COUNTERS = ("loss_scale.good_steps", SKIPPED_STEPS)


def _skip_on_overflow(graph: Graph, op: Builder, scaler: dict, grads: list[Value], results: dict) -> None:
    """finite = not isnan(0 * sum of every gradient element): one reduction decides the step (an inf or a NaN
    anywhere makes the sum inf or NaN, and 0 * inf is NaN; a sum of finite gradients past float32's range, 3.4e38,
    counts as an overflow too). Every state value keeps its input when not finite.
    The scale (torch's _amp_update_scale_): backoff on overflow; growth after growth_interval finite steps in
    a row, unless the grown scale is infinite."""
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    sums = []
    for g in grads:
        s = op.ReduceSum(g, keepdims=0)  # no axes: over every element, at every opset
        sums.append(s if g.elem_type == f32 else op.Cast(s, to=f32))
    total = sums[0] if len(sums) == 1 else op.Sum(*sums)
    finite = op.Not(op.IsNaN(op.Mul(total, op.const(0.0, f32))))
    for name in list(results):
        results[name] = op.Where(finite, results[name], graph.values[name])
    scale = graph.values[LOSS_SCALE_INPUT]
    good, skipped = (_add_state(graph, name, np.array(0, np.int64)) for name in SCALER_COUNTERS)
    counted = op.Add(good, op.const(1, i64))
    grow = op.Equal(counted, op.const(scaler["growth_interval"], i64))  # >= after a resume with a new interval
    grow = op.Or(grow, op.Greater(counted, op.const(scaler["growth_interval"], i64)))
    grown = op.Mul(scale, op.const(scaler["growth_factor"], f32))
    grown = op.Where(op.IsInf(grown), scale, grown)
    kept = op.Where(grow, grown, scale)
    results[LOSS_SCALE_INPUT] = op.Where(finite, kept, op.Mul(scale, op.const(scaler["backoff_factor"], f32)))
    zero = op.const(0, i64)
    results[SCALER_COUNTERS[0]] = op.Where(finite, op.Where(grow, zero, counted), zero)
    results[SCALER_COUNTERS[1]] = op.Add(skipped, op.Cast(op.Not(finite), to=i64))


# -- what comes before the update: accumulation and clipping ------------------------------------------------
def _count_micro_batch(op: Builder, micro: Value, k: int) -> tuple[Value, Value]:
    """apply = (micro_step + 1 == k); micro_step.next = 0 when applying, else micro_step + 1."""
    int64 = TensorProto.INT64
    count = op.Add(micro, op.const(1, int64))
    apply = op.Equal(count, op.const(k, int64))
    return apply, op.Where(apply, op.const(0, int64), count)


def _accumulate(op: Builder, params, grads, inputs, results, apply, k: int) -> list[Value]:
    """total = grad_acc + g / k, the gradient the update uses; grad_acc.next = 0 when applying, else total."""
    totals = []
    for (p, _), g in zip(params, grads):
        acc = inputs[f"{p.name}.grad_acc"]
        total = op.Add(acc, op.Div(g, op.const(float(k), p.elem_type)))
        results[acc.name] = op.Where(apply, op.const(0.0, p.elem_type), total)
        totals.append(total)
    return totals


def _clip_grad_norm(op: Builder, grads: list[Value], types: list[int], max_norm: float) -> list[Value]:
    """torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (||all gradients||_2 + 1e-6)), in float32"""
    f32 = TensorProto.FLOAT
    squares = []
    for g, dt in zip(grads, types):
        sq = op.ReduceSumSquare(g, keepdims=0)  # no axes: over every element, at every opset
        squares.append(sq if dt == f32 else op.Cast(sq, to=f32))
    total = op.Sqrt(op.Sum(*squares))
    coef = op.Min(op.Div(op.const(max_norm, f32), op.Add(total, op.const(CLIP_EPS, f32))), op.const(1.0, f32))
    casts: dict[int, Value] = {f32: coef}
    out = []
    for g, dt in zip(grads, types):
        if dt not in casts:
            casts[dt] = op.Cast(coef, to=dt)
        out.append(op.Mul(g, casts[dt]))
    return out


# -- reading the training graph and adding inputs -----------------------------------------------------------
def _parameters(graph: Graph, names: list[str] | None) -> list[tuple[Value, Value]]:
    """(parameter, gradient) pairs: the named ones, or every initializer with a `<p>_grad` output."""
    outputs = {v.name: v for v in graph.outputs}
    if names is None:
        names = [v.name[:-len(GRAD_SUFFIX)] for v in graph.outputs
                 if v.name.endswith(GRAD_SUFFIX) and v.name[:-len(GRAD_SUFFIX)] in graph.initializers]
        if not names:
            raise UsageError("the model has no <param>_grad outputs of initializers: is it a graph written by "
                             "onnxgrad build-grad?")
    pairs = []
    inputs = {id(v) for v in graph.inputs}
    for name in names:
        if name not in graph.initializers:
            raise UsageError(f"--optimizer: {name!r} has a gradient but no initializer, so no value to update "
                             f"(leave it out of --requires-grad, or ask for its gradient with --also-grad)")
        g = outputs.get(name + GRAD_SUFFIX)
        if g is None:
            raise UsageError(f"--optimizer: the parameter {name!r} has no {name + GRAD_SUFFIX!r} output")
        p = graph.values[name]
        if id(p) not in inputs:
            graph.inputs.append(p)
            inputs.add(id(p))
        pairs.append((p, g))
    return pairs


def _split_outputs(graph: Graph, params) -> tuple[list[Value], list[Value], list[Value]]:
    """(outputs before the first parameter gradient, the parameter gradients, the other gradients after)."""
    grad_ids = {id(g) for _, g in params}
    first = min(i for i, v in enumerate(graph.outputs) if id(v) in grad_ids)
    original = graph.outputs[:first]
    rest = graph.outputs[first:]
    return original, [v for v in rest if id(v) in grad_ids], [v for v in rest if id(v) not in grad_ids]


def _add_state(graph: Graph, name: str, initial: np.ndarray, weights: dict | None = None) -> Value:
    """A graph input with a stored initial value (so a caller may omit it)."""
    tensor = numpy_helper.from_array(initial, name)
    if weights is not None and should_stub(tensor):
        weights[name] = tensor
        tensor = stub_of(tensor)
    graph.initializers[name] = tensor
    v = Value(name, tensor.data_type, tuple(initial.shape))
    graph.values[name] = v
    graph.inputs.append(v)
    return v

