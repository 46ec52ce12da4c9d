"""sizes.png: days and cost against GPUs, one line per cluster, the interval as a band.

Rendered with matplotlib's Agg backend as planner/outputs/plots.py renders the plan's plots:
no date or version in the PNG, so the same report gives the same bytes. The cost panel shows
cost in USD when every planned row is priced, else GPU-hours. The deadline, when given, is a
dashed line on the days panel; Pareto points are ringed.
"""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402

from planner.numbers import number  # noqa: E402
from planner.size.rows import pareto_axis  # noqa: E402
from planner.size.sweep import SizeReport  # noqa: E402

READABLE = FuncFormatter(lambda value, _pos: number(value, 3))


def sizes_figure(report: SizeReport) -> Figure:
    """The two panels (days, cost or GPU-hours) against GPUs, log-log."""
    fig = Figure(figsize=(10, 4.2))
    days_ax, cost_ax = fig.subplots(1, 2)
    axis = pareto_axis(report.rows)
    for k, note in enumerate(report.clusters):
        rows = [r for r in report.rows if r.cluster == note.cluster and r.planned]
        if not rows:
            continue
        color = f"C{k % 10}"
        gpus = [r.gpus for r in rows]
        money = [r.cost_usd if axis == "cost" else r.gpu_hours for r in rows]
        panels = ((days_ax, [r.days for r in rows], 1.0), (cost_ax, money, 1e-6))
        for ax, ivs, scale in panels:
            mids = [iv.mid * scale for iv in ivs]
            ax.plot(gpus, mids, "o-", color=color, label=note.cluster)
            lo, hi = [iv.lo * scale for iv in ivs], [iv.hi * scale for iv in ivs]
            ax.fill_between(gpus, lo, hi, color=color, alpha=0.18, linewidth=0)
            best = [(g, y) for g, y, r in zip(gpus, mids, rows, strict=True) if r.pareto]
            if best:
                ax.scatter(*zip(*best, strict=True), s=120, facecolors="none", edgecolors="k")
    if report.request.deadline_s is not None:
        days_ax.axhline(
            report.request.deadline_s / 86400.0, color="k", ls="--", lw=1, label="deadline"
        )
    level = next((r.days.level for r in report.rows if r.days is not None), 0.8)
    days_ax.set_ylabel("days to train (with failures)")
    cost_ax.set_ylabel("cost (USD millions)" if axis == "cost" else "GPU-hours (millions)")
    for ax in (days_ax, cost_ax):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.xaxis.set_major_formatter(READABLE)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(READABLE)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="major", alpha=0.3)
    days_ax.legend(fontsize=8)
    tokens = number(report.request.tokens / 1e12, 4)
    fig.suptitle(
        f"{report.model}, {tokens}T tokens: estimate and {level:.0%} band; ringed: Pareto set"
    )
    fig.tight_layout()
    return fig


def sizes_png(report: SizeReport) -> bytes:
    """sizes_figure as PNG bytes (no metadata that changes between runs)."""
    buf = io.BytesIO()
    sizes_figure(report).savefig(buf, format="png", dpi=80, metadata={"Software": None})
    return buf.getvalue()
