"""Expert-migration quality: Piper vs the paper's greedy swap vs an EPLB re-pack, side by side.

For each configuration (experts / EP ranks / top-k, priced with a model of that shape on
frontier, EP rank r on device r, 100 steps of 8 x 4096 tokens per rank per interval) and
several seeds of a drifting synthetic trace, replay every policy and print mean realized
imbalance, p95, experts moved, transfer and total seconds, then the issue's ratios:
  Piper imbalance <= swap's while moving no more experts than swap;
  Piper imbalance within 0.01 of the re-pack's while moving <= 1/4 of its experts.

Run: python3 benchmarks/migration_quality.py [--seeds 3] [--intervals 32] [--quick]
Writes what it prints to results/migration_quality.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from results_md import recorded

from planner.migration.inputs import migrate_setup
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.run import replay_all
from planner.migration.synth import SynthOptions, synth_trace

CONFIGS = (  # (experts, ranks, top_k, model preset with that many experts and top-k)
    (64, 8, 6, "deepseek-v2-lite"),
    (128, 16, 8, "qwen3-30b-a3b"),
    (256, 64, 8, "deepseek-v3"),
)
METRICS = ("mean_imbalance", "p95_imbalance", "experts_moved", "transfer_s", "total_cost_s")


def run_config(cfg, args) -> dict[str, np.ndarray]:
    experts, ranks, top_k, model = cfg
    per_seed: dict[str, list[list[float]]] = {p: [] for p in POLICIES}
    for seed in range(args.seeds):
        synth = SynthOptions(
            layers=args.layers, experts=experts, intervals=args.intervals, tokens=args.tokens,
            top_k=top_k, skew=args.skew, drift=args.drift, seed=seed,
        )  # fmt: skip
        trace = synth_trace(synth)
        setup = migrate_setup(trace, ranks, model_name=model, cluster_name="frontier")
        opts = MigrationOptions(move_margin=args.move_margin, margin_sigmas=args.margin_sigmas)
        runs = replay_all(trace, setup.initial_LRS, setup.costs, POLICIES, opts)
        for name, run in runs.items():
            per_seed[name].append([getattr(run, m) for m in METRICS])
    return {name: np.array(rows) for name, rows in per_seed.items()}


def report(cfg, res: dict[str, np.ndarray]) -> list[bool]:
    experts, ranks, top_k, model = cfg
    print(f"\n{experts} experts / {ranks} ranks / top-{top_k}, priced as {model} on frontier")
    print(f"  {'policy':8s} {'mean imb':>9s} {'p95 imb':>8s} {'moved':>8s} {'transfer s':>11s} "
          f"{'total cost s':>13s}")  # fmt: skip
    for name, rows in res.items():
        m = rows.mean(axis=0)
        print(f"  {name:8s} {m[0]:9.4f} {m[1]:8.4f} {m[2]:8.1f} {m[3]:11.2f} {m[4]:13.1f}")
    imb = {n: r[:, 0].mean() for n, r in res.items()}
    moved = {n: r[:, 2].mean() for n, r in res.items()}
    cost = {n: r[:, 4].mean() for n, r in res.items()}
    checks = [
        imb["piper"] <= imb["swap"],
        moved["piper"] <= moved["swap"],
        imb["piper"] - imb["repack"] <= 0.01,
        moved["piper"] <= 0.25 * moved["repack"],
    ]
    print(f"  piper - swap imbalance   {imb['piper'] - imb['swap']:+.4f}  "
          f"({'ok' if checks[0] else 'MISSED'}: <= 0)")  # fmt: skip
    print(f"  piper / swap moved       {moved['piper'] / max(moved['swap'], 1):.3f}  "
          f"({'ok' if checks[1] else 'MISSED'}: <= 1)")  # fmt: skip
    print(f"  piper - repack imbalance {imb['piper'] - imb['repack']:+.4f}  "
          f"({'ok' if checks[2] else 'MISSED'}: <= 0.01)")  # fmt: skip
    print(f"  piper / repack moved     {moved['piper'] / max(moved['repack'], 1):.3f}  "
          f"({'ok' if checks[3] else 'MISSED'}: <= 0.25)")  # fmt: skip
    print(
        f"  total cost s vs swap {cost['piper'] / cost['swap']:.4f}, vs repack "
        f"{cost['piper'] / cost['repack']:.4f}, vs none {cost['piper'] / cost['none']:.4f}"
    )
    return checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--intervals", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per interval and layer")
    p.add_argument("--skew", type=float, default=SynthOptions.skew)
    p.add_argument("--drift", type=float, default=SynthOptions.drift)
    p.add_argument("--move-margin", type=float, default=MigrationOptions.move_margin)
    p.add_argument("--margin-sigmas", type=float, default=MigrationOptions.margin_sigmas)
    p.add_argument("--only", type=int, help="run only configuration 0, 1 or 2")
    p.add_argument("--quick", action="store_true", help="first configuration, one seed")
    p.add_argument("--results", default="results/migration_quality.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    if args.quick:
        args.seeds = 1
    title = "Expert migration quality: Piper vs greedy swap vs EPLB re-pack"
    with recorded(args.results, title, enabled=not args.no_results):
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    """Every configuration side by side, then the criteria met."""
    start = time.perf_counter()
    print(f"synthetic traces: {args.layers} layers x {args.intervals} intervals, {args.tokens} "
          f"tokens, skew {args.skew}, drift {args.drift}, seeds 0..{args.seeds - 1}; "
          f"move margin {args.move_margin} + {args.margin_sigmas} counting sigma per move, "
          f"other MigrationOptions defaults")  # fmt: skip
    met = []
    configs = CONFIGS[:1] if args.quick else CONFIGS
    if args.only is not None:
        configs = CONFIGS[args.only : args.only + 1]
    for cfg in configs:
        met += report(cfg, run_config(cfg, args))
    print(f"\n{sum(met)}/{len(met)} criteria met; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
