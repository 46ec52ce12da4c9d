"""`piper export PLAN --to megatron|torchtitan|slurm [--out FILE] [--trainer T] [--command CMD]`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from planner.outputs.export import DEFAULT_FILENAMES, EXPORT_TARGETS, TRAINERS, export_plan
from planner.outputs.files import write_atomic, write_files
from planner.plan import load_plan
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
        help="slurm only, --trainer megatron|torchtitan: the export the script sources "
        "(default: megatron_args.sh / torchtitan_args.sh beside --out, or in the current "
        "directory)",
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


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
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
    result = export_plan(
        plan,
        args.to,
        plan_path=str(Path(args.plan).resolve()),  # the script runs from anywhere
        command=args.command,
        trainer=args.trainer,
        args_file=_args_file(args),
    )
    if result.files and not args.out:
        raise SpecError(
            f"export --to {args.to}: it writes {', '.join(result.files)} beside the args file; "
            "give --out FILE"
        )
    if args.out:
        out = Path(args.out)
        if result.files:  # the args file and the modules it names, as one set
            write_files(out.parent, {**result.files, out.name: result.text})
        else:
            write_atomic(out, result.text)
        if args.to == "slurm":
            os.chmod(args.out, 0o755)
        beside = "".join(f" and {out.parent / name}" for name in result.files)
        print(f"wrote {args.out}{beside} ({len(result.notes)} notes)", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"piper export: note: {note}", file=sys.stderr)
    return 0
