"""torchtitan's activation-checkpoint subcommand for each recompute policy of a plan, and the
refusals of a policy the engine does not run as priced (per-op SAC to Megatron-LM,
Megatron's modules to torchtitan)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.outputs.export import export_plan
from planner.specs import SpecError
from tests.planner.outputs.export_plans import bash_array, priced_for
from tests.planner.outputs.test_export_torchtitan import fsdp_plan, titan
from tests.planner.outputs.test_export_torchtitan_model import titan_plan


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


def test_cuda_graphs_stay_off_as_priced_without_pipelining_or_ep():
    """torchtitan captures CUDA graphs by default at pp = 1, ep = 1; the torchtitan target is
    priced eager, so the export turns them off there too."""
    plan = fsdp_plan()
    par = replace(plan.parallel, pp=1, dp=8, ep=1, edp=8)
    one = replace(plan.stages[0], layers=tuple(range(8)))
    ns, _ = titan(replace(plan, parallel=par, stages=(one,), ranks=(), experts=()))
    assert (ns.pipeline_parallel_degree, ns.expert_parallel_degree) == (1, 1)
    assert ns.no_graphs


@pytest.mark.parametrize(
    ("recompute", "modules", "policy"),
    [("none", (), None), ("selective", ("op",), "SelectiveAC"), ("full", (), "FullAC")],
)
def test_torchtitan_parses_each_policy(recompute, modules, policy):
    """torchtitan 0.3's ConfigManager turns each exported subcommand into its AC policy
    (run where torchtitan is installed)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    plan = _with(titan_plan("qwen3-30b-a3b"), recompute, modules)
    layers = [
        replace(s, recompute_layers=s.layers if recompute != "none" else ()) for s in plan.stages
    ]
    plan = replace(plan, stages=tuple(layers))
    result = export_plan(plan, "torchtitan")
    config = manager.ConfigManager().parse_args(bash_array(result.text, "TORCHTITAN_ARGS"))
    ac = config.activation_checkpoint
    assert (type(ac).__qualname__.split(".")[0] if ac is not None else None) == policy
