"""Held-out published MoE runs through the committed presets: an independent check, no fitting.

Reads profiles/runs/holdout_runs.csv (published Megatron-Bridge runs on DGX-H100 and DGX-GB200
that are not rows of profiles/runs/published_runs.csv, the file the presets were fitted on;
sources and settings in profiles/runs/README.md). Each row becomes its exact layout
(planner/calibrate/runs.py) and goes through `planner.calibrate.runs.estimate_run` on the h100
or gb200-nvl72 preset as committed; nothing is fitted or tuned here.

Printed:
- per row: container, measured and predicted tokens/s/GPU (or TFLOPS/GPU where the row gives
  only that), predicted / measured, whether it fits, predicted peak GiB and the device's GiB,
  the layout, and "repeat of id N" where the row has calibration row N's layout (model,
  hardware, GPUs, precision, sequence, batch, parallel sizes) in another release;
- out-of-sample: geomean of predicted / measured, the share of rows within +-15%, the worst
  row (largest |ratio - 1|) over the rows that repeat no calibration layout, per hardware and
  per precision; the repeats counted apart, then all rows together;
- Spearman rank correlation of predicted vs measured per (model, hardware, GPUs) group of at
  least 3 rows;
- the same-stack groups (one model, hardware, GPU count and container release, two or more
  layouts): the layout-ranking test proper, with its Spearman;
- per layout measured under several releases: the spread of its measurements (max / min), the
  part of a cross-release group's ordering that no layout model can price.

    OMP_NUM_THREADS=1 python3 benchmarks/holdout_runs.py [--no-results]
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import dataclass

from out_of_sample import repeats_of
from published_runs import spearman
from results_md import ROOT, recorded

from planner.calibrate.fit import WITHIN
from planner.calibrate.runs import Run, estimate_run, load_runs, predicted_value
from planner.inputs.clusters import load_cluster

RUNS = ROOT / "profiles" / "runs" / "holdout_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
MIN_GROUP = 3  # rows a (model, hardware, GPUs) group needs for a Spearman figure

# Issue 25's target for these rows: geomean predicted / measured in TARGET_GEOMEAN and at least
# TARGET_SHARE of the rows within +-TARGET_WITHIN.
TARGET_GEOMEAN = (0.85, 1.15)
TARGET_WITHIN = 0.20
TARGET_SHARE = 0.60


@dataclass(frozen=True)
class Point:
    """One row's prediction beside its measurement, with what the summary groups it by."""

    label: str
    model: str
    hardware: str
    gpus: int
    precision: str
    predicted: float
    measured: float
    release: str = "-"
    layout: str = ""

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


@dataclass(frozen=True)
class Stats:
    """Errors of a set of points: count, geomean of predicted / measured, the share within
    +-WITHIN and within +-TARGET_WITHIN, and the worst point (largest |ratio - 1|) with its
    ratio."""

    n: int
    geomean: float
    within: float
    within_target: float
    worst: str
    worst_ratio: float


def stats(points: list[Point]) -> Stats:
    """Stats of `points` (at least one)."""
    ratios = [p.ratio for p in points]
    worst = max(points, key=lambda p: abs(p.ratio - 1))
    return Stats(
        n=len(points),
        geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)),
        within=sum(abs(r - 1) <= WITHIN for r in ratios) / len(ratios),
        within_target=sum(abs(r - 1) <= TARGET_WITHIN for r in ratios) / len(ratios),
        worst=worst.label,
        worst_ratio=worst.ratio,
    )


def summary(points: list[Point]) -> dict[str, Stats]:
    """Stats over all points ("all"), then per hardware and per precision, keyed by name."""
    out = {"all": stats(points)}
    for key in ("hardware", "precision"):
        for value in sorted({getattr(p, key) for p in points}):
            out[value] = stats([p for p in points if getattr(p, key) == value])
    return out


def group_spearman(
    points: list[Point], min_rows: int = MIN_GROUP
) -> list[tuple[tuple[str, str, int], list[str], float]]:
    """Spearman of predicted vs measured per (model, hardware, GPUs) group with at least
    `min_rows` points, in first-seen order: (group, labels, rho); rho is nan when every
    prediction (or measurement) of the group ties."""
    groups: dict[tuple[str, str, int], list[Point]] = {}
    for p in points:
        groups.setdefault((p.model, p.hardware, p.gpus), []).append(p)
    return [
        (key, [p.label for p in members],
         spearman([p.predicted for p in members], [p.measured for p in members]))
        for key, members in groups.items()
        if len(members) >= min_rows
    ]  # fmt: skip


def same_stack_groups(points: list[Point]) -> list[tuple[tuple[str, str, int, str], list[Point]]]:
    """Groups of one (model, hardware, GPUs, release) holding two or more distinct layouts,
    in first-seen order."""
    groups: dict[tuple[str, str, int, str], list[Point]] = {}
    for p in points:
        groups.setdefault((p.model, p.hardware, p.gpus, p.release), []).append(p)
    return [(k, m) for k, m in groups.items() if len({p.layout for p in m}) >= 2]


def release_spread(points: list[Point]) -> list[tuple[tuple[str, str, int], list[Point], float]]:
    """Per (model, hardware, GPUs, layout) measured under two or more releases: its points
    and max / min of their measurements, in first-seen order."""
    groups: dict[tuple[str, str, int, str], list[Point]] = {}
    for p in points:
        groups.setdefault((p.model, p.hardware, p.gpus, p.layout), []).append(p)
    out = []
    for (model, hw, gpus, _), members in groups.items():
        if len({p.release for p in members}) >= 2:
            values = [p.measured for p in members]
            out.append(((model, hw, gpus), members, max(values) / min(values)))
    return out


