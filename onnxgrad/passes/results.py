"""What each pass of the build records on the `Build` (`Build.record`): small frozen results, which the API
hands out in its `BuildResult` and from which the --report JSON is rendered (`api.BuildResult.report`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..memory.budget import BudgetReport
from ..memory.plan import Plan
from ..segments import LoopScheme


@dataclass(frozen=True)
class ReadResult:
    """The read pass: the opset the model came with (it is then brought to the supported one)."""

    source_opset: int


@dataclass(frozen=True)
class LossResult:
    """The heads pass (or a taken-up training graph): the outputs the gradient is taken of."""

    heads: tuple[str, ...]

    @property
    def loss(self) -> str:
        """The first head, which the report names the loss."""
        return self.heads[0]


@dataclass(frozen=True)
class GradientResult:
    """The gradient pass (or a taken-up training graph): what got a gradient and by which rules."""

    parameters: tuple[str, ...]
    also_grad: tuple[str, ...] = ()
    rules_used: dict[str, int] = field(default_factory=dict)   # op type -> nodes differentiated by its rule
    loop_segments: dict[str, int] | None = None                # with recomputation asked: Loop -> (innermost) segment length
    # with recomputation asked: Loop or Scan -> how it is checkpointed (unsegmented, or its levels of segments)
    loop_schemes: dict[str, LoopScheme] | None = None
    # floating-point scalar initializers on the loss's path, taken for constants (not differentiated) by default
    scalar_constants: tuple[str, ...] = ()
    # parameter matrices holding the same values (first, second, "equal" or "transposed"): a tie written twice?
    parameter_copies: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class PrecisionResult:
    """The precision pass: the settings asked for, and what casting to half precision did."""

    precision: str
    loss_scale: dict | None
    half_nodes: int = 0
    casts: int = 0
    widened_sums: int = 0        # backward sums of half gradients given float32 inputs (half_sums)
    recomputed_casts: int = 0    # forward Casts recomputed in the backward (recompute_casts)


@dataclass(frozen=True)
class WidenResult:
    """The widen_bf16 pass: the inputs of bfloat16 nodes given float32 copies."""

    widened_inputs: int


@dataclass(frozen=True)
class SweepResult:
    """`mirror --sweep`: the Pareto rows (the chosen plan among them), their table, and the budget chosen under."""

    rows: list[dict]
    table: str
    budget_bytes: int | None


@dataclass(frozen=True)
class MirrorResult:
    """The mirror pass: the plan it applied (with the simulated peaks before and after), the budget policy's
    report when it chose, the seconds it spent, and the sweep's rows when one was asked for."""

    plan: Plan
    budget: BudgetReport | None = None
    timings: dict[str, float] = field(default_factory=dict)
    sweep: SweepResult | None = None

    @property
    def recomputed(self) -> list[str]:
        return self.plan.recomputed

    @property
    def peak_bytes(self) -> int:
        return self.plan.predicted["peak_bytes"]

    @property
    def unmirrored_peak_bytes(self) -> int:
        return self.plan.predicted["unmirrored_peak_bytes"]

    @property
    def saved_bytes(self) -> int:
        return self.plan.predicted["saved_bytes"]

    @property
    def unmirrored_saved_bytes(self) -> int:
        return self.plan.predicted["unmirrored_saved_bytes"]


@dataclass(frozen=True)
class ScheduleResult:
    """The schedule pass: the backward nodes tied to the gradient, those tied to a fused node before them, and
    the MatMul reads of scaled values kept from onnxruntime's scale fusion."""

    anchored_nodes: int
    after_fused_nodes: int = 0
    scaled_reads_kept: int = 0


@dataclass(frozen=True)
class NodeCounts:
    """The written graph's nodes by phase, counted the same way for a forward model and a training graph."""

    forward: int
    recompute: int
    backward: int
    optimizer: int


@dataclass(frozen=True)
class ValidateResult:
    """The validate pass: the written graph's outputs, opset, IR version and nodes by phase."""

    outputs: tuple[str, ...]
    opset: int
    ir_version: int
    nodes: NodeCounts
