"""The few-run fit against a synthetic truth: "measured" runs are the resource model's own
predictions on a cluster with a known gemm_efficiency, times known multiplicative noise. One
run moves the constant by the posterior mode computed by hand, many runs converge on the truth
with a posterior sd that falls as 1 / sqrt(runs), an outlier is reported and pulls less than a
Gaussian likelihood would let it, and a bad prior in the profile is one line, exit 2."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from planner.calibrate.likelihood import prior_sds
from planner.calibrate.prior import fit_with_prior
from planner.calibrate.runs import Run, estimate_run, parse_runs, predicted_value
from planner.inputs.clusters import cluster_to_yaml
from planner.specs import SpecError
from tests.hardening_cli import run_piper
from tests.planner.calibrate.synthetic import LAYOUTS, runs_csv, truth_cluster, with_calibration

TRUE_GEMM = 0.55
START_GEMM = 0.7


def start_cluster(noise_sd: float = 0.1, dof: int = 12):
    """The truth with gemm_efficiency moved to START_GEMM, recording a leave-one-out error of
    `noise_sd` over `dof` runs (the fit's likelihood) and a prior sd of 0.3 on gemm."""
    start = replace(truth_cluster(gemm_efficiency=TRUE_GEMM), gemm_efficiency=START_GEMM)
    return with_calibration(start, loo_rms_log=noise_sd, runs=dof, prior_sd_gemm_efficiency=0.3)


def measured_runs(layouts, noise_log: list[float]) -> list[Run]:
    """The layouts' runs measured on the truth, times exp(noise) each."""
    runs = parse_runs(runs_csv(truth_cluster(gemm_efficiency=TRUE_GEMM), layouts))
    return [replace(r, measured=r.measured * math.exp(e))
            for r, e in zip(runs, noise_log, strict=True)]  # fmt: skip


def log_pred(run: Run, cluster, gemm: float) -> float:
    return math.log(predicted_value(run, estimate_run(run, replace(cluster, gemm_efficiency=gemm))))


def test_one_run_moves_gemm_by_the_posterior_mode_computed_by_hand():
    start = start_cluster()
    (run,) = measured_runs(LAYOUTS[1:2], [0.03])
    result = fit_with_prior([run], start, ["gemm_efficiency"], leave_one_out=False)
    assert result.selection.kept == ("gemm_efficiency",)
    # by hand: r(d) = r0 + g d in t = log(gemm), the t likelihood (sd 0.1, 12 dof) times the
    # Gaussian prior (sd 0.3) on d; the mode on a fine grid
    t0, h = math.log(START_GEMM), 1e-4
    r0 = log_pred(run, start, START_GEMM) - math.log(run.measured)
    g = (log_pred(run, start, math.exp(t0 + h)) - log_pred(run, start, math.exp(t0 - h))) / (2 * h)
    sigma, nu, w = 0.1, 12, 0.3
    d = np.linspace(-1.0, 1.0, 400001)
    z = (r0 + g * d) / sigma
    objective = (nu + 1) * np.log1p(z * z / nu) + (d / w) ** 2
    by_hand = d[np.argmin(objective)]
    moved = math.log(result.fitted.gemm_efficiency) - t0
    assert moved == pytest.approx(by_hand, rel=0.02)
    # the step is shrunk: the prior keeps it short of the move that would zero the residual
    assert 0 < by_hand / (-r0 / g) < 1


def test_many_runs_converge_on_the_truth():
    rng = np.random.default_rng(0)
    noise_sd = 0.05
    start = start_cluster(noise_sd=noise_sd)
    sds = {}
    for copies in (1, 8):
        layouts = list(LAYOUTS) * copies
        runs = measured_runs(layouts, list(rng.normal(0.0, noise_sd, len(layouts))))
        result = fit_with_prior(runs, start, ["gemm_efficiency"], leave_one_out=False)
        sds[len(runs)] = math.sqrt(result.covariance_t[0][0])
        error = math.log(result.fitted.gemm_efficiency / TRUE_GEMM)
        assert abs(error) < 3 * sds[len(runs)]
    assert abs(error) < 0.02  # 40 runs: within 2% of the truth
    # the posterior sd falls as 1 / sqrt(runs) once the runs outweigh the prior
    assert sds[40] / sds[5] == pytest.approx(math.sqrt(5 / 40), rel=0.2)


def test_an_outlier_is_reported_and_pulls_less_than_under_a_gaussian():
    layouts = LAYOUTS[:5]
    clean = measured_runs(layouts, [0.0] * 5)
    spoiled = [*clean[:4], replace(clean[4], measured=clean[4].measured * 2.0)]

    def gemm_t(runs, dof):
        cluster = start_cluster(noise_sd=0.05, dof=dof)
        result = fit_with_prior(runs, cluster, ["gemm_efficiency"], leave_one_out=False)
        return math.log(result.fitted.gemm_efficiency), result

    base, _ = gemm_t(clean, 12)
    robust, result = gemm_t(spoiled, 12)
    gaussian, _ = gemm_t(spoiled, 10**6)  # nu -> infinity: the Gaussian likelihood
    (outlier,) = result.outliers
    assert outlier.label == spoiled[4].label and outlier.weight < 0.2
    assert abs(robust - base) < 0.3 * abs(gaussian - base)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("prior_sd_gemm_efficiency", "-0.1", "must be a number > 0"),
        ("prior_sd_gemm_efficiency", "wide", "must be a number > 0"),
        ("prior_sd_gemm_efficiancy", "0.1", "is not a constant a fit may set"),
    ],
)
def test_a_bad_prior_in_the_profile_is_one_line(tmp_path, key, value, message):
    bad = with_calibration(truth_cluster(), **{key: value})
    with pytest.raises(SpecError, match=message):
        prior_sds(bad)
    profile = tmp_path / "bad.yaml"
    profile.write_text(cluster_to_yaml(bad))
    runs = tmp_path / "runs.csv"
    runs.write_text(runs_csv(truth_cluster(), LAYOUTS[:2]))
    out = tmp_path / "fitted.yaml"
    result = run_piper(["calibrate", "--fit", str(runs), "--cluster", str(profile),
                        "--out", str(out)])  # fmt: skip
    assert result.code == 2, result.stderr
    assert len(result.err_lines) == 1 and "Traceback" not in result.stderr
    assert f"calibration.{key}" in result.err_lines[0] and message in result.err_lines[0]
    assert not out.exists()