def container(run: Run) -> str:
    """The container release named in the row's source ("26.04.01"), or "-"."""
    found = re.search(r"\[(\d\d\.\d\d(?:\.\d\d)?)", run.field("source"))
    return found.group(1) if found else "-"


def layout(run: Run) -> str:
    p, t = run.parallel, run.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.selective_modules)})"
    knobs = [run.dispatcher, t.dtype]
    if t.a2a_overlap:
        knobs.append("a2a-ovl")
    if run.cuda_graphs and run.cuda_graphs != "none":
        knobs.append(f"graphs-{run.cuda_graphs}")
    return (f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} dp{p.dp} mbs{p.micro_batch} "
            f"m{p.num_microbatches} {rc} {' '.join(knobs)}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "holdout_runs.md", "Held-out runs", not args.no_results):
        report(load_runs(RUNS))
    return 0


def report(runs: list[Run]) -> None:
    """Print every section of the module docstring."""
    t0 = time.perf_counter()
    presets = {hw: load_cluster(name) for hw, name in CLUSTERS.items()}
    repeats = repeats_of(runs)
    print(f"{len(runs)} held-out runs from {RUNS.relative_to(ROOT)}; presets as committed, "
          + ", ".join(f"{name} ({hw})" for hw, name in CLUSTERS.items()))  # fmt: skip
    print(f"out-of-sample: every row except the {len(repeats)} that repeat a calibration row's "
          "layout in another release (marked 'repeat of id N', counted apart)")  # fmt: skip
    print(f"\n{'id':>4} {'model':<18} {'hw':<5} {'gpus':>4} {'prec':<5} {'release':<8} "
          f"{'metric':<12} {'measured':>9} {'predicted':>9} {'ratio':>6} {'fits':<4} "
          f"{'peak GiB':>8} {'of':>6}  layout")  # fmt: skip
    points = []
    for run in runs:
        est = estimate_run(run, presets[run.hardware])
        predicted = predicted_value(run, est)
        point = Point(run.label.removeprefix("id "), run.field("model"), run.hardware,
                      run.parallel.world, run.field("precision").upper(), predicted,
                      run.measured, container(run), layout(run))  # fmt: skip
        points.append(point)
        print(
            f"{point.label:>4} {point.model:<18} {run.hardware:<5} {point.gpus:>4} "
            f"{point.precision:<5} {container(run):<8} {run.metric:<12} {run.measured:>9.1f} "
            f"{predicted:>9.1f} {point.ratio:>6.2f} {'yes' if est.fits else 'NO':<4} "
            f"{max(est.memory_gib_per_stage):>8.1f} "
            f"{presets[run.hardware].device.memory_gib:>6.1f}  {layout(run)}"
            + (f"  repeat of id {repeats[point.label]}" if point.label in repeats else "")
        )
        if not est.fits:
            print(f"     does not fit: {est.reason}")
    print(f"\nOUT-OF-SAMPLE, predicted / measured (within: share of rows within +-{WITHIN:.0%},"
          f" then +-{TARGET_WITHIN:.0%}; worst: the row furthest from 1)")  # fmt: skip
    table = summary([p for p in points if p.label not in repeats])
    apart = [p for p in points if p.label in repeats]
    extra = [("repeats", stats(apart)), ("with rep", stats(points))] if apart else []
    for name, s in [*table.items(), *extra]:
        print(f"  {name:<8} {s.n:>3} rows  geomean {s.geomean:.3f}  within {s.within:>4.0%} "
              f"{s.within_target:>4.0%}  worst id {s.worst} {s.worst_ratio:.2f}")  # fmt: skip
    print(
        "  (repeats: the rows with a calibration row's layout, not out-of-sample, apart; "
        "with rep: all rows, repeats included; by stack: benchmarks/out_of_sample.py)"
    )
    whole = table["all"]
    lo, hi = TARGET_GEOMEAN
    ok = lo <= whole.geomean <= hi and whole.within_target >= TARGET_SHARE
    print(f"  target, out-of-sample rows: geomean in [{lo}, {hi}] and >= {TARGET_SHARE:.0%} within "
          f"+-{TARGET_WITHIN:.0%}: {whole.geomean:.3f}, {whole.within_target:.0%} "
          f"{'pass' if ok else 'FAIL'}")  # fmt: skip
    print(f"\nSpearman per (model, hardware, GPUs) group of >= {MIN_GROUP} rows "
          "(rows of one layout across releases share a prediction)")  # fmt: skip
    for (model, hw, gpus), labels, rho in group_spearman(points):
        shown = "n/a (predictions tie)" if math.isnan(rho) else f"{rho:+.2f}"
        print(f"  {model:<18} {hw:<5} {gpus:>4}  rows {','.join(labels):<28} {shown}")
    stacks = same_stack_groups(points)
    print("\nsame-stack groups (one model, hardware, GPU count and release; >= 2 layouts): "
          f"{len(stacks) or 'none in this file'}")  # fmt: skip
    for (model, hw, gpus, release), members in stacks:
        rho = spearman([p.predicted for p in members], [p.measured for p in members])
        shown = "n/a (ties)" if math.isnan(rho) else f"{rho:+.2f}"
        print(f"  {model:<18} {hw:<5} {gpus:>4} {release:<8} rows "
              f"{','.join(p.label for p in members):<20} {shown}")  # fmt: skip
    print("\none layout under several releases (one prediction each): measured max / min")
    for (model, hw, gpus), members, spread in release_spread(points):
        releases = ",".join(f"{p.label}:{p.release}" for p in members)
        print(f"  {model:<18} {hw:<5} {gpus:>4}  {spread:5.2f}x  {releases}")
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
