"""Render a PlanResult as the files and text of `piper plan`, all in memory (nothing written here).

`render_files(result)` returns {file name: content} for planner.outputs.files.write_files:
plan.json, timings.json, candidates.csv, stages.csv, memory.csv, comm.csv, summary.md and the
plots. Everything but timings.json is a function of the inputs only: floats are printed with a
fixed number of significant digits, rows in a fixed order, so equal inputs give equal bytes.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from typing import Any

from planner.search.baselines import Baseline
from planner.search.evaluator import EstimateView
from planner.search.make_plan import PlanResult
from planner.search.rows import CandidateRow, describe

CANDIDATE_COLUMNS = (
    "rank",
    "pp",
    "dp",
    "tp",
    "ep",
    "edp",
    "micro_batch",
    "num_microbatches",
    "recompute",
    "recompute_modules",
    "vp",
    "cp",
    "etp",
    "sharding",
    "a2a_overlap",
    "dispatcher",
    "step_time_s",
    "tokens_per_s",
    "mfu",
    "tflops_per_gpu",
    "stage0_memory_gib",
    "bound_step_time_s",
    "feasible",
    "status",
    "solver_status",
    "reason",
)


def fmt(x: float | None, digits: int = 6) -> str:
    """A float as text with `digits` significant digits; '' for None or nan."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return f"{x:.{digits}g}"


def _csv(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def candidates_csv(rows: Sequence[CandidateRow]) -> str:
    """One row per candidate, ranked (rows come ranked from the search); feasible is 1 only
    when the candidate is known to fit (a pruned family's unchecked members say 0)."""
    out = []
    for rank, r in enumerate(rows, start=1):
        p, e, k = r.parallel, r.estimate, r.knobs
        out.append(
            [
                rank,
                p.pp,
                p.dp,
                p.tp,
                p.ep,
                p.edp,
                p.micro_batch,
                p.num_microbatches,
                p.recompute,
                " ".join(p.recompute_modules),
                p.vp,
                p.cp,
                p.etp,
                k.sharding,
                int(k.a2a_overlap),
                k.dispatcher,
                fmt(e.step_time_s) if e else "",
                fmt(e.tokens_per_s) if e else "",
                fmt(e.mfu, 4) if e else "",
                fmt(e.tflops_per_gpu, 4) if e else "",
                fmt(e.memory_gib_per_stage[0], 4) if e and e.memory_gib_per_stage else "",
                fmt(r.bound_step_time_s),
                int(bool(r.feasible)),
                r.status,
                r.solver_status,
                r.reason,
            ]
        )
    return _csv(CANDIDATE_COLUMNS, out)


def stages_csv(result: PlanResult) -> str:
    """Per stage: layers, recomputed layers, time per micro-batch (s), memory (GiB)."""
    best, plan = result.best, result.plan
    assert best is not None and best.estimate is not None and plan is not None
    est = best.estimate
    rows = []
    for st in plan.stages:
        s = st.stage
        rows.append(
            [
                s,
                st.layers[0],
                st.layers[-1],
                len(st.layers),
                " ".join(map(str, st.recompute_layers)),
                fmt(est.stage_time_s[s]) if s < len(est.stage_time_s) else "",
                fmt(est.memory_gib_per_stage[s], 5),
                fmt(_capacity(est), 5),
            ]
        )
    header = (
        "stage",
        "first_layer",
        "last_layer",
        "num_layers",
        "recompute_layers",
        "time_per_microbatch_s",
        "memory_gib",
        "capacity_gib",
    )
    return _csv(header, rows)


def memory_csv(est: EstimateView) -> str:
    """Long format: stage, component, GiB; components as the resource model names them."""
    rows = []
    for s, total in enumerate(est.memory_gib_per_stage):
        for name, per_stage in est.memory_gib_SC:
            rows.append([s, name, fmt(per_stage[s], 5)])
        rows.append([s, "total", fmt(total, 5)])
    return _csv(("stage", "component", "gib"), rows)


def comm_csv(est: EstimateView) -> str:
    """Communication time per step by collective and level, with its share of the step."""
    rows = [
        [name, fmt(sec), fmt(sec / est.step_time_s, 4) if est.step_time_s > 0 else ""]
        for name, sec in sorted(est.comm_s)
    ]
    return _csv(("name", "seconds_per_step", "fraction_of_step"), rows)


def _baseline_rows(baselines: Sequence[Baseline], step_s: float) -> list[list[str]]:
    rows = []
    for b in baselines:
        e = b.estimate
        layout = describe(b.parallel, b.knobs) if b.parallel else "-"
        fits = "yes" if e and e.fits else "no"
        speed = b.speedup(step_s)
        rows.append(
            [
                b.title,
                layout,
                fmt(e.step_time_s, 4) if e else "-",
                fmt(e.tflops_per_gpu, 4) if e else "-",
                fits,
                f"{speed:.2f}x" if not math.isnan(speed) else "-",
                b.note or (e.reason if e and not e.fits else ""),
            ]
        )
    return rows


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_md(result: PlanResult) -> str:
    """The human summary: inputs, chosen layout, prediction, solver, baselines, top candidates."""
    plan, best = result.plan, result.best
    assert plan is not None and best is not None and best.estimate is not None
    est, par = best.estimate, best.parallel
    model, cluster = plan.model.name or "?", plan.cluster.name or "?"
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
        _predicted_table(est),
        "",
        "## Solvers",
        "",
        _solver_lines(plan),
        "",
        "## Baselines (same resource model)",
        "",
        _table(
            ("baseline", "layout", "step (s)", "TFLOPS/GPU", "fits", "Piper speedup", "note"),
            _baseline_rows(result.baselines, est.step_time_s),
        ),
        "",
        "## Top candidates",
        "",
        _top_candidates(result.rows),
        "",
        f"{len(result.rows)} candidates in candidates.csv ("
        + ", ".join(f"{n} {k}" for k, n in _status_counts(result.rows))
        + ").",
        "",
    ]
    return "\n".join(lines)


