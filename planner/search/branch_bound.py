"""Candidates of the outer search: screening by cheap bounds and branch and bound on the split.

Steps (planner/PLANNING.md describes them for users):
1. Enumerate valid layouts (planner.search.enumerate) within the user's fixed sizes.
2. Screen each with its StageCostInputs: a memory lower bound rejects layouts no split can fit;
   a step-time lower bound orders the rest (planner.search.bounds).
3. Branch and bound: find each candidate's optimal split in bound order (the exact DP, or the
   stage IP where the DP is not exact or score="ip"), in fixed-size batches (threads work on
   a batch concurrently, each solver single-threaded, so the set of candidates scored and
   every answer are the same for any --threads); predict each split with the resource model;
   a candidate whose bound is not below the best predicted step time is not scored and gets
   a "pruned" row. The winner's split is then re-solved by the stage IP (confirm_with_ip).
Ctrl-C during step 3 stops the search and keeps the best candidate found so far.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.resources.stage_inputs import StageCostInputs
from planner.search import bounds
from planner.search.enumerate import SearchSpace, enumerate_layouts, make_space
from planner.search.evaluator import EstimateView, Evaluator, StageChoice, gib
from planner.specs import ClusterSpec, ModelSpec, Recompute, SpecError, TrainingSpec
from planner.topology import check_fits

log = logging.getLogger(__name__)

BATCH = 4  # candidates solved between incumbent updates; fixed so --threads changes nothing
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class CandidateRow:
    """One evaluated layout: a row of candidates.csv."""

    order: int  # position in the enumeration (deterministic tie-break)
    parallel: ParallelConfig
    bound_step_time_s: float  # lower bound on the step; nan when not computed
    feasible: bool  # fits memory (by the IP and the resource model; pruned rows: by the bound)
    status: str  # "solved" | "pruned" | "infeasible" | "interrupted"
    reason: str
    solver_status: str = ""
    memory_need_gib: float = math.nan  # lower bound on the fullest stage (infeasible rows)
    usable_memory_gib: float = math.nan
    estimate: EstimateView | None = None
    stages: StageChoice | None = None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s if self.estimate else math.nan


@dataclass(frozen=True)
class Screened:
    order: int
    parallel: ParallelConfig
    inputs: StageCostInputs
    bound_s: float


@dataclass(frozen=True)
class SearchOutcome:
    """Steps 1-3: ranked rows, the winner's row, whether Ctrl-C stopped the search, wall
    times (s) and counts, and the screened candidates' cost inputs (for the baselines)."""

    rows: tuple[CandidateRow, ...]
    best: CandidateRow | None
    interrupted: bool
    timings: dict[str, float]
    inputs: Mapping[ParallelConfig, StageCostInputs]


@dataclass(frozen=True)
class SearchContext:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    space: SearchSpace
    options: SolverOptions
    evaluator: Evaluator
    score: Literal["dp", "ip"] = "dp"  # how candidates' splits are found (winner: always IP)


def rank_rows(rows: Sequence[CandidateRow]) -> tuple[CandidateRow, ...]:
    """Feasible solved rows by step time, then pruned and interrupted by bound, then the rest."""
    group = {"pruned": 1, "interrupted": 2}  # everything else not feasible: 3

    def key(r: CandidateRow) -> tuple:
        ok = r.status == "solved" and r.feasible
        g = 0 if ok else group.get(r.status, 3)
        value = r.step_time_s if ok else r.bound_step_time_s
        if r.status == "infeasible" and not math.isnan(r.memory_need_gib):
            value = r.memory_need_gib
        return (g, math.inf if math.isnan(value) else value, r.order)

    return tuple(sorted(rows, key=key))


def training_for(training: TrainingSpec, par: ParallelConfig) -> TrainingSpec:
    """The training spec a layout is costed with (the layout's recompute policy)."""
    return replace(training, recompute=par.recompute)


