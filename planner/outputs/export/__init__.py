"""Exports of a plan.json to the tools teams train with: Megatron-LM, torchtitan and Slurm.

`export_plan(plan, target)` renders one file as text plus the notes on what the target cannot
express; every note is also written into the file as a comment. Each target is one module:
megatron (flags), torchtitan (a TOML job config), slurm (an sbatch script that launches one
task per rank with the rank-to-node order of the rank IP).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.outputs.export.megatron import megatron_script
from planner.outputs.export.slurm import slurm_script
from planner.outputs.export.torchtitan import torchtitan_toml
from planner.plan.schema import Plan
from planner.specs import SpecError

EXPORT_TARGETS = ("megatron", "torchtitan", "slurm")
DEFAULT_FILENAMES = {
    "megatron": "megatron_args.sh",
    "torchtitan": "torchtitan.toml",
    "slurm": "piper.sbatch",
}


@dataclass(frozen=True)
class ExportResult:
    """One rendered export: the file text, the notes inside it and a default file name."""

    target: str
    text: str
    notes: tuple[str, ...]
    filename: str


def export_plan(
    plan: Plan, target: str, plan_path: str = "plan.json", command: str | None = None
) -> ExportResult:
    """Render `plan` for `target` (megatron | torchtitan | slurm).

    Args:
        plan: a loaded plan.json.
        target: one of EXPORT_TARGETS.
        plan_path: how the Slurm script refers to the plan file.
        command: the Slurm script's per-rank trainer command (default: Piper's runtime).
    """
    if target not in EXPORT_TARGETS:
        raise SpecError(
            f"export: unknown target '{target}'; use one of {', '.join(EXPORT_TARGETS)}"
        )
    if target == "slurm":
        text, notes = slurm_script(plan, plan_path, command)
    elif target == "megatron":
        text, notes = megatron_script(plan, plan.model_spec())
    else:
        text, notes = torchtitan_toml(plan, plan.model_spec())
    return ExportResult(target, text, notes, DEFAULT_FILENAMES[target])
