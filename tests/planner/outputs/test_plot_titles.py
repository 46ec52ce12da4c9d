"""The plots' titles lie inside their figures (timeline.png's ran past both edges)."""

from __future__ import annotations

from matplotlib.backends.backend_agg import FigureCanvasAgg

from planner.outputs.plots import timeline_figure

LONG = ("one 1F1B step: deepseek-v3-nomtp pp=16 ep=64 (32 of 128 micro-batches), drawn "
        "without interleaving (vp=4)")  # fmt: skip


def test_a_long_timeline_title_is_wrapped_inside_the_figure():
    fig = timeline_figure([0.2, 0.25, 0.25, 0.3], 32, LONG)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    title = fig.axes[0].title
    box = title.get_window_extent(canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height
    assert " ".join(title.get_text().split()) == LONG  # every word kept, on more lines
    assert "\n" in title.get_text()
