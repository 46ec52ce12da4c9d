"""Published MoE training runs through the resource model: preset vs fitted, targets, plans.

Reads profiles/runs/published_runs.csv (18 Megatron-Core runs on H100 and GB200, sources in
profiles/runs/README.md). Each row becomes its exact layout (planner/calibrate/runs.py says
how, and which decisions are assumed where a source is silent) and goes through
`planner.resources.cost.estimate` on the h100 or gb200-nvl72 preset as committed. Then,
per hardware, the preset's own fit is redone: the named efficiencies its `calibration`
lists as fitted (planner.specs.EFFICIENCIES; all of them for a preset without one) start
from ClusterSpec's defaults, the model as derived, and are fitted on that hardware's rows
exactly as `piper calibrate --fit` fits them (planner/calibrate/fit.py), with each row's
leave-one-out prediction. The fit's column equals the preset's when the committed constants
are this fit's.

Printed:
- per row: measured, predicted with the preset and its ratio, predicted with the
  in-benchmark fit and its ratio (when the fit's constants differ from the preset's), the
  leave-one-out ratio, whether it fits, peak GiB, device GiB and the headroom, the layout;
- per hardware: every constant, preset vs fitted, and the fit's errors;
- Spearman rank correlation per (model, hardware, GPUs) group;
- the accuracy targets with pass / fail, for the preset and for the fit: in-sample, the rows
  the presets were fitted on (out-of-sample by stack: benchmarks/out_of_sample.py);
- per setting (model, hardware, GPUs, global batch, sequence, precision): the layout
  `piper plan` picks (make_plan, as the CLI calls it with --gpus) and its
  predicted tokens/s/GPU beside the measured-fastest published layout's predicted and
  measured, on the presets and again on the fit (`--no-plans` skips this, the slow part:
  about a minute each);
- for rows of one model and hardware without pipelining at two token counts per
  micro-batch: the measured time per layer and micro-batch split into a fixed and a
  per-token part, beside the preset's host term and time per token.

    OMP_NUM_THREADS=1 python3 benchmarks/published_runs.py [--no-results] [--no-plans]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from results_md import ROOT, recorded

from planner.calibrate.fit import WITHIN, FitResult, derived, fit, fit_error
from planner.calibrate.runs import Run, accounted_split, estimate_run, load_runs, predicted_value
from planner.inputs.clusters import load_cluster
from planner.resources.cost import Estimate
from planner.specs import EFFICIENCIES, ClusterSpec, SpecError, TrainingSpec
from planner.targets import DEFAULT_MEMORY_MARGIN, TARGETS, memory_margin_gib

__all__ = ["accounted_split", "spearman"]

RUNS = ROOT / "profiles" / "runs" / "published_runs.csv"
CLUSTERS = {"H100": "h100", "GB200": "gb200-nvl72"}
RANKED_IDS = ("3", "4", "5", "6", "7")  # Qwen3-235B on 256 H100s, five layouts
LOW_PRECISION = ("fp8", "mxfp8")


@dataclass(frozen=True)
class Row:
    """One published run: its estimate on the preset and on the fit, and the left-out ratio."""

    run: Run
    preset: Estimate
    fitted: Estimate
    left_out: float | None  # predicted / measured, fitted without this row

    @property
    def id(self) -> str:
        return self.run.field("id")

    def ratio(self, which: str) -> float:
        est = self.preset if which == "preset" else self.fitted
        return predicted_value(self.run, est) / self.run.measured


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties); nan for fewer than 2 points."""
    if len(xs) < 2:
        return math.nan

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else math.nan


def _layout(run: Run) -> str:
    p, t = run.parallel, run.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.selective_modules)})"
    knobs = [run.dispatcher, t.dtype, "fsdp" if t.fsdp else "distopt"]
    if t.a2a_overlap:
        knobs.append("a2a-ovl")
    if run.cuda_graphs and run.cuda_graphs != "none":
        knobs.append(f"graphs-{run.cuda_graphs}")
    return (
        f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} etp{p.etp} edp{p.edp} dp{p.dp} "
        f"mbs{p.micro_batch} m{p.num_microbatches} {rc} {' '.join(knobs)}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-results", action="store_true", help="print only")
    parser.add_argument("--no-plans", action="store_true", help="skip the piper plan check")
    args = parser.parse_args()
    with recorded(ROOT / "results" / "published_runs.md", "Published runs", not args.no_results):
        report(load_runs(RUNS), plans=not args.no_plans)
    return 0


