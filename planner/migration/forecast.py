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
    return _kalman_path(shares_TE, totals_T, shift_tv)[0]


def _kalman_path(shares_TE: np.ndarray, totals_T: np.ndarray, shift_tv: float):
    """The filter's forecast after the last interval (E,) and its one-step predictions
    (T, E): row t forecasts interval t from intervals < t (row 0: interval 0 itself)."""
    kappa = _drift_kappa(shares_TE, totals_T)
    counts_T = np.maximum(totals_T, 1)
    est_E = shares_TE[0].copy()
    var_E = est_E / counts_T[0]
    preds_TE = np.empty_like(shares_TE)  # the estimates, normalized after the loop
    preds_TE[0] = est_E
    for t in range(1, shares_TE.shape[0]):
        s_E, n = shares_TE[t], counts_T[t]
        preds_TE[t] = est_E
        step_E = s_E - est_E
        if 0.5 * np.abs(step_E).sum() > shift_tv:
            est_E, var_E = s_E.copy(), s_E / n
            continue
        # drift and counting noise scale with the larger of the estimate and the newest
        # share: with the estimate alone, an expert the router left dead (share 0) would
        # keep a zero forecast after the router revives it, as recorded traces show
        top_E = np.maximum(est_E, s_E)
        prior_E = var_E + kappa * top_E**2
        gain_E = prior_E / (prior_E + np.maximum(top_E, 1e-12) / n)
        est_E = est_E + gain_E * step_E
        var_E = (1.0 - gain_E) * prior_E
    preds_TE[1:] /= np.maximum(preds_TE[1:].sum(axis=1, keepdims=True), 1e-300)
    return est_E / est_E.sum(), preds_TE


# smoothing constants of the per-step moving averages `forecast_interval` chooses among
STEP_ALPHAS = (1.0, 0.5, 0.3, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02, 0.012, 0.008, 0.005)


def interval_sums(history_TE: np.ndarray, rows_per_interval: int) -> np.ndarray:
    """The rows summed into intervals of `rows_per_interval` rows, aligned to the newest row
    (older rows that fill no whole interval are left out)."""
    k = max(1, rows_per_interval)
    n = history_TE.shape[0] // k
    rows_TE = history_TE[history_TE.shape[0] - n * k :]
    return rows_TE.reshape(n, k, history_TE.shape[1]).sum(axis=1)


def forecast_interval(
    history_TE: np.ndarray, rows_per_interval: int = 1, opts: ForecastOptions | None = None
) -> np.ndarray:
    """Expected tokens per expert (E,) over the next interval, scaled to the last interval's
    tokens. Each row of `history_TE` is an interval (rows_per_interval 1: forecast_loads) or
    a step, `rows_per_interval` of them one interval, aligned to the newest row.

    From steps, method "kalman" picks the forecast whose forecasts of the past intervals
    were closest (sum of squared share errors): a moving average of the per-step shares for
    each of STEP_ALPHAS, taken at the start of each past interval, or the Kalman filter on
    the interval sums. While no past interval can be scored (the first decision), the same
    choice is made on the halves of the one interval: each moving average of its first half
    against the first half's sum, as forecasts of the second half. Steps show a
    router's newest state, which the interval sum averages away (a collapsing router), but
    also its step-to-step swings, which the interval sum averages out (the aux-loss-free
    bias overshooting each step); which one predicts better is measured, not assumed.
    """
    opts = opts or ForecastOptions()
    k = max(1, rows_per_interval)
    if k == 1:
        return forecast_loads(history_TE, opts)
    if history_TE.shape[0] < k:
        raise ValueError(f"forecast_interval needs at least one interval ({k} rows)")
    intervals_IE = interval_sums(history_TE, k)  # aligned to the newest row
    if opts.method != "kalman":
        return forecast_loads(intervals_IE, opts)  # scaled to the last interval's tokens
    total = float(intervals_IE[-1].sum())
    return _select_step_forecast(history_TE.astype(float), intervals_IE, k, opts) * total


