"""Where a measured figure falls in its predicted interval: inside, below or above, and by how
many interval-sigmas.

    plan_intervals(plan) -> PlanIntervals                     # plan.json's, else recomputed
    checks_of_calibration(cal, ivs) -> tuple[IntervalCheck]   # a piper run's metrics.jsonl
    checks_of_log(plan, tokens_per_s, peak_gib, ivs) -> ...   # a Megatron-LM / torchtitan log
    summarise(checks) -> tuple[Tally, ...]                    # several measurements at once

The error model is planner/calibrate/uncertainty.py's: log(measured / predicted) ~ N(0,
sigma^2), the interval at level L being [x e^(-q sigma), x e^(q sigma)] around the prediction
x. A measurement's z is log(measured / predicted) / sigma (sigma: the interval's
`time_log_sd` for tokens/s and step time, `memory_log_sd` for memory), so it lies inside
exactly when |z| <= q. When the prediction compared is not the interval's mid (the run was
repriced for another dispatcher, planner/calibrate/run_settings.py), the interval keeps its
relative width around the prediction compared.

A plan.json without `predicted.intervals` gets them recomputed from its own cluster profile
(planner.calibrate.error_bars.plan_intervals_of, as `piper plan` makes them); when that fails,
`PlanIntervals.intervals` is None and `origin` says why in one line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from planner.calibrate.compare import Calibration
from planner.plan.schema import Interval, Intervals, Plan
from planner.specs import SpecError

Side = Literal["inside", "below", "above"]
# The figures checked, as printed; memory_gib is one stage's peak, peak_memory_gib a log's
# largest rank held against the stage predicted largest.
LABELS = {
    "tokens_per_s": "tokens/s",
    "step_time_s": "step time (s)",
    "memory_gib": "memory stage {stage} (GiB)",
    "peak_memory_gib": "peak memory, largest stage {stage} (GiB)",
}
MEMORY_FIGURES = ("memory_gib", "peak_memory_gib")


@dataclass(frozen=True)
class IntervalCheck:
    """One measured figure against its predicted interval [lo, hi] at `level`."""

    figure: str  # a key of LABELS
    stage: int | None  # None: the whole step
    measured: float
    predicted: float
    lo: float
    hi: float
    level: float
    log_sd: float  # the interval's sigma in log space

    @property
    def side(self) -> Side:
        if self.measured < self.lo:
            return "below"
        return "above" if self.measured > self.hi else "inside"

    @property
    def z(self) -> float:
        """log(measured / predicted) / sigma (+-inf when sigma is 0 or a side is 0)."""
        if self.measured <= 0 or self.predicted <= 0:
            return -math.inf if self.measured < self.predicted else math.inf
        log_ratio = math.log(self.measured / self.predicted)
        if self.log_sd == 0:
            return 0.0 if log_ratio == 0 else math.copysign(math.inf, log_ratio)
        return log_ratio / self.log_sd

    @property
    def label(self) -> str:
        return LABELS[self.figure].format(stage=self.stage)


@dataclass(frozen=True)
class PlanIntervals:
    """The intervals a plan's measurements are held against, and where they come from."""

    intervals: Intervals | None
    origin: str  # "from plan.json", "recomputed from ...", or why there are none (one line)


def plan_intervals(plan: Plan, where: str = "plan.json") -> PlanIntervals:
    """plan.json's `predicted.intervals`; for a plan without them, those its cluster profile
    gives (uncertainty.intervals on the plan's prediction); else None and why."""
    if plan.predicted.intervals is not None:
        return PlanIntervals(plan.predicted.intervals, f"from {where}")
    from planner.calibrate.error_bars import plan_intervals_of

    try:
        cluster = plan.cluster_spec(where)
        ivs = plan_intervals_of(plan, cluster)
    except (SpecError, KeyError, TypeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return PlanIntervals(
            None,
            f"{where} records no intervals and its cluster profile cannot give them ({first});"
            " re-plan with 'piper plan' to record them",
        )
    return PlanIntervals(ivs, f"recomputed from cluster profile {cluster.name}: {where} has none")


def check(
    figure: str, stage: int | None, measured: float, predicted: float, iv: Interval,
    log_sd: float,
) -> IntervalCheck:  # fmt: skip
    """`measured` against `iv` moved to centre on `predicted` (the same relative width)."""
    scale = predicted / iv.mid if iv.mid > 0 else 1.0
    return IntervalCheck(figure, stage, measured, predicted, iv.lo * scale, iv.hi * scale,
                         iv.level, log_sd)  # fmt: skip


def checks_of_calibration(cal: Calibration, ivs: Intervals) -> tuple[IntervalCheck, ...]:
    """tokens/s, step time and each stage's memory of a compared piper run (its Calibration)."""
    out = []
    for figure in ("tokens_per_s", "step_time_s"):
        c = cal.get(figure)
        if c is not None:
            iv = getattr(ivs, figure)
            out.append(check(figure, None, c.measured, c.predicted, iv, ivs.time_log_sd))
    for c in cal.components:
        if c.name == "memory_gib" and c.stage is not None:
            iv = ivs.memory_gib_per_stage[c.stage]
            out.append(check("memory_gib", c.stage, c.measured, c.predicted, iv,
                             ivs.memory_log_sd))  # fmt: skip
    return tuple(out)


def checks_of_log(
    plan: Plan, tokens_per_s: float, peak_gib: float | None, ivs: Intervals
) -> tuple[IntervalCheck, ...]:
    """tokens/s and step time of a training log (step time = the plan's global batch x
    sequence length / tokens/s), and its peak memory against the stage predicted largest (the
    log's peak is its largest rank's)."""
    pred = plan.predicted
    tokens_per_step = int(plan.training["global_batch"]) * int(plan.training["seq_len"])
    out = [
        check("tokens_per_s", None, tokens_per_s, pred.tokens_per_s, ivs.tokens_per_s,
              ivs.time_log_sd),
        check("step_time_s", None, tokens_per_step / tokens_per_s, pred.step_time_s,
              ivs.step_time_s, ivs.time_log_sd),
    ]  # fmt: skip
    if peak_gib is not None:
        mem = pred.memory_gib_per_stage
        k = max(range(len(mem)), key=mem.__getitem__)
        out.append(check("peak_memory_gib", k, peak_gib, mem[k], ivs.memory_gib_per_stage[k],
                         ivs.memory_log_sd))  # fmt: skip
    return tuple(out)


@dataclass(frozen=True)
class Tally:
    """How one kind of figure fell over several measurements."""

    kind: Literal["tokens/s", "memory"]
    inside: int
    below: int
    above: int
    mean_z: float
    level: float

    @property
    def count(self) -> int:
        return self.inside + self.below + self.above


def summarise(checks: Sequence[IntervalCheck]) -> tuple[Tally, ...]:
    """tokens/s (step time is its reciprocal, so it is not counted twice) and memory (every
    stage peak) over `checks`; a kind with no check is left out."""
    out = []
    for kind, figures in (("tokens/s", ("tokens_per_s",)), ("memory", MEMORY_FIGURES)):
        group = [c for c in checks if c.figure in figures]
        if group:
            sides = [c.side for c in group]
            out.append(Tally(kind, sides.count("inside"), sides.count("below"),
                             sides.count("above"), sum(c.z for c in group) / len(group),
                             group[0].level))  # fmt: skip
    return tuple(out)