def report(runs: list[Run], plans: bool = True) -> None:
    """Print every section of the module docstring."""
    t0 = time.perf_counter()
    presets = {hw: load_cluster(name) for hw, name in CLUSTERS.items()}
    fits = {
        hw: fit([r for r in runs if r.hardware == hw], *_derived_start(presets[hw]))
        for hw in CLUSTERS
        if any(r.hardware == hw for r in runs)
    }
    rows = []
    for run in runs:
        result = fits[run.hardware]
        left = next(f.left_out for f in result.runs if f.run is run)
        rows.append(Row(run, estimate_run(run, presets[run.hardware]),
                        estimate_run(run, result.fitted),
                        None if left is None else left / run.measured))  # fmt: skip
    differs = any(_moved(f) for f in fits.values())
    print(f"{len(runs)} runs from {RUNS.relative_to(ROOT)}; presets "
          + ", ".join(f"{name} ({hw})" for hw, name in CLUSTERS.items()))  # fmt: skip
    _row_table(rows, presets, differs)
    for hw, result in fits.items():
        _constants(hw, result)
    _groups(rows, differs)
    plan_lines = {}
    if plans:
        plan_lines["preset"] = _plans(rows, presets, "preset")
        if differs:
            fitted = {hw: result.fitted for hw, result in fits.items()}
            plan_lines["fit"] = _plans(rows, fitted, "fit")
    _targets(rows, differs, plan_lines)
    _token_scaling(rows, presets)
    print(f"\n(benchmark time {time.perf_counter() - t0:.0f} s)")


def per_layer_microbatch_s(run: Run, step_s: float) -> float:
    """Seconds per layer and micro-batch of a run without pipelining: step / (m x layers)."""
    return step_s / (run.parallel.num_microbatches * run.model.num_layers)


def measured_step_s(run: Run) -> float:
    """The step time a tokens/s/GPU row implies: gbs x seq / (GPUs x tokens/s/GPU)."""
    tokens = run.training.global_batch * run.training.seq_len
    return tokens / (run.parallel.world * run.measured)


def _token_scaling(rows: list[Row], presets: dict[str, ClusterSpec]) -> None:
    """Rows of one model and hardware without pipelining at two token counts per micro-batch:
    the measured time per layer and micro-batch split into a fixed part and a part per token
    (the line through the two rows), beside the model's host term and its time per token."""
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.run.parallel.pp == 1 and row.run.metric == "tokens/s/GPU":
            groups.setdefault((row.run.model.name, row.run.hardware), []).append(row)
    lines = []
    for (name, hw), members in groups.items():
        by_tokens = {micro_batch_tokens(m.run): m for m in members}
        if len(by_tokens) < 2:
            continue
        points = []
        for tokens in sorted(by_tokens)[:2]:
            m = by_tokens[tokens]
            host = presets[hw].layer_overhead_s(m.run.training.cuda_graphs)
            meas = per_layer_microbatch_s(m.run, measured_step_s(m.run))
            priced = per_layer_microbatch_s(m.run, m.preset.step_time_s)
            points.append((tokens, meas))
            lines.append(
                f"  id {m.id:>3} {name:18} {hw:5} {tokens:6d} tokens: measured "
                f"{meas * 1e3:6.2f} ms, model {priced * 1e3:6.2f} ms (host {host * 1e3:.2f} ms "
                f"+ {(priced - host) / tokens * 1e6:.2f} us per token)"
            )
        (t1, m1), (t2, m2) = points
        per_token = (m2 - m1) / (t2 - t1)
        lines.append(
            f"  {name} {hw}: measured = {(m1 - per_token * t1) * 1e3:.2f} ms + "
            f"{per_token * 1e6:.2f} us per token (the line through the two rows)"
        )
    if lines:
        print("\ntime per layer and micro-batch against tokens per micro-batch (pp = 1, "
              "preset): the measured split into fixed and per-token time")  # fmt: skip
        print("\n".join(lines))


def micro_batch_tokens(run: Run) -> int:
    """Tokens in one micro-batch of a data-parallel rank: mbs x seq."""
    return run.parallel.micro_batch * run.training.seq_len


