"""`piper calibrate --fit --log PLAN_OR_EXPORT:LOGFILE`: engine logs are runs of the fit, the
cluster comes from the plan, one run and eight constants warn, the profile names the logs, and
a bad log is one line, exit 2, nothing written."""

from __future__ import annotations

import re

from planner.calibrate.compare import estimate_plan
from planner.inputs.clusters import load_cluster
from tests.hardening_cli import run_piper
from tests.planner.calibrate.engine_logs import MEGATRON_ARGS, megatron_log, titan_log
from tests.planner.calibrate.test_compare import tiny_plan


def _setup(tmp_path):
    plan = tiny_plan()
    (tmp_path / "plan.json").write_text(plan.to_json())
    # iterations 1.2x-1.7x the model's step (a profile that applies), after a slow first one
    step_s = estimate_plan(plan).step_time_s
    logs = []
    for k, factors in enumerate(((9.0, 1.2, 1.3, 1.4), (9.0, 1.5, 1.6, 1.7))):
        log = tmp_path / f"megatron{k}.log"
        log.write_text(megatron_log([f * step_s for f in factors]))
        logs.append(log)
    return tmp_path / "plan.json", logs


def test_logs_fit_a_profile_of_the_plans_cluster(tmp_path):
    plan, logs = _setup(tmp_path)
    out = tmp_path / "fitted" / "cpu-fit.yaml"
    argv = ["calibrate", "--fit", "--log", f"{plan}:{logs[0]}", "--log", f"{plan}:{logs[1]}",
            "--out", str(out)]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    fitted = load_cluster(str(out))
    assert fitted.name == "cpu-gloo-fitted"  # the plan's cluster, no --cluster given
    cal = dict(fitted.calibration)
    assert cal["runs"] == "2" and cal["run_1"] == f"{logs[0]} ({plan}:{logs[0]})"
    assert cal["memory_runs"] == "2"  # both logs report max allocated (1.5 GiB peak)
    assert float(cal["fitted_framework_overhead_gib"]) == fitted.framework_overhead_gib
    # a table row, or (long paths) the row as a block of "column: value" lines
    row = r"^leave-one-out(\s+2\s|\n\s+runs: 2\n)"
    assert re.search(row, result.stdout, re.MULTILINE), result.stdout
    assert "memory: framework_overhead_gib from 2 measured peak(s)" in result.stdout
    assert f"{logs[1]}" in result.stdout and f"wrote {out}" in result.stdout


def test_one_log_and_eight_constants_warn(tmp_path):
    plan, logs = _setup(tmp_path)
    out = tmp_path / "one.yaml"
    result = run_piper(["calibrate", "--fit", "--log", f"{plan}:{logs[0]}", "--out", str(out)])
    assert result.code == 0, result.stderr
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("warning: "))
    kept = dict(load_cluster(str(out)).calibration)["params"]
    head = f"warning: 1 run(s) for 8 constant(s): fitting {kept or 'nothing'}; kept at "
    assert line.startswith(head)
    assert "," not in kept


def test_bad_logs_on_the_command_line_are_one_line(tmp_path):
    plan, logs = _setup(tmp_path)
    wrong = tmp_path / "tp2.log"
    wrong.write_text(megatron_log((9.0, 2.0), {**MEGATRON_ARGS, "pipeline_model_parallel_size": 4}))
    cut = tmp_path / "cut.log"
    cut.write_text(titan_log((900.0, 1000.0), (1.0, 1.0))[:-40])
    out = ["--out", str(tmp_path / "o" / "f.yaml")]
    cases = [
        (["--log", f"{plan}:{wrong}"], "the log's layout has pp=4"),
        (["--log", f"{plan}:{cut}"], "cut.log line 4: an iteration line cut short"),
        (["--log", f"{plan}"], "give PLAN_OR_EXPORT:LOGFILE"),
        (["--log", f"{plan}:{tmp_path / 'none.log'}"], "none.log: no such log"),
        ([], "--fit needs runs"),
    ]
    for extra, message in cases:
        result = run_piper(["calibrate", "--fit", *extra, *out])
        assert result.code == 2, (extra, result.stderr)
        assert len(result.err_lines) == 1 and "Traceback" not in result.stderr
        assert message in result.err_lines[0], (message, result.err_lines[0])
        assert not (tmp_path / "o").exists()
    result = run_piper(["calibrate", str(plan), "m.jsonl", "--log", f"{plan}:{logs[0]}"])
    assert result.code == 2 and "--log" in result.err_lines[0] and "fit mode" in result.stderr
