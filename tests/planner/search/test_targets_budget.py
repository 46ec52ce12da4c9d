"""The torchtitan target runs every memory budget a layout can name, and only those."""

from __future__ import annotations

from planner.parallel import BUDGET_MODULES
from planner.targets import TARGETS


def test_torchtitan_runs_the_budget_grid_of_parallel():
    modules = TARGETS["torchtitan"].recompute_modules
    assert modules[0] == "op" and modules[1:] == BUDGET_MODULES
    for name in ("megatron", "piper"):
        assert not set(TARGETS[name].recompute_modules or ()) & set(BUDGET_MODULES)
