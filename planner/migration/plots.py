"""The two plots of `piper migrate`, rendered to PNG bytes (deterministic: no metadata).

- imbalance.png: realized imbalance per interval (mean over layers), one line per policy.
- load_heatmap.png: rank load / mean rank load per interval for the first trace layer,
  without migration (before) and under Piper (after).
Shape letters: I intervals, L layers, R ranks.
"""

from __future__ import annotations

import io
from collections.abc import Mapping

import numpy as np

from planner.migration.placement import rank_loads
from planner.migration.report import LABELS
from planner.migration.run import PolicyRun
from planner.migration.trace import Trace


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    return buf.getvalue()


def _figure(width: float, height: float, cols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    axes = [fig.add_subplot(1, cols, i + 1) for i in range(cols)]
    return fig, axes


# Policies often coincide (greedy swap and Piper on a calm trace): each line has its own
# style and marker, so a line drawn over another still shows.
STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D")


def _integer_ticks(axis, count: int | None = None) -> None:
    """Ticks at whole numbers only (intervals, ranks), written without decimals: every one of
    `count` when there are at most 16, else as many as fit."""
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, MaxNLocator

    small = count is not None and count <= 16
    axis.set_major_locator(FixedLocator(range(count)) if small else MaxNLocator(integer=True))
    axis.set_major_formatter(FormatStrFormatter("%d"))


def imbalance_figure(runs: Mapping[str, PolicyRun]):
    """Realized imbalance per interval, mean over layers, one line per policy."""
    fig, (ax,) = _figure(7, 4)
    for i, (name, run) in enumerate(runs.items()):
        values_I = run.imbalance_IL.mean(axis=1)
        ax.plot(np.arange(len(values_I)), values_I, label=LABELS.get(name, name),
                linestyle=STYLES[i % len(STYLES)], marker=MARKERS[i % len(MARKERS)],
                markersize=4, alpha=0.85)  # fmt: skip
    _integer_ticks(ax.xaxis, max((len(r.imbalance_IL) for r in runs.values()), default=0))
    ax.set_xlabel("interval")
    ax.set_ylabel("max rank load / mean (realized)")
    ax.set_title("Expert-parallel load imbalance per interval")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def imbalance_png(runs: Mapping[str, PolicyRun]) -> bytes:
    return _png(imbalance_figure(runs))


def _rank_load_RI(run: PolicyRun, trace: Trace, lj: int) -> np.ndarray:
    cols = []
    for t in range(trace.num_intervals):
        load_E = trace.tokens_ILE[t, lj].astype(float)
        loads_R = rank_loads(run.slots_ILRS[t, lj], load_E)
        cols.append(loads_R / max(loads_R.mean(), 1e-300))
    return np.stack(cols, axis=1)


def heatmap_figure(before: PolicyRun, after: PolicyRun, trace: Trace):
    """Rank load / mean per interval for the first layer: before (no migration) and after,
    side by side on shared axes (whole-number ticks; the rank label once, on the left)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    grids = [_rank_load_RI(before, trace, 0), _rank_load_RI(after, trace, 0)]
    vmax = max(float(g.max()) for g in grids)
    image = None
    for ax, grid, run in zip(axes, grids, (before, after), strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax,
                          interpolation="nearest")  # fmt: skip
        _integer_ticks(ax.xaxis, grid.shape[1])
        _integer_ticks(ax.yaxis, grid.shape[0])
        ax.set_xlabel("interval")
        ax.set_title(f"{LABELS.get(run.name, run.name)}, layer {trace.layer_ids[0]}")
    axes[0].set_ylabel("EP rank")
    fig.colorbar(image, ax=list(axes), label="rank load / mean")
    return fig


def heatmap_png(before: PolicyRun, after: PolicyRun, trace: Trace) -> bytes:
    return _png(heatmap_figure(before, after, trace))
