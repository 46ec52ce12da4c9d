"""Exports of a plan.json to the tools teams train with: Megatron-LM, torchtitan and Slurm.

`export_plan(plan, target)` renders one file as text plus the notes on what the target cannot
express; every note is also written into the file as a comment, and every file carries the
plan's stamp (planner.outputs.export.stamp). Each target is one module: megatron (a bash file:
environment and MEGATRON_ARGS), torchtitan (a bash file: TORCHTITAN_ARGS for torchtitan 0.3's
ConfigManager), slurm (an sbatch script that launches one task per rank with the rank-to-node
order of the rank IP, for Piper's runtime, Megatron-LM or torchtitan; for the last two it
comes with the engine's export it sources, so the CLI writes both as one set).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.outputs.export.megatron import megatron_script
from planner.outputs.export.shell import check_plan_text
from planner.outputs.export.slurm import TRAINERS, Trainer, slurm_script
from planner.outputs.export.stamp import plan_stamp, stamped
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
    """One rendered export: the file text, the notes inside it, a default file name, the
    files written beside it (name -> text: torchtitan's config module for a composed model),
    and for a Slurm job that sources Megatron or torchtitan arguments, that export."""

    target: str
    text: str
    notes: tuple[str, ...]
    filename: str
    files: dict[str, str] = field(default_factory=dict)
    engine_args: ExportResult | None = None


def export_plan(
    plan: Plan,
    target: str,
    plan_path: str = "plan.json",
    command: str | None = None,
    trainer: Trainer = "piper",
    args_file: str | None = None,
    plan_bytes: bytes | None = None,
    job_path: str = DEFAULT_FILENAMES["slurm"],
) -> ExportResult:
    """Render `plan` for `target` (megatron | torchtitan | slurm), every file stamped.

    Args:
        plan: a loaded plan.json.
        target: one of EXPORT_TARGETS.
        plan_path: how the Slurm script refers to the plan file.
        command: the Slurm script's per-rank trainer command (default: the trainer's).
        trainer: the Slurm script's trainer: piper | megatron | torchtitan.
        args_file: the Megatron or torchtitan export the Slurm script sources.
        plan_bytes: the plan file as read (its sha256 is the stamp); default: `plan.to_json()`,
            the bytes `piper plan` writes.
        job_path: where the Slurm script goes, for the command its refusals print.
    """
    if target not in EXPORT_TARGETS:
        raise SpecError(
            f"export: unknown target '{target}'; use one of {', '.join(EXPORT_TARGETS)}"
        )
    check_plan_text(plan)
    check_priced(plan, trainer if target == "slurm" else target, plan_path)
    stamp = plan_stamp(plan, plan_bytes)
    if target == "megatron":
        text, notes = megatron_script(plan, plan.model_spec())
        return ExportResult(target, stamped(text, stamp), notes, DEFAULT_FILENAMES[target])
    if target == "torchtitan":
        text, notes, files = torchtitan_script(plan, plan.model_spec())
        files = {name: stamped(body, stamp) for name, body in files.items()}
        return ExportResult(target, stamped(text, stamp), notes, DEFAULT_FILENAMES[target], files)
    engine = None
    if trainer != "piper":
        engine = export_plan(plan, trainer, plan_path, plan_bytes=plan_bytes)
    modules = tuple(engine.files) if engine else ()
    text, notes = slurm_script(
        plan, plan_path, command, trainer, args_file, stamp, modules, job_path
    )
    return ExportResult(
        target, stamped(text, stamp), notes, DEFAULT_FILENAMES[target], engine_args=engine
    )
