"""Render a PlanResult as the files and text of `piper plan`, all in memory (nothing written here).

`render_files(result)` returns {file name: content} for planner.outputs.files.write_files:
plan.json, timings.json, candidates.csv, stages.csv, memory.csv, comm.csv, summary.md and the
plots. Everything but timings.json is a function of the inputs only: floats are printed with a
fixed number of significant digits, rows in a fixed order, so equal inputs give equal bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from planner.calibrate.error_bars import bracket, interval_lines, may_not_fit_note, memory_spread
from planner.numbers import number, percent
from planner.outputs.lines import cluster_label, mfu_text, wrapped
from planner.outputs.tables import (
    CANDIDATE_DIGITS,
    COMM_DIGITS,
    MEMORY_DIGITS,
    STAGE_DIGITS,
    candidates_frame,
    capacity_gib,
    comm_frame,
    memory_frame,
    stages_frame,
    time_spread,
    to_csv,
)
from planner.plan.schema import Intervals
from planner.resources.precision import LOW_PRECISION
from planner.search.baselines import Baseline
from planner.search.evaluator import EstimateView
from planner.search.make_plan import PlanResult
from planner.search.rows import CandidateRow, describe


def candidates_csv(rows: Sequence[CandidateRow], ivs: Intervals | None = None) -> str:
    """candidates.csv: planner.outputs.tables.candidates_frame, floats to fixed digits; the
    tokens/s and step time ends widened by the chosen plan's spread (`ivs`)."""
    return to_csv(candidates_frame(rows, time_spread(ivs)), CANDIDATE_DIGITS)


def stages_csv(result: PlanResult) -> str:
    """stages.csv: planner.outputs.tables.stages_frame."""
    return to_csv(stages_frame(result), STAGE_DIGITS)


def memory_csv(est: EstimateView, ivs: Intervals | None = None) -> str:
    """memory.csv: planner.outputs.tables.memory_frame (stage, component, GiB, and the
    totals' interval ends)."""
    return to_csv(memory_frame(est, ivs), MEMORY_DIGITS)


def comm_csv(est: EstimateView) -> str:
    """comm.csv: planner.outputs.tables.comm_frame."""
    return to_csv(comm_frame(est), COMM_DIGITS)


BASELINE_COLUMNS = ("baseline", "layout", "tokens/s/GPU", "step (s)", "TFLOPS/GPU", "fits",
                    "Piper speedup", "note")  # fmt: skip
FLOPS_NOTE = "model FLOPs in Megatron-Core's convention"  # planner/resources/flops.py


def baseline_rows(result: PlanResult) -> list[list[str]]:
    """One row per baseline (BASELINE_COLUMNS) against the plan's step time."""
    assert result.best is not None and result.best.estimate is not None
    ivs = result.plan.predicted.intervals if result.plan else None
    return _baseline_rows(result.baselines, result.best.estimate.step_time_s, result.gpus, ivs)


def _baseline_rows(
    baselines: Sequence[Baseline], step_s: float, gpus: int, ivs: Intervals | None = None
) -> list[list[str]]:
    """The rows; a baseline that fits at its estimate while a stage's total times the plan's
    memory spread (`ivs`: hi / mid, one profile-wide sd) exceeds the device says so."""
    spread = memory_spread(ivs)
    rows = []
    for b in baselines:
        e = b.estimate
        layout = describe(b.parallel, b.knobs) if b.parallel else "-"
        fits = "yes" if e and e.fits else "no"
        if e and e.fits and any(m * spread > capacity_gib(e) for m in e.memory_gib_per_stage):
            fits = f"at the estimate ({ivs.level:.0%} interval: may not)" if ivs else fits
        speed = b.speedup(step_s)
        rows.append(
            [
                b.title,
                layout,
                number(e.tokens_per_s / gpus, 4) if e else "-",
                number(e.step_time_s, 4) if e else "-",
                number(e.tflops_per_gpu, 4) if e else "-",
                fits,
                f"{speed:.2f}x" if not math.isnan(speed) else "-",
                _note(b, speed),
            ]
        )
    return rows


