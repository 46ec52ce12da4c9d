"""Forecast the next interval's expert loads from past intervals only.

Method "kalman" (default): each expert's load SHARE (tokens / interval total) is a random
walk observed with sampling noise (a local-level model). Observation variance is the
counting noise share / tokens; the walk's variance is kappa * share^2 (popularity drifts
multiplicatively), kappa estimated from the past intervals' squared changes minus their
counting noise. The filter then weighs the newest interval against the running estimate by
their variances: it averages noise away when intervals are small and follows the last
interval when drift dominates. When the newest shares differ from the estimate by more than
`shift_tv` in total-variation distance (a regime shift), it restarts from them. Drift and
counting noise are taken at the larger of the estimate and the newest share, so an expert
that was dead (share 0) is followed when the router revives it.
"ema" is a plain moving average with newest weight `alpha` (same restart rule), "last"
trusts the last interval, "mean" averages all past intervals.
The forecast is returned in tokens, scaled to the last interval's total.

Shape letters: T = past intervals, E = experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

ForecastMethod = Literal["kalman", "ema", "last", "mean"]


@dataclass(frozen=True)
class ForecastOptions:
    method: ForecastMethod = "kalman"
    alpha: float = 0.5  # weight of the newest interval in the moving average
    shift_tv: float = 0.25  # total-variation distance that counts as a regime shift


def _shares(tokens_TE: np.ndarray) -> np.ndarray:
    totals_T = tokens_TE.sum(axis=1, keepdims=True).astype(float)
    num_e = tokens_TE.shape[1]
    return np.where(totals_T > 0, tokens_TE / np.maximum(totals_T, 1e-300), 1.0 / num_e)


def forecast_loads(history_TE: np.ndarray, opts: ForecastOptions | None = None) -> np.ndarray:
    """Expected tokens per expert (E,) in the next interval, from `history_TE` (T >= 1)."""
    opts = opts or ForecastOptions()
    if history_TE.shape[0] == 0:
        raise ValueError("forecast_loads needs at least one past interval")
    shares_TE = _shares(history_TE)
    total = float(history_TE[-1].sum())
    if opts.method == "last":
        return shares_TE[-1] * total
    if opts.method == "mean":
        return shares_TE.mean(axis=0) * total
    if opts.method == "kalman":
        return _kalman(shares_TE, history_TE.sum(axis=1).astype(float), opts.shift_tv) * total
    avg_E = shares_TE[0].copy()
    for s_E in shares_TE[1:]:
        if 0.5 * np.abs(s_E - avg_E).sum() > opts.shift_tv:
            avg_E = s_E.copy()
        else:
            avg_E = opts.alpha * s_E + (1.0 - opts.alpha) * avg_E
    return avg_E * total


def _drift_kappa(shares_TE: np.ndarray, totals_T: np.ndarray) -> float:
    """Relative random-walk variance per interval: E[dS^2] = kappa S^2 + counting noise."""
    if shares_TE.shape[0] < 2:
        return 0.0
    diff2 = (np.diff(shares_TE, axis=0) ** 2).sum()
    mid_TE = 0.5 * (shares_TE[1:] + shares_TE[:-1])
    noise = (
        mid_TE * (1.0 / np.maximum(totals_T[1:], 1) + 1.0 / np.maximum(totals_T[:-1], 1))[:, None]
    ).sum()
    return max(0.0, float(diff2 - noise)) / max(float((mid_TE**2).sum()), 1e-300)


def _kalman(shares_TE: np.ndarray, totals_T: np.ndarray, shift_tv: float) -> np.ndarray:
    kappa = _drift_kappa(shares_TE, totals_T)
    est_E = shares_TE[0].copy()
    var_E = est_E / max(totals_T[0], 1)
    for s_E, n in zip(shares_TE[1:], totals_T[1:], strict=True):
        if 0.5 * np.abs(s_E - est_E).sum() > shift_tv:
            est_E, var_E = s_E.copy(), s_E / max(n, 1)
            continue
        # drift and counting noise scale with the larger of the estimate and the newest
        # share: with the estimate alone, an expert the router left dead (share 0) would
        # keep a zero forecast after the router revives it, as recorded traces show
        top_E = np.maximum(est_E, s_E)
        prior_E = var_E + kappa * top_E**2
        noise_E = np.maximum(top_E, 1e-12) / max(n, 1)
        gain_E = prior_E / (prior_E + noise_E)
        est_E = est_E + gain_E * (s_E - est_E)
        var_E = (1.0 - gain_E) * prior_E
    return est_E / est_E.sum()
