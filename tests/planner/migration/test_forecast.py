"""Forecasts use the past only and behave as documented on hand-made histories."""

from __future__ import annotations

import numpy as np
import pytest

from planner.migration.forecast import ForecastOptions, forecast_loads


def test_constant_shares_are_forecast_exactly_at_the_last_total():
    history_TE = np.array([[10, 30, 60], [20, 60, 120], [5, 15, 30]])
    for method in ("kalman", "ema", "last", "mean"):
        got = forecast_loads(history_TE, ForecastOptions(method=method))
        assert np.allclose(got, [5, 15, 30])


def test_ema_weights_the_newest_interval_by_alpha():
    history_TE = np.array([[50, 50], [70, 30]])
    got = forecast_loads(history_TE, ForecastOptions(method="ema", alpha=0.5, shift_tv=1.0))
    assert np.allclose(got, [60, 40])


def test_regime_shift_restarts_from_the_newest_interval():
    history_TE = np.array([[90, 10], [90, 10], [10, 90]])  # TV distance 0.8 > 0.25
    for method in ("kalman", "ema"):
        got = forecast_loads(history_TE, ForecastOptions(method=method))
        assert np.allclose(got, [10, 90])


def test_kalman_follows_drift_and_averages_noise():
    rng = np.random.default_rng(0)
    # pure counting noise around fixed shares: the filter averages (beats the last interval)
    shares = np.array([0.4, 0.3, 0.2, 0.1])
    noisy = np.stack([rng.multinomial(400, shares) for _ in range(20)])
    err_kalman = np.abs(forecast_loads(noisy) / 400 - shares).sum()
    err_last = np.abs(noisy[-1] / 400 - shares).sum()
    assert err_kalman < err_last
    # a steady trend without noise: the filter tracks the newest interval closely
    trend = np.stack([[1000 + 100 * t, 1000, 1000 - 50 * t] for t in range(10)])
    got = forecast_loads(trend)
    assert np.abs(got - trend[-1]).max() < 0.05 * trend[-1].max()


def test_needs_a_past_interval():
    with pytest.raises(ValueError):
        forecast_loads(np.zeros((0, 3)))


def test_a_revived_expert_is_followed():
    # 64 drifting experts, 20000 tokens an interval; expert 0 is dead for six intervals,
    # then the router revives it at 5% of the tokens: the forecast follows it (a drift
    # proportional to the old share alone would keep it at zero)
    rng = np.random.default_rng(0)
    share = rng.dirichlet(np.ones(64))
    rows = []
    for t in range(9):
        share = share * np.exp(rng.normal(0, 0.15, 64))
        s = share / share.sum()
        s[0] = 0.0 if t < 6 else 0.05
        rows.append(rng.multinomial(20000, s / s.sum()))
    tokens = np.array(rows)
    assert tokens[:6, 0].sum() == 0 and tokens[6:, 0].min() > 800
    assert forecast_loads(tokens)[0] == pytest.approx(tokens[6:, 0].mean(), rel=0.1)
