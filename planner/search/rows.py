"""The rows of candidates.csv: one per candidate of the search, with how it ended.

Statuses: "solved" (split found and predicted; feasible says whether it fits), "pruned" (its
step-time bound cannot beat the best found), "infeasible" (no split can fit, or the resource
model rejects it), "dominated" (another dispatcher is no slower and needs no more memory),
"interrupted" (Ctrl-C came first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.search.evaluator import EstimateView, StageChoice
from planner.search.space import Knobs


@dataclass(frozen=True)
class CandidateRow:
    """One candidate: a row of candidates.csv.

    feasible: fits memory (by the IP and the resource model; pruned rows: by the memory
    bound); None when its memory was never checked (a member of a pruned family).
    """

    order: int  # position in the enumeration (deterministic tie-break)
    parallel: ParallelConfig
    bound_step_time_s: float  # lower bound on the step; nan when not computed
    feasible: bool | None
    status: str
    reason: str
    solver_status: str = ""
    memory_need_gib: float = math.nan  # lower bound on the fullest stage (infeasible rows)
    usable_memory_gib: float = math.nan
    estimate: EstimateView | None = None
    stages: StageChoice | None = None
    knobs: Knobs = Knobs()

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s if self.estimate else math.nan


def rank_rows(rows: Sequence[CandidateRow]) -> tuple[CandidateRow, ...]:
    """Feasible solved rows by step time, then pruned and interrupted by bound, then the rest
    (infeasible by the memory they need), dominated last."""
    group = {"pruned": 1, "interrupted": 2, "dominated": 4}  # anything else not feasible: 3

    def key(r: CandidateRow) -> tuple:
        ok = r.status == "solved" and bool(r.feasible)
        g = 0 if ok else group.get(r.status, 3)
        value = r.step_time_s if ok else r.bound_step_time_s
        if r.status == "infeasible" and not math.isnan(r.memory_need_gib):
            value = r.memory_need_gib
        return (g, math.inf if math.isnan(value) else value, r.order)

    return tuple(sorted(rows, key=key))


def describe(par: ParallelConfig, knobs: Knobs | None = None) -> str:
    """pp=4 dp=16 tp=1 ep=8 mb=2 m=32 recompute=none, then the knobs that are set:
    vp, cp, etp, recompute modules, zero or fsdp, a2a-overlap, the dispatcher."""
    text = (
        f"pp={par.pp} dp={par.dp} tp={par.tp} ep={par.ep} mb={par.micro_batch} "
        f"m={par.num_microbatches} recompute={par.recompute}"
    )
    if par.recompute_modules:
        text += f"({','.join(par.recompute_modules)})"
    text += "".join(f" {k}={getattr(par, k)}" for k in ("vp", "cp", "etp") if getattr(par, k) > 1)
    if knobs is not None:
        if knobs.sharding != "none":
            text += f" {knobs.sharding}"
        if knobs.a2a_overlap:
            text += " a2a-overlap"
        if par.ep > 1:
            text += f" dispatcher={knobs.dispatcher}"
    return text