def screen(ctx: SearchContext, layouts: Sequence[ParallelConfig]) -> tuple[list, list]:
    """Cost inputs and bounds for every layout -> (screened candidates, infeasible rows).

    Activation memory per stage, min(pp - s, m) x act(micro_batch), never shrinks as the
    micro-batch grows (m = batch / micro_batch), so once a micro-batch cannot fit, the larger
    ones of the same layout are rejected without costing them.
    """
    cache: dict[tuple, StageCostInputs] = {}
    too_big: dict[tuple, tuple[int, float, float]] = {}  # layout -> (micro-batch, need, usable)
    survivors, rejected = [], []
    for order, par in enumerate(layouts):
        key = (par.pp, par.dp, par.tp, par.ep, par.recompute)
        if key in too_big and par.micro_batch > too_big[key][0]:
            mb, need, usable = too_big[key]
            reason = (
                f"micro-batch {par.micro_batch} > {mb}, which already needs >= {need:.1f} GiB "
                f"> {usable:.1f} GiB usable"
            )
            rejected.append(
                CandidateRow(order, par, math.nan, False, "infeasible", reason, "", need, usable)
            )
            continue
        try:
            inputs = _cost_inputs(ctx, par, cache)
        except SpecError as exc:  # a rule of the resource model the enumeration does not know
            rejected.append(CandidateRow(order, par, math.nan, False, "infeasible", str(exc)))
            continue
        if not bounds.memory_may_fit(inputs):
            need = gib(bounds.min_peak_memory_bytes(inputs))
            usable = gib(inputs.usable_memory_bytes)
            too_big.setdefault(key, (par.micro_batch, need, usable))
            reason = f"needs >= {need:.1f} GiB on its fullest stage > {usable:.1f} GiB usable"
            rejected.append(
                CandidateRow(order, par, math.nan, False, "infeasible", reason, "", need, usable)
            )
            continue
        survivors.append(Screened(order, par, inputs, bounds.step_time_lower_bound_s(inputs)))
    survivors.sort(key=lambda c: (c.bound_s, c.order))
    return survivors, rejected


def _cost_inputs(ctx: SearchContext, par: ParallelConfig, cache: dict) -> StageCostInputs:
    """StageCostInputs of a layout (cached: the layouts of one search repeat sizes)."""
    key = (par.pp, par.dp, par.tp, par.ep, par.micro_batch, par.num_microbatches, par.recompute)
    if key not in cache:
        cache[key] = ctx.evaluator.cost_inputs(
            ctx.model, ctx.cluster, training_for(ctx.training, par), par
        )
    return cache[key]


def _evaluate(ctx: SearchContext, cand: Screened) -> CandidateRow:
    """Solve the stage IP of one candidate and predict its split."""
    opts = replace(ctx.options, threads=1)
    if ctx.score == "ip":
        choice = ctx.evaluator.solve_stages(cand.inputs, opts)
    else:
        choice = ctx.evaluator.score_stages(cand.inputs, opts)
    return _row(ctx, cand, choice)


def _row(ctx: SearchContext, cand: Screened, choice: StageChoice) -> CandidateRow:
    """The row of a candidate whose split has been chosen: infeasible, or predicted."""
    rep = choice.report
    if not rep.has_solution:
        usable = gib(cand.inputs.usable_memory_bytes)
        why = (
            f"stage IP: no contiguous split of non-empty stages fits {usable:.1f} GiB usable"
            if rep.status == "INFEASIBLE"
            else rep.message or f"stage IP: {rep.status}"
        )
        need = gib(bounds.min_peak_memory_bytes(cand.inputs))
        return CandidateRow(
            cand.order,
            cand.parallel,
            cand.bound_s,
            False,
            "infeasible",
            why,
            rep.status,
            need,
            usable,
        )
    est = ctx.evaluator.estimate(
        ctx.model,
        ctx.cluster,
        training_for(ctx.training, cand.parallel),
        cand.parallel,
        choice.stage_layers,
        choice.recompute_layers,
    )
    if est.step_time_s < cand.bound_s * (1 - 1e-6):
        log.warning(
            "bound %.6g s above the predicted step %.6g s for %s; pruning may be unsafe",
            cand.bound_s,
            est.step_time_s,
            cand.parallel,
        )
    reason = "" if est.fits else est.reason
    return CandidateRow(
        cand.order,
        cand.parallel,
        cand.bound_s,
        est.fits,
        "solved",
        reason,
        rep.status,
        estimate=est,
        stages=choice,
    )


def _better(row: CandidateRow, best: CandidateRow | None) -> bool:
    if not (row.feasible and row.estimate):
        return False
    if best is None:
        return True
    return (row.step_time_s, row.order) < (best.step_time_s, best.order)


def reinstall_sigint() -> None:
    """Give Ctrl-C back to Python after solver calls.

    OR-Tools CP-SAT (catch_sigint_signal, on by default) installs its own SIGINT handler for
    the length of a solve and leaves SIG_DFL behind, so the next Ctrl-C would kill the
    process instead of raising KeyboardInterrupt. Re-registering Python's handler (main
    thread only) keeps "Ctrl-C stops the search and keeps the best plan" working.
    """
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is threading.main_thread() and callable(handler):
        signal.signal(signal.SIGINT, handler)