def _derived_start(preset: ClusterSpec) -> tuple[ClusterSpec, tuple[str, ...]]:
    """The preset's own fit, redone: the constants its `calibration` names as fitted, reset
    to ClusterSpec's defaults (the model as derived), and their names; a preset without a
    calibration fits every named efficiency from the defaults."""
    text = dict(preset.calibration).get("params", "")
    names = tuple(n.strip() for n in text.split(",") if n.strip()) or tuple(
        e.name for e in EFFICIENCIES
    )
    return derived(preset, names), names


def _moved(result: FitResult) -> bool:
    """The fit's constants differ from the preset's (at 4 significant digits)."""
    return any(
        f"{getattr(result.start, e.name):.4g}" != f"{getattr(result.fitted, e.name):.4g}"
        for e in EFFICIENCIES
    )


def _row_table(rows: list[Row], presets: dict[str, ClusterSpec], differs: bool) -> None:
    fit_head = f"{'fitted':>9} {'ratio':>6} " if differs else ""
    print(f"\n{'id':>3} {'model':<18} {'hw':<5} {'gpus':>4} {'metric':<12} {'measured':>9} "
          f"{'preset':>9} {'ratio':>6} {fit_head}{'LOO':>5} {'fits':<4} {'peak GiB':>8} "
          f"{'of':>6} {'room':>6}  layout")  # fmt: skip
    for r in rows:
        run, est = r.run, r.preset
        peak = max(est.memory_gib_per_stage)
        device = presets[run.hardware].device.memory_gib
        fitted = (f"{predicted_value(run, r.fitted):>9.1f} {r.ratio('fit'):>6.2f} "
                  if differs else "")  # fmt: skip
        loo = "-" if r.left_out is None else f"{r.left_out:.2f}"
        print(
            f"{r.id:>3} {run.field('model'):<18} {run.hardware:<5} {run.parallel.world:>4} "
            f"{run.metric:<12} {run.measured:>9.1f} {predicted_value(run, est):>9.1f} "
            f"{r.ratio('preset'):>6.2f} {fitted}{loo:>5} {'yes' if est.fits else 'NO':<4} "
            f"{peak:>8.1f} {device:>6.1f} {device - peak:>6.1f}  {_layout(run)}"
        )
    print("(in-sample: the presets were fitted on these rows; LOO, out-of-sample by row: "
          "predicted / measured fitted without the row; TFLOPS rows: Piper's model FLOPs "
          "against the source's own count; room: device GiB - predicted peak)")  # fmt: skip
    for r in rows:
        if not r.preset.fits:
            worst = max(r.preset.stages, key=lambda st: st.total_gib)
            parts = ", ".join(f"{n} {v:.1f}" for n, v in worst.memory_gib if v >= 0.05)
            print(f"row {r.id} does not fit: {r.preset.reason}; GiB by component: {parts}")


def _constants(hw: str, result: FitResult) -> None:
    status = "converged" if result.converged else result.message
    print(f"\n{hw}: constants of {result.start.name}, the fit's start (derived, or carried "
          f"where not fitted) -> fitted on its {len(result.runs)} rows ({status})")  # fmt: skip
    fitted = {e.name for e in result.params}
    for e in EFFICIENCIES:
        before, after = getattr(result.start, e.name), getattr(result.fitted, e.name)
        mark = "fitted" if e.name in fitted else "kept  "
        print(f"  {e.name:<24} {before:>9.4g} -> {after:>9.4g}  {mark}  {e.meaning}")
    for name, err in (("start", result.before), ("fit, in-sample", result.after),
                      ("leave-one-out, out-of-sample by row", result.left_out)):  # fmt: skip
        if err is not None:
            print(f"  {name:<35} geomean {err.geomean:.3f}, {err.within:.0%} within "
                  f"+-{WITHIN:.0%}, worst {err.worst} {err.worst_ratio:.2f}, RMS log "
                  f"{err.rms_log:.3f}")  # fmt: skip


