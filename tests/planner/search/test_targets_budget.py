"""The torchtitan target runs every memory budget a layout can name, and only those."""

from __future__ import annotations

from planner.parallel import BUDGET_MODULES
from planner.search.target_space import target_choices
from planner.targets import TARGETS


def test_torchtitan_runs_the_budget_grid_of_parallel():
    modules = TARGETS["torchtitan"].recompute_modules
    assert modules[0] == "op" and modules[1:] == BUDGET_MODULES
    for name in ("megatron", "piper"):
        assert not set(TARGETS[name].recompute_modules or ()) & set(BUDGET_MODULES)


def test_searched_budgets_only_for_torchtitan_and_only_when_modules_are_searched():
    def cut(name: str, modules=None):
        return target_choices(TARGETS[name], {}, None, modules, ["fsdp"], None, ["flat"], False)

    titan = cut("torchtitan")
    assert titan.module_set == ("op",)
    assert titan.budget_sets == (("budget:0.1",), ("budget:0.25",), ("budget:0.5",))
    assert cut("torchtitan", ["op"]).budget_sets == ()  # the user fixed the set
    assert cut("megatron").budget_sets == () and cut("piper").budget_sets == ()
