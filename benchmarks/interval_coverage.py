"""Do the 80% error bars hold 80% of runs? Held-out and leave-one-out runs, side by side.

For each preset with held-out rows (h100, gb200-nvl72), the tokens/s interval
(planner/calibrate/uncertainty.py, from what the preset's YAML records) is set around:
- each held-out row of profiles/runs/holdout_runs.csv, priced on the preset as committed
  (benchmarks/holdout_runs.py's rows: never fitted, never used to set sigma);
- each calibration row of profiles/runs/published_runs.csv predicted by the preset's fit
  redone without it (benchmarks/published_runs.py's leave-one-out; sigma is the RMS of these
  residuals, so their coverage is a consistency check, not an out-of-sample one).
A row is inside when its measured figure (tokens/s/GPU, or TFLOPS/GPU where it gives only
that) lies in the interval. The target: held-out coverage between 70% and 90%.

Memory: each row of profiles/runs/memory_runs.csv (benchmarks/memory_margin.py's compared
stage and prediction) inside the per-stage memory interval; the RMS of log(measured /
predicted) over the default set (current engines, no named gap) is what
DEFAULT_MEMORY_LOG_SD records, printed beside it.

    OMP_NUM_THREADS=1 python3 benchmarks/interval_coverage.py [--no-results]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

from memory_margin import RUNS as MEMORY_RUNS
from memory_margin import compared_gib, load_rows
from published_runs import _derived_start
from results_md import ROOT, recorded

from planner.calibrate.fit import fit
from planner.calibrate.runs import Run, estimate_run, load_runs, predicted_value
from planner.calibrate.uncertainty import DEFAULT_MEMORY_LOG_SD, error_model, intervals
from planner.inputs.clusters import load_cluster
from planner.specs import ClusterSpec

HOLDOUT = ROOT / "profiles" / "runs" / "holdout_runs.csv"
PUBLISHED = ROOT / "profiles" / "runs" / "published_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
MEMORY_CLUSTERS = {"H100": "h100", "H200": "h200", "GB200": "gb200-nvl72", "MI250X": "frontier"}
LEVEL = 0.8
TARGET = (0.7, 0.9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "interval_coverage.md", "Interval coverage",
                  not args.no_results):  # fmt: skip
        report()
    return 0


def metric_interval(run: Run, cluster: ClusterSpec, predicted: float | None = None):
    """(lo, hi) of the run's metric at LEVEL around the preset's prediction (or `predicted`,
    a left-out fit's), from the preset's error model."""
    est = estimate_run(run, cluster)
    ivs = intervals(cluster, est, LEVEL)
    iv = ivs.tokens_per_s if run.metric == "tokens/s/GPU" else ivs.tflops_per_gpu
    mid = predicted_value(run, est) if predicted is None else predicted
    return mid, mid * iv.lo / iv.mid, mid * iv.hi / iv.mid


def report() -> None:
    t0 = time.perf_counter()
    held = load_runs(HOLDOUT)
    published = load_runs(PUBLISHED)
    summary = []
    for hw, name in CLUSTERS.items():
        cluster = load_cluster(name)
        model = error_model(cluster)
        print(f"\n{name} ({hw}): {intervals(cluster, estimate_run(held[0], cluster)).source}")
        print(f"  {'set':<9} {'id':>4} {'measured':>10} {'predicted':>10} {'lo':>10} {'hi':>10}"
              f" {'ratio':>6}  inside")  # fmt: skip
        rows = [r for r in published if r.hardware == hw]
        result = fit(rows, *_derived_start(cluster))
        loo = [(r, f.left_out) for r, f in zip(rows, result.runs, strict=True)]
        loo_in = _rows("left out", cluster, loo)
        held_in = _rows("held out", cluster, [(r, None) for r in held if r.hardware == hw])
        rms = math.sqrt(sum(math.log(p / r.measured) ** 2 for r, p in loo) / len(loo))
        summary.append((name, model.time_log_sd, rms, model.runs, loo_in, held_in))
    _memory()
    print(
        f"\n{LEVEL:.0%} intervals: share of rows inside (target for held-out rows: "
        f"{TARGET[0]:.0%}-{TARGET[1]:.0%})"
    )
    print(
        f"  {'preset':<12} {'sd used':>8} {'LOO RMS now':>11} {'runs':>4} "
        f"{'left out (calibration)':>22} {'held out':>16}  target"
    )
    total = [0, 0]
    for name, sd, rms, runs, (a, n), (b, m) in summary:
        ok = TARGET[0] <= b / m <= TARGET[1]
        print(f"  {name:<12} {sd:>8.3f} {rms:>11.3f} {runs:>4} {a:>10}/{n:<3} {a / n:>7.0%} "
              f"{b:>8}/{m:<3} {b / m:>4.0%}  {'pass' if ok else 'FAIL'}")  # fmt: skip
        total[0] += b
        total[1] += m
    share = total[0] / total[1]
    ok = TARGET[0] <= share <= TARGET[1]
    print(
        f"  {'all held out':<12} {'':>8} {'':>11} {'':>4} {'':>22} {total[0]:>8}/{total[1]:<3}"
        f" {share:>4.0%}  {'pass' if ok else 'FAIL'}"
    )
    print(
        "  (sd used: the preset's calibration.loo_rms_log; LOO RMS now: the same leave-one-out "
        "redone on today's resource model)"
    )
    print(
        "  (held out: out-of-sample, holdout_runs.csv on the committed presets, its rows "
        "repeating a calibration layout included; left out: calibration rows, each out of its "
        "own refit, out-of-sample by row)"
    )
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def _rows(label: str, cluster: ClusterSpec, runs: list[tuple[Run, float | None]]):
    """Print each run's interval; (inside, rows)."""
    inside = 0
    for run, left_out in runs:
        mid, lo, hi = metric_interval(run, cluster, left_out)
        ok = lo <= run.measured <= hi
        inside += ok
        rid = run.label.removeprefix("id ")
        print(f"  {label:<9} {rid:>4} {run.measured:>10.1f} {mid:>10.1f} {lo:>10.1f} {hi:>10.1f}"
              f" {mid / run.measured:>6.2f}  {'yes' if ok else 'NO'}")  # fmt: skip
    return inside, len(runs)


def _memory() -> None:
    """Memory rows inside their stage's interval, all rows and the default set."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = load_rows(MEMORY_RUNS, Path(tmp))
    presets = {hw: load_cluster(name) for hw, name in MEMORY_CLUSTERS.items()}
    print(
        f"\nmemory: {len(rows)} rows of {MEMORY_RUNS.relative_to(ROOT)}, compared stage "
        "(benchmarks/memory_margin.py)"
    )
    logs, default, inside = [], [], {"all": [0, 0], "default set": [0, 0]}
    for row, run in rows:
        cluster = presets[row["hardware"]]
        est = estimate_run(run, cluster)
        pred, stage = compared_gib(row, est, cluster.framework_overhead_gib)
        iv = intervals(cluster, est, LEVEL).memory_gib_per_stage[stage]
        lo, hi = pred * iv.lo / iv.mid, pred * iv.hi / iv.mid
        meas = float(row["measured_peak_gib"])
        x = math.log(meas / pred)
        chosen = row["current"] == "1" and not row["gap"]
        logs.append(x)
        if chosen:
            default.append(x)
        for key in ("all", "default set") if chosen else ("all",):
            inside[key][0] += lo <= meas <= hi
            inside[key][1] += 1
    rms = math.sqrt(sum(x * x for x in default) / len(default))
    rms_all = math.sqrt(sum(x * x for x in logs) / len(logs))
    print(
        f"  RMS log(measured / predicted): default set {rms:.3f} ({len(default)} rows; "
        f"DEFAULT_MEMORY_LOG_SD = {DEFAULT_MEMORY_LOG_SD}), all rows {rms_all:.3f}"
    )
    for key, (k, n) in inside.items():
        print(f"  inside the {LEVEL:.0%} memory interval, {key:<11}: {k}/{n} ({k / n:.0%})")


if __name__ == "__main__":
    raise SystemExit(main())
