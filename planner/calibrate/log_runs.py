"""`--log PLAN_OR_EXPORT:LOGFILE`: a training log and the plan it ran, as one measured `Run`.

The layout, layer split, dispatcher and training setup come from the plan (planner.calibrate
.runs.Run, as RUNS.csv rows and `--run` pairs make it); the measured figures from the log:

- Megatron-LM / torchtitan logs (planner/calibrate/logs.py): the lines whose whole averaging
  window lies after the first `skip_steps` iterations (the warm-up: the first iteration holds
  CUDA and NCCL initialisation, the allocator's first growth and, for torchtitan, compilation;
  Megatron itself leaves it out of its timers, megatron/training/training.py:3562
  `not is_first_iteration`), median tokens/s per GPU (Megatron: global batch x sequence /
  (elapsed time per iteration x world); torchtitan: tps), and the peak memory (Megatron: the
  largest `max allocated`; torchtitan: the largest peak reserved after the warm-up);
- `piper run`'s metrics.jsonl: planner.calibrate.runs.run_of_metrics, and its run.json must
  record the plan's layout.

PLAN_OR_EXPORT is a plan.json, or an export (megatron_args.sh, torchtitan_args.sh, ...) with
the plan.json it came from beside it. Where the log prints its own layout (Megatron's
arguments block, torchtitan's device mesh) and a value differs from the plan's, or the log's
engine is not the one the plan was made for (`extra.target`) or exported to, that is one
SpecError line naming both and the fix.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from planner.calibrate.logs import after_warmup, log_engine, parse_log, read_log
from planner.calibrate.runs import DISPATCHERS, Run, run_of_metrics
from planner.plan.schema import Plan
from planner.specs import SpecError

PLAN_FILE = "plan.json"
ENGINE_NAMES = {"megatron": "Megatron-LM", "torchtitan": "torchtitan", "metrics": "piper run"}
EXPORT_ENGINES = {"megatron_args.sh": "megatron", "torchtitan_args.sh": "torchtitan"}


def split_pair(text: str) -> tuple[str, str]:
    """PLAN_OR_EXPORT:LOGFILE split at the last ':' (SpecError when a side is empty)."""
    plan, sep, log = text.rpartition(":")
    if not sep or not plan or not log:
        raise SpecError(
            f"--log {text}: give PLAN_OR_EXPORT:LOGFILE (a plan.json, or the export beside "
            "it, and the training log of its run)"
        )
    return plan, log


def resolve_plan(path: str | Path) -> Path:
    """The plan.json itself, or the plan.json beside an export file."""
    p = Path(path)
    if p.suffix == ".json":
        return p
    beside = p.parent / PLAN_FILE
    if not p.exists():
        raise SpecError(f"{p}: no such plan or export; give the plan.json the run executed")
    if not beside.is_file():
        raise SpecError(
            f"{p}: an export with no {PLAN_FILE} beside it; give the plan.json it was "
            "exported from (PLAN.json:LOGFILE)"
        )
    return beside


def run_of_log(pair: str, skip_steps: int = 1) -> Run:
    """`--log PLAN_OR_EXPORT:LOGFILE` as a Run (module docstring)."""
    from planner.plan import load_plan

    given, log_path = split_pair(pair)
    plan_path = resolve_plan(given)
    plan = load_plan(plan_path)
    text = read_log(log_path)
    engine = log_engine(text)
    _check_engine(plan, given, log_path, engine)
    if engine == "metrics":
        _check_piper_layout(plan, log_path)
        return run_of_metrics(plan_path, log_path, skip_steps)
    log = parse_log(text, log_path)
    _check_layout(plan, log.layout, log_path, plan_path)
    kept = after_warmup(log, skip_steps)
    par = plan.parallel
    world = par.pp * par.dp * par.tp * par.cp
    if engine == "megatron":
        tokens = int(plan.training["global_batch"]) * int(plan.training["seq_len"])
        measured = statistics.median(tokens / (s.step_time_s or 1.0) / world for s in kept)
        peak = log.peak_gib
    else:
        measured = statistics.median(s.tokens_per_s_per_gpu or 0.0 for s in kept)
        peak = max(s.peak_gib or 0.0 for s in kept) or None
    if measured <= 0:
        raise SpecError(f"{log_path}: the throughput after the warm-up is 0; give a real run")
    return plan_run(plan, plan_path, log_path, measured, peak)


def plan_run(
    plan: Plan, plan_path: str | Path, log_path: str, tokens_per_s_per_gpu: float,
    peak_gib: float | None,
) -> Run:  # fmt: skip
    """The plan's layout with a measured tokens/s per GPU and peak memory."""
    from planner.calibrate.compare import plan_inputs

    model, cluster, training, parallel = plan_inputs(plan)
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    dispatcher = extra.get("dispatcher", "flat")
    return Run(
        label=str(log_path), where=f"{plan_path}:{log_path}", model=model,
        hardware=cluster.name, parallel=parallel, training=training,
        dispatcher=dispatcher if dispatcher in DISPATCHERS else "flat",
        stage_layers=tuple(tuple(s.layers) for s in plan.stages),
        recompute_layers=tuple(tuple(s.recompute_layers) for s in plan.stages),
        metric="tokens/s/GPU", measured=tokens_per_s_per_gpu, measured_peak_gib=peak_gib,
    )  # fmt: skip