BASELINE_CONSOLE_COLUMNS = ("baseline", "layout", "tokens/s/GPU", "step (s)", "Piper speedup",
                            "fits; note")  # fmt: skip


def baseline_console_rows(result: PlanResult) -> list[list[str]]:
    """The baselines as `piper plan` prints them (BASELINE_CONSOLE_COLUMNS): summary.md's
    rows without TFLOPS/GPU, the fits verdict and the note in one column, so the table
    fits 100 columns."""
    out = []
    for row in baseline_rows(result):
        title, layout, per_gpu, step, _tflops, fits, speedup, note = row
        out.append([title, layout, per_gpu, step, speedup, "; ".join(x for x in (fits, note) if x)])
    return out


def _note(b: Baseline, speedup: float) -> str:
    """The note column: why the baseline does not fit or what it needed, and when it beats
    Piper's plan (speedup under 1.00x as printed), why."""
    e = b.estimate
    notes = [b.note or (e.reason if e and not e.fits else "")]
    if not math.isnan(speedup) and round(speedup, 2) < 1.0:
        if b.outside_search:
            notes.append("faster: the search excluded " + ", ".join(b.outside_search))
        else:
            notes.append("faster, inside the plan's search space: the search missed it")
    return "; ".join(n for n in notes if n)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_md(result: PlanResult) -> str:
    """The human summary: inputs, chosen layout, prediction, solver, baselines, top candidates."""
    plan, best = result.plan, result.best
    assert plan is not None and best is not None and best.estimate is not None
    est, par = best.estimate, best.parallel
    model, cluster = plan.model.name or "?", cluster_label(plan.cluster.name or "?")
    ivs = plan.predicted.intervals
    baselines = _baseline_rows(result.baselines, est.step_time_s, result.gpus, ivs)
    lines = [
        f"# Piper plan: {model} on {result.gpus} GPUs of {cluster}",
        "",
    ]
    if result.interrupted:
        lines += ["**Interrupted (Ctrl-C): this is the best plan found before the stop.**", ""]
    t = plan.training
    lines += [
        f"Training: sequence {t['seq_len']}, global batch {t['global_batch']} sequences, "
        f"{t['dtype']}, {t['bytes_per_param']} B/param, optimizer sharding "
        f"{'FSDP' if t.get('fsdp') else 'ZeRO (distributed optimizer)' if t['zero'] else 'off'}.",
        "",
        "## Chosen layout",
        "",
        f"`{describe(par, best.knobs)}` (edp={par.edp}); stages: "
        + ", ".join(f"{s.layers[0]}-{s.layers[-1]}" for s in plan.stages)
        + f"; recomputed layers: {sum(len(s.recompute_layers) for s in plan.stages)}.",
        "",
        "## Predicted",
        "",
        _predicted_table(est, result.gpus, plan.predicted.intervals, t["dtype"]),
        "",
        *_source_lines(plan.predicted.intervals),
        *_fits_lines(est, plan.predicted.intervals, "Fits (at the estimate; {}).", ""),
        f"TFLOPS/GPU and MFU: {FLOPS_NOTE}, {number(_gflop_per_token(est, result.gpus), 4)} GFLOP "
        f"per token; {mfu_text(est.tflops_per_gpu, est.mfu, t['dtype'], _peaks(plan))}.",
        "",
        "## Solvers",
        "",
        _solver_lines(plan),
        "",
        "## Baselines (same resource model)",
        "",
        _table(BASELINE_COLUMNS, baselines),
        "",
        "## Top candidates",
        "",
        _top_candidates(result.rows, result.gpus),
        "",
        f"{len(result.rows)} candidates in candidates.csv ("
        + ", ".join(f"{n} {k}" for k, n in _status_counts(result.rows))
        + ").",
        "",
    ]
    return "\n".join(lines)


def _gflop_per_token(est: EstimateView, gpus: int) -> float:
    """Model GFLOP per token behind tflops_per_gpu (TFLOPS/GPU x GPUs / tokens/s)."""
    return est.tflops_per_gpu * 1e3 * gpus / est.tokens_per_s


def _source_lines(ivs: Intervals | None) -> list[str]:
    """summary.md's line under the prediction: where its intervals come from."""
    return [] if ivs is None else [f"Intervals: {ivs.source}.", ""]


