"""Expert-migration quality: Piper vs the paper's greedy swap vs an EPLB re-pack, side by side.

Cases: drifting synthetic traces (several seeds) at 64 experts / 8 EP ranks, 128 / 16 and
256 / 64, and 256 / 64 with 32 redundant slots (DeepSeek-V3's 288 slots); then each
recorded setting (profiles/traces/*-bias*.csv.gz, made by `piper run --trace-every 1`, see
its README: one row per step) at its shape and interval (20 steps with 256 experts, 10 with
64, as the runs were recorded; every policy sees the steps before the interval it places):
the runs of one setting that differ only in their seed (NAME, NAME-seedN) are one case,
scored on their mean like the synthetic seeds; for these it also prints each run's mean
imbalance and Piper's gap to the re-pack over the first 5 decided intervals (the router
still settling) and over the rest.
Every case is priced with a model of that shape on frontier (EP rank r on device r, 100
steps of 8 x 4096 tokens per rank per interval). Every policy is replayed; the table shows
mean realized imbalance, p95, experts moved, transfer and total priced seconds (hottest-rank
expert compute + transfers), then the issue's criteria per case as pass/fail:
  without replicas: imbalance within +0.01 of the re-pack's while moving <= 1/4 of its
  experts, and <= the swap heuristic's while moving fewer experts than it;
  with redundant slots: imbalance <= the re-pack's without replicas;
  every case: total priced cost below every baseline's.

With --forecast-check it prints instead, per case, the realized imbalance of the EPLB re-pack
(replicas included) when it packs each forecast method's loads, and the next interval's own
loads (perfect foresight): how much a better forecast could give, moves free; for the
recorded traces also Piper's own forecast from the steps ("steps", forecast_interval).

Run: python3 benchmarks/migration_quality.py [--seeds 5] [--trace FILE --ep R ...] [--quick]
     [--forecast-check]
Writes what it prints to results/migration_quality.md (--results FILE, --no-results).
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from results_md import ROOT, recorded

from planner.migration.forecast import ForecastOptions, forecast_interval, forecast_loads
from planner.migration.inputs import migrate_setup
from planner.migration.placement import capacity, imbalance
from planner.migration.policies import POLICIES, MigrationOptions
from planner.migration.replicate import pack, replica_counts_for
from planner.migration.run import replay_all
from planner.migration.synth import SynthOptions, synth_trace
from planner.migration.trace import Trace, interval_trace, load_trace

METRICS = ("mean_imbalance", "p95_imbalance", "experts_moved", "transfer_s", "total_cost_s")
MODEL_FOR = {64: "deepseek-v2-lite", 128: "qwen3-30b-a3b", 256: "deepseek-v3"}
TRACE_MODEL_FOR = {64: "olmoe-1b-7b", 256: "deepseek-v3"}  # the recorded traces' shapes
RANKS_FOR = {64: 8, 128: 16, 256: 64}
STEPS_FOR = {64: 10, 256: 20}  # steps per interval of the recorded runs (their README)
SEED_SUFFIX = re.compile(r"-seed\d+$")  # NAME-seedN: the run of NAME with seed N


@dataclass(frozen=True)
class Case:
    """One row group of the report: traces, ranks, redundant slots, the pricing model."""

    name: str
    traces: tuple[Trace, ...]
    ranks: int
    model: str
    redundant_slots: int = 0
    baseline_of: str = ""  # name of the case without replicas this one is compared with
    rows_per_interval: int = 1  # trace rows per interval (recorded traces: steps)


def synthetic_cases(args) -> list[Case]:
    shapes = ((64, 8, 6), (128, 16, 8), (256, 64, 8))
    if args.quick:
        shapes = shapes[:1]
    cases = []
    for experts, ranks, top_k in shapes:
        traces = tuple(
            synth_trace(
                SynthOptions(
                    layers=args.layers,
                    experts=experts,
                    intervals=args.intervals,
                    tokens=args.tokens,
                    top_k=top_k,
                    skew=args.skew,
                    drift=args.drift,
                    seed=s,
                )
            )  # fmt: skip
            for s in range(args.seeds)
        )
        name = f"synthetic {experts}/{ranks} top-{top_k}"
        cases.append(Case(name, traces, ranks, MODEL_FOR[experts]))
        if experts == 256 and not args.quick:
            slots = ranks // 2
            cases.append(
                Case(f"{name} +{slots} slots", traces, ranks, MODEL_FOR[experts], slots, name)
            )
    return cases


def _stem(path: str) -> str:
    """The file name without .csv or .csv.gz."""
    return re.sub(r"\.csv(\.gz)?$", "", Path(path).name)


def _seed_order(path: str) -> tuple[str, int]:
    """NAME (seed 0) before NAME-seed1, NAME-seed2, ..."""
    stem = _stem(path)
    found = SEED_SUFFIX.search(stem)
    return SEED_SUFFIX.sub("", stem), int(found.group()[5:]) if found else 0


def trace_cases(args) -> list[Case]:
    """One case per recorded setting: the runs of one setting that differ only in their seed
    (NAME is seed 0, NAME-seedN seed N) form one case, scored on their mean. A --trace
    given by hand is taken as one row per interval, the recorded ones as one row per step."""
    paths = args.trace or sorted(
        (str(p) for p in (ROOT / "profiles" / "traces").glob("*-bias*.csv.gz")), key=_seed_order
    )
    groups: dict[tuple[str, int, int], list[Trace]] = {}
    for i, path in enumerate(paths):
        trace = load_trace(path)
        experts = trace.num_experts
        ranks = args.ep[i] if args.ep and i < len(args.ep) else RANKS_FOR.get(experts, 8)
        rows = 1 if args.trace else STEPS_FOR[experts]
        groups.setdefault((SEED_SUFFIX.sub("", _stem(path)), ranks, rows), []).append(trace)
    cases = []
    for (stem, ranks, rows), traces in groups.items():
        experts = traces[0].num_experts
        model = TRACE_MODEL_FOR.get(experts) or MODEL_FOR.get(experts, "")
        name = f"trace {stem} {experts}/{ranks}"
        cases.append(Case(name, tuple(traces), ranks, model, rows_per_interval=rows))
        if experts == 256:
            slots = ranks // 2
            cases.append(Case(f"{name} +{slots} slots", tuple(traces), ranks, model, slots, name,
                              rows))  # fmt: skip
    return cases


def run_case(case: Case, opts: MigrationOptions) -> dict[str, np.ndarray]:
    """Per policy: METRICS averaged over the case's traces; under PER_TRACE, per policy,
    the rows of each trace (traces, METRICS) and under EARLY the mean realized imbalance
    of each trace's intervals 1..EARLY_INTERVALS and of the rest (traces, 2)."""
    rows: dict[str, list[list[float]]] = {p: [] for p in POLICIES}
    early: dict[str, list[list[float]]] = {p: [] for p in POLICIES}
    k = case.rows_per_interval
    for trace in case.traces:
        setup = migrate_setup(
            interval_trace(trace, k), case.ranks, model_name=case.model, cluster_name="frontier",
            redundant_slots=case.redundant_slots,
        )  # fmt: skip
        runs = replay_all(trace, setup.initial_LRS, setup.costs, POLICIES, opts, k)
        for name, run in runs.items():
            rows[name].append([getattr(run, m) for m in METRICS])
            imb_I = run.imbalance_IL[1:].mean(axis=1)
            early[name].append([imb_I[:EARLY_INTERVALS].mean(), imb_I[EARLY_INTERVALS:].mean()])
    out = {name: np.mean(np.array(r), axis=0) for name, r in rows.items()}
    out[PER_TRACE] = {name: np.array(r) for name, r in rows.items()}
    out[EARLY] = {name: np.array(r) for name, r in early.items()}
    return out


