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


def test_per_interval_rows_are_the_plain_forecast():
    from planner.migration.forecast import forecast_interval

    rng = np.random.default_rng(3)
    history_TE = rng.integers(0, 100, size=(7, 5))
    assert np.allclose(forecast_interval(history_TE, 1), forecast_loads(history_TE))


def test_from_steps_a_trend_is_followed_and_a_swing_is_averaged():
    """Per-step rows, 10 steps an interval. A collapsing router (expert 0's share rising
    step by step) is forecast from its newest steps, near where the next interval will be;
    one that swings every step around a fixed share (the bias overshooting) is forecast at
    that share, not at the last step's; with one interval only, the same holds."""
    from planner.migration.forecast import forecast_interval, interval_sums

    k, steps = 10, 40
    share_T = np.linspace(0.3, 0.7, steps + k)  # expert 0's share, rising
    rising_TE = np.stack([1000 * share_T, 1000 * (1 - share_T)], axis=1).round()
    got = forecast_interval(rising_TE[:steps], k)
    truth = rising_TE[steps:].sum(axis=0)  # the next interval
    plain = forecast_loads(interval_sums(rising_TE[:steps], k))
    plain = plain / plain.sum() * got.sum()
    assert abs(got[0] - truth[0]) < 0.6 * abs(plain[0] - truth[0])  # the last step, 0.55
    assert got.sum() == rising_TE[steps - k : steps].sum()  # the last interval's tokens
    swing_T = np.where(np.arange(steps) % 2 == 0, 0.7, 0.3)  # mean 0.5, ends low
    swing_TE = np.stack([1000 * swing_T, 1000 * (1 - swing_T)], axis=1)
    got = forecast_interval(swing_TE, k)
    assert got[0] / got.sum() == pytest.approx(0.5, abs=0.02)
    # one interval alone: its halves choose; the rise is followed within it as well (its own
    # share 0.337, its last step 0.373, the next interval 0.414), the swing is averaged
    one = forecast_interval(rising_TE[:k], k)
    assert one[0] / one.sum() > 0.36 and one.sum() == rising_TE[:k].sum()
    one = forecast_interval(swing_TE[:k], k)
    assert np.allclose(one, swing_TE[:k].sum(axis=0))
    with pytest.raises(ValueError, match="one interval"):
        forecast_interval(rising_TE[: k - 1], k)
