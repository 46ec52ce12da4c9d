"""Out of sample by construction: every public run predicted by a fit that never saw its stack.

Rows: every public run in profiles/runs/ (published_runs.csv, holdout_runs.csv,
other_stacks.csv on the h100 and gb200-nvl72 presets; frontier_paper.csv on frontier). Each row
gets a stack label, hardware x software stack x release, from its `source`: "H100
Megatron-Bridge 25.09" (the container release in the source's brackets), "H100 ModelZoo"
(yanring/Megatron-MoE-ModelZoo), "H100 AutoModel", "H100 torchtitan", "MI250X Piper paper".

Fits: each preset's fitted constants (the `--params` of its `calibration.fitted_by` line) start
from the preset's derived start and are fitted as the committed fit was: h100 and
gb200-nvl72 by planner/calibrate/fit.py's least squares from ClusterSpec's defaults
(benchmarks/published_runs.py's refit), frontier by planner/calibrate/prior.py from the
datasheet values (benchmarks/frontier_runs.py's refit). A fit only ever receives rows of
published_runs.csv (frontier_paper.csv for frontier), the rows the committed fit used.

Printed, out-of-sample first:
- leave-one-stack-out: for each stack with rows on a preset's hardware, the preset refitted on
  the calibration rows of the other stacks (the ids the fit received are printed), then every
  row of the held-out stack predicted; frontier has one stack, so its rows are left out one
  at a time instead (leave-one-run-out);
- leave-one-release-out: the same per Megatron-Bridge container release (on one preset a
  release is one stack, so a row's prediction is the block above's), summed per preset and
  per release over both presets;
- in-sample, after them: each committed preset on the rows it was fitted on.
Each block: geomean predicted / measured, share within +-15% and +-20%, worst row; per preset
and per precision (BF16, FP8, MXFP8). A row whose layout (model, hardware, GPUs, precision,
sequence, batch, parallel sizes) repeats a calibration row's in another release is labelled
"repeat of calibration id N" and counted apart, never as held out.

    OMP_NUM_THREADS=1 python3 benchmarks/out_of_sample.py [--no-results] [--quick]

--quick: the h100 preset only, one stack held out (QUICK_STACK), nothing written.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from results_md import ROOT, recorded

from planner.calibrate.fit import WITHIN, derived, fit
from planner.calibrate.prior import fit_with_prior
from planner.calibrate.runs import Run, estimate_run, load_runs, predicted_value
from planner.inputs.clusters import load_cluster
from planner.specs import ClusterSpec

RUNS = ROOT / "profiles" / "runs"
CALIBRATION = "published_runs.csv"
FILES = (CALIBRATION, "holdout_runs.csv", "other_stacks.csv")
FRONTIER_FILE = "frontier_paper.csv"
PRESETS = {"H100": "h100", "GB200": "gb200-nvl72"}
PRECISIONS = ("BF16", "FP8", "MXFP8")
WITHIN_20 = 0.20
QUICK_STACK = "H100 Megatron-Bridge 26.04.01"
LAYOUT = ("model", "hardware", "gpus", "precision", "seq", "gbs", "mbs", "tp", "pp", "vp", "cp",
          "ep", "etp")  # fmt: skip
STACKS = (("Megatron-MoE-ModelZoo", "ModelZoo"), ("Automodel", "AutoModel"),
          ("torchtitan", "torchtitan"), ("Piper paper", "Piper paper"))  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One public run with its stack label, and the calibration id whose layout it repeats."""

    run: Run
    file: str
    stack: str
    release: str  # the Megatron-Bridge container release, "" for other stacks
    repeat_of: str  # "" unless a non-calibration row repeats a calibration row's layout

    @property
    def id(self) -> str:
        return self.run.field("id")

    @property
    def calibration(self) -> bool:
        return self.file in (CALIBRATION, FRONTIER_FILE)

    @property
    def precision(self) -> str:
        return self.run.field("precision").upper()


@dataclass(frozen=True)
class Prediction:
    row: Row
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.row.run.measured


@dataclass(frozen=True)
class Errors:
    """predicted / measured over rows: geomean, shares within +-15% / +-20%, the worst row."""

    n: int
    geomean: float
    within_15: float
    within_20: float
    worst: str
    worst_ratio: float

    def line(self) -> str:
        return (f"{self.n:>3} rows  geomean {self.geomean:.3f}  within 15% "
                f"{self.within_15:>4.0%}  20% {self.within_20:>4.0%}  worst id {self.worst} "
                f"{self.worst_ratio:.2f}")  # fmt: skip