PER_TRACE, EARLY = "per trace", "early"  # run_case's extra keys beside the policies
EARLY_INTERVALS = 5  # the recorded runs' first intervals: the router is still settling
FORECASTS = ("kalman", "last", "ema", "mean", "next interval")


def forecast_check(case: Case) -> dict[str, float]:
    """Per forecast: mean realized imbalance of the re-pack of its loads (intervals 1..I-1)."""
    k = case.rows_per_interval
    out: dict[str, list[float]] = {f: [] for f in (*FORECASTS, "steps")}
    for rows in case.traces:
        trace = interval_trace(rows, k)
        setup = migrate_setup(
            trace, case.ranks, model_name=case.model, cluster_name="frontier",
            redundant_slots=case.redundant_slots,
        )  # fmt: skip
        for lj in range(trace.num_layers):
            cap_R = capacity(setup.initial_LRS[lj])
            for t in range(1, trace.num_intervals):
                actual_E = trace.tokens_ILE[t, lj]
                for f in out:
                    if f == "next interval":
                        load_E = actual_E.astype(float)
                    elif f == "steps":
                        if k == 1:
                            continue
                        load_E = forecast_interval(rows.tokens_ILE[: t * k, lj], k)
                    else:
                        opts = ForecastOptions(method=f)
                        load_E = forecast_loads(trace.tokens_ILE[:t, lj], opts)
                    counts_E = replica_counts_for(load_E, case.ranks, int(cap_R.sum()))
                    out[f].append(imbalance(pack(load_E, counts_E, cap_R), actual_E))
    return {f: float(np.mean(v)) if v else float("nan") for f, v in out.items()}


