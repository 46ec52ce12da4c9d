"""`piper export PLAN --to megatron|torchtitan|slurm [--out FILE] [--trainer T] [--command CMD]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from planner.outputs.export import (
    DEFAULT_FILENAMES,
    EXPORT_TARGETS,
    TRAINERS,
    ExportResult,
    export_plan,
)
from planner.outputs.export.stamp import file_stamp, stamp_of
from planner.outputs.files import write_atomic, write_files
from planner.plan import Plan, load_plan
from planner.specs import SpecError
from planner.targets import TARGET_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="turn a plan.json into Megatron-LM or torchtitan arguments or a Slurm script",
        description="Export a plan for Megatron-LM, torchtitan or Slurm. Anything the target "
        "cannot express is listed as NOTE lines in the output.",
    )
    p.add_argument("plan", help="path to plan.json")
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="export target")
    p.add_argument("--out", help="write to FILE (default: print to stdout)")
    p.add_argument(
        "--trainer",
        choices=TRAINERS,
        default=None,
        help="slurm only: what each rank runs: Piper's runtime, Megatron-LM or torchtitan (the "
        "script sources that export, see --args-file); default: the engine the plan was made "
        "for (its --target)",
    )
    p.add_argument(
        "--args-file",
        help="slurm only, --trainer megatron|torchtitan: an export you write yourself, which "
        "the job sources and checks at start (default: the job writes megatron_args.sh / "
        "torchtitan_args.sh beside --out, with it; without --out, in the current directory)",
    )
    p.add_argument(
        "--target",
        choices=TARGET_NAMES,
        default=None,
        help="the engine the export is checked against (default: --to's engine; for slurm, "
        "--trainer's); every priced setting must run as priced there, else one line, exit 2",
    )
    p.add_argument(
        "--command",
        help="slurm only: the per-rank trainer command (default: the trainer's own, e.g. "
        "python -m runtime.launch --plan PLAN --out results/run)",
    )
    p.set_defaults(func=run)


def _args_file(args: argparse.Namespace) -> str | None:
    """The absolute path of the file the Slurm script sources for its trainer."""
    if args.trainer == "piper":
        return None
    if args.args_file:
        return str(Path(args.args_file).resolve())
    folder = Path(args.out).resolve().parent if args.out else Path.cwd()
    return str(folder / DEFAULT_FILENAMES[args.trainer])


def _trainer(args: argparse.Namespace, plan: Plan) -> None:
    """Set args.trainer: --trainer, else --target for slurm, else the engine the plan was
    made for; refuse a --target that is not the engine the export runs."""
    if args.trainer is None:
        extra = plan.extra if isinstance(plan.extra, dict) else {}
        made_for = str(extra.get("target") or "piper")
        args.trainer = made_for if args.to == "slurm" and made_for in TRAINERS else "piper"
        if args.to == "slurm" and args.target is not None:
            args.trainer = args.target
    if args.target is not None:
        engine = args.trainer if args.to == "slurm" else args.to
        if args.target != engine:
            fix = f"--trainer {args.target}" if args.to == "slurm" else f"--to {args.target}"
            raise SpecError(
                f"--target {args.target} with --to {args.to}: the export runs {engine}; give "
                f"--target {engine} or {fix}"
            )


def _sourced_note(args: argparse.Namespace, result: ExportResult, args_file: str) -> str | None:
    """A line when the job sources an args file this command does not write and that file is
    missing or stamped for another plan (the job would stop at start)."""
    path = Path(args_file)
    if file_stamp(path) == stamp_of(result.text):
        return None
    state = "was made from another plan" if path.is_file() else "is missing or unreadable"
    return (
        f"piper export: note: the job sources {args_file}, which {state}; the job stops at "
        f"start until 'piper export {args.plan} --to {args.trainer} --out {args_file}' "
        "rewrites it"
    )


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    plan_bytes = Path(args.plan).read_bytes()  # what the job hashes at start (read: valid)
    _trainer(args, plan)
    args_file = _args_file(args)
    result = export_plan(
        plan,
        args.to,
        plan_path=str(Path(args.plan).resolve()),  # the script runs from anywhere
        command=args.command,
        trainer=args.trainer,
        args_file=args_file,
        plan_bytes=plan_bytes,
        job_path=str(Path(args.out).resolve()) if args.out else DEFAULT_FILENAMES["slurm"],
    )
    if result.files and not args.out:
        raise SpecError(
            f"export --to {args.to}: it writes {', '.join(result.files)} beside the args file; "
            "give --out FILE"
        )
    engine = result.engine_args
    together = engine is not None and args.out is not None and not args.args_file
    if args.out:
        out = Path(args.out)
        files = {**result.files, out.name: result.text}
        if together:  # the job and the engine's args as one set, so they cannot drift
            files.update({**engine.files, Path(args_file).name: engine.text})
        if len(files) > 1:
            write_files(out.parent, files)
        else:
            write_atomic(out, result.text)
        if args.to == "slurm":
            os.chmod(args.out, 0o755)
        beside = "".join(f" and {out.parent / name}" for name in files if name != out.name)
        print(f"wrote {args.out}{beside} ({len(result.notes)} notes)", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"piper export: note: {note}", file=sys.stderr)
    if engine is not None and not together:
        line = _sourced_note(args, result, args_file)
        if line:
            print(line, file=sys.stderr)
    return 0
