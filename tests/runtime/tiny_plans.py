"""Helpers for E2's runtime tests: a tiny MoE ModelSpec and RunSpecs built from hand plans."""

from __future__ import annotations

from dataclasses import replace

from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec
from runtime.scale import RunSpec, hand_plan, run_spec_from_plan


def tiny_model(layers: int = 4, experts: int = 8, top_k: int = 2, d: int = 32) -> ModelSpec:
    """d=32, first layer dense, the rest MoE (gated experts, one shared expert), vocab 256."""
    att = AttentionSpec("gqa", num_heads=4, num_kv_heads=2, head_dim=8)
    moe = MoESpec(experts, top_k, expert_ffn=32, num_shared_experts=1, shared_ffn=16)
    body = (LayerSpec("dense", att, dense_ffn=64),) + tuple(
        LayerSpec("moe", att, moe=moe) for _ in range(layers - 1)
    )
    return ModelSpec("tiny", "test", d, 256, body)


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
