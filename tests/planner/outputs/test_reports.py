"""plan.json schema, CSV contents, summary and plots of a PlanResult (toy backend)."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from planner.ip.solvers import SolverOptions
from planner.outputs import plots, reports, tables
from planner.plan import plan_from_dict
from planner.search.make_plan import make_plan
from tests.planner.search.plan_stubs import ToyEvaluator, toy_cluster, toy_model, toy_training

OPTS = SolverOptions("cpsat", 10.0, 1, 0)
SECTION_8 = {
    "schema_version": None,
    "model": None,
    "cluster": None,
    "training": None,
    "parallel": {"pp", "dp", "tp", "ep", "edp", "micro_batch", "num_microbatches", "recompute"},
    "stages": {"stage", "layers", "recompute_layers"},
    "experts": {"layer", "rank_of_expert"},
    "ranks": {"rank", "node", "local_rank", "stage", "dp", "tp", "ep"},
    "predicted": {
        "step_time_s",
        "mfu",
        "tflops_per_gpu",
        "tokens_per_s",
        "bubble_fraction",
        "memory_gib_per_stage",
        "usable_memory_gib",
        "comm_s",
    },
    "solver": {"backend", "status", "objective", "bound", "gap"},
    "inputs_sha256": None,
}


@pytest.fixture(scope="module")
def result():
    return make_plan(
        toy_model(), toy_cluster(3.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator()
    )


@pytest.fixture(scope="module")
def files(result):
    return reports.render_files(result)


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def test_plan_json_has_every_field_of_section_8(files):
    doc = json.loads(files["plan.json"])
    for key, fields in SECTION_8.items():
        assert key in doc, key
        if fields is None:
            continue
        items = doc[key] if isinstance(doc[key], list) else [doc[key]]
        assert items, key
        for item in items:
            assert fields <= set(item), (key, fields - set(item))
    assert re.fullmatch(r"[0-9a-f]{64}", doc["inputs_sha256"])
    assert "wall_s" not in files["plan.json"]  # wall clock lives in timings.json only
    plan_from_dict(doc)  # the reader the runtime uses accepts it


def test_plan_is_self_consistent(result):
    p = result.plan
    layers = [layer for s in p.stages for layer in s.layers]
    assert layers == list(range(len(toy_model().layers)))
    assert p.parallel.pp * p.parallel.dp * p.parallel.tp == 16
    assert len(p.ranks) == 16 and len(p.stages) == p.parallel.pp
    moe = toy_model().moe_layers
    assert [e.layer for e in p.experts] == list(moe)
    for e in p.experts:
        counts = [e.rank_of_expert.count(r) for r in range(p.parallel.ep)]
        assert counts == [8 // p.parallel.ep] * p.parallel.ep
    assert max(p.predicted.memory_gib_per_stage) <= p.predicted.usable_memory_gib


def test_candidates_csv_ranks_every_row_with_feasible_and_reason(result, files):
    rows = _rows(files["candidates.csv"])
    assert len(rows) == len(result.rows)
    assert {"feasible", "reason", "step_time_s", "stage0_memory_gib"} <= set(rows[0])
    assert [int(r["rank"]) for r in rows] == list(range(1, len(rows) + 1))
    top = rows[0]
    par = result.plan.parallel
    assert (int(top["pp"]), int(top["ep"]), int(top["micro_batch"])) == (
        par.pp,
        par.ep,
        par.micro_batch,
    )
    assert float(top["step_time_s"]) == pytest.approx(result.plan.predicted.step_time_s, rel=1e-5)
    for r in rows:
        assert r["feasible"] in ("0", "1")
        if r["feasible"] == "0" or r["status"] != "solved":
            assert r["reason"]
    solved = [
        float(r["step_time_s"]) for r in rows if r["status"] == "solved" and r["feasible"] == "1"
    ]
    assert solved == sorted(solved)


def test_memory_and_stage_csvs_match_the_prediction(result, files):
    pred = result.plan.predicted
    totals = [float(r["gib"]) for r in _rows(files["memory.csv"]) if r["component"] == "total"]
    assert totals == pytest.approx(list(pred.memory_gib_per_stage), rel=1e-4)
    for r in _rows(files["memory.csv"]):
        assert r["component"] in ("weights", "activations", "total")
    stages = _rows(files["stages.csv"])
    assert len(stages) == result.plan.parallel.pp
    assert sum(int(s["num_layers"]) for s in stages) == len(toy_model().layers)
    comm = {r["name"]: float(r["seconds_per_step"]) for r in _rows(files["comm.csv"])}
    assert comm == pytest.approx(dict(pred.comm_s), rel=1e-5)


def test_summary_lists_baselines_with_speedups(result, files):
    md = files["summary.md"]
    for title in ("best uniform split", "X-MoE-like", "EP in a node, fewest stages that fit"):
        assert title in md
    for b in result.baselines:
        if b.estimate is not None and b.estimate.fits:
            assert f"{b.speedup(result.best.step_time_s):.2f}x" in md
    text = reports.summary_text(result, "out")
    assert "TFLOPS/GPU" in text and "Megatron-Core" in text and "wrote out/" in text
    best = result.best.estimate
    assert text.splitlines()[0].startswith(  # tokens/s is the headline
        f"{best.tokens_per_s:,.0f} tokens/s ({best.tokens_per_s / result.gpus:,.0f} per GPU)"
    )
    rows = reports.baseline_rows(result)
    assert [r[0] for r in rows] == [b.title for b in result.baselines]
    cols = reports.BASELINE_COLUMNS
    speedup, per_gpu = cols.index("Piper speedup"), cols.index("tokens/s/GPU")
    for row, b in zip(rows, result.baselines, strict=True):
        if b.estimate is not None and b.estimate.fits:
            assert row[speedup] == f"{b.speedup(result.best.step_time_s):.2f}x"
            per_gpu_value = float(row[per_gpu].replace(",", ""))
            assert per_gpu_value == pytest.approx(b.estimate.tokens_per_s / result.gpus, 1e-3)


def test_rendering_is_byte_identical_across_runs(files):
    again = make_plan(
        toy_model(), toy_cluster(3.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator()
    )
    other = reports.render_files(again)
    assert set(other) == set(files)
    for name in files:
        if name != "timings.json":
            assert other[name] == files[name], name
    for name in ("memory.png", "time.png", "timeline.png"):
        assert files[name][:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("pp", "m"), [(1, 3), (4, 8), (4, 2), (3, 5)])
def test_1f1b_timeline_matches_the_closed_form(pp, m):
    ops = plots.one_f_one_b([3.0] * pp, m)  # forward 1 s, backward 2 s
    assert len(ops) == 2 * pp * m
    assert max(op.end_s for op in ops) == pytest.approx((m + pp - 1) * 3.0)
    for s in range(pp):  # activations held: forwards started minus backwards finished
        events = sorted(
            (op.start_s if op.kind == "F" else op.end_s, op.kind) for op in ops if op.stage == s
        )
        held = peak = 0
        for _, kind in events:
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
        assert peak == min(pp - s, m)


def test_plan_tables_are_dataframes_the_csvs_are_written_from(result, files):
    """The Python API's tables hold numbers (NaN without an estimate); each CSV is its frame
    with floats to fixed digits."""
    import pandas as pd

    t = tables.plan_tables(result)
    assert all(isinstance(f, pd.DataFrame) for f in (t.candidates, t.stages, t.memory, t.comm))
    assert list(t.candidates.columns) == list(tables.CANDIDATE_COLUMNS)
    assert len(t.candidates) == len(result.rows)
    assert t.candidates["step_time_s"].dtype == float and t.candidates["pp"].dtype == int
    solved = t.candidates[t.candidates["status"] == "solved"]
    assert solved["step_time_s"].iloc[0] == result.rows[0].estimate.step_time_s
    total = t.memory[t.memory["component"] == "total"]["gib"].tolist()
    assert total == list(result.plan.predicted.memory_gib_per_stage)
    comm = dict(zip(t.comm["name"], t.comm["seconds_per_step"], strict=True))
    assert comm == pytest.approx(dict(result.plan.predicted.comm_s), rel=1e-12)
    assert tables.to_csv(t.candidates, tables.CANDIDATE_DIGITS) == files["candidates.csv"]
    assert tables.to_csv(t.stages, tables.STAGE_DIGITS) == files["stages.csv"]
    assert tables.to_csv(t.memory, tables.MEMORY_DIGITS) == files["memory.csv"]
    assert tables.to_csv(t.comm, tables.COMM_DIGITS) == files["comm.csv"]
    no_estimate = t.candidates[t.candidates["step_time_s"].isna()]
    rows = _rows(files["candidates.csv"])
    assert all(rows[i]["step_time_s"] == "" for i in no_estimate.index)
