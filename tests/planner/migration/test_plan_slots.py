"""plan.json's `experts` entry with redundant slots: round trip, defaults, checks, spread."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from planner.migration.placement import slot_counts
from planner.plan import ExpertPlacement, plan_from_dict
from planner.specs import SpecError

# a plan written before vp/cp/etp existed: pp=4 dp=8 tp=2 ep=8 (loads with their defaults)
EXAMPLE = Path(__file__).resolve().parents[1] / "data" / "plan_before_knobs.json"
SLOTS = [[0, 1, 4], [2, 3, 4], [5, 6], [0, 7]]  # experts 0 and 4 replicated; 10 slots


def _plan_with(entry: dict) -> dict:
    """The example plan with ep=4 (dp=8, tp=2: edp 4) and one experts entry."""
    d = json.loads(EXAMPLE.read_text())
    d = copy.deepcopy(d)
    d["parallel"].update(ep=4, edp=4)
    for r in d["ranks"]:
        r["ep"] %= 4
    d["experts"] = [entry]
    return d


def test_of_slots_derives_rank_of_expert_and_counts_redundant_slots():
    entry = ExpertPlacement.of_slots(3, SLOTS)
    assert entry.rank_of_expert == (0, 0, 1, 1, 0, 2, 2, 3)
    assert entry.redundant_slots == 2
    assert entry.rank_slots(4) == ((0, 1, 4), (2, 3, 4), (5, 6), (0, 7))


def test_plain_slots_are_left_out_so_old_plans_keep_their_bytes():
    entry = ExpertPlacement.of_slots(1, [[2, 0], [1, 3]])
    assert entry.slots == () and entry.rank_of_expert == (0, 1, 0, 1)
    assert entry.to_dict() == {"layer": 1, "rank_of_expert": [0, 1, 0, 1]}
    assert ExpertPlacement(1, (0, 0, 1, 1)).rank_slots(2) == ((0, 1), (2, 3))


def test_slots_round_trip_through_plan_json():
    entry = ExpertPlacement.of_slots(3, SLOTS)
    plan = plan_from_dict(_plan_with(entry.to_dict()))
    assert plan.experts == (entry,)
    assert json.loads(plan.to_json())["experts"] == [entry.to_dict()]


@pytest.mark.parametrize(
    ("slots", "rank_of_expert", "message"),
    [
        (SLOTS[:3], [0, 0, 1, 1, 0, 2, 2, 3], "has 3 ranks"),
        ([[0, 1, 4], [4, 3, 2], [5, 6], [0, 7]], [0, 0, 1, 1, 0, 2, 2, 3], "ascending"),
        ([[0, 1, 4], [2, 3, 4], [5, 6], [0]], [0, 0, 1, 1, 0, 2, 2, 3], "no slot for expert 7"),
        ([[0, 1, 4], [2, 3, 4], [5, 9], [0, 7]], [0, 0, 1, 1, 0, 2, 2, 3], "expert ids in"),
        (SLOTS, [3, 0, 1, 1, 0, 2, 2, 3], "puts expert 0 first on rank 0"),
    ],
)
def test_bad_slots_are_one_line_naming_the_field(slots, rank_of_expert, message):
    entry = {"layer": 3, "rank_of_expert": rank_of_expert, "slots": slots}
    with pytest.raises(SpecError, match=message) as err:
        plan_from_dict(_plan_with(entry), "p.json")
    assert "field 'experts[0].slots" in str(err.value) and "\n" not in str(err.value)


def test_slot_counts_spread_a_total_over_the_ranks():
    counts = slot_counts(256, 64, 32)  # DeepSeek-V3: 288 slots, one extra on every other rank
    assert counts.sum() == 288 and set(counts[1::2]) == {5} and set(counts[0::2]) == {4}
    assert slot_counts(8, 4, 6).tolist() == [3, 4, 3, 4]
    assert np.array_equal(slot_counts(8, 4), [2, 2, 2, 2])


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """piper plan for tiny-moe (8 experts, 3 MoE layers) on 4 cpu-gloo ranks, ep 4, no FSDP."""
    from planner.cli import main
    from planner.plan import load_plan

    out = tmp_path_factory.mktemp("plan")
    sizes = ["--gpus", "4", "--pp", "1", "--tp", "1", "--ep", "4", "--no-fsdp"]
    args = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", *sizes]
    assert main([*args, "--seq-len", "128", "--global-batch", "16", "--out", str(out)]) == 0
    return load_plan(out / "plan.json")


def test_slot_budget_counts_one_expert_state_per_moe_layer(tiny_plan):
    from planner.inputs.models import load_model
    from planner.search.assemble import slot_budget

    model = load_model("tiny-moe")
    # one routed expert: gated 3 x 64 x 64 = 12288 params x 18 B (the piper target's state),
    # for each of 3 MoE layers
    slot_gib = 3 * 12288 * 18 / 2**30
    budget = slot_budget(tiny_plan, model, None)
    assert budget.slot_gib_per_stage == pytest.approx((slot_gib,))
    room = tiny_plan.predicted.usable_memory_gib - tiny_plan.predicted.memory_gib_per_stage[0]
    assert budget.fit_per_rank == int(room // slot_gib)
    assert budget.redundant_slots == 0  # E / 8 = 1 replica cannot keep every rank at the mean
    assert slot_budget(tiny_plan, model, 6).redundant_slots == 6


def test_requested_slots_that_do_not_fit_are_one_line(tiny_plan):
    from dataclasses import replace

    from planner.inputs.models import load_model
    from planner.search.assemble import slot_budget

    model = load_model("tiny-moe")
    used = tiny_plan.predicted.memory_gib_per_stage[0]
    slot_gib = 3 * 12288 * 18 / 2**30
    tight = replace(
        tiny_plan, predicted=replace(tiny_plan.predicted, usable_memory_gib=used + 1.5 * slot_gib)
    )
    assert slot_budget(tight, model, 4).redundant_slots == 4  # one per rank fits
    with pytest.raises(SpecError, match="2 extra slots per rank need .* on stage 0") as err:
        slot_budget(tight, model, 8)
    assert "at most 4 fit" in str(err.value)
    with pytest.raises(SpecError, match="at most 24"):
        slot_budget(tiny_plan, model, 25)


def test_with_redundant_slots_places_replicas_and_counts_their_memory(tiny_plan):
    from planner.inputs.models import load_model
    from planner.ip.solvers import SolverOptions
    from planner.search.assemble import with_redundant_slots

    model = load_model("tiny-moe")
    plan = with_redundant_slots(tiny_plan, model, None, SolverOptions(), requested=4)
    slot_gib = 3 * 12288 * 18 / 2**30
    assert plan.predicted.memory_gib_per_stage[0] == pytest.approx(
        tiny_plan.predicted.memory_gib_per_stage[0] + slot_gib
    )
    for entry in plan.experts:
        assert entry.redundant_slots == 4 and len(entry.slots) == 4
        assert [len(held) for held in entry.slots] == [3, 3, 3, 3]
        # equal loads: pairs of ranks share two experts, so every rank carries 2 experts' load
        copies = {e: sum(e in held for held in entry.slots) for e in range(8)}
        assert [sum(1 / copies[e] for e in held) for held in entry.slots] == [2.0] * 4
    assert plan.extra["redundant_slots"]["redundant_slots"] == 4
    assert with_redundant_slots(tiny_plan, model, None, SolverOptions(), 0).experts == (
        tiny_plan.experts
    )


def test_fsdp_plans_get_no_redundant_slots(tiny_plan):
    """piper run sums the replicas' gradients as whole experts, FSDP shards them: an FSDP
    plan gets no slots by default, and asking for some is one line naming the fix."""
    from dataclasses import replace

    from planner.inputs.models import load_model
    from planner.search.assemble import slot_budget

    model = load_model("tiny-moe")
    assert slot_budget(tiny_plan, model, 6).redundant_slots == 6
    fsdp = replace(tiny_plan, training={**tiny_plan.training, "fsdp": True, "zero": False})
    roomy = replace(fsdp, predicted=replace(fsdp.predicted, usable_memory_gib=1e6))
    budget = slot_budget(roomy, model, None)
    assert budget.redundant_slots == 0 and budget.fit_per_rank > 1
    with pytest.raises(SpecError, match="--redundant-slots 6 with FSDP.*--no-fsdp"):
        slot_budget(fsdp, model, 6)


def test_plan_with_redundant_slots_keeps_fsdp_off(tmp_path, capsys):
    from planner.cli import main
    from planner.plan import load_plan

    args = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "4", "--pp", "1",
            "--tp", "1", "--ep", "4", "--seq-len", "128", "--global-batch", "16"]  # fmt: skip
    assert main([*args, "--redundant-slots", "4", "--out", str(tmp_path / "a")]) == 0
    plan = load_plan(tmp_path / "a" / "plan.json")
    assert plan.training["fsdp"] is False
    assert all(entry.redundant_slots == 4 for entry in plan.experts)
    capsys.readouterr()
    out = tmp_path / "b"
    assert main([*args, "--fsdp", "--redundant-slots", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--redundant-slots 4 with FSDP" in err[0] and "--no-fsdp" in err[0]
    assert not out.exists()


def test_moves_carry_what_the_runtime_sends_for_piper_plans():
    """Piper's runtime moves an expert's fp32 weights, gradients and Adam moments (16 B per
    parameter), not the target's 18 (which count the bf16 copies of a step); a plan priced for
    another engine keeps its own accounting."""
    from planner.migration.inputs import RUNTIME_MOVE_BYTES_PER_PARAM, _move_training
    from tests.planner.outputs.export_plans import make_plan, priced_for

    piper = make_plan()
    assert piper.training["bytes_per_param"] == 18
    assert _move_training(piper).bytes_per_param == RUNTIME_MOVE_BYTES_PER_PARAM == 16
    assert _move_training(priced_for(make_plan(zero=True), "megatron")).bytes_per_param == 18
