"""The files of `piper size`: sizes.csv (every figure and interval, machine-readable) and
summary.md (the text a person reads, at most 100 columns), from a SizeReport.

    size_csv(report) -> str          summary_text(report) -> str
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

from planner.numbers import number
from planner.plan.schema import Interval
from planner.size.rows import SizeRow, pareto_axis
from planner.size.sweep import SizeReport

CSV_COLUMNS = (
    "cluster",
    "gpus",
    "global_batch",
    "layout",
    "tokens_per_s",
    "tokens_per_s_lo",
    "tokens_per_s_hi",
    "mfu",
    "step_time_s",
    "ideal_days",
    "days",
    "days_lo",
    "days_hi",
    "effective_fraction",
    "interruptions",
    "checkpoint_every_s",
    "checkpoint_every_steps",
    "checkpoint_blocking_s",
    "restart_s",
    "gpu_hours",
    "gpu_hours_lo",
    "gpu_hours_hi",
    "cost_usd",
    "cost_usd_lo",
    "cost_usd_hi",
    "energy_mwh",
    "energy_mwh_lo",
    "energy_mwh_hi",
    "pareto",
    "flags",
    "note",
)


def _g(x: float | None) -> str:
    """A CSV number: 6 significant digits, empty for None, 'inf' for infinity."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    return "inf" if math.isinf(x) else f"{x:.6g}"


def _ends(iv: Interval | None) -> list[str]:
    return [_g(iv.mid), _g(iv.lo), _g(iv.hi)] if iv is not None else ["", "", ""]


def _text(value: str) -> str:
    return '"' + value.replace('"', '""') + '"' if any(c in value for c in ',"\n') else value


def size_csv(report: SizeReport) -> str:
    """sizes.csv: one line per cluster and size, CSV_COLUMNS (empty cells where no plan)."""
    lines = [",".join(CSV_COLUMNS)]
    for r in report.rows:
        gp = r.goodput
        cells = [
            _text(r.cluster),
            str(r.gpus),
            str(r.global_batch),
            _text(r.layout),
            *_ends(r.tokens_per_s),
            _g(r.mfu),
            _g(r.step_time_s),
            _g(r.ideal_days.mid if r.ideal_days else None),
            *_ends(r.days),
            _g(gp.effective_fraction if gp else None),
            _g(gp.interruptions if gp else None),
            _g(gp.interval_s if gp else None),
            str(gp.interval_steps) if gp else "",
            _g(gp.checkpoint_s if gp else None),
            _g(gp.restart_s if gp else None),
            *_ends(r.gpu_hours),
            *_ends(r.cost_usd),
            *_ends(r.energy_mwh),
            "1" if r.pareto else "0",
            " ".join(r.flags),
            _text(r.note),
        ]
        lines.append(",".join(cells))
    return "\n".join(lines) + "\n"


def size_json(report: SizeReport) -> dict:
    """`piper size --json`: every row (intervals as {lo, mid, hi, level}, failures priced) and
    every cluster's note, numbers as floats, infinity as None."""

    def clean(x):
        if isinstance(x, float):
            return None if math.isinf(x) or math.isnan(x) else x
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    return clean(
        {
            "model": report.model,
            "state_bytes": report.state_bytes,
            "rows": [dataclasses.asdict(r) for r in report.rows],
            "clusters": [dataclasses.asdict(c) for c in report.clusters],
        }
    )


def _range(iv: Interval | None, digits: int = 3) -> str:
    if iv is None:
        return "-"
    return f"{number(iv.mid, digits)} [{number(iv.lo, 2)}-{number(iv.hi, 2)}]"


def _mid(iv: Interval | None, scale: float = 1.0) -> str:
    return "-" if iv is None else number(iv.mid * scale, 3)


