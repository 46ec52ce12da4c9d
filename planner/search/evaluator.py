"""What the search needs from the resource model and the integer programs, in one place.

The search (planner.search.make_plan) talks to an `Evaluator`: a few calls whose results are
the small frozen types below. `default_evaluator()` wires them to the real modules
(planner.resources.cost, planner.ip.stage_ip / expert_ip / rank_ip); tests pass stubs. This
module is the only place that knows the shapes of those modules' result types.

Shape letters: E = routed experts of one MoE layer, S = pipeline stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from planner.ip.solvers import SolveReport, SolverOptions
from planner.parallel import ParallelConfig
from planner.plan.schema import RankPlan
from planner.resources.stage_inputs import StageCostInputs
from planner.specs import GIB, ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class StageChoice:
    """The stage IP's answer: transformer layer indices per stage and which are recomputed."""

    stage_layers: tuple[tuple[int, ...], ...]  # S
    recompute_layers: tuple[tuple[int, ...], ...]  # S
    report: SolveReport


@dataclass(frozen=True)
class EstimateView:
    """The resource model's prediction for one layout and split (units in the names).

    `memory_gib_SC` / `time_s_SC`: per component name, one value per stage.
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_gpu: float
    bubble_fraction: float
    memory_gib_per_stage: tuple[float, ...]
    usable_memory_gib: float
    comm_s: tuple[tuple[str, float], ...]
    fits: bool
    reason: str
    memory_gib_SC: tuple[tuple[str, tuple[float, ...]], ...] = ()
    time_s_SC: tuple[tuple[str, tuple[float, ...]], ...] = ()
    stage_time_s: tuple[float, ...] = ()  # one micro-batch, forward + backward, per stage
    device_memory_gib: float = float("nan")  # capacity the per-stage totals are held against


@dataclass(frozen=True)
class RankChoice:
    """The rank IP's answer: one RankPlan per logical rank, plus a note on straddling groups."""

    ranks: tuple[RankPlan, ...]
    report: SolveReport
    note: str = ""


class Evaluator(Protocol):
    """`dispatcher` names the all-to-all priced for the MoE dispatch/combine:
    "flat" | "halo" | "halo-dedup" | "deepep" (planner.search.space.DISPATCHERS)."""

    def cost_inputs(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        par: ParallelConfig,
        dispatcher: str,
    ) -> StageCostInputs: ...

    def solve_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice: ...

    def score_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice:
        """Same answer as solve_stages, found faster when possible (exact DP, IP fallback)."""
        ...

    def estimate(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        par: ParallelConfig,
        stage_layers: tuple[tuple[int, ...], ...],
        recompute_layers: tuple[tuple[int, ...], ...],
        dispatcher: str,
    ) -> EstimateView: ...

    def place_experts(
        self, load_E: Sequence[float], ep: int, options: SolverOptions
    ) -> tuple[tuple[int, ...], SolveReport]: ...

    def describe_model(self, model: ModelSpec) -> dict[str, Any]: ...

    def describe_cluster(self, cluster: ClusterSpec) -> dict[str, Any]: ...

    def place_ranks(
        self, par: ParallelConfig, cluster: ClusterSpec, allocation: Any, options: SolverOptions
    ) -> RankChoice: ...


def gib(x_bytes: float) -> float:
    return x_bytes / GIB
