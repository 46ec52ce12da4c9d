"""Turn the search's winner into a Plan: expert IP per MoE layer, rank IP, plan.json fields,
and the redundant expert slots the plan's memory headroom allows (with_redundant_slots).

Shape letters: E = routed experts of one MoE layer, L = transformer layers, S = stages.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from planner.ip.expert_ip import solve_experts
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
from planner.resources.memory import state_bytes
from planner.resources.params import layer_params
from planner.search.evaluator import EstimateView, Evaluator, RankChoice
from planner.specs import GIB, ModelSpec, SpecError, TrainingSpec

# DeepSeek-V3 serves its 256 routed experts in 288 slots (32 redundant, EPLB): the default
# adds E / 8 redundant slots per MoE layer when memory allows, at most one per EP rank.
REDUNDANT_SLOTS_PER_EXPERT = 1 / 8
# A replica placement whose hottest rank is within 0.5% of the lower bound (the mean load, or
# the hottest expert's share) is kept without a solve: the loads are a forecast, and the IP
# rarely proves more than its warm start (EPLB's replicate-then-pack) already reaches.
REPLICA_ACCEPT_GAP = 0.005


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
    """Solve the expert IP for each MoE layer (identical loads solved once, the solves sharing
    one time limit: pattern_options) and the rank IP."""
    loads = expert_loads(model, trace_loads)
    to_solve = {x for x in loads.values() if par.ep > 1 and len(set(x)) > 1}
    opts = pattern_options(options, len(to_solve))
    solved: dict[tuple[float, ...], tuple[tuple[int, ...], SolveReport]] = {}
    placements, reports = [], []
    for layer, load_E in loads.items():
        if load_E not in solved:
            if par.ep == 1 or len(set(load_E)) == 1:
                solved[load_E] = (default_placement(len(load_E), par.ep), _uniform(load_E, par.ep))
            else:
                solved[load_E] = evaluator.place_experts(load_E, par.ep, opts)
            reports.append(solved[load_E][1])
        placements.append(ExpertPlacement(layer, tuple(solved[load_E][0])))
    ranks = evaluator.place_ranks(par, cluster, allocation, replace(options, threads=1))
    return Placement(tuple(placements), _merge(reports, options.backend), ranks)


def pattern_options(options: SolverOptions, patterns: int) -> SolverOptions:
    """The options of one expert IP solve when `patterns` distinct load patterns (MoE layers
    with different loads) are solved in turn: --time-limit-s split evenly, so placing every
    layer takes one limit, as the stage and rank IPs do; one thread, so the answer is the
    same every run."""
    return replace(options, threads=1, time_limit_s=options.time_limit_s / max(patterns, 1))


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


@dataclass(frozen=True)
class SlotBudget:
    """Redundant expert slots for a plan: how many, what they cost, why.

    redundant_slots: extra slots per MoE layer over the whole EP group (expert_ip.slot_counts
        spreads them; the fullest rank holds ceil(redundant_slots / ep) of them).
    slot_gib_per_stage: memory one extra slot per MoE layer adds to a rank of each stage
        (weights, gradients, optimizer state of one routed expert of each of its MoE layers).
    fit_per_rank: extra slots per MoE layer that fit every stage's headroom.
    """

    redundant_slots: int
    slot_gib_per_stage: tuple[float, ...]
    fit_per_rank: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "redundant_slots": self.redundant_slots,
            "slot_gib_per_stage": list(self.slot_gib_per_stage),
            "fit_per_rank": self.fit_per_rank,
        }


def check_slots_without_fsdp(requested: int | None, fsdp: bool | None) -> None:
    """Redundant slots and FSDP do not go together: piper run sums the replicas' gradients
    as whole experts, FSDP shards them. A SpecError when both are asked for."""
    if requested and fsdp:
        raise SpecError(
            f"--redundant-slots {requested} with FSDP: the runtime sums the replicas' "
            "gradients as whole experts and FSDP shards them; pass --no-fsdp or "
            "--redundant-slots 0"
        )


def slot_budget(plan: Plan, model: ModelSpec, requested: int | None) -> SlotBudget:
    """How many redundant slots per MoE layer the plan gets (None = the default).

    The memory of one slot is the resource model's state of one routed expert
    (planner.resources.memory.state_bytes: weights, gradients and optimizer bytes, the
    optimizer sharded over edp with the distributed optimizer) for each MoE layer of the
    stage, split over etp; headroom is usable memory minus the predicted peak of the stage.
    Default: E / 8 slots (DeepSeek-V3's 288 for 256 experts), at most one per EP rank and
    only what fits every stage; fewer than 2 are none (one replica cannot keep every rank
    at the mean load). Requested: that many, or a SpecError when they do not fit. A plan
    with FSDP gets none (piper run sums the replicas' gradients as whole experts, FSDP
    shards them), and asking for some there is a SpecError.
    """
    par = plan.parallel.config()
    training = _training_of(plan)
    moe_layers = [i for i in model.moe_layers]
    per_stage = []
    for stage in plan.stages:
        params = sum(
            layer_params(model, model.layers[i]).expert / par.etp
            for i in stage.layers
            if i in moe_layers
        )
        per_stage.append(state_bytes(0.0, params, training, par).total / GIB)
    headroom = [
        plan.predicted.usable_memory_gib - used for used in plan.predicted.memory_gib_per_stage
    ]
    fits = [math.floor(room / gib) for room, gib in zip(headroom, per_stage, strict=True) if gib]
    fit = max(0, min(fits)) if fits else 0
    experts = model.num_experts
    if training.fsdp:
        check_slots_without_fsdp(requested, True)
        return SlotBudget(0, tuple(per_stage), fit)
    if requested is None:
        total = min(par.ep * min(fit, 1), int(experts * REDUNDANT_SLOTS_PER_EXPERT))
        total = total if total >= 2 and par.ep > 1 else 0
    else:
        total = requested
        _check_request(requested, par.ep, experts, fit, per_stage, headroom)
    return SlotBudget(total, tuple(per_stage), fit)


def _check_request(requested, ep, experts, fit, per_stage, headroom) -> None:
    if requested < 0:
        raise SpecError(f"--redundant-slots must be >= 0, got {requested}")
    if requested and ep < 2:
        raise SpecError("--redundant-slots needs ep >= 2: a replica lives on another EP rank")
    if requested > experts * (ep - 1):
        raise SpecError(
            f"--redundant-slots {requested}: at most {experts * (ep - 1)} ({experts} experts "
            f"on each of {ep} ranks); lower it"
        )
    need = -(-requested // ep)
    if need > fit:
        stage = min(range(len(headroom)), key=lambda s: headroom[s] - need * per_stage[s])
        raise SpecError(
            f"--redundant-slots {requested}: {need} extra slots per rank need "
            f"{need * per_stage[stage]:.2f} GiB on stage {stage}, which has "
            f"{max(headroom[stage], 0.0):.2f} GiB to spare; lower it (at most "
            f"{fit * ep} fit)"
        )


def _training_of(plan: Plan) -> TrainingSpec:
    names = {f.name for f in fields(TrainingSpec)}
    return TrainingSpec(**{k: v for k, v in plan.training.items() if k in names})


def with_redundant_slots(
    plan: Plan,
    model: ModelSpec,
    trace_loads: Mapping[int, Sequence[float]] | None,
    options: SolverOptions,
    requested: int | None = None,
) -> Plan:
    """The plan with redundant expert slots (slot_budget): the expert IP places replicas of
    every MoE layer on its expected loads (the trace's, else equal; each distinct pattern
    solved once, the solves sharing one time limit: pattern_options), plan.json's experts
    entries carry the slots, the predicted memory of each stage counts them, and
    extra.redundant_slots says how many and what they cost. No slots: the plan unchanged."""
    budget = slot_budget(plan, model, requested)
    if budget.redundant_slots == 0:
        return replace(plan, extra={**plan.extra, "redundant_slots": budget.to_dict()})
    loads = expert_loads(model, trace_loads)
    opts = pattern_options(options, len(set(loads.values())))
    solved: dict[tuple[float, ...], Any] = {}
    experts, reports = [], []
    for layer, load_E in loads.items():
        if load_E not in solved:
            solved[load_E] = solve_experts(
                load_E,
                plan.parallel.ep,
                opts,
                redundant_slots=budget.redundant_slots,
                accept_gap=REPLICA_ACCEPT_GAP,
            )
            reports.append(solved[load_E].report)
        experts.append(ExpertPlacement.of_slots(layer, solved[load_E].slots))
    per_rank = -(-budget.redundant_slots // plan.parallel.ep)
    memory = tuple(
        used + per_rank * gib
        for used, gib in zip(
            plan.predicted.memory_gib_per_stage, budget.slot_gib_per_stage, strict=True
        )
    )
    extra = {
        **plan.extra,
        "redundant_slots": budget.to_dict(),
        "expert_solver": _merge(reports, options.backend).to_dict(),
    }
    predicted = replace(plan.predicted, memory_gib_per_stage=memory)
    return replace(plan, experts=tuple(experts), predicted=predicted, extra=extra)


def estimate_with_slots(est: EstimateView, before: Plan, after: Plan) -> EstimateView:
    """`est` (the chosen candidate's estimate) with the memory with_redundant_slots added to
    each stage as a `redundant_slots` component, so stages.csv and memory.csv agree with
    plan.json."""
    added = tuple(
        a - b
        for a, b in zip(
            after.predicted.memory_gib_per_stage, before.predicted.memory_gib_per_stage, strict=True
        )
    )
    if not any(added):
        return est
    return replace(
        est,
        memory_gib_per_stage=after.predicted.memory_gib_per_stage,
        memory_gib_SC=(*est.memory_gib_SC, ("redundant_slots", added)),
    )
