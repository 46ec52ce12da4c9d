"""`piper place PLAN --nodelist LIST [--topology FILE] [--out DIR] [--time-limit-s S]`."""

from __future__ import annotations

import argparse
import sys

from planner.inputs.hostlist import load_nodelist
from planner.inputs.slurm_topology import allocation_of
from planner.ip.solvers import SolverOptions
from planner.outputs.files import write_files
from planner.outputs.place_report import placement_files, summary_line
from planner.plan import load_plan
from planner.run.place import place_plan
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "place",
        help="place a plan's ranks on the nodes of a Slurm allocation (the rank IP at job start)",
        description="Re-solve the rank IP for the nodes a job got, the plan's layout fixed; "
        "write a hostfile (one host per rank) and placement.md (predicted step time against "
        "the plain Slurm order and a compact allocation).",
    )
    p.add_argument("plan", help="path to plan.json")
    p.add_argument(
        "--nodelist",
        required=True,
        help='a Slurm hostlist (e.g. "$SLURM_JOB_NODELIST", frontier[00012-00016,00040]) or '
        "a file with one host per line",
    )
    p.add_argument(
        "--topology",
        help="Slurm's topology.conf (tree or block plugin) or topology.yaml; default: the "
        "cluster's hostname rule (Frontier)",
    )
    p.add_argument("--out", default="placement", help="output directory (default: placement)")
    p.add_argument("--solver", choices=("cpsat", "cbc"), default="cpsat")
    p.add_argument(
        "--time-limit-s", type=float, default=1.0, help="rank IP time limit in s (default 1)"
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.time_limit_s > 0:
        raise SpecError(
            f"--time-limit-s: {args.time_limit_s} must be positive; give the rank IP a time budget"
        )
    plan = load_plan(args.plan)
    hosts = load_nodelist(args.nodelist)
    allocation = allocation_of(hosts, args.topology, plan.cluster.name)
    options = SolverOptions(args.solver, args.time_limit_s, args.threads, args.seed)
    placement = place_plan(plan, allocation, options, args.plan)
    write_files(args.out, placement_files(placement, args.plan))
    print(summary_line(placement))
    print(f"wrote {args.out}/ (hostfile, local_ranks, placement.md)", file=sys.stderr)
    return 0
