"""piper calibrate against a run that did not do what the plan priced (its run.json), the
per-stage all-to-all with overlap, and calibration.png's bars."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import replace

import pytest

from planner.calibrate.compare import Calibration, Component, calibrate, estimate_plan
from planner.calibrate.report import calibration_figure, calibration_markdown
from planner.calibrate.run_settings import (
    Difference,
    Repricing,
    differences_line,
    repricing,
    run_differences,
)
from planner.cli import main
from planner.plan import ParallelPlan, StagePlan
from tests.planner.calibrate.test_compare import RANKS, metrics_lines, tiny_plan

RUN = {"pp": 2, "dp": 2, "tp": 1, "ep": 2, "vp": 1, "etp": 1, "micro_batch": 1,
       "num_microbatches": 4, "seq_len": 64, "fsdp": False, "recompute": "none",
       "hidden_size": 64, "layers": 4, "dispatcher": "flat", "steps": 2}  # fmt: skip
HALO_DEDUP = (
    "the run differs from what the plan priced: dispatcher halo-dedup (plan: flat); "
    "predictions repriced for the halo-dedup dispatcher"
)


def _calibrate_cli(tmp_path, capsys, run: dict | None) -> tuple[str, dict[str, float]]:
    """Run `piper calibrate` on tiny_plan() and a 2-step metrics.jsonl with `run` as run.json;
    returns stdout and the predicted column of calibration.csv by (component, stage)."""
    (tmp_path / "plan.json").write_text(tiny_plan().to_json())
    rows = metrics_lines([(2.4, 0.2, 0.2, RANKS), (2.5, 0.2, 0.2, RANKS)])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if run is not None:
        (tmp_path / "run.json").write_text(json.dumps(run))
    args = ["calibrate", str(tmp_path / "plan.json"), str(tmp_path / "metrics.jsonl")]
    assert main([*args, "--out", str(tmp_path / "cal")]) == 0
    table = csv.DictReader(io.StringIO((tmp_path / "cal" / "calibration.csv").read_text()))
    predicted = {(r["component"], r["stage"]): float(r["predicted"]) for r in table}
    return capsys.readouterr().out, predicted


def test_a_halo_dedup_run_of_a_flat_plan_is_said_and_repriced(tmp_path, capsys):
    out, predicted = _calibrate_cli(tmp_path, capsys, {**RUN, "dispatcher": "halo-dedup"})
    assert HALO_DEDUP + "\n" in out
    assert HALO_DEDUP + "\n" in (tmp_path / "cal" / "calibration.md").read_text()
    halo = estimate_plan(tiny_plan(), reprice=Repricing("halo-dedup", False))
    # the whole step is the resource model's for halo-dedup, not plan.json's hand-made 2.0 s
    assert predicted["step_time_s", "all"] == pytest.approx(halo.step_time_s, rel=1e-5)
    assert predicted["step_time_s", "all"] != pytest.approx(2.0)
    a2a = sum(s for n, s in halo.comm_s if n.startswith("a2a"))
    assert predicted["a2a_s", "all"] == pytest.approx(a2a, rel=1e-5)


def test_a_run_that_did_what_the_plan_priced_keeps_plan_json(tmp_path, capsys):
    out, predicted = _calibrate_cli(tmp_path, capsys, RUN)
    assert "differs" not in out
    assert predicted["step_time_s", "all"] == pytest.approx(2.0)


def test_other_differences_are_listed_and_not_repriced(tmp_path, capsys):
    out, predicted = _calibrate_cli(tmp_path, capsys, {**RUN, "hidden_size": 32, "layers": 2})
    line = (
        "the run differs from what the plan priced: hidden_size 32 (plan: 64), layers 2 "
        "(plan: 4); the other differences are not repriced"
    )
    assert line + "\n" in out
    assert predicted["step_time_s", "all"] == pytest.approx(2.0)


def test_overlap_is_dropped_where_the_runs_dispatcher_does_not_allow_it():
    plan = _overlapped_plan()
    diffs = run_differences(plan, {"dispatcher": "halo-dedup"})
    assert diffs == (Difference("dispatcher", "flat", "halo-dedup"),)
    reprice = repricing(plan, diffs)
    assert reprice == Repricing("halo-dedup", False)
    assert differences_line(diffs, reprice, True).endswith(
        ", without the all-to-all overlap (not allowed with halo-dedup)"
    )
    assert repricing(plan, run_differences(plan, {"dispatcher": "flat"})) is None


def _overlapped_plan():
    """tiny_plan at pp=1 dp=4 ep=2 in bf16 with the all-to-all overlap (the model allows it)."""
    plan = tiny_plan()
    training = {**plan.training, "a2a_overlap": True, "dtype": "bf16"}
    return replace(plan, training=training, parallel=ParallelPlan(1, 4, 1, 2, 2, 1, 2, "none"),
                   stages=(StagePlan(0, (0, 1, 2, 3)),))  # fmt: skip


def test_stage_a2a_counts_the_all_to_all_hidden_behind_compute():
    plan = _overlapped_plan()
    (stage,) = estimate_plan(plan).stages
    exposed = sum(s for n, s in stage.time_s if n.startswith("a2a"))
    hidden = sum(s for n, s in stage.hidden_s if n.startswith("a2a"))
    assert hidden > 0
    cal = calibrate(plan, metrics_lines([(2.0, 0.1, 0.1, [(0, 2**30, 0.1, 0.1)])] * 2))
    assert cal.get("a2a_s", 0).predicted == pytest.approx(2 * (exposed + hidden))


def test_calibration_plot_has_one_bar_and_label_per_table_row():
    cal = Calibration(
        (
            Component("step_time_s", None, 2.0, 2.5, "s"),
            Component("tokens_per_s", None, 128.0, 100.0, "tokens/s"),
            Component("a2a_s", 0, 0.0, 0.3, "s"),  # predicted 0: the row the plot used to drop
            Component("a2a_s", 1, 0.2, 0.0, "s"),
            Component("memory_gib", 1, 1.5, 1.6, "GiB"),
        ),
        2,
        "resource model",
    )
    (ax,) = calibration_figure(cal).axes
    table_rows = [line for line in calibration_markdown(cal).splitlines() if line.startswith("| ")]
    assert len(ax.containers) == len(table_rows) - 1 == 5  # one bar per row (header aside)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[2] == "a2a_s\nstage 0" and labels[0] == "step_time_s\nstep"
    notes = [t.get_text() for t in ax.texts]
    assert notes[2] == "predicted 0" and notes[3] == "measured 0" and notes[0] == "-20.0%"
    assert ax.get_yscale() == "log" and "predicted / measured" in ax.get_ylabel()


def test_a_fit_prices_a_logged_run_with_the_dispatcher_it_ran(tmp_path):
    """`piper calibrate --fit --log PLAN:metrics.jsonl` and plain `piper calibrate` price a
    run whose run.json records another dispatcher alike: as it ran."""
    from planner.calibrate.runs import run_of_metrics

    (tmp_path / "plan.json").write_text(tiny_plan().to_json())
    rows = metrics_lines([(2.4, 0.2, 0.2, RANKS), (2.5, 0.2, 0.2, RANKS)])
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = run_of_metrics(tmp_path / "plan.json", tmp_path / "metrics.jsonl")
    assert plain.dispatcher == "flat"
    (tmp_path / "run.json").write_text(json.dumps({**RUN, "dispatcher": "halo-dedup"}))
    ran = run_of_metrics(tmp_path / "plan.json", tmp_path / "metrics.jsonl")
    assert ran.dispatcher == "halo-dedup" and ran.measured == plain.measured
    assert ran.training == plain.training  # no overlap to drop here
    # an overlapped plan run with halo-dedup: the overlap does not run with it, so it goes
    plan = _overlapped_plan()
    one_stage = replace(
        plan.predicted, memory_gib_per_stage=plan.predicted.memory_gib_per_stage[:1]
    )
    (tmp_path / "plan.json").write_text(replace(plan, predicted=one_stage).to_json())
    overlapped = run_of_metrics(tmp_path / "plan.json", tmp_path / "metrics.jsonl")
    assert overlapped.dispatcher == "halo-dedup" and not overlapped.training.a2a_overlap
    (tmp_path / "run.json").unlink()
    as_planned = run_of_metrics(tmp_path / "plan.json", tmp_path / "metrics.jsonl")
    assert as_planned.dispatcher == "flat" and as_planned.training.a2a_overlap
