"""The tables of a plan as pandas DataFrames, and the CSV files written from them.

`plan_tables(result)` returns PlanTables(candidates, stages, memory, comm): numeric columns
hold numbers (NaN where a candidate has no estimate), text columns text. `to_csv(frame,
digits)` writes a frame with each float column printed to its fixed number of significant
digits, so equal inputs give equal bytes (candidates.csv, stages.csv, memory.csv, comm.csv).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pandas as pd

from planner.plan.schema import Intervals
from planner.search.evaluator import EstimateView
from planner.search.make_plan import PlanResult
from planner.search.rows import CandidateRow

NAN = float("nan")
CANDIDATE_COLUMNS = (
    "rank", "pp", "dp", "tp", "ep", "edp", "micro_batch", "num_microbatches", "recompute",
    "recompute_modules", "vp", "cp", "etp", "sharding", "a2a_overlap", "dispatcher",
    "step_time_s", "tokens_per_s", "mfu", "tflops_per_gpu", "stage0_memory_gib",
    "bound_step_time_s", "feasible", "status", "solver_status", "reason",
    "tokens_per_s_lo", "tokens_per_s_hi", "step_time_s_lo", "step_time_s_hi",
)  # fmt: skip
# Significant digits of each float column in the CSV files.
CANDIDATE_DIGITS = {"step_time_s": 6, "tokens_per_s": 6, "mfu": 4, "tflops_per_gpu": 4,
                    "stage0_memory_gib": 4, "bound_step_time_s": 6, "tokens_per_s_lo": 6,
                    "tokens_per_s_hi": 6, "step_time_s_lo": 6, "step_time_s_hi": 6}  # fmt: skip
STAGE_DIGITS = {"time_per_microbatch_s": 6, "memory_gib": 5, "capacity_gib": 5,
                "memory_gib_lo": 5, "memory_gib_hi": 5}  # fmt: skip
MEMORY_DIGITS = {"gib": 5, "gib_lo": 5, "gib_hi": 5}
COMM_DIGITS = {"seconds_per_step": 6, "fraction_of_step": 4}


@dataclass(frozen=True)
class PlanTables:
    """candidates (one row per candidate, ranked), stages (one per pipeline stage), memory
    (stage x component, GiB, long format) and comm (seconds per step by collective)."""

    candidates: pd.DataFrame
    stages: pd.DataFrame
    memory: pd.DataFrame
    comm: pd.DataFrame


def fmt(x: float | None, digits: int = 6) -> str:
    """A float as text with `digits` significant digits; '' for None or nan."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}g}"


def to_csv(frame: pd.DataFrame, digits: Mapping[str, int]) -> str:
    """CSV text of `frame` (no index, '\\n' line ends), float columns to `digits`."""
    out = frame.copy()
    for column, n in digits.items():
        out[column] = [fmt(v, n) for v in frame[column]]
    return out.to_csv(index=False, lineterminator="\n")


def candidates_frame(rows: Sequence[CandidateRow], spread: float | None = None) -> pd.DataFrame:
    """One row per candidate, ranked (rows come ranked from the search); feasible is 1 only
    when the candidate is known to fit (a pruned family's unchecked members say 0).
    `spread`: hi / mid of the chosen plan's tokens/s interval (planner.calibrate.error_bars),
    which sets every candidate's tokens/s and step time lo / hi (empty when None)."""
    out = []
    for rank, r in enumerate(rows, start=1):
        p, e, k = r.parallel, r.estimate, r.knobs
        memory = e.memory_gib_per_stage[0] if e and e.memory_gib_per_stage else NAN
        f = spread if spread and e else NAN
        bars = [e.tokens_per_s / f, e.tokens_per_s * f, e.step_time_s / f,
                e.step_time_s * f] if e else [NAN] * 4  # fmt: skip
        out.append(
            [rank, p.pp, p.dp, p.tp, p.ep, p.edp, p.micro_batch, p.num_microbatches, p.recompute,
             " ".join(p.recompute_modules), p.vp, p.cp, p.etp, k.sharding, int(k.a2a_overlap),
             k.dispatcher, e.step_time_s if e else NAN, e.tokens_per_s if e else NAN,
             e.mfu if e else NAN, e.tflops_per_gpu if e else NAN, memory, r.bound_step_time_s,
             int(bool(r.feasible)), r.status, r.solver_status, r.reason, *bars]
        )  # fmt: skip
    return pd.DataFrame(out, columns=list(CANDIDATE_COLUMNS))


