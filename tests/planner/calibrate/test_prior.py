"""The regularised fit (planner/calibrate/prior.py): only identifiable constants move, the
fitted values solve the stated objective, memory fits framework_overhead_gib, and the profile
records the runs, the priors, the fitted values and the leave-one-out error."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.calibrate.fit import fit
from planner.calibrate.memory_fit import MEMORY_SIGMA_GIB, MEMORY_WIDTH_GIB
from planner.calibrate.prior import SHRINK, fit_with_prior, warning_line
from planner.calibrate.prior_report import prior_profile_yaml, prior_tables
from planner.calibrate.runs import estimate_run, parse_runs, predicted_value
from planner.inputs.clusters import cluster_from_dict
from planner.specs import EFFICIENCIES
from tests.planner.calibrate.synthetic import (
    LAYOUTS,
    derived_cluster,
    runs_csv,
    truth_cluster,
    with_calibration,
)


@pytest.fixture(scope="module")
def runs():
    return parse_runs(runs_csv(truth_cluster(), LAYOUTS[:3]))


def test_one_run_and_eight_constants_fit_at_most_one_and_warn(runs):
    result = fit_with_prior(runs[:1], derived_cluster(), leave_one_out=False)
    kept = result.selection.kept
    assert len(kept) <= 1
    assert all(ratio <= SHRINK for _, ratio in result.selection.shrink)
    line = warning_line(result)
    head = (
        f"warning: 1 run(s) for 8 constant(s): fitting {kept[0] if kept else 'nothing'}; kept at "
    )
    assert line.startswith(head)
    assert len(result.selection.dropped) == 8 - len(kept)
    for e in EFFICIENCIES:  # every other constant stays at the preset
        if e.name not in kept:
            assert getattr(result.fitted, e.name) == getattr(derived_cluster(), e.name)
    # the unregularised fit moves more than one constant on the same single run
    old = fit(runs[:1], derived_cluster(), leave_one_out=False).fitted
    moved = [e.name for e in EFFICIENCIES
             if getattr(old, e.name) != getattr(derived_cluster(), e.name)]  # fmt: skip
    assert len(moved) > 1


def test_what_no_run_sees_or_repeats_another_is_kept(runs):
    # dp 1 (tp 2 x pp 8 on 16 GPUs): no data-parallel reduction and no A2A overlap, so
    # nothing the schedule overlaps depends on overlap_efficiency (the DP reduction of the
    # other layouts hides behind the last backward: RESOURCE_MODEL.md, data-parallel overlap)
    alone = parse_runs(runs_csv(truth_cluster(), [(16, 4096, 64, 1, 2, 8, 1, 1, 2, 1, "none")]))
    result = fit_with_prior(alone, derived_cluster(), leave_one_out=False)
    why = dict(result.selection.dropped)
    assert dict(result.selection.elasticity)["overlap_efficiency"] == 0.0
    assert why["overlap_efficiency"].startswith("no run's prediction moves with it")
    twice = [runs[0], replace(runs[0], label="again")]  # the same layout: one direction
    sure = with_calibration(derived_cluster(), loo_rms_log=0.02)  # runs that pin a direction
    same = fit_with_prior(twice, sure, ["gemm_efficiency", "attention_efficiency"],
                          leave_one_out=False)  # fmt: skip
    assert same.selection.kept == ("gemm_efficiency",)
    # with gemm_efficiency's prior spread in its noise, the one direction leaves it unknown
    assert "shrink its sd only to" in dict(same.selection.dropped)["attention_efficiency"]


def _objective(result, runs, gemm: float) -> float:
    cluster = replace(result.fitted, gemm_efficiency=gemm)
    prior, noise = result.priors[0], result.likelihood
    data = sum(
        noise.psi(math.log(predicted_value(r, estimate_run(r, cluster)) / r.measured) / noise.sigma)
        ** 2
        for r in runs
    )
    return data + ((math.log(gemm) - math.log(prior.value)) / prior.width) ** 2


def test_the_fit_solves_the_regularised_objective(runs):
    result = fit_with_prior(runs, derived_cluster(), ["gemm_efficiency"], leave_one_out=False)
    gemm = result.fitted.gemm_efficiency
    best = _objective(result, runs, gemm)
    assert best <= _objective(result, runs, gemm * 1.01)
    assert best <= _objective(result, runs, gemm * 0.99)
    # the prior holds it between the preset and the unregularised fit's value
    free = fit(runs, derived_cluster(), ["gemm_efficiency"], leave_one_out=False)
    assert free.fitted.gemm_efficiency < gemm < derived_cluster().gemm_efficiency


def test_measured_peaks_fit_the_framework_overhead(runs):
    start = derived_cluster()
    predicted = [max(estimate_run(r, start).memory_gib_per_stage) for r in runs]
    measured = [replace(r, measured_peak_gib=p + 3.0) for r, p in zip(runs, predicted, strict=True)]
    result = fit_with_prior(measured, start, ["gemm_efficiency"], leave_one_out=False)
    n = len(runs)
    shrink = n + (MEMORY_SIGMA_GIB / MEMORY_WIDTH_GIB) ** 2
    expected = start.framework_overhead_gib + 3.0 * n / shrink
    assert result.memory is not None and result.memory.runs == 3
    assert result.fitted.framework_overhead_gib == pytest.approx(expected)
    assert result.memory.mean_error_before_gib == pytest.approx(-3.0)
    assert abs(result.memory.mean_error_after_gib) < 0.1
    assert result.runs[0].peak_gib == pytest.approx(
        predicted[0] + expected - start.framework_overhead_gib
    )


def test_leave_one_out_refits_without_each_run(runs):
    result = fit_with_prior(runs, derived_cluster(), ["gemm_efficiency", "layer_overhead_us"])
    for i, row in enumerate(result.runs):
        others = [r for j, r in enumerate(runs) if j != i]
        alone = fit_with_prior(
            others, derived_cluster(), ["gemm_efficiency", "layer_overhead_us"], leave_one_out=False
        )
        by_hand = predicted_value(runs[i], estimate_run(runs[i], alone.fitted))
        assert row.left_out == pytest.approx(by_hand, rel=1e-9)  # fmt: skip


def test_the_profile_records_runs_priors_fitted_values_and_loo(runs):
    peaked = [replace(r, measured_peak_gib=2.0) for r in runs]  # under the prediction
    result = fit_with_prior(peaked, derived_cluster(), ["gemm_efficiency", "layer_overhead_us"])
    text = prior_profile_yaml(result, "runs.csv", "2026-12-01")
    cluster = cluster_from_dict(__import__("yaml").safe_load(text), source="fitted")
    cal = dict(cluster.calibration)
    assert cal["run_1"] == f"id 1 ({runs[0].where})" and cal["runs"] == "3"
    assert float(cal["prior_gemm_efficiency"]) == 0.7
    assert float(cal["fitted_gemm_efficiency"]) == cluster.gemm_efficiency
    assert float(cal["prior_sd_layer_overhead_us"]) == 1.0  # the start's, read back
    assert cal["loo_within_15pct"] == str(round(result.left_out.within, 4))
    assert cluster.framework_overhead_gib == result.fitted.framework_overhead_gib == 0.5
    assert "prior_framework_overhead_gib" in cal and "kept_grouped_gemm_half_rows" not in cal
    titles = [t for t, _, _ in prior_tables(result)]
    assert titles[0].startswith("constants of h100: 2 of 2 fitted")
    assert titles[-1].startswith("memory: framework_overhead_gib from 3 measured peak(s)")
