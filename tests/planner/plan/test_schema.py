"""plan.json's owner: typed entries that write back the same bytes, one solve report type,
check lists that follow the dataclasses, and no import cycle inside planner.plan."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from planner.ip.solvers import LinearModel, SolverOptions, solve
from planner.plan import (
    ClusterEntry,
    ModelEntry,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    load_plan,
    plan_from_dict,
)
from planner.plan.schema import json_fields
from planner.specs import SpecError

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "results" / "example" / "plan.json"


def _example() -> dict:
    return json.loads(EXAMPLE.read_text())


def test_example_plan_writes_back_byte_identical():
    plan = load_plan(EXAMPLE)
    assert plan.to_json() == EXAMPLE.read_text()
    assert isinstance(plan.model, ModelEntry) and isinstance(plan.cluster, ClusterEntry)
    assert (plan.model.name, plan.cluster.name) == ("mixtral-8x7b", "frontier")
    c = plan.cluster
    assert (c.gpus_per_node, c.nodes, c.gpus, c.nodes_used) == (8, 9408, 64, 8)
    assert [lv["name"] for lv in c.profile["levels"]][:2] == ["package", "node"]
    assert plan.cluster_spec().total_gpus == 8 * 9408


def test_hand_written_cluster_keeps_only_its_keys():
    section = {"name": "cpu-gloo", "gpus_per_node": 2, "env": {"A": "1"}}
    entry = ClusterEntry.from_dict(section)
    assert entry.nodes is None and entry.profile == {"env": {"A": "1"}}
    assert entry.to_dict() == {**section, "source": ""}


def test_solver_section_leaves_wall_time_and_message_out():
    model = LinearModel("one")
    x = model.bool_var("x")
    model.add([(1, x)], ">=", 1)
    model.minimize([(3, x)])
    report = solve(model, SolverOptions()).report
    assert isinstance(report, SolveReport) and report.objective == 3.0
    assert report.to_dict() == {"backend": "cpsat", "status": "OPTIMAL", "objective": 3.0,
                                "bound": 3.0, "gap": 0.0}  # fmt: skip
    assert json.loads(load_plan(EXAMPLE).to_json())["solver"].keys() == report.to_dict().keys()


def _without(section: str, key: str, index: int | None = None) -> dict:
    d = _example()
    target = d[section] if index is None else d[section][index]
    target.pop(key)
    return d


@pytest.mark.parametrize(
    ("section", "cls", "index"),
    [("predicted", Predicted, None), ("solver", SolveReport, None), ("ranks", RankPlan, 0)],
)
def test_every_plan_field_is_required(section, cls, index):
    for f in json_fields(cls):
        if f.default is not MISSING:  # comm_s, a rank's cp index: optional with a default
            continue
        with pytest.raises(SpecError, match=f"'{section}.*{f.name}' is missing"):
            plan_from_dict(_without(section, f.name, index), "p.json")


def test_entry_fields_are_type_checked():
    d = _example()
    d["cluster"]["nodes_used"] = 0
    with pytest.raises(SpecError, match="field 'cluster.nodes_used' must be >= 1"):
        plan_from_dict(d, "p.json")
    d = _example()
    d["model"]["name"] = 7
    with pytest.raises(SpecError, match=r"field 'model.name' has the wrong type \(int 7\)"):
        plan_from_dict(d, "p.json")


def test_plan_sections_follow_the_dataclass():
    lists_and_labels = ("stages", "experts", "ranks", "inputs_sha256", "schema_version", "extra")
    for key in [f.name for f in fields(Plan) if f.name not in lists_and_labels]:
        d = _example()
        d.pop(key)
        with pytest.raises(SpecError, match=f"field '{key}' is missing"):
            plan_from_dict(d, "p.json")


@pytest.mark.parametrize(
    "module",
    ["planner.plan.check", "planner.plan.schema", "planner.plan.io", "planner.plan.settings"],
)
def test_each_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
