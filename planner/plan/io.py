"""Reading plan.json: `load_plan(path)` and `plan_from_dict(d)`, both validated on read.

planner.plan.check validates the parsed document (schema version, types, sizes and
consistency) and names the field and the fix; this module then builds the typed Plan.
Writing is `Plan.to_json()` (planner.plan.schema).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from planner.inputs.json_errors import DuplicateKey, json_error_line, unique_object
from planner.inputs.paths import read_text_file
from planner.plan.check import check_plan_dict
from planner.plan.schema import (
    ClusterEntry,
    ExpertPlacement,
    Intervals,
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
        model=ModelEntry.from_dict(d["model"], path),
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
        predicted=Predicted(
            **{f.name: pred[f.name] for f in json_fields(Predicted)},
            intervals=_intervals(d["predicted"], path),
        ),
        solver=SolveReport(**{f.name: d["solver"][f.name] for f in json_fields(SolveReport)}),
        inputs_sha256=d.get("inputs_sha256", ""),
        schema_version=d["schema_version"],
        extra=d.get("extra", {}),
    )


def _intervals(pred: dict[str, Any], path: str) -> Intervals | None:
    """predicted.intervals (planner.plan.schema.Intervals), None when the plan has none; a
    malformed block is one SpecError line naming the key."""
    block = pred.get("intervals")
    if block is None:
        return None
    where = f"{path}: predicted.intervals"
    fix = "regenerate the plan with 'piper plan' or delete the block"
    if not isinstance(block, dict):
        raise SpecError(f"{where} must be an object; {fix}")
    stages = len(pred["memory_gib_per_stage"])
    pairs = {n: block.get(n) for n in Intervals.FIGURES}
    memory = block.get("memory_gib_per_stage")
    if not isinstance(memory, list) or len(memory) != stages:
        raise SpecError(f"{where}.memory_gib_per_stage must list {stages} [lo, hi] pairs; {fix}")
    pairs.update({f"memory_gib_per_stage[{i}]": m for i, m in enumerate(memory)})
    for name, pair in pairs.items():
        if not (isinstance(pair, list) and len(pair) == 2 and all(_is_number(x) for x in pair)
                and pair[0] <= pair[1]):  # fmt: skip
            raise SpecError(f"{where}.{name} must be [lo, hi] with lo <= hi; {fix}")
    for key in ("level", "time_log_sd", "param_log_sd", "memory_log_sd"):
        if not _is_number(block.get(key)) or block[key] < 0:
            raise SpecError(f"{where}.{key} must be a number >= 0; {fix}")
    if not 0 < block["level"] < 1:
        raise SpecError(f"{where}.level must lie in (0, 1), got {block['level']}; {fix}")
    if not isinstance(block.get("source"), str):
        raise SpecError(f"{where}.source must be text; {fix}")
    over = block.get("memory_may_not_fit_per_stage", [False] * stages)
    if not (isinstance(over, list) and len(over) == stages
            and all(isinstance(x, bool) for x in over)):  # fmt: skip
        raise SpecError(f"{where}.memory_may_not_fit_per_stage must list {stages} booleans; {fix}")
    return Intervals.from_dict(block, pred)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


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
        d = json.loads(text, object_pairs_hook=unique_object)
    except json.JSONDecodeError as exc:
        fix = "regenerate it with 'piper plan --out DIR'"
        raise SpecError(json_error_line(str(p), exc, fix)) from None
    except DuplicateKey as exc:
        raise SpecError(
            f"{p}: key {exc.key[:60]!r} is given twice in one object; keep one (or regenerate "
            "it with 'piper plan --out DIR')"
        ) from None
    except (ValueError, RecursionError):  # a number of > 4300 digits, nesting past the stack
        raise SpecError(f"{p}: not a plan (a number or nesting too large to read)") from None
    return plan_from_dict(d, str(p))