def _groups(rows: list[Row], differs: bool) -> None:
    """Spearman per (model, hardware, GPUs) group: on tokens/s/GPU when every row of the
    group has it, else on TFLOPS/GPU (every row has that)."""
    groups: dict[tuple[str, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.run.field("model"), r.run.hardware, r.run.parallel.world), [])
        groups[(r.run.field("model"), r.run.hardware, r.run.parallel.world)].append(r)
    print("\nrank correlation per group (model, hardware, GPUs): preset" + (", fit" * differs))
    for (model, hw, gpus), members in groups.items():
        ids = ",".join(r.id for r in members)
        if len(members) < 2:
            print(f"  {model:<18} {hw:<5} {gpus:>4}  rows {ids:<18} one row, no ranking")
            continue
        tokens = all(r.run.metric == "tokens/s/GPU" for r in members)
        rhos = [_rank(members, which, tokens) for which in ("preset", "fit")[: 1 + differs]]
        metric = "tokens/s/GPU" if tokens else "TFLOPS/GPU"
        shown = " / ".join(f"{rho:+.2f}" for rho in rhos)
        print(f"  {model:<18} {hw:<5} {gpus:>4}  rows {ids:<18} Spearman {shown} ({metric})")


def _rank(members: list[Row], which: str, tokens: bool) -> float:
    def value(r: Row) -> tuple[float, float]:
        est = r.preset if which == "preset" else r.fitted
        if tokens:
            return est.tokens_per_s / r.run.parallel.world, r.run.measured
        return est.tflops_per_gpu, float(r.run.field("measured_tflops_per_gpu"))

    pairs = [value(r) for r in members]
    return spearman([p for p, _ in pairs], [m for _, m in pairs])


def _targets(rows: list[Row], differs: bool, plan_lines: dict[str, tuple[int, int]]) -> None:
    """Issue 15's targets, pass / fail, for the preset and (when it differs) the fit."""
    whichs = ("preset", "fit")[: 1 + differs]
    results = {w: _target_values(rows, w) for w in whichs}
    bf16 = [r for r in rows if r.run.training.dtype == "bf16"]
    loo = [r.left_out for r in bf16 if r.left_out is not None]
    loo_within = sum(abs(x - 1) <= WITHIN for x in loo) / len(loo) if loo else math.nan
    print(f"\naccuracy targets, IN-SAMPLE: the presets were fitted on these rows "
          f"({len(bf16)} BF16, {len(rows) - len(bf16)} FP8/MXFP8; out-of-sample by stack: "
          f"benchmarks/out_of_sample.py){': preset | fit' if differs else ': preset'}")  # fmt: skip
    names = list(results[whichs[0]])
    for name in names:
        cells = [results[w][name] for w in whichs]
        print(f"  {name:<58} " + " | ".join(f"{text:<16} {_mark(ok)}" for text, ok in cells))
    print(f"  {'out-of-sample by row (LOO): >= 60% of BF16 within +-15%':<58} "
          f"{loo_within:.0%} of {len(loo):<10} {_mark(loo_within >= 0.6)}")  # fmt: skip
    if plan_lines:
        cells = [f"{ok} of {total:<11} {_mark(ok == total)}" for ok, total in plan_lines.values()]
        print(
            f"  {'piper plan >= the best published layout, every setting':<58} " + " | ".join(cells)
        )


