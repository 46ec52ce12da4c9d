"""make_plan(): the planner's entry point: search layouts, place experts and ranks, baselines.

The search itself (enumerate -> screen by bounds -> branch and bound on the stage IP) lives in
planner.search.branch_bound; the plan document in planner.search.assemble; the baselines in
planner.search.baselines. planner/PLANNING.md describes the whole for users.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from planner.ip.solvers import SolverOptions
from planner.plan.schema import ClusterEntry, ModelEntry, Plan, Predicted
from planner.plan.settings import ModelSettings, settings_of_model
from planner.search import assemble
from planner.search.advice import no_fit_message
from planner.search.baselines import Baseline, all_baselines
from planner.search.branch_bound import (
    Progress,
    SearchContext,
    new_context,
    reinstall_sigint,
    search_layouts,
)
from planner.search.costing import training_for
from planner.search.evaluator import Evaluator
from planner.search.rows import CandidateRow, describe
from planner.search.space import Candidate, Sharding, make_space
from planner.search.target_space import target_choices
from planner.specs import ClusterSpec, ModelSpec, Recompute, SpecError, TrainingSpec
from planner.targets import Target, check_model, check_training, with_conventions


@dataclass(frozen=True)
class PlanResult:
    """Everything `piper plan` reports. `plan` is None when no layout fits (see `message`)."""

    plan: Plan | None
    rows: tuple[CandidateRow, ...]  # ranked: candidates.csv
    best: CandidateRow | None
    baselines: tuple[Baseline, ...]
    timings: tuple[tuple[str, float], ...]  # wall clock (s) and counts: timings.json only
    interrupted: bool
    message: str  # one line: why there is no plan and what would make one fit; or ""
    gpus: int = 0


# Scale-up fabrics DeepEP / HybridEP do not run on (their kernels need NVLink and NVIDIA GPUs)
NO_DEEPEP_KINDS = frozenset(
    {"infinity-fabric", "xgmi", "shared-memory", "loopback", "loopback-tcp"}
)


def default_dispatchers(cluster: ClusterSpec) -> tuple[str, ...]:
    """The dispatchers searched when the user names none: flat and HALO-dedup everywhere
    (plain HALO never moves fewer bytes: `--dispatcher halo` prices it), DeepEP unless a level
    of the cluster is a fabric it does not run on (Frontier's Infinity Fabric, the CPU
    emulation). `--dispatcher deepep` still prices it on any cluster."""
    if any(lv.kind in NO_DEEPEP_KINDS for lv in cluster.levels):
        return ("flat", "halo-dedup")
    return ("flat", "halo-dedup", "deepep")


def make_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    gpus: int,
    fixed: Mapping[str, int | None] | None,
    options: SolverOptions,
    allocation: Any = None,
    trace_loads: Mapping[int, Sequence[float]] | None = None,
    progress: Progress | None = None,
    *,
    recompute: Sequence[Recompute] | None = None,
    recompute_modules: Sequence[str] | None = None,
    sharding: Sequence[Sharding] | None = None,
    a2a_overlap: bool | None = None,
    dispatchers: Sequence[str] | None = None,
    max_ep: int | None = None,
    evaluator: Evaluator | None = None,
    score: Literal["dp", "ip"] = "dp",
    target: Target | None = None,
    label: Callable[[str], None] | None = None,
) -> PlanResult:
    """Find the layout and placement with the best predicted step time that fits in memory.

    Args:
        model, cluster, training: the inputs (training.global_batch in sequences).
        gpus: devices to use (<= cluster.total_gpus).
        fixed: sizes the user fixed, any of pp, dp, tp, ep, micro_batch, vp, cp, etp
            (None = searched).
        options: solver backend, per-IP time limit (s), threads (candidates solved at once),
            seed.
        allocation: a real node allocation for the rank IP (None = the first `gpus` devices).
        trace_loads: transformer layer index -> tokens per expert (load_E); None = uniform.
        progress: called with (candidates done, candidates to solve) during the search.
        recompute: recompute policies to try (default: none, full and selective, chosen per
            layer).
        recompute_modules: the selective recompute modules (Megatron-Core's names); None =
            search planner.search.space.module_sets.
        sharding: optimizer sharding choices among "none", "zero", "fsdp" (default: zero,
            and fsdp without pipelining).
        a2a_overlap: fix the 1F1B all-to-all overlap on or off; None = search it where
            Megatron-LM allows it.
        dispatchers: the MoE dispatchers to try among "flat", "halo", "halo-dedup",
            "deepep" (default: default_dispatchers(cluster): flat, halo-dedup, and deepep
            only on clusters with NVLink).
        max_ep: largest EP group allowed (keep EP inside a fast domain); None = no limit.
        evaluator: the resource model and IPs (default: the real ones; tests pass stubs).
        score: "dp" finds each candidate's split with the exact DP (the stage IP where the DP
            is not exact) and re-solves the winner with the stage IP; "ip" solves every
            candidate with the stage IP. Both give the same plan; "dp" is much faster.
        target: the engine the plan is for (planner.targets): the search offers only what it
            executes and prices it with its conventions; None = no engine's limits.
        label: called with a short description as the baselines and the placement start
            (the progress bar's text).
    Returns:
        PlanResult; plan is None when nothing fits (message says what would) or when Ctrl-C
        came before any candidate was solved (interrupted is then True).
    """
    t0 = time.perf_counter()
    if evaluator is None:
        from planner.search.model_evaluator import default_evaluator

        evaluator = default_evaluator()
    settings = settings_of_model(model)  # read (and a bad key refused) before the search
    if training.cuda_graphs == "full":  # the exports' Megatron-Core 0.16 refuses the pair
        if a2a_overlap:
            raise SpecError(
                "plan: --a2a-overlap does not run with --cuda-graphs full in Megatron-Core 0.16 "
                "(no graph scope on moe / mlp with the overlap); use --cuda-graphs partial or "
                "drop --a2a-overlap"
            )
        a2a_overlap = False
    module_set, etp_rule, budget_sets = None, "any", ()
    if target is not None:
        training = with_conventions(training, target)
        check_training(training, target)
        check_model(model, target)
        cut = target_choices(
            target, fixed or {}, recompute, recompute_modules, sharding or ("zero", "fsdp"),
            a2a_overlap, dispatchers or default_dispatchers(cluster), bool(dispatchers),
        )  # fmt: skip
        fixed, recompute, recompute_modules = cut.fixed, cut.recompute, cut.recompute_modules
        sharding, a2a_overlap, dispatchers = cut.sharding, cut.a2a_overlap, cut.dispatchers
        module_set, etp_rule, budget_sets = cut.module_set, cut.etp_rule, cut.budget_sets
    if training.optimizer_offload_fraction > 0:  # HybridDeviceOptimizer: the distributed one's
        if "zero" not in (sharding or ("zero",)):
            raise SpecError(
                "plan: --optimizer-offload-fraction runs beside the distributed optimizer "
                "(--zero), not FSDP; drop --fsdp or the offload"
            )
        sharding = ("zero",)
        if not target.expert_placement:
            trace_loads = None  # the engine loads experts in its default placement
    space = make_space(
        gpus,
        fixed,
        recompute,
        max_ep,
        recompute_modules=recompute_modules,
        sharding=sharding,
        a2a_overlap=a2a_overlap,
        dispatchers=dispatchers or default_dispatchers(cluster),
        module_set=module_set,
        etp_rule=etp_rule,  # type: ignore[arg-type]
        budget_sets=budget_sets,
    )
    ctx = new_context(model, cluster, training, space, options, evaluator, score)
    t_search = time.perf_counter()
    found = search_layouts(ctx, progress)
    rows, best, interrupted, timings = found.rows, found.best, found.interrupted, found.timings
    t1 = time.perf_counter()
    # back to back: space, enumerate, screen, stage search (the rest of the search), ...
    timings["space_s"] = t_search - t0
    timings["stage_search_s"] = t1 - t_search - timings["enumerate_s"] - timings["screen_s"]
    (label or _quiet)("baselines: scoring the reference layouts")
    baselines: tuple[Baseline, ...] = ()
    if not interrupted:
        try:
            baselines = all_baselines(ctx, found.inputs)
        except KeyboardInterrupt:  # Ctrl-C while scoring baselines: keep the plan, skip them
            interrupted = True
    t2 = time.perf_counter()
    timings.update({"baselines_s": t2 - t1})
    if best is None:
        if not interrupted:
            (label or _quiet)("no layout fits: checking which fixes would")
        message = "" if interrupted else no_fit_message(ctx, rows)
        timings["total_s"] = time.perf_counter() - t0
        return PlanResult(None, rows, None, baselines, _t(timings), interrupted, message, gpus)
    (label or _quiet)("placement: expert and rank IPs")
    doc = _plan_document(ctx, best, allocation, trace_loads, baselines, interrupted, settings,
                         target)  # fmt: skip
    timings["placement_s"] = time.perf_counter() - t2
    timings["total_s"] = time.perf_counter() - t0
    return PlanResult(doc, rows, best, baselines, _t(timings), interrupted, "", gpus)


def _quiet(_text: str) -> None:
    return None


def _t(timings: Mapping[str, float]) -> tuple[tuple[str, float], ...]:
    return tuple(sorted(timings.items()))


def _plan_document(
    ctx: SearchContext,
    best: CandidateRow,
    allocation: Any,
    trace_loads: Mapping[int, Sequence[float]] | None,
    baselines: Sequence[Baseline],
    interrupted: bool,
    settings: ModelSettings,
    target: Target | None = None,
) -> Plan:
    assert best.estimate is not None and best.stages is not None
    par, est, knobs = best.parallel, best.estimate, best.knobs
    placement = assemble.place(
        ctx.evaluator, ctx.model, par, ctx.cluster, allocation, trace_loads, ctx.options
    )
    reinstall_sigint()
    # the settings the exports carry, embedded so that they read plan.json alone
    described = ctx.evaluator.describe_model(ctx.model)
    model = replace(ModelEntry.from_dict(described), settings=settings)
    g = ctx.cluster.gpus_per_node
    cluster = ClusterEntry.from_dict(
        {
            **ctx.evaluator.describe_cluster(ctx.cluster),
            "gpus": ctx.space.gpus,
            "nodes_used": -(-ctx.space.gpus // g),
        }
    )
    space = ctx.space
    sizes = {
        "gpus": space.gpus,
        "fixed": dict(space.fixed),
        "recompute": list(space.recompute),
        "recompute_modules": None
        if space.recompute_modules is None
        else list(space.recompute_modules),
        "sharding": list(space.sharding),
        "a2a_overlap": space.a2a_overlap,
        "dispatchers": list(space.dispatchers),
        "max_ep": space.max_ep,
        "solver": ctx.options.backend,
        "seed": ctx.options.seed,
        "trace": {str(k): list(v) for k, v in sorted((trace_loads or {}).items())},
        "allocation": repr(getattr(allocation, "nodes", allocation)) if allocation else None,
        "target": target.name if target else None,
    }
    digest = assemble.inputs_sha256(model.to_dict(), cluster.to_dict(), ctx.training, sizes)
    predicted = Predicted(
        est.step_time_s,
        est.mfu,
        est.tflops_per_gpu,
        est.tokens_per_s,
        est.bubble_fraction,
        tuple(est.memory_gib_per_stage),
        est.usable_memory_gib,
        tuple(sorted(est.comm_s)),
    )
    extra = {
        "target": target.name if target else "piper",
        "dispatcher": knobs.dispatcher,
        "interrupted": interrupted,
        "baselines": [_baseline_doc(b, est.step_time_s) for b in baselines],
    }
    return assemble.build_plan(
        model=model,
        cluster=cluster,
        training=training_for(ctx.training, best_candidate(best)),
        par=par,
        stage_layers=best.stages.stage_layers,
        recompute_layers=_recomputed(ctx.training, par, best.stages),
        predicted=predicted,
        stage_report=best.stages.report,
        placement=placement,
        digest=digest,
        extra=extra,
    )


def _recomputed(training: TrainingSpec, par: Any, stages: Any) -> tuple[tuple[int, ...], ...]:
    """Layers recomputed per stage: the stage IP's choice, or every layer where the engine
    applies the policy uniformly (TrainingSpec.uniform_recompute)."""
    if training.uniform_recompute and par.recompute != "none":
        return tuple(tuple(s) for s in stages.stage_layers)
    return tuple(tuple(r) for r in stages.recompute_layers)


def best_candidate(row: CandidateRow) -> Candidate:
    return Candidate(row.parallel, row.knobs)


def _baseline_doc(b: Baseline, piper_step_s: float) -> dict[str, Any]:
    est = b.estimate
    return {
        "name": b.name,
        "layout": describe(b.parallel, b.knobs) if b.parallel else "",
        "zero": b.zero,
        "fits": bool(est and est.fits),
        "step_time_s": est.step_time_s if est else None,
        "tflops_per_gpu": est.tflops_per_gpu if est else None,
        "speedup": None if math.isnan(b.speedup(piper_step_s)) else b.speedup(piper_step_s),
        "note": b.note,
    }
