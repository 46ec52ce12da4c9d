"""A profile that does not describe the runs' machine is refused, not bent to fit them
(planner/calibrate/applies.py), and no interval is wider than the uncalibrated model's."""

from __future__ import annotations

import json
import math

import pytest

from planner.calibrate.applies import FAR_FACTOR, StartResidual, does_not_apply
from planner.calibrate.compare import estimate_plan
from planner.calibrate.fit import fit_error
from planner.calibrate.uncertainty import (
    DEFAULT_TIME_LOG_SD,
    describe_source,
    intervals,
    quantile,
)
from planner.inputs.clusters import load_cluster
from tests.hardening_cli import run_piper
from tests.planner.calibrate.synthetic import with_calibration
from tests.planner.calibrate.test_compare import RANKS, metrics_lines, tiny_plan

Q99 = quantile(0.99, 20)


def _start(*ratios: float, sd: float = 0.3) -> list[StartResidual]:
    return [StartResidual(f"run{i}", math.log(r), sd) for i, r in enumerate(ratios)]


def _err(*ratios: float):
    return fit_error([f"run{i}" for i in range(len(ratios))], list(ratios), [1.0] * len(ratios))


def test_every_run_far_beyond_its_interval_is_refused():
    beyond = math.exp(Q99 * 0.3) * FAR_FACTOR * 1.1  # x2.2 past the 99% interval's end
    reason = does_not_apply(_start(beyond, beyond * 3), 20, 1, _err(1.0, 1.0), None)
    assert reason.startswith("every run lies beyond its 99% interval by more than x2")
    # one such run is an outlier, not the profile
    assert does_not_apply(_start(beyond, 1.1), 20, 1, _err(1.0, 1.0), None) == ""


def test_a_fit_that_moves_nothing_while_a_run_is_outside_is_refused():
    outside = math.exp(Q99 * 0.3) * 1.2
    reason = does_not_apply(_start(outside, 1.0), 20, 0, _err(outside, 1.0), None)
    assert reason.startswith("the fit moved no constant while run0 lies outside")
    assert does_not_apply(_start(1.1, 0.95), 20, 0, _err(1.1, 0.95), None) == ""


def test_runs_left_out_predicted_more_than_twice_off_are_refused():
    reason = does_not_apply(_start(1.5, 1.8), 20, 1, _err(1.0, 1.0), _err(2.5, 2.3))
    assert "each left out of the fit made on the others, are predicted x2.4 off" in reason
    assert does_not_apply(_start(1.5, 1.8), 20, 1, _err(1.0, 1.0), _err(1.6, 1.4)) == ""


def _runs(tmp_path, factors):
    """plan.json and piper run metrics measuring tokens/s `factors` below the model's."""
    made = tiny_plan()
    plan = tmp_path / "plan.json"
    plan.write_text(made.to_json())
    tokens_s = 512 / estimate_plan(made).step_time_s  # metrics_lines logs 256 tokens a step
    pairs = []
    for k, f in enumerate(factors):
        metrics = tmp_path / f"m{k}.jsonl"
        rows = metrics_lines([(256 / (tokens_s / f), 0.2, 0.2, RANKS)] * 3)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pairs += ["--run", f"{plan}:{metrics}"]
    return pairs


def test_runs_far_slower_than_the_profile_stop_the_fit_in_one_line(tmp_path):
    out = tmp_path / "fitted.yaml"
    result = run_piper(["calibrate", "--fit", "--cluster", "cpu-gloo", "--out", str(out),
                        *_runs(tmp_path, (8.7, 24.5))])  # fmt: skip
    assert result.code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not describe the machine these runs came from" in lines[0]
    assert "piper profile" in lines[0] and "no fitted profile written" in lines[0]
    assert not out.exists()


def test_runs_near_the_profile_still_fit(tmp_path):
    out = tmp_path / "fitted.yaml"
    result = run_piper(["calibrate", "--fit", "--cluster", "cpu-gloo", "--out", str(out),
                        *_runs(tmp_path, (1.3, 1.5))])  # fmt: skip
    assert result.code == 0, result.stderr
    assert load_cluster(str(out)).name == "cpu-gloo-fitted"


@pytest.mark.parametrize("loo", [0.9, 2.5])
def test_no_interval_is_wider_than_the_uncalibrated_models(loo):
    cluster = with_calibration(load_cluster("cpu-gloo"), loo_rms_log=loo, runs=2)
    est = estimate_plan(tiny_plan())
    ivs = intervals(cluster, est)
    widest = math.exp(quantile(0.8, None) * DEFAULT_TIME_LOG_SD)
    assert ivs.tokens_per_s.hi / ivs.tokens_per_s.mid == pytest.approx(widest, rel=1e-9)
    assert ivs.mfu.lo > 0.5 * est.mfu and ivs.mfu.hi < 1.0
    assert f"tokens/s x{1 / widest:.2f}-x{widest:.2f}" in describe_source(cluster)