def criteria(case: Case, res, plain) -> list[tuple[str, str, bool]]:
    """(criterion, measured, met) for one case; `plain` = the results without replicas.

    Without replicas: the re-pack and swap criteria; with them: the re-pack's imbalance
    without replicas. Every case: total priced cost below every baseline's.
    """
    imb = {n: res[n][0] for n in POLICIES}
    moved = {n: res[n][2] for n in POLICIES}
    cost = {n: res[n][4] for n in POLICIES}
    if plain is None:
        out = [
            ("imbalance <= re-pack + 0.01", f"{imb['piper'] - imb['repack']:+.4f}",
             imb["piper"] - imb["repack"] <= 0.01),
            ("moved <= 1/4 of re-pack's", f"{moved['piper'] / max(moved['repack'], 1):.3f}",
             moved["piper"] <= 0.25 * moved["repack"]),
            ("imbalance <= swap's", f"{imb['piper'] - imb['swap']:+.4f}",
             imb["piper"] <= imb["swap"]),
            ("moved < swap's", f"{moved['piper']:.1f} vs {moved['swap']:.1f}",
             moved["piper"] < moved["swap"]),
        ]  # fmt: skip
    else:
        out = [
            ("imbalance <= re-pack's without replicas",
             f"{imb['piper']:.4f} vs {plain['repack'][0]:.4f}", imb["piper"] <= plain["repack"][0])
        ]  # fmt: skip
    for base in ("none", "swap", "repack"):
        out.append(
            (f"total cost < {base}'s", f"{cost['piper'] / cost[base]:.4f}x",
             cost["piper"] < cost[base])
        )  # fmt: skip
    return out


