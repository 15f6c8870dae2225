"""Gradients through If, the recurrent ops (unrolled), the sequence ops (rewritten), training-mode BatchNorm and
Dropout; and the refusals, each naming the form and what to do.

None of these fits the one-op table of tests/cases (see tests/cases/control.py), so each model is built here
and goes through `check_gradients`, which hands it to the checker's `check_model` (tests/gradcheck.py): the
inner-product test <t, J^T c> = <J t, c> with J t by central differences, the full Jacobian on tiny shapes, and
the float32 training graph in onnxruntime against the float64 gradients. The recurrent ops are differentiated through
their unrolled form, so their finite differences are taken of that form (onnxruntime has no float64 LSTM or
GRU kernel), and separate tests prove the unrolled forward equal to onnxruntime's own LSTM, GRU and RNN.
LSTM, GRU and training BatchNorm are also checked against PyTorch autograd.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import onnxgrad
from gradcheck import Runner, check_model
from onnxgrad import runtime
from onnxgrad.errors import UnsupportedError
from onnxgrad.ir import from_model

torch.set_num_threads(2)


# -- the checker, for whole models -----------------------------------------------------------------------------
def _make(graph_fn, dtype, opset):
    elem = h.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model = h.make_model(graph_fn(elem, dtype), opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)


def _train(model, heads, wrt):
    return onnxgrad.build(model, loss=heads, requires_grad=wrt, feed_head_grads=True).model


def check_gradients(graph_fn, heads, wrt, feeds, *, opset=18, lowered=False, tol=1e-6, tol32=2e-3, seed=0):
    """graph_fn(elem_type, np_dtype) -> GraphProto; feeds: float64 values of every graph input (wrt: those
    differentiated). `lowered`: take finite differences of the training graph's forward part."""
    rng = np.random.default_rng(seed)
    fwd = _make(graph_fn, np.float64, opset)
    b = Runner(_train(fwd, heads, wrt))
    shapes = {o.name: [d.dim_value for d in o.type.tensor_type.shape.dim] for o in fwd.graph.output}
    f = None if lowered else Runner(fwd)

    def backward(x):
        return dict(zip(b.outputs, b(x)))

    def forward(x):
        if lowered:
            out = backward({**x, **{n + "_grad": np.zeros(shapes[n]) for n in heads}})
            return [out[n] for n in heads]
        return [y for o, y in zip(f.outputs, f(x)) if o in heads]

    train32 = _train(_make(graph_fn, np.float32, opset), heads, wrt)
    check_model(forward, backward, feeds, wrt, heads, [shapes[n] for n in heads], [np.float64] * len(heads), train32,
                rng, eps=1e-6, tol=tol, tol32=tol32)


def vi(name, elem, shape):
    return h.make_tensor_value_info(name, elem, shape)


def const(name, value, dtype=np.int64):
    return nh.from_array(np.asarray(value, dtype=dtype), name)


# -- If --------------------------------------------------------------------------------------------------------
def if_graph(elem, dtype):
    """y = If(sum(x) > 0: sin(x * w) + v, else: cos(x * x)); loss = sum(y * y). w is read by one branch only."""
    then = h.make_graph([h.make_node("Mul", ["x", "w"], ["t1"]), h.make_node("Sin", ["t1"], ["t2"]),
                         h.make_node("Add", ["t2", "v"], ["t3"])], "then", [], [vi("t3", elem, [2, 3])])
    other = h.make_graph([h.make_node("Mul", ["x", "x"], ["t1"]), h.make_node("Cos", ["t1"], ["t3"])], "else", [],
                         [vi("t3", elem, [2, 3])])
    nodes = [h.make_node("ReduceSum", ["x"], ["sx"], keepdims=0),
             h.make_node("Greater", ["sx", "zero"], ["cond"]),
             h.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other, name="branch"),
             h.make_node("Mul", ["y", "y"], ["y2"]), h.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    return h.make_graph(nodes, "if", [vi("x", elem, [2, 3]), vi("v", elem, [3])], [vi("loss", elem, [])],
                        [const("zero", 0.0, dtype), const("w", [0.5, -1.0, 2.0], dtype)])


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["then", "else"])
def test_if_both_branches(sign):
    x = np.abs(np.random.default_rng(1).uniform(0.5, 1.5, (2, 3))) * sign
    v = np.array([0.1, 0.2, -0.3])
    check_gradients(if_graph, ["loss"], ["x", "v"], {"x": x, "v": v})


