"""`piper calibrate PLAN METRICS`: predicted vs measured per component; `--fit` a profile."""

from __future__ import annotations

import argparse
from pathlib import Path

from planner.outputs.files import write_files


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="compare a plan's prediction with a run's metrics.jsonl",
        description="Predicted (plan.json + resource model per stage) vs measured "
        "(metrics.jsonl from 'piper run') per component; see planner/PROFILING.md.",
    )
    p.add_argument("plan", help="plan.json the run executed")
    p.add_argument("metrics", help="metrics.jsonl written by 'piper run'")
    p.add_argument(
        "--out",
        default=None,
        help="directory for calibration.{csv,md,png} (default: beside METRICS)",
    )
    p.add_argument(
        "--fit",
        default=None,
        metavar="PROFILE_OUT",
        help="write a cluster YAML with corrected efficiency constants",
    )
    p.add_argument("--cluster", default=None, help="re-estimate on this cluster/profile")
    p.add_argument("--skip-steps", type=int, default=1, help="warm-up steps to drop")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from planner.calibrate.compare import calibrate, fit_profile, plan_inputs
    from planner.calibrate.metrics import load_metrics
    from planner.calibrate.report import calibration_csv, calibration_markdown, calibration_png
    from planner.inputs.clusters import load_cluster
    from planner.plan import load_plan

    plan = load_plan(args.plan)
    metrics = load_metrics(args.metrics)
    cluster = load_cluster(args.cluster) if args.cluster else None
    cal = calibrate(plan, metrics, args.skip_steps, cluster)
    table = calibration_markdown(cal)
    out = Path(args.out) if args.out else Path(args.metrics).parent
    files: dict[str, str | bytes] = {
        "calibration.csv": calibration_csv(cal),
        "calibration.md": table,
        "calibration.png": calibration_png(cal),
    }
    fitted = None
    if args.fit:
        base = cluster or plan_inputs(plan)[1]
        fitted = yaml.safe_dump(
            fit_profile(cal, base, plan), sort_keys=False, default_flow_style=None, width=100
        )
    write_files(out, files)
    if fitted is not None:
        write_files(Path(args.fit).parent, {Path(args.fit).name: fitted})
    print(table, end="")
    print(
        f"wrote {out}/calibration.csv, calibration.md, calibration.png"
        + (f" and {args.fit}" if args.fit else "")
    )
    return 0
