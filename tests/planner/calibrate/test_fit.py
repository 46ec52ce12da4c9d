"""The fit: known constants recovered from synthetic runs, leave-one-out equal to refits by
hand, bounds kept, errors by hand, the parameter list refused when too long."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.calibrate import fit as fit_module
from planner.calibrate.fit import fit, fit_error, fit_params, from_unit, to_unit
from planner.calibrate.runs import estimate_run, parse_runs, predicted_value
from planner.specs import EFFICIENCIES, Efficiency, SpecError
from tests.planner.calibrate.synthetic import TRUTH, derived_cluster, runs_csv, truth_cluster

NAMES = tuple(TRUTH)


@pytest.fixture(scope="module")
def synthetic_runs():
    return parse_runs(runs_csv(truth_cluster()), "synthetic.csv")


def test_the_fit_recovers_known_constants(synthetic_runs):
    start = derived_cluster()
    exact = fit(synthetic_runs, start, NAMES, leave_one_out=False, prior_weight=0.0)
    for name, value in TRUTH.items():
        assert getattr(exact.fitted, name) == pytest.approx(value, rel=1e-4), name
    assert exact.before.rms_log > 0.1 and exact.after.rms_log < 1e-6
    assert exact.after.geomean == pytest.approx(1.0, abs=1e-6) and exact.after.within == 1.0
    # the default weak prior toward the start moves the answer by a few percent at most
    pulled = fit(synthetic_runs, start, NAMES, leave_one_out=False)
    for name, value in TRUTH.items():
        assert getattr(pulled.fitted, name) == pytest.approx(value, rel=0.05), name
    assert pulled.after.rms_log < 0.01 < exact.before.rms_log
    assert pulled.fitted.attention_efficiency == start.attention_efficiency  # not fitted


def test_leave_one_out_equals_refits_by_hand(synthetic_runs):
    runs = synthetic_runs[:3]
    start = derived_cluster()
    truth = truth_cluster(gemm_efficiency=0.5)
    runs = [replace(r, measured=predicted_value(r, estimate_run(r, truth)) * (1 + 0.1 * k))
            for k, r in enumerate(runs)]  # fmt: skip  # noisy: each left-out fit differs
    done = []
    result = fit(runs, start, ["gemm_efficiency"], progress=lambda d, t: done.append((d, t)))
    assert done == [(1, 3), (2, 3), (3, 3)]
    lefts = []
    for i, run in enumerate(runs):
        alone = fit(runs[:i] + runs[i + 1 :], start, ["gemm_efficiency"], leave_one_out=False)
        by_hand = predicted_value(run, estimate_run(run, alone.fitted))
        assert result.runs[i].left_out == pytest.approx(by_hand, rel=1e-12)
        lefts.append(by_hand)
    assert len({round(x, 6) for x in lefts}) == 3
    expected = fit_error([r.label for r in runs], lefts, [r.measured for r in runs])
    assert result.left_out == expected


def test_constants_stay_inside_their_bounds(synthetic_runs):
    # runs ten times faster than any constant allows: every fitted constant ends at a bound
    fast = [replace(r, measured=r.measured * 10) for r in synthetic_runs[:2]]
    start = derived_cluster()
    names = ("gemm_efficiency", "hbm_efficiency", "layer_overhead_us")
    result = fit(fast, start, names, leave_one_out=False)
    for e in fit_params(names):
        assert e.low <= getattr(result.fitted, e.name) <= e.high
    assert result.fitted.gemm_efficiency == pytest.approx(0.95)
    assert result.fitted.layer_overhead_us == pytest.approx(0.0, abs=1e-6)
    assert result.after.rms_log < result.before.rms_log


def test_errors_by_hand():
    e = fit_error(["a", "b", "c"], [1.1, 0.8, 1.0], [1.0, 1.0, 1.0])
    assert e.geomean == pytest.approx((1.1 * 0.8) ** (1 / 3))
    assert e.within == pytest.approx(2 / 3) and (e.worst, e.worst_ratio) == ("b", 0.8)
    assert e.rms_log == pytest.approx(math.sqrt((math.log(1.1) ** 2 + math.log(0.8) ** 2) / 3))


def test_unit_coordinates_span_the_bounds_and_log_entries_use_log_space():
    lin = Efficiency("x", 0.2, 1.0, "")
    log = Efficiency("y", 8.0, 4096.0, "", log=True)
    assert to_unit(lin, 0.6) == pytest.approx(0.5) and from_unit(lin, 0.5) == pytest.approx(0.6)
    assert from_unit(log, 0.5) == pytest.approx(math.sqrt(8 * 4096))
    assert to_unit(log, 8 * 4096**0.5 / 8**0.5) == pytest.approx(0.5)
    assert to_unit(lin, 5.0) == 1.0 and from_unit(log, -1) == 8.0  # clipped


def test_parameter_lists():
    assert [e.name for e in fit_params(None)] == [e.name for e in EFFICIENCIES]
    assert [e.name for e in fit_params(["hbm_efficiency"])] == ["hbm_efficiency"]
    with pytest.raises(SpecError, match="--params: 'gemm' is not a constant"):
        fit_params(["gemm"])
    with pytest.raises(SpecError, match="list each constant once"):
        fit_params(["hbm_efficiency", "hbm_efficiency"])


def test_more_than_eight_constants_are_refused(monkeypatch):
    many = tuple(Efficiency(f"c{i}", 0.1, 1.0, "") for i in range(9))
    monkeypatch.setattr(fit_module, "EFFICIENCIES", many)
    with pytest.raises(SpecError, match="9 constants; fit at most 8"):
        fit_params(None)
    assert len(fit_params([f"c{i}" for i in range(8)])) == 8