def _fits_lines(est: EstimateView, ivs: Intervals | None, form: str, *after: str) -> list[str]:
    """The fits verdict's warning, in `form`, when a stage's memory interval reaches past the
    device memory (error_bars.may_not_fit_note); none otherwise."""
    note = may_not_fit_note(ivs, capacity_gib(est))
    return [form.format(note), *after] if note else []


def _interval_row(est: EstimateView, gpus: int, ivs: Intervals) -> list[str]:
    """The predicted table's interval row: each figure's [lo, hi] (bubble and capacity: -)."""
    worst = max(range(len(est.memory_gib_per_stage)), key=est.memory_gib_per_stage.__getitem__)
    return [
        bracket(ivs.tokens_per_s), bracket(ivs.tokens_per_s, scale=1 / gpus),
        bracket(ivs.step_time_s), bracket(ivs.tflops_per_gpu),
        bracket(ivs.mfu, percent=True), "-", bracket(ivs.memory_gib_per_stage[worst]), "-",
    ]  # fmt: skip


def _predicted_table(
    est: EstimateView, gpus: int, ivs: Intervals | None = None, dtype: str = "bf16"
) -> str:
    """The prediction as a markdown table; its MFU is against the peak of `dtype`."""
    header = (
        "tokens/s",
        "tokens/s/GPU",
        "step time (s)",
        "TFLOPS/GPU",
        f"MFU ({dtype.upper()} peak)" if dtype in LOW_PRECISION else "MFU",
        "bubble",
        "max stage GiB",
        "capacity GiB",
    )
    row = [
        number(est.tokens_per_s, 4),
        number(est.tokens_per_s / gpus, 4),
        number(est.step_time_s, 4),
        number(est.tflops_per_gpu, 4),
        percent(est.mfu),
        percent(est.bubble_fraction),
        number(max(est.memory_gib_per_stage), 4),
        number(capacity_gib(est), 4),
    ]
    rows = [row] if ivs is None else [row, _interval_row(est, gpus, ivs)]
    return _table(header, rows)


def _solver_lines(plan: Any) -> str:
    out = []
    for name, rep in (
        ("stage IP", plan.solver.to_dict()),
        ("expert IP", plan.extra.get("expert_solver", {})),
        ("rank IP", plan.extra.get("rank_solver", {})),
    ):
        if rep:
            out.append(
                f"- {name}: {rep['backend']} {rep['status']}, "
                f"objective {number(rep['objective'], 6)}, bound {number(rep['bound'], 6)}, "
                f"gap {number(rep['gap'], 3)}"
            )
    if plan.extra.get("rank_note"):
        out.append(f"- rank placement: {plan.extra['rank_note']}")
    return "\n".join(out)


