"""Expert IP against brute-force enumeration of every placement with the given slots."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from planner.ip.expert_ip import cross_node_tokens, slot_counts, solve_experts
from planner.ip.expert_swap import improve_by_swaps, lpt_with_replicas, replicate_then_pack
from planner.ip.solvers import SolverOptions
from planner.specs import SpecError

CPSAT = SolverOptions(backend="cpsat", time_limit_s=10, threads=1, seed=0)
CBC = SolverOptions(backend="cbc", time_limit_s=10, threads=1, seed=0)


def equal_partitions(items: list[int], size: int):
    """Every split of `items` into groups of `size` (groups unordered)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [e for e in rest if e not in others]
        for tail in equal_partitions(left, size):
            yield [(first,) + others] + tail


def brute_balance(load: list[float], ep: int) -> float:
    best = math.inf
    for groups in equal_partitions(list(range(len(load))), len(load) // ep):
        best = min(best, max(sum(load[e] for e in g) for g in groups))
    return best


def brute_traffic(load, ep, nodes, coact, weight) -> float:
    pairs = [(e, f, coact[e][f]) for e in range(len(load)) for f in range(e + 1, len(load))]
    best = math.inf
    for groups in equal_partitions(list(range(len(load))), len(load) // ep):
        for perm in itertools.permutations(range(ep)):
            rank_of = [0] * len(load)
            for g, r in zip(groups, perm, strict=True):
                for e in g:
                    rank_of[e] = r
            hot = max(sum(load[e] for e in g) for g in groups)
            best = min(best, hot + weight * cross_node_tokens(load, rank_of, nodes, pairs))
    return best


def brute_replicas(load, ep, redundant) -> float:
    """Rank r holds slot_counts(E, ep, redundant)[r] distinct experts, every expert at least
    once; an expert's tokens split evenly over its copies."""
    num_e = len(load)
    counts = slot_counts(num_e, ep, redundant)
    best = math.inf
    combos = [itertools.combinations(range(num_e), c) for c in counts]
    for sets in itertools.product(*(list(c) for c in combos)):
        count = [sum(e in s for s in sets) for e in range(num_e)]
        if min(count) == 0:
            continue
        best = min(best, max(sum(load[e] / count[e] for e in s) for s in sets))
    return best


def check_placement(sol, num_e: int, ep: int, redundant: int = 0) -> None:
    per_rank = [sum(1 for _e, r, _s in sol.replicas if r == rank) for rank in range(ep)]
    assert tuple(per_rank) == slot_counts(num_e, ep, redundant)
    assert sol.slots == tuple(
        tuple(sorted(e for e, r, _s in sol.replicas if r == rank)) for rank in range(ep)
    )
    for e in range(num_e):
        shares = [s for ee, _r, s in sol.replicas if ee == e]
        assert sum(shares) == pytest.approx(1.0)
        assert sol.rank_of_expert[e] == min(r for ee, r, _s in sol.replicas if ee == e)
    assert sol.max_rank_load == pytest.approx(max(sol.rank_load))


def _load(rng: random.Random, n: int) -> list[float]:
    kind = rng.choice(["uniform", "skew", "ties"])
    if kind == "ties":
        return [float(rng.randint(1, 4)) for _ in range(n)]
    if kind == "skew":
        return [rng.paretovariate(1.2) * 100 for _ in range(n)]
    return [rng.uniform(10, 20) for _ in range(n)]


def test_balance_equals_brute_force():
    """100 random instances (E <= 8): hottest rank load equals enumeration."""
    rng = random.Random(11)
    for _ in range(100):
        ep = rng.choice([1, 2, 3, 4])
        num_e = ep * rng.randint(1, 8 // ep)
        load = _load(rng, num_e)
        sol = solve_experts(load, ep, CPSAT)
        assert sol.report.status == "OPTIMAL"
        assert sol.max_rank_load == pytest.approx(brute_balance(load, ep), rel=1e-5)
        check_placement(sol, num_e, ep)


def test_traffic_equals_brute_force():
    """30 instances with nodes and co-activation: max load + w x crossings equals enumeration."""
    rng = random.Random(12)
    for _ in range(30):
        ep, nodes = rng.choice([(2, [0, 1]), (3, [0, 0, 1]), (4, [0, 0, 1, 1])])
        num_e = ep * rng.randint(1, 6 // ep if ep < 4 else 1)
        load = _load(rng, num_e)
        upper = [
            [rng.uniform(0, 1) * min(load[e], load[f]) for f in range(num_e)] for e in range(num_e)
        ]
        coact = [
            [upper[min(e, f)][max(e, f)] if e != f else 0 for f in range(num_e)]
            for e in range(num_e)
        ]
        weight = rng.choice([0.1, 0.5, 2.0])
        sol = solve_experts(
            load, ep, CPSAT, node_of_rank=nodes, coactivation_EE=coact, traffic_weight=weight
        )
        assert sol.report.status == "OPTIMAL"
        want = brute_traffic(load, ep, nodes, coact, weight)
        assert sol.objective == pytest.approx(want, rel=1e-5)
        assert sol.report.objective == pytest.approx(want, rel=1e-5)
        check_placement(sol, num_e, ep)


def test_replicas_equal_brute_force():
    """20 instances with a total of redundant slots, one per rank or fewer (unequal slots)."""
    rng = random.Random(13)
    for _ in range(20):
        ep, num_e, redundant = rng.choice([(2, 2, 2), (2, 4, 2), (3, 3, 3), (2, 4, 1), (3, 6, 2)])
        load = _load(rng, num_e)
        sol = solve_experts(load, ep, CPSAT, redundant_slots=redundant)
        assert sol.report.status == "OPTIMAL"
        assert sol.max_rank_load == pytest.approx(brute_replicas(load, ep, redundant), rel=1e-5)
        check_placement(sol, num_e, ep, redundant)


def test_slot_counts_spread_a_total():
    assert slot_counts(256, 64, 32) == (4, 5) * 32  # DeepSeek-V3: 288 slots
    assert slot_counts(8, 4, 6) == (3, 4, 3, 4) and slot_counts(8, 4) == (2,) * 4


def test_uniform_loads_with_redundant_slots_keep_every_rank_at_the_mean():
    """Equal loads: ranks with a redundant slot pair up and share two experts (3 whole + 2
    halves = 4 expert loads on a 5-slot rank), so no rank exceeds the mean."""
    sol = solve_experts([10.0] * 256, 64, CPSAT, redundant_slots=32)
    assert sol.rank_load == (40.0,) * 64 and sol.report.status == "OPTIMAL"
    check_placement(sol, 256, 64, 32)
    assert sum(len(held) for held in sol.slots) == 288


@pytest.mark.parametrize("ep, slots", [(8, 8), (4, 4), (16, 8)])
def test_equal_loads_with_replicas_split_exactly_and_need_no_solve(ep, slots):
    """64 equal experts (OLMoE's layer): 1/64 of the total is an odd number of integer units,
    so halves rounded up left every rank one unit above the mean and CP-SAT ran its whole
    limit (plus the canonical pass) to close that unit. Shares that split exactly meet the
    bound at once."""
    opts = SolverOptions(backend="cpsat", time_limit_s=0.5, threads=1, seed=0)
    sol = solve_experts([1.0] * 64, ep, opts, redundant_slots=slots)
    assert sol.report.message == "greedy placement meets the lower bound"
    assert sol.report.status == "OPTIMAL" and sol.report.gap == 0.0
    assert sol.report.wall_s == 0.0 and sol.rank_load == (64 / ep,) * ep
    check_placement(sol, 64, ep, slots)


def test_replicate_then_pack_warm_start_lands_near_the_mean_on_skewed_loads():
    """Zipf-like loads (64 experts, 8 ranks, 8 redundant slots): LPT with replicas leaves the
    hottest rank 28% above the mean; EPLB's replicate-then-pack 0.14%, and the expert IP,
    warm-started from it, keeps that even when its limit runs out."""
    load = [1e6 / (e + 1) ** 0.8 for e in range(64)]
    mean, slots = sum(load) / 8, slot_counts(64, 8, 8)

    def hottest(held):
        copies = {e: sum(e in v for v in held.values()) for e in range(64)}
        return max(sum(load[e] / copies[e] for e in v) for v in held.values())

    assert hottest(lpt_with_replicas(load, slots, 8, 4)) / mean == pytest.approx(1.2771, abs=1e-4)
    packed = replicate_then_pack(load, slots, 8, 4)
    assert sorted(len(v) for v in packed.values()) == sorted(slots)
    assert hottest(packed) / mean == pytest.approx(1.0014, abs=1e-4)
    sol = solve_experts(load, 8, SolverOptions(time_limit_s=0.5), redundant_slots=8)
    assert sol.max_rank_load <= hottest(packed) * (1 + 1e-9)
    assert sol.report.bound <= sol.max_rank_load and sol.report.gap < 0.002
    check_placement(sol, 64, 8, 8)


def test_a_warm_start_within_accept_gap_of_the_bound_is_kept_without_a_solve():
    load = [1e6 / (e + 1) ** 0.8 for e in range(64)]
    kept = solve_experts(load, 8, CPSAT, redundant_slots=8, accept_gap=0.005)
    assert kept.report.message == "greedy placement within 0.50% of the lower bound"
    assert kept.report.status == "FEASIBLE" and kept.report.wall_s == 0.0
    assert kept.report.gap == pytest.approx(0.0014, abs=1e-4)
    assert kept.report.bound == pytest.approx(sum(load) / 8)
    check_placement(kept, 64, 8, 8)
    tight = solve_experts(load, 8, SolverOptions(time_limit_s=0.3), redundant_slots=8,
                          accept_gap=0.001)  # fmt: skip
    assert "within" not in tight.report.message  # 0.14% > 0.1%: the IP runs


def test_large_replica_instance_returns_the_greedy_with_its_bound():
    """256 x 64 with 32 replicas is not built as an IP: the greedy and an honest gap."""
    rng = random.Random(18)
    load = [rng.paretovariate(1.5) * 1000 for _ in range(256)]
    sol = solve_experts(load, 64, CPSAT, redundant_slots=32)
    assert sol.report.status == "FEASIBLE" and sol.report.bound <= sol.max_rank_load
    check_placement(sol, 256, 64, 32)
    plain = solve_experts(load, 64, SolverOptions(time_limit_s=2.0))
    assert sol.max_rank_load < plain.max_rank_load  # the replicas split the hot experts


def test_hand_computed_replica_split():
    """Loads (9, 1, 2, 0) on 2 ranks x 3 slots: replicate expert 0 (4.5 + 4.5); the best split
    of the rest is {1} / {2, 0} plus the cheapest fill -> ranks 4.5+1+x and 4.5+2+0 = 6.5."""
    sol = solve_experts([9.0, 1.0, 2.0, 0.0], 2, CPSAT, redundant_slots=2)
    assert sol.max_rank_load == pytest.approx(6.5)
    assert sorted(s for e, _r, s in sol.replicas if e == 0) == [0.5, 0.5]


def test_cpsat_and_cbc_agree():
    rng = random.Random(14)
    for _ in range(8):
        ep = rng.choice([2, 4])
        load = _load(rng, ep * 2)
        a, b = solve_experts(load, ep, CPSAT), solve_experts(load, ep, CBC)
        assert a.report.status == b.report.status == "OPTIMAL"
        assert a.max_rank_load == pytest.approx(b.max_rank_load, rel=1e-6)
    load = [3.0, 1.0, 2.0, 2.0]
    coact = [[0, 1, 0, 0], [1, 0, 0, 0.5], [0, 0, 0, 2], [0, 0.5, 2, 0]]
    a, b = (
        solve_experts(load, 2, o, node_of_rank=[0, 1], coactivation_EE=coact, traffic_weight=1.0)
        for o in (CPSAT, CBC)
    )
    assert a.objective == pytest.approx(b.objective, rel=1e-6)


def test_crossings_hand_computed():
    """2 nodes, k=2 tokens: 4 routed copies; the pair (0, 1) co-located saves 1 token;
    half of the distinct (token, node) deliveries are remote."""
    load = [2.0, 1.0, 1.0, 0.0]
    coact = [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    sol = solve_experts(
        load, 2, CPSAT, node_of_rank=[0, 1], coactivation_EE=coact, traffic_weight=10.0
    )
    assert sol.rank_of_expert[0] == sol.rank_of_expert[1]
    assert sol.cross_node_tokens == pytest.approx(0.5 * (4 - 1))


def test_large_instance_returns_with_gap():
    """256 experts on 64 ranks within a 2 s limit: a placement and an honest gap."""
    rng = random.Random(15)
    load = [rng.paretovariate(2.0) * 1000 for _ in range(256)]
    sol = solve_experts(load, 64, SolverOptions(time_limit_s=2.0))
    assert sol.report.status in ("OPTIMAL", "FEASIBLE")
    assert 0 <= sol.report.gap < 0.5 and sol.report.bound <= sol.max_rank_load
    assert sol.max_rank_load >= sum(load) / 64
    check_placement(sol, 256, 64)


def test_time_limit_path_never_empty():
    rng = random.Random(16)
    load = [rng.uniform(1, 100) for _ in range(64)]
    for backend in ("cpsat", "cbc"):
        sol = solve_experts(load, 16, SolverOptions(backend=backend, time_limit_s=0.01))
        assert sol.report.status in ("OPTIMAL", "FEASIBLE")
        check_placement(sol, 64, 16)


def test_same_answer_for_any_threads_and_backend():
    """Many optimal placements tie here; the canonical tie-break picks the same one for any
    thread count, seed and backend."""
    load = [5.0, 4.0, 3.0, 3.0, 2.0, 2.0, 1.0, 1.0]
    coact = [[1.0 if abs(e - f) == 4 else 0.0 for f in range(8)] for e in range(8)]
    runs = [
        SolverOptions(threads=1, seed=0),
        SolverOptions(threads=2, seed=7),
        SolverOptions(backend="cbc", threads=1, seed=3),
    ]
    for kwargs in (
        {},
        {"node_of_rank": [0, 0, 1, 1], "coactivation_EE": coact, "traffic_weight": 0.5},
    ):
        sols = [solve_experts(load, 4, o, **kwargs) for o in runs]
        assert all(s.report.status == "OPTIMAL" for s in sols)
        assert len({s.replicas for s in sols}) == 1
    assert sols[0].max_rank_load == pytest.approx(6.0)


def test_uniform_loads_need_no_search():
    """Uniform loads: the LPT warm start meets the lower bound, proven without a solve."""
    sol = solve_experts([10.0] * 256, 64, CPSAT)
    assert sol.report.status == "OPTIMAL" and "lower bound" in sol.report.message
    assert sol.rank_load == (40.0,) * 64
    check_placement(sol, 256, 64)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"load_E": [1, 2, 3], "ep": 2}, "must divide"),
        ({"load_E": [1, -2], "ep": 2}, ">= 0"),
        ({"load_E": [1, 2], "ep": 2, "node_of_rank": [0]}, "node_of_rank"),
        ({"load_E": [1, 2], "ep": 2, "coactivation_EE": [[0]]}, "2 x 2"),
    ],
)
def test_bad_input_raises_spec_error(kwargs, match):
    with pytest.raises(SpecError, match=match):
        solve_experts(options=CPSAT, **kwargs)


def test_swaps_bring_coactivated_experts_together():
    """LPT splits equal experts 0/1 and 2/3 over the two nodes; the first improving swap in
    index order (0 <-> 3) co-locates both pairs without changing any rank's load."""
    held = {0: [0, 2], 1: [1, 3]}
    out = improve_by_swaps(held, [5, 5, 5, 5], [0, 1], {(0, 1): 10, (2, 3): 1})
    assert out == {0: [2, 3], 1: [0, 1]}
    assert held == {0: [0, 2], 1: [1, 3]}  # input untouched
    # co-locating 0 and 1 (9 + 9) would raise the hottest rank by 8 to save 3: refused
    out = improve_by_swaps({0: [0, 2], 1: [1, 3]}, [9, 9, 1, 1], [0, 1], {(0, 1): 3})
    assert out == {0: [0, 2], 1: [1, 3]}


def test_large_traffic_instance_beats_load_only_placement():
    """256 experts, 64 ranks on 8 nodes, 1 s: the traffic-aware answer has a lower objective
    than the same placement problem solved for load alone, scored the same way."""
    rng = random.Random(17)
    load = [rng.uniform(500, 1500) for _ in range(256)]
    coact = [[0.0] * 256 for _ in range(256)]
    for _ in range(2000):
        e, f = rng.randrange(256), rng.randrange(256)
        if e != f:
            w = rng.uniform(0, 50)
            coact[e][f] += w
            coact[f][e] += w
    nodes = [r // 8 for r in range(64)]
    opts = SolverOptions(time_limit_s=1.0)
    aware = solve_experts(
        load, 64, opts, node_of_rank=nodes, coactivation_EE=coact, traffic_weight=0.05
    )
    plain = solve_experts(load, 64, opts)
    pairs = [(e, f, coact[e][f]) for e in range(256) for f in range(e + 1, 256) if coact[e][f]]
    plain_obj = plain.max_rank_load + 0.05 * cross_node_tokens(
        load, plain.rank_of_expert, nodes, pairs
    )
    assert aware.report.status in ("OPTIMAL", "FEASIBLE")
    assert aware.objective < plain_obj
    check_placement(aware, 256, 64)


def test_merged_report_has_objective_bound_and_gap_that_agree():
    from planner.ip.solvers import SolveReport
    from planner.search.assemble import _merge

    hot = SolveReport("cpsat", "OPTIMAL", 10.0, 10.0, 0.0, 0.1)
    loose = SolveReport("cpsat", "FEASIBLE", 8.0, 6.0, 0.25, 0.2)
    merged = _merge([hot, loose], "cpsat")
    # the hottest layer's load is proven (no layer can beat its bound 10): gap 0
    assert (merged.status, merged.objective, merged.bound, merged.gap) == ("FEASIBLE", 10, 10, 0)
    assert merged.wall_s == pytest.approx(0.3)
    open_hot = SolveReport("cpsat", "FEASIBLE", 10.0, 8.0, 0.2, 0.1)
    merged = _merge([open_hot, SolveReport("cpsat", "OPTIMAL", 9.0, 9.0, 0.0, 0.1)], "cpsat")
    assert (merged.objective, merged.bound) == (10, 9) and merged.gap == pytest.approx(0.1)
    failed = SolveReport("cpsat", "NOT_SOLVED", float("inf"), 0.0, float("inf"), 1.0)
    assert _merge([hot, failed], "cpsat").gap == float("inf")
