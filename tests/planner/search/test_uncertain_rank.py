"""P(best) under the stated error model: sums to one, deterministic, ties split evenly, a clear
winner near one, the shared part of the error cancels; the shortlist size and the tie line."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.search.uncertain_rank import (
    THRESHOLD,
    Contender,
    Odds,
    leading,
    p_best,
    tie_line,
)
from planner.specs import SpecError

COV = np.array([[0.04, 0.01], [0.01, 0.09]])  # two constants, sd 0.2 and 0.3


def test_p_best_sums_to_one_and_is_deterministic():
    logs = [math.log(x) for x in (10.0, 10.3, 10.6, 11.0)]
    jac = np.array([[0.5, 0.1], [0.2, 0.6], [0.4, 0.4], [0.0, 0.9]])
    first = p_best(logs, jac, COV, 0.06)
    assert sum(first) == pytest.approx(1.0, abs=1e-12)
    assert first == p_best(logs, jac, COV, 0.06)  # same inputs, same numbers, bit for bit
    assert first[0] == max(first) and all(0 < p < 1 for p in first)


def test_equal_predictions_and_equal_g_split_evenly():
    jac = np.array([[0.5, 0.3], [0.5, 0.3]])  # the constants move both alike: no difference
    p = p_best([math.log(20.0)] * 2, jac, COV, 0.06)
    assert p == pytest.approx((0.5, 0.5), abs=0.01)


def test_a_candidate_30_percent_faster_with_small_sigma_wins():
    p = p_best([math.log(10.0), math.log(13.0)], np.zeros((2, 0)), np.zeros((0, 0)), 0.05)
    z = math.log(1.3) / (0.05 * math.sqrt(2))  # 3.7 sds of the difference
    assert p[0] == pytest.approx(0.5 * (1 + math.erf(z / math.sqrt(2))), abs=1e-3)
    assert p[0] > 0.999


def test_the_shared_error_cancels_and_the_difference_in_g_counts():
    # a large constants' covariance moves both layouts alike when their g are equal: 5% apart
    # with a small residual is then a clear win; with opposite g the same covariance makes
    # the difference sd sqrt((g1 - g2)' C (g1 - g2)) = 2 x 0.2 x 1 = 0.4 and the odds even out
    logs = [math.log(10.0), math.log(10.5)]
    big = np.diag([0.04, 0.04])
    same = p_best(logs, np.array([[1.0, 0.0], [1.0, 0.0]]), big, 0.01)
    apart = p_best(logs, np.array([[1.0, 0.0], [-1.0, 0.0]]), big, 0.01)
    assert same[0] > 0.999
    z = math.log(10.5 / 10.0) / math.sqrt(0.4**2 + 2 * 0.01**2)
    assert apart[0] == pytest.approx(0.5 * (1 + math.erf(z / math.sqrt(2))), abs=0.01)


def test_exact_ties_are_shared():
    assert p_best([1.0, 1.0, 2.0], np.zeros((3, 0)), np.zeros((0, 0)), 0.0) == (0.5, 0.5, 0.0)


def test_bad_inputs_are_spec_errors():
    with pytest.raises(SpecError, match="at least one candidate"):
        p_best([], np.zeros((0, 0)), np.zeros((0, 0)), 0.1)
    with pytest.raises(SpecError, match="residual sd"):
        p_best([1.0], np.zeros((1, 0)), np.zeros((0, 0)), -0.1)
    with pytest.raises(SpecError, match=r"\(0, 1\]"):
        leading([0.5, 0.5], 0.0)


def test_leading_is_the_fewest_reaching_the_probability_pick_first():
    p = [0.30, 0.35, 0.20, 0.10, 0.05]
    assert leading(p, 0.9) == (0, 1, 2, 3)  # 0.35 + 0.30 + 0.20 = 0.85 < 0.9; + 0.10 = 0.95
    assert leading(p, 0.6) == (0, 1)
    assert leading(p, 0.3) == (0,)  # 0.35 alone would do, but the pick is always run: 0.30
    assert leading([0.97, 0.03], 0.9) == (0,)


def _odds(*p_best_values: float) -> Odds:
    cands = tuple(Contender(f"layout {i}", 10.0 + i, p, i) for i, p in enumerate(p_best_values))
    return Odds(cands, 0.06, 0.06, ())


def test_the_tie_line_appears_only_below_the_threshold():
    tied = tie_line(_odds(0.31, 0.27, 0.22, 0.12, 0.08))
    assert tied.startswith(
        "the leading 4 candidates cannot be told apart (P(best) 0.31, 0.27, 0.22"
    )
    assert "together 0.92" in tied
    assert tie_line(_odds(THRESHOLD, 0.3, 0.2)) == ""
    assert tie_line(_odds(0.9, 0.1)) == ""
    assert tie_line(_odds(0.49, 0.51)) != ""
    assert tie_line(_odds(0.31, 0.27, 0.22, 0.12, 0.08).to_dict()) == tied  # as plan.json holds
