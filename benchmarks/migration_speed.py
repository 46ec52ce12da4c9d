"""Migration decision speed: milliseconds per layer and interval, Piper vs the baselines.

256 experts on 64 EP ranks (top-8, priced as deepseek-v3 on frontier), one synthetic
drifting trace; every policy decides every interval from the past loads, and the median
wall-clock time of one (layer, interval) decision is printed with its ratio to the greedy
swap. Target from the issue: Piper's median <= 50 ms on a 2-core machine.

Run: python3 benchmarks/migration_speed.py [--intervals 32] [--layers 2]
Writes what it prints to results/migration_speed.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse

import numpy as np
from results_md import recorded

from planner.migration.inputs import migrate_setup
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.run import replay
from planner.migration.synth import SynthOptions, synth_trace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--intervals", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--results", default="results/migration_speed.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    title = "Expert migration decision time"
    with recorded(args.results, title, enabled=not args.no_results):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Replay every policy on one trace and print its decision times."""
    synth = SynthOptions(
        layers=args.layers, experts=args.experts, intervals=args.intervals, tokens=32768, top_k=8
    )
    trace = synth_trace(synth)
    setup = migrate_setup(trace, args.ranks, model_name=args.model, cluster_name="frontier")
    print(f"{args.experts} experts x {args.ranks} ranks, {args.layers} layers x "
          f"{args.intervals} intervals (skew {synth.skew}, drift {synth.drift})")  # fmt: skip
    print(f"{'policy':8s} {'median ms':>10s} {'p90 ms':>8s} {'max ms':>8s} {'vs swap':>8s}")
    medians = {}
    for name in POLICIES:
        run = replay(trace, setup.initial_LRS, setup.costs, name, MigrationOptions())
        ms = run.solve_s_IL[1:].ravel() * 1e3
        medians[name] = float(np.median(ms))
        ratio = medians[name] / max(medians.get("swap", medians[name]), 1e-9)
        print(f"{name:8s} {medians[name]:10.2f} {np.percentile(ms, 90):8.2f} {ms.max():8.2f} "
              f"{ratio:8.1f}")  # fmt: skip
    verdict = "meets" if medians["piper"] <= 50 else "MISSES"
    print(f"Piper median {medians['piper']:.2f} ms per layer per interval: {verdict} <= 50 ms")


if __name__ == "__main__":
    main()
