"""Each policy's definition on tiny hand-made loads (expected answers computed by hand)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from planner.migration.assignment import priced_local_search
from planner.migration.placement import (
    ABSENT,
    capacity,
    diff_moves,
    holders,
    initial_slots,
    rank_loads,
    rank_of_expert,
    replica_counts,
)
from planner.migration.policies import (
    LayerCosts,
    MigrationOptions,
    greedy_swap,
    no_migration,
    piper,
    repack,
)
from planner.migration.replicate import pack, replica_counts_for

LOADS = np.array([[10, 8, 1, 3]])  # one past interval; experts 0,1 on rank 0 and 2,3 on rank 1
START = initial_slots(np.array([0, 0, 1, 1]), 2)
FREE = LayerCosts(np.zeros((2, 2)), 1.0)
EXACT = MigrationOptions(move_margin=0.0, margin_sigmas=0.0, noise_scale=0.0)


def _sets(slots_RS):
    return [sorted(int(e) for e in row if e >= 0) for row in slots_RS]


def test_no_migration_keeps_the_placement():
    assert np.array_equal(no_migration(START, LOADS, FREE, EXACT), START)


def test_greedy_swap_by_hand():
    # gap 18 - 4 = 14; swapping 0<->3 gives |14 - 2*(10-3)| = 0, the first best pair;
    # then both ranks hold 11 and no swap narrows the gap
    got = greedy_swap(START, LOADS, FREE, EXACT)
    assert _sets(got) == [[1, 3], [0, 2]]


def test_greedy_swap_keeps_slots_and_never_raises_the_hottest_rank():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ep, per = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        current = rng.permutation(np.repeat(np.arange(ep), per))
        load_E = rng.integers(0, 300, size=ep * per)
        start, free_RR = initial_slots(current, ep), np.zeros((ep, ep))
        new = greedy_swap(start, load_E[None], LayerCosts(free_RR, 1.0), EXACT)
        assert [len(row) for row in _sets(new)] == [per] * ep  # each rank keeps its slots
        assert rank_loads(new, load_E).max() <= rank_loads(start, load_E).max()
        moved = {(m.expert, m.src_rank, m.dst_rank) for m in diff_moves(start, new, 0, 0, free_RR)}
        after = rank_of_expert(new, ep * per)
        pairs = enumerate(zip(current, after, strict=True))
        assert moved == {(e, a, b) for e, (a, b) in pairs if a != b}


def test_greedy_swap_stops_after_swap_rounds():
    loads = np.array([[9, 7, 5, 3, 1, 0]])
    start = initial_slots(np.array([0, 0, 1, 1, 2, 2]), 3)
    one = greedy_swap(start, loads, FREE, MigrationOptions(swap_rounds=1))
    assert (rank_of_expert(one, 6) != rank_of_expert(start, 6)).sum() == 2


def test_repack_by_hand_ignores_the_current_placement():
    # heaviest first onto the least loaded rank with room: 0->r0, 1->r1, 3->r1, 2->r0
    for start in (START, initial_slots(np.array([1, 0, 1, 0]), 2)):
        assert _sets(repack(start, LOADS, FREE, EXACT)) == [[0, 2], [1, 3]]


def test_repack_uses_only_the_last_interval():
    history = np.array([[0, 0, 100, 100], [10, 8, 1, 3]])
    assert _sets(repack(START, history, FREE, EXACT)) == [[0, 2], [1, 3]]


def test_replicas_by_hand():
    # two spare slots: expert 0 (100) gets a second replica (cap: one per rank), then
    # expert 1 (10, first of the 10s); packing 50, 50, 10, 10, 5, 5 gives 65 / 65
    load_E = np.array([100.0, 10.0, 10.0, 10.0])
    counts = replica_counts_for(load_E, 2, 6)
    assert counts.tolist() == [2, 2, 1, 1]
    slots = pack(load_E, counts, np.array([3, 3]))
    assert _sets(slots) == [[0, 1, 2], [0, 1, 3]]
    assert rank_loads(slots, load_E).tolist() == [65.0, 65.0]


def test_piper_reaches_the_balanced_placement_when_moves_are_free():
    got = piper(START, LOADS, FREE, EXACT)
    assert rank_loads(got, LOADS[0].astype(float)).max() == 11


def test_piper_stays_when_moves_cost_more_than_they_save():
    # balanced expert time 1 s per interval: the best swap saves 7/11 s, a move costs 10 s
    costly = LayerCosts(np.full((2, 2), 10.0) - 10.0 * np.eye(2), 1.0)
    assert np.array_equal(piper(START, LOADS, costly, EXACT), START)
    cheap = LayerCosts(np.full((2, 2), 0.1) - 0.1 * np.eye(2), 1.0)
    assert not np.array_equal(piper(START, LOADS, cheap, EXACT), START)


def test_piper_margin_blocks_small_gains():
    # 22 / 18 -> 20 / 20 by swapping 12 and 10: saves 2 / 20 = 0.1 of the balanced second,
    # bought with two moves: a margin of 0.04 per move lets it through, 0.06 does not
    loads = np.array([[12, 10, 10, 8]])
    allowed = MigrationOptions(move_margin=0.04, margin_sigmas=0.0, noise_scale=0.0)
    assert rank_loads(piper(START, loads, FREE, allowed), loads[0].astype(float)).max() == 20
    blocked = MigrationOptions(move_margin=0.06, margin_sigmas=0.0, noise_scale=0.0)
    assert np.array_equal(piper(START, loads, FREE, blocked), START)


def test_piper_counting_noise_margin():
    # same swap, gain 2 tokens of 20 mean rank load = 0.1 s; a move set of n experts must buy
    # k sqrt(n) standard errors of a mean expert's count, k sqrt(2) sqrt(40 / 4) tokens =
    # 0.2236 k s for the two moved experts, so k = 0.44 lets it through and k = 0.45 does not
    loads = np.array([[12, 10, 10, 8]])
    allowed = MigrationOptions(move_margin=0.0, margin_sigmas=0.44, noise_scale=0.0)
    assert rank_loads(piper(START, loads, FREE, allowed), loads[0].astype(float)).max() == 20
    blocked = MigrationOptions(move_margin=0.0, margin_sigmas=0.45, noise_scale=0.0)
    assert np.array_equal(piper(START, loads, FREE, blocked), START)
    # the margin is in tokens: 100x the tokens shrink it 10x relative to the gain
    assert rank_loads(piper(START, 100 * loads, FREE, blocked), 100.0 * loads[0]).max() == 2000


def test_piper_noise_margin_adds_in_quadrature():
    # ranks [10, 9] [1, 0] [10, 9] [1, 0]: only both swaps lower the hottest rank, 19 -> 10,
    # moving 4 experts. Margin k sqrt(4) sqrt(40 / 8) tokens = 4.472 k against a gain of 9:
    # k = 2.00 moves, k = 2.02 stays (a margin of k sqrt(5) per expert would stop at k = 1.01)
    loads = np.array([[10, 9, 1, 0, 10, 9, 1, 0]])
    start = initial_slots(np.array([0, 0, 1, 1, 2, 2, 3, 3]), 4)
    free = LayerCosts(np.zeros((4, 4)), 1.0)
    moves = MigrationOptions(move_margin=0.0, margin_sigmas=2.00, noise_scale=0.0)
    got = piper(start, loads, free, moves)
    assert rank_loads(got, loads[0].astype(float)).max() == 10
    assert (holders(got, 8) & ~holders(start, 8)).sum() == 4
    stays = MigrationOptions(move_margin=0.0, margin_sigmas=2.02, noise_scale=0.0)
    assert np.array_equal(piper(start, loads, free, stays), start)


def test_piper_prefers_the_cheaper_link():
    # ranks 0,1 share a fast link, rank 2 is far; relieving rank 0 works with either
    loads = np.array([[10, 6, 1, 2, 1, 2]])
    start = initial_slots(np.array([0, 0, 1, 1, 2, 2]), 3)
    move_s = np.array([[0.0, 0.01, 0.05], [0.01, 0.0, 0.05], [0.05, 0.05, 0.0]])
    got = piper(start, loads, LayerCosts(move_s, 100.0), EXACT)
    moved = rank_of_expert(got, 6) != rank_of_expert(start, 6)
    assert moved.any() and not (rank_of_expert(got, 6)[moved] == 2).any()


def _brute_force_max(load_E, ranks):
    """Optimal max rank load over all equal-slot placements (tiny instances)."""
    num_e, best = len(load_E), np.inf
    for perm in itertools.permutations(range(num_e)):
        groups = np.array(perm).reshape(ranks, -1)
        best = min(best, max(load_E[g].sum() for g in groups))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_local_search_never_worse_than_start_and_often_optimal(seed):
    rng = np.random.default_rng(seed)
    load_E = rng.integers(1, 50, size=6).astype(float)
    start = initial_slots(np.arange(6) // 2, 3)
    found = priced_local_search(start, load_E, np.zeros((6, 3)), 1.0, 20)
    got = rank_loads(found.slots_RS, load_E).max()
    assert got <= rank_loads(start, load_E).max()
    assert got >= _brute_force_max(load_E, 3) - 1e-9
    assert replica_counts(found.slots_RS, 6).tolist() == [1] * 6


def test_piper_with_spare_slots_adds_replicas_of_hot_experts():
    load = np.array([[100, 10, 10, 10]])
    start = initial_slots(np.array([0, 0, 1, 1]), 2, redundant_slots=2)
    got = piper(start, load, FREE, EXACT)
    held = holders(got, 4)
    assert held[0].all()  # the hot expert now lives on both ranks
    assert (got >= 0).sum(axis=1).max() <= 3


@pytest.mark.parametrize("backend", ["cpsat", "cbc"])
def test_integer_program_matches_brute_force(backend):
    from planner.ip.solvers import SolverOptions
    from planner.migration.exact import solve_assignment

    load_E = np.array([17.0, 3.0, 11.0, 29.0, 5.0, 8.0])
    start = initial_slots(np.arange(6) // 2, 3)
    got, report = solve_assignment(start, load_E, np.zeros((6, 3)), 1.0, SolverOptions(backend))
    assert report.status == "OPTIMAL"
    assert rank_loads(got, load_E).max() == _brute_force_max(load_E, 3)
    # with moves priced, the program keeps the placement when no move pays
    costly = np.where(np.eye(3, dtype=bool)[np.arange(6) // 2], 0.0, 100.0)
    kept, _ = solve_assignment(start, load_E, costly, 1.0 / 24.0, SolverOptions(backend))
    assert np.array_equal(rank_of_expert(kept, 6), np.arange(6) // 2)


def test_two_for_two_exchange_relieves_where_no_swap_does():
    # ranks 20 5 27 11 (63) | 28 6 2 25 (61): no swap changes rank 0 by exactly -1, so no
    # swap lowers the 63; a trade of two for two such as {5, 27} (32) for {6, 25} (31), or
    # {20, 11} (31) for {28, 2} (30), gives 62 / 62
    load_E = np.array([20.0, 5.0, 27.0, 11.0, 28.0, 6.0, 2.0, 25.0])
    start = initial_slots(np.arange(8) // 4, 2)
    free = np.zeros((8, 2))
    swaps = priced_local_search(start, load_E, free, 1.0, 20)
    assert rank_loads(swaps.slots_RS, load_E).max() == 63
    pairs = priced_local_search(start, load_E, free, 1.0, 20, exchange_slots=2)
    assert sorted(rank_loads(pairs.slots_RS, load_E).tolist()) == [62.0, 62.0]
    moved = rank_of_expert(pairs.slots_RS, 8) != rank_of_expert(start, 8)
    assert pairs.steps == 1 and moved.sum() == 4


def test_absent_slots_are_never_filled_and_ranks_keep_their_counts():
    # 3 ranks, 2 redundant slots (ranks 1 and 2 get one each): the hot expert is copied
    # into them, rank 0 keeps its two slots, and no policy touches the ABSENT padding
    load = np.array([[90, 10, 10, 10, 10, 10]])
    start = initial_slots(np.arange(6) // 2, 3, redundant_slots=2)
    assert capacity(start).tolist() == [2, 3, 3] and (start == ABSENT).sum() == 1
    free = LayerCosts(np.zeros((3, 3)), 1.0)
    for policy in (greedy_swap, repack, piper):
        got = policy(start, load, free, EXACT)
        assert capacity(got).tolist() == [2, 3, 3]
        assert np.array_equal(got == ABSENT, start == ABSENT)
    assert replica_counts(piper(start, load, free, EXACT), 6)[0] >= 2


def test_plain_maximum_search_lowers_the_hottest_rank_not_another():
    # rank 0 holds 277 (shedding its 40 or 226 relieves it by 40-46); ranks 1-5 sit at
    # 235-238 and each can shed a 100-137 expert onto a cold rank, a larger relief, but only
    # rank 0 sets the maximum. The plain-maximum search must lower 277, not relieve the
    # others one by one until its patience (4 exchanges without a new best) runs out
    hot = [[40, 11, 0, 226], [137, 39, 59, 0], [120, 60, 58, 0], [100, 90, 46, 0]]
    hot += [[110, 70, 55, 0], [100, 80, 57, 0]]
    cold = [[0, 0, 0, 5]] * 6
    load_E = np.array(hot + cold, dtype=float).ravel()
    start = initial_slots(np.arange(48) // 4, 12)
    found = priced_local_search(start, load_E, np.full((48, 12), 0.01), 1.0, 48, sources=8)
    assert rank_loads(start, load_E).max() == 277
    assert rank_loads(found.slots_RS, load_E).max() < 235
    assert found.steps >= 1


def test_piper_decides_by_the_experts_a_rank_holds_not_their_slot_order():
    """The runtime hands the policy each rank's experts ascending; a replay hands it the
    previous decision's order: both must get the same decision (canonical_slots)."""
    from planner.migration.policies import canonical_slots, piper

    rng = np.random.default_rng(3)
    ranks, per = 4, 2
    num_e = ranks * per
    costs = LayerCosts(np.full((ranks, ranks), 1e-4) - np.eye(ranks) * 1e-4, 0.01)
    opts = MigrationOptions(rows_per_interval=5)
    for _ in range(20):
        perm = rng.permutation(num_e).reshape(ranks, per)
        history = rng.integers(0, 1000, size=(10, num_e)).astype(float)
        history[:, rng.integers(num_e)] *= 4  # a hot expert worth moving
        sorted_RS = canonical_slots(perm)
        assert (np.sort(perm, axis=1) == sorted_RS).all()
        shuffled = np.array([rng.permutation(row) for row in perm])
        a = piper(sorted_RS, history, costs, opts)
        b = piper(shuffled, history, costs, opts)
        assert [sorted(r) for r in a.tolist()] == [sorted(r) for r in b.tolist()]
    # free and absent slots stay in place, the experts around them sort
    table = np.array([[5, -1, 2], [4, 3, -2]])
    assert canonical_slots(table).tolist() == [[2, -1, 5], [3, 4, -2]]
