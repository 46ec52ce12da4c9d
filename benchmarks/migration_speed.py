"""Migration decision speed: milliseconds per layer and interval, Piper vs the baselines.

256 experts on 64 EP ranks (top-8, priced as deepseek-v3 on frontier): one drifting
synthetic trace without replicas and with 32 redundant slots (DeepSeek-V3's 288 slots),
then each recorded trace of that shape (profiles/traces/tiny-256e-*.csv.gz, one row per
step, 20 steps per interval as recorded: every policy sees the steps; or --trace, one row
per interval).
Every policy decides every interval from the past loads; the median wall-clock time of one
(layer, interval) decision is printed with its ratio to the greedy swap. Target from the
issue: Piper's median <= 50 ms per layer per interval at 256 x 64 with replicas.

Then the trace's length: `piper migrate` end to end (read, the four policies, every output
file and plot) on generated traces of --length-rows / 4 and --length-rows rows (default
10^6): a run's per-step trace (16 experts, 2 MoE layers, one row per step, intervals of 10
steps, 4 EP ranks: 40,000 steps of a 25-row step are 10^6 rows) and a 256-expert trace of
one row per interval on 64 EP ranks. Every decision reads at most the newest 64 intervals
(policies.HISTORY_INTERVALS), so 4x the rows should take about 4x the time; target: 10^6
rows in < 60 s.

Run: python3 benchmarks/migration_speed.py [--intervals 32] [--layers 2] [--trace FILE]
     [--length-rows N] [--no-length]
Writes what it prints to results/migration_speed.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from migration_quality import STEPS_FOR
from results_md import ROOT, recorded

from planner.migration.inputs import migrate_setup
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.run import replay
from planner.migration.synth import SynthOptions, synth_trace
from planner.migration.trace import Trace, interval_trace, load_trace, trace_to_csv

TARGET_MS = 50.0
TARGET_LENGTH_S = 60.0  # piper migrate on a 10^6-row trace


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
    p.add_argument("--length-rows", type=int, default=10**6, help="rows of the longest trace")
    p.add_argument("--no-length", action="store_true", help="skip the trace-length timings")
    args = p.parse_args()
    title = "Expert migration decision time"
    with recorded(args.results, title, enabled=not args.no_results):
        run(args)
        if not args.no_length:
            run_lengths(args.length_rows)


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


def drifting_trace(experts: int, layers: int, rows: int, tokens: int) -> Trace:
    """Poisson counts of a popularity that drifts as an Ornstein-Uhlenbeck walk of logits
    (seeded): a long trace made in seconds (synth_trace samples every token)."""
    rng = np.random.default_rng(0)
    logit_LE = rng.normal(0.0, 0.5, (layers, experts))
    tokens_ILE = np.empty((rows, layers, experts), dtype=np.int64)
    for t in range(rows):
        logit_LE += rng.normal(0.0, 0.05, logit_LE.shape) - 0.01 * logit_LE
        share_LE = np.exp(logit_LE)
        tokens_ILE[t] = rng.poisson(tokens * share_LE / share_LE.sum(axis=1, keepdims=True))
    return Trace(tokens_ILE, tuple(range(1, layers + 1)))


def time_migrate(trace: Trace, flags: list[str], folder: Path) -> tuple[float, float]:
    """Wall-clock and CPU seconds of `piper migrate` on the trace written as CSV, outputs
    included (CPU: user + system of the process; other work on a shared machine stretches
    the wall clock, not it)."""
    path = folder / "trace.csv"
    path.write_text(trace_to_csv(trace))
    cli = "import sys; from planner.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", cli, "migrate", "--trace", str(path)]
    cmd += [*flags, "--out", str(folder / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall_s, cpu_s


def run_lengths(longest: int) -> None:
    """`piper migrate` on a quarter of the rows and on all of them, per trace shape."""
    shapes = (
        ("per-step, 16 experts x 2 layers, 10 steps per interval, 4 ranks", 16, 2, 4, 10),
        ("per-interval, 256 experts x 2 layers, 64 ranks", 256, 2, 64, 1),
    )
    print("\npiper migrate end to end by trace length (read, 4 policies, outputs, plots)")
    print(
        f"{'trace':66s} {'rows':>9s} {'intervals':>9s} {'wall s':>7s} {'CPU s':>6s} {'us/row':>7s}"
    )
    verdicts = []
    for label, experts, layers, ranks, k in shapes:
        per_row = layers * experts
        times = []
        for rows in (longest // 4, longest):
            steps = rows // per_row // k * k  # whole intervals
            trace = drifting_trace(experts, layers, steps, 4096 if k > 1 else 32768)
            flags = ["--ep", str(ranks), "--rows-per-interval", str(k)]
            with tempfile.TemporaryDirectory() as folder:
                wall_s, cpu_s = time_migrate(trace, flags, Path(folder))
            n = steps * per_row
            times.append((n, wall_s, cpu_s))
            print(f"{label:66s} {n:9,d} {steps // k:9,d} {wall_s:7.1f} {cpu_s:6.1f} "
                  f"{cpu_s / n * 1e6:7.1f}")  # fmt: skip
        (n_small, _, cpu_small), (n_big, wall_big, cpu_big) = times
        print(f"  {n_big / n_small:.2f}x the rows took {cpu_big / cpu_small:.2f}x the CPU time")
        verdicts.append((label, n_big, wall_big, cpu_big))
    print(f"\n| trace | rows | wall s | CPU s | < {TARGET_LENGTH_S:.0f} s |\n|---|---|---|---|---|")
    for label, n, wall_s, cpu_s in verdicts:
        ok = "pass" if wall_s < TARGET_LENGTH_S else "FAIL"
        print(f"| {label} | {n:,} | {wall_s:.1f} | {cpu_s:.1f} | {ok} |")


if __name__ == "__main__":
    main()
