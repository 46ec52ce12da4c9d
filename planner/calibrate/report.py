"""Render a Calibration: a text/markdown table, a CSV and a predicted-vs-measured plot; and
where measurements fall in their intervals: one line per figure, a summary line, JSON.

The CSV keeps 6 significant digits; the markdown writes numbers as people read them
(planner.numbers).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from planner.calibrate.compare import Calibration, Component
from planner.calibrate.error_bars import bracket
from planner.calibrate.interval_check import IntervalCheck, Tally
from planner.calibrate.log_runs import ENGINE_NAMES
from planner.calibrate.measured import Comparison
from planner.numbers import number
from planner.plan.schema import Interval

CSV_HEADER = "component,stage,unit,predicted,measured,error_pct"


def _stage(stage: int | None) -> str:
    return "all" if stage is None else str(stage)


def _pct(err: float) -> str:
    return f"{100 * err:+.1f}" if err != float("inf") else "inf"


def calibration_csv(cal: Calibration) -> str:
    """One row per component; floats with 6 significant digits (deterministic)."""
    lines = [CSV_HEADER]
    for c in cal.components:
        lines.append(
            f"{c.name},{_stage(c.stage)},{c.unit},{c.predicted:.6g},{c.measured:.6g},"
            f"{_pct(c.error)}"
        )
    return "\n".join(lines) + "\n"


def calibration_markdown(cal: Calibration) -> str:
    """A markdown table (also readable as plain text), under the line saying how the run
    differs from what the plan priced, when it does."""
    rows = [
        f"Predicted vs measured over {cal.steps_used} steps (per stage: {cal.per_stage_source})",
        "",
    ]
    if cal.note:
        rows += [cal.note, ""]
    rows += [
        "| component | stage | unit | predicted | measured | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for c in cal.components:
        rows.append(
            f"| {c.name} | {_stage(c.stage)} | {c.unit} | {number(c.predicted)} "
            f"| {number(c.measured)} | {_pct(c.error)}% |"
        )
    return "\n".join(rows) + "\n"


def _bar(c: Component, low: float, high: float) -> tuple[float, str]:
    """(predicted / measured, hatch) of a row, a zero side drawn to the axis edge, hatched."""
    if c.measured <= 0:
        return (1.0, "") if c.predicted <= 0 else (high, "//")
    return (low, "//") if c.predicted <= 0 else (c.predicted / c.measured, "")


def _bar_note(c: Component) -> str:
    """The error above a bar, or which side is zero."""
    if c.predicted <= 0 < c.measured:
        return "predicted 0"
    if c.measured <= 0 < c.predicted:
        return "measured 0"
    return f"{_pct(c.error)}%"


def calibration_figure(cal: Calibration):
    """Predicted / measured per component, one bar per table row (log scale, from 1), with
    the +-25% band; a row with a zero side is hatched at the axis edge and says which."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    comps = list(cal.components)
    finite = [c.predicted / c.measured for c in comps if c.predicted > 0 and c.measured > 0]
    low, high = min([0.5, *finite]) / 3, max([2.0, *finite]) * 3
    fig = Figure(figsize=(max(6.5, 1.0 * len(comps)), 4.2))
    ax = fig.add_subplot()
    xs = list(range(len(comps)))
    for x, c in zip(xs, comps, strict=True):
        ratio, hatch = _bar(c, low, high)
        ok = hatch == "" and abs(ratio - 1) <= 0.25
        ax.bar(x, ratio - 1.0, 0.6, bottom=1.0, color="tab:green" if ok else "tab:red",
               hatch=hatch, edgecolor="black" if hatch else None, linewidth=0.5)  # fmt: skip
        ax.annotate(_bar_note(c), (x, ratio), ha="center", va="bottom" if ratio >= 1 else "top",
                    fontsize=8)  # fmt: skip
    ax.axhspan(0.75, 1.25, color="green", alpha=0.08, label="within 25%")
    ax.axhline(1.0, color="gray", lw=0.8)
    labels = [f"{c.name}\n{'step' if c.stage is None else f'stage {c.stage}'}" for c in comps]
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(low / 1.5, high * 1.5)
    ax.set_ylabel("predicted / measured (log scale)")
    ax.set_title(f"piper calibrate: predicted vs measured ({cal.steps_used} steps)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def calibration_png(cal: Calibration) -> bytes:
    """calibration_figure as PNG bytes (no metadata: equal inputs, equal bytes)."""
    buf = io.BytesIO()
    calibration_figure(cal).savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


def check_line(c: IntervalCheck) -> str:
    """One figure against its interval, e.g. "tokens/s measured 1,234 vs predicted 1,300
    [1,100, 1,520] (80%): inside (z -0.4)"."""
    iv = Interval(c.lo, c.predicted, c.hi, c.level)
    return (f"{c.label} measured {number(c.measured)} vs predicted {number(c.predicted)} "
            f"{bracket(iv)}: {c.side} (z {_z(c.z)})")  # fmt: skip


def _z(z: float) -> str:
    return f"{z:+.1f}" if math.isfinite(z) else ("+inf" if z > 0 else "-inf")


def interval_lines(comparison: Comparison, indent: str = "  ") -> list[str]:
    """The measurement's head line (where its intervals come from) and one line per check;
    one line saying why when the plan has no intervals."""
    c, ivs = comparison, comparison.intervals
    what = f"{c.measured_path} ({ENGINE_NAMES[c.engine]})"
    if ivs.intervals is None:
        return [f"{what}: no intervals to compare with: {ivs.origin}"]
    head = f"{what} against {c.plan_path}'s {ivs.intervals.level:.0%} intervals, {ivs.origin}:"
    return [head, *(indent + check_line(x) for x in c.checks)]


def summary_line(tallies: Sequence[Tally], measurements: int) -> str:
    """Across measurements: how many fell inside, below and above, and the mean z, per kind."""
    parts = [
        f"{t.kind} {t.inside} inside, {t.below} below, {t.above} above of {t.count} "
        f"(mean z {_z(t.mean_z)}; {t.level:.0%} expected inside)"
        for t in tallies
    ]
    body = "; ".join(parts) if parts else "no intervals to compare with"
    return f"summary over {measurements} measurements: {body}"


def comparisons_json(comparisons: Sequence[Comparison], tallies: Sequence[Tally]) -> dict:
    """`piper calibrate PLAN MEASURED ... --json`: every check with its numbers, the tallies."""

    def check(x: IntervalCheck) -> dict:
        z = x.z if math.isfinite(x.z) else None
        return {"figure": x.figure, "stage": x.stage, "measured": x.measured,
                "predicted": x.predicted, "lo": x.lo, "hi": x.hi, "level": x.level,
                "log_sd": x.log_sd, "z": z, "side": x.side}  # fmt: skip

    return {
        "measurements": [
            {
                "plan": c.plan_path,
                "measured": c.measured_path,
                "format": c.engine,
                "intervals_from": c.intervals.origin if c.intervals.intervals else None,
                "no_intervals": None if c.intervals.intervals else c.intervals.origin,
                "note": c.calibration.note if c.calibration else "",
                "checks": [check(x) for x in c.checks],
            }  # fmt: skip
            for c in comparisons
        ],
        "summary": [
            {
                "kind": t.kind,
                "inside": t.inside,
                "below": t.below,
                "above": t.above,
                "count": t.count,
                "mean_z": t.mean_z if math.isfinite(t.mean_z) else None,
                "level": t.level,
            }  # fmt: skip
            for t in tallies
        ],
    }