def test_if_parameter_read_by_one_branch_gets_zeros_from_the_other():
    # y's gradient, which the backward If reads, is an output as well
    train = onnxgrad.build(_make(if_graph, np.float32, 18), requires_grad=["w", "x"], also_grad=["y"]).model
    sess = runtime.session(train)
    x = np.full((2, 3), -0.5, np.float32)  # the else branch, which does not read w
    out = dict(zip([o.name for o in train.graph.output], sess.run(None, {"x": x, "v": np.zeros(3, np.float32)})))
    np.testing.assert_array_equal(out["w_grad"], np.zeros(3, np.float32))
    y = np.cos(x * x)
    np.testing.assert_allclose(out["y_grad"], 2 * y, rtol=1e-6)
    np.testing.assert_allclose(out["x_grad"], 2 * y * -np.sin(x * x) * 2 * x, rtol=1e-5)


def if_multi_graph(elem, dtype):
    """An If with three outputs: one float output unused by the loss, one integer output, nested If inside."""
    inner_then = h.make_graph([h.make_node("Mul", ["a", "w"], ["i1"])], "inner_then", [], [vi("i1", elem, [2, 3])])
    inner_else = h.make_graph([h.make_node("Tanh", ["a"], ["i1"])], "inner_else", [], [vi("i1", elem, [2, 3])])
    then = h.make_graph([h.make_node("Exp", ["x"], ["a"]),
                         h.make_node("If", ["c2"], ["b"], then_branch=inner_then, else_branch=inner_else),
                         h.make_node("Neg", ["x"], ["unused"]), h.make_node("Shape", ["x"], ["shp"])],
                        "then", [], [vi("b", elem, [2, 3]), vi("unused", elem, [2, 3]), vi("shp", T.INT64, [2])])
    other = h.make_graph([h.make_node("Mul", ["x", "w"], ["b"]), h.make_node("Sigmoid", ["x"], ["unused"]),
                          h.make_node("Shape", ["w"], ["shp_else"])],  # onnx's data propagation wants distinct names
                         "else", [], [vi("b", elem, [2, 3]), vi("unused", elem, [2, 3]), vi("shp_else", T.INT64, [1])])
    nodes = [h.make_node("If", ["c1"], ["y", "z", "s"], then_branch=then, else_branch=other, name="outer"),
             h.make_node("ReduceSumSquare", ["y"], ["loss"], keepdims=0)]
    return h.make_graph(nodes, "if_multi", [vi("x", elem, [2, 3]), vi("w", elem, [3]), vi("c1", T.BOOL, []),
                                             vi("c2", T.BOOL, [])],
                        [vi("loss", elem, []), vi("z", elem, [2, 3]), vi("s", T.INT64, None)])


@pytest.mark.parametrize("c1,c2", [(True, True), (True, False), (False, True)])
def test_if_nested_with_unused_and_integer_outputs(c1, c2):
    rng = np.random.default_rng(2)
    feeds = {"x": rng.uniform(-1, 1, (2, 3)), "w": rng.uniform(-1, 1, 3), "c1": np.array(c1), "c2": np.array(c2)}
    check_gradients(if_multi_graph, ["loss"], ["x", "w"], feeds)


