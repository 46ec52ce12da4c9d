"""Error bars in the CLI: `piper estimate` prints and writes each figure's interval, `piper plan`
puts them in plan.json, the summary and the CSVs; plan.json readers take plans with and without
them and refuse a malformed block in one line. Interval ends are checked against the log-normal
formula with the spread read from the preset's YAML and scipy's quantiles."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from scipy.stats import norm, t

from planner.calibrate.uncertainty import (
    DEFAULT_MEMORY_LOG_SD,
    DEFAULT_TIME_LOG_SD,
    describe_source,
)
from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.plan import load_plan
from planner.specs import SpecError

ROOT = Path(__file__).resolve().parents[3]
ESTIMATE = ["estimate", "--model", "mixtral-8x7b", "--pp", "4", "--dp", "8", "--ep", "8",
            "--global-batch", "256"]  # fmt: skip


def spread(cluster: str, param_log_sd: float = 0.0) -> tuple[float, float]:
    """(tokens/s hi / mid, memory hi / mid) at 80% from what the preset's YAML records, with
    the fitted constants' covariance propagated to the layout (param_log_sd) added."""
    cal = yaml.safe_load((ROOT / "profiles" / "clusters" / f"{cluster}.yaml").read_text()).get(
        "calibration", {}
    )
    if "loo_rms_log" in cal:
        sd = math.hypot(float(cal["loo_rms_log"]), param_log_sd)
        time = math.exp(t.ppf(0.9, int(cal["runs"])) * sd)
    else:
        time = math.exp(norm.ppf(0.9) * DEFAULT_TIME_LOG_SD)
    return time, math.exp(norm.ppf(0.9) * DEFAULT_MEMORY_LOG_SD)


