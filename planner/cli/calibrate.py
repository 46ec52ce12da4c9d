"""`piper calibrate`: fit a cluster profile to measured runs, or compare a plan with its run.

Two modes (planner/PROFILING.md):
- `piper calibrate --fit [RUNS.csv] [--log PLAN_OR_EXPORT:LOG ...] [--run PLAN:METRICS ...]
  --cluster C --out FITTED.yaml [--params a,b]`: the runs (RUNS.csv rows, Megatron-LM /
  torchtitan logs, piper runs) fit the constants they identify, regularised toward the
  preset (planner/calibrate/prior.py), and framework_overhead_gib from measured peaks; prints
  what was fitted and why the rest was kept, the constants, the fit's and the leave-one-out
  errors; writes the fitted cluster profile.
- `piper calibrate PLAN MEASURED [MEASURED ...] [--format F] [--json] [--out DIR]
  [--write-profile OUT]`, or `piper calibrate --log PLAN:LOG ...`: each measurement (a `piper
  run`'s metrics.jsonl, a Megatron-LM or torchtitan log) against the plan's prediction:
  whether tokens/s, step time and peak memory lie inside the plan's 80% interval, below or
  above it, and z; for metrics.jsonl also predicted vs measured per component (where the
  run's run.json records another dispatcher or layout than the plan priced, one line says so
  and the dispatcher is repriced); a summary line over several measurements.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

from planner.calibrate.measured import FORMATS
from planner.outputs.files import write_files
from planner.specs import SpecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit a cluster profile to measured runs, or compare a plan with its run",
        description="With --fit RUNS.csv: fit the cluster profile's named efficiencies to "
        "measured runs (least squares on log throughput, leave-one-out errors) and write the "
        "fitted profile. With PLAN METRICS: predicted (plan.json + resource model per stage) "
        "vs measured (metrics.jsonl from 'piper run', or a Megatron-LM / torchtitan log), "
        "with where each figure falls in the plan's 80% interval. See planner/PROFILING.md.",
    )
    p.add_argument("plan", nargs="?", help="plan.json the run executed (compare mode)")
    p.add_argument(
        "metrics",
        nargs="*",
        metavar="MEASURED",
        help="compare mode: runs of PLAN: metrics.jsonl written by 'piper run', or Megatron-LM "
        "/ torchtitan logs",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default="auto",
        help="compare mode: the MEASURED files' format (default: detected)",
    )
    p.add_argument(
        "--json", action="store_true", help="compare mode: print one JSON object (for scripts)"
    )
    p.add_argument(
        "--fit",
        nargs="?",
        const="",
        default=None,
        metavar="RUNS.csv",
        help="fit mode; optionally measured runs with the columns of "
        "profiles/runs/published_runs.csv",
    )
    p.add_argument(
        "--log",
        action="append",
        default=[],
        metavar="PLAN_OR_EXPORT:LOGFILE",
        help="a Megatron-LM or torchtitan log (or piper run's metrics.jsonl) and the "
        "plan.json it ran, or the export beside that plan (repeatable): a run of the fit, or "
        "without --fit and PLAN a measurement to compare",
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
        help="fit mode: the candidate constants (default: every named efficiency, at most 8); "
        "the fit sets those the runs identify",
    )
    p.add_argument("--no-loo", action="store_true", help="fit mode: skip the leave-one-out refits")
    p.add_argument(
        "--covariance-only",
        action="store_true",
        help="fit mode: refit nothing; print the calibration entries (se_<name>, corr_<a>__<b>) "
        "of the --params constants' covariance at the cluster's own values, for a preset "
        "fitted elsewhere",
    )
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
        help="compare mode: write a cluster YAML corrected by the run's errors; fit mode: the "
        "same as --out",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help="fit mode: the cluster to fit from (required with RUNS.csv; default: the first "
        "--log/--run plan's); compare mode: re-estimate on it",
    )
    p.add_argument(
        "--skip-steps",
        type=int,
        default=1,
        help="warm-up steps (iterations) to drop from metrics.jsonl and logs",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.skip_steps < 0:
        raise SpecError(f"--skip-steps must be >= 0, got {args.skip_steps}")
    if args.fit is not None and (args.json or args.format != "auto"):
        raise SpecError("--json and --format belong to the compare mode; drop them with --fit")
    if args.fit is None and args.log and not args.plan:  # --log PLAN:LOG ...: compare each
        if args.run or args.params or args.no_loo or args.covariance_only:
            raise SpecError(
                "--run, --params, --no-loo and --covariance-only belong to the fit mode; add --fit"
            )
        return run_compare(args)
    if args.fit is not None:
        return run_fit(args)
    if args.run or args.log or args.params or args.no_loo or args.covariance_only:
        raise SpecError(
            "--run, --log, --params, --no-loo and --covariance-only belong to the fit mode; add "
            "--fit [RUNS.csv]"
        )
    if not (args.plan and args.metrics):
        raise SpecError(
            "give PLAN MEASURED (compare a plan with its run's metrics.jsonl or training log), "
            "--log PLAN:LOG ... (compare several) or --fit RUNS.csv --cluster C --out "
            "FITTED.yaml (fit a profile)"
        )
    return run_compare(args)


def run_compare(args: argparse.Namespace) -> int:
    """PLAN MEASURED ... / --log PLAN:LOG ...: each measurement against the plan's intervals
    (and, for metrics.jsonl, the component table and calibration.{csv,md,png}), a summary line
    over several, --json, --write-profile."""
    import json

    from planner.calibrate.interval_check import summarise
    from planner.calibrate.measured import compare_measurement
    from planner.calibrate.report import (
        calibration_markdown,
        comparisons_json,
        interval_lines,
        summary_line,
    )
    from planner.inputs.clusters import load_cluster

    pairs = [(args.plan, m) for m in args.metrics] + [_log_pair(p) for p in args.log]
    cluster = load_cluster(args.cluster) if args.cluster else None
    comparisons = [
        compare_measurement(plan, measured, args.format, args.skip_steps, cluster)
        for plan, measured in pairs
    ]
    files = _compare_files(comparisons, args, cluster)
    tallies = summarise([x for c in comparisons for x in c.checks])
    for path, content in files.items():
        write_files(path.parent, {path.name: content})
    wrote = [str(path) for path in files]
    if args.json:
        print(json.dumps({**comparisons_json(comparisons, tallies), "wrote": wrote}, indent=2))
        return 0
    for c in comparisons:
        if c.calibration is not None:
            print(calibration_markdown(c.calibration), end="")
        print("\n".join(interval_lines(c)))
    if len(comparisons) > 1:
        print(summary_line(tallies, len(comparisons)))
    if wrote:
        print(f"wrote {', '.join(wrote)}")
    return 0


def _log_pair(text: str) -> tuple[str, str]:
    """--log PLAN_OR_EXPORT:LOG in compare mode: the plan.json (beside an export) and the log."""
    from planner.calibrate.log_runs import resolve_plan, split_pair

    given, log = split_pair(text)
    return str(resolve_plan(given)), log


def _compare_files(comparisons: list, args: argparse.Namespace, cluster) -> dict[Path, object]:
    """calibration.{csv,md,png} of each metrics.jsonl comparison (in --out, else beside it) and
    the --write-profile profile, all rendered before anything is written."""
    import yaml

    from planner.calibrate.compare import fit_profile, plan_inputs
    from planner.calibrate.report import (
        calibration_csv,
        calibration_markdown,
        calibration_png,
        interval_lines,
    )
    from planner.plan import load_plan

    runs = [c for c in comparisons if c.calibration is not None]
    if (args.out or args.write_profile) and len(runs) != 1:
        raise SpecError(
            f"--out and --write-profile take one piper run's metrics.jsonl, got {len(runs)}; "
            "compare one run at a time to write them"
        )
    files: dict[Path, object] = {}
    for c in runs:
        out = Path(args.out) if args.out else Path(c.measured_path).parent
        table = calibration_markdown(c.calibration) + "\n".join(["", *interval_lines(c), ""])
        files[out / "calibration.csv"] = calibration_csv(c.calibration)
        files[out / "calibration.md"] = table
        files[out / "calibration.png"] = calibration_png(c.calibration)
    if args.write_profile:
        plan = load_plan(runs[0].plan_path)
        base = cluster or plan_inputs(plan)[1]
        profile = fit_profile(runs[0].calibration, base, plan)
        text = yaml.safe_dump(profile, sort_keys=False, default_flow_style=None, width=100)
        files[Path(args.write_profile)] = text
    return files


def run_fit(args: argparse.Namespace) -> int:
    """--fit [RUNS.csv] --log/--run ...: fit, print the tables, write the fitted profile."""
    from planner.calibrate.applies import refusal_line
    from planner.calibrate.fit import fit_params
    from planner.calibrate.log_runs import run_of_log
    from planner.calibrate.prior import fit_with_prior, warning_line
    from planner.calibrate.prior_report import prior_profile, prior_profile_yaml, prior_tables
    from planner.calibrate.runs import run_of_metrics
    from planner.calibrate.uncertainty import describe_source
    from planner.outputs.console import print_table, progress

    target = _fit_checks(args)
    names = [n.strip() for n in args.params.split(",")] if args.params is not None else None
    fit_params(names)  # refuse bad --params before reading anything
    cluster = _fit_cluster(args)
    used, others, left = _csv_runs(args, cluster)
    for pair in args.run:
        used.append(run_of_metrics(*_pair(pair), skip_steps=args.skip_steps))
    for pair in args.log:
        used.append(run_of_log(pair, skip_steps=args.skip_steps))
    if target is None:
        return _print_covariance(used, cluster, names)
    loo = not args.no_loo and len(used) >= 2
    with progress("leave-one-out refits", total=len(used) if loo else None) as update:
        result = fit_with_prior(used, cluster, names, leave_one_out=loo, progress=update)
    reason = result.does_not_apply()
    if reason:
        measured = cluster.source.startswith("piper profile")
        raise SpecError(refusal_line(reason, cluster.name, measured))
    text = prior_profile_yaml(result, args.fit or "", datetime.date.today().isoformat())
    for title, columns, rows in prior_tables(result):
        print_table(title, columns, rows)
        print()
    if others:
        print(f"left out {left} row(s) of {args.fit} on other hardware ({', '.join(others)})")
    print(f"likelihood: Student-t, sd {result.likelihood.sigma:.3f} with "
          f"{result.likelihood.dof} dof ({result.likelihood.source})")  # fmt: skip
    for o in result.outliers:
        print(f"outlier: {o.label} lies {o.z:+.2f} predictive sds off the start; the t "
              f"likelihood weights it {o.weight:.2f} at the fit")  # fmt: skip
    warning = warning_line(result)
    if warning:
        print(warning)
    if not result.converged:
        print(f"the fit stopped before converging: {result.message}")
    write_files(target.parent, {target.name: text})
    print(f"wrote {target} (cluster {result.start.name}-fitted)")
    print(f"error bars with it: {describe_source(prior_profile(result, '', ''))}")
    return 0


def _print_covariance(runs: list, cluster, names: list[str] | None) -> int:
    """--covariance-only: the calibration entries of the covariance at the cluster's values."""
    import numpy as np

    from planner.calibrate.prior import covariance_at
    from planner.calibrate.uncertainty import covariance_items

    kept, cov = covariance_at(runs, cluster, names)
    print(
        f"# {cluster.name}: covariance in t = log(c + a) of {', '.join(kept)} at the profile's "
        f"constants over {len(runs)} runs (nothing refitted); add under calibration:"
    )
    for key, value in covariance_items(kept, np.asarray(cov)):
        print(f"  {key}: {value}")
    return 0