def if_symbolic_graph(elem, dtype):
    """The batch dim is symbolic; v is read by the then branch only, so the else branch's zeros take its
    shape at run time."""
    then = h.make_graph([h.make_node("Mul", ["x", "v"], ["t"])], "then", [], [vi("t", elem, ["N", 3])])
    other = h.make_graph([h.make_node("Softplus", ["x"], ["t"])], "else", [], [vi("t", elem, ["N", 3])])
    nodes = [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    return h.make_graph(nodes, "if_sym", [vi("x", elem, ["N", 3]), vi("v", elem, ["N", 3]), vi("c", T.BOOL, [])],
                        [vi("loss", elem, [])])


@pytest.mark.parametrize("cond", [True, False])
def test_if_symbolic_dims(cond):
    train = onnxgrad.build(_make(if_symbolic_graph, np.float32, 18), requires_grad=["x", "v"]).model
    sess = runtime.session(train)
    rng = np.random.default_rng(3)
    for n in (1, 4):  # one graph serves every batch size
        x, v = rng.standard_normal((n, 3)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)
        out = dict(zip([o.name for o in train.graph.output], sess.run(None, {"x": x, "v": v, "c": np.array(cond)})))
        want_x = v if cond else 1 / (1 + np.exp(-x))
        np.testing.assert_allclose(out["x_grad"], want_x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["v_grad"], x if cond else np.zeros_like(v), rtol=1e-5, atol=1e-6)


def test_if_implicit_inputs_are_node_inputs_for_the_walker():
    graph = from_model(_make(if_graph, np.float32, 18))
    node = next(n for n in graph.nodes if n.op_type == "If")
    assert [v.name for v in node.implicit_inputs] == ["x", "w", "v"]
    assert [v.name for v in node.inputs] == ["cond"]
    assert (node, 2) in graph.values["w"].uses
    assert node.to_proto().input == ["cond"]  # written back as it was


def test_if_branch_with_a_random_op_is_refused():
    def graph(elem, dtype):
        then = h.make_graph([h.make_node("RandomNormalLike", ["x"], ["n"]), h.make_node("Mul", ["x", "n"], ["t"])],
                            "then", [], [vi("t", elem, [2, 3])])
        other = h.make_graph([h.make_node("Identity", ["x"], ["t"])], "else", [], [vi("t", elem, [2, 3])])
        return h.make_graph([h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other, name="noisy"),
                             h.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                            [vi("x", elem, [2, 3]), vi("c", T.BOOL, [])], [vi("loss", elem, [])])
    with pytest.raises(UnsupportedError, match=r"If node 'noisy'.*RandomNormalLike.*draws random numbers.*move the"):
        onnxgrad.build(_make(graph, np.float32, 18), requires_grad=["x"])


# -- LSTM, GRU, RNN ----------------------------------------------------------------------------------------------
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent(op, *, S=3, B=2, I=3, H=2, direction="forward", bias=True, init=True, layout=0, peepholes=False,
              seq_lens=False, attrs=None, opset=18, batch=None, seq=None):
    """(graph_fn, feeds, wrt, heads): every float operand a graph input, every output a head."""
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op]
    rng = np.random.default_rng(4)
    shapes = {"X": (B, S, I) if layout else (S, B, I), "W": (D, G * H, I), "R": (D, G * H, H)}
    if bias:
        shapes["B"] = (D, 2 * G * H)
    state = (B, D, H) if layout else (D, B, H)
    if init:
        shapes["h0"] = state
        if op == "LSTM":
            shapes["c0"] = state
    if peepholes:
        shapes["P"] = (D, 3 * H)
    feeds = {n: rng.uniform(-1, 1, s) for n, s in shapes.items()}
    slots = ["X", "W", "R", "B", "seq_lens", "h0", "c0", "P"][:8 if op == "LSTM" else 6]
    names = [n if n in shapes or (n == "seq_lens" and seq_lens) else "" for n in slots]
    while names[-1] == "":
        names.pop()
    outs = ["Y", "Y_h", "Y_c"][:3 if op == "LSTM" else 2]
    a = {"hidden_size": H, "direction": direction, **({"layout": layout} if opset >= 14 else {}), **(attrs or {})}

    def graph_fn(elem, dtype):
        inputs = []
        for n, s in shapes.items():
            dims = list(s)
            if n == "X" and batch:
                dims[1 - layout] = batch
            if n in ("h0", "c0") and batch:
                dims[0 if layout else 1] = batch
            if n == "X" and seq:
                dims[layout] = seq
            inputs.append(vi(n, elem, dims))
        inits = [const("seq_lens", [S] * B, np.int32)] if seq_lens else []
        return h.make_graph([h.make_node(op, names, outs, name="rec", **a)], "rnn", inputs,
                            [h.make_value_info(o, onnx.TypeProto()) for o in outs], inits)
    return graph_fn, feeds, list(shapes), outs


def ort_reference(model, feeds, layout):
    """onnxruntime's own op; for layout 1, which it does not run, its layout-0 twin on transposed tensors."""
    if not layout:
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    for a in twin.graph.node[0].attribute:
        if a.name == "layout":
            a.i = 0
    for v in [*twin.graph.input, *twin.graph.output, *twin.graph.value_info]:
        v.type.tensor_type.ClearField("shape")
    sess = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = sess.run(None, {k: v.transpose(1, 0, 2) if k in ("X", "h0", "c0") else v for k, v in feeds.items()})
    return [outs[0].transpose(2, 0, 1, 3)] + [o.transpose(1, 0, 2) for o in outs[1:]]


