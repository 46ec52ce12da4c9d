"""Exports of a plan.json to the tools teams train with: Megatron-LM, torchtitan and Slurm.

`export_plan(plan, target)` renders one file as text plus the notes on what the target cannot
express; every note is also written into the file as a comment. Each target is one module:
megatron (a bash file: environment and MEGATRON_ARGS), torchtitan (a bash file:
TORCHTITAN_ARGS for torchtitan 0.3's ConfigManager), slurm (an sbatch script that launches
one task per rank with the rank-to-node order of the rank IP, for Piper's runtime, Megatron-LM
or torchtitan).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.outputs.export.megatron import megatron_script
from planner.outputs.export.shell import check_plan_text
from planner.outputs.export.slurm import TRAINERS, Trainer, slurm_script
from planner.outputs.export.torchtitan import torchtitan_script
from planner.plan.priced import check_priced
from planner.plan.schema import Plan
from planner.specs import SpecError

EXPORT_TARGETS = ("megatron", "torchtitan", "slurm")
DEFAULT_FILENAMES = {
    "megatron": "megatron_args.sh",
    "torchtitan": "torchtitan_args.sh",
    "slurm": "piper.sbatch",
}

__all__ = ["DEFAULT_FILENAMES", "EXPORT_TARGETS", "TRAINERS", "ExportResult", "export_plan"]


@dataclass(frozen=True)
class ExportResult:
    """One rendered export: the file text, the notes inside it, a default file name, and the
    files written beside it (name -> text: torchtitan's config module for a composed model)."""

    target: str
    text: str
    notes: tuple[str, ...]
    filename: str
    files: dict[str, str] = field(default_factory=dict)


def export_plan(
    plan: Plan,
    target: str,
    plan_path: str = "plan.json",
    command: str | None = None,
    trainer: Trainer = "piper",
    args_file: str | None = None,
) -> ExportResult:
    """Render `plan` for `target` (megatron | torchtitan | slurm).

    Args:
        plan: a loaded plan.json.
        target: one of EXPORT_TARGETS.
        plan_path: how the Slurm script refers to the plan file.
        command: the Slurm script's per-rank trainer command (default: the trainer's).
        trainer: the Slurm script's trainer: piper | megatron | torchtitan.
        args_file: the Megatron or torchtitan export the Slurm script sources.
    """
    if target not in EXPORT_TARGETS:
        raise SpecError(
            f"export: unknown target '{target}'; use one of {', '.join(EXPORT_TARGETS)}"
        )
    check_plan_text(plan)
    check_priced(plan, trainer if target == "slurm" else target, plan_path)
    if target == "slurm":
        text, notes = slurm_script(plan, plan_path, command, trainer, args_file)
    elif target == "megatron":
        text, notes = megatron_script(plan, plan.model_spec())
    else:
        text, notes, files = torchtitan_script(plan, plan.model_spec())
        return ExportResult(target, text, notes, DEFAULT_FILENAMES[target], files)
    return ExportResult(target, text, notes, DEFAULT_FILENAMES[target])
