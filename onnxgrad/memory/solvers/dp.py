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

import bisect
import math
from dataclasses import dataclass

import numpy as np

from .problem import Plan, Problem, crossings, plan_entry, profile

MAX_BLOCKS = 100  # more narrow points than this are merged into this many blocks (the table is cubic in it)
LEVELS = 240  # memory levels of the table
# sums per range the table may search for the choices of a width; past that they are left to `Table.choice`, which
# costs about that much per range it is asked for
CHOICE_WORK = 1000


@dataclass
class Blocks:
    """The forward region in blocks: the movable ops of each, its forward cost, what its backward reads (`kept`),
    what crosses its end (`cross`), and the bytes the recursion holds or needs for each."""

    ops: list[list[int]]
    fwd: np.ndarray
    kept: list[list[int]]
    cross: list[list[int]]
    keep_bytes: np.ndarray  # what running the block keeping its values holds: kept and cross
    cross_bytes: np.ndarray  # what holding the block's end holds
    last_bytes: np.ndarray  # what its backward reads that does not cross its end
    read_bytes: np.ndarray  # what its backward reads
    held_bytes: np.ndarray  # what crosses its end that its own backward reads: held on from the sweep that made it
    free_bytes: np.ndarray  # what crosses into it that no backward op reads: dead once the block has run for good
    need: np.ndarray  # the memory its backward needs: its kept values and everything else live then
    redo: np.ndarray  # whether its backward needs a value of its own that is not held (the block runs again)
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
    L = len(ops)
    # The memory the backward of each block needs grows along the backward: the kept outputs made so far
    # (weight gradients pile up), the graph's outputs and the backward's own working values. It is read off the
    # baseline with every movable value weighing nothing, over the stretch of the backward that belongs to the
    # block: from the first backward op that reads its values (or what crosses into it) to the first one that
    # reads an earlier block's. (The static bytes are outside the table's memory.)
    during = profile(Problem([0 if m else b for m, b in zip(movable, size)], problem.cost, problem.inputs,
                             problem.recomputable, problem.keep, scratch=problem.scratch), problem.baseline).during
    first_read = problem.first_backward_read
    anchor = [min((first_read[i] for i in ops[k] + (cross[k - 1] if k else [])), default=problem.n)
              for k in range(L)]
    need, redo, held, free = [], [], [], []
    for k in range(L):
        upto = max(min(anchor[:k], default=problem.n), anchor[k] + 1)
        others = max(during[anchor[k]:upto], default=0)
        mine = set(kept[k])
        need.append(others + sum(size[i] for i in mine))
        kept_cross = mine & set(cross[k]) if k < L - 1 else set()
        held.append(sum(size[i] for i in kept_cross))
        redo.append(k == L - 1 or bool(mine - kept_cross))
        free.append(sum(size[i] for i in (cross[k - 1] if k else []) if first_read[i] == problem.n))
    return Blocks(ops, np.array(fwd, dtype=float), kept, cross,
                  np.array([sum(size[i] for i in set(k) | set(c)) for k, c in zip(kept, cross)], dtype=float),
                  np.array([sum(size[i] for i in c) for c in cross], dtype=float),
                  np.array([sum(size[i] for i in set(k) - set(c)) for k, c in zip(kept, cross)], dtype=float),
                  np.array([sum(size[i] for i in k) for k in kept], dtype=float),
                  np.array(held, dtype=float),
                  np.array(free, dtype=float), np.array(need, dtype=float), np.array(redo), np.array(stage))


@dataclass
class Model:
    """A memory model of the recursion, in memory levels. `keep`: what block s holds when it runs keeping its
    values; `cross`: what holding its end holds; `held`: what of its end the caller holds on into the reversal of
    a range that ends at it; `free`: what crosses into it that is dead once it has run for good; `leaf`: the
    least memory its reversal as the last block of a range takes; `need`: what its backward takes when it has
    run keeping its values (less what `held` and `free` give back); `redo`: whether that reversal runs it
    again."""

    keep: np.ndarray
    cross: np.ndarray
    held: np.ndarray
    free: np.ndarray
    leaf: np.ndarray
    need: np.ndarray
    redo: np.ndarray


def rotor_model(bl: Blocks, unit: int) -> Model:
    """Rotor's: the input of a range is held through its reversal, every reversal of a block runs it again, and
    the backward's own memory is not counted (one level for the whole backward)."""
    u = _levels(unit)
    zero = np.zeros(len(bl.ops), dtype=int)
    return Model(u(bl.keep_bytes), u(bl.cross_bytes), zero, zero, u(bl.last_bytes), zero,
                 np.ones(len(bl.ops), dtype=bool))


