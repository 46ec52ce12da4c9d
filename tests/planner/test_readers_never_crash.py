"""Readers never crash, continued: plan.json, trace.csv and metrics.jsonl.

As for the model, cluster and allocation readers (tests/planner/inputs/
test_reader_properties.py), hypothesis feeds each reader random bytes and a real file with
random values put at any depth (numbers no hardware could hold, wrong types, nesting); the
reader returns a value its consumers can use (a plan every export renders, a trace the
migration planner can take, metrics calibration can read) or raises one SpecError line.
"""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from planner.calibrate.metrics import REQUIRED_KEYS, load_metrics, parse_metrics
from planner.migration.trace import load_trace, trace_from_text
from planner.outputs.export import EXPORT_TARGETS, export_plan
from planner.plan import Plan, load_plan, plan_from_dict
from planner.specs import SpecError
from tests.planner.inputs.test_reader_properties import (
    MAGNITUDES,
    RANDOM_BYTES,
    SETTINGS,
    _mutated,
    one_line,
)
from tests.planner.outputs.export_plans import make_plan

PLAN_DOC = json.loads(make_plan().to_json())
TRACE_ROWS = [(t, layer, e, 10 * t + e) for t in range(2) for layer in (1, 3) for e in range(4)]
TRACE_CSV = "interval,layer,expert,tokens\n" + "".join(f"{t},{ly},{e},{n}\n"
                                                        for t, ly, e, n in TRACE_ROWS)  # fmt: skip
STEP = {"step": 0, "loss": 2.5, "step_time_s": 0.5, "tokens_per_s": 1e4,
        "peak_memory_bytes": 2**30, "dispatch_s": 0.01, "combine_s": 0.01,
        "bytes_intra_node": 10, "bytes_inter_node": 20,
        "per_rank": [{"rank": 0, "stage": 0, "peak_memory_bytes": 2**30, "dispatch_s": 0.01,
                      "combine_s": 0.01}]}  # fmt: skip


def _exports_render(plan: Plan) -> None:
    """Every export of a plan that loaded renders, or says why in one SpecError line."""
    for target in EXPORT_TARGETS:
        try:
            assert export_plan(plan, target, "/p/plan.json").text
        except SpecError as exc:
            assert one_line(exc), exc


@SETTINGS
@given(raw=RANDOM_BYTES)
def test_plan_json_random_bytes(raw, tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(raw)
    try:
        load_plan(path)
    except SpecError as exc:
        assert one_line(exc), exc


@SETTINGS
@given(data=st.data())
def test_plan_json_random_values_at_any_depth(data):
    doc = _mutated(PLAN_DOC, data)
    try:
        plan = plan_from_dict(doc, "plan.json")
    except SpecError as exc:
        assert one_line(exc), exc
        return
    _exports_render(plan)


def test_plan_json_numbers_beyond_hardware_are_one_line(tmp_path):
    for key, value in (("dp", 10**30), ("pp", 2**40), ("num_microbatches", 10**400)):
        doc = json.loads(json.dumps(PLAN_DOC))
        doc["parallel"][key] = value
        try:
            plan_from_dict(doc)
        except SpecError as exc:
            assert one_line(exc) and key in str(exc)
        else:
            raise AssertionError(f"parallel.{key}={value} was accepted")
    doc = json.loads(json.dumps(PLAN_DOC))
    doc["predicted"]["step_time_s"] = 10**400
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    try:
        load_plan(path)
    except SpecError as exc:
        assert one_line(exc) and "predicted.step_time_s" in str(exc)
    path.write_text('{"a": ' + "1" * 5000 + "}")  # past Python's int-digit limit
    try:
        load_plan(path)
    except SpecError as exc:
        assert one_line(exc)


def test_plan_json_training_types_are_checked():
    doc = json.loads(json.dumps(PLAN_DOC))
    doc["training"]["seq_len"] = "4k"
    try:
        plan_from_dict(doc)
    except SpecError as exc:
        assert "training.seq_len" in str(exc) and one_line(exc)
    doc["training"].update(seq_len=128, zero=True, fsdp=True)
    try:
        plan_from_dict(doc)
    except SpecError as exc:
        assert "fsdp and zero" in str(exc) and one_line(exc)


@SETTINGS
@given(raw=RANDOM_BYTES)
def test_trace_random_bytes(raw, tmp_path):
    path = tmp_path / "trace.csv"
    path.write_bytes(raw)
    try:
        trace = load_trace(path)
    except SpecError as exc:
        assert one_line(exc), exc
        return
    assert trace.tokens_ILE.min() >= 0


@SETTINGS
@given(data=st.data())
def test_trace_random_values_in_any_cell(data):
    lines = TRACE_CSV.splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        row = data.draw(st.integers(0, len(lines) - 1))
        cells = lines[row].split(",")
        col = data.draw(st.integers(0, 3))
        value = data.draw(MAGNITUDES)
        cells[col] = data.draw(st.sampled_from([str(value), repr(value), json.dumps(value)[:30]]))
        lines[row] = ",".join(cells)
    try:
        trace = trace_from_text("\n".join(lines) + "\n")
    except SpecError as exc:
        assert one_line(exc), exc
        return
    assert trace.tokens_ILE.min() >= 0 and trace.tokens_ILE.max() <= 2**62


def test_trace_huge_ids_do_not_allocate():
    """An interval or expert id of 10**9 is one line, not a dense array of 10**9 cells."""
    for row in ("1000000000,1,0,5", "0,1,999999999,5", "0,7,3,5"):
        try:
            trace_from_text(TRACE_CSV + row + "\n")
        except SpecError as exc:
            assert one_line(exc)
    try:
        trace_from_text("interval,layer,expert,tokens\n0,0,0," + "9" * 30 + "\n")
    except SpecError as exc:
        assert "above" in str(exc) and one_line(exc)


@SETTINGS
@given(raw=RANDOM_BYTES)
def test_metrics_random_bytes(raw, tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(raw)
    try:
        load_metrics(path)
    except SpecError as exc:
        assert one_line(exc), exc


@SETTINGS
@given(data=st.data())
def test_metrics_random_values_at_any_depth(data):
    steps = [dict(STEP, step=i) for i in range(2)]
    steps = [_mutated(s, data) if data.draw(st.booleans()) else s for s in steps]
    text = "\n".join(json.dumps(s) for s in steps) + "\n"
    try:
        rows = parse_metrics(text)
    except SpecError as exc:
        assert one_line(exc), exc
        return
    for row in rows:  # what calibration reads is finite
        assert all(math.isfinite(float(row[k])) for k in REQUIRED_KEYS)
        for r in row.get("per_rank", []):
            assert math.isfinite(float(r["peak_memory_bytes"] + r["dispatch_s"]))
