"""Render a Calibration: a text/markdown table, a CSV and a predicted-vs-measured plot."""

from __future__ import annotations

import io

from planner.calibrate import Calibration

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
    """A markdown table (also readable as plain text)."""
    rows = [
        f"Predicted vs measured over {cal.steps_used} steps (per stage: {cal.per_stage_source})",
        "",
        "| component | stage | unit | predicted | measured | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for c in cal.components:
        rows.append(
            f"| {c.name} | {_stage(c.stage)} | {c.unit} | {c.predicted:.4g} | {c.measured:.4g} "
            f"| {_pct(c.error)}% |"
        )
    return "\n".join(rows) + "\n"


def calibration_png(cal: Calibration) -> bytes:
    """Bars of predicted and measured per component (log scale), errors on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = [c for c in cal.components if c.predicted > 0 or c.measured > 0]
    labels = [f"{c.name}\n{_stage(c.stage)}" for c in comps]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(comps)), 4))
    xs = range(len(comps))
    ax.bar([x - 0.2 for x in xs], [max(c.predicted, 1e-12) for c in comps], 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [max(c.measured, 1e-12) for c in comps], 0.4, label="measured")
    for x, c in zip(xs, comps, strict=True):
        ax.annotate(
            f"{_pct(c.error)}%",
            (x, max(c.predicted, c.measured)),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("value (unit per component)")
    ax.set_title("piper calibrate: predicted vs measured")
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
