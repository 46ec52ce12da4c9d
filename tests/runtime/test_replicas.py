"""Redundant expert slots at run time: plan.json's slots reach the RunSpec, a replicated
expert's tokens split over its copies by share, the copies' gradients are summed, and a run
with replicas (static, and migrating copies in and out) trains like the one-copy oracle:
the same losses and, copy by copy, the oracle's expert weights and Adam moments."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from planner.plan.schema import ExpertPlacement
from planner.run.spec import ExpertSlots, run_spec_from_plan
from planner.specs import SpecError
from runtime.data import load_corpus
from runtime.model.replicas import SlotRouter
from tests.runtime.tiny_plans import (
    assert_experts_match_oracle,
    cycle_policy,
    hand_plan,
    reference_run,
    tiny_model,
    train_body,
)

# 8 experts on 4 EP ranks with 3 redundant slots: expert 0 on ranks 0 and 1 (one node),
# expert 5 on ranks 0, 2 and 3 (rank 0 on node 0, ranks 2 and 3 on node 1)
SLOTS = [[0, 1, 5], [0, 2, 3], [4, 5], [5, 6, 7]]


def _spec_with_slots(slots, dp, ep, ranks_per_node, **options):
    model = tiny_model(layers=3)
    plan = hand_plan(model, 1, dp, ep, micro_batch=2, seq_len=32, gpus_per_node=ranks_per_node)
    experts = tuple(ExpertPlacement.of_slots(e.layer, slots) for e in plan.experts)
    return run_spec_from_plan(replace(plan, experts=experts), model, 1.0, ranks_per_node, **options)


def test_plan_slots_reach_the_run_spec():
    spec = _spec_with_slots(SLOTS, dp=4, ep=4, ranks_per_node=2)
    table = spec.slots_of(1)
    assert table.slots_RS == tuple(tuple(r) for r in SLOTS)
    assert table.holders(5) == ((0, 2), (2, 1), (3, 0))
    assert [table.share_RS[r][s] for r, s in table.holders(5)] == [1 / 3] * 3
    assert [table.share_RS[r][s] for r, s in table.holders(0)] == [0.5, 0.5]
    assert dict(spec.placements)[1] == (0, 0, 1, 1, 2, 0, 3, 3)  # the lowest holder
    plain = run_spec_from_plan(hand_plan(tiny_model(3), 1, 4, 4), tiny_model(3), 1.0, 2)
    assert plain.slots == () and plain.slots_of(1).slots_RS == ((0, 1), (2, 3), (4, 5), (6, 7))


@pytest.mark.parametrize(
    ("slots", "share", "message"),
    [
        ([[0, 1], [2, 3], [4, 5]], None, "must list 4 EP ranks"),
        ([[0, 1], [2, 3], [4, 5], []], None, "every EP rank needs a slot"),
        ([[0, 1], [2, 9], [4, 5], [6, 7]], None, "experts 0..7"),
        ([[0, 1], [2, 3], [4, 5], [6, 6]], None, "expert 6 must sit on at least one rank, once"),
        ([[0, 1], [2, 3], [4, 5], [6, -1]], None, "expert 7 must sit on at least one rank"),
        ([[0, 1], [0, 3], [4, 5], [6, 7]], None, "expert 2 must sit"),
        ([[0, 1], [2, 3], [4, 5], [6, 7, 0]], (0.5, 0.25), "shares of expert 0's copies"),
    ],
)
def test_a_slot_table_the_runtime_cannot_run_is_one_line(slots, share, message):
    from planner.run.spec import check_slots

    table = ExpertSlots.even(slots)
    if share is not None:
        rows = [list(r) for r in table.share_RS]
        rows[0][0], rows[3][2] = share
        table = ExpertSlots(table.slots_RS, tuple(tuple(r) for r in rows))
    with pytest.raises(SpecError, match=message) as err:
        check_slots(table, 8, 4, layer=3)
    assert "\n" not in str(err.value) and "experts[layer=3]" in str(err.value)


def _uneven(slots, shares_of: dict[int, list[float]]) -> ExpertSlots:
    """`slots` with the copies of each expert in `shares_of` taking those shares (by rank)."""
    table = ExpertSlots.even(slots)
    rows = [list(r) for r in table.share_RS]
    for e, shares in shares_of.items():
        for (r, s), share in zip(table.holders(e), shares, strict=True):
            rows[r][s] = share
    return ExpertSlots(table.slots_RS, tuple(tuple(r) for r in rows))


def test_the_router_splits_a_replicated_experts_pairs_by_share_and_source():
    # expert 0 on ranks 0, 1, 3 with shares 1/2, 1/4, 1/4; global slots: rank 0 -> 0, 1;
    # rank 1 -> 2, 3, 4; rank 2 -> 5, 6; rank 3 -> 7, 8, 9
    table = _uneven([[0, 1], [2, 3, 0], [4, 5], [6, 7, 0]], {0: [0.5, 0.25, 0.25]})
    router = SlotRouter(table, 8)
    assert router.rank_of_slot_G.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    expert_TK = torch.tensor([[0, 1]] * 10)  # ten pairs of expert 0, ten of expert 1
    got = {}
    for source in range(4):
        slot_TK = router.route(expert_TK, source)
        assert slot_TK[:, 1].tolist() == [1] * 10  # expert 1: its one slot
        got[source] = slot_TK[:, 0].tolist()
    # copy j takes positions [floor(10 C_j + u), ...), u = (source + 1/2) / 4: contiguous runs
    # of 5, 2, 3 for sources 0 and 1 and 5, 3, 2 for sources 2 and 3
    assert got[0] == got[1] == [0] * 5 + [4] * 2 + [9] * 3
    assert got[2] == got[3] == [0] * 5 + [4] * 3 + [9] * 2
    assert [sum(v.count(g) for v in got.values()) for g in (0, 4, 9)] == [20, 10, 10]
    # one pair, two even copies: the sources of a group alternate
    pair = SlotRouter(ExpertSlots.even([[0, 1], [0, 2]]), 3)
    assert [pair.route(torch.tensor([[0]]), s).item() for s in (0, 1)] == [2, 0]
    assert torch.equal(router.route(expert_TK, 2), router.route(expert_TK, 2))


def test_without_replicas_each_expert_routes_to_its_one_slot():
    router = SlotRouter(ExpertSlots.of_ranks((1, 0, 1, 0), 2), 4)
    assert router.rank_of_slot_G.tolist() == [0, 0, 1, 1]  # rank 0 holds 1, 3; rank 1: 0, 2
    assert router.route(torch.tensor([[0, 1], [2, 3]]), 0).tolist() == [[2, 0], [3, 1]]


def _lines(results):
    return [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dispatcher", "direct_below_bytes"), [("halo", -1), ("flat", -1), ("halo-dedup", 0)]
)
def test_replicas_train_like_the_one_copy_oracle(run_distributed, dispatcher, direct_below_bytes):
    """dp = ep = 4 on two emulated nodes, ragged slots, layer 2 with uneven shares; every
    dispatcher (HALO-dedup forced through its three phases)."""
    load_corpus()
    spec = _spec_with_slots(
        SLOTS,
        dp=4,
        ep=4,
        ranks_per_node=2,
        steps=4,
        dispatcher=dispatcher,
        halo_direct_below_bytes=direct_below_bytes,
    )
    uneven = _uneven(SLOTS, {0: [0.25, 0.75], 5: [0.5, 0.25, 0.25]})
    spec = replace(spec, slots=(spec.slots[0], (2, uneven)))
    results = run_distributed(train_body, 4, spec, timeout_s=240)
    ref_losses, ref_model, ref_opt = reference_run(spec)
    lines = _lines(results)
    assert [d["loss"] for d in lines] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4)
    assert_experts_match_oracle(results, ref_model, ref_opt, edp=1)  # every copy
    for rank, result in enumerate(results):
        assert result[4] == {1: SLOTS, 2: SLOTS}, rank
    # per MoE layer and step: expert 0's two copies on node 0 exchange P bytes each way,
    # expert 5's copies on ranks 2 and 3 send P to rank 0 (node 0), which sends P back to each
    grad_bytes = 3 * 32 * 32 * 4  # w_in, w_gate, w_out of d = ffn = 32, fp32
    for d in lines:
        assert d["bytes_by_kind"]["grad_replica_intra"] == 2 * 2 * grad_bytes
        assert d["bytes_by_kind"]["grad_replica_inter"] == 2 * 4 * grad_bytes


# slot tables a migrating run cycles through (2 EP ranks x 5 slots, -1 = free): add a copy
# of 1 and drop those of 0 and 4; move 0 and 6, copy 7 and 6; back to the plan's table
CYCLE = [
    [[0, 1, 2, 3, 4], [0, 4, 5, 6, 7]],
    [[0, 1, 2, 3, -1], [4, 5, 6, 7, 1]],
    [[1, 2, 3, 6, 7], [0, 1, 4, 5, 7]],
]


@pytest.mark.slow
def test_migration_adds_moves_and_drops_replicas_like_the_oracle(run_distributed):
    """pp=1 dp=4 ep=2 (two EP groups, edp=2, one per emulated node); a new table every 2
    steps: the run's losses and every copy's weights and Adam moments equal the oracle's."""
    load_corpus()
    spec = _spec_with_slots(CYCLE[0], dp=4, ep=2, ranks_per_node=2, steps=9, migrate_every=2)
    results = run_distributed(train_body, 4, spec, -1, cycle_policy(CYCLE), timeout_s=240)
    ref_losses, ref_model, ref_opt = reference_run(spec)
    lines = _lines(results)
    assert [d["loss"] for d in lines] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4)
    # copies made per layer: 1 (of 1), 3 (0, 6, 7), 3 (0, 4, 6), 1 (of 1); two MoE layers
    assert [d["migrated_experts"] for d in lines] == [0, 2, 0, 6, 0, 6, 0, 2, 0]
    # CYCLE[1] again, arranged by the runtime: every expert that stayed kept its slot
    final = [[0, 1, 2, 3, -1], [6, 4, 5, 1, 7]]
    for rank, result in enumerate(results):
        assert result[4] == {1: final, 2: final}, rank
    assert_experts_match_oracle(results, ref_model, ref_opt, edp=2)
    migrated = [d["bytes_by_kind"].get("migrate_intra", 0) for d in lines]
    assert all(b > 0 for b in migrated[1::2]) and not any(migrated[0::2])
