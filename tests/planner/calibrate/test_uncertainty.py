"""Error bars (planner/calibrate/uncertainty.py) against oracles: the constants' covariance
propagated through a log-linear toy equals Monte Carlo sampling of the constants; intervals
cover 80% of synthetic runs drawn from the assumed distribution; the presets' and a fitted
profile's records are read back as written; the fit's covariance is the inverse Hessian of
its objective, found by central differences."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from planner.calibrate.likelihood import OFFSETS
from planner.calibrate.memory_fit import fit_memory
from planner.calibrate.prior import fit_with_prior
from planner.calibrate.prior_report import prior_profile_yaml
from planner.calibrate.runs import estimate_run, parse_runs, predicted_value
from planner.calibrate.uncertainty import (
    DEFAULT_MEMORY_LOG_SD,
    DEFAULT_TIME_LOG_SD,
    describe_source,
    error_model,
    intervals,
    parameter_log_sd,
)
from planner.inputs.clusters import cluster_from_dict, list_cluster_presets, load_cluster
from planner.plan.schema import Predicted
from planner.specs import SpecError
from tests.planner.calibrate.synthetic import LAYOUTS, derived_cluster, runs_csv, truth_cluster

ROOT = Path(__file__).resolve().parents[3]


H100 = load_cluster("h100")


def calibrated(runs: int, loo: float, **more: float | str):
    """The h100 preset with a calibration mapping of `runs` runs and LOO RMS `loo`."""
    cal = {"runs": runs, "loo_rms_log": loo, **more}
    return replace(H100, calibration=tuple((k, str(v)) for k, v in cal.items()))


def predicted(tokens_per_s: float = 1000.0, memory=(40.0, 50.0)) -> Predicted:
    return Predicted(2.0, 0.4, 300.0, tokens_per_s, 0.1, tuple(memory), 70.0)


def test_covariance_through_a_log_linear_toy_matches_monte_carlo():
    cov = np.array([[0.08**2, -0.4 * 0.08 * 0.3], [-0.4 * 0.08 * 0.3, 0.3**2]])
    cluster = calibrated(12, 0.1, se_gemm_efficiency=0.08, se_layer_overhead_us=0.3,
                         corr_gemm_efficiency__layer_overhead_us=-0.4)  # fmt: skip
    offset = OFFSETS["layer_overhead_us"]

    def tokens(c) -> float:  # log tokens = 1.3 t_gemm - 0.5 t_layer: linear in t
        return 1e4 * c.gemm_efficiency**1.3 * (c.layer_overhead_us + offset) ** -0.5

    got = parameter_log_sd(cluster, tokens, error_model(cluster))
    g = np.array([1.3, -0.5])
    assert got == pytest.approx(math.sqrt(g @ cov @ g), rel=1e-6)
    t0 = np.array([math.log(cluster.gemm_efficiency), math.log(cluster.layer_overhead_us + offset)])
    draws = np.random.default_rng(7).multivariate_normal(t0, cov, size=40_000)
    logs = [math.log(tokens(replace(cluster, gemm_efficiency=math.exp(a),
                                    layer_overhead_us=math.exp(b) - offset)))
            for a, b in draws]  # fmt: skip
    assert got == pytest.approx(float(np.std(logs)), rel=0.02)
    ivs = intervals(cluster, predicted(), reprice=tokens)
    assert ivs.time_log_sd == pytest.approx(math.hypot(0.1, got))


@pytest.mark.parametrize("runs", [3, 6, 12])
def test_intervals_cover_80_percent_of_runs_drawn_from_the_model(runs):
    rng = np.random.default_rng(runs)
    sigma, trials, inside_time, inside_memory = 0.2, 3000, 0, 0
    for _ in range(trials):
        loo = float(np.sqrt(np.mean(rng.normal(0, sigma, runs) ** 2)))
        mem = float(np.sqrt(np.mean(rng.normal(0, sigma, runs) ** 2)))
        ivs = intervals(calibrated(runs, loo, memory_runs=runs, memory_loo_rms_log=mem),
                        predicted())  # fmt: skip
        x = rng.normal(0, sigma, 2)
        inside_time += ivs.tokens_per_s.contains(1000.0 * math.exp(x[0]))
        inside_memory += ivs.memory_gib_per_stage[1].contains(50.0 * math.exp(x[1]))
    binomial_sd = math.sqrt(0.8 * 0.2 / trials)
    assert abs(inside_time / trials - 0.8) < 3 * binomial_sd
    assert abs(inside_memory / trials - 0.8) < 3 * binomial_sd


def test_every_figure_shares_the_time_spread_and_memory_has_its_own():
    ivs = intervals(calibrated(12, 0.124), predicted())
    f = ivs.tokens_per_s.hi / ivs.tokens_per_s.mid
    for iv in (ivs.step_time_s, ivs.tflops_per_gpu, ivs.mfu):
        assert iv.hi / iv.mid == pytest.approx(f) and iv.mid / iv.lo == pytest.approx(f)
    q = float(__import__("scipy.stats").stats.t.ppf(0.9, 12))
    assert f == pytest.approx(math.exp(q * 0.124))
    z = float(__import__("scipy.stats").stats.norm.ppf(0.9))
    mem = ivs.memory_gib_per_stage[0]
    assert mem.hi / mem.mid == pytest.approx(math.exp(z * DEFAULT_MEMORY_LOG_SD))
    assert intervals(calibrated(12, 0.124), replace(predicted(), mfu=0.9)).mfu.hi == 1.0


@pytest.mark.parametrize("name", list_cluster_presets())
def test_presets_use_what_they_record_or_the_documented_default(name):
    cal = yaml.safe_load((ROOT / "profiles" / "clusters" / f"{name}.yaml").read_text()).get(
        "calibration", {}
    )
    model = error_model(load_cluster(name))
    if "loo_rms_log" in cal:
        assert model.time_log_sd == float(cal["loo_rms_log"]) and model.runs == int(cal["runs"])
        assert describe_source(load_cluster(name)).startswith(f"fitted on {cal['runs']} runs")
    else:
        assert model.time_log_sd == DEFAULT_TIME_LOG_SD and model.runs == 0
        assert "without" in describe_source(load_cluster(name))


def test_h100_and_gb200_record_their_leave_one_out_error():
    assert error_model(load_cluster("h100")).calibrated
    assert error_model(load_cluster("gb200-nvl72")).calibrated


@pytest.mark.parametrize(
    ("key", "value"), [("loo_rms_log", "abc"), ("loo_rms_log", "-0.1"),
                       ("corr_gemm_efficiency__layer_overhead_us", "1.5")],
)  # fmt: skip
def test_a_bad_recorded_value_is_one_line_naming_it(key, value):
    cluster = calibrated(4, 0.1, se_gemm_efficiency=0.1, se_layer_overhead_us=0.1, **{key: value})
    with pytest.raises(SpecError, match=f"calibration.{key}") as err:
        error_model(cluster)
    assert "\n" not in str(err.value)


def test_the_start_profiles_record_is_pooled_in():
    pooled = error_model(calibrated(3, 0.2, start_runs=12, start_loo_rms_log=0.1))
    assert pooled.runs == 15 and pooled.start_runs == 12
    assert pooled.time_log_sd == pytest.approx(math.sqrt((3 * 0.2**2 + 12 * 0.1**2) / 15))
    one_run = error_model(calibrated(1, 0.0, start_runs=12, start_loo_rms_log=0.1))
    assert one_run.runs == 12 and one_run.time_log_sd == 0.1
    assert "start profile's 12 runs (no leave-one-out" in describe_source(
        calibrated(1, 0.0, start_runs=12, start_loo_rms_log=0.1)
    )


def test_a_bad_level_is_one_line():
    with pytest.raises(SpecError, match="level must lie in"):
        intervals(load_cluster("h100"), predicted(), level=1.0)


@pytest.fixture(scope="module")
def fitted():
    runs = parse_runs(runs_csv(truth_cluster(), LAYOUTS[:4]))
    start = derived_cluster()
    peaks = [max(estimate_run(r, start).memory_gib_per_stage) for r in runs]
    runs = [replace(r, measured_peak_gib=p + d) for r, p, d in
            zip(runs, peaks, (2.0, 3.5, 1.0, 4.0), strict=True)]  # fmt: skip
    return runs, fit_with_prior(runs, start, ["gemm_efficiency", "layer_overhead_us"])


def test_the_fitted_profile_records_what_the_intervals_read(fitted):
    runs, result = fitted
    text = prior_profile_yaml(result, "runs.csv", "2026-12-02")
    cluster = cluster_from_dict(yaml.safe_load(text), source="fitted")
    model = error_model(cluster)
    start = error_model(result.start)  # h100's record, kept by the derived start: pooled in
    assert start.runs == 12 and model.runs == 4 + 12 and model.start_runs == 12
    own = round(result.left_out.rms_log, 4)
    pooled = math.sqrt((4 * own**2 + 12 * round(start.time_log_sd, 4) ** 2) / 16)
    assert model.time_log_sd == pytest.approx(pooled, rel=1e-12)
    assert model.names == result.selection.kept == ("gemm_efficiency", "layer_overhead_us")
    np.testing.assert_allclose(model.covariance_t, result.covariance_t, rtol=1e-4, atol=1e-10)
    # memory: each run's peak predicted with framework_overhead_gib fitted on the others
    before = replace(result.fitted, framework_overhead_gib=result.start.framework_overhead_gib)
    logs = []
    for i, run in enumerate(runs):
        alone = fit_memory([r for j, r in enumerate(runs) if j != i], before)
        peak = max(estimate_run(run, replace(before, framework_overhead_gib=alone.fitted_gib))
                   .memory_gib_per_stage)  # fmt: skip
        logs.append(math.log(peak / run.measured_peak_gib))
    expected = math.sqrt(sum(x * x for x in logs) / len(logs))
    assert model.memory_runs == 4 and model.memory_log_sd == pytest.approx(expected, abs=1e-4)


def test_the_fit_covariance_is_the_inverse_hessian_of_its_objective(fitted):
    runs, result = fitted
    names = result.selection.kept
    priors = {p.name: p for p in result.priors}

    noise = result.likelihood  # every candidate fitted: each run's sd is sigma

    def objective(t: np.ndarray) -> float:  # the negative log posterior: half the fit's sum
        values = {n: priors[n].value_at(x) for n, x in zip(names, t, strict=True)}
        cluster = replace(result.fitted, **values)
        z = [math.log(predicted_value(r, estimate_run(r, cluster)) / r.measured) / noise.sigma
             for r in runs]  # fmt: skip
        data = sum((noise.dof + 1) * math.log1p(x * x / noise.dof) for x in z)
        prior = sum(((x - priors[n].t(priors[n].value)) / priors[n].width) ** 2
                    for n, x in zip(names, t, strict=True))  # fmt: skip
        return 0.5 * (data + prior)

    t = np.array([priors[n].t(getattr(result.fitted, n)) for n in names])
    h, k = 0.01, len(names)
    hess = np.zeros((k, k))
    for i in range(k):
        for j in range(k):
            ei, ej = np.eye(k)[i] * h, np.eye(k)[j] * h
            hess[i, j] = (objective(t + ei + ej) - objective(t + ei - ej) - objective(t - ei + ej)
                          + objective(t - ei - ej)) / (4 * h * h)  # fmt: skip
    # Gauss-Newton leaves out the residuals times the model's own curvature in t
    np.testing.assert_allclose(np.array(result.covariance_t), np.linalg.inv(hess), rtol=0.15)
