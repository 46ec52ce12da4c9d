"""torchtitan's activation-checkpoint subcommand for each recompute policy of a plan, and the
refusals of a policy the engine does not run as priced (per-op SAC to Megatron-LM,
Megatron's modules to torchtitan)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.outputs.export import export_plan
from planner.specs import SpecError
from tests.planner.outputs.export_plans import priced_for
from tests.planner.outputs.test_export_torchtitan import fsdp_plan, titan


def _with(plan, recompute: str, modules: tuple[str, ...] = ()):
    return replace(plan, parallel=replace(plan.parallel, recompute=recompute,
                                          recompute_modules=modules))  # fmt: skip


@pytest.mark.parametrize(
    ("recompute", "modules", "subcommand"),
    [("none", (), "none"), ("selective", ("op",), "selective"), ("full", (), "full")],
)
def test_each_policy_becomes_its_subcommand(recompute, modules, subcommand):
    ns, result = titan(_with(fsdp_plan(), recompute, modules))
    assert ns.ac == f"activation_checkpoint:{subcommand}"
    assert not any("recompute" in n or "AC" in n for n in result.notes)


@pytest.mark.parametrize("modules", [(), ("core_attn", "moe_act")])
def test_torchtitan_refuses_megatron_modules(modules):
    plan = priced_for(_with(fsdp_plan(), "selective", modules), "torchtitan")
    with pytest.raises(
        SpecError, match="does not run as priced.*re-plan with --target torchtitan"
    ) as err:
        export_plan(plan, "torchtitan")
    assert "\n" not in str(err.value)


def test_megatron_refuses_per_op_sac():
    plan = priced_for(_with(fsdp_plan(), "selective", ("op",)), "megatron")
    with pytest.raises(SpecError, match="per-op selective AC.*re-plan with --target megatron"):
        export_plan(plan, "megatron")
