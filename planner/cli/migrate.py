"""`piper migrate --trace FILE [--plan PLAN.json | --ep R ...]`: replay a trace under each
migration policy and write placements.csv, migrations.csv, summary.md, plots and timings.json.

Intervals come from the run that wrote the trace (its run.json), ep and tokens per step from
the plan (planner/migration/recorded.py); flags fill in what neither records."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from planner.ip.solvers import SolverOptions
from planner.migration.placement import capacity
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.recorded import load_run_record, replay_intervals
from planner.migration.run import replay
from planner.migration.trace import Trace, interval_trace, load_trace
from planner.numbers import number
from planner.outputs.console import print_table, progress
from planner.outputs.files import write_files
from planner.plan import load_plan
from planner.specs import SpecError

POLICY_COLUMNS = ("policy", "mean imb", "p95 imb", "moved", "GB moved", "transfer s",
                  "total s", "solver ms")  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "migrate",
        help="plan expert migration per interval on a load trace, against the baselines",
        description=(
            "Replay an expert-load trace: for each interval and MoE layer, choose the "
            "placement from past loads only, under no migration, the paper's greedy swap, "
            "an EPLB-style re-pack and Piper's priced assignment."
        ),
    )
    p.add_argument(
        "--trace", required=True, help="CSV interval,layer,expert,tokens (.csv.gz read too)"
    )
    p.add_argument(
        "--plan",
        help="plan.json: ep, model, cluster, rank devices, tokens per step, start placement",
    )
    p.add_argument(
        "--rows-per-interval",
        type=int,
        help="trace rows per migration interval (default: the run's, from run.json beside the "
        "trace; else 1, each row an interval); K when each row is a step and an interval K steps",
    )
    p.add_argument("--ep", type=int, help="expert-parallel ranks (default: the plan's or run's)")
    p.add_argument(
        "--model", help="prices an expert's bytes; default: the first preset with the trace's E"
    )
    p.add_argument("--cluster", help="prices the links (default frontier)")
    p.add_argument(
        "--steps-per-interval",
        type=int,
        help="training steps per interval (default: the run's --migrate-every; else the rows "
        "per interval when above 1, else 100)",
    )
    p.add_argument(
        "--tokens-per-step",
        type=int,
        help="tokens per EP rank and step (default: from the plan, else 8 x 4096)",
    )
    p.add_argument(
        "--redundant-slots",
        type=int,
        default=None,
        help="spare expert slots over the whole EP group, e.g. 32 for 256 experts on 64 "
        "ranks (default: the plan's, else 0)",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="piper",
        help="policy whose placements.csv / migrations.csv are written (default piper)",
    )
    p.add_argument("--move-margin", type=float, help="imbalance each moved expert must buy")
    p.add_argument(
        "--solver",
        choices=("local", "cpsat", "cbc"),
        default="local",
        help="Piper's search: local (default, fast) or the integer program on cpsat / cbc",
    )
    p.add_argument("--time-limit-s", type=float, default=5.0, help="per IP solve (default 5)")
    p.add_argument("--seed", type=int, default=0, help="solver seed (--solver cpsat|cbc)")
    p.add_argument("--out", default="results/migrate", help="output folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _setup(args: argparse.Namespace):
    """(history rows, interval trace, resolved settings, MigrateSetup) from the flags, the
    plan and the run.json beside the trace."""
    from planner.migration.inputs import migrate_setup

    rows = load_trace(args.trace)
    plan = load_plan(args.plan) if args.plan else None
    given = (args.ep, args.rows_per_interval, args.steps_per_interval, args.tokens_per_step)
    chosen_by = replay_intervals(rows, load_run_record(args.trace), plan, args.plan, *given)
    rows = Trace(rows.tokens_ILE[: chosen_by.trace_rows], rows.layer_ids, rows.source)
    rows = interval_trace(rows, chosen_by.rows_per_history_row)  # the rows policies see
    trace = interval_trace(rows, chosen_by.rows_per_interval // chosen_by.rows_per_history_row)
    setup = migrate_setup(
        trace,
        chosen_by.ep,
        plan_path=args.plan,
        model_name=args.model,
        cluster_name=args.cluster,
        steps_per_interval=chosen_by.steps_per_interval,
        tokens_per_rank_step=chosen_by.tokens_per_rank_step,
        redundant_slots=args.redundant_slots,
        plan=plan,
    )
    return rows, trace, chosen_by, setup


def _options(args: argparse.Namespace, trace: Trace, initial_LRS) -> MigrationOptions:
    opts = MigrationOptions()
    if args.move_margin is not None:
        if args.move_margin < 0:
            raise SpecError(f"--move-margin must be >= 0, got {args.move_margin}")
        opts = replace(opts, move_margin=args.move_margin)
    if args.time_limit_s <= 0:
        raise SpecError(f"--time-limit-s must be > 0, got {args.time_limit_s}")
    if args.solver != "local":
        if any(capacity(slots_RS).sum() > trace.num_experts for slots_RS in initial_LRS):
            raise SpecError(
                "--solver cpsat|cbc does not model replicas; drop --redundant-slots "
                "(or use a plan without them)"
            )
        solver = SolverOptions(args.solver, args.time_limit_s, threads=1, seed=args.seed)
        opts = replace(opts, solver=solver)
    return opts


def run(args: argparse.Namespace) -> int:
    from planner.migration import report

    start = time.perf_counter()
    rows, trace, chosen_by, setup = _setup(args)
    opts = _options(args, trace, setup.initial_LRS)
    k = chosen_by.rows_per_interval // chosen_by.rows_per_history_row
    runs = {}
    with progress("replaying the trace per policy", total=len(POLICIES)) as update:
        for i, name in enumerate(POLICIES):
            runs[name] = replay(rows, setup.initial_LRS, setup.costs, name, opts, k)
            update(i + 1)
    chosen = runs[args.policy]
    files: dict[str, str | bytes] = {
        "placements.csv": report.placements_csv(chosen, trace),
        "migrations.csv": report.migrations_csv(chosen),
        "summary.md": report.summary_md(runs, trace, setup, chosen_by.ep),
        "summary.json": report.summary_json(runs, setup),
    }
    if not args.no_plots:
        from planner.migration import plots

        files["imbalance.png"] = plots.imbalance_png(runs)
        files["load_heatmap.png"] = plots.heatmap_png(runs["none"], chosen, trace)
    files["timings.json"] = report.timings_json(runs, time.perf_counter() - start)
    write_files(args.out, files)
    if args.json:
        print(files["summary.json"], end="")
        return 0
    table = [
        (report.LABELS.get(name, name), f"{r.mean_imbalance:.4f}", f"{r.p95_imbalance:.4f}",
         r.experts_moved, number(r.bytes_moved / 1e9), number(r.transfer_s),
         number(r.total_cost_s), number(r.solve_ms_per_layer, 3))
        for name, r in runs.items()
    ]  # fmt: skip
    title = (
        f"{chosen_by.ep} EP ranks, {trace.num_intervals} intervals of "
        f"{setup.steps_per_interval} steps x {setup.tokens_per_rank_step} tokens per rank "
        f"({chosen_by.rows_per_interval} trace rows each; from {chosen_by.source})"
    )
    print_table(title, POLICY_COLUMNS, table)
    print(f"wrote {', '.join(sorted(files))} to {args.out}")
    return 0