def capacity_gib(est: EstimateView) -> float:
    """What per-stage totals are held against: device memory if known, else usable memory."""
    return est.usable_memory_gib if math.isnan(est.device_memory_gib) else est.device_memory_gib


def stages_frame(result: PlanResult) -> pd.DataFrame:
    """Per stage: layers, recomputed layers, time per micro-batch (s), memory (GiB) with its
    interval's ends and memory_may_not_fit (1: the upper end exceeds the device memory; all
    three empty when the plan has no intervals)."""
    best, plan = result.best, result.plan
    assert best is not None and best.estimate is not None and plan is not None
    est = best.estimate
    bars = memory_bars(est, plan.predicted.intervals)
    over = memory_may_not_fit(plan.predicted.intervals, len(plan.stages))
    rows = [
        [st.stage, st.layers[0], st.layers[-1], len(st.layers),
         " ".join(map(str, st.recompute_layers)),
         est.stage_time_s[st.stage] if st.stage < len(est.stage_time_s) else NAN,
         est.memory_gib_per_stage[st.stage], capacity_gib(est), *bars[st.stage],
         over[st.stage]]
        for st in plan.stages
    ]  # fmt: skip
    columns = ["stage", "first_layer", "last_layer", "num_layers", "recompute_layers",
               "time_per_microbatch_s", "memory_gib", "capacity_gib", "memory_gib_lo",
               "memory_gib_hi", "memory_may_not_fit"]  # fmt: skip
    return pd.DataFrame(rows, columns=columns)


def memory_frame(est: EstimateView, ivs: Intervals | None = None) -> pd.DataFrame:
    """Long format: stage, component, GiB; components as the resource model names them; the
    total rows carry the stage's interval ends (gib_lo, gib_hi) when `ivs` is given."""
    rows = []
    bars = memory_bars(est, ivs)
    for s, total in enumerate(est.memory_gib_per_stage):
        rows += [[s, name, per_stage[s], NAN, NAN] for name, per_stage in est.memory_gib_SC]
        rows.append([s, "total", total, *bars[s]])
    return pd.DataFrame(rows, columns=["stage", "component", "gib", "gib_lo", "gib_hi"])


def memory_may_not_fit(ivs: Intervals | None, stages: int) -> list[int | str]:
    """Per stage 1 / 0: the interval's upper end exceeds the device memory ("" unjudged)."""
    if ivs is None or not ivs.memory_may_not_fit:
        return [""] * stages
    return [int(x) for x in ivs.memory_may_not_fit]


def memory_bars(est: EstimateView, ivs: Intervals | None) -> list[tuple[float, float]]:
    """(lo, hi) GiB per stage of `est`: its totals times the intervals' lo / mid and hi / mid
    (NaN without intervals)."""
    if ivs is None:
        return [(NAN, NAN)] * len(est.memory_gib_per_stage)
    return [
        (m * iv.lo / iv.mid, m * iv.hi / iv.mid) if iv.mid > 0 else (NAN, NAN)
        for m, iv in zip(est.memory_gib_per_stage, ivs.memory_gib_per_stage, strict=True)
    ]


def comm_frame(est: EstimateView) -> pd.DataFrame:
    """Communication time per step by collective and level, with its share of the step."""
    rows = [[name, sec, sec / est.step_time_s if est.step_time_s > 0 else NAN]
            for name, sec in sorted(est.comm_s)]  # fmt: skip
    return pd.DataFrame(rows, columns=["name", "seconds_per_step", "fraction_of_step"])


def plan_tables(result: PlanResult) -> PlanTables:
    """The four tables of a plan (see PlanTables)."""
    assert result.best is not None and result.best.estimate is not None
    est = result.best.estimate
    ivs = result.plan.predicted.intervals if result.plan else None
    return PlanTables(candidates_frame(result.rows, time_spread(ivs)), stages_frame(result),
                      memory_frame(est, ivs), comm_frame(est))  # fmt: skip


def time_spread(ivs: Intervals | None) -> float | None:
    """hi / mid of the plan's tokens/s interval, None without intervals."""
    if ivs is None or ivs.tokens_per_s.mid <= 0:
        return None
    return ivs.tokens_per_s.hi / ivs.tokens_per_s.mid
