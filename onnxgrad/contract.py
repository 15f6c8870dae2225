"""The step-graph contract: the names, metadata keys and type sets that writers and runners of onnxgrad's graphs
agree on. Everything that reads or writes a training graph takes these from here."""
from __future__ import annotations

from onnx import TensorProto

# Value names
GRAD_SUFFIX = "_grad"        # `<x>_grad`: the gradient output of x; `<y>_grad`: the seed input of a non-scalar head
NEXT_SUFFIX = ".next"        # `<state>.next`: the output that replaces a state input after one step
MIRROR_SUFFIX = "_mirror"    # `<node>_mirror`: a recomputed copy of a forward node
SEED_TIE = "after_loss"      # `<seed>/after_loss/...`: the nodes that make the backward's seed wait for the loss
LR_INPUT = "lr"              # the optional learning-rate input of a step graph
LOSS_SCALE_INPUT = "loss_scale"  # mixed precision: the factor the loss is scaled by (state of a step graph)

# metadata_props keys
LOSS_KEY = "onnxgrad.loss"                    # the heads the gradient was taken of, comma-separated
LOSS_FN_KEY = "onnxgrad.loss_fn"              # the loss build-grad appended, as JSON
OPTIMIZER_KEY = "onnxgrad.optimizer"          # the optimizer's settings, as JSON
STATE_KEY = "onnxgrad.state"                  # state input -> the output that replaces it, as JSON
PHASES_KEY = "onnxgrad.phases"                # the phase of every node, run-length encoded (see `protos`)
MIRROR_KEY = "onnxgrad.mirror"                # the recomputation plan a mirror pass applied, as JSON
BUDGET_KEY = "onnxgrad.budget_bytes"          # mirror --budget: the peak bytes the plan was made to fit
ALLOCATOR_KEY = "onnxgrad.allocator"          # mirror --allocator: exact (live bytes) or arena (onnxruntime's arena)
EXECUTION_ORDER_KEY = "onnxgrad.execution_order"
DISABLED_OPTIMIZERS_KEY = "onnxgrad.disabled_optimizers"
MEMORY_REUSE_KEY = "onnxgrad.memory_reuse"
CHECKPOINT_KEY = "onnxgrad.checkpoint"
PRECISION_KEY = "onnxgrad.precision"          # --precision and the loss scaler's settings, as JSON
CLASS_LABELS_KEY = "onnxgrad.class_labels"    # labels of an expanded cross-entropy: {input: [classes, ignore_index]}

# The settings a runner applies so that the file's node order is the schedule, recomputed nodes are not merged
# back into the ones they copy, and each buffer lives as long as its value: PRIORITY_BASED order,
# common-subexpression elimination off, and onnxruntime's buffer reuse off (reuse hands a dead value's buffer to
# a later value of the same size, so the buffer lives as long as the later one: on ResNet-50 that held 30% more
# than the values alive at any time; README, "Running"). The NCHWc layout pass is off too: it replaces a pooling
# node with new nodes, which PRIORITY_BASED runs only when no node of the file is ready, so a recomputed pool
# waited while the backward ran on and its input stayed alive (ResNet-50: 24.5 MiB over the simulated peak).
RUNTIME_HINTS = {
    EXECUTION_ORDER_KEY: "PRIORITY_BASED",
    DISABLED_OPTIMIZERS_KEY: "CommonSubexpressionElimination,NchwcTransformer",
    MEMORY_REUSE_KEY: "off",
}
# Metadata that only means something to a runner of the step graph; an exported forward model drops it.
TRAINING_METADATA = (STATE_KEY, OPTIMIZER_KEY, LOSS_KEY, LOSS_FN_KEY, EXECUTION_ORDER_KEY, DISABLED_OPTIMIZERS_KEY,
                     MEMORY_REUSE_KEY, PHASES_KEY, MIRROR_KEY, BUDGET_KEY, ALLOCATOR_KEY, PRECISION_KEY)

# Node phases, in the order a step runs them
FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER = "forward", "recompute", "backward", "optimizer"
PHASES = (FORWARD, RECOMPUTE, BACKWARD, OPTIMIZER)

# Element types a gradient flows through
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
