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


def imbalance_png(runs: Mapping[str, PolicyRun]) -> bytes:
    """Realized imbalance per interval, mean over layers, one line per policy."""
    fig, (ax,) = _figure(7, 4)
    for name, run in runs.items():
        values_I = run.imbalance_IL.mean(axis=1)
        ax.plot(np.arange(len(values_I)), values_I, marker=".", label=LABELS.get(name, name))
    ax.set_xlabel("interval")
    ax.set_ylabel("max rank load / mean (realized)")
    ax.set_title("Expert-parallel load imbalance per interval")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _png(fig)


def _rank_load_RI(run: PolicyRun, trace: Trace, lj: int) -> np.ndarray:
    cols = []
    for t in range(trace.num_intervals):
        load_E = trace.tokens_ILE[t, lj].astype(float)
        loads_R = rank_loads(run.slots_ILRS[t, lj], load_E)
        cols.append(loads_R / max(loads_R.mean(), 1e-300))
    return np.stack(cols, axis=1)


def heatmap_png(before: PolicyRun, after: PolicyRun, trace: Trace) -> bytes:
    """Rank load / mean per interval for the first layer: before (no migration) and after."""
    fig, axes = _figure(11, 4, cols=2)
    grids = [_rank_load_RI(before, trace, 0), _rank_load_RI(after, trace, 0)]
    vmax = max(float(g.max()) for g in grids)
    image = None
    for ax, grid, run in zip(axes, grids, (before, after), strict=True):
        image = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax)
        ax.set_xlabel("interval")
        ax.set_ylabel("EP rank")
        ax.set_title(f"{LABELS.get(run.name, run.name)}, layer {trace.layer_ids[0]}")
    fig.colorbar(image, ax=axes, label="rank load / mean")
    return _png(fig)
