"""plan.json: the typed schema (schema, settings), its validation (check) and reading it (io)."""

from planner.plan.io import load_plan, plan_from_dict
from planner.plan.schema import (
    SCHEMA_VERSION,
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
)

__all__ = [
    "SCHEMA_VERSION",
    "ClusterEntry",
    "ExpertPlacement",
    "ModelEntry",
    "ParallelPlan",
    "Plan",
    "Predicted",
    "RankPlan",
    "SolveReport",
    "StagePlan",
    "load_plan",
    "plan_from_dict",
]
