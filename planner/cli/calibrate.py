"""`piper calibrate`: fit a cluster profile to measured runs, or compare a plan with its run.

Two modes (planner/PROFILING.md):
- `piper calibrate --fit RUNS.csv --cluster C --out FITTED.yaml [--params a,b] [--run
  PLAN.json:METRICS.jsonl ...]`: least squares of the cluster's named efficiencies on the
  runs' throughput; prints the constants before and after, the fit's and the leave-one-out
  errors; writes the fitted cluster profile.
- `piper calibrate PLAN METRICS [--out DIR] [--write-profile OUT]`: predicted vs measured
  per component for one `piper run`; where the run's run.json records another dispatcher or
  layout than the plan priced, one line says so and the dispatcher is repriced.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from planner.outputs.files import write_files
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit a cluster profile to measured runs, or compare a plan with its run",
        description="With --fit RUNS.csv: fit the cluster profile's named efficiencies to "
        "measured runs (least squares on log throughput, leave-one-out errors) and write the "
        "fitted profile. With PLAN METRICS: predicted (plan.json + resource model per stage) "
        "vs measured (metrics.jsonl from 'piper run') per component. See planner/PROFILING.md.",
    )
    p.add_argument("plan", nargs="?", help="plan.json the run executed (compare mode)")
    p.add_argument("metrics", nargs="?", help="metrics.jsonl written by 'piper run' (compare)")
    p.add_argument(
        "--fit",
        default=None,
        metavar="RUNS.csv",
        help="fit mode: measured runs with the columns of profiles/runs/published_runs.csv",
    )
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="PLAN.json:METRICS.jsonl",
        help="fit mode: a 'piper run' as one more run (repeatable)",
    )
    p.add_argument(
        "--params",
        default=None,
        metavar="a,b,c",
        help="fit mode: the constants to fit (default: every named efficiency, at most 8)",
    )
    p.add_argument("--no-loo", action="store_true", help="fit mode: skip the leave-one-out refits")
    p.add_argument(
        "--out",
        default=None,
        help="fit mode: the fitted cluster YAML (required); compare mode: directory for "
        "calibration.{csv,md,png} (default: beside METRICS)",
    )
    p.add_argument(
        "--write-profile",
        default=None,
        metavar="PROFILE_OUT",
        help="compare mode: write a cluster YAML corrected by the run's errors",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="fit mode: the cluster to fit from (required); compare mode: re-estimate on it",
    )
    p.add_argument("--skip-steps", type=int, default=1, help="warm-up steps to drop")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.skip_steps < 0:
        raise SpecError(f"--skip-steps must be >= 0, got {args.skip_steps}")
    if args.fit is not None:
        return run_fit(args)
    if args.run or args.params or args.no_loo:
        raise SpecError("--run, --params and --no-loo belong to the fit mode; add --fit RUNS.csv")
    if not (args.plan and args.metrics):
        raise SpecError(
            "give PLAN METRICS (compare a plan with its run) or --fit RUNS.csv --cluster C "
            "--out FITTED.yaml (fit a profile)"
        )
    return run_compare(args)


def run_compare(args: argparse.Namespace) -> int:
    """PLAN METRICS: the component table, calibration.{csv,md,png}, --write-profile."""
    import yaml

    from planner.calibrate.compare import calibrate, fit_profile, plan_inputs
    from planner.calibrate.metrics import load_metrics
    from planner.calibrate.report import calibration_csv, calibration_markdown, calibration_png
    from planner.calibrate.run_settings import (
        differences_line,
        load_run_info,
        repricing,
        run_differences,
    )
    from planner.inputs.clusters import load_cluster
    from planner.plan import load_plan

    plan = load_plan(args.plan)
    metrics = load_metrics(args.metrics)
    cluster = load_cluster(args.cluster) if args.cluster else None
    differences = run_differences(plan, load_run_info(args.metrics))
    reprice = repricing(plan, differences)
    note = differences_line(differences, reprice, bool(plan.training.get("a2a_overlap")))
    cal = calibrate(plan, metrics, args.skip_steps, cluster, reprice, note)
    table = calibration_markdown(cal)
    out = Path(args.out) if args.out else Path(args.metrics).parent
    files: dict[str, str | bytes] = {
        "calibration.csv": calibration_csv(cal),
        "calibration.md": table,
        "calibration.png": calibration_png(cal),
    }
    fitted = None
    if args.write_profile:
        base = cluster or plan_inputs(plan)[1]
        fitted = yaml.safe_dump(
            fit_profile(cal, base, plan), sort_keys=False, default_flow_style=None, width=100
        )
    write_files(out, files)
    if fitted is not None:
        target = Path(args.write_profile)
        write_files(target.parent, {target.name: fitted})
    print(table, end="")
    print(
        f"wrote {out}/calibration.csv, calibration.md, calibration.png"
        + (f" and {args.write_profile}" if args.write_profile else "")
    )
    return 0


def run_fit(args: argparse.Namespace) -> int:
    """--fit RUNS.csv: fit, print the tables, write the fitted profile."""
    from planner.calibrate.fit import fit, fit_params
    from planner.calibrate.fit_report import fit_tables, fitted_profile_yaml
    from planner.calibrate.runs import hardware_matches, load_runs, run_of_metrics
    from planner.inputs.clusters import load_cluster
    from planner.outputs.console import print_table, progress

    if args.plan or args.metrics:
        raise SpecError(
            "--fit takes no PLAN METRICS; give a piper run as --run PLAN.json:METRICS.jsonl"
        )
    if not args.cluster:
        raise SpecError("--fit needs --cluster C: the cluster profile the runs ran on")
    if not args.out:
        raise SpecError("--fit needs --out FITTED.yaml: where to write the fitted profile")
    target = Path(args.out)
    if target.suffix not in (".yaml", ".yml"):
        raise SpecError(f"--out {args.out}: the fitted profile is YAML; name it FITTED.yaml")
    names = [n.strip() for n in args.params.split(",")] if args.params is not None else None
    fit_params(names)  # refuse bad --params before reading anything
    cluster = load_cluster(args.cluster)
    runs = load_runs(args.fit, allow_empty=bool(args.run))
    used = [r for r in runs if hardware_matches(r.hardware, cluster)]
    others = sorted({r.hardware for r in runs} - {r.hardware for r in used})
    if not used and not args.run:  # (load_runs refused a file without rows)
        raise SpecError(
            f"{args.fit}: no run on {cluster.device.name} (cluster {cluster.name}); the rows' "
            f"hardware is {', '.join(others)}: give the cluster they ran on as --cluster"
        )
    for pair in args.run:
        used.append(run_of_metrics(*_pair(pair), skip_steps=args.skip_steps))
    loo = not args.no_loo and len(used) >= 2
    with progress("leave-one-out refits", total=len(used) if loo else None) as update:
        result = fit(used, cluster, names, leave_one_out=loo, progress=update)
    text = fitted_profile_yaml(result, args.fit, datetime.date.today().isoformat())
    for title, columns, rows in fit_tables(result):
        print_table(title, columns, rows)
        print()
    if others:
        left = sum(r.hardware in others for r in runs)
        print(f"left out {left} row(s) of {args.fit} on other hardware ({', '.join(others)})")
    if not result.converged:
        print(f"the fit stopped before converging: {result.message}")
    write_files(target.parent, {target.name: text})
    print(f"wrote {target} (cluster {result.start.name}-fitted)")
    return 0


def _pair(text: str) -> tuple[str, str]:
    plan, sep, metrics = text.rpartition(":")
    if not sep or not plan or not metrics:
        raise SpecError(f"--run {text}: give PLAN.json:METRICS.jsonl (a plan and its run)")
    return plan, metrics
