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
from planner.plan.schema import Interval, Intervals, Plan
from planner.resources.cost import estimate
from planner.search.make_plan import PlanResult
from planner.specs import ClusterSpec


def bracket(
    iv: Interval, digits: int = 4, scale: float = 1.0, percent: bool = False, level: bool = True
) -> str:
    """The interval as "[lo, hi] (80%)": its ends times `scale` to `digits` significant digits
    (percentages with one decimal when `percent`); without " (80%)" when not `level`."""
    lo, hi = iv.lo * scale, iv.hi * scale
    ends = f"{lo:.1%}, {hi:.1%}" if percent else f"{number(lo, digits)}, {number(hi, digits)}"
    return f"[{ends}]" + (f" ({iv.level:.0%})" if level else "")


def interval_lines(ivs: Intervals | None, gpus: int, indent: str = "  ") -> list[str]:
    """The printed interval lines of `piper plan` and `piper estimate` (none without ivs):
    tokens/s (total and per GPU), step time, TFLOPS/GPU, MFU, each stage's memory, source."""
    if ivs is None:
        return []
    memory = ", ".join(
        f"stage {k} {bracket(iv, 3)}" for k, iv in enumerate(ivs.memory_gib_per_stage)
    )
    return [
        f"{indent}intervals: tokens/s {bracket(ivs.tokens_per_s)}, per GPU "
        f"{bracket(ivs.tokens_per_s, scale=1 / gpus)}",
        f"{indent}  step {bracket(ivs.step_time_s)} s, TFLOPS/GPU {bracket(ivs.tflops_per_gpu, 3)},"
        f" MFU {bracket(ivs.mfu, percent=True)}",
        f"{indent}  memory (GiB) {memory}",
        f"{indent}  from {ivs.source}",
    ]


def intervals_csv(ivs: Intervals) -> str:
    """`piper estimate --out`'s intervals.csv: figure,stage,level,lo,mid,hi (stage empty for
    the step's figures; memory_gib one row per stage)."""
    rows = ["figure,stage,level,lo,mid,hi"]
    named = [(n, "", getattr(ivs, n)) for n in Intervals.FIGURES]
    named += [("memory_gib", str(k), iv) for k, iv in enumerate(ivs.memory_gib_per_stage)]
    for name, stage, iv in named:
        rows.append(f"{name},{stage},{iv.level:g},{iv.lo:.6g},{iv.mid:.6g},{iv.hi:.6g}")
    return "\n".join(rows) + "\n"


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
