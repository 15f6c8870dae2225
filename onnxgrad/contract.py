"""The step-graph contract: the names, metadata keys and type sets that writers and runners of onnxgrad's graphs
agree on. Everything that reads or writes a training graph takes these from here."""
from __future__ import annotations

from onnx import TensorProto

# Value names
GRAD_SUFFIX = "_grad"        # `<x>_grad`: the gradient output of x; `<y>_grad`: the seed input of a non-scalar head
NEXT_SUFFIX = ".next"        # `<state>.next`: the output that replaces a state input after one step
MIRROR_SUFFIX = "_mirror"    # `<node>_mirror`: a recomputed copy of a forward node
LR_INPUT = "lr"              # the optional learning-rate input of a step graph

# metadata_props keys
LOSS_KEY = "onnxgrad.loss"                    # the heads the gradient was taken of, comma-separated
LOSS_FN_KEY = "onnxgrad.loss_fn"              # the loss build-grad appended, as JSON
OPTIMIZER_KEY = "onnxgrad.optimizer"          # the optimizer's settings, as JSON
STATE_KEY = "onnxgrad.state"                  # state input -> the output that replaces it, as JSON
PHASES_KEY = "onnxgrad.phases"                # the phase of every node, run-length encoded (see `ir`)
MIRROR_KEY = "onnxgrad.mirror"                # the recomputation plan a mirror pass applied, as JSON
EXECUTION_ORDER_KEY = "onnxgrad.execution_order"
DISABLED_OPTIMIZERS_KEY = "onnxgrad.disabled_optimizers"
CHECKPOINT_KEY = "onnxgrad.checkpoint"

# The settings a runner applies so that the file's node order is the schedule and recomputed nodes are not
# merged back into the ones they copy: PRIORITY_BASED order, common-subexpression elimination off (README,
# "Running").
RUNTIME_HINTS = {
    EXECUTION_ORDER_KEY: "PRIORITY_BASED",
    DISABLED_OPTIMIZERS_KEY: "CommonSubexpressionElimination",
}
# onnxruntime's graph fusions (ORT_ENABLE_EXTENDED and above) replace the nodes they fuse by new ones numbered
# after every node of the file; under PRIORITY_BASED a fused forward node then waits behind the recomputed
# nodes, which read only forward values, so they run during the forward pass and the saving is gone. A graph
# with recomputed nodes turns these off as well (the fusions that fire on element-wise and activation tails,
# normalisations and convolutions; found with `bench/bench_mirror.py --fusions`).
RECOMPUTE_DISABLED_OPTIMIZERS = (
    "QuickGeluFusion", "GeluFusion", "FastGeluFusion", "BiasGeluFusion", "LayerNormFusion",
    "SimplifiedLayerNormFusion", "SkipLayerNormFusion", "BiasSoftmaxFusion", "GemmActivationFusion",
    "ConvActivationFusion", "ConvAddActivationFusion", "ConvAddFusion", "ConvMulFusion", "ConvBNFusion",
    "MatMulAddFusion", "MatMulScaleFusion", "ReluClipFusion", "DivMulFusion", "NotWhereFusion",
)

# Metadata that only means something to a runner of the step graph; an exported forward model drops it.
TRAINING_METADATA = (STATE_KEY, OPTIMIZER_KEY, LOSS_KEY, LOSS_FN_KEY, EXECUTION_ORDER_KEY, DISABLED_OPTIMIZERS_KEY,
                     PHASES_KEY, MIRROR_KEY)

# Node phases, in the order a step runs them
FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER = "forward", "recompute", "backward", "optimizer"
PHASES = (FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER)

# Element types a gradient flows through
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
