"""The recomputation problem, its one liveness kernel, and the plans every heuristic solver speaks.

A `Problem` numbers a training graph's ops in the baseline order (forward then backward) and says, per op, the
bytes of its output, the cost of running it, the ops it reads, whether it may run more than once, and which
outputs live to the end. A schedule runs the ops in that order, with recomputations inserted. `profile` is the
one liveness kernel: an output is allocated when its op runs and freed right after its last reader, or held to
the end when nothing reads it (the model onnxruntime applies to our graphs), so every solver is judged by the
same simulator that checks the rewritten graph.

Plans. A heuristic schedule is built from a plan of one entry per op, in stages like Checkmate's: stage t runs op
t after recomputing, in index order, whatever op t needs that is not available. An op's entry is a horizon h and
a reuse stage r: its first run serves readers up to stage h; after that a reader recomputes it, and a copy
recomputed at stage r or later is held until its last reader (reused), an earlier one serves only the stage that
made it (recomputed again for every stage that needs it). Named classes of entries:
  HOLD: h = the end; a checkpoint, held from its one run to its last reader;
  REUSE: h = the end of the forward region, r = 0; Chen et al.'s segment recomputation;
  DROP: h = the end of the forward region, r = the end; the inner level of revolve/treeverse;
  SHORT: h = SHORT_REACH stages after its run, r = the end.
Plans with a reuse stage per op express revolve's nested checkpoints (a value dropped while an outer segment is
recomputed, then kept from the stage whose backward sweep stores it), which the block DP (`dp.py`) writes.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Arrays:
    """A problem's reads (each op's distinct reads, flattened: op i reads read_ops[read_start[i]:][:read_count[i]]),
    sizes, scratch bytes (and whether any op has some), kept ops, costs and movable ops, as numpy arrays."""

    read_count: np.ndarray
    read_start: np.ndarray
    read_ops: np.ndarray
    read_via: np.ndarray  # per read, the view it goes through (-1: none): see Problem.through
    has_via: bool
    size: np.ndarray
    scratch: np.ndarray
    keep: np.ndarray
    cost: np.ndarray
    movable: np.ndarray
    has_scratch: bool


@dataclass(eq=False)
class Problem:
    """One recomputation problem. Ops are numbered in a topological order that is the baseline schedule."""

    size: list[int]  # bytes of op i's output(s)
    cost: list[float]  # cost of running op i once
    inputs: list[list[int]]  # ops whose outputs op i reads
    recomputable: list[bool]  # may op i run more than once
    keep: set[int]  # ops whose output stays live to the end (graph outputs; the problem adds the unread ones)
    static_bytes: int = 0  # bytes live for the whole run (parameters, graph inputs, ...)
    scratch: list[int] | None = None  # working memory op i's kernel takes while it runs (None: none)
    # The reads the liveness kernel follows, per op: (op read, the view op it is read through, or -1 for a
    # direct read). A view shares its owner's buffer, so a read through it holds the run of the owner the view's
    # latest run read, not the owner's latest run (which differ when the owner is recomputed between the view and
    # its reader). None: every input read directly.
    through: list[list[tuple[int, int]]] | None = None

    def __post_init__(self) -> None:
        n = len(self.size)
        if not (len(self.cost) == len(self.inputs) == len(self.recomputable) == n):
            raise ValueError(f"problem: size, cost, inputs and recomputable must have one entry per op "
                             f"({n}, {len(self.cost)}, {len(self.inputs)}, {len(self.recomputable)})")
        for i, ins in enumerate(self.inputs):
            for j in ins:
                if not 0 <= j < i:
                    raise ValueError(f"problem: op {i} reads op {j}, which does not come before it")
        if any(s < 0 for s in self.size) or any(c < 0 for c in self.cost) or self.static_bytes < 0:
            raise ValueError("problem: sizes, costs and static bytes must be non-negative")
        if self.scratch is None:
            self.scratch = [0] * n
        elif len(self.scratch) != n or any(b < 0 for b in self.scratch):
            raise ValueError("problem: scratch must have one non-negative entry per op")
        if any(not 0 <= k < n for k in self.keep):
            raise ValueError(f"problem: keep names ops outside 0..{n - 1}")
        # onnxruntime holds an output no node reads to the end of the run: such an op is kept
        read = {j for ins in self.inputs for j in ins}
        self.keep = set(self.keep) | {i for i in range(n) if i not in read}
        if self.through is not None:
            if len(self.through) != n:
                raise ValueError("problem: through must have one entry per op")
            for k, pairs in enumerate(self.through):
                ins = set(self.inputs[k])
                if any(i not in ins or (v != -1 and v not in ins) for i, v in pairs):
                    raise ValueError(f"problem: op {k} reads through ops it does not read")

    @property
    def n(self) -> int:
        return len(self.size)

    @cached_property
    def reads(self) -> list[tuple[int, ...]]:
        """The distinct ops each op reads (an op reading one value twice holds it once)."""
        return [tuple(sorted(set(ins))) for ins in self.inputs]

    @cached_property
    def arrays(self) -> Arrays:
        """The problem as numpy arrays, for the liveness kernel."""
        if self.through is None:
            pairs = [[(i, -1) for i in r] for r in self.reads]
        else:
            pairs = [sorted(set(t)) for t in self.through]
        count = np.fromiter((len(r) for r in pairs), dtype=np.int64, count=self.n)
        start = np.cumsum(count) - count
        total = int(count.sum())
        flat = np.fromiter((i for r in pairs for i, _ in r), dtype=np.int64, count=total)
        via = np.fromiter((v for r in pairs for _, v in r), dtype=np.int64, count=total)
        return Arrays(count, start, flat, via, bool((via >= 0).any()), np.asarray(self.size, dtype=np.int64),
                      np.asarray(self.scratch, dtype=np.int64), np.asarray(sorted(self.keep), dtype=np.int64),
                      np.asarray(self.cost, dtype=float), np.asarray(self.movable, dtype=bool),
                      any(self.scratch))

    @cached_property
    def movable_ops(self) -> list[int]:
        return [i for i, m in enumerate(self.movable) if m]

    @cached_property
    def movable_reads(self) -> list[tuple[int, ...]]:
        """The movable ops each op reads: the only inputs a staged schedule may find missing."""
        movable = self.movable
        return [tuple(i for i in r if movable[i]) for r in self.reads]

    @cached_property
    def staged_reads(self) -> list[tuple[int, ...]]:
        """The movable ops each op reads directly: what a staged schedule must find, or recompute, before the op
        runs. An owner read only through a view is not among them: that read takes the copy the view's run read
        (`through`), which the view's own copy stands for; recomputing the owner would make a copy no read takes."""
        if self.through is None:
            return self.movable_reads
        movable = self.movable
        return [tuple(sorted({i for i, v in pairs if v < 0 and movable[i]})) for pairs in self.through]

    @cached_property
    def users(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in range(self.n)]
        for k, ins in enumerate(self.reads):
            for i in ins:
                users[i].append(k)
        return users

    @property
    def baseline_cost(self) -> float:
        """Cost of the schedule that runs every op once."""
        return float(sum(self.cost))

    @property
    def baseline(self) -> list[int]:
        return list(range(self.n))

    @cached_property
    def baseline_peak(self) -> int:
        """The peak of the baseline schedule (store-all): every budget at or above it is met with no
        recomputation."""
        return profile(self, self.baseline).peak

    @cached_property
    def movable(self) -> list[bool]:
        """Ops a solver may run more than once: recomputable and not kept (a kept output is computed once), less
        the free ones: an op of no bytes and no working memory that reads nothing movable (a view of a weight or
        an input) is held from its one run at no cost, and running it again could only add steps. Left movable,
        a network's many views of shared weights or shape constants would cross every cut of its forward region
        and hide its narrow points."""
        movable: list[bool] = []
        size, scratch = self.size, self.scratch
        for i, (r, ins) in enumerate(zip(self.recomputable, self.reads)):
            free = size[i] == 0 and scratch[i] == 0 and not any(movable[j] for j in ins)
            movable.append(r and i not in self.keep and not free)
        return movable

    @cached_property
    def forward_end(self) -> int:
        """One past the last recomputable op: ops before it form the forward region, whose values the baseline
        holds for forward readers anyway."""
        last = max((i for i, r in enumerate(self.movable) if r), default=-1)
        return last + 1

    @cached_property
    def first_backward_read(self) -> list[int]:
        """Per op, its first reader at or after `forward_end` (n: none)."""
        end, n = self.forward_end, self.n
        first = []
        for readers in self.users:
            k = bisect.bisect_left(readers, end)
            first.append(readers[k] if k < len(readers) else n)
        return first

    @cached_property
    def forward_cost(self) -> float:
        """Cost of one run of every movable op: the unit of `extra forward passes`."""
        return float(sum(c for c, m in zip(self.cost, self.movable) if m))

    @cached_property
    def cuts(self) -> tuple[list[int], list[list[int]]]:
        """The forward region's narrow points: see `narrow_points`."""
        return narrow_points(self)

    @cached_property
    def cut_values(self) -> np.ndarray:
        """What crosses each narrow point of `cuts` that is movable, one row per point, padded with -1."""
        crossing = self.cuts[1]
        movable = self.movable
        rows = [[i for i in c if movable[i]] for c in crossing]
        table = np.full((len(rows), max(map(len, rows), default=0)), -1, dtype=np.int64)
        for j, row in enumerate(rows):
            table[j, :len(row)] = row
        return table