RECURRENT_FORMS = {
    "LSTM-forward": ("LSTM", {}),
    "LSTM-reverse-no-bias-no-init-layout1": ("LSTM", dict(direction="reverse", bias=False, init=False, layout=1)),
    "LSTM-bidirectional-layout1": ("LSTM", dict(direction="bidirectional", layout=1)),
    "LSTM-bidirectional-no-init": ("LSTM", dict(direction="bidirectional", init=False)),
    "LSTM-peepholes": ("LSTM", dict(peepholes=True)),
    "LSTM-peepholes-bidirectional-no-init": ("LSTM", dict(peepholes=True, direction="bidirectional", init=False)),
    "LSTM-input-forget": ("LSTM", dict(attrs={"input_forget": 1})),
    "LSTM-clip": ("LSTM", dict(attrs={"clip": 0.6})),
    "LSTM-activations": ("LSTM", dict(attrs={"activations": ["HardSigmoid", "Tanh", "Softsign"],
                                             "activation_alpha": [0.25], "activation_beta": [0.45]})),
    "LSTM-full-seq-lens": ("LSTM", dict(seq_lens=True)),
    "LSTM-opset13": ("LSTM", dict(opset=13)),
    "GRU-forward": ("GRU", {}),
    "GRU-reverse-no-bias-no-init-layout1": ("GRU", dict(direction="reverse", bias=False, init=False, layout=1)),
    "GRU-bidirectional": ("GRU", dict(direction="bidirectional")),
    "GRU-linear-before-reset": ("GRU", dict(attrs={"linear_before_reset": 1})),
    "GRU-linear-before-reset-no-init-bidirectional": ("GRU", dict(attrs={"linear_before_reset": 1}, init=False,
                                                                  direction="bidirectional", layout=1)),
    "GRU-clip-activations": ("GRU", dict(attrs={"clip": 0.5, "activations": ["HardSigmoid", "LeakyRelu"],
                                                "activation_alpha": [0.3, 0.2], "activation_beta": [0.45]})),
    "RNN-forward": ("RNN", {}),
    "RNN-reverse-no-bias-no-init": ("RNN", dict(direction="reverse", bias=False, init=False)),
    "RNN-bidirectional-layout1": ("RNN", dict(direction="bidirectional", layout=1)),
    "RNN-activations": ("RNN", dict(direction="bidirectional", attrs={
        "activations": ["ScaledTanh", "Affine"], "activation_alpha": [0.7, 0.5], "activation_beta": [1.3, 0.1]})),
    "RNN-opset22": ("RNN", dict(opset=22)),
}


@pytest.mark.parametrize("form", list(RECURRENT_FORMS))
def test_recurrent_unrolled_forward_equals_onnxruntime(form):
    op, kw = RECURRENT_FORMS[form]
    graph_fn, feeds, wrt, outs = recurrent(op, **kw)
    model = _make(graph_fn, np.float32, kw.get("opset", 18))
    feeds32 = {k: v.astype(np.float32) for k, v in feeds.items()}
    want = ort_reference(model, feeds32, kw.get("layout", 0))
    train = _train(model, outs, wrt)
    assert not any(n.op_type == op for n in train.graph.node), "the recurrent node was not unrolled"
    feeds32.update({o + "_grad": np.zeros_like(w) for o, w in zip(outs, want)})
    got = runtime.session(train).run(outs, feeds32)
    for name, g, w in zip(outs, got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"{form}: {name}")


@pytest.mark.parametrize("form", list(RECURRENT_FORMS))
def test_recurrent_gradients(form):
    op, kw = RECURRENT_FORMS[form]
    graph_fn, feeds, wrt, outs = recurrent(op, **kw)
    check_gradients(graph_fn, outs, wrt, feeds, opset=kw.get("opset", 18), lowered=True)


def test_recurrent_symbolic_batch():
    graph_fn, feeds, wrt, outs = recurrent("LSTM", direction="bidirectional", batch="N")
    train = _train(_make(graph_fn, np.float32, 18), ["Y"], wrt)
    sess = runtime.session(train)
    for n in (1, 3):
        rng = np.random.default_rng(n)
        f = {k: rng.uniform(-1, 1, (v.shape[0], n, v.shape[2]) if k in ("X", "h0", "c0") else v.shape)
             .astype(np.float32) for k, v in feeds.items()}
        f["Y_grad"] = np.ones((3, 2, n, 2), np.float32)
        out = dict(zip([o.name for o in train.graph.output], sess.run(None, f)))
        assert out["X_grad"].shape == (3, n, 3) and out["h0_grad"].shape == (2, n, 2)