def _status_counts(rows: Sequence[CandidateRow]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    return sorted(counts.items())


def _top_candidates(rows: Sequence[CandidateRow], gpus: int, n: int = 10) -> str:
    out = []
    for rank, r in enumerate(rows[:n], start=1):
        e = r.estimate
        out.append(
            [
                rank,
                describe(r.parallel, r.knobs),
                number(e.tokens_per_s / gpus, 4) if e else "-",
                number(e.step_time_s, 4) if e else "-",
                number(e.tflops_per_gpu, 4) if e else "-",
                number(e.memory_gib_per_stage[0], 4) if e else "-",
                r.reason or "-",
            ]
        )
    header = ("rank", "layout", "tokens/s/GPU", "step (s)", "TFLOPS/GPU", "stage-0 GiB", "reason")
    return _table(header, out)


def summary_dict(result: PlanResult) -> dict[str, Any]:
    """Machine-readable summary (`piper plan --json`): plan, baselines, counts; no timings."""
    plan = result.plan
    est = result.best.estimate if result.best else None
    return {
        "ok": plan is not None,
        "interrupted": result.interrupted,
        "message": result.message,
        "parallel": plan.to_dict()["parallel"] if plan else None,
        "knobs": asdict(result.best.knobs) if plan and result.best else None,
        "predicted": plan.to_dict()["predicted"] if plan else None,
        "solver": plan.to_dict()["solver"] if plan else None,
        "baselines": plan.extra.get("baselines", []) if plan else [],
        "pick": plan.extra.get("pick") if plan else None,  # P(best): planner/PLANNING.md
        "published": plan.extra.get("published", []) if plan else [],
        "step_time_s": est.step_time_s if est else None,
        "target": plan.extra.get("target", "piper") if plan else None,
        "headroom_gib_per_stage": [capacity_gib(est) - m for m in est.memory_gib_per_stage]
        if est
        else None,
        "candidates": dict(_status_counts(result.rows)),
        "inputs_sha256": plan.inputs_sha256 if plan else "",
    }


def summary_text(result: PlanResult, out_dir: str, plotted: bool = True) -> str:
    """What `piper plan` prints above its baseline table (baseline_rows): layout, prediction,
    solver, where the files are."""
    plan, best = result.plan, result.best
    assert plan is not None and best is not None and best.estimate is not None
    est = best.estimate
    lines = []
    if result.interrupted:
        lines.append("interrupted: best plan found so far (search stopped by Ctrl-C)")
    t, peaks = plan.training, _peaks(plan)
    lines += [
        f"{number(est.tokens_per_s)} tokens/s ({number(est.tokens_per_s / result.gpus)} per GPU): "
        f"{plan.model.name} on {result.gpus} GPUs of {cluster_label(plan.cluster.name)}, "
        f"{describe(best.parallel, best.knobs)}",
        f"  sequence {t['seq_len']:,} tokens, global batch {t['global_batch']:,} sequences "
        f"({number(t['seq_len'] * t['global_batch'])} tokens per step), {t['dtype']}",
        f"  step {number(est.step_time_s, 4)} s, max stage memory "
        f"{number(max(est.memory_gib_per_stage), 3)} GiB of {number(capacity_gib(est), 3)}",
        f"  headroom per stage (GiB) "
        f"{', '.join(number(capacity_gib(est) - m, 3) for m in est.memory_gib_per_stage)}; "
        f"memory margin {number(plan.training.get('memory_margin_gib', 0.0), 3)} GiB kept free; "
        f"target {plan.extra.get('target', 'piper')}",
        *_fits_lines(est, plan.predicted.intervals, "  fits (at the estimate; {})"),
        f"  {number(est.tflops_per_gpu, 3)} TFLOPS/GPU, "
        f"{mfu_text(est.tflops_per_gpu, est.mfu, t['dtype'], peaks)} ({FLOPS_NOTE}, "
        f"{number(_gflop_per_token(est, result.gpus), 4)} GFLOP/token)",
        *interval_lines(plan.predicted.intervals, result.gpus),
        f"  stage IP {plan.solver.backend} {plan.solver.status} (gap {number(plan.solver.gap, 3)})",
    ]
    plots = ", plots" if plotted else ""
    lines.append(f"  wrote {out_dir}/ (plan.json, candidates.csv, summary.md{plots})")
    return "\n".join(wrapped(lines))


def _peaks(plan: Any) -> Mapping[str, float]:
    """The plan's device peak TFLOPS per dtype ({} for a plan that does not record them)."""
    return plan.cluster.profile.get("device", {}).get("peak_tflops", {})


def timings_json(result: PlanResult) -> str:
    return json.dumps(dict(result.timings), indent=2, sort_keys=True) + "\n"


def render_files(result: PlanResult, plots: bool = True) -> dict[str, str | bytes]:
    """Every output file of `piper plan`, rendered in memory, keyed by file name; without
    the PNG plots when `plots` is False (`--no-plots`: they take most of the rendering)."""
    from planner.outputs.plots import render_plots

    assert result.plan is not None and result.best is not None and result.best.estimate
    est, ivs = result.best.estimate, result.plan.predicted.intervals
    files: dict[str, str | bytes] = {
        "plan.json": result.plan.to_json(),
        "timings.json": timings_json(result),
        "candidates.csv": candidates_csv(result.rows, ivs),
        "stages.csv": stages_csv(result),
        "memory.csv": memory_csv(est, ivs),
        "comm.csv": comm_csv(est),
        "summary.md": summary_md(result),
    }
    if plots:
        files.update(render_plots(result.plan, est))
    return files
