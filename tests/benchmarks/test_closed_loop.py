"""benchmarks/closed_loop.py in small: profile this machine, plan a shortlist of 2 on that
profile, run both layouts, and report each prediction beside its measurement; the verdicts are
computed from the printed figures (the thresholds are the benchmark's, the figures this
machine's)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import closed_loop as cl  # noqa: E402


def test_verdicts_on_hand_made_trials():
    fast = cl.Trial("1-a", predicted=100.0, lo=80.0, hi=125.0, measured=95.0, without_host=300.0)
    slow = cl.Trial("2-b", predicted=90.0, lo=72.0, hi=112.0, measured=120.0, without_host=250.0)
    (_, ok_within, _), (_, ok_pick, figure) = cl.verdicts([fast, slow])
    assert not ok_within  # 90 / 120 = 0.75 lies outside +-20%
    assert abs(slow.ratio - 0.75) < 1e-12 and abs(fast.ratio - 100 / 95) < 1e-12
    assert ok_pick and "fastest 2-b" in figure  # 120 lies inside the pick's [80, 125]
    outside = cl.Trial("2-b", predicted=90.0, lo=72.0, hi=112.0, measured=130.0, without_host=250.0)
    assert not cl.verdicts([fast, outside])[1][1]
    assert cl.verdicts([fast])[0][1]


@pytest.mark.slow
def test_the_loop_runs_in_small(tmp_path, capsys):
    args = argparse.Namespace(nproc=2, shortlist=2, steps=3, model="tiny-moe", seq_len=64,
                              global_batch=8)  # fmt: skip
    trials = cl.closed_loop(args, tmp_path)
    assert len(trials) == 2 and trials[0].name.startswith("1-")
    for t in trials:
        assert t.measured > 0 and math.isfinite(t.ratio) and t.lo is not None and t.lo < t.hi
        assert t.without_host > t.predicted  # the measured host time slows every layout
    profile = (tmp_path / "profile.yaml").read_text()
    assert "layer_host" in profile  # the profile measured this machine's host time per layer
    cl.report(trials)
    out = capsys.readouterr().out
    assert out.count("pass") + out.count("FAIL") == 2 and trials[1].name in out