def growing_model(bl: Blocks, unit: int) -> Model:
    """The memory that grows along the backward: each block's reversal takes what its backward needs at that
    point (weight gradients made so far, outputs, the backward's working values); what a block's own backward
    reads of its end is held on from the sweep that made it rather than made again; and what crosses into a
    block that no backward op reads is given back once the block has run for good."""
    u = _levels(unit)
    held, free, need = u(bl.held_bytes), u(bl.free_bytes), u(bl.need)
    return Model(u(bl.keep_bytes), u(bl.cross_bytes), held, free, np.maximum(need - held - free, 0), need,
                 bl.redo)


def lean_model(bl: Blocks, unit: int) -> Model:
    """Rotor's, with a block that keeps its values charged only for what its backward reads (what crosses its
    end besides is freed once the next block has run, when that one keeps its values too), and each reversal
    charged for the backward's own memory at that point."""
    u = _levels(unit)
    zero = np.zeros(len(bl.ops), dtype=int)
    return Model(u(bl.read_bytes), u(bl.cross_bytes), zero, zero, u(bl.last_bytes + bl.need - bl.read_bytes),
                 zero, np.ones(len(bl.ops), dtype=bool))


MODELS = (rotor_model, growing_model, lean_model)


def _levels(unit: int):
    """Bytes in memory levels, to the nearest level (the simulator judges the plans, not these sums)."""
    return lambda b: np.rint(b / unit).astype(int)


@dataclass
class Workspace:
    """The arrays a table is computed in, allocated once for the tables of every model (fresh memory costs its
    page faults every time): opt[s, t, m]; whether block s keeps what its backward reads there (`kept`) and
    otherwise the block j whose incoming values are held (`choice`, -1 where kept); opt shifted by what crosses
    into block s (`later`) and by what block t holds on (`sooner`); a scratch buffer."""

    opt: np.ndarray
    kept: np.ndarray
    choice: np.ndarray
    later: np.ndarray
    sooner: np.ndarray
    total: np.ndarray

    @classmethod
    def of(cls, L: int, M: int) -> "Workspace":
        return cls(np.empty((L, L, M)), np.empty((L, L, M), dtype=bool),
                   np.empty((L, L, M), dtype=np.int16 if L < 2**15 else np.int64), np.empty((L, L, M)),
                   np.empty((L, L, M)), np.empty(L * L * M // 4 + L * M))


@dataclass
class Table:
    """opt[s, t, m] of one model over M memory levels, and the choice made at each (-1: block s keeps what its
    backward reads; j: hold what crosses into block j). In opt[s, t, m], what crosses into block s and what the
    model's `held` says of block t's end are held by the caller, outside m. It reads its workspace: valid until
    that computes another table."""

    blocks: Blocks
    model: Model
    space: Workspace
    prefix: np.ndarray  # forward cost of blocks 0..k-1 at k
    chosen: np.ndarray  # per width, whether `space.choice` holds its choices
    later: np.ndarray  # opt shifted by what crosses into block s: `space.later`, or opt where nothing shifts it
    sooner: np.ndarray  # opt shifted by what block t holds on: `space.sooner`, or opt where nothing shifts it

    @property
    def opt(self) -> np.ndarray:
        return self.space.opt

    def choice(self, s: int, t: int) -> np.ndarray:
        """The choice at (s, t) for every level: -1, or the first j of least cost. The table works out the
        choices of the widths where few levels hold something; the others are worked out here, for the ranges a
        plan's recursion visits, from the same sums in the same order as the table's minimum."""
        if self.chosen[t - s]:
            return self.space.choice[s, t]
        prefix = self.prefix
        total_ = self.later[s + 1:t + 1, t] + (prefix[s + 1:t + 1] - prefix[s])[:, None]
        total_ += self.sooner[s, s:t]
        row = total_.argmin(axis=0)
        row += s + 1
        row[self.space.kept[s, t]] = -1
        return row


def _prefix(bl: Blocks) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(bl.fwd)])


