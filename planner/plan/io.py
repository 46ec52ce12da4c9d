"""Reading plan.json: `load_plan(path)` and `plan_from_dict(d)`, both validated on read.

planner.plan.check validates the parsed document (schema version, types, sizes and
consistency) and names the field and the fix; this module then builds the typed Plan.
Writing is `Plan.to_json()` (planner.plan.schema).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.inputs.json_errors import json_error_line
from planner.inputs.paths import read_text_file
from planner.plan.check import check_plan_dict
from planner.plan.schema import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
    json_fields,
)
from planner.specs import SpecError


def plan_from_dict(d: Any, path: str = "plan.json") -> Plan:
    """Build a Plan from parsed JSON.

    Args:
        d: the parsed plan.json document.
        path: the file it came from, named in every error.
    Raises:
        SpecError: one line naming `path`, the field and the fix (planner.plan.check).
    """
    check_plan_dict(d, path)
    pred = {
        **d["predicted"],
        "memory_gib_per_stage": tuple(d["predicted"]["memory_gib_per_stage"]),
        "comm_s": tuple(sorted(d["predicted"].get("comm_s", {}).items())),
    }
    return Plan(
        model=ModelEntry.from_dict(d["model"]),
        cluster=ClusterEntry.from_dict(d["cluster"]),
        training=d["training"],
        parallel=ParallelPlan(**_known(ParallelPlan, d["parallel"])),
        stages=tuple(
            StagePlan(s["stage"], tuple(s["layers"]), tuple(s.get("recompute_layers", ())))
            for s in d["stages"]
        ),
        experts=tuple(
            ExpertPlacement(
                e["layer"],
                tuple(e["rank_of_expert"]),
                tuple(tuple(held) for held in e.get("slots", ())),
            )
            for e in d["experts"]
        ),
        ranks=tuple(RankPlan(**_known(RankPlan, r)) for r in d["ranks"]),
        predicted=Predicted(**{f.name: pred[f.name] for f in json_fields(Predicted)}),
        solver=SolveReport(**{f.name: d["solver"][f.name] for f in json_fields(SolveReport)}),
        inputs_sha256=d.get("inputs_sha256", ""),
        schema_version=d["schema_version"],
        extra=d.get("extra", {}),
    )


def _known(cls: type, entry: dict[str, Any]) -> dict[str, Any]:
    """The plan.json fields of dataclass `cls` in `entry`; a field with a default may be
    absent (plans written before it existed); lists become tuples."""
    out = {}
    for f in json_fields(cls):
        if f.name in entry:
            value = entry[f.name]
            out[f.name] = tuple(value) if isinstance(value, list) else value
    return out


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan.json file (see plan_from_dict)."""
    p = Path(path)
    if not p.exists():
        raise SpecError(f"{p}: no such plan file; create one with 'piper plan --out DIR'")
    text = read_text_file(p, "plan")
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        fix = "regenerate it with 'piper plan --out DIR'"
        raise SpecError(json_error_line(str(p), exc, fix)) from None
    except (ValueError, RecursionError):  # a number of > 4300 digits, nesting past the stack
        raise SpecError(f"{p}: not a plan (a number or nesting too large to read)") from None
    return plan_from_dict(d, str(p))
