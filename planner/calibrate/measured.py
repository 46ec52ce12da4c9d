"""One measurement of a plan's run, read and compared: `piper run`'s metrics.jsonl or a
Megatron-LM / torchtitan training log against the plan's prediction and its intervals.

    compare_measurement(plan_path, measured_path, ...) -> Comparison

The file's format is given (`fmt`), or metrics for a *.jsonl file, or detected
(planner.calibrate.logs.log_engine: a JSON object per line is metrics.jsonl, Megatron's
arguments block or iteration line, torchtitan's step line); a file that reads as another
format than the one given, or as none, is one SpecError line. metrics.jsonl gives the
component table (planner/calibrate/compare.py) and its interval checks (tokens/s, step time,
each stage's memory); a training log gives tokens/s, step time and its peak memory after the
warm-up, read as `piper calibrate --fit --log` reads it (planner/calibrate/log_runs.py: the
log's layout and engine checked against the plan's).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from planner.calibrate.compare import Calibration
from planner.calibrate.interval_check import (
    IntervalCheck,
    PlanIntervals,
    checks_of_calibration,
    checks_of_log,
    plan_intervals,
)
from planner.calibrate.log_runs import ENGINE_NAMES
from planner.calibrate.logs import log_engine, parse_log, read_log
from planner.specs import ClusterSpec, SpecError

Format = Literal["auto", "metrics", "megatron", "torchtitan"]
FORMATS: tuple[Format, ...] = ("auto", "metrics", "megatron", "torchtitan")


@dataclass(frozen=True)
class Comparison:
    """A measurement against its plan: the component table (metrics.jsonl only) and where each
    measured figure falls in its interval (none when the plan has no intervals)."""

    plan_path: str
    measured_path: str
    engine: str  # "metrics", "megatron" or "torchtitan"
    calibration: Calibration | None
    checks: tuple[IntervalCheck, ...]
    intervals: PlanIntervals


def measured_format(path: str, fmt: Format = "auto") -> str:
    """The file's format (log_engine's names): `fmt` when given, metrics for a *.jsonl file
    (load_metrics then reads it and names any faulty line), else detected from the text;
    SpecError when it reads as none, or as another than `fmt` names."""
    if fmt == "metrics" or (fmt == "auto" and Path(path).suffix == ".jsonl"):
        return "metrics"
    text = read_log(path)
    engine = log_engine(text) or parse_log(text, path).engine  # parse_log: the one line
    if fmt != "auto" and engine != fmt:
        raise SpecError(
            f"{path}: reads as {ENGINE_NAMES[engine]} output, not --format {fmt}; give the "
            f"{ENGINE_NAMES[fmt]} file, or leave --format out to detect it"
        )
    return engine


def compare_measurement(
    plan_path: str, measured_path: str, fmt: Format = "auto", skip_steps: int = 1,
    cluster: ClusterSpec | None = None,
) -> Comparison:  # fmt: skip
    """`measured_path` (metrics.jsonl or a training log) against plan.json `plan_path`.

    Args:
        plan_path: the plan.json the run executed.
        measured_path: its metrics.jsonl, Megatron-LM log or torchtitan log.
        fmt: the file's format, or "auto" to detect it.
        skip_steps: warm-up steps (iterations) dropped.
        cluster: metrics.jsonl: re-estimate per stage on it instead of the plan's cluster.
    Returns:
        The Comparison; SpecError (one line) for a file that cannot be read or trusted.
    """
    from planner.plan import load_plan

    plan = load_plan(plan_path)
    engine = measured_format(measured_path, fmt)
    ivs = plan_intervals(plan, plan_path)
    if engine == "metrics":
        cal = _calibration(plan, measured_path, skip_steps, cluster)
        checks = checks_of_calibration(cal, ivs.intervals) if ivs.intervals else ()
        return Comparison(plan_path, measured_path, engine, cal, checks, ivs)
    from planner.calibrate.log_runs import run_of_log

    if ":" in measured_path:
        raise SpecError(f"{measured_path}: a log's path may not hold ':'; rename or link it")
    run = run_of_log(f"{plan_path}:{measured_path}", skip_steps)
    par = plan.parallel
    tokens_per_s = run.measured * par.pp * par.dp * par.tp * par.cp  # per GPU -> the job's
    checks = (
        checks_of_log(plan, tokens_per_s, run.measured_peak_gib, ivs.intervals)
        if ivs.intervals
        else ()
    )
    return Comparison(plan_path, measured_path, engine, None, checks, ivs)


def _calibration(
    plan, metrics_path: str, skip_steps: int, cluster: ClusterSpec | None
) -> Calibration:
    """The component table of a piper run, repriced where its run.json records another
    dispatcher than the plan priced (planner/calibrate/run_settings.py)."""
    from planner.calibrate.compare import calibrate
    from planner.calibrate.metrics import load_metrics
    from planner.calibrate.run_settings import (
        differences_line,
        load_run_info,
        repricing,
        run_differences,
    )

    metrics = load_metrics(metrics_path)
    differences = run_differences(plan, load_run_info(metrics_path))
    reprice = repricing(plan, differences)
    note = differences_line(differences, reprice, bool(plan.training.get("a2a_overlap")))
    return calibrate(plan, metrics, skip_steps, cluster, reprice, note)
