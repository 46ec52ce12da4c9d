"""What `piper plan` says beside its pick: the pick's odds of being truly the fastest, and the
published measurements of the same setting.

    pick_odds(rows, model, cluster, training, target) -> Odds | None
    published_measurements(model, cluster, training, gpus) -> tuple[PublishedLayout, ...]

`pick_odds` prices the candidates near the best (planner.calibrate.shortlist's
priced_candidates: the solved ones with the search's estimate, the pruned ones on an even
split), takes each one's sensitivities to the profile's fitted constants (the profile's
recorded covariance, planner.calibrate.uncertainty.error_model) and the layout-specific
residual, and computes P(best) (planner.search.uncertain_rank, which states the model).

`published_measurements` reads the rows of profiles/runs/published_runs.csv and
holdout_runs.csv of exactly the plan's setting (planner.search.recipes.published_for), one
entry per published layout, with the measured tokens/s per GPU as published and the resource
model's prediction of that layout on the plan's cluster (planner.calibrate.runs.run_of: the
row's exact layout and settings).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.calibrate.runs import estimate_run, predicted_value, run_of
from planner.calibrate.shortlist import log_sensitivities, priced_candidates
from planner.calibrate.uncertainty import error_model
from planner.search.recipes import Published, published_for
from planner.search.rows import CandidateRow, describe
from planner.search.uncertain_rank import (
    MAX_CONTENDERS,
    RESIDUAL_SHARE,
    WINDOW,
    Contender,
    Odds,
    check_log_steps,
    p_best,
)
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target, with_conventions


def pick_odds(
    rows: Sequence[CandidateRow],
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    target: Target | None,
    window: float = WINDOW,
    limit: int = MAX_CONTENDERS,
) -> Odds | None:
    """P(best) of the candidates predicted within `window` of the best step (at most `limit`,
    the fastest), the pick first; None when no candidate was solved and fits.

    Args:
        rows: the search's ranked candidates (PlanResult.rows).
        model, cluster, training, target: the plan's inputs (training as the user gave it).
        window: the relative step-time window of the candidates considered.
        limit: the most candidates considered.
    """
    if not any(r.status == "solved" and r.feasible and r.estimate for r in rows):
        return None
    train = with_conventions(training, target) if target is not None else training
    best_s = next(r.step_time_s for r in rows if r.status == "solved" and r.feasible)
    limit_s = best_s * (1 + window)
    priced = priced_candidates(rows, model, cluster, train, limit_s, fastest=limit)
    near = [x for x in priced if x.est.step_time_s <= limit_s][:limit]
    m = error_model(cluster)
    rho = RESIDUAL_SHARE * m.time_log_sd
    shared = math.sqrt(max(m.time_log_sd**2 - rho**2, 0.0))
    if m.names and len(near) > 1:
        _, jac = log_sensitivities([x.run for x in near], cluster, m.names)
        cov = np.array(m.covariance_t)
    else:
        jac, cov = np.zeros((len(near), 0)), np.zeros((0, 0))
    steps = [x.est.step_time_s for x in near]
    p = p_best(check_log_steps(steps), jac, cov, rho) if len(near) > 1 else (1.0,)
    contenders = tuple(
        Contender(x.run.label, x.est.step_time_s, pi, x.row.order)
        for x, pi in zip(near, p, strict=True)
    )
    return Odds(contenders, rho, shared, m.names if len(near) > 1 else (), window)


@dataclass(frozen=True)
class PublishedLayout:
    """One published layout of the plan's setting: its measurements as published (the
    fastest first) and the resource model's prediction of it on the plan's cluster (nan where
    the model cannot price it)."""

    source: str  # e.g. Megatron-Bridge
    layout: str
    measured_tokens_per_s_per_gpu: tuple[float, ...]
    releases: tuple[str, ...]  # one per measurement ("" where the source names none)
    row_ids: tuple[str, ...]
    files: tuple[str, ...]
    predicted_tokens_per_s_per_gpu: float


def published_measurements(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, gpus: int
) -> tuple[PublishedLayout, ...]:
    """The published measurements of the plan's setting (module docstring), one entry per
    layout, the layout with the fastest measurement first."""
    found = published_for(
        model.name, (cluster.device.name, cluster.name), gpus, training.dtype,
        training.seq_len, training.global_batch,
    )  # fmt: skip
    groups: dict[str, list[Published]] = {}
    runs = {}
    for p in found:
        try:
            run = run_of(dict(p.fields), f"{p.file} id {p.recipe.row_id}")
        except SpecError:
            continue
        text = describe(run.parallel) + (" a2a-overlap" if p.recipe.a2a_overlap else "")
        text += f" dispatcher={run.dispatcher}"
        groups.setdefault(text, []).append(p)
        runs.setdefault(text, run)
    out = []
    for text, ps in groups.items():
        try:
            predicted = predicted_value(runs[text], estimate_run(runs[text], cluster))
        except SpecError:
            predicted = math.nan
        out.append(PublishedLayout(
            ps[0].recipe.source, text, tuple(p.recipe.tokens_per_s_per_gpu for p in ps),
            tuple(p.release for p in ps), tuple(p.recipe.row_id for p in ps),
            tuple(p.file for p in ps), predicted,
        ))  # fmt: skip
    return tuple(out)
