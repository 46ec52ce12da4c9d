"""Expert migration: traces, forecasts, priced placement policies and their replay.

The runtime's entry point is `next_placement` (api.py), priced by `plan_move_costs`
(inputs.py) from the plan it trains; `piper migrate` replays a trace under every policy
(run.py). See MIGRATION.md.
"""

from planner.migration.api import MigrationDecision, next_placement
from planner.migration.inputs import plan_move_costs
from planner.migration.placement import Move
from planner.migration.policies import MigrationOptions
from planner.migration.pricing import MoveCosts

__all__ = [
    "MigrationDecision",
    "MigrationOptions",
    "Move",
    "MoveCosts",
    "next_placement",
    "plan_move_costs",
]