def _predicted_table(est: EstimateView) -> str:
    header = (
        "step time (s)",
        "tokens/s",
        "TFLOPS/GPU",
        "MFU",
        "bubble",
        "max stage GiB",
        "capacity GiB",
    )
    row = [
        fmt(est.step_time_s, 4),
        fmt(est.tokens_per_s, 4),
        fmt(est.tflops_per_gpu, 4),
        f"{100 * est.mfu:.1f}%",
        f"{100 * est.bubble_fraction:.1f}%",
        fmt(max(est.memory_gib_per_stage), 4),
        fmt(_capacity(est), 4),
    ]
    return _table(header, [row])


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
                f"objective {fmt(rep['objective'], 6)}, bound {fmt(rep['bound'], 6)}, "
                f"gap {fmt(rep['gap'], 3)}"
            )
    if plan.extra.get("rank_note"):
        out.append(f"- rank placement: {plan.extra['rank_note']}")
    return "\n".join(out)


def _status_counts(rows: Sequence[CandidateRow]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    return sorted(counts.items())


def _top_candidates(rows: Sequence[CandidateRow], n: int = 10) -> str:
    out = []
    for rank, r in enumerate(rows[:n], start=1):
        e = r.estimate
        out.append(
            [
                rank,
                describe(r.parallel, r.knobs),
                fmt(e.step_time_s, 4) if e else "-",
                fmt(e.tflops_per_gpu, 4) if e else "-",
                fmt(e.memory_gib_per_stage[0], 4) if e else "-",
                r.reason or "-",
            ]
        )
    return _table(("rank", "layout", "step (s)", "TFLOPS/GPU", "stage-0 GiB", "reason"), out)


def summary_dict(result: PlanResult) -> dict[str, Any]:
    """Machine-readable summary (`piper plan --json`): plan, baselines, counts; no timings."""
    plan = result.plan
    est = result.best.estimate if result.best else None
    return {
        "ok": plan is not None,
        "interrupted": result.interrupted,
        "message": result.message,
        "parallel": plan.to_dict()["parallel"] if plan else None,
        "predicted": plan.to_dict()["predicted"] if plan else None,
        "solver": plan.to_dict()["solver"] if plan else None,
        "baselines": plan.extra.get("baselines", []) if plan else [],
        "step_time_s": est.step_time_s if est else None,
        "candidates": dict(_status_counts(result.rows)),
        "inputs_sha256": plan.inputs_sha256 if plan else "",
    }


def summary_text(result: PlanResult, out_dir: str) -> str:
    """What `piper plan` prints: layout, prediction, baselines with speedups, where files are."""
    plan, best = result.plan, result.best
    assert plan is not None and best is not None and best.estimate is not None
    est = best.estimate
    lines = []
    if result.interrupted:
        lines.append("interrupted: best plan found so far (search stopped by Ctrl-C)")
    lines += [
        f"{plan.model.name} on {result.gpus} GPUs of {plan.cluster.name}: "
        f"{describe(best.parallel, best.knobs)}",
        f"  step {est.step_time_s:.4g} s, {est.tokens_per_s:.4g} tokens/s, "
        f"{est.tflops_per_gpu:.4g} TFLOPS/GPU, MFU {100 * est.mfu:.1f}%, "
        f"max stage memory {max(est.memory_gib_per_stage):.1f} GiB of {_capacity(est):.1f}",
        f"  stage IP {plan.solver.backend} {plan.solver.status} (gap {plan.solver.gap:.3g})",
    ]
    for row in _baseline_rows(result.baselines, est.step_time_s):
        if row[2] == "-":
            lines.append(f"  vs {row[0]}: no layout ({row[6]})")
        else:
            note = f" ({row[6]})" if row[6] else ""
            lines.append(f"  vs {row[0]}: {row[1]} -> {row[2]} s, speedup {row[5]}{note}")
    lines.append(f"  wrote {out_dir}/ (plan.json, candidates.csv, summary.md, plots)")
    return "\n".join(lines)


def _capacity(est: EstimateView) -> float:
    """What per-stage totals are held against: device memory if known, else usable memory."""
    return est.usable_memory_gib if math.isnan(est.device_memory_gib) else est.device_memory_gib


def timings_json(result: PlanResult) -> str:
    return json.dumps(dict(result.timings), indent=2, sort_keys=True) + "\n"


def render_files(result: PlanResult) -> dict[str, str | bytes]:
    """Every output file of `piper plan`, rendered in memory, keyed by file name."""
    from planner.outputs import plots

    assert result.plan is not None and result.best is not None and result.best.estimate
    est = result.best.estimate
    files: dict[str, str | bytes] = {
        "plan.json": result.plan.to_json(),
        "timings.json": timings_json(result),
        "candidates.csv": candidates_csv(result.rows),
        "stages.csv": stages_csv(result),
        "memory.csv": memory_csv(est),
        "comm.csv": comm_csv(est),
        "summary.md": summary_md(result),
    }
    files.update(plots.render_plots(result.plan, est))
    return files