def table(bl: Blocks, model: Model, M: int, space: Workspace | None = None) -> Table:
    """opt[s, t, m] over M memory levels (see `Table`). Ranges of one width are computed together, over every
    start s and every level at once; the choice of j is left to `Table.choice`, for the ranges a plan visits."""
    L = len(bl.ops)
    space = space or Workspace.of(L, M)
    keep_u, cross_u, held_u, free_u = (np.asarray(x) for x in (model.keep, model.cross, model.held, model.free))
    need_u = np.asarray(model.need)
    inf = math.inf
    # later[j, t] = opt[j, t] shifted by what crosses into block j: the memory left when that is held;
    # sooner[s, t] = opt[s, t] shifted by what block t holds on from the sweep that made it. Where nothing shifts
    # it (no bytes cross, or none are held on), it is opt itself, read in place
    crossing_in = np.concatenate([[0], cross_u[:-1]]).astype(int)
    opt = space.opt
    later = space.later if crossing_in.any() else opt
    sooner = space.sooner if held_u.any() else opt
    for a in {id(a): a for a in (opt, later, sooner)}.values():
        a.fill(inf)
    space.kept.fill(True)
    space.choice.fill(-1)
    chosen = np.ones(L, dtype=bool)
    prefix = _prefix(bl)
    levels_ = np.arange(M)
    leaf_cost = np.where(model.redo, bl.fwd, 0.0)

    def band(a: np.ndarray, width: int) -> np.ndarray:
        """a[s, s + width] for every s, in place: (L - width, M) at a regular stride (L - width for 2-D a)."""
        return _strided(a, width, (L - width,), (L + 1,))

    def pairs(a: np.ndarray, width: int, later_side: bool) -> np.ndarray:
        """For j = s+1+i, i in 0..width-1: a[j, s + width] (`later_side`) or a[s, j - 1], as an (L - width, width)
        view over s and i, for 2-D or 3-D a."""
        if later_side:
            return _strided(a, L + width, (L - width, width), (L + 1, L))
        return _strided(a, 0, (L - width, width), (L + 1, 1))

    def groups(by: np.ndarray) -> list[tuple[int, np.ndarray, list[int]]]:
        """The positions of each distinct value of `by`, in increasing order (as an array and as a list)."""
        return [(c, where, where.tolist()) for c in np.unique(by).tolist() for where in [np.flatnonzero(by == c)]]

    # later[s, s + width] is shifted by crossing_in[s], sooner[s, s + width] by held_u[s + width]
    shifted_copies = [(a, groups(by), offset) for a, by, offset in ((later, crossing_in, 0), (sooner, held_u, 1))
                      if a is not opt]

    def settle(width: int) -> None:
        ranges = band(opt, width)
        S = L - width
        for copy, by_value, offset in shifted_copies:
            shifted, offset = band(copy, width), offset * width
            # a few distinct shifts (one or two on a uniform chain): the rows of each, as a slice where they run
            # on without a gap
            for c, where, listed in by_value:
                lo, hi = bisect.bisect_left(listed, offset), bisect.bisect_left(listed, S + offset)
                if c >= M or lo == hi:
                    continue
                if listed[hi - 1] - listed[lo] == hi - 1 - lo:
                    rows = slice(listed[lo] - offset, listed[hi - 1] - offset + 1)
                else:
                    rows = where[lo:hi] - offset
                shifted[rows, c:] = ranges[rows, :M - c]

    # Along the levels every entry is infinite below its first finite level (`lowest`) and constant from its
    # `settled` level up; a range's entries are bounded by those of the entries they are made of, so each width is
    # computed over the levels between the least first finite level and the greatest settled one, and the level
    # above them repeat the top computed one (the same sums, so the same table, about half the work). Both are
    # kept shifted as `later` and `sooner` are, and as they are for the last width computed.
    lowest_later = np.full((L, L), M) + crossing_in[:, None]
    settled_later = np.zeros((L, L), dtype=int) + crossing_in[:, None]
    lowest_sooner = np.full((L, L), M) + held_u[None, :]
    settled_sooner = np.zeros((L, L), dtype=int) + held_u[None, :]

    def bounds(width: int, first: int = 0, last: int = M - 1) -> tuple[np.ndarray, np.ndarray]:
        """The first finite level and the settled level of each range of a width, from its levels first..last:
        below them every entry is infinite, above them each repeats the one at `last`."""
        ranges = band(opt, width)
        window = ranges[:, first:last + 1]
        finite = np.isfinite(window)
        lowest = np.where(finite.any(axis=1), finite.argmax(axis=1) + first, M)
        moving = window != ranges[:, last:last + 1]
        # an entry finite at the top and the same all through the window moves just below it (infinite there)
        settled = np.where(moving.any(axis=1), last + 1 - moving[:, ::-1].argmax(axis=1),
                           np.where(finite[:, -1], first, 0))
        S = L - width
        band(lowest_later, width)[:] = lowest + crossing_in[:S]
        band(settled_later, width)[:] = settled + crossing_in[:S]
        band(lowest_sooner, width)[:] = lowest + held_u[width:]
        band(settled_sooner, width)[:] = settled + held_u[width:]
        return lowest, settled

    for s in range(L):
        if model.leaf[s] < M:
            opt[s, s, model.leaf[s]:] = leaf_cost[s]
    settle(0)
    lowest_of, settled_of = bounds(0)  # of the ranges one narrower than those being computed
    for width in range(1, L):
        S = L - width
        # block s runs for good: what it keeps is held, what crosses into it is dead unless read later
        k = keep_u[:S]
        kept_less_free = k - free_u[:S]
        lowest = np.maximum(k, need_u[:S] - held_u[width:] - free_u[:S])
        first = min(int(np.maximum(lowest, lowest_of[1:] + kept_less_free).min()),
                    int(np.maximum(pairs(lowest_later, width, True), pairs(lowest_sooner, width, False)).min()))
        if first >= M:
            # nothing of this width fits in memory: infinite, as filled
            lowest_of, settled_of = np.full(S, M), np.zeros(S, dtype=int)
            continue
        last = min(M - 1, max(first, int(np.maximum(lowest, settled_of[1:] + kept_less_free).max()),
                              int(pairs(settled_later, width, True).max()),
                              int(pairs(settled_sooner, width, False).max())))
        at = levels_[first:last + 1]
        reads = np.minimum(at[None, :] - k[:, None] + free_u[:S, None], M - 1)
        runs = bl.fwd[:S, None] + band(opt, width - 1)[1:][np.arange(S)[:, None], np.maximum(reads, 0)]
        best = np.where(at[None, :] >= lowest[:, None], runs, inf)
        # hold what crosses into block j = s+1+i, for every i in 0..width-1 at once: later[s+1+i, s+width] and
        # sooner[s, s+i] lie at regular strides over (s, i, level), so they are read in place
        on_later, on_sooner = pairs(later, width, True), pairs(sooner, width, False)
        forward = _strided(prefix, 1, (S, width), (1, 1)) - prefix[:S, None]  # prefix[j] - prefix[s]
        total_ = space.total[:S * width * len(at)].reshape(S, width, len(at))
        np.add(forward[:, :, None], on_later[:, :, first:last + 1], out=total_)
        np.add(total_, on_sooner[:, :, first:last + 1], out=total_)
        value = total_.min(axis=1)
        with np.errstate(invalid="ignore"):
            better = value < np.where(np.isfinite(best), best - 1e-9 * np.abs(best), inf)
        ranges, kept = band(opt, width), band(space.kept, width)
        ranges[:, first:last + 1] = np.where(better, value, best)
        ranges[:, last + 1:] = ranges[:, last:last + 1]
        kept[:, first:last + 1] = ~better
        kept[:, last + 1:] = kept[:, last:last + 1]
        # where holding what crosses into some block beats keeping block s: the first j of least cost, found
        # here unless that takes longer than finding it for each range (of this width) on its own
        starts, at_level = np.nonzero(better)
        chosen[width] = len(starts) * width <= CHOICE_WORK * S
        if len(starts) and chosen[width]:
            picks = band(space.choice, width)
            picks[starts, at_level + first] = starts + 1 + total_[starts, :, at_level].argmin(axis=1)
            picks[:, last + 1:] = picks[:, last:last + 1]
        settle(width)
        lowest_of, settled_of = bounds(width, first, last)
    return Table(bl, model, space, prefix, chosen, later, sooner)