def report(case: Case, res, plain) -> list[tuple[str, str, bool]]:
    print(f"\n{case.name}, {len(case.traces)} trace(s), priced as {case.model} on frontier")
    print(f"  {'policy':8s} {'mean imb':>9s} {'p95 imb':>8s} {'moved':>8s} {'transfer s':>11s} "
          f"{'total cost s':>13s}")  # fmt: skip
    for name in POLICIES:
        m = res[name]
        print(f"  {name:8s} {m[0]:9.4f} {m[1]:8.4f} {m[2]:8.1f} {m[3]:11.2f} {m[4]:13.1f}")
    if case.name.startswith("trace"):
        per, early = res[PER_TRACE], res[EARLY]
        print("  mean imbalance per run (seed 0, 1, ...): "
              + "; ".join(f"{n} " + " ".join(f"{v:.4f}" for v in per[n][:, 0]) for n in POLICIES))
        gap = early["piper"] - early["repack"]
        print(f"  piper - repack imbalance, intervals 1-{EARLY_INTERVALS}: "
              + " ".join(f"{v:+.4f}" for v in gap[:, 0])
              + f"; intervals {EARLY_INTERVALS + 1}+: " + " ".join(f"{v:+.4f}" for v in gap[:, 1]))
    rows = criteria(case, res, plain)
    for label, value, ok in rows:
        print(f"  {'pass' if ok else 'FAIL'}  {label:40s} {value}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--intervals", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per interval and layer")
    p.add_argument("--skew", type=float, default=SynthOptions.skew)
    p.add_argument("--drift", type=float, default=SynthOptions.drift)
    p.add_argument("--margin-sigmas", type=float, default=MigrationOptions.margin_sigmas)
    p.add_argument(
        "--trace", action="append", help="trace CSV, one row per interval (repeatable; "
        "default: the recorded profiles/traces/*-bias*.csv.gz, one row per step)",
    )  # fmt: skip
    p.add_argument("--ep", type=int, action="append", help="EP ranks for each --trace")
    p.add_argument("--no-traces", action="store_true", help="synthetic cases only")
    p.add_argument("--no-synthetic", action="store_true", help="recorded traces only")
    p.add_argument("--quick", action="store_true", help="64/8 only, one seed, no traces")
    p.add_argument(
        "--forecast-check", action="store_true",
        help="re-pack each forecast's loads instead (prints only)",
    )  # fmt: skip
    p.add_argument("--results", default="results/migration_quality.md", help="markdown to write")
    p.add_argument("--no-results", action="store_true", help="print only")
    args = p.parse_args()
    if args.quick:
        args.seeds, args.no_traces = 1, True
    if args.forecast_check:
        args.no_results = True
    title = "Expert migration quality: Piper vs greedy swap vs EPLB re-pack"
    with recorded(args.results, title, enabled=not args.no_results):
        run_all(args)


def run_all(args: argparse.Namespace) -> None:
    """Every case side by side, then the criteria as one pass/fail table."""
    start = time.perf_counter()
    opts = MigrationOptions(margin_sigmas=args.margin_sigmas)
    print(f"synthetic traces: {args.layers} layers x {args.intervals} intervals, {args.tokens} "
          f"tokens, skew {args.skew}, drift {args.drift}, seeds 0..{args.seeds - 1}; "
          f"Piper's margin {args.margin_sigmas} counting sigma x sqrt(experts moved), other "
          f"MigrationOptions defaults")  # fmt: skip
    cases = [] if args.no_synthetic else synthetic_cases(args)
    cases += [] if args.no_traces else trace_cases(args)
    if args.forecast_check:
        print("\nre-pack of each forecast's loads: mean realized imbalance")
        names = (*FORECASTS, "steps")
        print(f"| case | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
        for case in cases:
            got = forecast_check(case)
            print(f"| {case.name} | {' | '.join(f'{got[f]:.4f}' for f in names)} |")
        return
    done: dict[str, dict[str, np.ndarray]] = {}
    table = []
    for case in cases:
        done[case.name] = run_case(case, opts)
        rows = report(case, done[case.name], done.get(case.baseline_of))
        table += [(case.name, *row) for row in rows]
    print("\n| case | criterion | measured | result |\n|---|---|---|---|")
    for name, label, value, ok in table:
        print(f"| {name} | {label} | {value} | {'pass' if ok else 'FAIL'} |")
    met = sum(ok for *_, ok in table)
    print(f"\n{met}/{len(table)} criteria met; {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
