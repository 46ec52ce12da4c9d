"""The outer search: families of candidates, bounds, and branch and bound on the split.

Steps (planner/PLANNING.md describes them for users):
1. Enumerate the candidates as families (planner.search.enumerate) within the fixed sizes.
2. Bound each family by costing its fastest member (planner.search.families); compare the
   dispatchers once per MoE shape and drop the dominated ones (planner.search.costing).
3. Branch and bound, in bound order: a family whose bound can still beat the best step
   found is expanded (its members costed and screened by the memory bound); a candidate gets
   its optimal split (the exact DP, or the stage IP where the DP is not exact or
   score="ip") and a prediction, in fixed-size batches (threads work on a batch
   concurrently, each solver single-threaded, so the set of candidates scored and every
   answer are the same for any --threads). A family or candidate whose bound is not below
   the best predicted step time gets "pruned" rows. The winner's split is then re-solved by
   the stage IP (confirm_with_ip).
4. When nothing fits and cp was searched, a second pass tries the fallback cp sizes.
Ctrl-C during step 3 stops the search and keeps the best candidate found so far.
"""

from __future__ import annotations

import heapq
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Literal

from planner.ip.solvers import SolverOptions
from planner.resources.stage_inputs import StageCostInputs
from planner.search import bounds
from planner.search import space as sp
from planner.search.costing import Costing, Screened, training_for
from planner.search.enumerate import enumerate_families
from planner.search.evaluator import Evaluator, StageChoice, gib
from planner.search.families import Bounded, bound_families, expand, unexpanded_rows
from planner.search.rows import CandidateRow, describe, rank_rows
from planner.search.space import Candidate, SearchSpace
from planner.specs import ClusterSpec, ModelSpec, TrainingSpec
from planner.topology import check_fits

log = logging.getLogger(__name__)

BATCH = 4  # candidates solved between incumbent updates; fixed so --threads changes nothing
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class SearchOutcome:
    """Ranked rows, the winner's row, whether Ctrl-C stopped the search, wall times (s) and
    counts, and the screened candidates' cost inputs (for the baselines)."""

    rows: tuple[CandidateRow, ...]
    best: CandidateRow | None
    interrupted: bool
    timings: dict[str, float]
    inputs: Mapping[Candidate, StageCostInputs]


@dataclass(frozen=True)
class SearchContext:
    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    space: SearchSpace
    options: SolverOptions
    evaluator: Evaluator
    score: Literal["dp", "ip"] = "dp"  # how candidates' splits are found (winner: always IP)


def _evaluate(ctx: SearchContext, cand: Screened) -> CandidateRow:
    """Solve the stage split of one candidate and predict it."""
    opts = replace(ctx.options, threads=1)
    if ctx.score == "ip":
        choice = ctx.evaluator.solve_stages(cand.inputs, opts)
    else:
        choice = ctx.evaluator.score_stages(cand.inputs, opts)
    return _row(ctx, cand, choice)


def _row(ctx: SearchContext, cand: Screened, choice: StageChoice) -> CandidateRow:
    """The row of a candidate whose split has been chosen: infeasible, or predicted."""
    rep, par, knobs = choice.report, cand.candidate.parallel, cand.candidate.knobs
    if not rep.has_solution:
        usable = gib(cand.inputs.usable_memory_bytes)
        why = (
            f"stage IP: no contiguous split of stages with >= {cand.inputs.vp} layers fits "
            f"{usable:.1f} GiB usable"
            if rep.status == "INFEASIBLE"
            else rep.message or f"stage IP: {rep.status}"
        )
        need = gib(bounds.min_peak_memory_bytes(cand.inputs))
        return CandidateRow(
            cand.order, par, cand.bound_s, False, "infeasible", why, rep.status, need, usable,
            knobs=knobs,
        )  # fmt: skip
    est = ctx.evaluator.estimate(
        ctx.model,
        ctx.cluster,
        training_for(ctx.training, cand.candidate),
        par,
        choice.stage_layers,
        choice.recompute_layers,
        knobs.dispatcher,
    )
    if est.step_time_s < cand.bound_s * (1 - 1e-6):
        log.warning(
            "bound %.6g s above the predicted step %.6g s for %s; pruning may be unsafe",
            cand.bound_s,
            est.step_time_s,
            describe(par, knobs),
        )
    reason = "" if est.fits else est.reason
    return CandidateRow(
        cand.order, par, cand.bound_s, est.fits, "solved", reason, rep.status,
        estimate=est, stages=choice, knobs=knobs,
    )  # fmt: skip


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