def _row_line(r: SizeRow) -> str:
    """One table line, at most 100 columns with flags of up to 14 characters."""
    mark = "*" if r.pareto else " "
    mfu = "-" if r.mfu is None else f"{r.mfu:.1%}"
    tps = "-" if r.tokens_per_s is None else number(r.tokens_per_s.mid / 1e6, 3)
    eff = "-" if r.goodput is None else f"{r.goodput.effective_fraction:.1%}"
    return (
        f"{mark}{r.cluster[:9]:<9} {r.gpus:>6} {r.global_batch:>6} {tps:>6} {mfu:>6} "
        f"{_range(r.days):<20} {eff:>6} {_mid(r.gpu_hours, 1e-6):>7} "
        f"{_mid(r.cost_usd, 1e-6):>7} {_mid(r.energy_mwh):>7} {','.join(r.flags)}"
    ).rstrip()


HEADER = (
    " cluster     GPUs  batch Mtok/s    MFU days [80% band]      goodput  GPU-hM     $M"
    "     MWh flags"
)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, 100, break_on_hyphens=False)


def summary_text(report: SizeReport) -> str:
    """summary.md: the question, the table, the deadline's answer, failures, notes."""
    req = report.request
    out = [
        f"# piper size: {report.model}, {number(req.tokens / 1e12, 4)}T tokens",
        "",
        *_wrap(
            f"Sequence {req.seq_len}, global batch {req.global_batch} sequences "
            f"({req.batch_rule} rule), {req.dtype}. Days, GPU-hours (millions), cost (USD "
            "millions) and energy (MWh, GPU board power only) include failures (goodput: the "
            "share of wall time that trains); the band is the tokens/s interval carried through; "
            "sizes.csv has every figure's band."
        ),
        "",
        "```",
        HEADER,
        *(_row_line(r) for r in report.rows),
        "```",
        "",
        *_wrap(
            f"`*` Pareto set of days vs {pareto_axis(report.rows)}. Flags: batch = fewer "
            "sequences than data-parallel ranks at the model parallelism of the smallest size; "
            f"capped = batch rule at its critical batch; mfu = MFU under {req.min_mfu:.0%}; "
            "no-plan = no layout fits (sizes.csv's note says why)."
        ),
        "",
        *_cluster_lines(report),
        "",
        *_failure_lines(report),
    ]
    return "\n".join(out).rstrip() + "\n"


def _cluster_lines(report: SizeReport) -> list[str]:
    req = report.request
    lines = []
    for c in report.clusters:
        price = "-" if c.price_usd is None else f"${c.price_usd:g}/GPU-hour"
        power = "-" if c.power_w is None else f"{c.power_w:g} W/GPU"
        lines += _wrap(
            f"- {c.cluster} (target {c.target}): price {price} ({c.price_source}); "
            f"power {power} ({c.power_source})"
        )
        if req.deadline_s is not None:
            days = req.deadline_s / 86400.0
            meets = (
                "no size meets it"
                if c.meets_deadline is None
                else f"smallest size that meets it: {c.meets_deadline} GPUs"
            )
            surely = (
                "none at the band's upper end"
                if c.meets_deadline_hi is None
                else f"{c.meets_deadline_hi} GPUs at the band's upper end"
            )
            lines += _wrap(f"  deadline {number(days, 3)} days: {meets} at the estimate; {surely}")
    return lines


def _failure_lines(report: SizeReport) -> list[str]:
    f = report.request.failures
    mode = sorted({c.checkpoint_mode for c in report.clusters})
    lines = _wrap(
        f"Failures: {f.per_gpu_hour:.3g} per GPU-hour (Llama 3 405B: 419 in 54 days on 16,384 "
        f"GPUs), relaunch {number(f.restart_s, 3)} s plus the reload; checkpoint "
        f"{number(report.state_bytes / 1e12, 3)} TB (weights + optimizer state) over "
        f"{number(f.storage_gbps, 4)} GB/s, saves {'/'.join(mode)}; the save interval minimising "
        "the loss is sqrt(2 C M) (Young/Daly; piper run --checkpoint-every takes the steps):"
    )
    for r in report.rows:
        gp = r.goodput
        if gp is None:
            continue
        lines.append(
            f"  {r.cluster[:9]} {r.gpus:>6} GPUs: MTBF {number(gp.mtbf_s / 3600, 3)} h, save "
            "blocks "
            f"{number(gp.checkpoint_s, 3)} s every {number(gp.interval_s / 60, 3)} min "
            f"({gp.interval_steps} steps), {number(gp.interruptions, 3)} interruptions"
        )
    return lines
