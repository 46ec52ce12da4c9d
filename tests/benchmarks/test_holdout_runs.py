"""benchmarks/holdout_runs.py: the held-out file loads and is disjoint from the calibration
rows, and the summary's geomean, share within +-15%, worst row and group Spearman match
hand-computed values on a tiny input."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import holdout_runs as hr  # noqa: E402

from planner.calibrate.runs import load_runs  # noqa: E402

KEY = ("model", "hardware", "gpus", "precision", "seq", "gbs", "mbs", "tp", "pp", "vp", "cp",
       "ep", "etp", "measured_tokens_per_s_per_gpu", "measured_tflops_per_gpu")  # fmt: skip


def test_holdout_file_loads_and_holds_no_calibration_row():
    runs = load_runs(hr.RUNS)
    assert len(runs) == 36
    assert [int(r.field("id")) for r in runs] == list(range(101, 137))
    full = [r for r in runs if r.cuda_graphs == "full"]
    assert [int(r.field("id")) for r in full] == list(range(129, 137))
    assert all(r.training.a2a_overlap and r.training.dtype == "mxfp8" for r in full)
    assert {r.hardware for r in runs} == set(hr.CLUSTERS)
    calibration = load_runs(ROOT / "profiles" / "runs" / "published_runs.csv")
    fitted = {tuple(r.field(k) for k in KEY) for r in calibration}
    assert not [r.label for r in runs if tuple(r.field(k) for k in KEY) in fitted]
    assert len({r.field("id") for r in runs}) == len(runs)


def _point(label, hw, prec, predicted, measured, model="m", gpus=8):
    return hr.Point(label, model, hw, gpus, prec, predicted, measured)


def test_summary_by_hand():
    points = [
        _point("a", "H100", "BF16", 110, 100),  # 1.10, within
        _point("b", "H100", "FP8", 80, 100),  # 0.80, outside
        _point("c", "GB200", "BF16", 200, 100),  # 2.00, outside, the worst
        _point("d", "GB200", "FP8", 50, 50),  # 1.00, within
    ]
    s = hr.summary(points)
    assert s["all"].n == 4
    assert s["all"].geomean == pytest.approx((1.1 * 0.8 * 2.0 * 1.0) ** 0.25)
    assert s["all"].within == pytest.approx(0.5)
    assert (s["all"].worst, s["all"].worst_ratio) == ("c", pytest.approx(2.0))
    assert s["H100"].geomean == pytest.approx(math.sqrt(1.1 * 0.8))
    assert (s["H100"].worst, s["H100"].within) == ("b", 0.5)
    assert (s["GB200"].worst, s["GB200"].within) == ("c", 0.5)
    assert s["BF16"].geomean == pytest.approx(math.sqrt(2.2))
    assert s["FP8"].worst == "b"
    assert set(s) == {"all", "H100", "GB200", "BF16", "FP8"}


def test_group_spearman_by_hand():
    points = [
        # group x: predicted ranks (1, 2, 3, 4) vs measured ranks (2, 1, 4, 3) -> 0.6
        _point("1", "H100", "BF16", 1, 20, model="x"),
        _point("2", "H100", "BF16", 2, 10, model="x"),
        _point("3", "H100", "BF16", 3, 40, model="x"),
        _point("4", "H100", "BF16", 4, 30, model="x"),
        # group y: two rows, below the minimum
        _point("5", "H100", "BF16", 1, 1, model="y"),
        _point("6", "H100", "BF16", 2, 2, model="y"),
        # group z: every prediction ties -> nan
        _point("7", "GB200", "FP8", 5, 1, model="z"),
        _point("8", "GB200", "FP8", 5, 2, model="z"),
        _point("9", "GB200", "FP8", 5, 3, model="z"),
    ]
    groups = hr.group_spearman(points)
    assert [g[0] for g in groups] == [("x", "H100", 8), ("z", "GB200", 8)]
    assert groups[0][1] == ["1", "2", "3", "4"]
    assert groups[0][2] == pytest.approx(0.6)
    assert math.isnan(groups[1][2])


def test_same_stack_groups_and_release_spread_by_hand():
    def pt(label, release, layout, measured, model="x"):
        return hr.Point(label, model, "H100", 16, "FP8", 1.0, measured, release, layout)

    points = [
        pt("1", "26.04", "tp1", 100),
        pt("2", "26.04", "tp2", 80),  # 26.04 holds two layouts: a same-stack group
        pt("3", "26.02", "tp1", 50),  # tp1 under 26.04 and 26.02: spread 100 / 50
        pt("4", "26.02", "tp1", 60, model="y"),  # one layout, one release: neither
    ]
    stacks = hr.same_stack_groups(points)
    assert [(k, [p.label for p in m]) for k, m in stacks] == [
        (("x", "H100", 16, "26.04"), ["1", "2"])
    ]
    spread = hr.release_spread(points)
    assert [(k, [p.label for p in m], s) for k, m, s in spread] == [
        (("x", "H100", 16), ["1", "3"], pytest.approx(2.0))
    ]


def test_target_share_counts_rows_within_twenty_percent():
    ratios = (1.0, 1.18, 0.83, 0.79, 1.5)  # within 15%: 1 row; within 20%: 3 rows
    s = hr.stats([_point(str(i), "H100", "BF16", 100 * r, 100) for i, r in enumerate(ratios)])
    assert (s.within, s.within_target) == (pytest.approx(0.2), pytest.approx(0.6))
    assert hr.TARGET_WITHIN == 0.20 and s.within_target >= hr.TARGET_SHARE
