"""Expert tensor parallelism and the folded expert mesh on gloo.

Oracles: the rank convention of planner/FORMULATION.md by hand; an expert's width slices
sum to the whole expert's output; one step's gradients equal the single-device model's (a
slice of each expert for an expert-TP rank) for expert-TP groups over data-parallel ranks,
over tensor-parallel ranks, and for an EP group spanning the data x tensor block.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planner.calibrate.metrics import parse_metrics
from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError
from runtime.model.moe import Experts
from runtime.parallel.expert_tp import _slot_major, shard_experts
from runtime.parallel.mesh import group_members, rank_coords
from tests.runtime.parallel.grads import assert_match_oracle, reference, step_body
from tests.runtime.tiny_plans import hand_plan, reference_losses, tiny_model, train_body


def _featureful_model():
    """tiny_model (3 layers) with expert biases, attention biases and qk-norm."""
    base = tiny_model(layers=3)
    layers = []
    for layer in base.layers:
        att = replace(layer.attention, bias=True, o_bias=True, qk_norm=True)
        moe = layer.moe and replace(layer.moe, expert_bias=True, router_bias=True)
        layers.append(replace(layer, attention=att, moe=moe))
    return replace(base, layers=tuple(layers))


def _spec(dp, tp, ep, etp, pp=1, model=None, steps=1, **options):
    model = model or _featureful_model()
    plan = hand_plan(
        model, pp, dp, ep, micro_batch=2, num_microbatches=2, seq_len=32, gpus_per_node=2,
        tp=tp, etp=etp,
    )  # fmt: skip
    return run_spec_from_plan(plan, model, 1.0, 2, steps=steps, **options)


def test_expert_mesh_folds_over_the_stage_block():
    spec = _spec(dp=2, tp=2, ep=2, etp=2, pp=2)  # 8 ranks, edp = 4 / (2 * 2) = 1
    assert spec.edp == 1
    for c in rank_coords(spec):  # j = dp_idx * tp + tp_idx; etp fastest, then ep, then edp
        j = c.logical % 4
        assert (c.etp_idx, c.ep_idx, c.edp_idx) == (j % 2, j // 2 % 2, j // 4)
    groups = group_members(spec)
    # expert-TP groups are the TP pairs; EP groups take one rank of each pair (2 apart)
    assert groups["etp"] == [[0, 1], [2, 3], [4, 5], [6, 7]] == groups["tp"]
    assert groups["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["edp"] == [[r] for r in range(8)]
    # ep = dp * tp: one EP group spans the whole data x tensor block of a stage
    wide = group_members(_spec(dp=2, tp=2, ep=4, etp=1, pp=2))
    assert wide["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and "etp" not in wide
    # etp over data-parallel ranks: dp = 4, ep = 2, etp = 2
    assert group_members(_spec(dp=4, tp=1, ep=2, etp=2))["ep"] == [[0, 2], [1, 3]]


def test_width_slices_sum_to_the_whole_expert():
    spec = _featureful_model().layers[1].moe
    whole = Experts(32, spec, [3, 5], seed=0, layer=1)
    rows = torch.randn(7, 32, generator=torch.Generator().manual_seed(0))
    counts = [4, 3]
    parts = []
    for index in range(4):
        shard = Experts(32, spec, [3, 5], seed=0, layer=1)
        shard_experts(shard, 4, index)
        assert shard.w_in.shape == (2, 32, 8) and shard.w_out.shape == (2, 8, 32)
        assert (shard.b_out is not None) == (index == 0)  # the output bias is added once
        parts.append(shard(rows, counts))
    assert torch.allclose(sum(parts), whole(rows, counts), atol=1e-6)
    with pytest.raises(ValueError, match="etp=3"):
        shard_experts(Experts(32, spec, [3], seed=0, layer=1), 3, 0)


def test_gathered_rows_are_grouped_by_slot():
    counts_PX = torch.tensor([[2, 1], [0, 3]])  # member 0: rows 0-2, member 1: rows 3-5
    assert _slot_major(counts_PX).tolist() == [0, 1, 2, 3, 4, 5]
    assert _slot_major(torch.tensor([[1, 2], [2, 1]])).tolist() == [0, 3, 4, 1, 2, 5]


def test_etp_that_does_not_divide_the_scaled_expert_width_is_refused():
    base = tiny_model()
    model = replace(base, layers=tuple(
        replace(x, moe=x.moe and replace(x.moe, expert_ffn=48)) for x in base.layers
    ))  # fmt: skip
    plan = hand_plan(model, 1, 16, 1, gpus_per_node=16, etp=16)  # 48 splits 16 ways
    assert run_spec_from_plan(plan, model, 1.0, 16).etp == 16
    with pytest.raises(SpecError, match="etp=16 does not divide run layer 1's expert FFN"):
        run_spec_from_plan(plan, model, 0.5, 16)  # 24 does not


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
@pytest.mark.parametrize(
    ("dp", "tp", "ep", "etp"),
    [(2, 1, 1, 2), (4, 1, 2, 2), (2, 2, 2, 2), (2, 2, 4, 1)],
    ids=["etp-over-dp", "etp-and-ep-over-dp", "etp-over-tp-ep-over-dp", "ep-spans-dp-x-tp"],
)
def test_gradients_equal_the_single_device_gradients(run_distributed, dp, tp, ep, etp):
    spec = _spec(dp=dp, tp=tp, ep=ep, etp=etp)
    ref = reference(spec)
    results = run_distributed(step_body, spec.world, spec, timeout_s=120)
    assert assert_match_oracle(results, ref, tp, etp) == set(ref)
    if etp > 1:  # each rank holds 1/etp of every local expert's width
        ffn = spec.model.layers[1].moe.expert_ffn
        shapes = {v.shape for r in results for k, v in r[1].items() if k[2:3] == ("w_in",)}
        assert shapes == {(spec.model.hidden_size, ffn // etp)}


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_pp2_etp2_trains_like_the_oracle_and_counts_expert_tp_bytes(run_distributed):
    spec = _spec(dp=2, tp=1, ep=1, etp=2, pp=2, steps=6, model=tiny_model())
    results = run_distributed(train_body, spec.world, spec, timeout_s=240)
    lines = parse_metrics(results[0][1]["metrics.jsonl"])
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)
    # by hand: per MoE layer and micro-batch, each rank of a pair sends half of the pair's
    # row buffer in each of 4 ring passes (gather, reduce-scatter, their backward); with
    # ep = 1 every rank holds all T k routed rows, so no padding: T k D fp32 per pass, plus
    # half of the gathered int64 rows-per-slot counts (8 slots)
    etp_bytes = sum(v for k, v in lines[-1]["bytes_by_kind"].items() if k.startswith("etp"))
    rows = spec.micro_batch * spec.seq_len * spec.model.top_k
    per_call = 4 * rows * spec.model.hidden_size * 4 + spec.model.num_experts * 8
    moe_layers = sum(layer.moe is not None for layer in spec.model.layers)
    assert etp_bytes == spec.dp * moe_layers * spec.num_microbatches * per_call


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_etp2_with_live_migration_trains_like_the_oracle(run_distributed):
    """dp = 4, ep = 2, etp = 2: both expert-TP slices of a moved expert move along their own
    EP groups (ranks 0, 2 and 1, 3) with the stage's one decision."""
    from tests.runtime.tiny_plans import rotate_policy

    spec = _spec(dp=4, tp=1, ep=2, etp=2, steps=5, model=tiny_model(), migrate_every=2)
    results = run_distributed(train_body, spec.world, spec, -1, rotate_policy, timeout_s=240)
    lines = parse_metrics(results[0][1]["metrics.jsonl"])
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=1e-4, abs=1e-4)
    assert [d["migrated_experts"] for d in lines] == [0, 24, 0, 24, 0]  # 3 MoE layers x 8