class _Queue:
    """Families and screened candidates by (bound, order); a family before its members."""

    def __init__(self, families: Sequence[Bounded], single: Sequence[Screened]) -> None:
        self.heap: list[tuple[float, int, int, Bounded | Screened]] = []
        self.pushed = 0
        self.screened: dict[int, Screened] = {}  # every candidate that passed the memory bound
        for b in families:
            self.push(b)
        for c in single:
            self.push(c)

    def push(self, item: Bounded | Screened) -> None:
        self.pushed += 1
        if isinstance(item, Bounded):
            order = item.family.first_order + item.members[0]
            heapq.heappush(self.heap, (item.bound_s, order, 0, item))
        else:
            self.screened[item.order] = item
            heapq.heappush(self.heap, (item.bound_s, item.order, 1, item))

    def pop(self) -> Bounded | Screened:
        return heapq.heappop(self.heap)[3]

    def __len__(self) -> int:
        return len(self.heap)


def _pruned_reason(bound_s: float, best: CandidateRow) -> str:
    return f"pruned: bound {bound_s:.4g} s >= best {best.step_time_s:.4g} s"


def _may_beat(item: Screened, best: CandidateRow | None) -> bool:
    return best is None or bounds.can_beat(item.inputs, best.step_time_s)


def _memory_pruned_row(item: Screened, best: CandidateRow) -> CandidateRow:
    """A candidate whose memory forces enough recompute (or a split slow enough) that even
    the cheapest fractional recompute keeps it from the best step: its bound is that step."""
    c = item.candidate
    reason = f"pruned: bound >= best {best.step_time_s:.4g} s with the recompute its memory needs"
    return CandidateRow(
        item.order, c.parallel, best.step_time_s, True, "pruned", reason, knobs=c.knobs
    )


def _leftover_rows(item: Bounded | Screened, status: str, reason: str) -> list[CandidateRow]:
    if isinstance(item, Bounded):
        return unexpanded_rows(item, status, reason)
    c = item.candidate
    return [CandidateRow(item.order, c.parallel, item.bound_s, True, status, reason, knobs=c.knobs)]