@pytest.mark.parametrize("case,message", [
    (dict(seq="S"), r"LSTM node 'rec': the sequence length of X 'X' is not static \('S'\).*--dim S=N"),
    (dict(batch="N", seq_lens=True), None),  # full-length constant lengths are fine
])
def test_recurrent_symbolic_sequence_refused(case, message):
    graph_fn, feeds, wrt, outs = recurrent("LSTM", init=False, **case)
    model = _make(graph_fn, np.float32, 18)
    if message is None:
        onnxgrad.build(model, loss=outs, requires_grad=wrt)
        return
    with pytest.raises(UnsupportedError, match=message):
        onnxgrad.build(model, loss=outs, requires_grad=wrt)
    onnxgrad.build(model, loss=outs, requires_grad=wrt, dims={"S": 3})  # bound: unrolled


def _with_node_change(graph_fn, change):
    def changed(elem, dtype):
        g = graph_fn(elem, dtype)
        change(g)
        return g
    return changed


@pytest.mark.parametrize("change,message", [
    ("short-lengths", r"sequence_lens holds lengths other than the sequence length 3; only full-length"),
    ("runtime-lengths", r"sequence_lens 'seq_lens' is not a constant; only full-length sequences"),
    ("activation", r"activation 'Swish' is not supported \(supported: Sigmoid, Tanh"),
])
def test_recurrent_refusals(change, message):
    graph_fn, feeds, wrt, outs = recurrent("GRU", seq_lens=True, init=False)

    def edit(g):
        if change == "short-lengths":
            g.initializer[0].CopyFrom(const("seq_lens", [3, 2], np.int32))
        elif change == "runtime-lengths":
            del g.initializer[:]
            g.input.append(vi("seq_lens", T.INT32, [2]))
        else:
            g.node[0].attribute.append(h.make_attribute("activations", ["Sigmoid", "Swish"]))
    model = _make(_with_node_change(graph_fn, edit), np.float32, 18)
    with pytest.raises(UnsupportedError, match=r"no gradient for GRU node 'rec': " + message):
        onnxgrad.build(model, loss=outs, requires_grad=wrt)


def test_recurrent_off_the_gradient_path_is_left_alone():
    """A frozen recurrent layer whose output the loss does not read is neither unrolled nor refused."""
    graph_fn, feeds, wrt, outs = recurrent("RNN", seq="S")

    def with_loss(elem, dtype):
        g = graph_fn(elem, dtype)
        g.node.append(h.make_node("ReduceSumSquare", ["X"], ["loss"], keepdims=0))
        g.output.append(vi("loss", elem, []))
        return g
    train = onnxgrad.build(_make(with_loss, np.float32, 18), loss="loss", requires_grad=["X"]).model
    assert [n.op_type for n in train.graph.node].count("RNN") == 1