# ---------------------------------------------------------------------------------------------------------------
# The liveness kernel


@dataclass
class Simulation:
    peak: int  # the most bytes live at once, static bytes included
    peak_step: int  # position in the schedule where the peak is reached (first such)
    live_after: list[int]  # live bytes right after each step, once its frees are done
    cost: float  # sum of the cost of every occurrence
    during: list[int]  # live bytes while each step runs (its inputs and its output together)


def profile(problem: Problem, schedule: list[int], check: bool = False) -> Simulation:
    """Peak and live bytes of a schedule. An output is allocated when its op runs and freed right after the
    last occurrence that reads it (a read takes the latest earlier occurrence of the producer; through a view,
    the occurrence the view read: `Problem.through`); a recomputed copy nobody reads and a kept output are never
    freed (onnxruntime holds an output no node reads to the end of the run); a first run nobody reads is freed
    right after its op; while an op runs, its inputs and its output are live together. With `check`, a schedule
    that breaks a rule of the problem raises ValueError naming the first rule broken (solvers skip the checks on
    schedules they built)."""
    if check:
        _check(problem, schedule)
    if len(schedule) == 0:
        return Simulation(problem.static_bytes, 0, [], 0.0, [])
    ops, live_after, during, _ = _liveness(problem, schedule)
    peak_step = int(np.argmax(during))
    cost = problem.cost
    return Simulation(max(int(during[peak_step]), problem.static_bytes), peak_step, live_after.tolist(),
                      float(sum(map(cost.__getitem__, schedule))), during.tolist())


