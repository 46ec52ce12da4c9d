"""Render a Calibration: a text/markdown table, a CSV and a predicted-vs-measured plot."""

from __future__ import annotations

import io

from planner.calibrate.compare import Calibration

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
    """Predicted / measured per component (log scale) with the +-25% band; unit-free."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    comps = [c for c in cal.components if c.predicted > 0 and c.measured > 0]
    labels = [f"{c.name}\n{_stage(c.stage)}" for c in comps]
    ratios = [c.predicted / c.measured for c in comps]
    fig, ax = plt.subplots(figsize=(max(6, 1.0 * len(comps)), 3.8))
    xs = list(range(len(comps)))
    colors = ["tab:green" if abs(r - 1) <= 0.25 else "tab:red" for r in ratios]
    ax.bar(xs, ratios, 0.6, color=colors)
    ax.axhspan(0.75, 1.25, color="green", alpha=0.08, label="within 25%")
    ax.axhline(1.0, color="gray", lw=0.8)
    for x, c, r in zip(xs, comps, ratios, strict=True):
        ax.annotate(f"{_pct(c.error)}%", (x, r), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("predicted / measured")
    ax.set_title(f"piper calibrate: predicted vs measured ({cal.steps_used} steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
