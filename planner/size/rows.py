"""One row of `piper size` per cluster and size, its flags, and the Pareto set of days vs cost.

    flags_of(rows, min_mfu) -> the rows of one cluster with their flags set
    pareto(rows) -> the rows with `pareto` set where no other row is as fast and as cheap

Flags (planner/SIZING.md, "Flags"): "no-plan" (no layout fits; `note` says why), "batch" (the
global batch gives fewer sequences, hence fewer than one micro-batch, than the data-parallel ranks
the size needs at the smallest planned size's model parallelism: the planner can only feed it by
splitting the model further), "capped" (the sqrt rule reached the critical batch), "mfu" (MFU
below the threshold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.plan.schema import Interval
from planner.size.goodput import Goodput


@dataclass(frozen=True)
class SizeRow:
    """One cluster at one size. Figures are None where no layout fits. Intervals hold the
    profile's `level` of probability; days and what follows from them include failures."""

    cluster: str
    gpus: int
    global_batch: int  # sequences per step at this size
    batch_capped: bool = False
    layout: str = ""
    model_parallel: int = 0  # pp x tp x cp of the plan
    dp: int = 0
    micro_batch: int = 0
    tokens_per_s: Interval | None = None
    mfu: float | None = None
    step_time_s: float | None = None
    ideal_days: Interval | None = None
    days: Interval | None = None
    gpu_hours: Interval | None = None
    cost_usd: Interval | None = None
    energy_mwh: Interval | None = None
    goodput: Goodput | None = None
    flags: tuple[str, ...] = ()
    pareto: bool = False
    note: str = ""

    @property
    def planned(self) -> bool:
        return self.days is not None


def scaled(iv: Interval, factor: float) -> Interval:
    """The interval times a positive factor."""
    return Interval(iv.lo * factor, iv.mid * factor, iv.hi * factor, iv.level)


def flags_of(rows: Sequence[SizeRow], min_mfu: float) -> list[SizeRow]:
    """The rows of one cluster (sizes ascending) with their flags (module docstring)."""
    first = next((r for r in rows if r.planned), None)
    base_mp = first.model_parallel if first is not None else 0
    out = []
    for row in rows:
        flags = []
        if not row.planned:
            flags.append("no-plan")
        if base_mp and row.global_batch < row.gpus // base_mp:
            flags.append("batch")
        if row.batch_capped:
            flags.append("capped")
        if row.mfu is not None and row.mfu < min_mfu:
            flags.append("mfu")
        out.append(replace(row, flags=tuple(flags)))
    return out


def pareto_axis(rows: Sequence[SizeRow]) -> str:
    """ "cost" when every planned row is priced, else "GPU-hours": what the Pareto set weighs."""
    planned = [r for r in rows if r.planned]
    return "cost" if all(r.cost_usd is not None for r in planned) else "GPU-hours"


def pareto(rows: Sequence[SizeRow]) -> list[SizeRow]:
    """`rows` with `pareto` True on each planned row that no other planned row matches or beats
    in both days and cost (GPU-hours when any planned row has no price), at the estimates."""
    planned = [r for r in rows if r.planned]
    priced = pareto_axis(rows) == "cost"

    def key(r: SizeRow) -> tuple[float, float]:
        assert r.days is not None and r.gpu_hours is not None
        money = r.cost_usd.mid if priced and r.cost_usd is not None else r.gpu_hours.mid
        return r.days.mid, money

    def dominated(r: SizeRow) -> bool:
        d, c = key(r)
        return any(
            key(o)[0] <= d and key(o)[1] <= c and key(o) != (d, c) for o in planned if o is not r
        )

    return [replace(r, pareto=r.planned and not dominated(r)) for r in rows]
