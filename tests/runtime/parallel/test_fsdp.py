"""FSDP (training.fsdp: torch's fully_shard) on gloo.

Oracles: one step's gradients and the weights after one Adam step equal the single-device
model's; parameters, gradients and Adam moments are shards (1/dp of the dense weights, 1/edp
of the experts); a training run's loss sequence equals the oracle's; the gradients are
reduce-scattered after every micro-batch and the parameters all-gathered for its forward and
backward (ring passes over the FSDP units, counted by hand from the parameters), with and
without pipelining.
"""

from __future__ import annotations

import pytest

from planner.calibrate.metrics import parse_metrics
from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError
from tests.runtime.parallel.grads import assert_match_oracle, reference, step_body
from tests.runtime.tiny_plans import hand_plan, reference_losses, tiny_model, train_body

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("corpus")]


def _spec(pp=1, dp=2, ep=1, tp=1, vp=1, layers=4, m=2, steps=1, **options):
    model = tiny_model(layers=layers)
    plan = hand_plan(
        model, pp, dp, ep, micro_batch=2, num_microbatches=m, seq_len=32, gpus_per_node=2,
        tp=tp, vp=vp, fsdp=True,
    )  # fmt: skip
    return run_spec_from_plan(plan, model, 1.0, 2, steps=steps, **options)


def _shards_body(rank: int, world: int, spec):
    """After one step: for each parameter, (local numel, whole numel, Adam moment numel)."""
    from torch.distributed.tensor import DTensor

    from runtime.launch import build_trainer
    from runtime.train import train

    trainer = build_trainer(spec, rank)
    train(trainer)
    out = []
    for p in trainer.module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        moment = trainer.optimizer.state[p]["exp_avg"]
        moment = moment.to_local() if isinstance(moment, DTensor) else moment
        out.append((isinstance(p, DTensor), local.numel(), p.numel(), moment.numel()))
    return out


@pytest.mark.parametrize(
    ("pp", "dp", "ep", "tp", "vp", "layers", "m"),
    [
        (1, 2, 1, 1, 1, 4, 2),
        (2, 2, 2, 1, 1, 4, 2),
        (1, 2, 2, 2, 1, 3, 2),
        (2, 1, 1, 1, 2, 4, 2),
        (1, 1, 1, 2, 1, 3, 2),
    ],
    ids=["dp2", "pp2-dp2-ep2", "dp2-tp2-ep2", "pp2-vp2", "tp2-edp2"],  # edp2: dp 1, edp 2
)
def test_gradients_and_updated_weights_equal_the_oracle(run_distributed, pp, dp, ep, tp, vp,
                                                        layers, m):  # fmt: skip
    spec = _spec(pp, dp, ep, tp, vp, layers, m)
    assert spec.fsdp
    ref_grads = reference(spec)
    grads = run_distributed(step_body, spec.world, spec, timeout_s=120)
    assert assert_match_oracle(grads, ref_grads, tp, 1) == set(ref_grads)
    ref_weights = reference(spec, weights=True)
    weights = run_distributed(step_body, spec.world, spec, True, timeout_s=120)
    # Adam's first step is about lr * sign(g): loose where a gradient is near zero
    assert assert_match_oracle(weights, ref_weights, tp, 1, atol=1e-5) == set(ref_weights)


def test_weights_gradients_and_moments_are_shards(run_distributed):
    spec = _spec(dp=2, ep=1, steps=1)  # edp = 2: experts sharded over the same pair
    for params in run_distributed(_shards_body, spec.world, spec):
        assert all(sharded for sharded, *_ in params)
        assert sum(local for _, local, _, _ in params) * 2 == sum(n for _, _, n, _ in params)
        assert all(moment == local for _, local, _, moment in params)


@pytest.mark.parametrize("pp", [1, 2])
def test_fsdp_trains_like_the_oracle_and_its_collectives_move_the_units_bytes(run_distributed, pp):
    from runtime.model.transformer import StageModule

    spec = _spec(pp=pp, dp=2, ep=1, m=3 if pp == 1 else 4, steps=4)  # edp = 2: experts too
    results = run_distributed(train_body, spec.world, spec, timeout_s=240)
    lines = parse_metrics(results[0][1]["metrics.jsonl"])
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)
    # by hand, from the FSDP units' parameters (fp32, each parameter's dim 0 padded to a
    # multiple of dp): per ring pass each of the dp ranks sends (dp - 1) / dp of a unit
    model, dp, m = StageModule(spec.model, range(4), True, True), spec.dp, spec.num_microbatches

    def unit(params) -> float:  # bytes all ranks send in one pass over one unit
        rows = [-(-p.shape[0] // dp) * dp * (p.numel() // p.shape[0]) for p in params]
        return dp * (dp - 1) / dp * 4 * sum(rows)

    experts = [b.moe.experts for b in model.blocks if b.moe is not None]
    expert_ids = {id(p) for e in experts for p in e.parameters()}
    blocks = sum(unit([p for p in b.parameters() if id(p) not in expert_ids]) for b in model.blocks)
    root = unit([p for n, p in model.named_parameters() if not n.startswith("blocks.")])
    expert = sum(unit(list(e.parameters())) for e in experts)
    kinds = lines[-1]["bytes_by_kind"]  # all on one emulated node: every key ends in _intra
    # gradients: reduce-scattered into the shards after every micro-batch's backward
    assert kinds["grad_dense_intra"] == m * (blocks + root)
    assert kinds["grad_expert_intra"] == m * expert
    # weights: every block and expert unit gathered for each micro-batch's forward and again
    # for its backward; the root unit (embedding, norm, head) kept from forward to backward
    assert kinds["param_gather_intra"] == m * (2 * (blocks + expert) + root)


def test_fsdp_with_live_migration_or_replicas_is_refused():
    from dataclasses import replace

    model = tiny_model()
    plan = hand_plan(model, 1, 2, 2, gpus_per_node=2, fsdp=True)
    with pytest.raises(SpecError, match="--migrate-every with training.fsdp"):
        run_spec_from_plan(plan, model, 1.0, 2, migrate_every=2)
    slots = ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))  # experts 0 and 4 on both EP ranks
    layer = replace(plan.experts[0], slots=slots)
    with pytest.raises(SpecError, match="training.fsdp with redundant expert slots"):
        run_spec_from_plan(replace(plan, experts=(layer, *plan.experts[1:])), model, 1.0, 2)
