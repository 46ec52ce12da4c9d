"""The fits verdict and the memory intervals: `piper estimate` and `piper plan` say "at the
estimate ... may not fit" exactly when a stage that fits at its point estimate has an 80%
memory interval whose upper end exceeds the device memory, and plan.json, stages.csv and
intervals.csv carry that per stage. The oracle is the interval's upper end, read back from
the same output, held against the device memory of the cluster's YAML."""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import replace

import pytest

from planner.calibrate.error_bars import may_not_fit, may_not_fit_note
from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.ip.solvers import SolverOptions
from planner.outputs import reports
from planner.outputs.tables import capacity_gib
from planner.plan import plan_from_dict
from planner.plan.schema import Interval, Intervals
from planner.search.make_plan import make_plan
from tests.hardening_cli import run_piper
from tests.planner.search.plan_stubs import ToyEvaluator, toy_cluster, toy_model, toy_training

MIXTRAL = ["estimate", "--model", "mixtral-8x7b", "--cluster", "h100", "--pp", "4", "--dp", "8",
           "--ep", "8", "--global-batch", "256"]  # fmt: skip
LAYOUTS = {
    "tight": ["--micro-batch", "1"],  # stage 0's interval reaches past 74.5 GiB
    "selective": ["--micro-batch", "1", "--recompute-modules", "core_attn,moe_act"],
    "full": ["--micro-batch", "2", "--recompute", "full"],
    "over": ["--micro-batch", "4"],  # does not fit at the estimate
}


def hand_intervals(mids: tuple[float, ...], spread: float) -> Intervals:
    """Memory intervals mid / spread .. mid x spread (the step's figures are not read)."""
    one = Interval(1.0, 1.0, 1.0, 0.8)
    memory = tuple(Interval(m / spread, m, m * spread, 0.8) for m in mids)
    return Intervals(0.8, "by hand", 0.1, 0.0, 0.1, one, one, one, one, memory)


@pytest.mark.parametrize(
    ("mids", "spread", "risky"),
    [
        ((50.0, 60.0), 74.5 / 60.0, ()),  # upper end equal to the device: fits
        ((50.0, 60.0), 74.5 / 60.0 * (1 + 1e-9), (1,)),
        ((70.0, 60.0), 1.3, (0, 1)),
        ((80.0, 60.0), 1.1, ()),  # stage 0 over at the estimate, stage 1 under at 66 GiB
    ],
)
def test_the_note_names_exactly_the_stages_whose_upper_end_exceeds_the_device(mids, spread, risky):
    ivs = may_not_fit(hand_intervals(mids, spread), 74.5)
    assert ivs.memory_may_not_fit == tuple(m * spread > 74.5 for m in mids)
    note = may_not_fit_note(ivs, 74.5)
    assert bool(note) == bool(risky)
    for k in risky:
        assert f"{mids[k] * spread:.1f} GiB on stage {k}" in note
    if risky:
        assert note.startswith("the 80% interval's upper end") and note.endswith(
            "74.5 GiB: may not fit"
        )


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimate_says_may_not_fit_exactly_when_the_upper_end_exceeds_the_device(
    layout, capsys, tmp_path
):
    device_gib = load_cluster("h100").device.memory_gib
    argv = [*MIXTRAL, *LAYOUTS[layout]]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    totals = [st["total_gib"] for st in d["stages"]]
    highs = [hi for _, hi in d["intervals"]["memory_gib_per_stage"]]
    assert d["intervals"]["memory_may_not_fit_per_stage"] == [hi > device_gib for hi in highs]
    risky = [k for k, (t, hi) in enumerate(zip(totals, highs, strict=True)) if t <= device_gib < hi]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = re.sub(r"\n {4,}", " ", capsys.readouterr().out)  # a wrapped line made whole
    verdict = next(ln for ln in out.splitlines() if ln.startswith("fits "))
    warned = "may not fit" in verdict
    assert warned == (bool(risky) and d["fits_without_margin"]), verdict
    if warned:
        assert verdict.startswith("fits             at the estimate, with the")
        for k in risky:
            assert f"{highs[k]:.1f} GiB on stage {k}" in verdict
    elif d["fits"]:
        assert verdict.startswith("fits             yes, with the")
    rows = list(csv.DictReader((tmp_path / "intervals.csv").open()))
    flags = [r["may_not_fit"] for r in rows if r["figure"] == "memory_gib"]
    assert flags == [str(int(hi > device_gib)) for hi in highs]
    if layout == "tight":  # the case the warning is for: a layout fitting at its estimate
        assert d["fits"] and warned


@pytest.fixture(scope="module")
def toy_result():
    opts = SolverOptions("cpsat", 10.0, 1, 0)
    return make_plan(toy_model(), toy_cluster(3.0), toy_training(), 16, None, opts,
                     evaluator=ToyEvaluator())  # fmt: skip


@pytest.mark.parametrize("spread", [1.5, 2.0])
def test_plan_summary_csv_and_json_carry_the_verdict(toy_result, spread):
    plan = toy_result.plan
    capacity = 2.0  # the toy cluster's memory the totals are held against
    ivs = may_not_fit(hand_intervals(plan.predicted.memory_gib_per_stage, spread), capacity)
    result = replace(toy_result, plan=replace(plan, predicted=replace(plan.predicted,
                                                                      intervals=ivs)))  # fmt: skip
    mid = plan.predicted.memory_gib_per_stage[0]
    over = mid * spread > capacity
    text = reports.summary_text(result, "out")
    flat = " ".join(text.split())  # the printed lines wrap at 100 columns
    md = reports.summary_md(result)
    assert ("  fits (at the estimate; " in text) == over
    assert ("Fits (at the estimate; " in md) == over
    if over:
        assert f"upper end {mid * spread:.1f} GiB on stage 0 exceeds 2.0 GiB: may not fit" in flat
    files = reports.render_files(result)
    stages = list(csv.DictReader(io.StringIO(files["stages.csv"])))
    assert [s["memory_may_not_fit"] for s in stages] == [str(int(over))]
    back = plan_from_dict(json.loads(files["plan.json"]))
    assert back.predicted.intervals.memory_may_not_fit == (over,)
    fits = reports.BASELINE_COLUMNS.index("fits")
    for b, row in zip(result.baselines, reports.baseline_rows(result), strict=True):
        e = b.estimate
        risky = bool(e and e.fits and max(e.memory_gib_per_stage) * spread > capacity_gib(e))
        want = (
            "at the estimate (80% interval: may not)" if risky else "yes" if e and e.fits else "no"
        )
        assert row[fits] == want, b.title
        assert f"| {want} |" in md


@pytest.mark.parametrize("flags", [[1], [True, False], "yes"])
def test_a_malformed_may_not_fit_list_is_one_line(toy_result, tmp_path, flags):
    plan = toy_result.plan
    ivs = may_not_fit(hand_intervals(plan.predicted.memory_gib_per_stage, 1.5), 2.0)
    d = json.loads(replace(plan, predicted=replace(plan.predicted, intervals=ivs)).to_json())
    d["predicted"]["intervals"]["memory_may_not_fit_per_stage"] = flags
    (tmp_path / "plan.json").write_text(json.dumps(d))
    result = run_piper(["export", str(tmp_path / "plan.json"), "--to", "megatron"])
    assert result.code == 2 and len(result.err_lines) == 1, result.stderr
    assert "predicted.intervals.memory_may_not_fit_per_stage must list 1 booleans" in result.stderr
