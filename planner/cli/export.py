"""`piper export PLAN --to megatron|torchtitan|slurm [--out FILE] [--command CMD]`."""

from __future__ import annotations

import argparse
import os
import sys

from planner.outputs.export import EXPORT_TARGETS, export_plan
from planner.outputs.files import write_atomic
from planner.plan import load_plan


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="turn a plan.json into Megatron-LM flags, a torchtitan TOML or a Slurm script",
        description="Export a plan for Megatron-LM, torchtitan or Slurm. Anything the target "
        "cannot express is listed as NOTE lines in the output.",
    )
    p.add_argument("plan", help="path to plan.json")
    p.add_argument("--to", required=True, choices=EXPORT_TARGETS, help="export target")
    p.add_argument("--out", help="write to FILE (default: print to stdout)")
    p.add_argument(
        "--command",
        help="slurm only: the per-rank trainer command "
        "(default: python -m runtime.launch --plan PLAN --out results/run)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    result = export_plan(plan, args.to, plan_path=args.plan, command=args.command)
    if args.out:
        write_atomic(args.out, result.text)
        if args.to == "slurm":
            os.chmod(args.out, 0o755)
        print(f"wrote {args.out} ({len(result.notes)} notes)", file=sys.stderr)
    else:
        sys.stdout.write(result.text)
    for note in result.notes:
        print(f"piper export: note: {note}", file=sys.stderr)
    return 0
