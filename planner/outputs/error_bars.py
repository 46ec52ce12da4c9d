"""Error bars on a plan and in text: the chosen layout's intervals, and how they are printed.

`with_intervals(result, cluster)` returns the PlanResult whose plan carries
`predicted.intervals` (planner/calibrate/uncertainty.py on the chosen layout, the fitted
constants' covariance propagated through the resource model re-run on the plan's layout and
layer split); plan.json, summary.md, the printed summary and the CSVs read them from there.
`bracket(iv)` is the one text form: "[lo, hi] (80%)".
"""

from __future__ import annotations

from dataclasses import replace

from planner.calibrate.compare import plan_inputs
from planner.calibrate.uncertainty import intervals
from planner.numbers import number
from planner.plan.schema import Interval, Plan
from planner.resources.cost import estimate
from planner.search.make_plan import PlanResult
from planner.specs import ClusterSpec


def bracket(iv: Interval, digits: int = 4, scale: float = 1.0, percent: bool = False) -> str:
    """ "[lo, hi] (80%)": the interval's ends times `scale`, to `digits` significant digits (as
    percentages with one decimal when `percent`)."""
    lo, hi = iv.lo * scale, iv.hi * scale
    ends = f"{lo:.1%}, {hi:.1%}" if percent else f"{number(lo, digits)}, {number(hi, digits)}"
    return f"[{ends}] ({iv.level:.0%})"


def plan_tokens_per_s(plan: Plan, cluster: ClusterSpec) -> float:
    """Tokens/s of the plan's layout, layer split, recompute and dispatcher on `cluster`."""
    model, _, training, parallel = plan_inputs(plan, cluster)
    return estimate(
        model, cluster, training, parallel, stage_layers=[s.layers for s in plan.stages],
        recompute_layers=[s.recompute_layers for s in plan.stages],
        dispatcher=plan.extra.get("dispatcher", "flat"),
    ).tokens_per_s  # fmt: skip


def with_intervals(result: PlanResult, cluster: ClusterSpec) -> PlanResult:
    """`result` with its plan's predicted.intervals set from `cluster`'s calibration (the
    result unchanged when it has no plan)."""
    plan = result.plan
    if plan is None:
        return result
    ivs = intervals(cluster, plan.predicted, reprice=lambda c: plan_tokens_per_s(plan, c))
    predicted = replace(plan.predicted, intervals=ivs)
    return replace(result, plan=replace(plan, predicted=predicted))


def time_spread(plan: Plan | None) -> float | None:
    """hi / mid of the plan's tokens/s interval (the factor every candidate's figures are
    widened by), None without intervals."""
    if plan is None or plan.predicted.intervals is None:
        return None
    iv = plan.predicted.intervals.tokens_per_s
    return iv.hi / iv.mid if iv.mid > 0 else None
