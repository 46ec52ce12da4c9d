"""Turn the search's winner into a Plan: expert IP per MoE layer, rank IP, plan.json fields.

Shape letters: E = routed experts of one MoE layer, L = transformer layers.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig, default_placement
from planner.plan.schema import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    SolveReport,
    StagePlan,
)
from planner.search.evaluator import Evaluator, RankChoice
from planner.specs import ModelSpec, TrainingSpec


@dataclass(frozen=True)
class Placement:
    """Expert and rank placement of the winning layout, with their solver reports."""

    experts: tuple[ExpertPlacement, ...]
    expert_report: SolveReport
    ranks: RankChoice


def expert_loads(
    model: ModelSpec, trace_loads: Mapping[int, Sequence[float]] | None
) -> dict[int, tuple[float, ...]]:
    """Expected tokens per expert (load_E) for every MoE layer: the trace's, else uniform."""
    out = {}
    for layer in model.moe_layers:
        experts = model.layers[layer].moe.num_experts  # type: ignore[union-attr]
        loads = (trace_loads or {}).get(layer)
        out[layer] = tuple(float(x) for x in loads) if loads is not None else (1.0,) * experts
    return out


def place(
    evaluator: Evaluator,
    model: ModelSpec,
    par: ParallelConfig,
    cluster: Any,
    allocation: Any,
    trace_loads: Mapping[int, Sequence[float]] | None,
    options: SolverOptions,
) -> Placement:
    """Solve the expert IP for each MoE layer (identical loads solved once) and the rank IP."""
    opts = replace(options, threads=1)  # single-threaded solves give the same answer every run
    solved: dict[tuple[float, ...], tuple[tuple[int, ...], SolveReport]] = {}
    placements, reports = [], []
    for layer, load_E in expert_loads(model, trace_loads).items():
        if load_E not in solved:
            if par.ep == 1 or len(set(load_E)) == 1:
                solved[load_E] = (default_placement(len(load_E), par.ep), _uniform(load_E, par.ep))
            else:
                solved[load_E] = evaluator.place_experts(load_E, par.ep, opts)
            reports.append(solved[load_E][1])
        placements.append(ExpertPlacement(layer, tuple(solved[load_E][0])))
    ranks = evaluator.place_ranks(par, cluster, allocation, opts)
    return Placement(tuple(placements), _merge(reports, options.backend), ranks)


def _uniform(load_E: Sequence[float], ep: int) -> SolveReport:
    """Equal loads: any equal-slot placement reaches the bound sum(load)/ep, so blocks are
    optimal without a solve."""
    best = sum(load_E) / ep
    return SolveReport("closed-form", "OPTIMAL", best, best, 0.0, 0.0, "equal loads")


def _trivial(backend: str) -> SolveReport:
    return SolveReport(backend, "OPTIMAL", 0.0, 0.0, 0.0, 0.0, "nothing to place")


def _merge(reports: Sequence[SolveReport], backend: str) -> SolveReport:
    """One report for the layers solved: worst status; the objective is the largest layer
    objective (the step's hottest-rank load), its bound the largest layer bound (no layer can
    do better than its own bound), and the gap is theirs, so objective, bound and gap agree.
    (The largest per-layer gap can be larger: a layer far from its bound may still be below
    the hottest layer's proven load.)"""
    if not reports:
        return _trivial(backend)
    order = ["OPTIMAL", "FEASIBLE", "NOT_SOLVED", "INFEASIBLE"]
    objective = max(r.objective for r in reports)
    bound = max(r.bound for r in reports)
    return SolveReport(
        reports[0].backend,
        max((r.status for r in reports), key=order.index),
        objective,
        bound,
        max(0.0, objective - bound) / max(abs(objective), 1e-12)
        if math.isfinite(objective)
        else math.inf,
        sum(r.wall_s for r in reports),
    )


_LABELS = ("name", "source")


def inputs_sha256(
    model_config: Mapping[str, Any],
    cluster: Mapping[str, Any],
    training: TrainingSpec,
    sizes: Mapping[str, Any],
) -> str:
    """sha256 of the canonical JSON of every input that decides the plan.

    Content only: the `name` and `source` fields (what a preset or file was called and where
    it was read from) are left out, so the same model and cluster give the same digest from
    any path or checkout.
    """
    doc = {
        "model": {k: v for k, v in model_config.items() if k not in _LABELS},
        "cluster": {k: v for k, v in cluster.items() if k not in _LABELS},
        "training": asdict(training),
        "sizes": dict(sizes),
    }
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def build_plan(
    *,
    model: ModelEntry,
    cluster: ClusterEntry,
    training: TrainingSpec,
    par: ParallelConfig,
    stage_layers: Sequence[Sequence[int]],
    recompute_layers: Sequence[Sequence[int]],
    predicted: Predicted,
    stage_report: SolveReport,
    placement: Placement,
    digest: str,
    extra: dict[str, Any],
) -> Plan:
    """Assemble the plan.json document (ARCHITECTURE section 8)."""
    parallel = ParallelPlan.of(par)
    stages = tuple(
        StagePlan(s, tuple(layers), tuple(rc))
        for s, (layers, rc) in enumerate(zip(stage_layers, recompute_layers, strict=True))
    )
    extra = {
        **extra,
        "expert_solver": placement.expert_report.to_dict(),
        "rank_solver": placement.ranks.report.to_dict(),
        "rank_note": placement.ranks.note,
    }
    return Plan(
        model=model,
        cluster=cluster,
        training=asdict(training),
        parallel=parallel,
        stages=stages,
        experts=placement.experts,
        ranks=placement.ranks.ranks,
        predicted=predicted,
        solver=stage_report,
        inputs_sha256=digest,
        extra=extra,
    )
