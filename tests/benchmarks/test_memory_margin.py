"""benchmarks/memory_margin.py: the margin derivation on synthetic rows (coverage, rounding,
the default set), the rejection count, and the runs file loading with its engine settings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_margin as mm  # noqa: E402


def _p(label, predicted, measured, device=100.0, current=True, gap=""):
    return mm.Point(label, predicted, measured, device, current=current, gap=gap)


def test_errors_and_shortfall():
    p = _p("a", 70.0, 73.0, device=80.0)
    assert p.error_gib == pytest.approx(-3.0)
    assert p.error_pct_device == pytest.approx(-3.75)
    assert p.error_pct_measured == pytest.approx(-300 / 73)
    assert p.shortfall_pct == pytest.approx(3.75)
    assert _p("b", 75.0, 73.0).shortfall_pct == 0.0  # over-predicted: no shortfall


def test_covering_margin_worst_row_rounded_up():
    points = [
        _p("over", 60, 50),  # shortfall 0
        _p("small", 50, 51.2),  # 1.2 % of 100 GiB
        _p("worst", 50, 53.01),  # 3.01 %
        _p("other device", 40, 42, device=200),  # 1 %
    ]
    assert mm.covering_margin(points) == 4.0  # 3.01 -> 4
    assert mm.covering_margin(points, step=0.5) == 3.5
    assert mm.covered(points, 4.0) == 4
    assert mm.covered(points, 3.0) == 3  # the worst row is left out
    assert mm.covering_margin([_p("exact", 50, 53)]) == 3.0  # no rounding up of 3.0 itself
    assert mm.covering_margin([_p("x", 60, 50), _p("y", 55, 55)]) == 0.0


def test_covering_margin_quantile_is_nearest_rank():
    # shortfalls 1..10 %: 90 % coverage = the 9th smallest, 50 % = the 5th
    points = [_p(str(i), 50, 50 + i) for i in range(1, 11)]
    assert mm.covering_margin(points, 1.0) == 10.0
    assert mm.covering_margin(points, 0.9) == 9.0
    assert mm.covering_margin(points, 0.5) == 5.0
    assert mm.covered(points, 9.0) == 9
    with pytest.raises(ValueError):
        mm.covering_margin([], 1.0)
    with pytest.raises(ValueError):
        mm.covering_margin(points, 0.0)


def test_default_set_leaves_out_old_engines_and_named_gaps():
    points = [
        _p("current", 50, 52.5),  # 2.5 %
        _p("old engine", 50, 70, current=False),  # 20 %, not in the set
        _p("named gap", 40, 80, gap="loss_logits_copies"),  # 40 %, a model fix
        _p("over", 60, 50),
    ]
    assert [p.label for p in mm.default_set(points)] == ["current", "over"]
    assert mm.default_margin(points) == 3.0
    with pytest.raises(ValueError):
        mm.default_margin([_p("only old", 50, 60, current=False)])


def test_rejected_counts_rooms_below_the_margin():
    rooms = [-3.7, 4.3, 4.3, 7.9, 10.7]
    assert mm.rejected(rooms, 0.0) == 1
    assert mm.rejected(rooms, 4.0) == 1
    assert mm.rejected(rooms, 4.3) == 1  # room equal to the margin still fits
    assert mm.rejected(rooms, 5.0) == 3
    assert mm.rejected(rooms, 20.0) == 5


def test_runs_file_loads_with_engine_conventions(tmp_path):
    rows = mm.load_rows(mm.RUNS, tmp_path)
    assert len(rows) >= 8
    ids = [row["id"] for row, _ in rows]
    assert len(set(ids)) == len(ids)
    for row, run in rows:
        assert row["source"] and row["measured_peak_gib"]
        assert row["peak_kind"] in mm.PEAK_KINDS and row["peak_rank"] in mm.PEAK_RANKS
        assert run.hardware in mm.CLUSTERS
        if row["engine"] == "torchtitan":
            t = run.training
            assert t.fsdp and not t.zero and t.bytes_per_param == 16
            assert not t.gate_in_activation
        else:
            assert run.training.zero and run.training.bytes_per_param == 18
        if row["split"] == "even":
            sizes = [len(s) for s in run.stage_layers]
            assert max(sizes) - min(sizes) <= 1
    by_id = {row["id"]: run for row, run in rows}
    assert by_id["207"].model.num_layers == 80  # llama3-8b with the 70B overrides
    assert by_id["232"].model.vocab_size == 256000
