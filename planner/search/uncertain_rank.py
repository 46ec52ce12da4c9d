"""Ranking under uncertainty: how likely each leading candidate is to be truly the fastest.

The search picks the layout with the best predicted step time, and the pick stays that
layout. Each prediction has an error (planner.calibrate.uncertainty), so a layout predicted a
little slower may measure faster; this module states how likely that is.

**Error model.** For candidate i with predicted step time x_i, the measured step time T_i is

    log(T_i / x_i) = e + g_i' d + r_i

- e: the error every layout on the same cluster and software stack shares (most of the
  profile's leave-one-out error s_loo); it moves all T_i together and never changes which is
  fastest, so it is left out.
- d ~ N(0, C): the fitted constants' error, C their covariance in t = log(c + a) as the
  profile records it; g_i = d log(step_i) / d t. Two layouts differ in this term by
  (g_i - g_j)' d, of variance (g_i - g_j)' C (g_i - g_j): layouts that lean on the same
  constants the same way share it.
- r_i ~ N(0, rho^2), independent per layout: what the resource model gets wrong about one
  layout and not another. rho = RESIDUAL_SHARE x s_loo, RESIDUAL_SHARE = 0.71 from the
  published runs' same-stack groups (results/published_runs.md: rows of one model, hardware
  and GPU count, whose shared error cancels within the group): the pooled within-group sd
  of their leave-one-out log errors is 0.104 (10 degrees of freedom: groups gpt-oss-120b
  H100 64, qwen3-235b-a22b H100 256, gpt-oss-120b GB200 64, qwen3-235b-a22b GB200 256)
  against an RMS of 0.146 over the same rows; 0.104 / 0.146 = 0.71, so about half of the
  error's variance is the layout's own and half is shared. results/holdout_runs.md has no
  same-stack group. The H100 groups alone give 0.085 / 0.094 = 0.90; 0.71 is the pooled one.

**P(best)** of candidate i is P(T_i < T_j for every other candidate j considered), estimated
by Monte Carlo: SAMPLES draws of the N layout-specific errors (covariance J C J' + rho^2 I)
from numpy's default_rng(SEED), so the same inputs give the same probabilities. The
candidates considered are the fastest ones predicted within WINDOW of the best (at most
MAX_CONTENDERS); their P(best) sum to 1, layouts outside the window are taken to lose.
When the pick's P(best) is below THRESHOLD, the leading candidates cannot be told apart by
the model: a short trial of each decides (`piper plan --shortlist auto`).

Shape letters: N candidates, K fitted constants, S samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.specs import SpecError

WINDOW = 0.15  # candidates predicted within 15% of the best step are considered
MAX_CONTENDERS = 12  # of those, the fastest (each costs 1 + K estimates for its g)
RESIDUAL_SHARE = 0.71  # rho / s_loo (module docstring)
THRESHOLD = 0.5  # below it the pick is not told apart from the next candidates
SAMPLES = 20000  # Monte Carlo draws: a probability's standard error <= 0.0036
SEED = 0  # fixed: same inputs, same P(best)
SHORTLIST_PROBABILITY = 0.9  # --shortlist auto: trials until this much P(best) is covered


def p_best(
    log_step_N: Sequence[float],
    jac_NK: np.ndarray,
    cov_KK: np.ndarray,
    residual_sd: float,
    samples: int = SAMPLES,
    seed: int = SEED,
) -> tuple[float, ...]:
    """P(candidate i is the fastest) for each of N candidates (module docstring).

    Args:
        log_step_N: log of each candidate's predicted step time (s).
        jac_NK: d log(step) / d t_k per candidate and fitted constant (K may be 0).
        cov_KK: the constants' covariance in t.
        residual_sd: rho, each layout's own log-error sd (>= 0).
        samples, seed: the Monte Carlo draws and the generator's seed.
    Returns:
        N probabilities summing to 1 (a draw's exact tie is shared by the tied candidates).
    """
    mu = np.asarray(log_step_N, dtype=float)
    if mu.ndim != 1 or not len(mu):
        raise SpecError("p_best: give at least one candidate")
    if not residual_sd >= 0:
        raise SpecError(f"p_best: residual sd {residual_sd} must be >= 0")
    jac = np.asarray(jac_NK, dtype=float).reshape(len(mu), -1)
    cov = np.asarray(cov_KK, dtype=float).reshape(jac.shape[1], jac.shape[1])
    sigma_NN = jac @ cov @ jac.T + residual_sd**2 * np.eye(len(mu))
    w, v = np.linalg.eigh((sigma_NN + sigma_NN.T) / 2)
    root_NN = v * np.sqrt(np.clip(w, 0.0, None))
    z_SN = np.random.default_rng(seed).standard_normal((samples, len(mu)))
    draws_SN = mu + z_SN @ root_NN.T
    won_SN = draws_SN == draws_SN.min(axis=1, keepdims=True)
    share_SN = won_SN / won_SN.sum(axis=1, keepdims=True)
    return tuple(float(p) for p in share_SN.mean(axis=0))


def leading(probabilities: Sequence[float], probability: float) -> tuple[int, ...]:
    """The fewest candidates whose summed P(best) reaches `probability`: indices by P(best),
    highest first (ties by index); the pick (index 0) is always among them."""
    if not 0 < probability <= 1:
        raise SpecError(f"shortlist probability {probability}: give a number in (0, 1], e.g. 0.9")
    order = sorted(range(len(probabilities)), key=lambda i: (-probabilities[i], i))
    chosen: list[int] = []
    total = 0.0
    for i in order:
        chosen.append(i)
        total += probabilities[i]
        if total >= probability - 1e-12:
            break
    if 0 not in chosen:  # the pick is run first whatever its odds
        chosen = [0, *chosen[:-1]] if len(chosen) > 1 else [0]
    return tuple(sorted(chosen, key=lambda i: (i != 0, -probabilities[i], i)))


@dataclass(frozen=True)
class Contender:
    """One candidate considered: its layout text, predicted step and P(best)."""

    layout: str
    step_time_s: float
    p_best: float
    order: int  # the candidate's enumeration order (its row in candidates.csv)


@dataclass(frozen=True)
class Odds:
    """P(best) of the leading candidates, the pick first (module docstring).

    residual_log_sd: rho; shared_log_sd: the rest of s_loo (sqrt(s_loo^2 - rho^2)), which
    does not change the ranking; constants: the fitted constants whose covariance is used.
    """

    contenders: tuple[Contender, ...]
    residual_log_sd: float
    shared_log_sd: float
    constants: tuple[str, ...]
    window: float = WINDOW
    threshold: float = THRESHOLD
    samples: int = SAMPLES

    @property
    def pick_p_best(self) -> float:
        return self.contenders[0].p_best

    @property
    def told_apart(self) -> bool:
        return self.pick_p_best >= self.threshold

    def leading(self, probability: float) -> tuple[Contender, ...]:
        """The fewest contenders whose summed P(best) reaches `probability` (pick first)."""
        idx = leading([c.p_best for c in self.contenders], probability)
        return tuple(self.contenders[i] for i in idx)

    def to_dict(self) -> dict[str, Any]:
        """plan.json's `extra.pick` (planner/PLANNING.md, "The pick under uncertainty")."""
        return {
            "p_best": round(self.pick_p_best, 4),
            "told_apart": self.told_apart,
            "threshold": self.threshold,
            "window": self.window,
            "residual_log_sd": round(self.residual_log_sd, 6),
            "shared_log_sd": round(self.shared_log_sd, 6),
            "samples": self.samples,
            "seed": SEED,
            "contenders": [
                {
                    "layout": c.layout,
                    "step_time_s": round(c.step_time_s, 6),
                    "p_best": round(c.p_best, 4),
                }
                for c in self.contenders
            ],  # fmt: skip
        }


def tie_line(odds: Mapping[str, Any] | Odds, shown: int = 4) -> str:
    """The line "the leading 3 candidates cannot be told apart (P(best) 0.31, 0.27, 0.22)"
    when the pick's P(best) is below the threshold, else "" (from Odds or plan.json's extra.pick).
    The leading candidates are the fewest whose summed P(best) reaches
    SHORTLIST_PROBABILITY, the pick first; at most `shown` probabilities are listed."""
    d = odds.to_dict() if isinstance(odds, Odds) else odds
    p = [float(c["p_best"]) for c in d.get("contenders", ())]
    if not p or float(d["p_best"]) >= float(d["threshold"]):
        return ""
    idx = leading(p, SHORTLIST_PROBABILITY)
    values = ", ".join(f"{p[i]:.2f}" for i in idx[:shown]) + (", ..." if len(idx) > shown else "")
    return (f"the leading {len(idx)} candidates cannot be told apart (P(best) {values}; "
            f"together {sum(p[i] for i in idx):.2f}): the pick is the best predicted, its "
            f"P(best) below {float(d['threshold']):.2f}; `--shortlist auto` writes a short "
            "trial of each")  # fmt: skip


def odds_line(odds: Mapping[str, Any]) -> str:
    """One line: the pick's P(best) among the candidates considered."""
    n = len(odds["contenders"])
    if n == 1:
        return (f"P(best) 1.00: no other layout predicted within {odds['window']:.0%} of its "
                "step")  # fmt: skip
    return (f"P(best) {float(odds['p_best']):.2f} among the {n} layouts predicted within "
            f"{float(odds['window']):.0%} of its step (layout-specific log-error sd "
            f"{float(odds['residual_log_sd']):.3f}; planner/PLANNING.md)")  # fmt: skip


def check_log_steps(steps_s: Sequence[float]) -> list[float]:
    """log of each predicted step (s); SpecError for one that is not positive and finite."""
    out = []
    for x in steps_s:
        if not (x > 0 and math.isfinite(x)):
            raise SpecError(f"p_best: predicted step {x} s must be a positive finite number")
        out.append(math.log(x))
    return out