def errors(preds: Sequence[Prediction]) -> Errors:
    """Errors of `preds` (at least one)."""
    ratios = [p.ratio for p in preds]
    worst = max(preds, key=lambda p: abs(math.log(p.ratio)))
    return Errors(
        n=len(ratios), geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)),
        within_15=sum(abs(r - 1) <= WITHIN for r in ratios) / len(ratios),
        within_20=sum(abs(r - 1) <= WITHIN_20 for r in ratios) / len(ratios),
        worst=worst.row.id, worst_ratio=worst.ratio,
    )  # fmt: skip


def stack_of(run: Run) -> tuple[str, str]:
    """(stack label, Megatron-Bridge release or "") from the row's hardware and source."""
    source = run.field("source")
    if "Megatron-Bridge" in source:
        found = re.search(r"\[(\d\d\.\d\d(?:\.\d\d)?)", source)
        if found is None:
            raise ValueError(f"{run.where}: a Megatron-Bridge source without a [release]")
        return f"{run.hardware} Megatron-Bridge {found.group(1)}", found.group(1)
    for key, name in STACKS:
        if key in source:
            return f"{run.hardware} {name}", ""
    raise ValueError(f"{run.where}: no stack known for source {source[:60]!r}")


def layout_key(run: Run) -> tuple[str, ...]:
    return tuple(run.field(c).strip().lower() for c in LAYOUT)


def repeats_of(runs: Sequence[Run]) -> dict[str, str]:
    """{id: calibration id} for each of `runs` whose layout (LAYOUT) is a calibration row's;
    a calibration row itself is not a repeat."""
    calibration = {layout_key(r): r.field("id") for r in load_runs(RUNS / CALIBRATION)}
    own = set(calibration.values())
    return {r.field("id"): calibration[layout_key(r)] for r in runs
            if layout_key(r) in calibration and r.field("id") not in own}  # fmt: skip


def load_rows(files: Sequence[str] = (*FILES, FRONTIER_FILE)) -> list[Row]:
    """Every row of `files` with its stack and the calibration id whose layout it repeats."""
    rows = []
    for name in files:
        runs = load_runs(RUNS / name)
        repeats = {} if name in (CALIBRATION, FRONTIER_FILE) else repeats_of(runs)
        for run in runs:
            stack, release = stack_of(run)
            rows.append(Row(run, name, stack, release, repeats.get(run.field("id"), "")))
    return rows


def fitted_names(preset: ClusterSpec) -> tuple[str, ...]:
    """The constants the preset's `calibration.fitted_by` line fits (its --params)."""
    line = dict(preset.calibration).get("fitted_by", "")
    found = re.search(r"--params\s+(\S+)", line)
    if found is None:
        raise ValueError(f"{preset.name}: calibration.fitted_by names no --params")
    return tuple(n for n in found.group(1).split(",") if n)


class Refits:
    """Each preset refitted on a set of calibration rows from the committed fit's start
    (module docstring), cached by the ids fitted on (the stack and release blocks share
    their fits)."""

    def __init__(self, presets: dict[str, ClusterSpec]) -> None:
        self.presets = presets
        self.names = {hw: fitted_names(p) for hw, p in presets.items()}
        self.cache: dict[tuple[str, tuple[str, ...]], ClusterSpec] = {}
        self.seconds: list[float] = []

    def start(self, hw: str) -> ClusterSpec:
        if hw == "MI250X":  # the committed fit's start: the datasheet values
            from frontier_runs import JITTER_START_US, datasheet_cluster

            return replace(datasheet_cluster(), network_jitter_us=JITTER_START_US)
        return derived(self.presets[hw], self.names[hw])

    def cluster(self, hw: str, fit_rows: Sequence[Row]) -> ClusterSpec:
        key = (hw, tuple(r.id for r in fit_rows))
        if key not in self.cache:
            t0 = time.perf_counter()
            runs = [r.run for r in fit_rows]
            if hw == "MI250X":
                self.cache[key] = fit_with_prior(runs, self.start(hw), self.names[hw],
                                                 leave_one_out=False).fitted  # fmt: skip
            else:
                self.cache[key] = fit(runs, self.start(hw), self.names[hw],
                                      leave_one_out=False).fitted  # fmt: skip
            self.seconds.append(time.perf_counter() - t0)
        return self.cache[key]


def predict(row: Row, cluster: ClusterSpec) -> Prediction:
    return Prediction(row, predicted_value(row.run, estimate_run(row.run, cluster)))