def _fit_checks(args: argparse.Namespace) -> Path | None:
    """The fit mode's argument rules; returns the profile to write (None with
    --covariance-only, which writes nothing)."""
    if args.plan or args.metrics:
        raise SpecError(
            "--fit takes no PLAN METRICS; give a piper run as --run PLAN.json:METRICS.jsonl"
        )
    if not (args.fit or args.log or args.run):
        raise SpecError(
            "--fit needs runs: RUNS.csv, --log PLAN_OR_EXPORT:LOGFILE or --run "
            "PLAN.json:METRICS.jsonl"
        )
    if args.fit and not args.cluster:
        raise SpecError("--fit needs --cluster C: the cluster profile the runs ran on")
    out = args.out or args.write_profile
    if args.covariance_only:
        if out or args.no_loo:
            raise SpecError("--covariance-only writes nothing; leave out --out and --no-loo")
        return None
    if not out:
        raise SpecError("--fit needs --out FITTED.yaml: where to write the fitted profile")
    target = Path(out)
    if target.suffix not in (".yaml", ".yml"):
        raise SpecError(f"--out {out}: the fitted profile is YAML; name it FITTED.yaml")
    return target


def _fit_cluster(args: argparse.Namespace):
    """--cluster, or the cluster of the first --log / --run plan."""
    from planner.calibrate.log_runs import resolve_plan, split_pair
    from planner.inputs.clusters import load_cluster
    from planner.plan import load_plan

    if args.cluster:
        return load_cluster(args.cluster)
    given = split_pair(args.log[0])[0] if args.log else _pair(args.run[0])[0]
    return load_plan(resolve_plan(given)).cluster_spec()


def _csv_runs(args: argparse.Namespace, cluster) -> tuple[list, list[str], int]:
    """RUNS.csv's rows on the cluster's hardware, the other hardware named, rows left out."""
    from planner.calibrate.runs import hardware_matches, load_runs

    if not args.fit:
        return [], [], 0
    runs = load_runs(args.fit, allow_empty=bool(args.run or args.log))
    used = [r for r in runs if hardware_matches(r.hardware, cluster)]
    others = sorted({r.hardware for r in runs} - {r.hardware for r in used})
    if not used and not (args.run or args.log):  # (load_runs refused a file without rows)
        raise SpecError(
            f"{args.fit}: no run on {cluster.device.name} (cluster {cluster.name}); the rows' "
            f"hardware is {', '.join(others)}: give the cluster they ran on as --cluster"
        )
    return used, others, sum(r.hardware in others for r in runs)


def _pair(text: str) -> tuple[str, str]:
    plan, sep, metrics = text.rpartition(":")
    if not sep or not plan or not metrics:
        raise SpecError(f"--run {text}: give PLAN.json:METRICS.jsonl (a plan and its run)")
    return plan, metrics