# The fitted values planner/calibrate/likelihood.py's table lists (h100, gb200-nvl72, frontier
# values at a bound left out), by constant: each prior sd is their sample
# sd in t, capped at the uniform-over-bounds sd, which a constant with fewer values takes.
FITTED_VALUES = {
    "gemm_efficiency": (0.7918, 0.7914, 0.6723),
    "layer_overhead_us": (1465, 5919),
}


def test_the_default_priors_are_the_presets_spread_capped_by_the_bounds():
    from planner.calibrate.likelihood import DEFAULT_PRIOR_SD, OFFSETS
    from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES

    for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES):
        a = OFFSETS.get(e.name, 0.0)
        cap = (math.log(e.high + a) - math.log(e.low + a)) / math.sqrt(12)
        values = FITTED_VALUES.get(e.name, ())
        spread = float(np.std([math.log(v + a) for v in values], ddof=1)) if values else cap
        assert DEFAULT_PRIOR_SD[e.name] == pytest.approx(min(spread, cap), abs=6e-4), e.name


def test_priors_of_unfitted_constants_are_what_the_bounds_say():
    """A start profile nobody fitted (no recorded leave-one-out error: datasheet values and
    assumptions) takes each constant's uniform-over-bounds sd; a fitted one the presets'
    spread; a recorded prior_sd_<name> overrides either."""
    from planner.calibrate.likelihood import DEFAULT_PRIOR_SD, OFFSETS
    from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES

    bare = replace(truth_cluster(), calibration=())
    fitted = with_calibration(bare, loo_rms_log=0.1, runs=12)
    assert prior_sds(fitted) == DEFAULT_PRIOR_SD
    sds = prior_sds(bare)
    for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES):
        if e.name not in DEFAULT_PRIOR_SD:
            continue
        a = OFFSETS.get(e.name, 0.0)
        cap = (math.log(e.high + a) - math.log(e.low + a)) / math.sqrt(12)
        assert sds[e.name] == pytest.approx(cap, rel=1e-12), e.name
    assert sds["gemm_efficiency"] > 3 * DEFAULT_PRIOR_SD["gemm_efficiency"]
    assert prior_sds(with_calibration(bare, prior_sd_gemm_efficiency=0.2))["gemm_efficiency"] == 0.2
