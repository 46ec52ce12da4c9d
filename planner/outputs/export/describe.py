"""What every export says about a plan: its title line, and which MoE layers place their
experts other than the contiguous blocks Megatron and torchtitan assume."""

from __future__ import annotations

from planner.plan.priced import noncontiguous_expert_layers
from planner.plan.schema import Plan

__all__ = ["noncontiguous_expert_layers", "plan_title"]


def plan_title(plan: Plan) -> str:
    """One line naming the model, the cluster, the layout and the plan's inputs digest."""
    p = plan.parallel
    return (
        f"piper plan: {plan.model.name or 'model'} on {plan.cluster.name or 'cluster'}"
        f" (pp {p.pp}, dp {p.dp}, tp {p.tp}, ep {p.ep}), inputs_sha256 {plan.inputs_sha256[:12]}"
    )
