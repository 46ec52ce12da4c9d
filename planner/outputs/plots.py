"""The plots of `piper plan`, rendered to PNG bytes with matplotlib's Agg backend.

- memory.png: memory per stage, stacked by component, against usable device memory;
- time.png: time of one micro-batch per stage, stacked by component;
- timeline.png: one 1F1B step (forward = 1/3, backward = 2/3 of a stage's micro-batch time).
Each `*_figure` returns the matplotlib Figure (tests read its properties), `*_png` its bytes.
Stacked components each get their own colour (PALETTE, 40 distinct), the legend lists them
top of the stack first, and axes write numbers with thousands separators.
PNG metadata carries no date or version, so the same plan gives the same bytes.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
from matplotlib import colormaps  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from planner.numbers import number  # noqa: E402
from planner.plan.schema import Plan  # noqa: E402
from planner.search.evaluator import EstimateView  # noqa: E402

_META = {"Software": None}
# tab10's strong colours, then their light partners, then tab20b: 40 distinct colours, the
# first ten the ones readers know.
PALETTE = (
    colormaps["tab20"].colors[0::2] + colormaps["tab20"].colors[1::2] + colormaps["tab20b"].colors
)
FORWARD, BACKWARD = "tab:blue", "tab:orange"
READABLE = FuncFormatter(lambda value, _pos: number(value, 3))


def _title(fig: Figure, ax, title: str) -> None:
    """Set the axes' title, wrapped at spaces onto more lines until, after tight_layout, it
    lies inside the figure (a long model name or a note on the schedule overran the edge)."""
    canvas = FigureCanvasAgg(fig)
    words = len(title)
    while True:
        text = ax.set_title(textwrap.fill(title, words, break_long_words=False))
        fig.tight_layout()
        canvas.draw()
        box = text.get_window_extent(canvas.get_renderer())
        if (box.x0 >= 0 and box.x1 <= fig.bbox.width) or words <= 20:
            return
        words -= 5


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata=_META)
    return buf.getvalue()


def _stacked(ax, components: Sequence[tuple[str, Sequence[float]]], stages: int) -> None:
    """One bar per stage, stacked by component, each component its own PALETTE colour."""
    bottom = [0.0] * stages
    for i, (name, values) in enumerate(components):
        ax.bar(range(stages), values, bottom=bottom, label=name, color=PALETTE[i % len(PALETTE)])
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(stages))
    if stages > 16:
        ax.tick_params(axis="x", labelsize=6)
    ax.set_xlabel("pipeline stage")
    ax.yaxis.set_major_formatter(READABLE)


def _legend(ax) -> None:
    """The legend beside the axes: lines (capacity) first, then the stacked components top
    of the stack first (the order the eye reads them)."""
    lines = [(h, label) for h, label in zip(*ax.get_legend_handles_labels(), strict=True)
             if isinstance(h, Line2D)]  # fmt: skip
    bars = [(c, c.get_label()) for c in ax.containers][::-1]
    handles, labels = zip(*(lines + bars), strict=True)
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def memory_figure(est: EstimateView, title: str) -> Figure:
    """Memory per stage (GiB per device), stacked by component, and the capacity line."""
    stages = len(est.memory_gib_per_stage)
    comps = est.memory_gib_SC or (("total", est.memory_gib_per_stage),)
    fig = Figure(figsize=(8.5, 4))
    ax = fig.add_subplot()
    _stacked(ax, comps, stages)
    cap = est.device_memory_gib if est.device_memory_gib == est.device_memory_gib else None
    ax.axhline(cap or est.usable_memory_gib, color="black", linestyle="--", label="capacity")
    ax.set_ylabel("GiB per device")
    _legend(ax)
    _title(fig, ax, title)
    return fig


def memory_png(est: EstimateView, title: str) -> bytes:
    return _png(memory_figure(est, title))


def time_figure(est: EstimateView, title: str) -> Figure:
    """Time of one micro-batch per stage (ms, forward + backward), stacked by component."""
    stages = len(est.memory_gib_per_stage)
    comps = est.time_s_SC or (("total", est.stage_time_s),)
    fig = Figure(figsize=(8.5, 4))
    ax = fig.add_subplot()
    _stacked(ax, [(n, [1e3 * v for v in vals]) for n, vals in comps], stages)
    ax.set_ylabel("ms per micro-batch (fwd + bwd)")
    _legend(ax)
    _title(fig, ax, title)
    return fig


def time_png(est: EstimateView, title: str) -> bytes:
    return _png(time_figure(est, title))


@dataclass(frozen=True)
class Op:
    stage: int
    micro: int
    kind: str  # "F" | "B"
    start_s: float
    end_s: float


def one_f_one_b(stage_time_s: Sequence[float], num_microbatches: int) -> list[Op]:
    """Start/end of every forward and backward op of one 1F1B step.

    Stage s runs min(pp - 1 - s, m) warm-up forwards, then alternates forward/backward, then
    drains the backwards; an op starts when its stage is free and its input has arrived
    (F from stage s - 1, B from stage s + 1). Forward takes 1/3 of the stage time.
    """
    pp, m = len(stage_time_s), num_microbatches
    order = []
    for s in range(pp):
        warm = min(pp - 1 - s, m)
        seq = [("F", i) for i in range(warm)]
        for i in range(m - warm):
            seq += [("F", warm + i), ("B", i)]
        seq += [("B", i) for i in range(m - warm, m)]
        order.append(seq)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    ops: list[Op] = []
    while len(ops) < 2 * pp * m:
        progressed = False
        for s in range(pp):
            if pos[s] >= len(order[s]):
                continue
            kind, i = order[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" else ("B", s + 1, i)
            has_dep = (kind == "F" and s > 0) or (kind == "B" and s < pp - 1)
            if has_dep and dep not in done:
                continue
            if kind == "B" and ("F", s, i) not in done:
                continue
            start = max(free[s], done[dep] if has_dep else 0.0)
            dur = stage_time_s[s] / 3 if kind == "F" else 2 * stage_time_s[s] / 3
            done[(kind, s, i)] = free[s] = start + dur
            ops.append(Op(s, i, kind, start, start + dur))
            pos[s] += 1
            progressed = True
        if not progressed:
            raise RuntimeError("1F1B schedule deadlocked")  # cannot happen for valid inputs
    return ops


def timeline_figure(stage_time_s: Sequence[float], num_microbatches: int, title: str) -> Figure:
    """One 1F1B step: a row per stage, forward and backward ops in two colours (legend),
    micro-batch numbers on the ops when there are few."""
    ops = one_f_one_b(stage_time_s, num_microbatches)
    fig = Figure(figsize=(9, 0.5 * len(stage_time_s) + 1.8))
    ax = fig.add_subplot()
    for stage in range(len(stage_time_s)):
        for kind, color in (("F", FORWARD), ("B", BACKWARD)):
            spans = [
                (1e3 * op.start_s, 1e3 * (op.end_s - op.start_s))
                for op in ops
                if op.stage == stage and op.kind == kind
            ]
            ax.broken_barh(
                spans, (stage - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.3
            )
    if num_microbatches <= 8:
        for op in ops:
            ax.text(500 * (op.start_s + op.end_s), op.stage, str(op.micro), ha="center",
                    va="center", fontsize=7, color="white")  # fmt: skip
    ax.set_yticks(range(len(stage_time_s)))
    ax.invert_yaxis()
    ax.set_ylabel("pipeline stage")
    ax.set_xlabel("ms")
    ax.xaxis.set_major_formatter(READABLE)
    ax.legend(handles=[Patch(color=FORWARD, label="forward"),
                       Patch(color=BACKWARD, label="backward")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # fmt: skip
    _title(fig, ax, title)
    return fig


def timeline_png(stage_time_s: Sequence[float], num_microbatches: int, title: str) -> bytes:
    return _png(timeline_figure(stage_time_s, num_microbatches, title))


def render_plots(plan: Plan, est: EstimateView) -> dict[str, bytes]:
    """{file name: PNG bytes} for the chosen plan."""
    name = f"{plan.model.name} pp={plan.parallel.pp} ep={plan.parallel.ep}"
    stage_time = est.stage_time_s or tuple(0.0 for _ in est.memory_gib_per_stage)
    m = plan.parallel.num_microbatches
    shown = min(m, 32)
    what = f"one 1F1B step: {name}" + (f" ({shown} of {m} micro-batches)" if shown < m else "")
    if plan.parallel.vp > 1:
        what += f", drawn without interleaving (vp={plan.parallel.vp})"
    return {
        "memory.png": memory_png(est, f"memory per stage: {name}"),
        "time.png": time_png(est, f"time per stage: {name}"),
        "timeline.png": timeline_png(stage_time, shown, what),
    }