def _mark(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _target_values(rows: list[Row], which: str) -> dict[str, tuple[str, bool]]:
    bf16 = [r.ratio(which) for r in rows if r.run.training.dtype == "bf16"]
    low = [r.ratio(which) for r in rows if r.run.training.dtype in LOW_PRECISION]
    g = fit_error([""] * len(bf16), bf16, [1.0] * len(bf16))
    worst = max(abs(x - 1) for x in bf16)
    g_low = math.exp(sum(map(math.log, low)) / len(low)) if low else math.nan
    ranked = [r for r in rows if r.id in RANKED_IDS]
    est = [(r.preset if which == "preset" else r.fitted) for r in ranked]
    predicted = [e.tokens_per_s / r.run.parallel.world for e, r in zip(est, ranked, strict=True)]
    measured = [r.run.measured for r in ranked]
    rho = spearman(predicted, measured)
    first = ranked[max(range(len(ranked)), key=lambda i: predicted[i])]
    fastest = {r.id for r in ranked if r.run.measured == max(measured)}
    fits = sum(e.fits for e in (r.preset if which == "preset" else r.fitted for r in rows))
    return {
        "BF16 geomean predicted / measured in [0.92, 1.08]":
            (f"{g.geomean:.3f}", 0.92 <= g.geomean <= 1.08),
        "BF16 rows within +-15%: >= 75%": (f"{g.within:.0%}", g.within >= 0.75),
        "worst BF16 row within +-35%": (f"{worst:+.0%} off", worst <= 0.35),
        "FP8/MXFP8 geomean in [0.9, 1.1]": (f"{g_low:.3f}", 0.9 <= g_low <= 1.1),
        f"Spearman >= 0.8, ids {RANKED_IDS[0]}-{RANKED_IDS[-1]} (tokens/s/GPU)":
            (f"{rho:+.2f}", rho >= 0.8),
        "first pick there is the measured fastest (ids 4, 5 tie)":
            (f"id {first.id}", first.id in fastest),
        "every published layout predicted to fit": (f"{fits} of {len(rows)}", fits == len(rows)),
    }  # fmt: skip


def _plans(rows: list[Row], clusters: dict[str, ClusterSpec], which: str) -> tuple[int, int]:
    """piper plan per setting on `clusters` (the presets or the fit, `which`) beside the
    measured-fastest published layout predicted on the same; (settings that pass, settings)."""
    from planner.ip.solvers import SolverOptions
    from planner.search.make_plan import make_plan

    settings: dict[tuple, list[Row]] = {}
    for r in rows:
        t = r.run.training
        key = (r.run.field("model"), r.run.hardware, r.run.parallel.world, t.global_batch,
               t.seq_len, t.dtype)  # fmt: skip
        settings.setdefault(key, []).append(r)
    print(f"\npiper plan per setting ({which}; tokens/s/GPU predicted) vs the measured-fastest "
          "published layout")  # fmt: skip
    print(f"  {'setting':<44} {'plan':>8} {'best pub':>8} {'measured':>8}  "
          "plan's layout | best published (id)")  # fmt: skip
    ok = 0
    for (model, hw, gpus, gbs, seq, dtype), members in settings.items():
        best = max(members, key=lambda r: r.run.measured)
        cluster = clusters[hw]
        # what `piper plan --target megatron` plans: its conventions and the default margin
        margin = memory_margin_gib(DEFAULT_MEMORY_MARGIN, cluster.device.memory_gib)
        training = TrainingSpec(seq_len=seq, global_batch=gbs, dtype=dtype,
                                cuda_graphs=best.run.training.cuda_graphs,
                                memory_margin_gib=margin)  # fmt: skip
        where = f"{model} {hw} {gpus} gbs{gbs} seq{seq} {dtype}"
        try:
            result = make_plan(best.run.model, cluster, training, gpus, None,
                               SolverOptions("cpsat", 10.0, 1, 0),
                               target=TARGETS["megatron"])  # fmt: skip
        except SpecError as err:
            print(f"  {where:<44} no plan: {err}")
            continue
        if result.plan is None:
            print(f"  {where:<44} no plan: {result.message}")
            continue
        plan_tps = result.plan.predicted.tokens_per_s / gpus
        est = best.preset if which == "preset" else best.fitted
        best_tps = est.tokens_per_s / best.run.parallel.world
        measured = f"{best.run.measured:8.1f}" if best.run.metric == "tokens/s/GPU" else "       -"
        good = plan_tps >= best_tps * (1 - 1e-9)
        ok += good
        print(f"  {where:<44} {plan_tps:>8.1f} {best_tps:>8.1f} {measured}  {_mark(good)} "
              f"{_plan_layout(result.plan)} | {_layout(best.run)} (id {best.id})")  # fmt: skip
    return ok, len(settings)


def _plan_layout(plan) -> str:
    p, t = plan.parallel, plan.training
    rc = p.recompute if p.recompute != "selective" else f"sel({','.join(p.recompute_modules)})"
    sharding = "fsdp" if t.get("fsdp") else "distopt" if t.get("zero") else "replicated"
    knobs = [str(plan.extra.get("dispatcher", "flat")), sharding]
    if t.get("a2a_overlap"):
        knobs.append("a2a-ovl")
    return (f"tp{p.tp} pp{p.pp} vp{p.vp} cp{p.cp} ep{p.ep} etp{p.etp} dp{p.dp} "
            f"mbs{p.micro_batch} m{p.num_microbatches} {rc} {' '.join(knobs)}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
