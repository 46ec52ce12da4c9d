"""What the plots show, read from their matplotlib figures (not pixels): `piper plan`'s
memory.png, time.png and timeline.png, `piper migrate`'s imbalance.png and load_heatmap.png.
(calibration.png: tests/planner/calibrate/test_run_settings.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from matplotlib.colors import to_hex

from planner.migration.plots import heatmap_figure, imbalance_figure
from planner.migration.run import PolicyRun
from planner.migration.trace import Trace
from planner.outputs import plots

# The 13 time components of a tp=2 MoE plan, as the resource model names them.
COMPONENTS = ("a2a_leaf", "attn_core", "attn_proj", "dense_mlp", "elementwise", "experts", "head",
              "optimizer", "p2p_node", "recompute", "router", "shared", "tp_leaf")  # fmt: skip


def _estimate(stages: int = 3) -> SimpleNamespace:
    """The fields of an EstimateView the plan's plots read: 13 time and 4 memory components."""
    times = tuple((n, tuple(1e-3 * (i + 1) for _ in range(stages))) for i, n in
                  enumerate(COMPONENTS))  # fmt: skip
    memory = tuple((n, (1.0,) * stages) for n in ("weights", "grads", "optimizer", "activations"))
    return SimpleNamespace(
        memory_gib_per_stage=(4.0,) * stages, memory_gib_SC=memory, time_s_SC=times,
        stage_time_s=(0.09,) * stages, device_memory_gib=8.0, usable_memory_gib=7.0,
    )  # fmt: skip


def _bar_colours(ax) -> dict[str, str]:
    """Legend label -> colour of its bars (one BarContainer per stacked component)."""
    return {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in ax.containers}


def test_every_time_component_has_its_own_colour():
    (ax,) = plots.time_figure(_estimate(), "t").axes
    colours = _bar_colours(ax)
    assert set(colours) == set(COMPONENTS)
    assert len(set(colours.values())) == len(COMPONENTS) == 13  # a2a_leaf and router differ


def test_stacked_legend_reads_top_of_the_stack_first():
    (ax,) = plots.time_figure(_estimate(), "t").axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == list(COMPONENTS)[::-1]


def test_memory_plot_has_distinct_colours_and_the_capacity_line():
    (ax,) = plots.memory_figure(_estimate(), "m").axes
    assert len(set(_bar_colours(ax).values())) == 4
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [8.0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["capacity", "activations", "optimizer", "grads", "weights"]


def test_axes_write_thousands_with_separators():
    est = _estimate(stages=1)
    est.time_s_SC = (("experts", (3.2,)),)  # 3,200 ms
    (ax,) = plots.time_figure(est, "t").axes
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "3,000" in labels and not any("e+" in x for x in labels)


def test_timeline_has_a_legend_and_numbered_micro_batches():
    (ax,) = plots.timeline_figure((0.03, 0.03), 2, "one step").axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["forward", "backward"]
    assert sorted(t.get_text() for t in ax.texts) == ["0"] * 4 + ["1"] * 4  # 2 stages x F, B
    assert ax.get_ylabel() == "pipeline stage"


def _runs() -> tuple[PolicyRun, PolicyRun, Trace]:
    """Two policies over 3 intervals of one layer, 4 experts on 2 EP ranks."""
    tokens_ILE = np.array([[[40, 10, 30, 20]], [[10, 40, 20, 30]], [[25, 25, 25, 25]]])
    trace = Trace(tokens_ILE, (1,))
    fixed = np.broadcast_to(np.array([[0, 1], [2, 3]]), (3, 1, 2, 2)).copy()
    moved = fixed.copy()
    moved[1:, 0] = [[0, 3], [2, 1]]
    zeros = np.zeros((3, 1))
    none = PolicyRun("none", fixed, (), np.ones((3, 1)), zeros, zeros)
    piper = PolicyRun("piper", moved, (), np.full((3, 1), 1.1), zeros, zeros)
    return none, piper, trace


def test_heatmap_ticks_are_whole_ranks_and_intervals_labelled_once():
    none, piper, trace = _runs()
    fig = heatmap_figure(none, piper, trace)
    fig.canvas.draw()
    left, right = fig.axes[:2]
    ranks = [t.get_text() for t in left.get_yticklabels()]
    assert ranks == ["0", "1"]  # not -0.50 ... 1.50
    for ax in (left, right):
        intervals = [t.get_text() for t in ax.get_xticklabels()]
        assert intervals == ["0", "1", "2"]
        assert all(float(y).is_integer() for y in ax.get_yticks())
    # one "EP rank" label, on the left panel: the right one's would overlap the left's ticks
    assert left.get_ylabel() == "EP rank" and right.get_ylabel() == ""


def test_imbalance_lines_differ_in_style_and_ticks_are_whole_intervals():
    none, piper, _ = _runs()
    fig = imbalance_figure({"none": none, "piper": piper})
    fig.canvas.draw()
    (ax,) = fig.axes
    styles = {(line.get_linestyle(), line.get_marker()) for line in ax.get_lines()}
    assert len(styles) == 2
    assert all(t.get_text().isdigit() for t in ax.get_xticklabels())
