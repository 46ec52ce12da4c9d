"""Trial runs that pin the model down: the layouts `piper plan --shortlist K` asks a team to run.

The search ranks layouts by predicted step time; the prediction carries an interval
(planner.calibrate.uncertainty), so layouts whose intervals overlap the best one's may be the
faster ones in truth. A few short runs decide, and the same runs calibrate the profile
(`piper calibrate --fit`). Which K to run, in three steps:

1. Overlap: the search's layouts that fit, by predicted step time (those it pruned priced on
   an even layer split), keep those whose step-time interval at `level` overlaps the best
   one's, the first MAX_CONSIDERED of them (the best first).
2. Sensitivities: for each kept layout i and each constant k the fit may move
   (planner.specs.EFFICIENCIES, in the fit's coordinates t_k = log(c_k + a_k) of
   planner.calibrate.prior), J_ik = d log(step_time_i) / d t_k by forward differences
   (step prior.JACOBIAN_STEP, backward at the upper bound), through the resource model.
3. Active choice, greedy D-optimal design: the fit's information about t starts at the prior,
   M = diag(1 / w_k^2) (the prior sds the fit uses, planner.calibrate.likelihood), and a
   measured run i adds J_i J_i' / s^2 (s = the fit's noise sigma on this profile, its
   leave-one-out error: the same posterior the fit computes). The predicted best is always
   run first (it is the layout the team wants to confirm); each next trial is the layout
   that maximises det(M + J_i J_i' / s^2), i.e. the largest v_i = J_i' M^-1 J_i: the layout
   whose step time the fit, given the trials already chosen, is least sure of. v_i is large
   for a layout that leans on constants with wide priors that no chosen trial has
   constrained yet, so the trials differ where the fit is weakest. A layout whose
   sensitivities equal a chosen one's (same row of J) adds no direction and is skipped.

`--shortlist auto` sizes the list by the odds instead (planner.search.uncertain_rank): the
trials are the fewest of the plan's contenders (the layouts predicted within 15% of the best)
whose summed probability of being truly the fastest reaches `--shortlist-probability`
(default 0.9), the pick first, then by that probability; their information and the
constants' posterior are those of that order. Each trial carries its P(best) in both modes.

The result reports each trial's information gain log(1 + v_i / s^2) (nats) and each constant's
prior and posterior standard deviation (the linearised fit after the K trials, sqrt(diag
M^-1)), so a user sees what the trials will pin down.

Shape letters: N layouts considered, K constants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from planner.calibrate.likelihood import likelihood_of
from planner.calibrate.prior import JACOBIAN_STEP, Prior, priors_of
from planner.calibrate.runs import Run, estimate_run
from planner.calibrate.uncertainty import LEVEL, Estimated, intervals
from planner.resources.cost import even_split
from planner.search.costing import training_for
from planner.search.rows import CandidateRow, describe
from planner.search.space import Candidate
from planner.search.uncertain_rank import Odds
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target, with_conventions

MAX_CONSIDERED = 32  # layouts priced for sensitivities (each costs 1 + K estimates)
SAME_ROW = 1e-9  # sensitivity rows closer than this (max abs) are the same direction


@dataclass(frozen=True)
class Design:
    """The greedy D-optimal order over the rows of J (module docstring, step 3).

    chosen: row indices in the order chosen; gain_nats: log(1 + v / s^2) of each when chosen;
    prior_sd / posterior_sd: per constant (K), in t units, before and after the chosen rows.
    """

    chosen: tuple[int, ...]
    gain_nats: tuple[float, ...]
    prior_sd: tuple[float, ...]
    posterior_sd: tuple[float, ...]


@dataclass(frozen=True)
class Trial:
    """One shortlisted layout: its candidate row, predicted step and interval, why chosen."""

    row: CandidateRow
    layout: str
    step_time_s: float
    low_s: float
    high_s: float
    gain_nats: float
    leans_on: tuple[str, ...]  # the constants its step time moves most with, largest first
    p_best: float = 0.0  # P(best) (planner.search.uncertain_rank); 0 outside the odds' window


@dataclass(frozen=True)
class Shortlist:
    """The trials (the predicted best first), how many layouts overlapped, the constants."""

    trials: tuple[Trial, ...]
    requested: int  # K asked for; trials holds fewer when fewer distinct layouts overlap
    overlapping: int  # layouts whose interval overlaps the best one's (before the cap)
    considered: int  # of those, priced for sensitivities
    level: float
    constants: tuple[str, ...]
    prior_sd: tuple[float, ...]
    posterior_sd: tuple[float, ...]
    probability: float | None = None  # `--shortlist auto`: the summed P(best) asked for
    contenders: int = 0  # layouts the odds were computed over (0: no odds)
    window: float = 0.0  # their step-time window

    @property
    def p_best_total(self) -> float:
        """The probability that the fastest layout is among the trials (under the odds)."""
        return sum(t.p_best for t in self.trials)


def d_optimal(
    jac_NK: np.ndarray,
    widths_K: Sequence[float],
    count: int,
    noise_sd: float,
    first: int | None = None,
    order: Sequence[int] | None = None,
) -> Design:
    """Greedy D-optimal choice of `count` rows of `jac_NK` (module docstring, step 3).

    Args:
        jac_NK: d log(prediction) / d t per layout (row) and constant (column).
        widths_K: the prior standard deviation of each t_k (> 0).
        count: rows to choose (at most N; fewer when only that many distinct rows exist).
        noise_sd: s, a run's log error (likelihood_of(cluster).sigma), > 0.
        first: a row chosen first whatever its information (the predicted best), or None.
        order: rows chosen in this order instead (`--shortlist auto` chooses by P(best));
            the gains and posterior are those of that order.
    """
    jac = np.asarray(jac_NK, dtype=float)
    info = np.diag(1.0 / np.asarray(widths_K, dtype=float) ** 2)
    prior_sd = tuple(float(w) for w in widths_K)
    chosen: list[int] = []
    gains: list[float] = []
    while len(chosen) < min(count if order is None else len(order), len(jac)):
        cov = np.linalg.inv(info)
        var_N = np.einsum("nk,kl,nl->n", jac, cov, jac)
        if order is not None:
            chosen.append(order[len(chosen)])
            gains.append(math.log1p(float(var_N[chosen[-1]]) / noise_sd**2))
            info = info + np.outer(jac[chosen[-1]], jac[chosen[-1]]) / noise_sd**2
            continue
        open_ = [
            i for i in range(len(jac))
            if i not in chosen and all(np.max(np.abs(jac[i] - jac[j])) > SAME_ROW for j in chosen)
        ]  # fmt: skip
        if not open_:
            break
        pick = first if first is not None and not chosen else max(open_, key=lambda i: var_N[i])
        chosen.append(pick)
        gains.append(math.log1p(float(var_N[pick]) / noise_sd**2))
        info = info + np.outer(jac[pick], jac[pick]) / noise_sd**2
    post = np.sqrt(np.diag(np.linalg.inv(info)))
    return Design(tuple(chosen), tuple(gains), prior_sd, tuple(float(x) for x in post))


def log_sensitivities(
    runs: Sequence[Run], cluster: ClusterSpec, names: Sequence[str] | None = None
) -> tuple[tuple[Prior, ...], np.ndarray]:
    """The priors of the constants and J_NK = d log(step_time) / d t_k per run (module
    docstring, step 2), as planner.calibrate.prior differentiates."""
    priors = priors_of(cluster, names)
    base = np.array([math.log(estimate_run(r, cluster).step_time_s) for r in runs])
    cols = []
    for p in priors:
        t0 = p.t(p.value)
        step = JACOBIAN_STEP if t0 + JACOBIAN_STEP <= p.t_bounds[1] else -JACOBIAN_STEP
        moved = replace(cluster, **{p.name: p.value_at(t0 + step)})
        dt = p.t(p.value_at(t0 + step)) - t0
        if dt == 0:
            cols.append(np.zeros(len(runs)))
            continue
        logs = np.array([math.log(estimate_run(r, moved).step_time_s) for r in runs])
        cols.append((logs - base) / dt)
    return priors, np.column_stack(cols) if cols else np.zeros((len(runs), 0))


def candidate_run(
    row: CandidateRow, model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec
) -> Run:
    """A search candidate as a Run (priced by estimate_run as the search priced it; a pruned
    candidate, which has no split, on an even split). `training` has the target's
    conventions applied."""
    par = row.parallel
    split = row.stages.stage_layers if row.stages else even_split(model.num_layers, par.pp)
    recomputed = row.stages.recompute_layers if row.stages else None
    return Run(
        label=describe(par, row.knobs), where=f"candidate {row.order}", model=model,
        hardware=cluster.name, parallel=par,
        training=training_for(training, Candidate(par, row.knobs)),
        dispatcher=row.knobs.dispatcher, stage_layers=tuple(tuple(s) for s in split),
        metric="tokens/s/GPU", measured=1.0, recompute_layers=recomputed,
    )  # fmt: skip


def shortlist(
    rows: Sequence[CandidateRow],
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    target: Target | None,
    count: int,
    level: float = LEVEL,
    odds: Odds | None = None,
    probability: float | None = None,
) -> Shortlist:
    """The trials for a plan's ranked candidates (module docstring).

    Args:
        rows: the search's ranked candidates (PlanResult.rows); the first feasible solved
            row is the predicted best.
        model, cluster, training: the plan's inputs (training as the user gave it; the
            target's conventions are applied here as make_plan applies them).
        target: the engine planned for (None: no engine's conventions).
        count: trials wanted (>= 1); ignored with `probability`.
        level: the probability of each interval (planner.calibrate.uncertainty).
        odds: the plan's P(best) (planner.calibrate.pick_odds); each trial carries its own.
        probability: `--shortlist auto`: the trials are the fewest of the odds' contenders
            whose summed P(best) reaches it (the pick first), in order of P(best); needs odds.
    """
    if probability is None and count < 1:
        raise SpecError(f"--shortlist {count}: give a number of trial layouts >= 1, e.g. 3")
    train = with_conventions(training, target) if target is not None else training
    priced = priced_candidates(rows, model, cluster, train)
    if not priced:
        raise SpecError("--shortlist: no layout fits, so there is nothing to try")
    boxes = [intervals(cluster, x.est, level).step_time_s for x in priced]
    overlap = [i for i, box in enumerate(boxes) if box.lo <= boxes[0].hi]
    p_of = {c.order: c.p_best for c in odds.contenders} if odds else {}
    if probability is not None:
        assert odds is not None, "--shortlist auto needs the plan's odds"
        where = {x.row.order: i for i, x in enumerate(priced)}
        kept = [where[c.order] for c in odds.leading(probability) if c.order in where]
        order: list[int] | None = list(range(len(kept)))
    else:
        kept, order = overlap[:MAX_CONSIDERED], None
    priors, jac = log_sensitivities([priced[i].run for i in kept], cluster)
    noise = likelihood_of(cluster).sigma
    design = d_optimal(jac, [p.width for p in priors], count, noise, first=0, order=order)
    names = tuple(p.name for p in priors)
    trials = []
    for pick, gain in zip(design.chosen, design.gain_nats, strict=True):
        x, box = priced[kept[pick]], boxes[kept[pick]]
        ranked = np.argsort(-np.abs(jac[pick]), kind="stable")
        leans = tuple(names[k] for k in ranked[:2] if abs(jac[pick][k]) > 0)
        trials.append(Trial(x.row, x.run.label, x.est.step_time_s, box.lo, box.hi, gain, leans,
                            p_of.get(x.row.order, 0.0)))  # fmt: skip
    asked = len(kept) if probability is not None else count
    return Shortlist(tuple(trials), asked, len(overlap), len(kept), level, names,
                     design.prior_sd, design.posterior_sd, probability,
                     len(odds.contenders) if odds else 0, odds.window if odds else 0.0)  # fmt: skip


@dataclass(frozen=True)
class Priced:
    """A candidate that fits, as a Run, with its prediction."""

    row: CandidateRow
    run: Run
    est: Estimated


def priced_candidates(
    rows: Sequence[CandidateRow],
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    bound_limit_s: float = math.inf,
    fastest: int | None = None,
) -> list[Priced]:
    """Every candidate that fits, the predicted best first, then by predicted step time: the
    solved rows with the search's estimate, the pruned ones (at most 4 x MAX_CONSIDERED,
    those whose step-time bound is at most `bound_limit_s`) priced on an even split.
    `training` has the target's conventions applied. With `fastest`, pricing stops at the
    first pruned row (they come by bound) whose bound exceeds the `fastest`-th best step so
    far: no later row can be among the `fastest` fastest."""
    out: list[Priced] = []
    for row in rows:
        if row.status == "solved" and row.feasible and row.estimate is not None:
            out.append(Priced(row, candidate_run(row, model, cluster, training), row.estimate))
        elif (row.status == "pruned" and len(out) < 4 * MAX_CONSIDERED
              and not row.bound_step_time_s > bound_limit_s):  # fmt: skip
            if fastest and len(out) >= fastest:
                kth = sorted(x.est.step_time_s for x in out)[fastest - 1]
                if row.bound_step_time_s > kth:
                    break
            run = candidate_run(row, model, cluster, training)
            try:
                est = estimate_run(run, cluster)
            except SpecError:
                continue
            if est.fits:
                out.append(Priced(row, run, est))
    if not out:
        return out
    return out[:1] + sorted(out[1:], key=lambda x: (x.est.step_time_s, x.row.order))