@pytest.mark.parametrize("cluster", ["h100", "frontier", "h200"])
def test_estimate_json_carries_each_figures_interval(cluster, capsys):
    assert main([*ESTIMATE, "--cluster", cluster, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    iv = d["intervals"]
    f_time, f_mem = spread(cluster, iv["param_log_sd"])
    cal = yaml.safe_load((ROOT / "profiles" / "clusters" / f"{cluster}.yaml").read_text()).get(
        "calibration", {}
    )
    # h100 and frontier record a covariance; h200 carries h100's constants uncalibrated
    assert (iv["param_log_sd"] > 0) == any(k.startswith("se_") for k in cal)
    assert (cluster == "h200") == (cal == {})
    assert iv["level"] == 0.8
    for key in ("tokens_per_s", "step_time_s", "tflops_per_gpu"):
        lo, hi = iv[key]
        assert lo == pytest.approx(d[key] / f_time, rel=1e-6)
        assert hi == pytest.approx(d[key] * f_time, rel=1e-6)
    assert iv["mfu"][1] == pytest.approx(min(d["mfu"] * f_time, 1.0), rel=1e-6)
    assert len(iv["memory_gib_per_stage"]) == 4
    for (lo, hi), st in zip(iv["memory_gib_per_stage"], d["stages"], strict=True):
        assert lo == pytest.approx(st["total_gib"] / f_mem, rel=1e-6)
        assert hi == pytest.approx(st["total_gib"] * f_mem, rel=1e-6)
    assert iv["source"] == describe_source(load_cluster(cluster))


def test_estimate_prints_intervals_and_writes_intervals_csv(tmp_path, capsys):
    assert main([*ESTIMATE, "--cluster", "frontier", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "intervals: tokens/s [" in out and "(80%)" in out
    assert "memory (GiB) stage 0 [" in out and "stage 3 [" in out
    assert f"from {describe_source(load_cluster('frontier'))}" in " ".join(out.split())
    rows = list(csv.DictReader((tmp_path / "intervals.csv").open()))
    assert [r["figure"] for r in rows] == ["tokens_per_s", "step_time_s", "tflops_per_gpu",
                                           "mfu"] + ["memory_gib"] * 4  # fmt: skip
    for r in rows:
        assert float(r["lo"]) <= float(r["mid"]) <= float(r["hi"])


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("plan")
    args = ["plan", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--gpus", "16", "--pp", "2",
            "--ep", "8", "--global-batch", "256", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    return out


def test_plan_json_summary_and_csvs_carry_the_intervals(plan_dir):
    d = json.loads((plan_dir / "plan.json").read_text())
    pred = d["predicted"]
    iv = pred["intervals"]
    f_time, f_mem = spread("h100", iv["param_log_sd"])
    assert iv["tokens_per_s"][1] / pred["tokens_per_s"] == pytest.approx(f_time, rel=1e-6)
    assert iv["param_log_sd"] > 0  # the preset records its constants' covariance
    for (lo, hi), mid in zip(iv["memory_gib_per_stage"], pred["memory_gib_per_stage"], strict=True):
        assert lo == pytest.approx(mid / f_mem, rel=1e-6) and hi == pytest.approx(mid * f_mem)
    summary = (plan_dir / "summary.md").read_text()
    assert "Intervals: fitted on 12 runs" in summary and "(80%)" in summary
    cands = list(csv.DictReader((plan_dir / "candidates.csv").open()))
    best = cands[0]
    assert float(best["tokens_per_s_hi"]) == pytest.approx(
        float(best["tokens_per_s"]) * f_time, rel=1e-5
    )
    assert float(best["step_time_s_lo"]) == pytest.approx(
        float(best["step_time_s"]) / f_time, rel=1e-5
    )
    stages = list(csv.DictReader((plan_dir / "stages.csv").open()))
    assert float(stages[1]["memory_gib_hi"]) == pytest.approx(
        float(stages[1]["memory_gib"]) * f_mem, rel=1e-4
    )
    totals = [
        r for r in csv.DictReader((plan_dir / "memory.csv").open()) if r["component"] == "total"
    ]
    assert all(float(r["gib_lo"]) < float(r["gib"]) < float(r["gib_hi"]) for r in totals)


def test_plans_with_and_without_intervals_load(plan_dir, tmp_path):
    plan = load_plan(plan_dir / "plan.json")
    d = json.loads((plan_dir / "plan.json").read_text())
    ivs = plan.predicted.intervals
    assert ivs is not None and ivs.tokens_per_s.mid == d["predicted"]["tokens_per_s"]
    assert [ivs.tokens_per_s.lo, ivs.tokens_per_s.hi] == d["predicted"]["intervals"]["tokens_per_s"]
    assert json.loads(plan.to_json()) == d  # written back byte for byte in content
    del d["predicted"]["intervals"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = load_plan(tmp_path / "old.json")
    assert (
        old.predicted.intervals is None
        and "intervals" not in json.loads(old.to_json())["predicted"]
    )


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda iv: iv.update(tokens_per_s=[2.0, 1.0]), "tokens_per_s must be"),
        (lambda iv: iv["memory_gib_per_stage"].pop(), "must list 2"),
        (lambda iv: iv.update(level=1.5), "level must lie in"),
        (lambda iv: iv.pop("source"), "source must be text"),
    ],
)
def test_a_malformed_intervals_block_is_one_line(plan_dir, tmp_path, edit, match):
    d = json.loads((plan_dir / "plan.json").read_text())
    edit(d["predicted"]["intervals"])
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(SpecError, match=match) as err:
        load_plan(tmp_path / "bad.json")
    assert "\n" not in str(err.value) and "predicted.intervals" in str(err.value)


def test_a_fitted_profile_adds_its_constants_covariance(tmp_path, capsys):
    from planner.calibrate.uncertainty import error_model, parameter_log_sd
    from planner.inputs.models import load_model
    from planner.parallel import ParallelConfig
    from planner.resources.cost import estimate
    from planner.specs import TrainingSpec
    from planner.targets import TARGETS, with_conventions
    from tests.planner.calibrate.synthetic import LAYOUTS, runs_csv, truth_cluster

    (tmp_path / "runs.csv").write_text(runs_csv(truth_cluster(), LAYOUTS[:4]))
    fitted = tmp_path / "fitted.yaml"
    fit = ["calibrate", "--fit", str(tmp_path / "runs.csv"), "--cluster", "h100", "--params",
           "gemm_efficiency,layer_overhead_us", "--out", str(fitted)]  # fmt: skip
    assert main([*fit, "--no-loo"]) == 0
    out = capsys.readouterr().out
    assert "error bars with it: fitted on the start profile's 12 runs (no leave-one-out" in out
    assert main(fit) == 0
    out = capsys.readouterr().out
    assert "fitted on 4 runs pooled with the start profile's 12" in out
    kept = dict(load_cluster(str(fitted)).calibration)["params"]  # what the runs identify
    assert kept and f"{len(kept.split(','))} fitted constant(s)" in out
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", str(fitted), "--dp", "16",
            "--ep", "16", "--global-batch", "256", "--json"]  # fmt: skip
    assert main(args) == 0
    iv = json.loads(capsys.readouterr().out)["intervals"]
    cluster = load_cluster(str(fitted))
    model = error_model(cluster)
    tr = with_conventions(TrainingSpec(global_batch=256, zero=True), TARGETS["megatron"])
    par = ParallelConfig(pp=1, dp=16, ep=16, micro_batch=1, num_microbatches=16)
    qwen = load_model("qwen3-30b-a3b")
    param = parameter_log_sd(cluster, lambda c: estimate(qwen, c, tr, par).tokens_per_s, model)
    assert param > 0 and iv["param_log_sd"] == pytest.approx(param, rel=1e-6)
    assert iv["time_log_sd"] == pytest.approx(math.hypot(model.time_log_sd, param), rel=1e-6)


def test_a_profile_with_a_bad_recorded_error_is_one_line_and_exit_2(tmp_path, capsys):
    text = (ROOT / "profiles" / "clusters" / "h100.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(re.sub(r"loo_rms_log: [0-9.]+", "loo_rms_log: lots", text, count=1))
    assert main([*ESTIMATE, "--cluster", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "calibration.loo_rms_log = 'lots'" in err
    assert not (tmp_path / "o").exists()
