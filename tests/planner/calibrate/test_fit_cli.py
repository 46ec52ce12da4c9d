"""`piper calibrate --fit RUNS.csv --cluster C --out FITTED.yaml`: the fitted profile loads and
holds the printed constants; piper runs join as --run; bad inputs are one line, exit 2, and
nothing is written."""

from __future__ import annotations

import json
import re

import pytest

from planner.calibrate.compare import estimate_plan
from planner.calibrate.fit_report import constant_text
from planner.inputs.clusters import cluster_to_yaml, load_cluster
from tests.hardening_cli import run_piper
from tests.planner.calibrate.synthetic import (
    LAYOUTS,
    TRUTH,
    derived_cluster,
    runs_csv,
    truth_cluster,
)
from tests.planner.calibrate.test_compare import RANKS, metrics_lines, tiny_plan

PARAMS = "gemm_efficiency,layer_overhead_us"


@pytest.fixture(scope="module")
def runs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("runs") / "runs.csv"
    path.write_text(runs_csv(truth_cluster(), LAYOUTS[:3]))
    return path


def _printed(out: str, name: str) -> tuple[str, str]:
    """(before, after) of a constant in the printed constants table."""
    match = re.search(rf"^{name}\s+(\S+)\s+(\S+)\s+(yes|kept)", out, re.MULTILINE)
    assert match, out
    return match.group(1), match.group(2)


def test_the_fit_writes_a_profile_the_planner_reads(runs_file, tmp_path):
    out = tmp_path / "fitted" / "h100-mine.yaml"
    base = tmp_path / "h100.yaml"  # the preset's hardware with the derived efficiencies
    base.write_text(cluster_to_yaml(derived_cluster()))
    result = run_piper(["calibrate", "--fit", str(runs_file), "--cluster", str(base),
                        "--out", str(out), "--params", PARAMS])  # fmt: skip
    assert result.code == 0, result.stderr
    fitted = load_cluster(str(out))
    assert fitted.name == "h100-fitted"
    start = load_cluster(str(base))
    for name in ("gemm_efficiency", "layer_overhead_us", "attention_efficiency"):
        before, after = _printed(result.stdout, name)
        assert before == constant_text(getattr(start, name))
        assert after == constant_text(getattr(fitted, name))
    # two of the three constants that made the runs: the fit moves toward them (the prior
    # holds them short of the truth, the third constant being off)
    assert abs(fitted.gemm_efficiency - TRUTH["gemm_efficiency"]) < 0.06
    assert 0.5 * TRUTH["layer_overhead_us"] < fitted.layer_overhead_us
    assert fitted.attention_efficiency == start.attention_efficiency
    cal = dict(fitted.calibration)
    assert cal["runs"] == "3" and cal["runs_used"] == "id 1, id 2, id 3"
    assert cal["params"] == PARAMS and cal["runs_file"] == str(runs_file)
    assert float(cal["fit_rms_log"]) < float(cal["before_rms_log"])
    assert {"date", "loo_geomean", "loo_within_15pct", "loo_worst"} <= set(cal)
    assert re.search(r"^leave-one-out\s+3\s", result.stdout, re.MULTILINE), result.stdout
    assert f"wrote {out}" in result.stdout


def test_a_piper_run_joins_the_fit(runs_file, tmp_path):
    plan = tmp_path / "plan.json"
    made = tiny_plan()
    plan.write_text(made.to_json())
    pairs = []
    # runs 1.3x and 1.45x below the model's tokens/s: a profile that applies (metrics_lines
    # logs 256 tokens a step, the plan's batch is 8 x 64 = 512)
    tokens_s = 512 / estimate_plan(made).step_time_s
    for k, step_s in enumerate(256 / (tokens_s / f) for f in (1.3, 1.45)):
        metrics = tmp_path / f"m{k}.jsonl"
        rows = metrics_lines([(step_s, 0.2, 0.2, RANKS)] * 2)
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        pairs += ["--run", f"{plan}:{metrics}"]
    out = tmp_path / "cpu.yaml"
    # runs.csv holds only H100 rows: on cpu-gloo the two piper runs are the fit's runs
    result = run_piper(["calibrate", "--fit", str(runs_file), "--cluster", "cpu-gloo",
                        "--out", str(out), "--params", "gemm_efficiency", *pairs])  # fmt: skip
    assert result.code == 0, result.stderr
    assert "left out 3 row(s)" in result.stdout
    assert dict(load_cluster(str(out)).calibration)["runs"] == "2"
    assert f"{tmp_path / 'm0.jsonl'}" in result.stdout


def _bad_cases(runs_file, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    unknown = tmp_path / "unknown.csv"
    unknown.write_text(runs_file.read_text().replace("qwen3-30b-a3b", "qwen9-moe", 1))
    fit = ["calibrate", "--fit", str(runs_file), "--out", str(tmp_path / "o" / "f.yaml")]
    return [
        ("missing", fit[:2] + [str(tmp_path / "no.csv")] + fit[3:] + ["--cluster", "h100"],
         "no.csv: no such runs file"),
        ("empty", fit[:2] + [str(empty)] + fit[3:] + ["--cluster", "h100"], "empty.csv: empty"),
        ("model", fit[:2] + [str(unknown)] + fit[3:] + ["--cluster", "h100"],
         "line 2 (id 1): column 'model'"),
        ("hardware", [*fit, "--cluster", "gb200-nvl72"], "no run on B200-GB200"),
        ("params", [*fit, "--cluster", "h100", "--params", "gemm"], "--params: 'gemm'"),
        ("cluster", fit, "--fit needs --cluster"),
        ("no-cluster", [*fit, "--cluster", "h1OO"], "cluster 'h1OO'"),
        ("out", fit[:3] + ["--cluster", "h100"], "--fit needs --out"),
        ("run", [*fit, "--cluster", "h100", "--run", "plan.json"], "--run plan.json"),
        ("mixed", ["calibrate", "a.json", "--fit", str(runs_file)], "--fit takes no PLAN"),
        ("neither", ["calibrate"], "give PLAN MEASURED (compare a plan with its run's "
         "metrics.jsonl or training log), --log PLAN:LOG"),
        ("cov-compare", ["calibrate", "--log", "a.json:b.log", "--covariance-only"],
         "--covariance-only belong to the fit mode"),
    ]  # fmt: skip


def test_bad_inputs_are_one_line_and_write_nothing(runs_file, tmp_path):
    for name, argv, message in _bad_cases(runs_file, tmp_path):
        result = run_piper(argv)
        assert result.code == 2, (name, result.stderr)
        assert len(result.err_lines) == 1 and "Traceback" not in result.stderr, name
        assert result.err_lines[0].startswith("piper calibrate: error: "), name
        assert message in result.err_lines[0], (name, result.err_lines[0])
        assert not (tmp_path / "o").exists(), name
