"""The ONNX backend node suite's models that hold a Scan or a Loop, run as gradient tests.

Every float tensor input that reaches a float tensor output is differentiated, every float output is a head
seeded with a random direction, and the point is the case's own input data. The checks are those of every rule
test (tests/gradcheck.py's check_model): the inner-product test against central differences in float64, the
full Jacobian where it is small, and the training graph in stock onnxruntime in its own precision. A case that
cannot be checked is listed in REFUSED with the reason, and the test proves that reason is what happens.
"""
from __future__ import annotations

import ctypes
import re
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxgrad
from gradcheck import check_model
from onnxgrad import gradcheck
from onnxgrad.contract import FLOAT_TYPES
from onnxgrad.errors import UsageError

HALF = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}

# case -> why it is not a gradient test (a regular expression the outcome must match)
REFUSED = {
    "test_loop13_seq": "no float tensor input",
    "test_loop16_seq_none": "no float tensor input",
    "test_range_int32_type_negative_delta_expanded": "no float tensor input",
    "test_sequence_map_identity_1_sequence_expanded": "no float tensor input",
    "test_sequence_map_identity_2_sequences_expanded": "no float tensor input",
    "test_sequence_map_add_2_sequences_expanded": "no float tensor input",
    "test_sequence_map_extract_shapes_expanded": "no float tensor input",
    "test_sequence_map_identity_1_sequence_1_tensor_expanded": "no float tensor input and output",
    "test_sequence_map_add_1_sequence_1_tensor_expanded": "no float tensor input and output",
    "test_scan_sum": "Scan node .* opset 8's batched form",
}

# The Range cases' points sit on a jump of the trip count: (limit - start) / delta is a whole number, so any step
# of the finite differences changes the output's length. Their start is moved off the jump (1 -> 1.5: still two
# elements).
MOVED = {name: {"start": np.array(1.5)} for name in ("test_range_float_type_positive_delta_expanded",
                                                     "test_range_float16_type_positive_delta_expanded",
                                                     "test_range_bfloat16_type_positive_delta_expanded")}


def _has_loop(g: onnx.GraphProto) -> bool:
    return any(n.op_type in ("Scan", "Loop") or any(a.type == onnx.AttributeProto.GRAPH and _has_loop(a.g)
                                                     for a in n.attribute) for n in g.node)


def _cases():
    from onnx.backend.test.case import node
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = [c for c in node.collect_testcases() if c.model is not None and _has_loop(c.model.graph)]
    return {c.name: c for c in found}


CASES = _cases()


def _float_tensors(values) -> list[str]:
    return [v.name for v in values if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in FLOAT_TYPES]


def gradient_test(case) -> str:
    """Run the checks; returns what was differentiated, or raises the reason it cannot be."""
    model = case.model
    heads, wrt = _float_tensors(model.graph.output), _float_tensors(model.graph.input)
    if not heads or not wrt:
        raise UsageError("no float tensor input and output to differentiate")
    while True:  # inputs that reach the outputs only through non-differentiable edges (Range's limit) are left
        try:
            train = onnxgrad.build(model, loss=heads, requires_grad=wrt, feed_head_grads=True).model
            break
        except UsageError as e:
            m = re.match(r"--requires-grad (\S+): not reachable", str(e))
            if not m or len(wrt) == 1:
                raise
            wrt.remove(m.group(1))
    inputs, _ = case.data_sets[0]
    floats = set(_float_tensors(model.graph.input))
    x = {vi.name: np.asarray(v).astype(np.float32).astype(np.float64) if vi.name in floats else np.asarray(v)
         for vi, v in zip(model.graph.input, inputs)}
    x.update(MOVED.get(case.name, {}))
    model, train = _runnable(model), _runnable(train)
    f = gradcheck.Runner(gradcheck.to_float64(model), fallback=gradcheck.reference_evaluator)
    b = gradcheck.Runner(gradcheck.to_float64(train), fallback=gradcheck.reference_evaluator)
    y0 = [f(x)[h] for h in heads]
    rng = np.random.default_rng(0)
    half = any(v.type.tensor_type.elem_type in HALF for v in model.graph.input)
    check_model(lambda feeds: [f(feeds)[h] for h in heads], b, x, wrt, heads, [y.shape for y in y0],
                [np.float64] * len(heads), None if half else train, rng, eps=1e-6, tol=1e-6, tol32=2e-3,
                label=case.name)
    if half:  # the half-precision graph in onnxruntime, against the float64 one
        _half_agrees(train, x, heads, wrt, b, [y.shape for y in y0], rng)
    return ",".join(wrt)


def _runnable(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime 1.31 refuses opset 27, still in development; the expanded functions stamped with it use no
    op changed since opset 26, so they run stamped 26."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for o in out.opset_import:
        if o.domain in ("", "ai.onnx") and o.version > 26:
            o.version = 26
    return out


def _array(v: "ort.OrtValue", bf16) -> np.ndarray:
    if v.data_type() != "tensor(bfloat16)":
        return v.numpy()
    count = int(np.prod(v.shape()))
    bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(v.data_ptr())) if count else np.zeros(0)
    return bits.astype(np.uint16).view(bf16).reshape(v.shape())


def _half_agrees(train, x, heads, wrt, b, shapes, rng):
    from onnxgrad import runtime
    types = {vi.name: onnx.helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type) for vi in train.graph.input}
    c = [rng.standard_normal(s) for s in shapes]
    feeds = {n: np.asarray(v).astype(types[n]) for n, v in x.items()}
    feeds.update({h + "_grad": ci.astype(types[h + "_grad"]) for h, ci in zip(heads, c)})
    sess = runtime.session(train)
    bf16 = onnx.helper.tensor_dtype_to_np_dtype(onnx.TensorProto.BFLOAT16)
    # onnxruntime's Python API takes bfloat16 arrays as OrtValues of their bits, and gives them back as bits
    feeds = {n: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(v.view(np.uint16), onnx.TensorProto.BFLOAT16)
             if v.dtype == bf16 else v for n, v in feeds.items()}
    outs = sess.run_with_ort_values(None, {n: v if isinstance(v, ort.OrtValue) else ort.OrtValue.ortvalue_from_numpy(v)
                                           for n, v in feeds.items()})
    got = {o.name: _array(v, bf16) for o, v in zip(train.graph.output, outs)}
    want = b({**x, **{h + "_grad": ci for h, ci in zip(heads, c)}})
    for n in wrt:
        err = gradcheck.relative_error(got[n + "_grad"].astype(np.float64), want[n + "_grad"])
        assert err <= 2e-2, f"half-precision onnxruntime gradient of {n} off by {err:.2e}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_node_suite_case(name):
    if name in REFUSED:
        with pytest.raises(Exception, match=REFUSED[name]):
            gradient_test(CASES[name])
    else:
        gradient_test(CASES[name])
