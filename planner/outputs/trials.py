"""The trial loop's files: one short benchmark job per shortlisted layout, and the command that
collects their logs, refits the profile and re-plans.

`trial_files(...)` renders, under the shortlist folder (paths relative to it):

- `<n>-<layout>/plan.json`: the layout's plan (trial 1 is the plan itself);
- the job, by the engine the plan was made for (plan.json `extra.target`):
  - piper: `<n>-<layout>/trial.sh`, `piper run PLAN --steps N` (the plan's dispatcher and
    precision, piper run's defaults), its metrics in `<n>-<layout>/run/metrics.jsonl` (the log);
  - megatron / torchtitan: `trial.sbatch` (`piper export --to slurm --trainer ENGINE` with
    the trainer's command plus a short run: Megatron-LM `--train-iters N --log-interval 1
    --eval-iters 0`, torchtitan `--training.steps N --metrics.log_freq 1`; the tokenizer and
    data flags from $DATA_ARGS, as in every Slurm export; torchtitan's flags go before the
    exported arguments, which end with a subcommand) with the engine's export it sources
    (`megatron_args.sh` / `torchtitan_args.sh`, exactly what was priced, stamped for the
    trial's plan.json as the job is), and `trial.sh`, which submits it with
    `sbatch --output <n>-<layout>/train.log` (the log);
- `run_all.sh`: every trial.sh in order;
- `collect.sh`: `piper calibrate --fit --log PLAN:LOG ... --out fitted.yaml`, then the same
  `piper plan` with `--cluster fitted.yaml --out replan`;
- `shortlist.md`: the trials, why each was chosen, and the constants they pin down.

The short-run flags, at the engines' pinned versions: Megatron-LM (NVIDIA/Megatron-LM at
d98e8a64) logs every 100 iterations and evaluates 100 batches by default
(megatron/training/config/training_config.py:115 `eval_iters: int | None = 100`, :247
`log_interval: int = 100`), and `--eval-iters 0` leaves the validation loader empty
(megatron/training/datasets/data_samplers.py:24); torchtitan (b5bcd76c) runs 10,000 steps and
logs every 10 by default (torchtitan/config/configs.py:67 `steps: int = 10000`,
torchtitan/components/metrics.py:279 `log_freq: int = 10`). A log line per iteration lets
`piper calibrate --fit` drop the warm-up iteration alone.

Scripts name files by absolute paths (they run from anywhere, as the Slurm export's do); every
path and argument that reaches a shell is quoted (shlex), and the folder names are built from
the layout's sizes only ([a-z0-9-]).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from planner.calibrate.shortlist import Shortlist
from planner.calibrate.uncertainty import intervals
from planner.outputs.export import DEFAULT_FILENAMES, export_plan
from planner.outputs.export.slurm import trainer_command as slurm_trainer_command
from planner.plan.schema import Plan
from planner.specs import ClusterSpec, SpecError

DEFAULT_STEPS = 30
SHORT_RUN = {
    "megatron": ("--train-iters", "{steps}", "--log-interval", "1", "--eval-iters", "0"),
    "torchtitan": ("--training.steps", "{steps}", "--metrics.log_freq", "1"),
}
FOLDER_NAME = re.compile(r"^[a-z0-9-]+$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class TrialJob:
    """One trial as written: its folder name, plan and the log its job leaves."""

    name: str
    plan: Plan
    log: Path


def folder_name(n: int, plan: Plan) -> str:
    """`<n>-pp1-dp4-tp2-ep8-mb2`, then vp/cp/etp above 1, the recompute policy, sharding."""
    p = plan.parallel
    parts = [str(n), f"pp{p.pp}", f"dp{p.dp}", f"tp{p.tp}", f"ep{p.ep}", f"mb{p.micro_batch}"]
    parts += [f"{k}{getattr(p, k)}" for k in ("vp", "cp", "etp") if getattr(p, k, 1) > 1]
    if p.recompute != "none":
        parts.append(str(p.recompute))
    for key in ("fsdp", "zero"):
        if plan.training.get(key):
            parts.append(key)
    name = "-".join(parts).lower()
    if not FOLDER_NAME.match(name):  # the sizes are integers and the policy a Literal
        raise SpecError(f"shortlist: layout name {name!r} is not [a-z0-9-]; report this plan")
    return name


def check_path(path: Path, what: str) -> None:
    """A path that reaches the trial scripts must be printable (no control characters) and
    free of ':' (`piper calibrate --log PLAN:LOG` splits there) and '%' (`sbatch --output`
    expands its patterns)."""
    if CONTROL.search(str(path)):
        raise SpecError(
            f"{what} {str(path)!r} holds a control character (newline, tab, ...); choose a "
            "plain folder name"
        )
    for char, why in ((":", "piper calibrate --log PLAN:LOG splits at it"),
                      ("%", "sbatch --output expands it")):  # fmt: skip
        if char in str(path):
            raise SpecError(
                f"{what} {str(path)!r} holds '{char}' ({why}); choose a folder name without it"
            )


def engine_of(plan: Plan) -> str:
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    return str(extra.get("target") or "piper")


def trial_files(
    shortlist: Shortlist,
    plans: Sequence[Plan],
    folder: Path,
    replan: Sequence[str],
    cluster: ClusterSpec,
    steps: int = DEFAULT_STEPS,
) -> tuple[dict[str, str], tuple[TrialJob, ...]]:
    """The shortlist folder's files (module docstring) and the trials as written.

    Args:
        shortlist: planner.calibrate.shortlist's choice (trials in order, best first).
        plans: one plan per trial, in the same order.
        folder: the shortlist folder, absolute.
        replan: the `piper plan` arguments to re-plan with (without --cluster and --out).
        cluster: the plan's cluster (the intervals of the trials' predictions).
        steps: iterations of each trial run (>= 2: the first is the warm-up).
    """
    check_path(folder, "--out")
    if steps < 2:
        raise SpecError(f"--trial-steps {steps}: give >= 2 (the first step is the warm-up)")
    files: dict[str, str] = {}
    jobs = []
    for n, plan in enumerate(plans, start=1):
        name = folder_name(n, plan)
        job_files, log = _job(plan, folder / name, steps)
        files.update({f"{name}/{k}": v for k, v in job_files.items()})
        jobs.append(TrialJob(name, plan, log))
    files["run_all.sh"] = _script(
        ["# every trial of the shortlist, one after another"]
        + [f"bash {shlex.quote(str(folder / j.name / 'trial.sh'))}" for j in jobs]
    )
    files["collect.sh"] = _collect(jobs, folder, replan)
    files["shortlist.md"] = _summary(shortlist, jobs, folder, cluster, steps)
    return files, tuple(jobs)


def _script(lines: Sequence[str]) -> str:
    return "\n".join(["#!/usr/bin/env bash", "set -euo pipefail", *lines]) + "\n"


def _job(plan: Plan, trial: Path, steps: int) -> tuple[dict[str, str], Path]:
    """(the trial folder's files, the log its job leaves)."""
    engine = engine_of(plan)
    plan_path = trial / "plan.json"
    files = {"plan.json": plan.to_json()}
    if engine == "piper":
        run = trial / "run"  # piper run's dispatcher and precision default to the plan's
        argv = ["${PIPER:-piper}", "run", shlex.quote(str(plan_path)), "--steps", str(steps),
                "--out", shlex.quote(str(run))]  # fmt: skip
        files["trial.sh"] = _script([f"# {steps} steps of this layout; its log: run/metrics.jsonl",
                                     '"' + argv[0] + '" ' + " ".join(argv[1:])])  # fmt: skip
        return files, run / "metrics.jsonl"
    if engine not in SHORT_RUN:
        raise SpecError(f"{plan_path}: no trial job for target '{engine}'; re-plan with --target")
    command = trainer_command(engine, steps)
    args_file = trial / DEFAULT_FILENAMES[engine]
    sbatch = export_plan(plan, "slurm", str(plan_path), command, engine, str(args_file),  # type: ignore[arg-type]
                         job_path=str(trial / "trial.sbatch"))  # fmt: skip
    exported = sbatch.engine_args  # written with the job, as `piper export --to slurm` does
    assert exported is not None  # an engine trainer's job comes with the engine's export
    files[exported.filename] = exported.text
    files.update(exported.files)  # beside it (torchtitan's config module)
    files["trial.sbatch"] = sbatch.text
    log = trial / "train.log"
    head = [f"# submit {steps} iterations of this layout; its log: {log.name}"]
    if engine == "megatron":
        head.append("# DATA_ARGS: your tokenizer and data flags (e.g. --mock-data --tokenizer-type "
                    "NullTokenizer --vocab-size 151936), exported before this script; the job "
                    "passes its words on")  # fmt: skip
    submit = f"sbatch --output {shlex.quote(str(log))} {shlex.quote(str(trial / 'trial.sbatch'))}"
    files["trial.sh"] = _script([*head, submit])
    return files, log


def trainer_command(engine: str, steps: int) -> str:
    """The trial's per-rank command: the trainer's (with the words of $DATA_ARGS, as every
    Slurm export's) plus the short-run flags where the trainer takes options: before
    torchtitan's exported arguments, which end with a subcommand after which tyro takes no
    top-level option; after Megatron-LM's."""
    short = [a.format(steps=steps) for a in SHORT_RUN[engine]]
    return slurm_trainer_command(engine, short)  # type: ignore[arg-type]


def _collect(jobs: Sequence[TrialJob], folder: Path, replan: Sequence[str]) -> str:
    fitted, out = folder / "fitted.yaml", folder / "replan"
    fit = ['"${PIPER:-piper}"', "calibrate", "--fit"]
    for j in jobs:
        fit += ["--log", shlex.quote(f"{folder / j.name / 'plan.json'}:{j.log}")]
    fit += ["--out", shlex.quote(str(fitted))]
    again = ['"${PIPER:-piper}"', *(shlex.quote(a) for a in replan)]
    again += ["--cluster", shlex.quote(str(fitted)), "--out", shlex.quote(str(out))]
    return _script([
        "# after every trial has run: refit the profile on their logs, then re-plan with it",
        " ".join(fit),
        " ".join(again),
    ])  # fmt: skip


def _summary(
    shortlist: Shortlist, jobs: Sequence[TrialJob], folder: Path, cluster: ClusterSpec,
    steps: int,
) -> str:  # fmt: skip
    level = shortlist.level
    lines = ["# Trial shortlist", "", _why(shortlist, len(jobs), steps), ""]
    if shortlist.contenders:
        lines += [f"Summed P(best) of these trials: {shortlist.p_best_total:.2f}, the "
                  "probability that the truly fastest of the layouts predicted within "
                  f"{shortlist.window:.0%} of the best is among them (planner/PLANNING.md, "
                  "'The pick under uncertainty').", ""]  # fmt: skip
    if shortlist.probability is None and len(jobs) < shortlist.requested:
        lines += [f"{shortlist.requested} were asked for; only {len(jobs)} of the overlapping "
                  "layouts differ in what the fit can learn from them.", ""]  # fmt: skip
    lines += [
        f"| trial | layout | predicted step (s) | {level:.0%} interval (s) | P(best) "
        "| information (nats) | leans on |",
        "|---|---|---|---|---|---|---|",
    ]
    for j, t in zip(jobs, shortlist.trials, strict=True):
        step = j.plan.predicted.step_time_s
        ivs = j.plan.predicted.intervals or intervals(cluster, j.plan.predicted, level)
        box = ivs.step_time_s  # plan.json's own interval where it has one
        lines.append(
            f"| {j.name} | {t.layout} | {step:.4g} | {box.lo:.4g}-{box.hi:.4g} | "
            f"{t.p_best:.2f} | {t.gain_nats:.2f} | {', '.join(t.leans_on) or '-'} |"
        )
    lines += ["", "Standard deviation of each constant in the fit's log units (t = log(c + a)), "
              "from the prior alone and after these trials (linearised):", "",
              "| constant | prior | after the trials |", "|---|---|---|"]  # fmt: skip
    for name, a, b in zip(shortlist.constants, shortlist.prior_sd, shortlist.posterior_sd,
                          strict=True):  # fmt: skip
        still = "" if b < a * (1 - 1e-3) else " (no trial moves it)"
        lines.append(f"| {name} | {a:.3f} | {b:.3f}{still} |")
    lines += ["", "Run the trials, then collect:", "", "```bash",
              f"bash {shlex.quote(str(folder / 'run_all.sh'))}",
              f"bash {shlex.quote(str(folder / 'collect.sh'))}", "```", ""]  # fmt: skip
    return "\n".join(lines)


def _why(shortlist: Shortlist, trials: int, steps: int) -> str:
    """The paragraph that says how the trials were chosen and how many."""
    if shortlist.probability is not None:
        return (f"{trials} layouts to run for {steps} iterations each: the fewest of the "
                f"{shortlist.contenders} layouts predicted within {shortlist.window:.0%} of the "
                "best step whose summed probability of being the fastest reaches "
                f"{shortlist.probability:g} (`--shortlist auto`), the pick first, then by that "
                "probability.")  # fmt: skip
    return (f"{trials} layouts to run for {steps} iterations each, chosen among the "
            f"{shortlist.considered} fastest of the {shortlist.overlapping} layouts whose "
            f"predicted step time's {shortlist.level:.0%} interval overlaps the best one's: the "
            "best first, then each time the layout whose step time the fit, given the trials "
            "before it, is least sure of (greedy D-optimal design; planner/PROFILING.md, 'The "
            "trial loop').")  # fmt: skip