def _select_step_forecast(rows_TE, intervals_IE, k: int, opts: ForecastOptions) -> np.ndarray:
    num_i = intervals_IE.shape[0]
    target_IE = _shares(intervals_IE)
    kalman_E, preds_IE = _kalman_path(
        target_IE, intervals_IE.sum(axis=1).astype(float), opts.shift_tv
    )
    a_A1 = np.array(STEP_ALPHAS)[:, None]
    if num_i < 2:
        return _select_in_interval(rows_TE[-k:], k // 2, a_A1, kalman_E)
    avg_AIE = _interval_averages(_shares(rows_TE), num_i, k, a_A1)
    # the average at the start of interval i + 1 (after block i) forecasts interval i + 1
    err_A = ((avg_AIE[:, :-1] - target_IE[None, 1:]) ** 2).sum(axis=(1, 2))
    kalman_err = float(((preds_IE[1:] - target_IE[1:]) ** 2).sum())
    best = int(np.argmin(err_A))
    if kalman_err <= err_A[best]:
        return kalman_E
    return avg_AIE[best, -1] / max(float(avg_AIE[best, -1].sum()), 1e-300)


def _interval_averages(shares_TE, num_i: int, k: int, a_A1: np.ndarray) -> np.ndarray:
    """(A, I, E): each moving average of the per-step shares, started at row 0, after the
    last row of each of the num_i newest k-row intervals. Every block of k rows adds the
    same weights, so the blocks' additions are one product and each interval one step
    avg_i = (1 - a)^k avg_(i-1) + addition_i."""
    first = shares_TE.shape[0] - num_i * k  # row where interval 0 starts
    start_AE = np.repeat(shares_TE[:1], a_A1.shape[0], axis=0)
    blocks_IKE = shares_TE[first + k :].reshape(num_i - 1, k, shares_TE.shape[1])
    weight_AK = a_A1 * (1.0 - a_A1) ** np.arange(k - 1, -1, -1)[None, :]
    add_AIE = np.tensordot(weight_AK, blocks_IKE, axes=([1], [1]))
    keep_A1 = (1.0 - a_A1) ** k
    avg_AIE = np.empty((a_A1.shape[0], num_i, shares_TE.shape[1]))
    avg_AIE[:, 0] = _averaged(start_AE, shares_TE[1 : first + k], a_A1)
    for i in range(1, num_i):
        avg_AIE[:, i] = keep_A1 * avg_AIE[:, i - 1] + add_AIE[:, i - 1]
    return avg_AIE


def _averaged(avg_AE: np.ndarray, block_NE: np.ndarray, a_A1: np.ndarray) -> np.ndarray:
    """The moving averages (one per smoothing constant) after the rows of `block_NE`:
    over n rows avg <- (1 - a)^n avg + sum_j a (1 - a)^(n - 1 - j) s_j."""
    n = block_NE.shape[0]
    weight_AN = a_A1 * (1.0 - a_A1) ** np.arange(n - 1, -1, -1)[None, :]
    return (1.0 - a_A1) ** n * avg_AE + weight_AN @ block_NE


def _select_in_interval(rows_KE, half: int, a_A1, kalman_E: np.ndarray) -> np.ndarray:
    """The first decision's choice, on the halves of its one interval (`rows_KE`, tokens, one
    row per step): the first half's sum (what the Kalman filter gives from one interval) against
    each moving average of its rows, as forecasts of the second half's shares; the winner
    is then taken over the whole interval (the Kalman filter: `kalman_E`)."""
    if half < 1:
        return kalman_E
    shares_KE = _shares(rows_KE)
    halves = np.split(rows_KE, [half])
    first_E, target_E = (_shares(r.sum(axis=0, keepdims=True))[0] for r in halves)
    sum_err = float(((first_E - target_E) ** 2).sum())
    start_AE = np.repeat(shares_KE[:1], a_A1.shape[0], axis=0)
    avg_AE = _averaged(start_AE, shares_KE[1:half], a_A1)
    err_A = ((avg_AE - target_E) ** 2).sum(axis=1)
    best = int(np.argmin(err_A))
    if sum_err <= err_A[best]:
        return kalman_E
    avg_E = _averaged(avg_AE[best : best + 1], shares_KE[half:], a_A1[best : best + 1])[0]
    return avg_E / max(float(avg_E.sum()), 1e-300)
