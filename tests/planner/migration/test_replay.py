"""The interval loop: no lookahead, slot counts, moves that reproduce the next placement,
replication rows, and the runtime API."""

from __future__ import annotations

import numpy as np
import pytest

from planner.migration import next_placement
from planner.migration.api import uniform_costs
from planner.migration.placement import (
    capacity,
    default_rank_of_expert,
    holders,
    initial_slots,
    rank_of_expert,
)
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.run import replay, replay_all
from planner.migration.synth import SynthOptions, synth_trace
from planner.specs import SpecError
from tests.planner.migration.conftest import make_trace

E, R = 16, 4


def _setup(trace, redundant=0):
    initial = np.stack(
        [initial_slots(default_rank_of_expert(E, R), R, redundant)] * trace.num_layers
    )
    costs = uniform_costs(trace.num_layers, R)
    costs.move_s_LRR[:] = 0.001 * (1 - np.eye(R))
    costs.expert_bytes_L[:] = 1000
    return initial, costs


@pytest.fixture(scope="module")
def trace():
    return synth_trace(SynthOptions(layers=2, experts=E, intervals=10, tokens=2000, top_k=2))


@pytest.mark.parametrize("redundant", [0, R // 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_changing_later_loads_never_changes_earlier_placements(trace, policy, redundant):
    initial, costs = _setup(trace, redundant)
    cut = 5
    future = trace.tokens_ILE.copy()
    future[cut:] = future[cut:][:, :, ::-1] * 3 + 7  # a different future from interval 5 on
    a = replay(trace, initial, costs, policy)
    b = replay(make_trace(future, trace.layer_ids), initial, costs, policy)
    # the placement in force during t uses intervals < t: identical through interval `cut`
    assert np.array_equal(a.slots_ILRS[: cut + 1], b.slots_ILRS[: cut + 1])
    assert [m for m in a.moves if m[0] <= cut] == [m for m in b.moves if m[0] <= cut]


@pytest.mark.parametrize("redundant", [0, R, R // 2])
def test_slots_and_moves_reproduce_each_next_placement(trace, redundant):
    initial, costs = _setup(trace, redundant)
    capacity_R = capacity(initial[0])
    assert capacity_R.sum() == E + redundant
    for run in replay_all(trace, initial, costs, POLICIES).values():
        for t in range(1, trace.num_intervals):
            for lj, layer in enumerate(trace.layer_ids):
                old, new = run.slots_ILRS[t - 1, lj], run.slots_ILRS[t, lj]
                assert np.array_equal(capacity(new), capacity_R)  # every rank keeps its slots
                moves = [m for i, m in run.moves if i == t and m.layer == layer]
                if redundant == 0:
                    assert ((new >= 0).sum(axis=1) == E // R).all()
                    applied = rank_of_expert(old, E)
                    for m in moves:
                        assert applied[m.expert] == m.src_rank
                        applied[m.expert] = m.dst_rank
                    assert np.array_equal(applied, rank_of_expert(new, E))
                else:
                    held_old, held_new = holders(old, E), holders(new, E)
                    added = {(m.expert, m.dst_rank) for m in moves}
                    assert added == set(zip(*np.nonzero(held_new & ~held_old), strict=True))
                    assert all(held_old[m.expert, m.src_rank] for m in moves)
                    # a rank never holds two replicas of one expert; every expert survives
                    for row in new:
                        kept = row[row >= 0]
                        assert len(kept) == len(set(kept.tolist()))
                    assert held_new.any(axis=1).all()


def test_metrics_are_consistent(trace):
    initial, costs = _setup(trace)
    runs = replay_all(trace, initial, costs, POLICIES)
    assert runs["none"].experts_moved == 0 and runs["none"].transfer_s == 0
    for run in runs.values():
        assert run.bytes_moved == 1000 * run.experts_moved
        assert run.transfer_s == pytest.approx(0.001 * run.experts_moved)
        assert (run.imbalance_IL >= 1.0 - 1e-12).all()
        assert run.total_cost_s == pytest.approx(run.imbalance_IL.sum() + run.transfer_s)
    # every policy beats no migration on this skewed, drifting trace
    for name in ("swap", "repack", "piper"):
        assert runs[name].mean_imbalance < runs["none"].mean_imbalance


def test_replication_lowers_imbalance_of_a_hot_expert():
    tokens = np.tile(np.array([400] + [40] * 15), (6, 1, 1))
    hot = make_trace(tokens)
    plain = replay(hot, *_setup(hot, 0), "piper")
    replicated = replay(hot, *_setup(hot, R), "piper")
    assert replicated.mean_imbalance < plain.mean_imbalance - 0.5
    last = replicated.slots_ILRS[-1, 0]
    assert (last == 0).sum() >= 2  # expert 0 appears on more than one rank


def test_next_placement_api(trace):
    current = np.stack([default_rank_of_expert(E, R)] * 2)
    decision = next_placement(current, trace.tokens_ILE[:4], layer_ids=(7, 9))
    applied = current.copy()
    for m in decision.moves:
        lj = (7, 9).index(m.layer)
        assert applied[lj, m.expert] == m.src_rank
        applied[lj, m.expert] = m.dst_rank
    assert np.array_equal(applied, decision.placement_LE)
    assert decision.moves and decision.predicted_gain_s > 0
    assert (np.stack([np.bincount(r, minlength=R) for r in applied]) == E // R).all()
    # deterministic and pure
    again = next_placement(current, trace.tokens_ILE[:4], layer_ids=(7, 9))
    assert np.array_equal(again.placement_LE, decision.placement_LE)
    assert next_placement(current, np.zeros((0, 2, E))).moves == ()


def test_next_placement_accepts_nested_lists_and_rejects_bad_shapes():
    current = [[0, 0, 1, 1]]
    decision = next_placement(current, [[[9, 8, 1, 1]], [[9, 8, 1, 2]]], None, MigrationOptions())
    assert sorted(decision.placement_LE[0].tolist()) == [0, 0, 1, 1]
    with pytest.raises(SpecError, match="load history"):
        next_placement(current, [[[1, 2, 3]]])
    with pytest.raises(SpecError, match="E/R experts"):
        next_placement([[0, 0, 0, 1]], [[[1, 2, 3, 4]]])


def test_next_placement_with_slots_keeps_each_rank_s_slots():
    # 8 experts on 4 ranks with 2 redundant slots on ranks 1 and 3 (one still free): expert
    # 0 is hot, so it gets copies; slots_LRS lists each rank's experts within its slots
    current = [[[0, 1], [2, 3, -1], [4, 5], [6, 7, 0]]]
    history = [[[800, 10, 10, 10, 10, 10, 10, 10]]] * 3
    decision = next_placement(current, history)
    (slots_RS,) = decision.slots_LRS
    assert [len(row) <= cap for row, cap in zip(slots_RS, (2, 3, 2, 3), strict=True)] == [1] * 4
    assert sum(0 in row for row in slots_RS) >= 2
    assert sorted({e for row in slots_RS for e in row}) == list(range(8))
    assert decision.placement_LE[0].tolist() == [
        min(r for r, row in enumerate(slots_RS) if e in row) for e in range(8)
    ]
    old = {(e, r) for r, row in enumerate(current[0]) for e in row if e >= 0}
    new = {(e, r) for r, row in enumerate(slots_RS) for e in row}
    assert {(m.expert, m.dst_rank) for m in decision.moves} == new - old
    assert all((m.expert, m.src_rank) in old for m in decision.moves)


def test_next_placement_rejects_broken_slots():
    history = [[[1, 2, 3, 4]]]
    with pytest.raises(SpecError, match="at most once per rank"):
        next_placement([[[0, 0], [1, 2, 3]]], history)
    with pytest.raises(SpecError, match="every expert"):
        next_placement([[[0, 1], [1, 3, -1]]], history)


def test_per_step_rows_replay_as_their_intervals():
    """A trace of steps, 4 per interval: the baselines see the last interval's sum, so they
    place exactly as on the interval trace; imbalance is measured on each interval's sum;
    Piper sees the steps and still only the past (later steps never change earlier
    placements)."""
    from planner.migration.trace import Trace, interval_trace

    rng = np.random.default_rng(5)
    rows = Trace(rng.poisson(50, size=(24, 1, 8)) * np.arange(1, 9), (3,))
    coarse = interval_trace(rows, 4)
    assert coarse.num_intervals == 6
    assert coarse.tokens_ILE[1, 0, 2] == rows.tokens_ILE[4:8, 0, 2].sum()
    initial = initial_slots(np.arange(8) // 4, 2)[None]
    costs = uniform_costs(1, 2)
    for policy in ("none", "swap", "repack"):
        a = replay(rows, initial, costs, policy, rows_per_interval=4)
        b = replay(coarse, initial, costs, policy)
        assert np.array_equal(a.slots_ILRS, b.slots_ILRS)
        assert np.allclose(a.imbalance_IL, b.imbalance_IL)
    base = replay(rows, initial, costs, "piper", rows_per_interval=4)
    later = Trace(rows.tokens_ILE.copy(), (3,))
    later.tokens_ILE[16:] = later.tokens_ILE[16:][:, :, ::-1]
    again = replay(later, initial, costs, "piper", rows_per_interval=4)
    assert np.array_equal(base.slots_ILRS[:5], again.slots_ILRS[:5])  # decided before row 16
    with pytest.raises(ValueError, match="4-row intervals"):
        replay(Trace(rows.tokens_ILE[:22], (3,)), initial, costs, "piper", rows_per_interval=4)


def test_next_placement_from_steps_waits_for_a_whole_interval():
    current = [[0, 0, 1, 1]]
    steps = [[[90, 80, 1, 1]]] * 3
    opts = MigrationOptions(rows_per_interval=4)
    kept = next_placement(current, steps, options=opts)
    assert kept.placement_LE.tolist() == current and kept.moves == ()
    moved = next_placement(current, steps * 2, options=opts)
    assert sorted(moved.placement_LE[0][:2].tolist()) == [0, 1]  # the two hot experts split


def _long_trace(intervals: int, rows_per_interval: int = 1):
    """More intervals than the policy's window (HISTORY_INTERVALS), with regime shifts."""
    opts = SynthOptions(
        layers=1, experts=E, intervals=intervals * rows_per_interval, tokens=400, top_k=2,
        shift_prob=0.1, seed=0,
    )  # fmt: skip
    return synth_trace(opts)


def test_each_decision_reads_at_most_the_window(monkeypatch):
    """The work of a decision is bounded: Piper's forecast is handed at most the newest
    HISTORY_INTERVALS intervals however long the trace, as the runtime hands its policy."""
    import planner.migration.policies as policies

    seen: list[int] = []
    real = policies.forecast_interval

    def spy(history_TE, rows_per_interval=1, opts=None):
        seen.append(history_TE.shape[0])
        return real(history_TE, rows_per_interval, opts)

    monkeypatch.setattr(policies, "forecast_interval", spy)
    trace = _long_trace(policies.HISTORY_INTERVALS + 6, 2)
    initial, costs = _setup(trace)
    replay(trace, initial, costs, "piper", rows_per_interval=2)
    assert max(seen) == 2 * policies.HISTORY_INTERVALS  # the window, full
    assert len(seen) > 2 * policies.HISTORY_INTERVALS  # forecast and rank error, each decision


def test_replay_decides_as_the_run_with_its_window():
    """Past the runtime's window of 64 intervals, the replay of a per-step trace makes the
    decisions of the run's policy loop: runtime.train.close_interval keeps the newest 64
    intervals' rows and next_placement decides on them."""
    pytest.importorskip("torch")
    from planner.migration.policies import HISTORY_INTERVALS
    from runtime.train import MAX_INTERVALS, close_interval, rows_per_interval

    assert MAX_INTERVALS == HISTORY_INTERVALS  # the run keeps the window the policy reads
    steps = 2  # --migrate-every 2: one history row per step
    trace = _long_trace(MAX_INTERVALS + 8, steps)
    initial, costs = _setup(trace)
    replayed = replay(trace, initial, costs, "piper", rows_per_interval=steps)
    opts = MigrationOptions(rows_per_interval=rows_per_interval(steps))
    current, history, rows = default_rank_of_expert(E, R)[None], [], []
    moved_differently = 0
    for t in range(1, trace.num_intervals // steps):
        history.extend(trace.tokens_ILE[(t - 1) * steps : t * steps].tolist())
        past = close_interval(history, rows, steps)
        decision = next_placement(current, np.asarray(past), costs, opts)
        current = decision.placement_LE
        want = holders(replayed.slots_ILRS[t, 0], E)
        moved_differently += not np.array_equal(holders(np.asarray(decision.slots_LRS[0]), E), want)
    assert moved_differently == 0
    assert replayed.experts_moved > 0
