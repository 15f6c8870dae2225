"""Multi-level recomputation by dynamic programming over the blocks between the forward region's narrow points.

The structure is Rotor's (Beaumont et al., "Optimal checkpointing for heterogeneous chains", 2019; Rockmate,
ICML 2023): revolve's recursion generalised to blocks of their own sizes and costs. The forward region is cut at
its narrow points (`Problem.cuts`: the articulation points of a residual network, every layer of a chain) into
blocks 0..L-1. `opt(s, t, m)` is the least cost of running the backward of blocks s..t, with what crosses into
block s held and m bytes free besides. Either block s runs keeping everything its backward reads (the option
inside a block), and the rest is solved with less memory:

    opt(s, t, m) = fwd[s] + opt(s+1, t, m - keep[s]),

or the blocks s..j-1 run forward dropping what they make, the values crossing into block j are held while
blocks j..t are reversed, and blocks s..j-1 are then reversed from the same start:

    opt(s, t, m) = fwd[s..j-1] + opt(j, t, m - cross[j-1]) + opt(s, j-1, m).

On a uniform chain this is revolve (binomial checkpointing, Griewank and Walther 2000). The table is computed
once for every memory level (numpy over the levels), so one pass gives a schedule for every budget. Each
level's recursion becomes a plan of the staged scheme (`problem.py`): a value held in the forward pass is a
checkpoint (HOLD); one held by a later sweep is dropped by earlier ones and kept from the stage at which the
backward of its range starts (its reuse stage). The plans are judged by the simulator, not by the program's
own memory model, which counts only the bytes above (not gradients or working memory).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import Problem, crossings, plan_entry, profile

MAX_BLOCKS = 100  # more narrow points than this are merged into this many blocks (the table is cubic in it)
LEVELS = 240  # memory levels of the table


@dataclass
class Blocks:
    """The forward region in blocks: the movable ops of each, its forward cost, what its backward reads (with
    what crosses its end), what crosses its end, and the first backward stage that reads it."""

    ops: list[list[int]]
    fwd: np.ndarray
    kept: list[list[int]]
    cross: list[list[int]]
    kept_bytes: np.ndarray
    cross_bytes: np.ndarray
    last_bytes: np.ndarray
    read_bytes: np.ndarray
    background: np.ndarray
    stage: np.ndarray


def blocks(problem: Problem, max_blocks: int = MAX_BLOCKS) -> Blocks | None:
    positions, crossing, weights = crossings(problem)
    if not positions:
        return None
    end = problem.forward_end
    if len(positions) > max_blocks:
        # merge: of each run of consecutive positions keep the one crossed by the fewest bytes
        per = math.ceil(len(positions) / max_blocks)
        chosen = []
        for a in range(0, len(positions), per):
            window = range(a, min(a + per, len(positions)))
            chosen.append(min(window, key=lambda j: (weights[j], -j)))
        positions = [positions[j] for j in chosen]
        crossing = [crossing[j] for j in chosen]
    bounds = list(positions)
    if bounds[-1] < end - 1:  # a tail after the last narrow point: one more block, nothing crosses its end
        bounds.append(end - 1)
        crossing = list(crossing) + [[]]
    movable, users, size, cost = problem.movable, problem.users, problem.size, problem.cost
    ops, fwd, kept, stage = [], [], [], []
    start = 0
    for b in bounds:
        mine = [i for i in range(start, b + 1) if movable[i]]
        start = b + 1
        ops.append(mine)
        fwd.append(sum(cost[i] for i in mine))
        back = [i for i in mine if any(u >= end for u in users[i])]
        kept.append(back)
        stage.append(min((u for i in mine for u in users[i] if u >= end), default=problem.n))
    cross = [[i for i in c if movable[i]] for c in crossing]
    kept_bytes = [sum(size[i] for i in set(k) | set(c)) for k, c in zip(kept, cross)]
    last_bytes = [sum(size[i] for i in set(k) - set(c)) for k, c in zip(kept, cross)]
    # what else is live while each block is reversed: kept outputs made so far (weight gradients pile up) and
    # the backward's own working values, from the baseline with every movable value weighing nothing
    during = profile(Problem([0 if m else b for m, b in zip(movable, size)], problem.cost, problem.inputs,
                             problem.recomputable, problem.keep), problem.baseline).during
    first_read = [min((u for u in users[i] if u >= end), default=problem.n) for i in range(problem.n)]
    anchor = [min((first_read[i] for i in ops[k] + (cross[k - 1] if k else [])), default=problem.n)
              for k in range(len(ops))]
    background = []
    for k in range(len(ops)):
        upto = min(anchor[:k], default=problem.n)
        upto = max(upto, anchor[k] + 1)
        background.append(max(during[anchor[k]:upto], default=0) if anchor[k] < problem.n else 0)
    return Blocks(ops, np.array(fwd, dtype=float), kept, cross, np.array(kept_bytes, dtype=float),
                  np.array([sum(size[i] for i in c) for c in cross], dtype=float), np.array(last_bytes, dtype=float),
                  np.array([sum(size[i] for i in k) for k in kept], dtype=float), np.array(background, dtype=float), np.array(stage))


def table(bl: Blocks, span: int, levels: int = LEVELS, variant: tuple[bool, bool] = (True, True)
          ) -> tuple[np.ndarray, np.ndarray, int]:
    """opt[s, t, m] and the choice made there (-1: block s keeps what its backward reads; j: hold what crosses
    into block j), over `levels` memory levels m of `unit` bytes each, spanning `span` bytes (the baseline's
    peak above its static bytes: no plan needs more)."""
    L = len(bl.ops)
    unit = max(1, math.ceil(span / levels))
    keep_u, cross_u, base_u = _units(bl, unit, variant)
    M = min(levels, math.ceil(span / unit)) + 1
    inf = math.inf
    opt = np.full((L, L, M), inf)
    choice = np.full((L, L, M), -1, dtype=np.int32)
    prefix = np.concatenate([[0.0], np.cumsum(bl.fwd)])
    levels_ = np.arange(M)

    # later[j, t] = opt[j, t] shifted by what crosses into block j: the memory left when that is held
    later = np.full((L, L, M), inf)

    def settle(j: int, t: int) -> None:
        by = cross_u[j - 1] if j else 0
        if by < M:
            later[j, t, by:] = opt[j, t, :M - by]

    for s in range(L):
        if base_u[s] < M:
            opt[s, s, base_u[s]:] = bl.fwd[s]
        settle(s, s)
    for width in range(1, L):
        for s in range(L - width):
            t = s + width
            best = np.full(M, inf)
            k = keep_u[s]
            if k < M:
                best[k:] = bl.fwd[s] + opt[s + 1, t, :M - k]
            arg = np.full(M, -1, dtype=np.int32)
            # hold what crosses into block j, for every j in s+1..t at once
            total_ = (prefix[s + 1:t + 1] - prefix[s])[:, None] + later[s + 1:t + 1, t] + opt[s, s:t]
            j = np.argmin(total_, axis=0)
            value = total_[j, levels_]
            with np.errstate(invalid="ignore"):
                better = value < np.where(np.isfinite(best), best - 1e-9 * np.abs(best), inf)
            opt[s, t] = np.where(better, value, best)
            choice[s, t] = np.where(better, j + s + 1, arg)
            settle(s, t)
    return opt, choice, unit


def _units(bl: Blocks, unit: int, variant: tuple[bool, bool]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes in memory levels, to the nearest level (the simulator judges the plans, not these sums). The
    variant says whether a block that keeps its values is also charged for what crosses its end that the
    backward does not read (it is freed as soon as the next block has run, when that block keeps its values
    too), and whether the backward's own working memory is counted."""
    charge_cross, background = variant
    keep_u = np.rint((bl.kept_bytes if charge_cross else bl.read_bytes) / unit).astype(int)
    cross_u = np.rint(bl.cross_bytes / unit).astype(int)
    base_u = np.rint((bl.last_bytes + (bl.background if background else 0.0)) / unit).astype(int)
    return keep_u, cross_u, base_u


