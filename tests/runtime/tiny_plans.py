"""Helpers for the runtime tests: a tiny MoE ModelSpec, plans written by hand and the RunSpecs
built from them, the single-device oracle and the per-rank training body."""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.migration import MigrationDecision, Move
from planner.parallel import default_placement
from planner.plan.schema import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
)
from planner.run.spec import RunSpec, run_spec_from_plan
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec
from planner.targets import TARGETS


def tiny_model(layers: int = 4, experts: int = 8, top_k: int = 2, d: int = 32) -> ModelSpec:
    """d=32, first layer dense, the rest MoE (gated experts, one shared expert), vocab 256."""
    att = AttentionSpec("gqa", num_heads=4, num_kv_heads=2, head_dim=8)
    moe = MoESpec(experts, top_k, expert_ffn=32, num_shared_experts=1, shared_ffn=16)
    body = (LayerSpec("dense", att, dense_ffn=64),) + tuple(
        LayerSpec("moe", att, moe=moe) for _ in range(layers - 1)
    )
    return ModelSpec("tiny", "test", d, 256, body)


def hand_plan(
    model: ModelSpec,
    pp: int,
    dp: int,
    ep: int,
    micro_batch: int = 1,
    num_microbatches: int = 2,
    seq_len: int = 64,
    gpus_per_node: int = 8,
    model_entry: ModelEntry | None = None,
    tp: int = 1,
    vp: int = 1,
    etp: int = 1,
    fsdp: bool = False,
) -> Plan:
    """A plan written by hand (no solver): even stages, contiguous expert blocks, ranks in
    order. `model_entry` is plan.model (name, source, config). vp > 1: the runtime interleaves
    the stages' chunks (planner/run/layout.py). Priced with the piper target's state bytes."""
    n = model.num_layers
    bounds = [round(s * n / pp) for s in range(pp + 1)]
    stages = tuple(StagePlan(s, tuple(range(bounds[s], bounds[s + 1]))) for s in range(pp))
    experts = tuple(
        ExpertPlacement(i, default_placement(model.layers[i].moe.num_experts, ep))
        for i in model.moe_layers
    )
    block = dp * tp
    ranks = tuple(
        RankPlan(
            r, r // gpus_per_node, r % gpus_per_node, r // block, r % block // tp, r % tp,
            r % block // etp % ep,
        )
        for r in range(pp * block)
    )  # fmt: skip
    return Plan(
        model=model_entry or ModelEntry(model.name, model.source),
        cluster=ClusterEntry(
            "hand", gpus_per_node=gpus_per_node, nodes=-(-pp * block // gpus_per_node)
        ),
        training={
            "seq_len": seq_len,
            "global_batch": dp * micro_batch * num_microbatches,
            "bytes_per_param": TARGETS["piper"].bytes_per_param,
        }
        | ({"fsdp": True, "fsdp_reduce_dtype": TARGETS["piper"].fsdp_reduce_dtype} if fsdp else {}),
        parallel=ParallelPlan(
            pp,
            dp,
            tp,
            ep,
            block // (etp * ep),
            micro_batch,
            num_microbatches,
            "none",
            vp=vp,
            etp=etp,
        ),
        stages=stages,
        experts=experts,
        ranks=ranks,
        predicted=Predicted(0.0, 0.0, 0.0, 0.0, 0.0, tuple(0.0 for _ in range(pp)), 0.0),
        solver=SolveReport("none", "NOT_SOLVED", 0.0, 0.0, 0.0),
    )


def tiny_spec(
    pp: int,
    dp: int,
    ep: int,
    ranks_per_node: int,
    steps: int = 30,
    layers: int = 4,
    seq_len: int = 32,
    num_microbatches: int = 2,
    **options,
) -> RunSpec:
    """A RunSpec for the tiny model from an even hand plan (micro-batch 2)."""
    model = tiny_model(layers=layers)
    plan = hand_plan(
        model,
        pp,
        dp,
        ep,
        micro_batch=2,
        num_microbatches=num_microbatches,
        seq_len=seq_len,
        gpus_per_node=ranks_per_node,
    )
    return run_spec_from_plan(plan, model, 1.0, ranks_per_node, steps=steps, **options)


def with_options(spec: RunSpec, **changes) -> RunSpec:
    return replace(spec, **changes)


def reference_losses(spec: RunSpec) -> list[float]:
    """Loss sequence of `reference_run`."""
    return reference_run(spec)[0]


def reference_run(spec: RunSpec):
    """(losses, model, optimizer) of the single-device oracle: the whole model, every
    expert local, the global batch of every dp replica, gradients averaged exactly as the
    distributed run averages them."""
    import torch

    from runtime.data import sample_batch
    from runtime.model.transformer import StageModule, lm_loss

    model = StageModule(spec.model, range(spec.model.num_layers), True, True, seed=spec.seed)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    batch, m = spec.micro_batch * spec.num_microbatches, spec.num_microbatches
    losses = []
    for step in range(spec.steps):
        opt.zero_grad()
        total = 0.0
        for j in range(spec.dp):
            x, y = sample_batch(step, j, spec.dp, batch, spec.seq_len, spec.seed)
            for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
                loss = lm_loss(model(xc), yc) / (spec.dp * m)
                loss.backward()
                total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model, opt


def rotate_policy(current_LE, load_history_TLE, costs=None, options=None) -> MigrationDecision:
    """A deliberately bold policy with next_placement's signature, to force moves: every
    expert moves to the next EP rank (ep_idx + 1 mod ep), whatever the loads."""
    import numpy as np

    current = np.asarray(current_LE, dtype=np.int64)
    placement = (current + 1) % (current.max(axis=1, keepdims=True) + 1)
    moves = tuple(
        Move(layer, e, int(a), int(b), 0, 0.0)
        for layer, (old, new) in enumerate(zip(current, placement, strict=True))
        for e, (a, b) in enumerate(zip(old, new, strict=True))
        if a != b
    )
    return MigrationDecision(placement, moves, 0.0)


@dataclass(frozen=True)
class SlotDecision:
    """A test policy's decision for a stage with slot tables (runtime/migrate.py reads
    slots_LRS: per MoE layer, per EP rank, the experts of its slots, -1 = free)."""

    slots_LRS: tuple


def cycle_policy(cycle: list[list[list[int]]]):
    """A test policy over slot tables: every layer goes to the table after its current one
    in `cycle` (per EP rank the experts it holds, in any order), whatever the loads."""

    def held(rows) -> list[list[int]]:
        return [sorted(e for e in r if e >= 0) for r in rows]

    def choose(current_LRS, load_history_TLE, costs=None, options=None) -> SlotDecision:
        order = [held(t) for t in cycle]
        return SlotDecision(
            tuple(cycle[(order.index(held(t)) + 1) % len(cycle)] for t in current_LRS)
        )

    return choose


def train_body(rank: int, world: int, spec: RunSpec, fail_at: int = -1, policy=None):
    """run_distributed body: train and return (losses, files, expert_state, placements,
    slots).

    policy: a function with next_placement's signature (e.g. rotate_policy); None = the
    planner's policy."""
    from runtime.launch import build_trainer
    from runtime.migrate import MigrationPolicy
    from runtime.train import train

    migration = MigrationPolicy(choose=policy) if policy else MigrationPolicy()
    r = train(build_trainer(spec, rank, migration=migration), fail_migration_at=fail_at)
    state = {k: v.numpy().copy() for k, v in r.expert_state.items()}  # no shared-memory fds
    return r.losses, r.files, state, r.placements, r.slots


def assert_experts_match_oracle(results, ref_model, ref_opt, edp: int) -> None:
    """Every expert's weights and Adam moments, on every expert-DP replica, wherever it now
    lives (results: train_body's per-rank returns), equal the single-device oracle's."""
    import numpy as np

    from runtime.migrate import pack_views, slot_state_views

    ref_moes, seen = ref_model.moe_layers(), set()
    for rank_result in results:
        for (layer, expert, replica), packed in rank_result[2].items():
            want = pack_views(slot_state_views(ref_moes[layer], ref_opt, expert)).detach().numpy()
            np.testing.assert_allclose(packed, want, rtol=1e-3, atol=1e-5)
            seen.add((layer, expert, replica))
    experts = len(next(iter(ref_moes.values())).experts.expert_ids)  # the oracle holds all
    assert seen == {(layer, e, q) for layer in ref_moes for e in range(experts) for q in range(edp)}
