"""The real Evaluator: resource model (planner.resources.cost), stage/expert/rank IPs, model and
cluster descriptions. Imported lazily by plan() so the search can be tested with stubs.

Shape letters: E = routed experts, S = pipeline stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from planner.ip.solvers import SolveReport, SolverOptions
from planner.parallel import ParallelConfig
from planner.resources.stage_inputs import StageCostInputs
from planner.search.evaluator import EstimateView, RankChoice, StageChoice
from planner.specs import ClusterSpec, LayerSpec, ModelSpec, TrainingSpec


class ModelEvaluator:
    """Evaluator protocol (planner.search.evaluator) over the project's modules."""

    def __init__(self) -> None:
        self._shared: dict[ModelSpec, ModelSpec] = {}

    def shared_layers(self, model: ModelSpec) -> ModelSpec:
        """The model with equal layers as one object: the resource model keys per-layer costs
        by LayerSpec for every candidate, and a dict lookup that finds the same object skips
        comparing two equal specs field by field."""
        if model not in self._shared:
            pool: dict[LayerSpec, LayerSpec] = {}
            layers = tuple(pool.setdefault(layer, layer) for layer in model.layers)
            self._shared[model] = replace(model, layers=layers)
        return self._shared[model]

    def cost_inputs(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        par: ParallelConfig,
        dispatcher: str,
    ) -> StageCostInputs:
        from planner.resources.cost import stage_cost_inputs

        model = self.shared_layers(model)
        return stage_cost_inputs(model, cluster, training, par, dispatcher=dispatcher)

    def solve_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice:
        from planner.ip.stage_ip import solve_stages

        return _choice(inputs, solve_stages(inputs, options))

    def score_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice:
        """The exact DP when it is exact for these inputs, else the stage IP."""
        from planner.ip import stage_dp
        from planner.ip.stage_ip import stage_solution_dp

        sol = stage_solution_dp(inputs)
        if sol.report.status == "OPTIMAL":
            return _choice(inputs, sol)
        if (
            sol.report.status == "INFEASIBLE"
            and stage_dp.solve_dp(stage_dp.quantize_inputs(inputs)).exact
        ):
            return _choice(inputs, sol)
        return self.solve_stages(inputs, options)

    def estimate(
        self,
        model: ModelSpec,
        cluster: ClusterSpec,
        training: TrainingSpec,
        par: ParallelConfig,
        stage_layers: tuple[tuple[int, ...], ...],
        recompute_layers: tuple[tuple[int, ...], ...],
        dispatcher: str,
    ) -> EstimateView:
        from planner.resources.cost import estimate

        model = self.shared_layers(model)
        est = estimate(model, cluster, training, par, stage_layers, recompute_layers, dispatcher)
        return view_of(est, cluster)

    def place_experts(
        self, load_E: Sequence[float], ep: int, options: SolverOptions
    ) -> tuple[tuple[int, ...], SolveReport]:
        from planner.ip.expert_ip import solve_experts

        sol = solve_experts(load_E, ep, options)
        return sol.rank_of_expert, sol.report

    def place_ranks(
        self, par: ParallelConfig, cluster: ClusterSpec, allocation: Any, options: SolverOptions
    ) -> RankChoice:
        from planner.ip.rank_ip import solve_ranks

        sol = solve_ranks(par, cluster, allocation, options)
        note = f"{sol.straddling_groups} of {sol.groups_total} TP/CP/EP groups straddle a switch"
        return RankChoice(tuple(sol.ranks), sol.report, "; ".join(filter(None, [note, sol.note])))

    def describe_model(self, model: ModelSpec) -> dict[str, Any]:
        from planner.inputs.models import model_config, numerics_of_model

        entry = {"name": model.name, "source": model.source, "config": model_config(model)}
        return {**entry, "numerics": numerics_of_model(model)}

    def describe_cluster(self, cluster: ClusterSpec) -> dict[str, Any]:
        from planner.inputs.clusters import cluster_to_dict

        return {
            **cluster_to_dict(cluster),
            "name": cluster.name,
            "source": cluster.source,
            "gpus_per_node": cluster.gpus_per_node,
            "nodes": cluster.num_nodes,
        }


def _choice(inputs: StageCostInputs, sol: Any) -> StageChoice:
    layer_of = [u.layer for u in inputs.units]  # the stage IP speaks unit positions
    return StageChoice(
        tuple(tuple(layer_of[i] for i in st) for st in sol.stage_layers),
        tuple(tuple(layer_of[i] for i in rc) for rc in sol.recompute_layers),
        sol.report if sol.report.has_solution or not sol.reason else _with_message(sol),
    )


def _with_message(sol: Any) -> SolveReport:
    return replace(sol.report, message=sol.reason)


def view_of(est: Any, cluster: ClusterSpec) -> EstimateView:
    """planner.resources.cost.Estimate -> EstimateView (per-stage components as columns)."""
    stages = est.stages
    mem_names = [n for n, _ in stages[0].memory_gib]
    time_names = sorted({n for st in stages for n, _ in st.time_s})
    memory_SC = tuple(
        (n, tuple(dict(st.memory_gib).get(n, 0.0) for st in stages)) for n in mem_names
    )
    time_SC = tuple((n, tuple(dict(st.time_s).get(n, 0.0) for st in stages)) for n in time_names)
    return EstimateView(
        step_time_s=est.step_time_s,
        tokens_per_s=est.tokens_per_s,
        mfu=est.mfu,
        tflops_per_gpu=est.tflops_per_gpu,
        bubble_fraction=est.bubble_fraction,
        memory_gib_per_stage=tuple(st.total_gib for st in stages),
        usable_memory_gib=est.usable_memory_gib,
        comm_s=tuple(est.comm_s),
        fits=est.fits,
        reason=est.reason,
        memory_gib_SC=memory_SC,
        time_s_SC=time_SC,
        stage_time_s=tuple(st.total_s for st in stages),
        device_memory_gib=cluster.device.memory_gib,
    )


def default_evaluator() -> ModelEvaluator:
    return ModelEvaluator()
