"""Live expert migration: the runtime asks the planner's policy priced from the plan's
cluster, moves carry weights + grads + Adam moments, a failed move changes nothing, and
training with migration equals training without it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from planner.cli import main
from planner.migration import next_placement
from planner.migration.inputs import migrate_setup
from planner.migration.trace import Trace, trace_from_text, trace_rows
from planner.plan import load_plan
from planner.resources.params import layer_params
from planner.run.migration import run_move_costs
from planner.run.spec import ExpertSlots, run_spec_from_plan
from runtime.data import load_corpus
from runtime.migrate import MigrationPolicy, arrange, copy_plan, decide, plan_migration
from tests.runtime.tiny_plans import (
    SlotDecision,
    assert_experts_match_oracle,
    reference_run,
    rotate_policy,
    tiny_spec,
    train_body,
)


def test_rotate_policy_moves_every_expert():
    d = rotate_policy([(0, 0, 1, 1)], [])
    assert d.placement_LE.tolist() == [[1, 1, 0, 0]] and len(d.moves) == 4


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
        trace_every=3,
    )
    results = run_distributed(train_body, 4, spec, 2, rotate_policy, timeout_s=240)
    ref_losses, ref_model, ref_opt = reference_run(spec)
    lines = [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]
    assert [d["loss"] for d in lines] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4)
    moved = [d["migrated_experts"] for d in lines]
    # rotate moves all 8 experts of each of the 2 MoE layers; the injected failure moves none
    assert moved == [0, 0, 0, 16, 0, 16, 0, 16, 0]
    # trace.csv: 3 intervals of 3 steps; each sums tokens x top-k over the stage and steps
    per_key: dict = {}
    for interval, layer, _e, tokens in trace_rows(trace_from_text(results[0][1]["trace.csv"])):
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


def test_the_runtime_asks_the_planners_next_placement():
    assert MigrationPolicy().choose is next_placement
    current = [ExpertSlots.of_ranks(r, 2) for r in ((0, 0, 1, 1), (0, 1, 0, 1))]
    # layer 0: both hot experts on rank 0 -> the planner separates them; layer 1 balanced
    history = [[[100, 90, 1, 1], [5, 5, 5, 5]]] * 4
    tables = decide(_one_rank_mesh(), MigrationPolicy(), current, history)
    rank_of = tables[0].rank_of_expert(4)
    assert sorted(rank_of) == [0, 0, 1, 1] and rank_of[0] != rank_of[1]
    assert tables[1] == current[1]
    assert tables[0].share_RS == ((1.0, 1.0), (1.0, 1.0))


def test_a_failing_policy_keeps_the_placement():
    def broken(*_args):
        raise ValueError("no prices")

    current = [ExpertSlots.of_ranks((0, 0, 1, 1), 2)]
    tables = decide(_one_rank_mesh(), MigrationPolicy(choose=broken), current, [[[9, 9, 1, 1]]])
    assert tables == tuple(current)


def test_a_policy_table_that_overfills_a_rank_or_loses_an_expert_is_refused():
    current = [ExpertSlots.even([[0, 1, 2], [2, 3]])]  # expert 2 replicated, ragged slots
    for bad in ([[0, 1], [2, 3, 1]], [[0, 1, 1], [2, 3]], [[0, 1, -1], [2, -1]]):
        policy = MigrationPolicy(choose=lambda *_a, rows=bad: SlotDecision((rows,)))
        assert decide(_one_rank_mesh(), policy, current, [[[1, 1, 1, 1]]]) == tuple(current)
    good = [[0, 1, 3], [2, 3]]  # the replica moves from expert 2 to expert 3
    policy = MigrationPolicy(choose=lambda *_a: SlotDecision((good,)))
    (table,) = decide(_one_rank_mesh(), policy, current, [[[1, 1, 1, 1]]])
    assert table.slots_RS == ((0, 1, 3), (2, 3)) and table.holders(3) == ((0, 2), (1, 1))


def test_arrange_keeps_staying_experts_in_their_slots():
    old = ExpertSlots.even([[0, 1, 2], [2, 3, -1]])
    # rank 0 drops 2 and gains 3 in its slot; rank 1 drops its copy of 2 (ascending rows,
    # plan.json style, or padded with planner.migration.placement's ABSENT = -2)
    new = arrange(old, [[0, 1, 3], [3, -2, -2]])
    assert new.slots_RS == ((0, 1, 3), (-1, 3, -1))
    assert new.share_RS == ((1.0, 1.0, 0.5), (0.0, 0.5, 0.0))
    assert arrange(old, [[2, 1, 0], [2, 3]]) == old  # the same sets: nothing moves
    assert arrange(old, [[1, 0], [4, 2, 3]]).slots_RS == ((0, 1, -1), (2, 3, 4))


def test_copy_plan_takes_a_new_copy_from_a_holder_on_the_receivers_node():
    old = ExpertSlots.even([[0, 1, -1], [2, 3, 0], [4, 5, -1], [6, 7, -1]])
    new = ExpertSlots.even([[0, 1, 7], [2, 3, -1], [4, 5, 0], [6, 7, 0]])
    nodes = [0, 0, 1, 1]
    # 0 -> ranks 2 and 3: no holder on node 1, the lowest (rank 0); 7 -> rank 0 from rank 3;
    # rank 1's copy of 0 is dropped (no transfer)
    assert copy_plan(old, new, nodes) == [(0, 0, 2), (0, 0, 3), (7, 3, 0)]
    moved = ExpertSlots.even([[0, 1, -1], [2, 3, 7], [4, 5, 0], [6, 0, -1]])
    # 7 leaves rank 3 for rank 1 (no holder on node 0: from rank 3); 0 as above
    assert copy_plan(old, moved, nodes) == [(0, 0, 2), (0, 0, 3), (7, 3, 1)]
    more = ExpertSlots.even([[0, 1, 2], [2, 3, 0], [4, 5, 3], [6, 7, 2]])
    assert copy_plan(old, more, nodes) == [(2, 1, 0), (2, 1, 3), (3, 1, 2)]


def _one_rank_mesh():
    """The fields `decide` reads, for a stage of one rank (no broadcast)."""
    return SimpleNamespace(me=SimpleNamespace(physical=0, stage=0), stage_ranks=[0])


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> str:
    """`piper plan` on cpu-gloo (2 devices per node): pp=2, ep=4, so EP groups span nodes."""
    out = tmp_path_factory.mktemp("plan")
    sizes = ["--gpus", "8", "--pp", "2", "--tp", "1", "--ep", "4"]
    shape = ["--seq-len", "64", "--global-batch", "16", "--out", str(out)]
    assert main(["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", *sizes, *shape]) == 0
    return str(out / "plan.json")


def test_run_prices_are_piper_migrates_for_the_same_plan(plan_path):
    plan = load_plan(plan_path)
    spec = run_spec_from_plan(plan, plan.model_spec(), 1.0, migrate_every=4)
    by_stage = run_move_costs(plan, spec, plan_path)
    layers = tuple(e.layer for e in plan.experts)
    trace = Trace(np.zeros((1, len(layers), 8), dtype=np.int64), layers, "test")
    want = migrate_setup(trace, 4, plan_path, steps_per_interval=4).costs
    rows = 0
    for stage, costs in enumerate(by_stage):
        moe = [i for i in spec.stage_layers[stage] if spec.model.layers[i].moe is not None]
        picked = [layers.index(spec.source_layers[i]) for i in moe]
        for name in ("expert_bytes_L", "move_s_LRR", "level_LRR", "balanced_s_L"):
            np.testing.assert_array_equal(getattr(costs, name), getattr(want, name)[picked])
        rows += len(picked)
    assert rows == len(layers)
    assert by_stage[0].level_LRR.max() > by_stage[0].level_LRR[0, 0, 1]  # some moves leave a node
    assert plan_migration(plan_path, spec).costs_by_stage[1] is not None


def test_a_scaled_run_prices_its_own_shrunken_experts(plan_path):
    plan = load_plan(plan_path)
    model = plan.model_spec()
    full = run_move_costs(plan, run_spec_from_plan(plan, model, 1.0, migrate_every=2), plan_path)
    spec = run_spec_from_plan(plan, model, 0.5, migrate_every=2)
    scaled = run_move_costs(plan, spec, plan_path)
    for stage, costs in enumerate(scaled):
        moe = [i for i in spec.stage_layers[stage] if spec.model.layers[i].moe is not None]
        # what the runtime sends: fp32 weights, gradients and Adam moments (not the target's 18)
        expert = [16 * layer_params(spec.model, spec.model.layers[i]).expert for i in moe]
        assert costs.expert_bytes_L.tolist() == expert
        assert (costs.expert_bytes_L < full[stage].expert_bytes_L[: len(moe)]).all()
        np.testing.assert_array_equal(costs.level_LRR, full[stage].level_LRR[: len(moe)])
    # no --migrate-every: nothing to price
    assert plan_migration(plan_path, run_spec_from_plan(plan, model, 0.5)).costs_by_stage == ()


def test_the_policy_sees_the_rows_of_past_intervals(monkeypatch):
    """Every K steps the trainer closes an interval and hands the policy the rows of every
    past interval, oldest first: one row per step up to K = 20, else rows of K / n steps for
    the largest divisor n <= 20 of K; at most MAX_INTERVALS intervals; and the policy's
    options say how many rows make one interval."""
    import runtime.train as train

    assert [train.rows_per_interval(k) for k in (1, 3, 20, 40, 100, 23)] == [1, 3, 20, 20, 20, 1]
    seen = []
    monkeypatch.setattr(train, "migrate_stage", lambda moes, m, p, past, *a: seen.append(
        [list(map(list, row)) for row in past]) or 0)  # fmt: skip
    module = SimpleNamespace(moe_layers=lambda: {1: None})

    def steps(k, first, last, history, rows):
        spec = SimpleNamespace(migrate_every=k, steps=1000)
        for step in range(first, last):
            history.append([[step, 1], [2 * step, 0]])  # two layers of 2 experts per step
            del history[:-k]
            train._maybe_migrate(spec, module, None, None, None, history, rows, step, -1, None)

    history, rows = [], []
    steps(3, 0, 6, history, rows)  # K = 3: a row per step
    assert seen == [
        [[[0, 1], [0, 0]], [[1, 1], [2, 0]], [[2, 1], [4, 0]]],
        [[[s, 1], [2 * s, 0]] for s in range(6)],
    ]
    seen.clear()
    history, rows = [], []
    steps(40, 0, 40, history, rows)  # K = 40: 20 rows of 2 steps
    assert seen == [[[[2 * j + 2 * j + 1, 2], [2 * (4 * j + 1), 0]] for j in range(20)]]
    monkeypatch.setattr(train, "MAX_INTERVALS", 2)
    history, rows = [], []
    steps(3, 0, 9, history, rows)
    assert seen[-1] == [[[s, 1], [2 * s, 0]] for s in range(3, 9)]
    policy = train.with_rows(MigrationPolicy(), 40)
    assert policy.options.rows_per_interval == 20 and policy.choose is next_placement
    assert train.with_rows(MigrationPolicy(), 0).options is None


@pytest.mark.slow
def test_the_runs_decisions_are_the_replay_of_its_trace(run_distributed):
    """The planner's policy in a run (pp=1 dp=2 ep=2, migration every 3 steps, uniform
    prices) makes exactly the decisions `replay` makes on the run's per-step trace.csv with
    3 rows per interval: the same experts moved per interval and the same final placement.
    So what the benchmark measures on a recorded per-step trace is what a run decides."""
    from planner.migration.api import uniform_costs
    from planner.migration.placement import initial_slots, rank_of_expert
    from planner.migration.policies import MigrationOptions
    from planner.migration.run import replay

    load_corpus()
    spec = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=15, layers=3, migrate_every=3,
                     trace_every=1)  # fmt: skip
    results = run_distributed(train_body, 2, spec, -1, None, timeout_s=240)
    lines = [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]
    trace = trace_from_text(results[0][1]["trace.csv"])
    assert trace.num_intervals == spec.steps
    num_e = trace.num_experts
    start = initial_slots(np.arange(num_e) // (num_e // 2), 2)
    moved = {t: 0 for t in range(1, spec.steps // 3)}
    for lj, layer in enumerate(trace.layer_ids):
        one = type(trace)(trace.tokens_ILE[:, lj : lj + 1], (layer,))
        run = replay(one, start[None], uniform_costs(1, 2), "piper", MigrationOptions(), 3)
        for t, _ in run.moves:
            moved[t] += 1
        assert results[0][3][layer] == rank_of_expert(run.slots_ILRS[-1, 0], num_e).tolist()
    got = {t: lines[3 * t - 1]["migrated_experts"] for t in moved}
    assert got == moved
    assert sum(moved.values()) > 0


def test_a_moved_expert_carries_the_bytes_its_move_is_priced_at():
    """The wire format of one moved expert (weights, gradients, both Adam moments, fp32)
    holds RUNTIME_MOVE_BYTES_PER_PARAM bytes per parameter of the expert (the runtime's
    parameters are fp32 in a bf16 run too; the bf16 copies a step computes with are not sent)."""
    import torch

    from planner.migration.inputs import RUNTIME_MOVE_BYTES_PER_PARAM
    from runtime.migrate import pack_views, slot_state_views
    from runtime.model.moe import MoELayer
    from tests.runtime.tiny_plans import tiny_model

    model = tiny_model()
    spec = model.layers[1].moe
    layer = MoELayer(32, spec, [0] * spec.num_experts, 0, seed=3, layer=1)
    opt = torch.optim.Adam(layer.parameters())
    layer(torch.randn(2, 5, 32)).square().sum().backward()
    opt.step()
    wire = pack_views(slot_state_views(layer, opt, 0))
    per_expert = layer_params(model, model.layers[1]).expert
    assert wire.dtype == torch.float32
    assert wire.numel() * wire.element_size() == RUNTIME_MOVE_BYTES_PER_PARAM * per_expert