# -- against PyTorch ---------------------------------------------------------------------------------------------
def _onnx_weights(module, kind, directions, grad=False):
    """torch's (i, f, g, o) LSTM and (r, z, n) GRU gate blocks in ONNX's (i, o, f, c) and (z, r, h) order:
    W, R, B from the parameters, or from their gradients."""
    order = [0, 3, 1, 2] if kind == "LSTM" else [1, 0, 2]

    def get(name):
        p = getattr(module, name)
        t = p.grad if grad else p
        return torch.cat([t.detach().chunk(len(order))[k] for k in order])
    suffixes = ["", "_reverse"][:directions]
    W = torch.stack([get("weight_ih_l0" + s) for s in suffixes])
    R = torch.stack([get("weight_hh_l0" + s) for s in suffixes])
    B = torch.stack([torch.cat([get("bias_ih_l0" + s), get("bias_hh_l0" + s)]) for s in suffixes])
    return W, R, B


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["uni", "bi"])
def test_recurrent_matches_torch(kind, bidirectional):
    S, Bt, I, H = 4, 2, 3, 5
    D = 2 if bidirectional else 1
    torch.manual_seed(0)
    module = (torch.nn.LSTM if kind == "LSTM" else torch.nn.GRU)(I, H, bidirectional=bidirectional).double()
    x = torch.randn(S, Bt, I, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(D, Bt, H, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(D, Bt, H, dtype=torch.float64, requires_grad=True)
    targets = [torch.randn(S, Bt, D * H, dtype=torch.float64), torch.randn(D, Bt, H, dtype=torch.float64),
               torch.randn(D, Bt, H, dtype=torch.float64)]
    if kind == "LSTM":
        y, (hn, cn) = module(x, (h0, c0))
        outs = [y, hn, cn]
    else:
        y, hn = module(x, h0)
        outs = [y, hn]
    loss = sum((o * t).sum() for o, t in zip(outs, targets))
    loss.backward()
    W, R, B = _onnx_weights(module, kind, D)
    gW, gR, gB = _onnx_weights(module, kind, D, grad=True)

    # torch's Y is (S, B, D*H); ONNX's is (S, D, B, H): the loss reads it through a Transpose and Reshape
    graph_fn, _, _, names = recurrent(kind, S=S, B=Bt, I=I, H=H, direction="bidirectional" if bidirectional
                                      else "forward", attrs={"linear_before_reset": 1} if kind == "GRU" else None)
    def with_loss(elem, dtype):
        g = graph_fn(elem, dtype)
        g.node.extend([h.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
                       h.make_node("Reshape", ["Yt", "flat"], ["Yf"]),
                       h.make_node("Mul", ["Yf", "T0"], ["p0"]), h.make_node("ReduceSum", ["p0"], ["l0"], keepdims=0),
                       h.make_node("Mul", ["Y_h", "T1"], ["p1"]), h.make_node("ReduceSum", ["p1"], ["l1"], keepdims=0)])
        parts = ["l0", "l1"]
        if kind == "LSTM":
            g.node.extend([h.make_node("Mul", ["Y_c", "T2"], ["p2"]),
                           h.make_node("ReduceSum", ["p2"], ["l2"], keepdims=0)])
            parts.append("l2")
        g.node.append(h.make_node("Sum", parts, ["loss"]))
        g.initializer.extend([const("flat", [S, Bt, D * H])] +
                             [nh.from_array(t.numpy(), f"T{k}") for k, t in enumerate(targets[:len(parts)])])
        del g.output[:]
        g.output.append(vi("loss", elem, []))
        return g
    wrt = ["X", "W", "R", "B", "h0"] + (["c0"] if kind == "LSTM" else [])
    train = onnxgrad.build(_make(with_loss, np.float64, 18), requires_grad=wrt).model
    feeds = {"X": x, "W": W, "R": R, "B": B, "h0": h0, "c0": c0}
    feeds = {k: v.detach().numpy() for k, v in feeds.items() if k in wrt}
    out = dict(zip([o.name for o in train.graph.output], runtime.session(train).run(None, feeds)))
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-10)
    for name, theirs in [("X", x.grad), ("W", gW), ("R", gR), ("B", gB), ("h0", h0.grad), ("c0", c0.grad)][:len(wrt)]:
        np.testing.assert_allclose(out[name + "_grad"], theirs.numpy(), rtol=1e-9, atol=1e-10,
                                   err_msg=f"{kind}: gradient of {name}")


# -- sequences ---------------------------------------------------------------------------------------------------
def sequence_graph(elem, dtype):
    """Every sequence op the rewrite handles, in one chain: split, pick, build, insert, erase, stack, concat."""
    nodes = [
        h.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
        h.make_node("SequenceAt", ["rows", "one"], ["a"]),
        h.make_node("SequenceAt", ["rows", "minus1"], ["b"]),
        h.make_node("Mul", ["a", "b"], ["ab"]),
        h.make_node("SequenceConstruct", ["ab", "a"], ["s2"]),
        h.make_node("SequenceInsert", ["s2", "b", "one"], ["s3"]),
        h.make_node("SequenceInsert", ["s3", "ab"], ["s4"]),
        h.make_node("SequenceErase", ["s4", "zero"], ["s5"]),
        h.make_node("SequenceErase", ["s5"], ["s6"]),
        h.make_node("ConcatFromSequence", ["s6"], ["stacked"], axis=-1, new_axis=1),
        h.make_node("SplitToSequence", ["x", "two"], ["cols"], axis=-1),
        h.make_node("ConcatFromSequence", ["cols"], ["joined"], axis=1),
        h.make_node("SplitToSequence", ["x", "sizes"], ["parts"], axis=0),
        h.make_node("SequenceAt", ["parts", "one"], ["p1"]),
        h.make_node("SequenceEmpty", [], ["empty"], dtype=elem),
        h.make_node("SequenceInsert", ["empty", "p1"], ["s7"]),
        h.make_node("ConcatFromSequence", ["s7"], ["single"], axis=0),
        h.make_node("SequenceLength", ["cols"], ["n"]),
        h.make_node("Cast", ["n"], ["nf"], to=elem),
        h.make_node("Sin", ["stacked"], ["o1"]),
        h.make_node("Mul", ["joined", "nf"], ["o2"]),
        h.make_node("Exp", ["single"], ["o3"]),
    ]
    inits = [const("one", 1), const("minus1", -1), const("zero", 0), const("two", 2), const("sizes", [1, 3])]
    return h.make_graph(nodes, "seq", [vi("x", elem, [4, 3])],
                        [vi("o1", elem, [3, 2]), vi("o2", elem, [4, 3]), vi("o3", elem, [3, 3])], inits)


def test_sequence_chain_gradients():
    x = np.random.default_rng(5).standard_normal((4, 3))
    check_gradients(sequence_graph, ["o1", "o2", "o3"], ["x"], {"x": x})
    train = _train(_make(sequence_graph, np.float32, 18), ["o1", "o2", "o3"], ["x"])
    assert not {n.op_type for n in train.graph.node} & {"SplitToSequence", "SequenceAt", "ConcatFromSequence",
                                                        "SequenceConstruct", "SequenceInsert", "SequenceLength"}


def test_sequence_with_a_runtime_position_is_refused():
    def graph(elem, dtype):
        return h.make_graph([h.make_node("SplitToSequence", ["x"], ["rows"], axis=0, keepdims=0),
                             h.make_node("SequenceAt", ["rows", "i"], ["a"], name="pick"),
                             h.make_node("ReduceSum", ["a"], ["loss"], keepdims=0)], "g",
                            [vi("x", elem, [4, 3]), vi("i", T.INT64, [])], [vi("loss", elem, [])])
    with pytest.raises(UnsupportedError, match=r"SequenceAt node 'pick': sequence values are differentiated only "
                                               r"in chains .* constant positions"):
        onnxgrad.build(_make(graph, np.float32, 18), requires_grad=["x"])


# -- BatchNormalization in training mode ---------------------------------------------------------------------------
def bn_graph(shape, opset_attrs=None):
    C = shape[1]

    def graph_fn(elem, dtype):
        node = h.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y", "running_mean",
                           "running_var"], training_mode=1, epsilon=2**-10, momentum=0.75)
        return h.make_graph([node], "bn", [vi("x", elem, list(shape)), vi("scale", elem, [C]), vi("bias", elem, [C])],
                            [vi("y", elem, list(shape)), vi("running_mean", elem, [C]), vi("running_var", elem, [C])],
                            [const("mean", np.linspace(-0.2, 0.3, C), dtype), const("var", np.linspace(0.5, 2, C), dtype)])
    return graph_fn