def _strided(a: np.ndarray, offset: int, shape: tuple[int, ...], steps: tuple[int, ...]) -> np.ndarray:
    """A view of contiguous `a` as rows of its first two axes flattened: starting at row `offset`, `steps` rows
    apart along each axis of `shape`, each row whole (the remaining axes of a). A constructor call, about ten
    times cheaper than `as_strided`, which the table makes thousands of times."""
    strides = a.strides
    row = strides[1] if len(strides) > 1 else strides[0]
    if len(steps) == 1:
        return np.ndarray(shape + a.shape[2:], a.dtype, a, offset * row, (steps[0] * row,) + strides[2:])
    return np.ndarray(shape + a.shape[2:], a.dtype, a, offset * row, (steps[0] * row, steps[1] * row) + strides[2:])


def plans(problem: Problem, max_blocks: int = MAX_BLOCKS, levels: int = LEVELS) -> list[tuple[int, ...]]:
    """One plan per distinct recursion of each model's table, from the least memory level that has one to the
    most (levels spanning the baseline's peak above its static bytes: no plan needs more)."""
    bl = blocks(problem, max_blocks)
    if bl is None:
        return []
    span = max(1, problem.baseline_peak - problem.static_bytes)
    unit = max(1, math.ceil(span / levels))
    M = min(levels, math.ceil(span / unit)) + 1
    space = Workspace.of(len(bl.ops), M)
    found: dict[tuple[int, ...], None] = {}
    for make in MODELS:
        for plan in _plans(problem, table(bl, make(bl, unit), M, space)):
            found[plan] = None
    return list(found)