def branch_and_bound(
    ctx: SearchContext,
    costing: Costing,
    queue: _Queue,
    progress: Progress | None = None,
    total: int | None = None,
    done: int = 0,
) -> tuple[list[CandidateRow], CandidateRow | None, bool]:
    """Step 3: expand and solve in bound order, prune what cannot beat the incumbent;
    Ctrl-C stops it. Returns (rows, best, interrupted). `progress` is called after every batch
    with (candidates decided, `total`): `done` already decided plus a row per candidate
    since (solved, pruned or found infeasible); without `total`, the queue's own count."""
    rows: list[CandidateRow] = []
    solving: list[Screened] = []
    best: CandidateRow | None = None
    pool = ThreadPoolExecutor(max_workers=ctx.options.threads)
    interrupted = False
    try:
        while len(queue):
            batch: list[Screened] = []
            while len(queue) and len(batch) < BATCH:
                item = queue.pop()
                if best is not None and item.bound_s >= best.step_time_s:
                    reason = _pruned_reason(item.bound_s, best)
                    rows += _leftover_rows(item, "pruned", reason)
                elif not item.refined:  # the quick bound can win: compute the exact one
                    queue.push(item.refine(costing) if isinstance(item, Bounded) else item.refine())
                elif isinstance(item, Screened) and not _may_beat(item, best):
                    rows.append(_memory_pruned_row(item, best))
                elif isinstance(item, Bounded):
                    items, decided = expand(costing, item)
                    rows += decided
                    for queued in items:
                        queue.push(queued)
                else:
                    batch.append(item)
                    solving.append(item)
            for row in pool.map(lambda c: _evaluate(ctx, c), batch):
                rows.append(row)
                par = row.parallel
                step = f", step {row.step_time_s:.4g} s" if row.feasible else ""
                log.info("candidate pp=%d dp=%d tp=%d ep=%d mb=%d m=%d %s: %s%s", par.pp, par.dp,
                         par.tp, par.ep, par.micro_batch, par.num_microbatches, par.recompute,
                         row.status, step)  # fmt: skip
                if _better(row, best):
                    best = row
            reinstall_sigint()
            if progress and total:
                progress(min(done + len(rows), total), total)
            elif progress:
                progress(queue.pushed - len(queue), queue.pushed)
    except KeyboardInterrupt:
        interrupted = True
        done = {r.order for r in rows}
        for item in [c for c in solving if c.order not in done]:
            c = item.candidate
            reason = "interrupted: not evaluated (Ctrl-C)"
            rows.append(
                CandidateRow(item.order, c.parallel, item.bound_s, True, "interrupted", reason,
                             knobs=c.knobs)
            )  # fmt: skip
        while len(queue):
            rows += _leftover_rows(
                queue.pop(), "interrupted", "interrupted: not evaluated (Ctrl-C)"
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


@dataclass(frozen=True)
class _Pass:
    rows: list[CandidateRow]
    best: CandidateRow | None
    interrupted: bool
    screened: list[Screened]
    candidates: int
    costed: int
    times: dict[str, float]


def _one_pass(ctx: SearchContext, progress: Progress | None, offset: int) -> _Pass:
    t0 = time.perf_counter()
    families = enumerate_families(ctx.model, ctx.cluster, ctx.training, ctx.space)
    if offset:
        families = [replace(f, first_order=f.first_order + offset) for f in families]
    costing = Costing(ctx.model, ctx.cluster, ctx.training, ctx.evaluator)
    t1 = time.perf_counter()
    bounded, single, decided = bound_families(costing, families)
    queue = _Queue(bounded, single)
    t2 = time.perf_counter()
    count = sum(len(f.members) for f in families)
    if progress:
        progress(len(decided), count)
    rows, best, interrupted = branch_and_bound(ctx, costing, queue, progress, count, len(decided))
    t3 = time.perf_counter()
    times = {"enumerate_s": t1 - t0, "screen_s": t2 - t1, "stage_search_s": t3 - t2}
    screened = list(queue.screened.values())
    return _Pass([*rows, *decided], best, interrupted, screened, count, costing.calls, times)


def search_layouts(ctx: SearchContext, progress: Progress | None = None) -> SearchOutcome:
    """Steps 1-4: enumerate, bound, branch and bound (and confirm the winner by the IP)."""
    passes = [_one_pass(ctx, progress, 0)]
    fallback = sp.cp_fallback(ctx.space, ctx.model, ctx.training, ctx.cluster.gpus_per_node)
    if passes[0].best is None and not passes[0].interrupted and fallback:
        wide = replace(ctx, space=replace(ctx.space, cp_fallback=fallback))
        passes.append(_one_pass(wide, progress, passes[0].candidates))
    last = passes[-1]
    rows = [r for p in passes for r in p.rows]
    screened = [c for p in passes for c in p.screened]
    best, interrupted = last.best, last.interrupted
    t3 = time.perf_counter()
    if best is not None and ctx.score == "dp" and not interrupted:
        best = confirm_with_ip(ctx, best, {c.order: c for c in screened}[best.order])
        rows = [best if r.order == best.order else r for r in rows]
    timings = {k: sum(p.times[k] for p in passes) for k in last.times}
    timings["stage_search_s"] += time.perf_counter() - t3
    timings.update(
        layouts=float(sum(p.candidates for p in passes)),
        costed=float(sum(p.costed for p in passes)),
        candidates_scored=float(sum(r.status == "solved" or bool(r.solver_status) for r in rows)),
        candidates_pruned=float(sum(r.status == "pruned" for r in rows)),
    )
    inputs = {c.candidate: c.inputs for c in screened}
    return SearchOutcome(rank_rows(rows), best, interrupted, timings, inputs)


def new_context(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    space: SearchSpace,
    options: SolverOptions,
    evaluator: Evaluator,
    score: Literal["dp", "ip"] = "dp",
) -> SearchContext:
    """Validate the request (the GPU count fits the cluster) and bundle it for the search."""
    check_fits(cluster, space.gpus)
    return SearchContext(model, cluster, training, space, options, evaluator, score)