@pytest.mark.parametrize("shape,opset", [((3, 2), 15), ((2, 3, 4), 14), ((2, 2, 2, 3), 15), ((2, 2, 2, 2, 2), 18)])
def test_batchnorm_training_gradients(shape, opset):
    rng = np.random.default_rng(6)
    C = shape[1]
    feeds = {"x": rng.standard_normal(shape) + 0.5, "scale": rng.uniform(0.5, 1.5, C), "bias": rng.uniform(-1, 1, C)}
    check_gradients(bn_graph(shape), ["y"], ["x", "scale", "bias"], feeds, opset=opset)


def test_batchnorm_training_matches_torch():
    torch.manual_seed(0)
    # epsilon and momentum are float32 attributes in ONNX: exact binary fractions keep the comparison tight;
    # torch's momentum weighs the batch, ONNX's the running value
    bn = torch.nn.BatchNorm2d(3, eps=2**-10, momentum=0.25).double().train()
    with torch.no_grad():
        bn.running_mean.copy_(torch.from_numpy(np.linspace(-0.2, 0.3, 3)))
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = (torch.randn(4, 3, 2, 5, dtype=torch.float64) * 2 + 1).requires_grad_()
    target = torch.randn(4, 3, 2, 5, dtype=torch.float64)
    loss = (bn(x) * target).sum()
    loss.backward()

    def with_loss(elem, dtype):
        g = bn_graph((4, 3, 2, 5))(elem, dtype)
        g.node.extend([h.make_node("Mul", ["y", "target"], ["p"]), h.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)])
        g.initializer.append(nh.from_array(target.numpy(), "target"))
        g.output.insert(0, vi("loss", elem, []))
        return g
    train = onnxgrad.build(_make(with_loss, np.float64, 15), loss="loss", requires_grad=["x", "scale", "bias"]).model
    feeds = {"x": x.detach().numpy(), "scale": bn.weight.detach().numpy(), "bias": bn.bias.detach().numpy()}
    out = dict(zip([o.name for o in train.graph.output], runtime.session(train).run(None, feeds)))
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-10)
    np.testing.assert_allclose(out["running_mean"], bn.running_mean.numpy(), rtol=1e-10)
    for name, theirs in [("x", x), ("scale", bn.weight), ("bias", bn.bias)]:
        np.testing.assert_allclose(out[name + "_grad"], theirs.grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=name)


