"""Migration decision speed: milliseconds per layer and interval, Piper vs the baselines.

256 experts on 64 EP ranks (top-8, priced as deepseek-v3 on frontier): one drifting
synthetic trace without replicas and with 32 redundant slots (DeepSeek-V3's 288 slots),
then each recorded trace of that shape (profiles/traces/tiny-256e-*.csv.gz, one row per
step, 20 steps per interval as recorded: every policy sees the steps; or --trace, one row
per interval).
Every policy decides every interval from the past loads; the median wall-clock time of one
(layer, interval) decision is printed with its ratio to the greedy swap. Target from the
issue: Piper's median <= 50 ms per layer per interval at 256 x 64 with replicas.

Run: python3 benchmarks/migration_speed.py [--intervals 32] [--layers 2] [--trace FILE]
Writes what it prints to results/migration_speed.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from migration_quality import STEPS_FOR
from results_md import ROOT, recorded

from planner.migration.inputs import migrate_setup
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.run import replay
from planner.migration.synth import SynthOptions, synth_trace
from planner.migration.trace import Trace, interval_trace, load_trace

TARGET_MS = 50.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--redundant-slots", type=int, default=32, help="for the replica runs")
    p.add_argument("--intervals", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--trace", action="append", help="trace CSV, one row per interval (repeatable)")
    p.add_argument("--results", default="results/migration_speed.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    title = "Expert migration decision time"
    with recorded(args.results, title, enabled=not args.no_results):
        run(args)


def time_policies(trace: Trace, args, redundant: int, rows: int = 1) -> dict[str, np.ndarray]:
    """Milliseconds of every (interval >= 1, layer) decision, per policy."""
    setup = migrate_setup(
        interval_trace(trace, rows), args.ranks, model_name=args.model, cluster_name="frontier",
        redundant_slots=redundant,
    )  # fmt: skip
    out = {}
    for name in POLICIES:
        run = replay(trace, setup.initial_LRS, setup.costs, name, MigrationOptions(), rows)
        out[name] = run.solve_s_IL[1:].ravel() * 1e3
    return out


def print_times(label: str, ms: dict[str, np.ndarray]) -> float:
    print(f"\n{label}")
    print(f"{'policy':8s} {'median ms':>10s} {'p90 ms':>8s} {'max ms':>8s} {'vs swap':>8s}")
    swap = max(float(np.median(ms["swap"])), 1e-9)
    for name, v in ms.items():
        med = float(np.median(v))
        print(f"{name:8s} {med:10.2f} {np.percentile(v, 90):8.2f} {v.max():8.2f} "
              f"{med / swap:8.1f}")  # fmt: skip
    return float(np.median(ms["piper"]))


def run(args: argparse.Namespace) -> None:
    """Time every policy on each trace, without and with redundant slots."""
    synth = SynthOptions(
        layers=args.layers, experts=args.experts, intervals=args.intervals, tokens=32768, top_k=8
    )
    cases = [(f"synthetic (skew {synth.skew}, drift {synth.drift})", synth_trace(synth), 1)]
    recorded_paths = sorted(str(p) for p in (ROOT / "profiles/traces").glob("tiny-256e-*.csv.gz"))
    paths = args.trace or recorded_paths
    rows = 1 if args.trace else STEPS_FOR[256]  # the recorded 256-expert runs' interval
    cases += [(f"trace {Path(p).name.split('.')[0]}", load_trace(p), rows) for p in paths]
    print(f"{args.experts} experts x {args.ranks} ranks, priced as {args.model} on frontier; "
          f"synthetic: {args.layers} layers x {args.intervals} intervals")  # fmt: skip
    verdicts = []
    for label, trace, rows in cases:
        for redundant in (0, args.redundant_slots):
            steps = f" of {rows} steps" if rows > 1 else ""
            shape = f"{trace.num_layers} layers x {trace.num_intervals // rows} intervals{steps}"
            name = f"{label}, {shape}, {redundant} redundant slots"
            median = print_times(name, time_policies(trace, args, redundant, rows))
            verdicts.append((name, median))
    print("\n| case | Piper median ms per layer per interval | <= 50 ms |\n|---|---|---|")
    for name, median in verdicts:
        print(f"| {name} | {median:.2f} | {'pass' if median <= TARGET_MS else 'FAIL'} |")


if __name__ == "__main__":
    main()
