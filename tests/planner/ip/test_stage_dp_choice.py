"""The DP's choice among optimal splits, against enumeration of every split.

solve_dp returns the minimum bottleneck (FORMULATION.md, section 1.4) and, among the splits
that reach it, the one with the fewest recomputed layers and then the shortest early stages
(the earliest stage ends). Both rules are checked here on the quantized data the DP reads:
every contiguous split (stages of >= min_layers layers) is enumerated, and each stage's
fewest recomputed layers within the bottleneck come from every subset of its layers.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from planner.ip import stage_dp
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost

GIB = 2**30


def _inputs(rng: random.Random) -> StageCostInputs:
    n = rng.randint(2, 7)
    pp = rng.randint(1, min(n, 4))
    kinds = [
        (rng.uniform(1, 5), rng.uniform(0, 2), rng.uniform(0.5, 3) * GIB,
         rng.uniform(0.2, 2) * GIB, rng.uniform(0, 1))
        for _ in range(rng.choice([1, 2, 3]))
    ]  # fmt: skip
    units = []
    for i in range(n):
        t, dt, state, act, frac = rng.choice(kinds)
        units.append(UnitCost(i, "moe", t, t + dt, state, act, act * frac))
    first = StageExtras(rng.uniform(0, 2), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    last = StageExtras(rng.uniform(0, 3), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    vp = rng.choice([1, 1, 2]) if 2 * pp <= n else 1
    cap = rng.uniform(4, 14) * GIB
    return StageCostInputs(
        tuple(units), first, last, cap, pp, rng.choice([1, 2, 8]), rng.random() < 0.7, vp
    )


def _fewest_recomputed(data: stage_dp.StageData, s: int, a: int, b: int, limit: int) -> float:
    """Fewest layers of [a, b) recomputed so that stage s fits memory within `limit` time."""
    layers = range(a, b) if data.recompute_allowed else ()
    for r in range(len(layers) + 1):
        for rec in itertools.combinations(layers, r):
            chosen = frozenset(rec)
            if (
                data.stage_mem_q(s, a, b, chosen) <= data.cap_q
                and data.stage_time_q(s, a, b, chosen) <= limit
            ):
                return r
    return math.inf


def _brute_force(data: stage_dp.StageData) -> tuple[float, float, tuple[int, ...] | None]:
    """(min bottleneck, fewest recomputed layers at it, earliest starts with both)."""
    n, pp, k = data.num_layers, data.pp, data.min_layers
    splits = [
        (0, *cuts)
        for cuts in itertools.combinations(range(1, n), pp - 1)
        if all(y - x >= k for x, y in itertools.pairwise((0, *cuts, n)))
    ]
    times = sorted({data.stage_time_q(s, a, b, frozenset(rec))
                    for starts in splits
                    for s, (a, b) in enumerate(itertools.pairwise((*starts, n)))
                    for r in range(b - a + 1)
                    for rec in itertools.combinations(range(a, b), r)})  # fmt: skip
    for limit in times:
        counted = []
        for starts in splits:
            per_stage = [_fewest_recomputed(data, s, a, b, limit)
                         for s, (a, b) in enumerate(itertools.pairwise((*starts, n)))]  # fmt: skip
            counted.append((sum(per_stage), starts))
        best = min(counted)
        if best[0] < math.inf:
            return limit, best[0], best[1]
    return math.inf, math.inf, None


@pytest.mark.parametrize("seed", range(3))
def test_dp_picks_fewest_recomputed_then_earliest_stage_ends(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(60):
        data = stage_dp.quantize_inputs(_inputs(rng))
        limit, fewest, starts = _brute_force(data)
        got = stage_dp.solve_dp(data)
        if starts is None:
            assert got.split is None and got.reason
            continue
        assert got.exact
        split = got.split
        assert data.bottleneck(split) == limit
        assert data.fits(split)
        assert len(split.recomputed) == fewest
        assert split.starts == starts
        checked += 1
    assert checked >= 20  # most random instances have a split