def test_batchnorm_running_statistics_carry_no_gradient():
    def graph(elem, dtype):
        g = bn_graph((2, 3, 4))(elem, dtype)
        g.node.append(h.make_node("ReduceSum", ["running_mean"], ["loss"], keepdims=0))
        g.output.insert(0, vi("loss", elem, []))
        return g
    with pytest.raises(UnsupportedError, match=r"BatchNormalization node '': the loss depends on the running_mean "
                                               r"or running_var output; running statistics carry no gradient"):
        onnxgrad.build(_make(graph, np.float32, 15), loss="loss", requires_grad=["x"])


# -- Dropout in training form ------------------------------------------------------------------------------------
@pytest.mark.parametrize("training", ["constant", "input"])
def test_dropout_training_without_mask_gets_one(training):
    """The gradient uses the mask of the same run: dx = dy * mask / (1 - ratio), mask = (y != 0) here."""
    def graph(elem, dtype):
        inputs = [vi("x", elem, [4, 5])] + ([vi("t", T.BOOL, [])] if training == "input" else [])
        inits = [const("r", 0.25, dtype)] + ([const("t", True, bool)] if training == "constant" else [])
        nodes = [h.make_node("Dropout", ["x", "r", "t"], ["y"], seed=7), h.make_node("Mul", ["y", "y"], ["y2"]),
                 h.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
        return h.make_graph(nodes, "g", inputs, [vi("loss", elem, [])], inits)
    train = onnxgrad.build(_make(graph, np.float32, 15), requires_grad=["x"], also_grad=["y"]).model
    dropout = next(n for n in train.graph.node if n.op_type == "Dropout")
    assert list(dropout.output) == ["y", "y_mask"]
    sess = runtime.session(train)
    x = np.random.default_rng(7).uniform(0.5, 1.5, (4, 5)).astype(np.float32)
    dropped = 0
    for t in [True] if training == "constant" else [True, False]:
        for _ in range(3):  # a new mask each run, the gradient always from the run's own mask
            feeds = {"x": x} if training == "constant" else {"x": x, "t": np.array(t)}
            out = dict(zip([o.name for o in train.graph.output], sess.run(None, feeds)))
            y = out["y_grad"] / 2  # d(sum y^2)/dy = 2y
            keep = 0.75 if t else 1.0
            np.testing.assert_allclose(out["x_grad"], 2 * y * (y != 0) / keep, rtol=1e-6)
            dropped += int((y == 0).sum())
    assert dropped > 0


class _TrainingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.drop = torch.nn.Dropout(0.0)  # training form, but a mask that keeps everything, as in torch
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return (self.fc(torch.nn.functional.adaptive_avg_pool2d(h, 1).flatten(1)) ** 2).mean()


def test_torch_training_export_matches_autograd(tmp_path):
    """torch's TorchScript exporter in training mode writes BatchNormalization(training_mode=1) with its running
    statistics outputs, and Dropout with training_mode true and a mask output."""
    torch.manual_seed(0)
    net = _TrainingNet().train()
    x = torch.randn(4, 2, 5, 5)
    path = tmp_path / "net.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    exported = onnx.load(str(path))
    bn = next(n for n in exported.graph.node if n.op_type == "BatchNormalization")
    assert h.get_attribute_value(next(a for a in bn.attribute if a.name == "training_mode")) == 1
    assert any(n.op_type == "Dropout" for n in exported.graph.node)
    result = onnxgrad.build(exported, frozen=["bn.running_mean", "bn.running_var"])
    params = dict(net.named_parameters())
    assert result.report["parameters"] == list(params)
    sess = runtime.session(result.model)
    out = dict(zip([o.name for o in result.model.graph.output],
                   sess.run(None, {exported.graph.input[0].name: x.numpy()})))
    loss = net(x)
    loss.backward()
    np.testing.assert_allclose(out[result.report["loss"]], loss.item(), rtol=1e-5)
    for name, p in params.items():  # conv.bias's true gradient is 0: BatchNorm removes the channel mean
        np.testing.assert_allclose(out[name + "_grad"], p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert np.abs(params["bn.weight"].grad.numpy()).min() > 1e-3
