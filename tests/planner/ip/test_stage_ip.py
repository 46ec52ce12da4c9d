"""Stage IP and its DP against brute-force enumeration of every split and recompute choice."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.ip import stage_dp
from planner.ip.solvers import SolverOptions
from planner.ip.stage_ip import (
    solve_stages,
    stage_memory_bytes,
    stage_solution_dp,
    stage_time_s,
)
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost

GIB = 2**30
CPSAT = SolverOptions(backend="cpsat", time_limit_s=10, threads=1, seed=0)
CBC = SolverOptions(backend="cbc", time_limit_s=10, threads=1, seed=0)


def random_inputs(
    rng: random.Random, num_layers: int, pp: int, classes: int | None
) -> StageCostInputs:
    """Random layers (from `classes` kinds, or all distinct), extras and a borderline memory."""
    kinds = [
        (
            rng.uniform(1, 5),
            rng.uniform(0, 2),
            rng.uniform(0.5, 3) * GIB,
            rng.uniform(0.2, 2) * GIB,
            rng.uniform(0, 1),
        )
        for _ in range(classes or num_layers)
    ]
    units = []
    for i in range(num_layers):
        t, dt, state, act, frac = kinds[rng.randrange(len(kinds)) if classes else i]
        units.append(UnitCost(i, "moe", t, t + dt, state, act, act * frac))
    first = StageExtras(rng.uniform(0, 2), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    last = StageExtras(rng.uniform(0, 3), rng.uniform(0, 2) * GIB, rng.uniform(0, 1) * GIB)
    m = rng.choice([1, 2, 8])
    rec = rng.random() < 0.7
    probe = StageCostInputs(tuple(units), first, last, 1e30, pp, m, rec)
    lo, hi = _memory_range(probe)
    cap = rng.uniform(lo * 0.95, hi * 1.05)
    return StageCostInputs(tuple(units), first, last, cap, pp, m, rec)


def _splits(num_layers: int, pp: int, min_layers: int = 1):
    for cuts in itertools.combinations(range(1, num_layers), pp - 1):
        bounds = (0,) + cuts + (num_layers,)
        if all(b - a >= min_layers for a, b in itertools.pairwise(bounds)):
            yield [tuple(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _recompute_sets(inputs: StageCostInputs):
    n = len(inputs.units)
    if not inputs.recompute_allowed:
        yield frozenset()
        return
    for mask in range(2**n):
        yield frozenset(i for i in range(n) if mask >> i & 1)


def _memory_range(inputs: StageCostInputs) -> tuple[float, float]:
    """Smallest and largest 'worst stage memory' over all splits (full recompute vs none)."""
    n = len(inputs.units)
    worst = []
    for stages in _splits(n, inputs.pp):
        for rec in (frozenset(range(n)), frozenset()):
            worst.append(
                max(stage_memory_bytes(inputs, s, lay, rec) for s, lay in enumerate(stages))
            )
    return min(worst), max(worst)


def brute_force(inputs: StageCostInputs) -> float:
    """Min bottleneck time over every contiguous split (stages of >= vp layers) and recompute
    set that fits (inf: none)."""
    best = math.inf
    for stages in _splits(len(inputs.units), inputs.pp, inputs.vp):
        for rec in _recompute_sets(inputs):
            mems = [stage_memory_bytes(inputs, s, lay, rec) for s, lay in enumerate(stages)]
            if max(mems) > inputs.usable_memory_bytes:
                continue
            best = min(best, max(stage_time_s(inputs, s, lay, rec) for s, lay in enumerate(stages)))
    return best


def check_solution(inputs: StageCostInputs, sol) -> None:
    """The returned split is contiguous, covers all layers, fits, and its numbers add up."""
    flat = [i for stage in sol.stage_layers for i in stage]
    assert flat == list(range(len(inputs.units)))
    assert len(sol.stage_layers) == inputs.pp
    assert all(len(stage) >= inputs.vp for stage in sol.stage_layers)
    for s, (lay, rec) in enumerate(zip(sol.stage_layers, sol.recompute_layers, strict=True)):
        assert set(rec) <= set(lay)
        assert not rec or inputs.recompute_allowed
        mem = stage_memory_bytes(inputs, s, lay, set(rec))
        assert mem <= inputs.usable_memory_bytes * (1 + 1e-9)
        assert sol.stage_memory_bytes[s] == pytest.approx(mem)
        assert sol.stage_time_s[s] == pytest.approx(stage_time_s(inputs, s, lay, set(rec)))
    assert sol.bottleneck_s == pytest.approx(max(sol.stage_time_s))


def _cases(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 6)
        pp = rng.randint(1, min(n, 4))
        yield random_inputs(rng, n, pp, rng.choice([None, 1, 2, 3]))


@pytest.mark.parametrize("seed", range(4))
def test_ip_equals_brute_force(seed):
    """120 random instances: the CP-SAT optimum equals enumeration (or both are infeasible)."""
    for inputs in _cases(30, seed):
        want = brute_force(inputs)
        sol = solve_stages(inputs, CPSAT)
        if want == math.inf:
            assert sol.report.status == "INFEASIBLE" and "needs" in sol.reason
            continue
        assert sol.report.status == "OPTIMAL", sol.report
        assert sol.bottleneck_s == pytest.approx(want, rel=1e-5)
        assert sol.report.objective == pytest.approx(want, rel=1e-5)
        check_solution(inputs, sol)


def test_dp_equals_brute_force():
    """100 more instances through the exact DP alone (the search's fast path)."""
    for inputs in _cases(100, 99):
        want = brute_force(inputs)
        sol = stage_solution_dp(inputs)
        if want == math.inf:
            assert sol.report.status == "INFEASIBLE"
            continue
        assert sol.report.status == "OPTIMAL" and sol.report.backend == "dp"
        assert sol.bottleneck_s == pytest.approx(want, rel=1e-5)
        check_solution(inputs, sol)


@pytest.mark.parametrize("vp", [2, 3])
def test_stages_keep_one_layer_per_interleaved_chunk(vp):
    """With vp chunks per pipeline rank every stage holds >= vp layers: IP and DP equal the
    enumeration of such splits on 40 random instances (in-flight counts of interleaved 1F1B);
    pp * vp > layers has no split."""
    rng = random.Random(vp)
    for _ in range(40):
        pp = rng.randint(2, 3)
        base = random_inputs(rng, rng.randint(pp * vp, pp * vp + 3), pp, rng.choice([None, 2]))
        inputs = replace(base, vp=vp, num_microbatches=pp * rng.randint(1, 3))
        want = brute_force(inputs)
        for sol in (solve_stages(inputs, CPSAT), stage_solution_dp(inputs)):
            if want == math.inf:
                assert sol.report.status == "INFEASIBLE"
                continue
            assert sol.report.status == "OPTIMAL", sol.report
            assert sol.bottleneck_s == pytest.approx(want, rel=1e-5)
            check_solution(inputs, sol)
    too_deep = replace(_uniform(5, 3, 1000), vp=vp)
    sol = stage_solution_dp(too_deep)
    assert sol.report.status == "INFEASIBLE" and f">= {vp} layers" in sol.reason


def test_ip_without_exact_dp_still_optimal(monkeypatch):
    """With the DP forced to its greedy fallback, the IP alone must still find the optimum."""
    monkeypatch.setattr(stage_dp, "MAX_COMBOS", 1)
    rng = random.Random(7)
    checked = 0
    for _ in range(25):
        inputs = random_inputs(rng, 6, rng.randint(1, 3), None)
        want = brute_force(inputs)
        sol = solve_stages(inputs, CPSAT)
        if want < math.inf and sol.report.has_solution:
            assert sol.bottleneck_s == pytest.approx(want, rel=1e-5)
            check_solution(inputs, sol)
            checked += 1
    assert checked >= 5


def test_cpsat_and_cbc_agree():
    rng = random.Random(3)
    agreed = 0
    while agreed < 8:
        inputs = random_inputs(rng, rng.randint(3, 6), rng.randint(1, 3), rng.choice([None, 2]))
        a, b = solve_stages(inputs, CPSAT), solve_stages(inputs, CBC)
        assert a.report.status == b.report.status
        if a.report.status == "OPTIMAL":
            assert a.report.objective == pytest.approx(b.report.objective, rel=1e-6)
            assert b.report.backend == "cbc"
            agreed += 1


def _uniform(num_layers: int, pp: int, cap_gib: float, rec: bool = True) -> StageCostInputs:
    units = tuple(
        UnitCost(i, "moe", 1.0, 1.3, 2 * GIB, 1 * GIB, 0.1 * GIB) for i in range(num_layers)
    )
    return StageCostInputs(units, StageExtras(), StageExtras(), cap_gib * GIB, pp, 8, rec)


def test_hand_computed_uniform_split():
    """12 identical layers, pp=4, plenty of memory: 3 layers per stage, bottleneck 3.0 s."""
    sol = solve_stages(_uniform(12, 4, 1000), CPSAT)
    assert [len(s) for s in sol.stage_layers] == [3, 3, 3, 3]
    assert sol.bottleneck_s == pytest.approx(3.0)
    assert sol.recompute_layers == ((), (), (), ())


def test_hand_computed_recompute_on_first_stage():
    """4 layers, pp=2 (in-flight 2 and 1), cap 9 GiB: stage 0 holds 2x(2 + 2x1) = 8 GiB, fine;
    with cap 7.5 GiB stage 0 must recompute one layer (saves 2 x 0.9 GiB) -> time 2.3 s."""
    sol = solve_stages(_uniform(4, 2, 9.0), CPSAT)
    assert [len(s) for s in sol.stage_layers] == [2, 2] and sol.bottleneck_s == pytest.approx(2.0)
    sol = solve_stages(_uniform(4, 2, 7.5), CPSAT)
    assert sol.stage_layers == ((0, 1), (2, 3))
    assert sol.recompute_layers == ((0,), ())
    assert sol.bottleneck_s == pytest.approx(2.3)


def test_infeasible_names_tightest_stage():
    """4 layers, pp=2, 4 GiB: best split needs 2x2 + 2x(2x0.1) = 4.4 GiB on stage 0."""
    sol = solve_stages(_uniform(4, 2, 4.0), CPSAT)
    assert sol.report.status == "INFEASIBLE" and not sol.feasible
    assert sol.stage_layers == ()
    assert sol.reason.startswith("stage 0 needs 4.4 GiB > 4.0 GiB usable (over by 0.4 GiB)")
    sol = solve_stages(_uniform(3, 4, 100.0), CPSAT)
    assert sol.report.status == "INFEASIBLE" and "pp=4 exceeds the 3 layers" in sol.reason


def test_time_limit_returns_solution():
    """A 61-layer, pp=16 instance with a tiny limit still returns a split with its gap."""
    units = tuple(
        UnitCost(
            i,
            "dense" if i < 3 else "moe",
            1.0 if i < 3 else 3.0,
            1.3 if i < 3 else 4.0,
            1 * GIB,
            1.5 * GIB,
            0.15 * GIB,
        )
        for i in range(61)
    )
    inputs = StageCostInputs(
        units, StageExtras(0.5, GIB, 0.3 * GIB), StageExtras(2.0, GIB, GIB), 24 * GIB, 16, 32, True
    )
    for backend in ("cpsat", "cbc"):
        sol = solve_stages(inputs, SolverOptions(backend=backend, time_limit_s=0.01))
        assert sol.report.status in ("OPTIMAL", "FEASIBLE")
        assert sol.report.gap >= 0 and (sol.report.status == "OPTIMAL") == (sol.report.gap == 0)
        check_solution(inputs, sol)


def test_deterministic_across_threads_and_backends():
    """Ties are broken canonically: the same split for any thread count and backend."""
    inputs = _uniform(10, 3, 30)
    sols = [
        solve_stages(inputs, SolverOptions(backend=b, threads=t, seed=s, time_limit_s=10))
        for b, t, s in [("cpsat", 1, 0), ("cpsat", 2, 5), ("cbc", 1, 0), ("cbc", 2, 3)]
    ]
    assert len({(s.stage_layers, s.recompute_layers) for s in sols}) == 1
    assert [len(s) for s in sols[0].stage_layers] == [2, 4, 4]  # shortest early stages first


@st.composite
def stage_inputs(draw) -> StageCostInputs:
    """Any valid StageCostInputs with up to 12 layers (sizes in GiB, times in seconds)."""
    n = draw(st.integers(1, 12))
    pp = draw(st.integers(1, min(n, 6)))
    pos = st.floats(0.0, 4.0, allow_nan=False)
    units = []
    for i in range(n):
        t, dt, state, act = draw(pos), draw(pos), draw(pos), draw(pos)
        frac = draw(st.floats(0.0, 1.0))
        units.append(UnitCost(i, "moe", t, t + dt, state * GIB, act * GIB, act * frac * GIB))
    first = StageExtras(draw(pos), draw(pos) * GIB, draw(pos) * GIB)
    last = StageExtras(draw(pos), draw(pos) * GIB, draw(pos) * GIB)
    cap = draw(st.floats(0.0, 60.0)) * GIB
    return StageCostInputs(
        tuple(units), first, last, cap, pp, draw(st.integers(1, 64)), draw(st.booleans())
    )


@settings(max_examples=40, deadline=None, derandomize=True)
@given(stage_inputs())
def test_property_plans_satisfy_their_constraints(inputs):
    """Random valid inputs: a split that is contiguous, non-empty and fits, whose bottleneck
    the IP and the DP agree on; or INFEASIBLE with a one-line reason from both."""
    dp = stage_solution_dp(inputs)
    ip = solve_stages(inputs, CPSAT)
    assert dp.report.status in ("OPTIMAL", "INFEASIBLE")
    if not dp.feasible:
        assert ip.report.status == "INFEASIBLE" and ip.reason and "\n" not in ip.reason
        return
    check_solution(inputs, dp)
    check_solution(inputs, ip)
    assert ip.report.status == "OPTIMAL"
    assert ip.bottleneck_s == pytest.approx(dp.bottleneck_s, rel=1e-5, abs=1e-9)


def test_a_usable_memory_below_a_byte_is_infeasible_not_an_overflow():
    """Hypothesis found usable_memory_bytes = 2.4e-302 with a 1 GiB head: the memory quantum
    came from the capacity and the demand overflowed int(). It is simply infeasible."""
    from planner.ip.stage_ip import stage_solution_dp
    from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost

    inputs = StageCostInputs(
        units=(UnitCost(0, "moe", 0.0, 0.0, 0.0, 0.0, 0.0),),
        first=StageExtras(),
        last=StageExtras(0.0, 0.0, float(2**30)),
        usable_memory_bytes=2.389154863367977e-302,
        pp=1,
        num_microbatches=1,
        recompute_allowed=False,
    )
    assert stage_dp.quantize_inputs(inputs).cap_q == 0
    assert stage_solution_dp(inputs).report.status == "INFEASIBLE"
