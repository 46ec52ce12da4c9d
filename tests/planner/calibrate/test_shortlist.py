"""The trial shortlist: greedy D-optimal choice against brute-force determinants, sensitivities
against the fit's own Jacobian, and the shortlist of a real plan against the search's numbers
and the intervals' overlap."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.calibrate.likelihood import likelihood_of
from planner.calibrate.prior import _Problem, priors_of
from planner.calibrate.runs import estimate_run, predicted_value
from planner.calibrate.shortlist import candidate_run, d_optimal, log_sensitivities, shortlist
from planner.calibrate.uncertainty import intervals
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.search.make_plan import make_plan
from planner.specs import SpecError, TrainingSpec
from planner.targets import get_target, with_conventions

NOISE = 0.12  # a run's log error s


def log_det_info(jac, widths, rows):
    info = np.diag(1 / np.asarray(widths) ** 2)
    for i in rows:
        info = info + np.outer(jac[i], jac[i]) / NOISE**2
    return np.linalg.slogdet(info)[1], info


@pytest.mark.parametrize("seed", range(5))
def test_each_greedy_step_maximises_the_determinant(seed):
    rng = np.random.default_rng(seed)
    jac = rng.normal(size=(9, 4)) * rng.uniform(0.05, 1.0, size=4)
    widths = rng.uniform(0.2, 1.0, size=4)
    design = d_optimal(jac, widths, 4, NOISE, first=2)
    assert design.chosen[0] == 2
    for step in range(1, 4):
        before = list(design.chosen[:step])
        brute = {i: log_det_info(jac, widths, [*before, i])[0] for i in range(9) if i not in before}
        assert design.chosen[step] == max(brute, key=brute.get)
        gain = log_det_info(jac, widths, design.chosen[: step + 1])[0]
        gain -= log_det_info(jac, widths, before)[0]
        assert design.gain_nats[step] == pytest.approx(gain, rel=1e-9)
    _, info = log_det_info(jac, widths, design.chosen)
    assert design.posterior_sd == pytest.approx(np.sqrt(np.diag(np.linalg.inv(info))), rel=1e-9)
    assert design.prior_sd == pytest.approx(widths)


def test_the_trials_differ_where_the_fit_is_least_sure():
    # the best leans on constant 0; three near-copies of it, one layout on constant 1 (a wide
    # prior), one on constant 2 (a narrow one), and an exact copy of the best
    jac = np.array([
        [1.0, 0.0, 0.0], [0.98, 0.02, 0.0], [0.97, 0.0, 0.03], [0.99, 0.01, 0.01],
        [0.2, 1.0, 0.0], [0.2, 0.0, 1.0], [1.0, 0.0, 0.0],
    ])  # fmt: skip
    design = d_optimal(jac, [0.3, 1.0, 0.3], 3, NOISE, first=0)
    assert design.chosen == (0, 4, 5)
    assert design.posterior_sd[1] < 0.2 * design.prior_sd[1]  # the wide constant is pinned
    copies = d_optimal(jac[[0, 6]], [0.3, 1.0, 0.3], 3, NOISE, first=0)
    assert copies.chosen == (0,)  # copies add none


@pytest.fixture(scope="module")
def tiny_plan():
    model, cluster = load_model("tiny-moe"), load_cluster("cpu-gloo")
    training, target = TrainingSpec(seq_len=64, global_batch=8), get_target("piper")
    result = make_plan(model, cluster, training, 2, {}, SolverOptions("cpsat", 10, 1, 0),
                       target=target)  # fmt: skip
    return model, cluster, training, target, result


def test_candidates_are_priced_as_the_search_priced_them(tiny_plan):
    model, cluster, training, target, result = tiny_plan
    train = with_conventions(training, target)
    solved = [r for r in result.rows if r.status == "solved" and r.feasible]
    assert solved
    for row in solved:
        est = estimate_run(candidate_run(row, model, cluster, train), cluster)
        assert est.step_time_s == pytest.approx(row.step_time_s, rel=1e-9)


def test_sensitivities_are_the_fits_jacobian(tiny_plan):
    model, cluster, training, target, result = tiny_plan
    train = with_conventions(training, target)
    rows = [r for r in result.rows if r.status == "solved"][:2]
    runs = [candidate_run(r, model, cluster, train) for r in rows]
    # the fit differentiates log(tokens/s) / measured; tokens/s = tokens per step / step time
    runs = [r.__class__(**{**r.__dict__, "measured": predicted_value(r, estimate_run(r, cluster))})
            for r in runs]  # fmt: skip
    priors, jac = log_sensitivities(runs, cluster)
    problem = _Problem(runs, cluster, priors_of(cluster, None), likelihood_of(cluster))
    fit_jac = problem.jacobian(range(len(runs)))
    assert [p.name for p in priors] == [p.name for p in priors_of(cluster, None)]
    np.testing.assert_allclose(jac, -fit_jac, rtol=1e-9, atol=1e-12)
    scale_out = [p.name for p in priors].index("scale_out_efficiency")
    assert np.all(jac[:, scale_out] == 0)  # 2 ranks on one emulated node: nothing crosses


def test_shortlist_of_a_plan(tiny_plan):
    model, cluster, training, target, result = tiny_plan
    chosen = shortlist(result.rows, model, cluster, training, target, 3)
    assert len(chosen.trials) == 3 and chosen.trials[0].row is result.best
    best_hi = intervals(cluster, result.best.estimate).step_time_s.hi
    layouts = set()
    for t in chosen.trials:
        assert t.low_s <= best_hi  # every trial's interval overlaps the best one's
        assert t.step_time_s >= result.best.step_time_s * (1 - 1e-12)
        layouts.add(t.layout)
    assert len(layouts) == 3
    assert chosen.considered <= chosen.overlapping
    # information only grows, and each constant's spread shrinks or stays
    assert all(b <= a + 1e-12 for a, b in zip(chosen.prior_sd, chosen.posterior_sd, strict=True))
    with pytest.raises(SpecError, match="--shortlist 0"):
        shortlist(result.rows, model, cluster, training, target, 0)


def test_sensitivity_signs_follow_the_physics(tiny_plan):
    model, cluster, training, target, result = tiny_plan
    run = candidate_run(result.best, model, cluster, with_conventions(training, target))
    priors, jac = log_sensitivities([run], cluster)
    by_name = dict(zip([p.name for p in priors], jac[0], strict=True))
    assert by_name["gemm_efficiency"] < 0  # faster GEMMs, shorter steps
    assert math.isfinite(sum(by_name.values()))
