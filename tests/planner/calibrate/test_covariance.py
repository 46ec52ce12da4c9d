"""The fitted constants' posterior covariance: written into the fitted profile and read back,
it gives the interval computed directly from the fit; the Laplace covariance at a profile's
own constants matches the formula by hand; `--covariance-only` prints it and writes nothing."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import yaml

from planner.calibrate.likelihood import OFFSETS
from planner.calibrate.prior import covariance_at, fit_with_prior
from planner.calibrate.prior_report import prior_profile_yaml
from planner.calibrate.runs import estimate_run, parse_runs, predicted_value
from planner.calibrate.uncertainty import covariance_items, error_model, intervals, quantile
from planner.inputs.clusters import cluster_from_dict
from tests.hardening_cli import run_piper
from tests.planner.calibrate.synthetic import LAYOUTS, runs_csv
from tests.planner.calibrate.test_fit_shrinkage import measured_runs, start_cluster

NAMES = ("gemm_efficiency", "layer_overhead_us")


def log_tokens(run, cluster) -> float:
    return math.log(estimate_run(run, cluster).tokens_per_s)


def gradient(run, cluster, names, h: float = 1e-4) -> np.ndarray:
    """d log(tokens/s) / d t_k by central differences, t = log(c + a)."""
    out = []
    for n in names:
        a, c = OFFSETS.get(n, 0.0), getattr(cluster, n)
        up = replace(cluster, **{n: (c + a) * math.exp(h) - a})
        down = replace(cluster, **{n: (c + a) * math.exp(-h) - a})
        out.append((log_tokens(run, up) - log_tokens(run, down)) / (2 * h))
    return np.array(out)


@pytest.fixture(scope="module")
def fitted():
    runs = measured_runs(LAYOUTS[:4], [0.02, -0.03, 0.01, 0.04])
    return runs, fit_with_prior(runs, start_cluster(noise_sd=0.05), list(NAMES))


def test_the_covariance_written_and_read_back_gives_the_direct_interval(fitted):
    runs, result = fitted
    assert result.selection.kept == NAMES
    back = cluster_from_dict(yaml.safe_load(prior_profile_yaml(result, "r.csv", "d")), "fitted")
    model = error_model(back)
    assert model.names == NAMES
    np.testing.assert_allclose(model.covariance_t, result.covariance_t, rtol=1e-4)
    # a layout none of the runs had, priced on the fitted profile
    (other,) = parse_runs(runs_csv(back, LAYOUTS[4:5]))
    est = estimate_run(other, back)
    bars = intervals(back, est, reprice=lambda c: estimate_run(other, c).tokens_per_s)
    g = gradient(other, back, NAMES)
    param = math.sqrt(g @ np.array(result.covariance_t) @ g)
    assert param > 0.01
    assert bars.param_log_sd == pytest.approx(param, rel=0.03)
    sigma = math.hypot(model.time_log_sd, param)
    q = quantile(0.8, model.runs)
    assert bars.tokens_per_s.hi == pytest.approx(est.tokens_per_s * math.exp(q * sigma), rel=1e-3)


def test_the_covariance_at_a_profiles_own_constants_is_the_formula_by_hand(fitted):
    runs, _ = fitted
    cluster = start_cluster(noise_sd=0.05)  # 12 dof, prior sd 0.3 on gemm
    names, cov = covariance_at(runs, cluster, ["gemm_efficiency"])
    sigma, nu, w = 0.05, 12, 0.3
    info = 1 / w**2
    for run in runs:
        z = (math.log(predicted_value(run, estimate_run(run, cluster)) / run.measured)) / sigma
        kappa = max((nu + 1) * (nu - z * z) / (nu + z * z) ** 2, 0.0)
        (g,) = gradient(run, cluster, ["gemm_efficiency"])  # p: the runs' tokens/s
        info += kappa * g * g / sigma**2
    assert names == ("gemm_efficiency",)
    assert cov[0, 0] == pytest.approx(1 / info, rel=0.03)


def test_covariance_only_prints_the_entries_and_writes_nothing(tmp_path, fitted):
    runs_file = tmp_path / "runs.csv"
    runs_file.write_text(runs_csv(start_cluster(), LAYOUTS[:3]))
    argv = ["calibrate", "--fit", str(runs_file), "--cluster", "h100", "--params",
            ",".join(NAMES), "--covariance-only"]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    from planner.inputs.clusters import load_cluster

    names, cov = covariance_at(parse_runs(runs_file.read_text()), load_cluster("h100"), NAMES)
    for key, value in covariance_items(names, cov):
        assert f"  {key}: {value}\n" in result.stdout
    assert list(tmp_path.iterdir()) == [runs_file]
    bad = run_piper([*argv, "--out", str(tmp_path / "x.yaml")])
    assert bad.code == 2 and len(bad.err_lines) == 1
    assert "--covariance-only writes nothing" in bad.err_lines[0]
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.parametrize("preset", ["h100", "gb200-nvl72"])
def test_the_fitted_presets_record_their_covariance_at_their_constants(preset):
    from planner.calibrate.runs import hardware_matches, load_runs
    from planner.inputs.clusters import load_cluster
    from tests.hardening_cli import REPO

    cluster = load_cluster(preset)
    params = tuple(n.strip() for n in dict(cluster.calibration)["params"].split(","))
    model = error_model(cluster)
    assert model.names == params
    runs = [r for r in load_runs(REPO / "profiles" / "runs" / "published_runs.csv")
            if hardware_matches(r.hardware, cluster)]  # fmt: skip
    _, cov = covariance_at(runs, cluster, params)
    # stale after a refit or a model change: regenerate with the command in the profile
    np.testing.assert_allclose(model.covariance_t, cov, rtol=1e-3, atol=2e-6)
