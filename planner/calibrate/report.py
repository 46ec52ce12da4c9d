"""Render a Calibration: a text/markdown table, a CSV and a predicted-vs-measured plot.

The CSV keeps 6 significant digits; the markdown writes numbers as people read them
(planner.numbers).
"""

from __future__ import annotations

import io

from planner.calibrate.compare import Calibration, Component
from planner.numbers import number

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
