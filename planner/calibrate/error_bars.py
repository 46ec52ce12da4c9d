"""Error bars on a plan and in text: the chosen layout's intervals, and how they are printed.

`with_intervals(result, cluster)` returns the PlanResult whose plan carries
`predicted.intervals` (planner/calibrate/uncertainty.py on the chosen layout, the fitted
constants' covariance propagated through the resource model re-run on the plan's layout and
layer split); plan.json, summary.md, the printed summary and the CSVs read them from there.
`bracket(iv)` is the one text form: "[lo, hi] (80%)". `may_not_fit(ivs, device_memory_gib)`
judges each stage's memory interval against the device memory (its upper end above it: the
stage may not fit), and `may_not_fit_note` is the sentence the fits verdicts of `piper plan`
and `piper estimate` add when a stage fits at the estimate but not at that upper end; neither
changes which layouts the planner accepts (that is the memory margin's job).
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
    """`piper estimate --out`'s intervals.csv: figure,stage,level,lo,mid,hi,may_not_fit (stage
    and may_not_fit empty for the step's figures; memory_gib one row per stage, may_not_fit 1
    where hi exceeds the device memory, else 0; empty when `ivs` was not judged)."""
    rows = ["figure,stage,level,lo,mid,hi,may_not_fit"]
    over = [str(int(x)) for x in ivs.memory_may_not_fit] or [""] * len(ivs.memory_gib_per_stage)
    named = [(n, "", getattr(ivs, n), "") for n in Intervals.FIGURES]
    named += [("memory_gib", str(k), iv, over[k]) for k, iv in enumerate(ivs.memory_gib_per_stage)]
    for name, stage, iv, flag in named:
        rows.append(f"{name},{stage},{iv.level:g},{iv.lo:.6g},{iv.mid:.6g},{iv.hi:.6g},{flag}")
    return "\n".join(rows) + "\n"


def may_not_fit(ivs: Intervals, device_memory_gib: float) -> Intervals:
    """`ivs` with memory_may_not_fit set: per stage, the interval's upper end exceeds
    `device_memory_gib` (the whole device, as the fits verdict holds the totals)."""
    over = tuple(iv.hi > device_memory_gib for iv in ivs.memory_gib_per_stage)
    return replace(ivs, memory_may_not_fit=over)


def memory_spread(ivs: Intervals | None) -> float:
    """hi / mid of the memory intervals (one profile-wide sd, so every stage and layout shares
    it); 1.0 without intervals."""
    for iv in ivs.memory_gib_per_stage if ivs else ():
        if iv.mid > 0:
            return iv.hi / iv.mid
    return 1.0


def may_not_fit_note(ivs: Intervals | None, device_memory_gib: float) -> str:
    """The verdict's warning for stages that fit at the estimate (mid <= device memory) while
    their interval's upper end exceeds it; "" when there is none. E.g. "the 80% interval's
    upper end 85.5 GiB exceeds 74.5 GiB on stage 0: may not fit"."""
    if ivs is None:
        return ""
    risky = [(k, iv) for k, iv in enumerate(ivs.memory_gib_per_stage)
             if iv.mid <= device_memory_gib < iv.hi]  # fmt: skip
    if not risky:
        return ""
    ends = ", ".join(f"{iv.hi:.1f} GiB on stage {k}" for k, iv in risky)
    verb = "exceeds" if len(risky) == 1 else "exceed"
    return (f"the {ivs.level:.0%} interval's upper end{'s' if len(risky) > 1 else ''} {ends} "
            f"{verb} {device_memory_gib:.1f} GiB: may not fit")  # fmt: skip


def plan_tokens_per_s(plan: Plan, cluster: ClusterSpec) -> float:
    """Tokens/s of the plan's layout, layer split, recompute and dispatcher on `cluster`."""
    model, _, training, parallel = plan_inputs(plan, cluster)
    return estimate(
        model, cluster, training, parallel, stage_layers=[s.layers for s in plan.stages],
        recompute_layers=[s.recompute_layers for s in plan.stages],
        dispatcher=plan.extra.get("dispatcher", "flat"),
    ).tokens_per_s  # fmt: skip


def plan_intervals_of(plan: Plan, cluster: ClusterSpec) -> Intervals:
    """The plan's intervals on `cluster` (its calibration, the fitted constants' covariance
    propagated through the plan's layout), each stage's memory judged against the device."""
    ivs = intervals(cluster, plan.predicted, reprice=lambda c: plan_tokens_per_s(plan, c))
    return may_not_fit(ivs, cluster.device.memory_gib)


def with_intervals(result: PlanResult, cluster: ClusterSpec) -> PlanResult:
    """`result` with its plan's predicted.intervals set from `cluster` (plan_intervals_of;
    the result unchanged when it has no plan)."""
    plan = result.plan
    if plan is None:
        return result
    predicted = replace(plan.predicted, intervals=plan_intervals_of(plan, cluster))
    return replace(result, plan=replace(plan, predicted=predicted))
