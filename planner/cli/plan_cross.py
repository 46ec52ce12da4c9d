"""`piper plan --cluster a,b,c`: the same model and global batch planned on each cluster in
turn (each into its own subfolder of --out), then one table side by side
(planner/outputs/cross.py; planner/CLUSTERS.md, "Cross-hardware answers")."""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from planner.outputs.console import phases, print_table
from planner.outputs.cross import (
    COLUMNS,
    cluster_names,
    cross_cells,
    cross_row,
    cross_title,
    failed_row,
    folder,
)
from planner.specs import SpecError


def run_cross(args: argparse.Namespace, plan_one: Callable[..., Any]) -> int:
    """Plan on every cluster of `args.cluster` with `plan_one` (`piper plan`'s search and
    files: (args, clock) -> (PlanResult or None, out)); 0 when some cluster has a plan, else 2."""
    from planner.inputs.clusters import load_cluster

    names = cluster_names(args.cluster)
    for name in names:  # an unknown preset or a bad file: refused before any search
        load_cluster(name)
    base = args.out or f"results/{Path(args.model).stem}-cross" + (
        f"-{args.gpus}" if args.gpus else ""
    )
    rows = []
    for name in names:
        one = copy.copy(args)
        one.cluster, one.out = name, f"{base}/{folder(name)}"
        try:
            with phases(f"piper plan ({name})") as clock:
                result, out = plan_one(one, clock)
        except SpecError as exc:
            rows.append(failed_row(name, one.out, str(exc)))
            continue
        if result is None:
            print("piper plan: interrupted; the table is not printed", file=sys.stderr)
            return 130
        rows.append(cross_row(name, result, out))
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2, sort_keys=True))
    else:
        print_table(cross_title(rows, Path(args.model).stem), COLUMNS, cross_cells(rows))
        print(f"wrote {base}/ ({', '.join(folder(n) for n in names if _made(rows, n))})")
    return 0 if any(r.tokens_per_s is not None for r in rows) else 2


def _made(rows: list, name: str) -> bool:
    return any(r.cluster == name and r.tokens_per_s is not None for r in rows)