def _plans(problem: Problem, tab: Table) -> list[tuple[int, ...]]:
    bl, model, opt = tab.blocks, tab.model, tab.opt
    L = len(bl.ops)
    # plain ints and lists: the walks below are scalar work, which numpy scalars slow down
    keep_u, cross_u, held_u, free_u = (np.asarray(x).tolist() for x in (model.keep, model.cross, model.held,
                                                                         model.free))
    top = opt.shape[2] - 1
    n, last_forward = problem.n, problem.forward_end - 1
    hold = plan_entry(n, n, 0)
    base = [hold if not m else plan_entry(n, last_forward, n) for m in problem.movable]
    first_read = problem.first_backward_read
    found: dict[tuple[int, ...], None] = {}
    walks: set[tuple] = set()
    inner_stage: dict[int, list[int]] = {}  # per j, by s
    ops, cross = bl.ops, bl.cross
    rows: list[list[int] | None] = [None] * (L * L)  # the choice row of (s, t) at s * L + t, once visited
    finite = np.isfinite(opt[0, L - 1]).tolist()
    for m in range(opt.shape[2]):
        if not finite[m]:
            continue
        # the recursion, in the order its sweeps run: (s, t, memory, stage of the sweep; None: the forward pass);
        # its walk, (block, the block whose incoming values are held or -1, stage) per step, is all a plan
        # depends on, so levels that recurse alike give their plan once
        walk = []
        append = walk.append
        stack = [(0, L - 1, m, None)]
        while stack:
            s, t, mem, stage = stack.pop()
            # blocks that run keeping their values, one after another (each a step of the walk)
            while True:
                if s < t:
                    row = rows[s * L + t]
                    if row is None:
                        row = rows[s * L + t] = tab.choice(s, t).tolist()
                    j = row[mem]
                else:
                    j = -1
                append((s, j, stage))
                if j >= 0 or s >= t:
                    break
                mem = mem - keep_u[s] + free_u[s]
                if mem > top:
                    mem = top
                s += 1
            if j < 0:
                continue
            # blocks s..j-1 are reversed from the first stage that reads one of their values other than what
            # crosses into block j (held for blocks j..t, so still there)
            reads_from = inner_stage.get(j)
            if reads_from is None:
                reads_from = inner_stage[j] = _first_reads(bl, first_read, j, n)
            inner = reads_from[s]
            # popped last-in first-out: blocks j..t are reversed first, then s..j-1 from the stage they start at
            stack.append((s, j - 1, mem - held_u[j - 1], inner))
            stack.append((j, t, mem - cross_u[j - 1], stage))
        walk = tuple(walk)
        if walk in walks:
            continue
        walks.add(walk)
        # an op takes the entry of the first step that stores it: the steps are stored last to first, each
        # overwriting what later ones stored (a block's kept values are among its ops)
        entries = list(base)
        for s, j, stage in reversed(walk):
            entry = hold if stage is None else plan_entry(n, last_forward, int(stage))
            if j < 0:
                for i in cross[s]:
                    entries[i] = entry
                for i in ops[s]:
                    entries[i] = entry
            else:
                for i in cross[j - 1]:
                    entries[i] = entry
        found[Plan(entries)] = None
    return list(found)


def _first_reads(bl: Blocks, first_read: list[int], j: int, n: int) -> list[int]:
    """For every s < j, the first stage that reads a value of blocks s..j-1 other than what crosses into block j
    (n: none): the stage from which blocks s..j-1 are reversed once j.. have been."""
    right = set(bl.cross[j - 1])
    least = [n] * j
    running = n
    for k in range(j - 1, -1, -1):
        for i in bl.ops[k]:
            if i not in right and first_read[i] < running:
                running = first_read[i]
        least[k] = running
    return least