def leave_group_out(rows: list[Row], refits: Refits, hw: str, group: str, attr: str):
    """The rows on `hw` whose `attr` (stack or release) is `group`, predicted by the preset
    refitted on the calibration rows on `hw` of every other group: (fit ids, predictions)."""
    fit_rows = [r for r in rows if r.calibration and r.run.hardware == hw
                and getattr(r, attr) != group]  # fmt: skip
    cluster = refits.cluster(hw, fit_rows)
    held = [r for r in rows if r.run.hardware == hw and getattr(r, attr) == group]
    return [r.id for r in fit_rows], [predict(r, cluster) for r in held]


def leave_one_run_out(rows: list[Row], refits: Refits, hw: str):
    """One stack only (frontier): each calibration row predicted by a fit on the others."""
    cal = [r for r in rows if r.calibration and r.run.hardware == hw]
    return [predict(r, refits.cluster(hw, [o for o in cal if o is not r])) for r in cal]


def print_rows(preds: Sequence[Prediction], in_sample: bool = False) -> None:
    for p in preds:
        run, tag = p.row.run, _tag(p.row, in_sample)
        print(f"    {p.row.id:>4} {run.field('model'):<18} {p.row.precision:<6} {run.metric:<12} "
              f"{run.measured:>9.1f} {p.predicted:>9.1f} {p.ratio:>6.2f}  {tag}")  # fmt: skip


def _tag(row: Row, in_sample: bool) -> str:
    if in_sample:
        return "in-sample (fitted on)"
    if row.repeat_of:
        return f"repeat of calibration id {row.repeat_of}"
    return "held out (calibration row)" if row.calibration else "held out"


def print_summary(title: str, preds: Sequence[Prediction], by: str = "hardware",
                  kind: str = "held out") -> dict:  # fmt: skip
    """Per preset (or release) and precision: the held-out (`kind`) rows, then the repeats
    apart. Returns {(group, a precision, 'all' or 'repeats'): Errors}."""
    print(f"\n  {title}")
    out = {}
    for group in dict.fromkeys(_group(p, by) for p in preds):
        mine = [p for p in preds if _group(p, by) == group]
        held = [p for p in mine if not p.row.repeat_of]
        repeats = [p for p in mine if p.row.repeat_of]
        for prec in ("all", *PRECISIONS):
            sel = [p for p in held if prec in ("all", p.row.precision)]
            if sel:
                out[(group, prec)] = errors(sel)
                print(f"    {group:<12} {prec:<5} {kind:<9} {out[(group, prec)].line()}")
        if repeats:
            out[(group, "repeats")] = errors(repeats)
            print(f"    {group:<12} {'all':<5} {'repeats':<9} {errors(repeats).line()}  (apart)")
    return out


def _group(p: Prediction, by: str) -> str:
    if by == "release":
        return p.row.release
    return PRESETS.get(p.row.run.hardware, "frontier")


def stack_block(rows: list[Row], refits: Refits, hardware: Sequence[str], only: str = ""):
    """Leave-one-stack-out (module docstring); returns every held-out prediction."""
    print("\nOUT-OF-SAMPLE 1: leave-one-stack-out (each preset refitted without the stack, "
          "then the stack's rows predicted)")  # fmt: skip
    print(f"    {'id':>4} {'model':<18} {'prec':<6} {'metric':<12} {'measured':>9} "
          f"{'predicted':>9} {'ratio':>6}")  # fmt: skip
    preds = []
    for hw in hardware:
        if hw == "MI250X":
            print("  MI250X Piper paper: the only stack on frontier (nothing else to fit on); "
                  "leave-one-run-out: each row predicted by a fit on the other six")  # fmt: skip
            got = leave_one_run_out(rows, refits, hw)
            print_rows(got)
            preds += got
            continue
        for stack in dict.fromkeys(r.stack for r in rows if r.run.hardware == hw):
            if only and stack != only:
                continue
            fit_ids, got = leave_group_out(rows, refits, hw, stack, "stack")
            print(f"  {stack} held out; {PRESETS[hw]} fitted on ids {','.join(fit_ids)}")
            print_rows(got)
            preds += got
    return preds


def release_block(rows: list[Row], refits: Refits, hardware: Sequence[str], only: str = ""):
    """Leave-one-release-out over Megatron-Bridge container releases (module docstring)."""
    print("\nOUT-OF-SAMPLE 2: leave-one-release-out (Megatron-Bridge container releases; each "
          "preset refitted without the release's rows)")  # fmt: skip
    preds = []
    for release in sorted({r.release for r in rows if r.release}):
        if only and release != only:
            continue
        for hw in hardware:
            if any(r.run.hardware == hw and r.release == release for r in rows):
                fit_ids, got = leave_group_out(rows, refits, hw, release, "release")
                print(f"  {release} on {PRESETS[hw]}: fitted on ids {','.join(fit_ids)}; "
                      f"predicted ids {','.join(p.row.id for p in got)}")  # fmt: skip
                preds += got
    return preds