def branch_and_bound(
    ctx: SearchContext, survivors: Sequence[Screened], progress: Progress | None = None
) -> tuple[list[CandidateRow], CandidateRow | None, bool]:
    """Step 3: solve in bound order, prune what cannot beat the incumbent; Ctrl-C stops it."""
    rows: list[CandidateRow] = []
    best: CandidateRow | None = None
    pool = ThreadPoolExecutor(max_workers=ctx.options.threads)
    i, interrupted = 0, False
    try:
        while i < len(survivors):
            batch: list[Screened] = []
            while i < len(survivors) and len(batch) < BATCH:
                cand = survivors[i]
                i += 1
                if best is not None and cand.bound_s >= best.step_time_s:
                    reason = f"pruned: bound {cand.bound_s:.4g} s >= best {best.step_time_s:.4g} s"
                    rows.append(
                        CandidateRow(
                            cand.order, cand.parallel, cand.bound_s, True, "pruned", reason
                        )
                    )
                else:
                    batch.append(cand)
            for row in pool.map(lambda c: _evaluate(ctx, c), batch):
                rows.append(row)
                if _better(row, best):
                    best = row
            reinstall_sigint()
            if progress:
                progress(i, len(survivors))
    except KeyboardInterrupt:
        interrupted = True
        done = {r.order for r in rows}
        for cand in survivors:
            if cand.order not in done:
                reason = "interrupted: not evaluated (Ctrl-C)"
                rows.append(
                    CandidateRow(
                        cand.order, cand.parallel, cand.bound_s, True, "interrupted", reason
                    )
                )
    finally:
        pool.shutdown(wait=not interrupted, cancel_futures=True)
    return rows, best, interrupted


def confirm_with_ip(ctx: SearchContext, best: CandidateRow, cand: Screened) -> CandidateRow:
    """Re-solve the winner's split with the stage IP (the user's backend) and re-predict.

    The DP that scored the candidates is exact; the IP proves it with the chosen solver and
    its report (status, objective, bound, gap) goes into plan.json.
    """
    choice = ctx.evaluator.solve_stages(cand.inputs, replace(ctx.options, threads=1))
    reinstall_sigint()
    if not choice.report.has_solution:
        log.warning("stage IP found no split where the DP did (%s); keeping the DP's", cand)
        return best
    return _row(ctx, cand, choice)


def search_layouts(ctx: SearchContext, progress: Progress | None = None) -> SearchOutcome:
    """Steps 1-3: enumerate, screen, branch and bound (and confirm the winner by the IP)."""
    t0 = time.perf_counter()
    layouts = enumerate_layouts(ctx.model, ctx.cluster, ctx.training, ctx.space)
    t1 = time.perf_counter()
    survivors, rejected = screen(ctx, layouts)
    t2 = time.perf_counter()
    rows, best, interrupted = branch_and_bound(ctx, survivors, progress)
    if best is not None and ctx.score == "dp" and not interrupted:
        best = confirm_with_ip(ctx, best, {c.order: c for c in survivors}[best.order])
        rows = [best if r.order == best.order else r for r in rows]
    t3 = time.perf_counter()
    timings = {
        "enumerate_s": t1 - t0,
        "screen_s": t2 - t1,
        "stage_search_s": t3 - t2,
        "layouts": float(len(layouts)),
        "candidates_scored": float(sum(r.status in ("solved", "infeasible") for r in rows)),
        "candidates_pruned": float(sum(r.status == "pruned" for r in rows)),
    }
    inputs = {c.parallel: c.inputs for c in survivors}
    return SearchOutcome(rank_rows([*rows, *rejected]), best, interrupted, timings, inputs)


def new_context(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    gpus: int,
    fixed: Mapping[str, int | None] | None,
    options: SolverOptions,
    evaluator: Evaluator,
    recompute: Sequence[Recompute] | None = None,
    max_ep: int | None = None,
    score: Literal["dp", "ip"] = "dp",
) -> SearchContext:
    """Validate the request (GPU count, fixed sizes) and bundle it for the search."""
    check_fits(cluster, gpus)
    space = make_space(gpus, fixed, recompute, max_ep)
    return SearchContext(model, cluster, training, space, options, evaluator, score)


def describe(par: ParallelConfig) -> str:
    """pp=4 dp=16 tp=1 ep=8 mb=2 m=32 recompute=none"""
    return (
        f"pp={par.pp} dp={par.dp} tp={par.tp} ep={par.ep} mb={par.micro_batch} "
        f"m={par.num_microbatches} recompute={par.recompute}"
    )