def plans(problem: Problem, max_blocks: int = MAX_BLOCKS, levels: int = LEVELS) -> list[tuple[int, ...]]:
    """One plan per distinct recursion of the table, from the least memory level that has one to the most."""
    bl = blocks(problem, max_blocks)
    if bl is None:
        return []
    found: dict[tuple[int, ...], None] = {}
    for variant in VARIANTS:
        for plan in _plans(problem, bl, levels, variant):
            found[plan] = None
    return list(found)


VARIANTS = ((True, False), (False, True))


def _plans(problem: Problem, bl: Blocks, levels: int, variant: tuple[bool, bool]) -> list[tuple[int, ...]]:
    opt, choice, unit = table(bl, max(1, problem.baseline_peak - problem.static_bytes), levels, variant)
    L = len(bl.ops)
    keep_u, cross_u, _ = _units(bl, unit, variant)
    n, last_forward = problem.n, problem.forward_end - 1
    hold = plan_entry(n, n, 0)
    base = [hold if not m else plan_entry(n, last_forward, n) for m in problem.movable]
    end = problem.forward_end
    first_read = [min((u for u in problem.users[i] if u >= end), default=n) for i in range(n)]
    found: dict[tuple[int, ...], None] = {}
    for m in range(opt.shape[2]):
        if not math.isfinite(opt[0, L - 1, m]):
            continue
        entries = list(base)
        assigned = [False] * n

        def store(ops, stage):
            for i in ops:
                if not assigned[i]:
                    assigned[i] = True
                    entries[i] = hold if stage is None else plan_entry(n, last_forward, int(stage))

        # the recursion, in the order its sweeps run: (s, t, memory, stage of the sweep; None: the forward pass)
        stack = [(0, L - 1, m, None)]
        while stack:
            s, t, mem, stage = stack.pop()
            j = int(choice[s, t, mem]) if s < t else -1
            if j < 0:
                store(bl.ops[s] if stage is None else bl.kept[s] + bl.ops[s], stage)
                store(bl.cross[s], stage)
                if s < t:
                    stack.append((s + 1, t, mem - keep_u[s], stage))
                continue
            store(bl.cross[j - 1], stage)
            # blocks s..j-1 are reversed from the first stage that reads one of their values other than what
            # crosses into block j (held for blocks j..t, so still there)
            right = set(bl.cross[j - 1])
            inner = min((first_read[i] for k in range(s, j) for i in bl.ops[k] if i not in right),
                        default=n)
            # popped last-in first-out: blocks j..t are reversed first, then s..j-1 from the stage they start at
            stack.append((s, j - 1, mem, inner))
            stack.append((j, t, mem - cross_u[j - 1], stage))
        found[tuple(entries)] = None
    return list(found)