def in_sample(rows: list[Row], presets: dict[str, ClusterSpec], hardware: Sequence[str]):
    print("\nIN-SAMPLE: the committed presets on the rows they were fitted on")
    return [predict(r, presets[r.run.hardware]) for r in rows
            if r.calibration and r.run.hardware in hardware]  # fmt: skip


def report(quick: bool = False) -> None:
    """Print every block of the module docstring, out-of-sample first."""
    t0 = time.perf_counter()
    rows = load_rows(FILES if quick else (*FILES, FRONTIER_FILE))
    hardware = ["H100"] if quick else ["H100", "GB200", "MI250X"]
    presets = {hw: load_cluster(PRESETS.get(hw, "frontier")) for hw in hardware}
    refits = Refits(presets)
    files = ", ".join(sorted({r.file for r in rows}))
    print(f"{len(rows)} public rows from profiles/runs/ ({files}); fitted constants per preset "
          "(calibration.fitted_by --params):")  # fmt: skip
    for hw in hardware:
        print(f"  {presets[hw].name}: {', '.join(refits.names[hw])}")
    print_stacks(rows, hardware)
    only = QUICK_STACK if quick else ""
    stack = stack_block(rows, refits, hardware, only)
    title = "leave-one-stack-out, predicted / measured (repeats of calibration layouts apart)"
    results = {"stack": print_summary(title, stack)}
    release = release_block(rows, refits, hardware, only.rsplit(" ", 1)[-1])
    print_summary("leave-one-release-out per preset", release)
    print_summary("leave-one-release-out per release (both presets)", release, by="release")
    inside = in_sample(rows, presets, hardware)
    print_rows(inside, in_sample=True)
    results["in"] = print_summary("in-sample, predicted / measured (committed presets)", inside,
                                  kind="in-sample")  # fmt: skip
    closing(results, hardware)
    print(f"\n(fits: {len(refits.seconds)}, {sum(refits.seconds):.0f} s, one fit "
          f"{max(refits.seconds, default=0):.1f} s at most; benchmark time "
          f"{time.perf_counter() - t0:.0f} s)")  # fmt: skip


def print_stacks(rows: list[Row], hardware: Sequence[str]) -> None:
    print("\nstacks (calibration ids | other ids; r = repeat of a calibration layout)")
    for stack in dict.fromkeys(r.stack for r in rows if r.run.hardware in hardware):
        mine = [r for r in rows if r.stack == stack]
        cal = ",".join(r.id for r in mine if r.calibration) or "-"
        other = ",".join(r.id + ("r" if r.repeat_of else "") for r in mine if not r.calibration)
        print(f"  {stack:<30} {cal:<16} | {other or '-'}")


def closing(results: dict, hardware: Sequence[str]) -> None:
    """Per preset and precision: leave-one-stack-out first, in-sample after."""
    print("\nsummary per preset and precision: OUT-OF-SAMPLE (leave-one-stack-out; frontier "
          "leave-one-run-out) | in-sample")  # fmt: skip
    for hw in hardware:
        name = PRESETS.get(hw, "frontier")
        for prec in ("all", *PRECISIONS, "repeats"):
            cells = [results[k].get((name, prec)) for k in ("stack", "in")]
            if prec == "repeats" and cells[0]:
                print(f"  {name:<12} repeats of calibration layouts, apart (not held out): "
                      f"{_cell(cells[0])}")  # fmt: skip
            elif any(cells):
                shown = [_cell(c) for c in cells]
                print(f"  {name:<12} {prec:<5} out-of-sample {shown[0]:<32} | in-sample "
                      f"{shown[1]}")  # fmt: skip
    print("  (cells: geomean predicted / measured, share within 15% / 20%, worst row, rows)")


def _cell(e: Errors | None) -> str:
    if e is None:
        return "-"
    return (f"{e.geomean:.3f} {e.within_15:.0%}/{e.within_20:.0%} worst {e.worst} "
            f"{e.worst_ratio:.2f} n {e.n}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    parser.add_argument("--quick", action="store_true",
                        help=f"h100 only, {QUICK_STACK} held out, nothing written")  # fmt: skip
    args = parser.parse_args()
    write = not (args.no_results or args.quick)
    with recorded(ROOT / "results" / "out_of_sample.md", "Out of sample", write):
        report(quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
