"""The prices a run's live migration pays, from its plan: torch-free, so `piper run` checks
them before it starts any process and the runtime asks for them once at start-up."""

from __future__ import annotations

from planner.migration import MoveCosts, plan_move_costs
from planner.plan import Plan
from planner.run.spec import RunSpec


def run_move_costs(
    plan: Plan, spec: RunSpec, where: str = "plan.json"
) -> tuple[MoveCosts | None, ...]:
    """The prices of each stage's MoE layers, as `piper migrate --plan` prices them.

    The plan gives the cluster, the device of every EP rank and the training (bytes per
    parameter, dtype); the run gives the model, so a `--scale` run prices the bytes of the
    shrunken experts it moves and the expert compute it runs. One interval is migrate_every
    steps; tokens per EP rank and step = micro_batch x num_microbatches x seq_len of the run.

    Returns:
        One MoveCosts per stage (rows: its MoE layers, ascending), None for a stage without.
    """
    tokens = spec.micro_batch * spec.num_microbatches * spec.seq_len
    out: list[MoveCosts | None] = []
    for layers in spec.stage_layers:
        moe = [i for i in layers if spec.model.layers[i].moe is not None]
        if not moe:
            out.append(None)
            continue
        src = [spec.source_layers[i] for i in moe]
        out.append(plan_move_costs(plan, spec.model, moe, src, spec.migrate_every, tokens, where))
    return tuple(out)
