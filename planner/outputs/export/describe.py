"""What every export says about a plan: its title line, and which MoE layers place their
experts other than the contiguous blocks Megatron and torchtitan assume."""

from __future__ import annotations

from planner.plan.schema import Plan


def plan_title(plan: Plan) -> str:
    """One line naming the model, the cluster, the layout and the plan's inputs digest."""
    p = plan.parallel
    return (
        f"piper plan: {plan.model.name or 'model'} on {plan.cluster.name or 'cluster'}"
        f" (pp {p.pp}, dp {p.dp}, tp {p.tp}, ep {p.ep}), inputs_sha256 {plan.inputs_sha256[:12]}"
    )


def noncontiguous_expert_layers(plan: Plan) -> int:
    """MoE layers whose placement is not the default 'expert e on EP rank e // (E/ep)'."""
    permuted = 0
    for placement in plan.experts:
        n = len(placement.rank_of_expert)
        per_rank = max(1, n // plan.parallel.ep)
        if list(placement.rank_of_expert) != [e // per_rank for e in range(n)]:
            permuted += 1
    return permuted