def measure(problem: Problem, schedule: list[int]) -> tuple[int, float, np.ndarray]:
    """`profile`'s peak and cost of a schedule the solver built, and its live bytes during each step as an
    array: what a search keeps of each plan."""
    if len(schedule) == 0:
        return problem.static_bytes, 0.0, np.zeros(0, dtype=np.int64)
    ops, _, during, _ = _liveness(problem, schedule)
    # a running sum adds in schedule order, as `profile`'s sum does, so the cost is the same to the last bit
    cost = float(np.cumsum(problem.arrays.cost[ops])[-1])
    return max(int(during.max()), problem.static_bytes), cost, during


def _liveness(problem: Problem, schedule: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The schedule as an array, the live bytes after and during each step (see `profile`), and which recomputed
    copies no read takes."""
    trace = liveness_trace(problem, schedule)
    return trace.ops, trace.live_after, trace.during, trace.unread


class _Trace(NamedTuple):
    """`_liveness`'s arrays and the reads behind them: per step, where its reads begin in `taken` (`begin`,
    `count`), the step each read takes (`taken`) and the step that reads it (`reader`), and the step after which
    each output is freed (`end`; the schedule's length: held to the end)."""

    ops: np.ndarray
    live_after: np.ndarray
    during: np.ndarray
    unread: np.ndarray
    end: np.ndarray
    begin: np.ndarray
    count: np.ndarray
    taken: np.ndarray
    reader: np.ndarray


def liveness_trace(problem: Problem, schedule: list[int] | np.ndarray) -> _Trace:
    """The liveness kernel's whole record of a schedule (`_Trace`): live bytes, the copy each read takes and when
    each output is freed (`profile`, `prune` and `anneal` read it)."""
    length = len(schedule)
    arrays = problem.arrays
    if isinstance(schedule, np.ndarray):
        ops = schedule.astype(np.int64, copy=False)
    else:
        ops = np.fromiter(schedule, dtype=np.int64, count=length)
    positions = np.arange(length, dtype=np.int64)
    # every read: (position of the reader, op read), in schedule order
    count = arrays.read_count[ops]
    total = int(count.sum())
    reader = np.repeat(positions, count)
    first = np.repeat(arrays.read_start[ops] - (np.cumsum(count) - count), count)
    index = first + np.arange(total, dtype=np.int64)
    read = arrays.read_ops[index]
    # the occurrence each read takes: the latest run of the op read before the reader's position; through a
    # view, the latest run before the view's own latest run
    stride = length + 1
    occurrences = np.sort(ops * stride + positions)
    anchor = reader
    if arrays.has_via:
        via = arrays.read_via[index]
        through = via >= 0
        anchor = reader.copy()
        views_taken = np.searchsorted(occurrences, via[through] * stride + reader[through]) - 1
        anchor[through] = occurrences[views_taken] % stride
    taken = occurrences[np.searchsorted(occurrences, read * stride + anchor) - 1] % stride
    end = np.full(length, -1, dtype=np.int64)
    np.maximum.at(end, taken, reader)
    # a recomputed copy no read takes is held to the end of the run, as onnxruntime holds an output no node reads
    # (bench/trace_memory.py); a first run no read takes is freed at once (the graph's readers read the first run,
    # so the copy that served them is the one nobody reads there, which `BudgetProblem.tidy` takes out; an op
    # no op reads at all is kept)
    unread = end < 0
    if unread.any():
        first_run = np.full(problem.n, length, dtype=np.int64)
        np.minimum.at(first_run, ops, positions)
        end[unread] = positions[unread]
        unread &= positions != first_run[ops]  # the copies
        end[unread] = length
    if len(arrays.keep):
        # a kept output's last run is never freed: the last occurrence below the next op's first
        below = np.searchsorted(occurrences, (arrays.keep + 1) * stride) - 1
        latest = occurrences[np.maximum(below, 0)]
        ran = (below >= 0) & (latest // stride == arrays.keep)
        end[latest[ran] % stride] = length
    size = arrays.size[ops]
    freed = np.zeros(length + 1, dtype=np.int64)
    np.add.at(freed, end, size)
    freed = freed[:length]
    live_after = np.cumsum(size - freed)
    live_after += problem.static_bytes
    # while a step runs, what it frees right after it is still live
    during = live_after + freed
    if arrays.has_scratch:
        during += arrays.scratch[ops]
    return _Trace(ops, live_after, during, unread, end, np.cumsum(count) - count, count, taken, reader)


def trace_peak(problem: Problem, trace: _Trace) -> int:
    """The peak of a traced schedule: its most live bytes during a step, at least the static bytes."""
    return max(int(trace.during.max()), problem.static_bytes) if len(trace.ops) else problem.static_bytes


def first_runs(ops: np.ndarray) -> np.ndarray:
    """Per position of a schedule, whether it is its op's first run (the others are recomputed copies)."""
    first = np.zeros(len(ops), dtype=bool)
    first[np.unique(ops, return_index=True)[1]] = True
    return first


PRUNE_CHARGE = 256  # the least work one simulation of `prune` counts: a short schedule's time is mostly overhead


def trace_read(problem: Problem, schedule: np.ndarray) -> tuple[np.ndarray, _Trace, int]:
    """Trace `schedule` after taking out every copy no read takes, and then any copy only those read, until
    none is left: which positions stay (a mask over `schedule`), the trace of what stays, and the work counted
    (each simulation at least PRUNE_CHARGE)."""
    stays = np.ones(len(schedule), dtype=bool)
    steps = 0
    while True:
        trial = schedule[stays]
        trace = liveness_trace(problem, trial)
        steps += max(len(trial), PRUNE_CHARGE)
        if not trace.unread.any():
            return stays, trace, steps
        stays[np.flatnonzero(stays)[trace.unread]] = False


def prune(problem: Problem, schedule: list[int], budget: int, work: int) -> tuple[list[int], int, float, int]:
    """Recomputations a schedule can do without: each, the costliest first, is taken out when the copy before
    it can serve its readers instead (it is then held longer) and the peak stays within `budget`; the copies
    that then serve no reader go with it. A staged plan cannot say this (a value held, then recomputed, then held
    again), so it cuts the cost of the plans a search over stages finds. Before a removal is simulated, the copy
    before it, held longer, is added to the live bytes of the steps that change in no other way (up to the first
    copy taken out, and to the earliest step at which an output those copies read is freed sooner): when that
    alone breaks the budget, the removal is refused without a simulation. Stops when a pass takes nothing out,
    or when `work` schedule steps have been simulated or scanned (each simulation, and each removal refused
    unsimulated, counts at least PRUNE_CHARGE). Returns (schedule, peak, cost, steps counted)."""
    cost, size = problem.arrays.cost, problem.arrays.size
    current = np.asarray(schedule, dtype=np.int64)
    trace = liveness_trace(problem, current)
    peak = trace_peak(problem, trace)
    total = float(np.cumsum(cost[current])[-1]) if len(current) else 0.0
    steps = max(len(current), PRUNE_CHARGE)
    while True:
        firsts = first_runs(current)
        recomputed = np.flatnonzero(~firsts)
        order = recomputed[np.lexsort((recomputed, -cost[current[recomputed]]))]
        kept = np.ones(len(current), dtype=bool)  # positions of `current` in the schedule tried last
        state = RemovalCheck(trace, firsts)
        taken_out = False
        for q in order.tolist():
            if not kept[q]:
                continue
            if steps >= work:
                return current[kept].tolist(), peak, total, steps
            dead, scanned = state.removal(int(state.where[q]), size, budget)
            if scanned:
                steps += max(scanned, PRUNE_CHARGE)  # the scans, at least a simulation's charge
                continue
            trial_kept = kept.copy()
            trial_kept[state.index[dead]] = False
            stays, result, counted = trace_read(problem, current[trial_kept])
            trial_kept[np.flatnonzero(trial_kept)[~stays]] = False
            steps += counted
            trial_peak = trace_peak(problem, result)
            if trial_peak <= budget:
                kept, taken_out = trial_kept, True
                peak, total = trial_peak, float(np.cumsum(cost[result.ops])[-1])
                state = RemovalCheck(result, firsts[kept], kept)
        if not taken_out:
            return current.tolist(), peak, total, steps
        current, trace = current[kept], state.trace


class RemovalCheck:
    """A schedule `prune` or `anneal` is trying, as positions of the pass's schedule (`kept`), its trace, and the
    readers of each of its copies (as lists: the searches below walk them one read at a time)."""

    def __init__(self, trace: _Trace, firsts: np.ndarray, kept: np.ndarray | None = None):
        self.trace, self.firsts = trace, firsts.tolist()
        self.index = np.flatnonzero(kept) if kept is not None else np.arange(len(trace.ops))
        self.where = np.full(len(kept) if kept is not None else len(trace.ops), -1, dtype=np.int64)
        self.where[self.index] = np.arange(len(self.index))
        readers = np.bincount(trace.taken, minlength=len(trace.ops))
        self.readers = readers.tolist()
        self.taken, self.begin = trace.taken.tolist(), trace.begin.tolist()
        self.stop = (trace.begin + trace.count).tolist()
        self.end = trace.end.tolist()
        # the steps that read each copy, in order: copy c's are read_by[read_from[c]:read_from[c + 1]]
        self.read_by = trace.reader[np.argsort(trace.taken, kind="stable")].tolist()
        self.read_from = np.concatenate(([0], np.cumsum(readers))).tolist()

    def removal(self, t: int, size: np.ndarray, budget: int) -> tuple[list[int], int]:
        """Taking out the copy at step t: the steps that go with it (`dead_with`), and 0, or the steps scanned
        when the copy before it, held longer, breaks `budget` on the steps that change in no other way (up to
        `unchanged_until`): the removal is then refused without a simulation. A copy no read takes holds nothing
        longer when it goes."""
        dead = self.dead_with(t)
        if not self.readers[t]:
            return dead, 0
        ops = self.trace.ops
        v = int(ops[t])
        before = np.flatnonzero(ops[:t] == v)
        held_from = self.end[int(before[-1])] + 1 if len(before) else t
        until = self.unchanged_until(dead, size)
        if held_from < until and int(self.trace.during[held_from:until].max()) + int(size[v]) > budget:
            return dead, until - held_from + len(dead)
        return dead, 0

    def dead_with(self, t: int) -> list[int]:
        """Step t and the recomputed copies that only it, or copies dead in turn, read."""
        readers, firsts, taken, begin, stop = self.readers, self.firsts, self.taken, self.begin, self.stop
        dead, left = [t], {}
        for d in dead:
            for c in taken[begin[d]:stop[d]]:
                n = left.get(c, readers[c]) - 1
                left[c] = n
                if n == 0 and not firsts[c]:
                    dead.append(c)
        return dead

    def unchanged_until(self, dead: list[int], size: np.ndarray) -> int:
        """The first step whose live bytes taking out `dead` may lower, other than by the copies themselves: the
        first of them, or the step after the new last reader of an output only they read last. 0 when a copy is
        a view (taking it out moves reads through it to other copies)."""
        if not size[self.trace.ops[dead]].all():
            return 0
        taken, begin, stop, end, read_by, read_from = (self.taken, self.begin, self.stop, self.end, self.read_by,
                                                       self.read_from)
        out = set(dead)
        until = min(dead)
        for d in dead:
            for c in taken[begin[d]:stop[d]]:
                if c in out or end[c] not in out:
                    continue
                later = [r for r in read_by[read_from[c]:read_from[c + 1]] if r not in out]
                until = min(until, max(later, default=c) + 1)
        return until


def freed_after(problem: Problem, schedule: list[int]) -> list[int]:
    """Per position, the position after which its output is freed, by `profile`'s rules (the schedule's length:
    held to the end of the run)."""
    return liveness_trace(problem, schedule).end.tolist() if len(schedule) else []


def unread_copies(problem: Problem, schedule: list[int]) -> list[int]:
    """The positions of recomputed copies that no read takes (`profile`'s rules, views included): taking one
    out changes no read, so the schedule then holds less and costs less. Taking one out may leave the copies it
    read unread in turn; call again until none is left."""
    if len(schedule) == 0:
        return []
    return np.flatnonzero(_liveness(problem, schedule)[3]).tolist()


def without_unread_copies(problem: Problem, schedule: list[int]) -> list[int]:
    """The schedule less every recomputed copy that no read takes, and the copies that only those read, in
    turn: the same reads, less held and less run."""
    while True:
        dead = set(unread_copies(problem, schedule))
        if not dead:
            return schedule
        schedule = [k for p, k in enumerate(schedule) if p not in dead]


def _check(problem: Problem, schedule: list[int]) -> None:
    n = problem.n
    reads, recomputable, keep = problem.reads, problem.recomputable, problem.keep
    seen = [False] * n
    count = [0] * n
    last_fixed = -1
    for p, op in enumerate(schedule):
        if not isinstance(op, (int, np.integer)) or not 0 <= op < n:
            raise ValueError(f"schedule position {p}: {op!r} is not an op index in 0..{n - 1}")
        for i in reads[op]:
            if not seen[i]:
                raise ValueError(f"schedule position {p}: op {op} reads op {i}, which has not run before it")
        seen[op] = True
        count[op] += 1
        if count[op] > 1:
            if not recomputable[op]:
                raise ValueError(f"schedule position {p}: op {op} is not recomputable and runs a second time")
            if op in keep:
                raise ValueError(f"schedule position {p}: op {op} is kept to the end and runs a second time")
        if not recomputable[op]:
            if op < last_fixed:
                raise ValueError(f"schedule position {p}: non-recomputable op {op} runs after op {last_fixed}, "
                                 f"out of the baseline order")
            last_fixed = op
    missing = [i for i in range(n) if count[i] == 0]
    if missing:
        raise ValueError(f"schedule never runs op {missing[0]}" + (f" (and {len(missing) - 1} more)"
                                                                   if len(missing) > 1 else ""))


def validate(problem: Problem, schedule: list[int]) -> None:
    """Raise ValueError with the reason when `schedule` is not a valid schedule of `problem`: an op that never
    runs, a read before the producer ran, a second run of a non-recomputable or kept op, or non-recomputable ops
    out of their baseline order."""
    _check(problem, schedule)


def simulate(problem: Problem, schedule: list[int]) -> Simulation:
    """`profile` with the schedule checked first."""
    return profile(problem, schedule, check=True)


def floor(problem: Problem) -> int:
    """A peak no valid schedule can go below.

    When op i runs, these buffers are live at once, and each is a different buffer: the static bytes, i's
    output, the outputs i reads, and every kept output already computed. A kept output is computed once and
    never freed, so it is live at i if its op must run before i: an ancestor of i, or (when i is not
    recomputable) a non-recomputable op before i in the baseline, or an ancestor of one. At the end of any
    schedule every kept output is live. When i is not recomputable, so is every output of a non-recomputable
    op before i that a non-recomputable op after i reads: both run once, in the baseline order, so its one copy
    lives across i (the backward's gradients in flight). The floor is the largest of these sums; it is a lower
    bound, not always reachable (a budget between it and the true least peak gets no schedule from the
    solvers)."""
    return sum(floor_parts(problem)[:4])


class FloorParts(NamedTuple):
    """The floor in its parts, where it is reached."""

    static: int  # weights and inputs
    kept: int  # kept outputs computed by then
    in_flight: int  # outputs of ops that run once, read by a later one
    working: int  # the op's own output, inputs and working memory
    op: int | None  # the op (None: the end of the schedule, where every kept output is live)


def floor_parts(problem: Problem) -> FloorParts:
    """`floor`, in its parts."""
    end = FloorParts(problem.static_bytes, sum(problem.size[k] for k in problem.keep), 0, 0, None)
    best = end
    for i, parts in enumerate(_necessary_parts(problem)):
        if sum(parts) > sum(best[:4]):
            best = FloorParts(*parts, i)
    return best


def necessary_bytes(problem: Problem) -> list[int]:
    """Per op, the bytes live in any schedule while it runs (see `floor`), static bytes included."""
    return [sum(p) for p in _necessary_parts(problem)]


def _necessary_parts(problem: Problem) -> list[tuple[int, int, int, int]]:
    n = problem.n
    keep, size, reads = problem.keep, problem.size, problem.reads
    # kept ancestors as bitsets (Python ints): cheap for the tens or thousands of kept outputs of a real graph
    bit = {k: 1 << j for j, k in enumerate(sorted(keep))}
    kept_size = {1 << j: size[k] for j, k in enumerate(sorted(keep))}
    before = [0] * n  # kept ops that must run before op i (strictly)
    fixed_prefix = 0  # kept ops that must run before the next non-recomputable op
    sums: dict[int, int] = {0: 0}

    def bytes_of(mask: int) -> int:
        total = sums.get(mask)
        if total is None:
            total, m = 0, mask
            while m:
                low = m & -m
                total += kept_size[low]
                m ^= low
            sums[mask] = total
        return total

    recomputable = problem.recomputable
    last_fixed_reader = _last_fixed_reader(problem)
    closing: dict[int, list[int]] = {}
    in_flight: set[int] = set()  # outputs of non-recomputable ops that a later non-recomputable op reads
    in_flight_bytes = 0
    out = []
    for i in range(n):
        mask = 0
        for j in reads[i]:
            mask |= before[j] | bit.get(j, 0)
        if not problem.recomputable[i]:
            mask |= fixed_prefix
            fixed_prefix = mask | bit.get(i, 0)
        before[i] = mask
        working = size[i] + problem.scratch[i] + sum(size[j] for j in reads[i])
        counted = bit.get(i, 0)
        for j in reads[i]:
            counted |= bit.get(j, 0)
        kept = bytes_of(mask & ~counted)
        flying = 0
        if not recomputable[i]:
            flying = in_flight_bytes - sum(size[j] for j in reads[i] if j in in_flight)
            for j in closing.pop(i, ()):
                in_flight.discard(j)
                in_flight_bytes -= size[j]
            if i not in keep and last_fixed_reader[i] > i:
                in_flight.add(i)
                in_flight_bytes += size[i]
                closing.setdefault(last_fixed_reader[i], []).append(i)
        out.append((problem.static_bytes, kept, flying, working))
    return out


def _last_fixed_reader(problem: Problem) -> list[int]:
    """Per op, its last reader that is not recomputable (-1: none)."""
    recomputable = problem.recomputable
    return [max((u for u in readers if not recomputable[u]), default=-1) for readers in problem.users]


def extra_cost_bound(problem: Problem, budget: int) -> float | None:
    """A lower bound on the extra cost of any schedule under `budget` whose ops first run in the baseline order
    (every solver's schedules do); None when no schedule fits.

    Take an op k that runs once (not movable). Every movable value v made before k that an op running once after
    k reads, and that k does not read itself, is either live while k runs, or recomputed after k (its first run
    is over), at a cost of at least `_price_per_byte` times its bytes. While k runs, `necessary_bytes` are live
    besides; so the values kept across k fit in the budget less those bytes, and the rest cost their runs. The
    cheapest choice, with values taken fractionally (the cheapest per byte dropped first), bounds the extra cost
    from below, and so does the largest such bound over k. It does not count recomputations nested inside
    others (revolve's inner levels) nor inputs shared between values, so it is not tight; on a chain it is exact
    for one level of recomputation."""
    n = problem.n
    if n == 0:
        return 0.0 if budget >= problem.static_bytes else None
    necessary = necessary_bytes(problem)
    if budget < max(necessary) or budget < problem.static_bytes + sum(problem.size[k] for k in problem.keep):
        return None
    movable, size, cost, reads = problem.movable, problem.size, problem.cost, problem.reads
    last_reader = _last_fixed_reader(problem)
    price = _price_per_byte(problem, last_reader)
    # the values that may need dropping, by cost per byte (a value of no bytes is free to keep)
    ranked = sorted((v for v in range(n) if movable[v] and size[v] > 0 and last_reader[v] > v),
                    key=lambda v: (price[v], v))
    rank = {v: r for r, v in enumerate(ranked)}
    tree = _Fenwick(len(ranked))
    leaving: dict[int, list[int]] = {}
    best = 0.0
    for k in range(n):
        for v in leaving.pop(k, ()):
            tree.add(rank[v], -size[v], -price[v] * size[v])
        if not movable[k]:
            held = [v for v in reads[k] if v in rank and v < k < last_reader[v]]
            for v in held:
                tree.add(rank[v], -size[v], -price[v] * size[v])
            drop = tree.total_size - (budget - necessary[k])
            if drop > 0:
                best = max(best, tree.cheapest(drop))
            for v in held:
                tree.add(rank[v], size[v], price[v] * size[v])
        if k in rank:  # from the next op on, k's output is made and a later fixed op reads it
            tree.add(rank[k], size[k], price[k] * size[k])
            leaving.setdefault(last_reader[k], []).append(k)
    return best


def _price_per_byte(problem: Problem, last_reader: list[int]) -> list[float]:
    """Per movable op v, a lower bound on the cost per byte of not keeping v: recomputing v needs its inputs,
    and an input that only v reads, and that no op running once reads, is private to v: it is kept in v's place
    (freeing the difference) or recomputed as well. Along v's chain of private inputs (each the only movable input
    of the one before), the least cost per byte freed over those choices; other inputs are taken as free."""
    n = problem.n
    movable, size, cost, users = problem.movable, problem.size, problem.cost, problem.users
    reads = problem.movable_reads
    price = [0.0] * n
    for v in range(n):
        if not movable[v] or size[v] == 0:
            continue
        best, spent, u = math.inf, cost[v], v
        while len(reads[u]) == 1 and len(users[reads[u][0]]) == 1 and last_reader[reads[u][0]] < 0:
            w = reads[u][0]
            freed = size[v] - size[w]  # keep w in v's place
            if freed > 0:
                best = min(best, spent / freed)
            spent += cost[w]  # or recompute it as well
            u = w
        price[v] = min(best, spent / size[v])  # u's inputs are taken as free
    return price


class _Fenwick:
    """Sizes and costs by rank, with prefix sums: the cost of dropping the cheapest `bytes` (fractionally)."""

    def __init__(self, n: int):
        self.n = n
        self.size = [0] * (n + 1)
        self.cost = [0.0] * (n + 1)
        self.item_size = [0] * n
        self.item_cost = [0.0] * n
        self.total_size = 0
        self.top = 1 << max(n.bit_length() - 1, 0) if n else 0

    def add(self, r: int, size: int, cost: float) -> None:
        self.item_size[r] += size
        self.item_cost[r] += cost
        self.total_size += size
        i = r + 1
        while i <= self.n:
            self.size[i] += size
            self.cost[i] += cost
            i += i & -i

    def _prefix_cost(self, i: int) -> float:
        total = 0.0
        while i > 0:
            total += self.cost[i]
            i -= i & -i
        return total

    def cheapest(self, bytes_: int) -> float:
        """The cost of the cheapest-per-byte items whose sizes sum to `bytes_` (the last one taken in part)."""
        if bytes_ >= self.total_size:
            return self._prefix_cost(self.n)
        # the longest prefix of ranks whose sizes sum below bytes_
        pos, taken_size, taken_cost = 0, 0, 0.0
        step = self.top
        while step:
            nxt = pos + step
            if nxt <= self.n and taken_size + self.size[nxt] < bytes_:
                pos = nxt
                taken_size += self.size[nxt]
                taken_cost += self.cost[nxt]
            step >>= 1
        # the item at rank pos (0-based) completes it
        part = (bytes_ - taken_size) / self.item_size[pos]
        return taken_cost + part * self.item_cost[pos]


# ---------------------------------------------------------------------------------------------------------------
# Solutions


@dataclass
class Solution:
    schedule: list[int]
    peak: int  # simulated
    cost: float  # of the whole schedule
    extra_cost: float  # over the baseline, where each op runs once
    recomputed: dict[int, int]  # op -> how many extra times it runs
    solver: str
    gap: float | None = None  # relative optimality gap of the extra cost when known (0.0: proven optimal)
    status: str = ""  # "optimal", "feasible" (a time limit stopped the proof), "heuristic"

    @property
    def kept(self) -> list[int]:
        """Ops that run once (their output is held from its only run to its last reader)."""
        counted = set(self.recomputed)
        return sorted(set(self.schedule) - counted)


def make_solution(problem: Problem, schedule: list[int], solver: str, gap: float | None = None,
                  status: str = "") -> Solution:
    sim = simulate(problem, schedule)
    runs: dict[int, int] = {}
    for op in schedule:
        runs[op] = runs.get(op, 0) + 1
    recomputed = {op: r - 1 for op, r in sorted(runs.items()) if r > 1}
    return Solution(list(schedule), sim.peak, sim.cost, sim.cost - problem.baseline_cost, recomputed, solver,
                    gap, status)


# ---------------------------------------------------------------------------------------------------------------
# Plans and their staged schedules

SHORT, DROP, REUSE, HOLD = 0, 1, 2, 3
SHORT_REACH = 2


class Plan(tuple):
    """A plan (a tuple of entries) that computes its hash once: a plan of a large graph has tens of thousands of
    entries, and the solvers use it as a dictionary key several times over. Equal to, and hashed as, the plain
    tuple of the same entries."""

    def __hash__(self) -> int:
        cached = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached


def plan_entry(n: int, horizon: int, reuse_from: int) -> int:
    """One op's plan entry in a problem of n ops (horizon and reuse stage in 0..n; n: the end)."""
    return horizon * (n + 1) + reuse_from


def plan_of_classes(problem: Problem, classes: list[int] | np.ndarray) -> tuple[int, ...]:
    """The plan of one named class per op (ignored for ops that are not movable)."""
    n, last_forward = problem.n, problem.forward_end - 1
    classes = np.asarray(classes)
    index = np.arange(n, dtype=np.int64)
    entries = np.where(classes == REUSE, plan_entry(n, last_forward, 0), plan_entry(n, last_forward, n))
    short = classes == SHORT
    entries[short] = plan_entry(n, np.minimum(last_forward, index[short] + SHORT_REACH), n)
    entries[(classes == HOLD) | ~problem.arrays.movable] = plan_entry(n, n, 0)
    return Plan(entries.tolist())


def build_schedule(problem: Problem, plan: tuple[int, ...] | list[int],
                   demands: list[list[int]] | None = None) -> list[int]:
    """The staged schedule of a plan (see the module docstring; entries of ops that are not movable are
    ignored). `demands`, when given, receives for each op the stages at which something read it."""
    if demands is not None:
        return _staged(problem, plan, demands)
    n = problem.n
    movable_reads, movable_ops = problem.staged_reads, problem.movable_ops
    # good[i]: the last stage at which op i's latest copy serves a reader. Its first run serves up to its horizon;
    # a copy recomputed at stage t serves to the end if t is at or after the op's reuse stage, else stage t alone.
    # Only movable ops are ever missing: an op that runs once is where it was left from its stage on. good[i] is
    # kept as served[i], a number below t * (n + 1) exactly when t > good[i]: at first the plan entry itself
    # (horizon * (n + 1) plus a reuse stage below n + 1), then good[i] * (n + 1); so no entry is split up front.
    stride = n + 1
    served = list(plan)
    # while no horizon ends inside the forward region, its ops run alone in order (every input where it was left)
    start = problem.forward_end
    if movable_ops and min(map(served.__getitem__, movable_ops)) < (start - 1) * stride:
        start = 0
    schedule = list(range(start))
    append, extend = schedule.append, schedule.extend
    held = n * stride
    for t in range(start, n):
        now = t * stride
        # most ops find every input where it was left: they run alone, with no search for what to recompute
        for i in movable_reads[t]:
            if now > served[i]:
                break
        else:
            append(t)
            continue
        # what op t needs, transitively, that no copy serves: recomputed at this stage, in index order (a copy
        # taken in serves stage t at once, so nothing is taken twice)
        need = [t]
        for k in need:
            for i in movable_reads[k]:
                if now <= served[i]:
                    continue
                served[i] = held if t >= plan[i] % stride else now
                need.append(i)
        need.sort()
        extend(need)
    return schedule


def _staged(problem: Problem, plan: tuple[int, ...] | list[int], demands: list[list[int]]) -> list[int]:
    """`build_schedule`, recording for each movable op the stages that read it directly: every op's inputs are
    searched."""
    n = problem.n
    reads, movable = problem.staged_reads, problem.movable
    horizon = [plan[i] // (n + 1) if movable[i] else n for i in range(n)]
    reuse_from = [plan[i] % (n + 1) for i in range(n)]
    computed_at = [-1] * n  # stage of the latest run of each op
    marked = [-1] * n  # the stage whose search last took the op in
    schedule: list[int] = []
    for t in range(n):
        marked[t] = t
        need = [t]
        stack = [t]
        while stack:
            k = stack.pop()
            for i in reads[k]:
                if not demands[i] or demands[i][-1] != t:
                    demands[i].append(t)
                if marked[i] == t:
                    continue
                at = computed_at[i]
                if (t <= horizon[i] if at == i else at >= reuse_from[i]):
                    continue
                marked[i] = t
                need.append(i)
                stack.append(i)
        if len(need) == 1:
            schedule.append(t)
            computed_at[t] = t
        else:
            need.sort()
            schedule.extend(need)
            for i in need:
                computed_at[i] = t
    return schedule


MAX_CUT_VALUES = 64  # a position crossed by more values than this is no narrow point


def crossings(problem: Problem) -> tuple[list[int], list[list[int]], list[int]]:
    """Positions in the forward region, for each the movable outputs made at or before it that forward ops
    after it read (holding those splits the forward region in two), and their bytes. Positions crossed by more
    than MAX_CUT_VALUES values are left out."""
    end = problem.forward_end
    movable, users, size = problem.movable, problem.users, problem.size
    last_forward_reader = [max((u for u in users[i] if u < end), default=-1) for i in range(problem.n)]
    open_values: dict[int, None] = {}
    open_bytes = 0
    closing: dict[int, list[int]] = {}
    positions: list[int] = []
    crossing: list[list[int]] = []
    weights: list[int] = []
    for p in range(end):
        for i in closing.pop(p, ()):
            del open_values[i]
            open_bytes -= size[i]
        if movable[p] and last_forward_reader[p] > p:
            open_values[p] = None
            open_bytes += size[p]
            closing.setdefault(last_forward_reader[p], []).append(p)
        if not movable[p] or len(open_values) > MAX_CUT_VALUES:
            continue
        positions.append(p)
        # p itself is the cut when nothing crosses (the forward region's last op)
        crossing.append(list(open_values) or [p])
        weights.append(open_bytes)
    return positions, crossing, weights


def narrow_points(problem: Problem) -> tuple[list[int], list[list[int]]]:
    """The positions of `crossings` crossed by no more bytes than about their neighbours, so segments end at
    the graph's narrow points (articulation points in a residual network), with what crosses each."""
    positions, crossing, weights = crossings(problem)
    narrow = [j for j in range(len(positions))
              if weights[j] == 0 or weights[j] <= 1.5 * min(weights[max(0, j - 1):j + 2])]
    return [positions[j] for j in narrow], [crossing[j] for j in narrow]
