"""torchtitan's memory-budget AC in the export: the subcommand, the budget and the compile
flags torchtitan 0.3 needs for it; other targets refuse a budget layout in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.outputs.export import export_plan
from planner.parallel import ParallelConfig
from planner.search.target_space import check_layout_for
from planner.specs import SpecError, TrainingSpec
from planner.targets import TARGETS
from tests.planner.outputs.export_plans import bash_array, priced_for
from tests.planner.outputs.test_export_torchtitan import fsdp_plan
from tests.planner.outputs.test_export_torchtitan_model import titan_plan


def _budget(plan, budget: str = "0.35"):
    return replace(plan, parallel=replace(plan.parallel, recompute="selective",
                                          recompute_modules=(f"budget:{budget}",)))  # fmt: skip


def test_budget_becomes_memory_budget_with_compile():
    plan = priced_for(_budget(fsdp_plan()), "torchtitan")
    args = bash_array(export_plan(plan, "torchtitan").text, "TORCHTITAN_ARGS")
    tail = args[args.index("--compile.enable") :]
    assert tail == [
        "--compile.enable", "--compile.components", "model,loss",
        "activation_checkpoint:memory-budget", "--activation_checkpoint.memory_budget", "0.35",
    ]  # fmt: skip


def test_only_the_torchtitan_target_runs_a_budget():
    """A fixed budget layout (`piper estimate`) is checked against the target: torchtitan runs
    it, Megatron-Core and Piper's runtime refuse it in one line naming the fix."""
    training = TrainingSpec(seq_len=4096, global_batch=64, fsdp=True)
    par = ParallelConfig(pp=1, dp=8, ep=8, recompute="selective",
                         recompute_modules=("budget:0.5",))  # fmt: skip
    check_layout_for(TARGETS["torchtitan"], training, par, "flat")
    for name in ("megatron", "piper"):
        with pytest.raises(SpecError, match=r"--memory-budget 0.5: .*--target torchtitan") as err:
            check_layout_for(TARGETS[name], training, par, "flat")
        assert "\n" not in str(err.value)


def test_torchtitan_parses_the_memory_budget():
    """torchtitan 0.3's ConfigManager builds MemoryBudgetAC with the budget and a compiled
    model from the exported arguments (run where torchtitan is installed)."""
    manager = pytest.importorskip("torchtitan.config.manager")
    plan = _budget(titan_plan("qwen3-30b-a3b"), "0.5")
    layers = [replace(s, recompute_layers=s.layers) for s in plan.stages]
    plan = replace(plan, stages=tuple(layers))
    result = export_plan(plan, "torchtitan")
    config = manager.ConfigManager().parse_args(bash_array(result.text, "TORCHTITAN_ARGS"))
    ac = config.activation_checkpoint
    assert type(ac).__qualname__.split(".")[0] == "MemoryBudgetAC"
    assert ac.memory_budget == 0.5
    assert config.compile.enable and "model" in config.compile.components


def test_megatron_export_refuses_a_budget_plan():
    plan = priced_for(_budget(fsdp_plan()), "megatron")
    with pytest.raises(SpecError, match="budget:0.35.*re-plan with --target megatron") as err:
        export_plan(plan, "megatron")
    assert "\n" not in str(err.value)