def _check_engine(plan: Plan, given: str, log_path: str, engine: str | None) -> None:
    """The log's engine is the plan's target and the export's engine."""
    if engine is None:
        parse_log(read_log(log_path), log_path)  # raises the not-a-log line
        return
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    target = extra.get("target")
    wanted = "metrics" if target == "piper" else target
    ran = ENGINE_NAMES[engine]
    if target and wanted != engine:
        raise SpecError(
            f"{log_path}: a {ran} log, but {given} was planned for --target {target}; give "
            f"the plan the run executed (a plan made with --target "
            f"{'piper' if engine == 'metrics' else engine})"
        )
    exported = EXPORT_ENGINES.get(Path(given).name)
    if exported and exported != engine:
        raise SpecError(
            f"{log_path}: a {ran} log, but {given} is the {ENGINE_NAMES[exported]} export; "
            "give the export (or plan.json) of the run that wrote this log"
        )


def _check_layout(
    plan: Plan, layout: tuple[tuple[str, int], ...], log_path: str, plan_path: Path
) -> None:
    """Every layout value the log prints equals the plan's."""
    par = plan.parallel
    planned = {
        "pp": par.pp, "dp": par.dp, "tp": par.tp, "ep": par.ep, "vp": par.vp, "cp": par.cp,
        "etp": par.etp, "micro_batch": par.micro_batch,
        "world": par.pp * par.dp * par.tp * par.cp,
        "global_batch": int(plan.training.get("global_batch", 0)),
        "seq_len": int(plan.training.get("seq_len", 0)),
    }  # fmt: skip
    for name, value in layout:
        if name in planned and planned[name] != value:
            raise SpecError(
                f"{log_path}: the log's layout has {name}={value}, {plan_path} has "
                f"{name}={planned[name]}; give the plan this run executed (or re-plan with "
                "the run's layout)"
            )


def _check_piper_layout(plan: Plan, metrics_path: str) -> None:
    """A piper run whose run.json records another layout than the plan's is refused."""
    from planner.calibrate.run_settings import LAYOUT_KEYS, load_run_info, run_differences

    for d in run_differences(plan, load_run_info(metrics_path)):
        if d.setting in (*LAYOUT_KEYS, "seq_len", "hidden_size", "layers"):
            raise SpecError(
                f"{metrics_path}: run.json records {d.setting}={d.ran}, the plan has "
                f"{d.setting}={d.planned} (a --scale'd run?); give the plan this run executed"
            )
