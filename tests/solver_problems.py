"""Recomputation problems for the solver tests and benchmarks: uniform chains and random training DAGs."""
from __future__ import annotations

import random

from onnxgrad.memory.solvers import Problem


def chain(n: int, activation_bytes: int = 1, forward_cost: float = 1.0, backward_cost: float = 2.0,
          static_bytes: int = 0) -> Problem:
    """A uniform chain of n layers and its backward pass (2n ops).

    Forward op i (index i) reads layer i-1's output. The backward op of layer i (index 2n-1-i) reads layer i's
    input (the output of layer i-1; the graph input is static for layer 0) and the gradient from the backward op
    of layer i+1; the top one reads the chain's output in its place. The last backward output is kept."""
    size = [activation_bytes] * (2 * n)
    cost = [forward_cost] * n + [backward_cost] * n
    inputs: list[list[int]] = [[i - 1] if i else [] for i in range(n)]
    for layer in range(n - 1, -1, -1):
        index = 2 * n - 1 - layer
        reads = [layer - 1] if layer else []
        reads.append(index - 1)  # the gradient from above (the chain's output for the top layer)
        inputs.append(reads)
    return Problem(size, cost, inputs, [True] * n + [False] * n, {2 * n - 1}, static_bytes)


def random_training_dag(forward_ops: int, seed: int = 0, skip: float = 0.3, reach: int = 8,
                        fixed: float = 0.05, max_size: int = 8, static_bytes: int = 0) -> Problem:
    """A random forward DAG and its backward pass: forward op i reads op i-1 and, with probability `skip`, one
    more op at most `reach` ops back (a skip connection; `reach` 0: any earlier op); a fraction `fixed` of
    forward ops may not be recomputed (random ops). The backward op of forward op f reads f's inputs (the saved
    activations; f itself when it reads none) and the backward ops of f's readers (the gradient of f's output);
    the backward op of the last forward op reads it as the loss. The backward op of the first forward op is
    kept, as a gradient output."""
    rng = random.Random(seed)
    size = [rng.randint(1, max_size) for _ in range(forward_ops)]
    cost = [float(rng.randint(1, 10)) for _ in range(forward_ops)]
    inputs: list[list[int]] = []
    for i in range(forward_ops):
        reads = [i - 1] if i else []
        if i > 1 and rng.random() < skip:
            reads.append(rng.randrange(max(0, i - 1 - reach) if reach else 0, i - 1))
        inputs.append(reads)
    recomputable = [rng.random() >= fixed for _ in range(forward_ops)]
    readers: list[list[int]] = [[] for _ in range(forward_ops)]
    for i, reads in enumerate(inputs):
        for j in reads:
            readers[j].append(i)
    grad = {}
    for f in range(forward_ops - 1, -1, -1):
        index = forward_ops + (forward_ops - 1 - f)
        grad[f] = index
        reads = list(inputs[f]) or [f]
        reads += [grad[r] for r in readers[f]] or [f]
        inputs.append(sorted(set(reads)))
        size.append(size[f])
        cost.append(2 * cost[f])
        recomputable.append(False)
    return Problem(size, cost, inputs, recomputable, {grad[0]}, static_bytes)


def tanh_chain(layers: int, width: int = 256, batch: int = 4096):
    """The training graph of a chain of `layers` Gemm+Tanh layers (width x width weights, an MSE loss) as the
    budget policy sees it: (its `BudgetProblem`, the graph's simulated unmirrored peak)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from onnxgrad import pipeline
    from onnxgrad.passes import training_pipeline
    from onnxgrad.memory.budget import BudgetProblem
    from onnxgrad.memory.cost import CostModel
    from onnxgrad.memory.simulate import simulate, sizes
    from onnxgrad.passes.mirror import name_every_node
    from onnxgrad.shapes import type_everything

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Gemm", [x, f"w{i}"], [f"z{i}"], name=f"gemm{i}"),
                  helper.make_node("Tanh", [f"z{i}"], [f"y{i}"], name=f"tanh{i}")]
        x = f"y{i}"
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, width]) for n in ("x", x)]
    model = helper.make_model(helper.make_graph(nodes, "tanh_chain", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.checker.check_model(model)
    passes = training_pipeline()
    upto = next(k for k, p in enumerate(passes) if p.name == "mirror")
    build = pipeline.run(pipeline.Build(model, pipeline.Options(loss_fn="mse")), passes[:upto])
    graph = build.graph
    type_everything(graph)
    name_every_node(graph, build.new_names())
    nbytes = sizes(graph, {})
    return BudgetProblem(graph, nbytes, CostModel(symbols={})), simulate(graph, nbytes=nbytes).peak
