"""The least recomputation whose simulated peak fits a memory budget, as a policy that returns a `Plan`.

`MirrorOptions` is what the mirror pass is asked (parsed once); `budget_policy` decides and returns a
`BudgetResult`: the plan and the report (fits, predicted peak, budget, floor, least peak found, cost units,
solver status and gap). It never edits the graph; `plan.apply` does. When nothing fits it raises `BudgetError`,
a UsageError that carries the same report, so a report can be written on failure too.

The training graph becomes a `solvers.Problem`: its nodes in schedule order, each with the bytes of its outputs,
its cost (`cost.py`), the nodes it reads, whether it may run again (a forward node that is not random, writes no
graph output and is not read by name inside control flow), and the static bytes (weights and graph inputs). A
solver returns a schedule in which forward nodes may appear again; it becomes a plan (an order of node names with
recomputations), `plan.apply` rewrites the graph, and the graph's own simulator checks the peak of what was
written. Where the two models differ (a node with several outputs frees them together in the problem, one by
one in the graph), the graph's peak can only be lower or equal; should it still exceed the budget, the
solve is repeated under a budget lowered by the excess.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field

from ..contract import BACKWARD, FORWARD, RECOMPUTE
from ..errors import UsageError
from ..ir import Graph, Node
from . import solvers
from .arena import SPLIT_ALWAYS, least_limit, resident, runs_within
from .cost import CostModel
from .mxnet import RANDOM, MirrorFunction, mxnet_plan
from .plan import Plan, Step
from .simulate import format_bytes
from .simulate import allocations_of_plan, live_peak, peak_of_plan, scratch_bytes, view_of_input

SOLVERS = ("fast", "dp", "exact", "milp")
# Plans past this many extra forward passes are not chosen by default. Near the floor the solvers can reach a
# few MiB lower by recomputing the forward pass from the inputs again and again; onnxruntime ran such graphs
# well above their simulated peak (BERT-base 71 extra passes: 1480 MiB measured against 933 simulated; ViT-B/16
# 13.7 passes: 1210 against 694), and at 5-23x the step time, while every plan of at most 2.7 passes measured
# within 1% of its simulated peak.
MAX_EXTRA_PASSES = 4.0
ALLOCATORS = ("exact", "arena")
# --allocator arena: the emulated arena (memory.arena, kNextPowerOfTwo) is raised by this much before it is held
# against the budget; the plan must fit it with chunks split by onnxruntime's default rule (CUDA's arena) and with
# every chunk split (the one onnxgrad's CPU sessions give such a plan: it held 3-11% less on most plans, but an
# emulation of it alone let a ResNet-50 plan reach 1.03 of its budget). What a CPU process holds for the plan
# without a limit must fit too, as far as it is modelled (`arena.resident`: within 0.3% on the dynamo
# ResNet-50's plans; 1.8% under the least limit with this margin on the least of them). The margin covers what
# neither models: onnxruntime runs the nodes its fusions make after the file's ready nodes, and on BERT-base's
# least arena plan that order needs 602.5 MiB of arena where the file's needs 545.8 (bench/trace_memory.py
# --arena); the process held 632.4 MiB, `resident` says 578.4, and the budget left 626.5 above the static bytes
# (1.01; BENCHMARKS.md).
ARENA_MARGIN = 0.10
# --allocator arena: the most schedules of the front whose need in the arena is emulated for one budget (0.3-0.6 s
# each on ResNet-50, whose front has 22 staged and 22 pruned)
ARENA_EVALUATIONS = 64
COSTS = ("model", "prices", "profile")
# Schedule steps per problem op, and at least the search's own work, that the fast solver spends pruning its
# front (`solvers.prune`). On ResNet-50 (training sizes) it takes a 33-pass plan at the floor to 1.5 passes, so the
# least budget within 4 extra forward passes is 315 MiB (floor 314.1), and adds 1-2 s; the transformer exports have
# too many movable ops for the local search and are not pruned; on the 30-op random DAG's least peak (60 ops with
# the backward) it cuts the cost from 515 to 190; a front of 800 ops stays under 1 s (BENCHMARKS.md).
PRUNE_WORK_PER_OP = 2000
# The least schedule steps the annealing of the plan for a budget spends (`solvers.anneal`): on small problems each
# simulation is mostly overhead and counts PRUNE_CHARGE, so 2000 steps per op would buy a few hundred moves per
# search; with this many the 30-op random DAGs' plans come within 1.10x of CP-SAT's best, for about 1.5 s
# (BENCHMARKS.md, "Fifth round: copies placed one by one"). Problems over 800 ops spend their 2000 per op.
ANNEAL_LEAST_WORK = 1_600_000


def solver_limits(problem: solvers.Problem, work: int = solvers.DEFAULT_WORK, time_limit: float = 60.0,
                  workers: int = 2, target: int | None = None) -> solvers.Limits:
    """What the solvers may spend on `problem`, the fast solver's front pruned (`PRUNE_WORK_PER_OP`), the
    schedules under `target` (the problem's budget) first, and the cheapest under it annealed with as much work
    again (at least ANNEAL_LEAST_WORK): the one front that `mirror --budget` chooses from and `mirror --sweep`
    draws."""
    extra = max(work, PRUNE_WORK_PER_OP * problem.n)
    return solvers.Limits(work=work, time_limit=time_limit, workers=workers, prune_work=extra, prune_below=target,
                          anneal_work=max(extra, ANNEAL_LEAST_WORK))


def problem_front(problem: solvers.Problem, options: MirrorOptions, unmirrored_peak: int) -> solvers.Front:
    """The fast solver's front that `mirror --budget` chooses from and `mirror --sweep` draws."""
    target = problem_target(problem, options, unmirrored_peak)
    return solvers.front(problem, solver_limits(problem, options.work, options.time_limit, options.workers, target))


def problem_target(problem: solvers.Problem, options: MirrorOptions, unmirrored_peak: int) -> int | None:
    """The budget of `options` in the problem's bytes (None: auto, or no budget given). The problem counts the
    small Constant nodes as alive throughout, the graph frees them: the graph's budget is raised by that
    difference."""
    wanted = parse_budget(options.budget or "auto").resolve(options.fraction_of or unmirrored_peak)
    return None if wanted is None else wanted + max(0, problem.baseline_peak - unmirrored_peak)


@dataclass(frozen=True)
class MirrorOptions:
    """What the mirror pass is asked, parsed once. `budget`: bytes, a fraction of the unmirrored peak ("0.4x"),
    "auto", or None (MXNet's policy); `solver`: fast (default), dp, exact (CP-SAT from the fast plan) or milp
    (HiGHS); `cost`: model, prices or profile; `time_limit`: seconds for the exact solvers; `work`: the fast solver's
    effort, in schedule steps (a count, so the plan is the same on every machine). `loops`: Loop or Scan node name
    -> its segment lengths, innermost first (segments.LoopScheme; a loop not named runs unsegmented), which the
    budget's retry over loop schemes gives (api.py); None: the gradient pass chooses. `fraction_of`: the peak a
    fractional budget ("0.4x") is a fraction of, when the graph the policy sees has loops segmented that the
    unmirrored graph runs as they are; None: that graph's own unmirrored peak. `max_extra_passes`: no plan that
    recomputes more than this many forward passes' worth is chosen (MAX_EXTRA_PASSES says why)."""

    budget: str | None = None
    solver: str = "fast"
    cost: str = "model"
    time_limit: float = 60.0
    work: int = solvers.DEFAULT_WORK
    workers: int = 2
    save: frozenset[str] = frozenset()
    recompute: frozenset[str] = frozenset()
    sweep: str | None = None
    loops: dict[str, tuple[int, ...]] | None = None
    fraction_of: int | None = None
    max_extra_passes: float = MAX_EXTRA_PASSES
    allocator: str = "exact"  # exact: the budget bounds the live bytes; arena: also onnxruntime's arena (memory.arena)

    def __post_init__(self) -> None:
        if self.allocator not in ALLOCATORS:
            raise UsageError(f"--allocator {self.allocator}: expected one of {', '.join(ALLOCATORS)}")
        if self.solver not in SOLVERS:
            raise UsageError(f"--solver {self.solver}: expected one of {', '.join(SOLVERS)}")
        if self.cost not in COSTS:
            raise UsageError(f"--cost {self.cost}: expected model, prices or profile")
        if not self.max_extra_passes >= 0:
            raise UsageError(f"--max-extra-passes {self.max_extra_passes}: expected a number >= 0")

    @classmethod
    def of(cls, options: MirrorOptions | dict) -> MirrorOptions:
        """The options as given: a MirrorOptions, or its fields as a dict."""
        return options if isinstance(options, MirrorOptions) else cls.from_dict(options)

    @classmethod
    def from_dict(cls, options: dict) -> MirrorOptions:
        """The options as `api.build(mirror_options=...)` and the command line give them (a dict)."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UsageError(f"mirror options: unknown {', '.join(unknown)}")
        values = {k: v for k, v in options.items() if v is not None}
        for key in ("save", "recompute"):
            if key in values:
                values[key] = frozenset(values[key])
        if "loops" in values:
            values["loops"] = {name: tuple(int(k) for k in lengths) for name, lengths in values["loops"].items()}
        for key in ("time_limit", "max_extra_passes"):
            if key in values:
                values[key] = float(values[key])
        return cls(**values)

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


@dataclass
class Budget:
    """A budget as the user wrote it: bytes, a fraction of the unmirrored peak, or `auto`."""

    text: str
    bytes: int | None = None
    fraction: float | None = None
    auto: bool = False

    def resolve(self, unmirrored_peak: int) -> int | None:
        if self.auto:
            return None
        return self.bytes if self.bytes is not None else int(self.fraction * unmirrored_peak)


def parse_budget(text: str) -> Budget:
    """'16GiB', '2e9', '1500MB', '0.4x' or 'auto'."""
    t = text.strip().lower()
    if t == "auto":
        return Budget(text, auto=True)
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(x|[kmgt]i?b|b)?", t)
    if m:
        value, unit = float(m.group(1)), m.group(2) or ""
        if unit == "x":
            if not 0 < value <= 1:
                raise UsageError(f"--budget {text}: a fraction of the unmirrored peak must be in (0, 1]")
            return Budget(text, fraction=value)
        if value > 0:
            return Budget(text, bytes=int(value * UNITS[unit]))
    raise UsageError(f"--budget {text}: expected bytes (e.g. 16GiB, 1500MB, 2e9), a fraction of the unmirrored "
                     f"peak (e.g. 0.4x) or auto")


class BudgetProblem:
    """A training graph as a `solvers.Problem`, and the way back from a solver's schedule to a `Plan`."""

    def __init__(self, graph: Graph, nbytes: dict[int, int], costs: CostModel, save: set[str] = frozenset(),
                 recompute: set[str] = frozenset()):
        self.graph = graph
        # Constant nodes (shapes, axes, scalars) are counted as static and placed before their first reader:
        # they are small, and leaving them out keeps the problem the size of the real computation
        self.constants = [n for n in graph.nodes if not n.all_inputs and n.op_type == "Constant"]
        constant_ids = {id(n) for n in self.constants}
        self.nodes: list[Node] = [n for n in graph.nodes if id(n) not in constant_ids]
        index = {id(n): k for k, n in enumerate(self.nodes)}
        outputs = {id(v) for v in graph.outputs}
        read_by_name = {id(v) for n in graph.nodes for v in n.implicit_inputs}
        self.reasons: dict[str, str] = {}
        # a view (Reshape, a folded Transpose, ...) shares its input's buffer, as in the simulator: it adds no
        # bytes, and whatever reads it reads the buffer's owner too, which so lives as long as the view does
        views = {k for k, n in enumerate(self.nodes) if view_of_input(n, outputs)}

        def owners(v) -> list[int]:
            found = []
            while v is not None and v.producer is not None and id(v.producer) in index:
                k = index[id(v.producer)]
                found.append(k)
                if k not in views:
                    break
                v = v.producer.inputs[0]
            return found

        size, cost, inputs, recomputable, keep, scratch, through = [], [], [], [], set(), [], []
        for k, n in enumerate(self.nodes):
            size.append(0 if k in views else sum(nbytes[id(v)] for v in n.outputs if v.name))
            scratch.append(scratch_bytes(n, nbytes))
            cost.append(costs.cost(n))
            chains = [owners(v) for v in n.all_inputs]
            inputs.append(sorted({j for chain in chains for j in chain}))
            # the view read directly, and its owners through it (the run of each that the view's run read)
            through.append(sorted({(j, chain[0] if m else -1) for chain in chains for m, j in enumerate(chain)}))
            if any(id(v) in outputs for v in n.outputs):
                keep.update(owners(n.outputs[0]) if k in views else [k])
            ok, why = self._may_recompute(n, outputs, read_by_name, save, recompute)
            recomputable.append(ok)
            if n.phase == FORWARD:
                self.reasons[n.name] = why
        statics = {id(v) for v in graph.inputs} | {id(graph.values[t]) for t in graph.initializers
                                                   if t in graph.values}
        statics |= {id(v) for n in self.constants for v in n.outputs if v.name}
        self.problem = solvers.Problem(size, cost, inputs, recomputable, keep, sum(nbytes[i] for i in statics),
                                       scratch, through)
        self.forward_cost = sum(c for c, n in zip(cost, self.nodes) if n.phase == FORWARD)

    def tidy(self, solution: solvers.Solution) -> solvers.Solution:
        """The solver's schedule less the recomputations that cannot help in the graph `plan.apply` writes:
        copies run before the first backward op (the forward pass itself then holds what they would make,
        at the same peak, and onnxruntime cannot run them beside the nodes they copy: two copies of one
        input-only chain, both ready, run interleaved and double the forward's memory), and copies nothing
        reads (forward nodes read the originals, so a copy made only for the loss is never read). The
        peak may change; the caller checks it on the graph."""
        schedule = solution.schedule
        first_backward = next((p for p, k in enumerate(schedule) if self.nodes[k].phase == BACKWARD), len(schedule))
        first_run: dict[int, int] = {}
        for p, k in enumerate(schedule):
            first_run.setdefault(k, p)
        tidied = [k for p, k in enumerate(schedule) if p >= first_backward or first_run[k] == p]
        tidied = solvers.without_unread_copies(self.problem, tidied)
        if len(tidied) == len(schedule):
            return solution
        return solvers.make_solution(self.problem, tidied, solution.solver, None, solution.status)

    @staticmethod
    def _may_recompute(n: Node, outputs, read_by_name, save, recompute) -> tuple[bool, str]:
        if n.phase != FORWARD:
            return False, ""
        if n.op_type in RANDOM and not n.domain:
            return False, f"random op ({n.op_type}): kept, so recomputations read the same numbers"
        if any(id(v) in outputs for v in n.outputs):
            return False, "writes a graph output, alive to the end anyway"
        if n.subgraphs() or any(id(v) in read_by_name for v in n.outputs):
            return False, "control flow reads it by name"
        if n.name in save:
            return False, "--save"
        return True, "--recompute" if n.name in recompute else ""

    def reasons_of(self, solution: solvers.Solution) -> dict[str, str]:
        return self.plan(solution, "budget").reasons

    def plan(self, solution: solvers.Solution, policy: str) -> Plan:
        """The solver's schedule as a plan: each node's first run is the node itself, later runs are copies."""
        order: list[Step] = []
        constant_of = {id(v): n for n in self.constants for v in n.outputs}
        placed: set[int] = set()
        seen: set[int] = set()
        for k in solution.schedule:
            n = self.nodes[k]
            for v in n.all_inputs:  # each constant just before its first reader, as in the graph
                c = constant_of.get(id(v)) if v is not None else None
                if c is not None and id(c) not in placed:
                    placed.add(id(c))
                    order.append(c.name)
            if k in seen:
                order.append((n.name, RECOMPUTE))
            else:
                seen.add(k)
                order.append(n.name)
        order += [c.name for c in self.constants if id(c) not in placed]
        reasons = {}
        read_by_backward = {id(v) for n in self.nodes if n.phase == BACKWARD for v in n.all_inputs}
        for k, n in enumerate(self.nodes):
            if n.phase != FORWARD:
                continue
            runs = solution.recomputed.get(k, 0)
            if runs:
                reasons[n.name] = f"recomputed {runs}x" + (" (--recompute)" if self.reasons[n.name] == "--recompute"
                                                           else "")
            elif any(id(v) in read_by_backward for v in n.outputs):
                why = self.reasons[n.name]
                reasons[n.name] = "stored: " + (why or "cheaper to keep within the budget")
            else:
                reasons[n.name] = "kept: the backward does not read it"
        return Plan(policy, order, reasons)


@dataclass
class BudgetReport:
    """What `mirror --report` says about a budgeted plan, also when none fits (`fits` false)."""

    fits: bool
    budget: str
    budget_bytes: int | None
    floor_bytes: int
    least_peak_found_bytes: int | None
    predicted_peak_bytes: int | None
    unmirrored_peak_bytes: int
    cost_units: str
    solver: str
    status: str
    gap: float | None  # (extra cost - extra_cost_bound) / extra cost, or the exact solver's own where it proved more
    extra_cost: float | None = None
    extra_cost_bound: float | None = None  # no schedule under the budget recomputes for less (`extra_cost_bound`)
    forward_cost: float = 0.0
    extra_forward_passes: float | None = None
    extra_flops: float | None = None
    forward_flops: float = 0.0
    problem_ops: int = 0
    allocator: str = "exact"  # what predicted_peak_bytes counts: the live bytes, or onnxruntime's arena (`arena`)
    solve_seconds: float = 0.0  # a timing: the build report has it, the model's metadata does not

    def record(self) -> dict:
        """The fields for the model's metadata: everything but timings."""
        d = asdict(self)
        d.pop("solve_seconds")
        return d


class BudgetError(UsageError):
    """No schedule fits the budget; `report` says how close the solvers came."""

    def __init__(self, message: str, report: BudgetReport):
        super().__init__(message)
        self.report = report


@dataclass
class BudgetResult:
    plan: Plan
    report: BudgetReport


COST_UNITS = {"model": "FLOP-equivalents (FLOPs + 20 x bytes moved)",
              "prices": "microseconds (per-kernel-class prices fitted to onnxruntime's CPU profile)",
              "profile": "microseconds (onnxruntime)"}


def recompute_costs(graph: Graph, options: MirrorOptions, dims: dict[str, int]):
    """The price of running each node again: the cost model, or onnxruntime's own time per node (--cost
    profile, the median of several runs)."""
    if options.cost == "model":
        return CostModel(symbols=dict(dims))
    if options.cost == "prices":
        from .cost import CPU_PRICES
        return CostModel(symbols=dict(dims), prices=CPU_PRICES)
    from .. import weights
    from .cost import ProfiledCosts, profile_costs
    proto = graph.to_model(weights_apart=True)
    weights.join(proto, graph.initializers)
    return ProfiledCosts.of_graph(graph, profile_costs(proto, symbols=dict(dims)), CostModel(symbols=dict(dims)))


def budget_policy(graph: Graph, nbytes: dict[int, int], bp: BudgetProblem, options: MirrorOptions,
                  unmirrored_peak: int, flops: CostModel, front: solvers.Front | None = None) -> BudgetResult:
    """The cheapest plan whose graph peak fits `options.budget` (or, for auto, the least peak one extra forward
    pass buys). The graph is read, never changed. `flops` prices the report's FLOPs whatever priced the plan.
    `front`: the fast solver's front for `problem_front(bp.problem, options, unmirrored_peak)`, when the caller has
    it already (`mirror --sweep` draws it)."""
    budget = parse_budget(options.budget or "auto")
    if options.recompute:
        raise UsageError("--recompute: with --budget the solver chooses what to recompute; use --save to keep a "
                         "node")
    forward = {n.name for n in graph.nodes if n.phase == FORWARD}
    for name in sorted(options.save - forward):
        raise UsageError(f"--save {name}: no forward node of that name")
    started = time.perf_counter()
    problem = bp.problem
    least = solvers.floor(problem)
    wanted = budget.resolve(options.fraction_of or unmirrored_peak)
    units = COST_UNITS[options.cost]

    def report(solution: solvers.Solution | None, peak: int | None, found: int | None,
               problem_budget: int | None = None) -> BudgetReport:
        extra = solution.extra_cost if solution is not None else None
        bound = solvers.extra_cost_bound(problem, problem_budget) if problem_budget is not None else None
        gap = solution.gap if solution is not None else None
        if gap is None and extra is not None and bound is not None:
            gap = max(0.0, (extra - bound) / extra) if extra > 0 else 0.0
        return BudgetReport(
            fits=solution is not None, budget=budget.text, budget_bytes=wanted, floor_bytes=least,
            least_peak_found_bytes=found, predicted_peak_bytes=peak, unmirrored_peak_bytes=unmirrored_peak,
            cost_units=units, solver=solution.solver if solution else options.solver,
            status=solution.status if solution else "no schedule", gap=gap,
            extra_cost=extra, extra_cost_bound=bound, forward_cost=bp.forward_cost,
            extra_forward_passes=(extra / bp.forward_cost if bp.forward_cost else 0.0) if extra is not None else None,
            extra_flops=(sum(flops.flops(bp.nodes[k]) * r for k, r in solution.recomputed.items())
                         if solution is not None else None),
            forward_flops=sum(flops.flops(n) for n in bp.nodes if n.phase == FORWARD), problem_ops=problem.n,
            allocator=options.allocator, solve_seconds=round(time.perf_counter() - started, 3))

    def held(order: list) -> int:
        """The peak the budget bounds: the live bytes, and with --allocator arena what onnxruntime's arena needs
        (emulated, with ARENA_MARGIN for the emulation's error and what a process holds beyond the least limit),
        and at least what a CPU process holds for it without a limit as far as that is modelled (`arena.resident`:
        the pages written, the regions' index, the kernels' buffers from malloc)."""
        if options.allocator != "arena":
            return peak_of_plan(graph, order, nbytes)
        static, events = allocations_of_plan(graph, order, nbytes)
        arena = max(least_limit(events), least_limit(events, max_dead_bytes=SPLIT_ALWAYS))
        # the live bytes from the same events: `peak_of_plan` would build the plan's steps again
        return static + max(live_peak(events), math.ceil(arena * (1 + ARENA_MARGIN)), resident(events))

    def fits(order: list, budget: int) -> bool:
        """Whether `held(order) <= budget` with --allocator arena, by running the emulated arena once under the
        limit the budget leaves it (each chunk rule) instead of searching for the least limit."""
        static, events = allocations_of_plan(graph, order, nbytes)
        room = math.floor((budget - static) / (1 + ARENA_MARGIN))
        return (static + live_peak(events) <= budget and room > 0 and runs_within(events, room)
                and runs_within(events, room, max_dead_bytes=SPLIT_ALWAYS) and static + resident(events) <= budget)

    if wanted is not None and wanted >= unmirrored_peak and (
            options.allocator != "arena" or held([n.name for n in graph.nodes]) <= wanted):
        # nothing to recompute: answered at once, without a search (and before the floor, which counts the
        # small Constant nodes as alive throughout where the graph frees them)
        solution = solvers.baseline(problem)
        plan = Plan("budget", [n.name for n in graph.nodes], bp.reasons_of(solution))
        return _result(plan, report(solution, unmirrored_peak, None))
    if wanted is not None and wanted < least:
        r = report(None, None, None)
        raise BudgetError(f"--budget {budget.text}: {format_bytes(wanted)} is below the least peak any schedule can reach, "
                          f"{format_bytes(least)} ({_floor_parts(bp)})", r)
    # the problem's budget (raised by the Constant nodes it counts as alive throughout), then lowered by any excess
    # the graph's own peak shows
    target = problem_target(problem, options, unmirrored_peak)
    limits = solver_limits(problem, options.work, options.time_limit, options.workers, target)
    max_extra = options.max_extra_passes * bp.forward_cost * (1 + 1e-9)  # with rounding room
    front = (front or solvers.front(problem, limits)).within(max_extra)
    found = front.least_peak
    solution = plan = None
    peak = least_written = None
    walked = (options.allocator == "arena" and options.solver == "fast" and front.staged is not None
              and wanted is not None)
    if walked:
        solution, plan, peak, least_written = _arena_choice(bp, front, wanted, target, held, fits)
    # the arena's need falls more slowly than the live bytes as the plan recomputes more: more rounds for it
    for _ in range(0 if walked else 8 if options.allocator == "arena" else 4):
        solution = _choose(bp, front, options, target, limits)
        if solution is not None and solution.extra_cost > max_extra:
            solution = None  # an exact solver's optimum past the cap
        if solution is None:
            break
        policy = "budget" if options.solver == "fast" else f"budget-{options.solver}"
        plan = bp.plan(solution, policy)
        peak = held(plan.order)
        if found is not None and solution.peak <= found:
            least_written = peak  # the least plan's peak as written, which a failure reports
        solution, plan, peak = _tidied(bp, solution, plan, peak, wanted, held, policy)
        if wanted is None or peak <= wanted:
            break
        # the offset between the problem's peak and the graph's is not the same at every plan: ask for a plan
        # whose problem peak lies below this one's by the excess the graph showed, and at least for the least
        # peak found (whose own offset may be smaller)
        lower = max(min(target, solution.peak) - (peak - wanted), found)
        if lower >= solution.peak:
            solution = plan = None
            break
        target = lower
        solution = plan = None
    # MXNet's plan is one more candidate: on element-wise tails between heavy ops it is often the cheapest
    mxnet = mxnet_plan(graph, nbytes, MirrorFunction(graph, set(options.save)))
    index = {n.name: k for k, n in enumerate(bp.nodes)}
    mxnet_extra = sum(problem.cost[index[s[0]]] for s in mxnet.order if isinstance(s, tuple) and s[0] in index)
    mxnet_peak = held(mxnet.order)
    if wanted is None:
        better = mxnet_extra <= bp.forward_cost and (solution is None or mxnet_peak < peak)
    else:
        better = (mxnet_peak <= wanted and mxnet_extra <= max_extra
                  and (solution is None or mxnet_extra < solution.extra_cost))
    if better:
        # Constant nodes are outside the problem (counted as static): their copies are not recomputations
        recomputed = {index[s[0]]: 1 for s in mxnet.order if isinstance(s, tuple) and s[0] in index}
        steps = [s[0] if isinstance(s, tuple) else s for s in mxnet.order]
        solution = solvers.Solution([index[s] for s in steps if s in index], mxnet_peak,
                                   problem.baseline_cost + mxnet_extra, mxnet_extra, recomputed,
                                   "mxnet (the cheapest plan that fits)", None, "heuristic")
        plan, peak = Plan("budget", mxnet.order, mxnet.reasons), mxnet_peak
    if solution is None:
        if options.allocator == "arena" and front.least_peak is not None and not walked:
            # the least plan's peak in the arena, which the message and the report give
            least_written = held(bp.plan(front.best_under(front.least_peak), "budget").order)
        if least_written is not None:
            found = least_written
        r = report(None, None, found)
        raise BudgetError(_no_schedule(budget, wanted, least, options.solver, found, options.max_extra_passes,
                                       options.allocator), r)
    # the bound at the problem's budget (auto: at the peak chosen, which the problem measures unless MXNet's plan won)
    problem_budget = target if target is not None else (None if better else solution.peak)
    return _result(plan, report(solution, peak, found, problem_budget))


def _tidied(bp: BudgetProblem, solution: solvers.Solution, plan: Plan, peak: int, wanted: int | None, held,
            policy: str) -> tuple[solvers.Solution, Plan, int]:
    """The schedule tidied (`BudgetProblem.tidy`) where its peak as written (`held`) is no higher, or still fits
    `wanted`; else the schedule as it was."""
    tidied = bp.tidy(solution)
    if tidied is solution:
        return solution, plan, peak
    tidy_plan = bp.plan(tidied, policy)
    tidy_peak = held(tidy_plan.order)
    if tidy_peak <= peak or (wanted is not None and tidy_peak <= wanted):
        return tidied, tidy_plan, tidy_peak
    return solution, plan, peak


def _arena_choice(bp: BudgetProblem, front: solvers.Front, wanted: int, target: int, held, fits
                  ) -> tuple[solvers.Solution | None, Plan | None, int | None, int | None]:
    """`--allocator arena` with the fast solver: (solution, plan, peak, None) for the cheapest schedule of the
    front, as staged or pruned, whose need in the arena (`held`) fits `wanted`; else (None, None, None, the least
    budget a staged schedule meets). The arena's need is far from monotonic in the live peak (ResNet-50's dynamo
    export: 392.5 MiB at the least live peak, 444.6 at the next, 418.2 at the two after), so each schedule is
    weighed, the cheapest first, up to `ARENA_EVALUATIONS` of them (`fits`: one run of the emulated arena under
    the budget; `held`, the least limit, only for the one chosen). The least budget is taken over the staged
    schedules alone, which do not depend on the budget asked (the pruning does): asked for it, the same command
    meets it."""
    offset = target - wanted  # the problem's bytes over the graph's (its Constant nodes)
    candidates = {(c.cost, c.peak, c.plan, c.schedule or ()): c for c in front.staged + front.points}
    weighed = 0
    for c in sorted(candidates.values(), key=lambda c: (c.cost, c.peak)):
        if c.peak > target:
            continue  # the arena holds at least the live bytes
        if weighed == ARENA_EVALUATIONS:
            break
        weighed += 1
        solution = front.solution(c)
        plan = bp.plan(solution, "budget")
        if not fits(plan.order, wanted):
            continue
        peak = held(plan.order)
        if peak > wanted:
            continue  # the least limit's search passed a limit the arena runs under
        return (*_tidied(bp, solution, plan, peak, wanted, held, "budget"), None)
    least = None
    for c in sorted(front.staged, key=lambda c: (c.peak, c.cost))[:ARENA_EVALUATIONS]:
        if least is not None and c.peak - offset > least:
            break
        order = bp.plan(front.solution(c), "budget").order
        if least is not None and not fits(order, least - 1):
            continue
        # a budget under which this schedule's live peak also passes the first test above
        need = max(held(order), c.peak - offset)
        least = need if least is None else min(least, need)
    return None, None, None, least


def _result(plan: Plan, report: BudgetReport) -> BudgetResult:
    plan.extra = report.record()
    plan.timings = {"solve_seconds": report.solve_seconds}
    return BudgetResult(plan, report)


def _choose(bp: BudgetProblem, front: solvers.Front, options: MirrorOptions, target: int | None,
            limits: solvers.Limits) -> solvers.Solution | None:
    """The cheapest schedule under `target` (None: auto, the least peak at most one extra forward pass buys)."""
    problem = bp.problem
    if target is None:
        best = front.least_peak_within(bp.forward_cost * (1 + 1e-9))
        if best is None or options.solver in ("fast", "dp"):
            return best
        target = best.peak
    else:
        best = front.best_under(target)
    if options.solver == "fast":
        return best
    if options.solver == "dp":
        return solvers.dp_front(problem).best_under(target)
    if options.solver == "exact":
        return solvers.solve_cp(problem, target, limits, hint=best)
    try:  # milp: HiGHS; when it finds nothing in time, the fast plan stands
        exact = solvers.solve_highs(problem, target, limits)
    except solvers.SolverTimeout:
        return best
    if exact is None or (best is not None and best.cost < exact.cost):
        return best
    return exact


def _floor_parts(bp: BudgetProblem) -> str:
    """What the floor is made of, in words: what any schedule holds where it is reached."""
    static, kept, flying, working, op = solvers.floor_parts(bp.problem)
    parts = [f"{format_bytes(static)} of weights and inputs"]
    if kept:
        parts.append(f"{format_bytes(kept)} of graph outputs made by then, such as weight gradients")
    if flying:
        parts.append(f"{format_bytes(flying)} of gradients in flight")
    if working:
        node = bp.nodes[op]
        parts.append(f"{format_bytes(working)} for the inputs and outputs of {node.op_type} {node.name}")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]


def _no_schedule(budget: Budget, target: int | None, floor: int, which: str, least: int | None,
                 max_extra_passes: float, allocator: str = "exact") -> str:
    if target is None:
        return "--budget auto: no schedule found"
    limited = max_extra_passes < math.inf
    within = (f" within {max_extra_passes:g} extra forward pass" + ("" if max_extra_passes == 1 else "es")
              if limited else "")
    arena = " in onnxruntime's arena (--allocator arena)" if allocator == "arena" else ""
    reached = (f"the least peak it reaches{within} is {format_bytes(least)}{arena}, " if least is not None
               else f"none{within}, " if limited else "")
    return (f"--budget {budget.text}: the {which} solver finds no schedule under {format_bytes(target)} ({reached}and no "
            f"schedule can go below {format_bytes(floor)}); give a larger budget"
            + (", allow more recomputation (--max-extra-passes)" if limited else "")
            + (" or try --solver exact" if which in ("fast", "dp") else ""))
