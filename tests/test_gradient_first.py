"""Rules are written gradient-first: backward nodes that read only forward values stay rare and known.

Such a node can run during the forward pass under any execution order that is free to hoist it (onnxruntime's
fusions renumber nodes), and its output then stays alive until the backward pass uses it. Small or boolean
outputs (masks, shapes, constants) are harmless; a float tensor as large as the op's operands is not. This test
lists, for every case of the rule table, the backward nodes that produce such a tensor without depending on
the incoming gradient, and compares them with the known, intrinsic ones (a derivative that is a function of the
forward values alone, such as cos(x) for Sin).
"""
import numpy as np
import onnx
import pytest

from gradcheck import _build, _model, float_outputs
from test_rules import ALL_CASES

FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}

# op -> node types its rule may emit that read forward values only and are as large as the operands
INTRINSIC = {
    "Conv": {"Reshape", "Transpose"},          # the input, laid out as the kernel of the weight-gradient Conv
    "ConvTranspose": {"Reshape", "Transpose"},  # the input, laid out as the kernel of the weight-gradient Conv
    "Cos": {"Sin"}, "Sin": {"Cos"},
    "Erf": {"Exp", "Mul", "Neg"},              # exp(-x^2)
    "Gather": {"Cast"},                        # one-hot matrix (small tables; every table at opsets 13-15)
    "GatherElements": {"ConstantOfShape"},     # zeros to scatter the gradient into
    "GatherND": {"Cast", "ConstantOfShape"},   # zeros to scatter into; one-hot matrix (as Gather)
    "Gelu": {"Add", "Erf", "Exp", "Mul", "Tanh"},
    "GlobalMaxPool": {"Cast"},                 # the mask of maxima
    "GroupNormalization": {"Mul", "Reshape", "Sub"},  # the normalised input
    "InstanceNormalization": {"Mul", "Sub"},
    "LayerNormalization": {"Mul", "Sub"},
    "LogSoftmax": {"Exp"},                     # softmax = exp(log_softmax)
    "LRN": {"Conv", "Mul", "Pow", "Squeeze", "Unsqueeze"},  # d = bias + alpha/size * window sum of x^2, d^-beta
    "MatMul": {"Flatten", "Transpose"},        # operand layouts; onnxruntime folds them into FusedMatMul
    "Max": {"Cast", "Sum"}, "Min": {"Cast", "Sum"},  # masks of the selected inputs, ties counted
    "MaxPool": {"ConstantOfShape"},            # zeros to scatter the gradient into
    "Mish": {"Sigmoid", "Softplus", "Tanh"},
    "Pow": {"Log", "Pow", "Sub"},              # a ** (b - 1) and log(a)
    "ReduceL1": {"Sign"},
    "ReduceLogSum": {"Exp"}, "ReduceLogSumExp": {"Exp", "Sub"},
    "ReduceMax": {"Cast"}, "ReduceMin": {"Cast"}, "ReduceProd": {"Cast", "Where"},
    "SoftmaxCrossEntropyLoss": {"Exp", "Softmax"},
    "Softplus": {"Sigmoid"}, "Softsign": {"Abs", "Add"},
    "TopK": {"ConstantOfShape"},               # zeros to scatter the gradient into
    "Attention": {"Reshape"},                  # 3-D K and V split into heads (a view, no copy)
    "RotaryEmbedding": {"Cast"},               # one-hot matrix of the positions (as Gather)
    "Swish": {"Mul", "Sigmoid"},               # sigmoid(alpha * x) is a function of x alone, as in Softplus
}


def forward_only_large_nodes(case) -> set[str]:
    fwd, wrt = _model(case, np.float32)
    heads = float_outputs(fwd)
    train = onnx.shape_inference.infer_shapes(_build(fwd, heads, wrt))
    types = {vi.name: vi.type.tensor_type
             for vi in [*train.graph.value_info, *train.graph.input, *train.graph.output]}

    def size(name):
        t = types.get(name)
        if t is None or not t.HasField("shape") or any(not d.HasField("dim_value") for d in t.shape.dim):
            return None
        return int(np.prod([d.dim_value for d in t.shape.dim]))

    largest = max(size(n) or 1 for n in wrt + heads)
    depends_on_gradient = {h + "_grad" for h in heads}
    found = set()
    for node in train.graph.node[1:]:  # node 0 is the forward op
        if "/after_loss/" in node.name:  # the seed, read through one element of the loss so it waits for it
            depends_on_gradient.update(node.output)
            continue
        if any(i in depends_on_gradient for i in node.input):
            depends_on_gradient.update(node.output)
            continue
        for o in node.output:
            t, s = types.get(o), size(o)
            if node.op_type != "Constant" and t is not None and t.elem_type in FLOAT_TYPES and (s is None or s >= largest):
                found.add(node.op_type)
    return found


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_backward_nodes_consume_the_gradient(case):
    unexpected = forward_only_large_nodes(case) - INTRINSIC.get(case.op, set())
    assert not unexpected, f"{case}: backward nodes {sorted(unexpected)} read only forward values"
