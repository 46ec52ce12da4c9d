"""Live expert migration: policies keep slots, moves carry weights + grads + Adam moments, a
failed move changes nothing, and training with migration equals training without it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from runtime.data import load_corpus
from runtime.metrics import validate_trace
from runtime.migrate import greedy_next_placement, rotate_placement
from tests.runtime.tiny_plans import (
    assert_experts_match_oracle,
    reference_run,
    tiny_spec,
    train_body,
)


def _max_load(table, load):
    return max(sum(load[e] for e in range(len(table)) if table[e] == r) for r in set(table))


def test_greedy_policy_keeps_slots_and_never_raises_the_hottest_rank():
    rng = np.random.default_rng(0)
    for _ in range(50):
        ep, per = int(rng.integers(2, 5)), int(rng.integers(1, 4))
        current = tuple(int(r) for r in rng.permutation(np.repeat(np.arange(ep), per)))
        history = rng.integers(0, 100, size=(3, 1, ep * per)).tolist()
        decision = greedy_next_placement([current], history)
        new = decision.placement_LE[0]
        load = np.asarray(history).sum(axis=0)[0]
        assert sorted(new) == sorted(current)  # every rank keeps its number of slots
        assert _max_load(new, load) <= _max_load(current, load)
        assert {(e, a, b) for _, e, a, b in decision.moves} == {
            (e, a, b) for e, (a, b) in enumerate(zip(current, new, strict=True)) if a != b
        }


def test_rotate_policy_moves_every_expert():
    d = rotate_placement([(0, 0, 1, 1)])
    assert d.placement_LE == ((1, 1, 0, 0),) and len(d.moves) == 4


@pytest.mark.slow
def test_migration_every_two_steps_matches_training_without_it(run_distributed):
    """pp=1 dp=4 ep=2 (edp=2 replicas on two emulated nodes); rotate every 2 steps, the
    first attempt fails on one rank mid-move (two-phase rule: nothing changes)."""
    load_corpus()
    steps = 9  # migrations after steps 2 (injected failure), 4, 6, 8 -> three rotations
    spec = tiny_spec(
        pp=1,
        dp=4,
        ep=2,
        ranks_per_node=2,
        steps=steps,
        layers=3,
        migrate_every=2,
        migrate_policy="rotate",
        trace_every=3,
    )
    results = run_distributed(train_body, 4, spec, 2, timeout_s=240)
    ref_losses, ref_model, ref_opt = reference_run(spec)
    lines = [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]
    assert [d["loss"] for d in lines] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4)
    moved = [d["migrated_experts"] for d in lines]
    # rotate moves all 8 experts of each of the 2 MoE layers; the injected failure moves none
    assert moved == [0, 0, 0, 16, 0, 16, 0, 16, 0]
    # trace.csv: 3 intervals of 3 steps; each sums tokens x top-k over the stage and steps
    per_key: dict = {}
    for interval, layer, _e, tokens in validate_trace(results[0][1]["trace.csv"]):
        per_key[(interval, layer)] = per_key.get((interval, layer), 0) + tokens
    assert per_key == {
        (i, layer): 3 * spec.tokens_per_step * 2 for i in range(3) for layer in (1, 2)
    }
    # three rotations with ep=2: every expert sits on the other EP rank than initially
    for rank_result in results:
        for layer, table in rank_result[3].items():
            assert table == [1 - (e // 4) for e in range(8)], (layer, table)
    # each expert's weights, grads and Adam moments equal the single-device oracle's,
    # on every edp replica, wherever the expert now lives
    assert_experts_match_oracle(results, ref_model, ref_opt, edp=2)


def test_planner_policy_is_the_planners_next_placement():
    from runtime.migrate import resolve_policy

    policy = resolve_policy("planner")
    current = [(0, 0, 1, 1), (0, 1, 0, 1)]
    # layer 0: both hot experts on rank 0 -> the planner separates them; layer 1 balanced
    history = [[[100, 90, 1, 1], [5, 5, 5, 5]]] * 4
    decision = policy(current, history)
    assert sorted(decision.placement_LE[0]) == [0, 0, 1, 1]
    assert decision.placement_LE[0][0] != decision.placement_LE[0][1]
    assert decision.placement_LE[1] == current[1]
    for layer, expert, src, dst in decision.moves:
        assert current[layer][expert] == src and decision.placement_LE[layer][expert] == dst
