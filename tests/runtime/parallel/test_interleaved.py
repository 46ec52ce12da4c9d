"""Interleaved 1F1B (vp > 1) on gloo: each pipeline rank runs vp model chunks with
torch.distributed.pipelining's interleaved schedule.

Oracles: one step's gradients, every one of them, equal the single-device model's on the
same global batch; a training run's loss sequence equals the oracle's; the pipeline sends
one activation and one gradient per micro-batch across each of the pp * vp - 1 chunk
boundaries; a rank table whose pipeline order is not the process group's sorted order trains
the same.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.calibrate.metrics import parse_metrics
from planner.plan.schema import RankPlan
from planner.run.spec import run_spec_from_plan
from tests.runtime.parallel.grads import assert_match_oracle, reference, step_body
from tests.runtime.tiny_plans import hand_plan, reference_losses, tiny_model, train_body

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("corpus")]


def _spec(pp=2, dp=1, ep=1, vp=2, layers=8, m=4, g=2, ranks=None, steps=1, **options):
    model = tiny_model(layers=layers)
    plan = hand_plan(
        model, pp, dp, ep, micro_batch=2, num_microbatches=m, seq_len=32, gpus_per_node=g, vp=vp
    )
    if ranks is not None:
        plan = replace(plan, ranks=ranks)
    return run_spec_from_plan(plan, model, 1.0, g, steps=steps, **options)


def test_pp2_vp2_every_gradient_equals_the_single_device_gradient(run_distributed):
    spec = _spec()  # 8 layers: rank 0 runs layers 0-1 and 4-5, rank 1 runs 2-3 and 6-7
    assert spec.chunks(0) == ((0, (0, 1)), (2, (4, 5)))
    assert spec.chunks(1) == ((1, (2, 3)), (3, (6, 7)))
    ref = reference(spec)
    seen = assert_match_oracle(run_distributed(step_body, spec.world, spec), ref, 1, 1)
    assert seen == set(ref)  # every parameter of the model, each on the rank that runs it


def test_pp2_vp2_dp2_ep2_trains_like_the_oracle_and_sends_every_chunk_boundary(run_distributed):
    spec = _spec(dp=2, ep=2, steps=6, dispatcher="flat")
    results = run_distributed(train_body, spec.world, spec, timeout_s=240)
    lines = parse_metrics(results[0][1]["metrics.jsonl"])
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)
    # every micro-batch's activation [mb, S, D] fp32 crosses each of the pp * vp - 1 chunk
    # boundaries forward and its gradient backward, on each of the dp pipelines
    act = spec.micro_batch * spec.seq_len * spec.model.hidden_size * 4
    for line in lines[1:]:  # step 0 adds the schedule's one-time shape inference
        p2p = sum(v for k, v in line["bytes_by_kind"].items() if k.startswith("p2p"))
        assert p2p == act * spec.num_microbatches * 2 * spec.dp * (spec.pp * spec.vp - 1)


def test_permuted_pipeline_order_with_vp2_trains_like_the_oracle(run_distributed):
    """Stage 1 on the lower physical ranks: group rank 0 runs plan position 1's chunks."""
    rows = (
        RankPlan(2, 0, 0, 1, 0, 0, 0),
        RankPlan(3, 0, 1, 1, 1, 0, 1),
        RankPlan(0, 1, 0, 0, 0, 0, 0),
        RankPlan(1, 1, 1, 0, 1, 0, 1),
    )
    spec = _spec(dp=2, ep=2, layers=4, ranks=rows, steps=4)
    assert spec.logical_of_physical == (2, 3, 0, 1)
    results = run_distributed(train_body, spec.world, spec, timeout_s=240)
    losses = [d["loss"] for d in parse_metrics(results[0][1]["metrics.jsonl"])]
    assert losses == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)
