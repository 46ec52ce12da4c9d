"""What `piper estimate` prints and writes: the breakdown table of one layout's estimate
(`estimate_table`), its files (`estimate_files`: estimate.json, memory.csv, time.csv,
comm.csv) and, for a re-priced plan, the plan's own prediction beside the new one
(`beside_plan`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from planner.numbers import number, percent
from planner.outputs.lines import cluster_label, mfu_text, wrapped


def rounded(obj: object) -> object:
    if isinstance(obj, float):
        return float(f"{obj:.9g}")
    if isinstance(obj, dict):
        return {k: rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [rounded(v) for v in obj]
    return obj


def estimate_files(data: dict) -> dict[str, str]:
    mem = ["stage,component,gib"]
    time = ["stage,component,seconds"]
    for st in data["stages"]:
        mem += [f"{st['stage']},{k},{v:.6f}" for k, v in st["memory_gib"].items()]
        mem.append(f"{st['stage']},total,{st['total_gib']:.6f}")
        time += [f"{st['stage']},{k},{v:.9g}" for k, v in st["time_s"].items()]
        time.append(f"{st['stage']},total,{st['total_s']:.9g}")
    comm = ["name,kind,level,seconds_per_step"]
    for name, s in data["comm_s"].items():
        kind, _, level = name.partition("_")
        comm.append(f"{name},{kind},{level},{s:.9g}")
    return {
        "estimate.json": json.dumps(rounded(data), indent=2, sort_keys=True) + "\n",
        "memory.csv": "\n".join(mem) + "\n",
        "time.csv": "\n".join(time) + "\n",
        "comm.csv": "\n".join(comm) + "\n",
    }


def estimate_table(d: dict, interval_note: str = "") -> str:
    par, tr = d["parallel"], d["training"]
    rc = par["recompute"]
    if par["recompute_modules"]:
        rc += f"({','.join(par['recompute_modules'])})"
    sharding = "fsdp" if tr["fsdp"] else "distributed optimizer" if tr["zero"] else "replicated"
    lines = [
        f"{d['tokens_per_s']:,.0f} tokens/s ({d['tokens_per_s_per_gpu']:,.0f} per GPU), "
        f"step {number(d['step_time_s'])} s, {number(d['tflops_per_gpu'], 3)} TFLOPS/GPU, "
        f"{mfu_text(d['tflops_per_gpu'], d['mfu'], tr['dtype'], d.get('peak_tflops', {}))} "
        f"({d['flops_convention']} FLOP convention)",
        f"{d['model']} on {cluster_label(d['cluster'])}: pp={par['pp']} vp={par['vp']} "
        f"dp={par['dp']} tp={par['tp']} cp={par['cp']} ep={par['ep']} etp={par['etp']} "
        f"edp={par['edp']} micro-batch={par['micro_batch']} "
        f"micro-batches={par['num_microbatches']} recompute={rc} "
        f"({par['world']} GPUs, {d['dispatcher']} all-to-all"
        f"{_dedup_note(d.get('dedup_ratio'))}{', overlapped' if tr['a2a_overlap'] else ''})",
        f"  sequence {tr['seq_len']:,} tokens, global batch {tr['global_batch']:,} sequences",
        f"  {tr['dtype']}, {sharding}, Adam moments {tr['optimizer_dtype']}, "
        f"MTP layers {tr['mtp_layers']}",
        "",
    ]
    stages = d["stages"]
    mem_keys = list(stages[0]["memory_gib"])
    memory = [[len(st["layers"]) for st in stages]]
    memory += [[st["memory_gib"][k] for st in stages] for k in mem_keys]
    memory.append([st["total_gib"] for st in stages])
    lines += _grid("memory per rank (GiB)", ["layers", *mem_keys, "total"], memory, stages)
    time_keys = sorted({k for st in stages for k in st["time_s"]})
    times = [[st["time_s"].get(k, 0.0) * 1e3 for st in stages] for k in time_keys]
    times.append([st["total_s"] * 1e3 for st in stages])
    lines += ["", *_grid("time per micro-batch, forward + backward (ms)", [*time_keys, "total"],
                         times, stages, ".2f")]  # fmt: skip
    hidden_keys = sorted({k for st in stages for k in st["hidden_s"]})
    if hidden_keys:
        hidden = [[st["hidden_s"].get(k, 0.0) * 1e3 for st in stages] for k in hidden_keys]
        lines += ["", *_grid("communication hidden behind compute, per micro-batch (ms)",
                             hidden_keys, hidden, stages, ".2f")]  # fmt: skip
    lines += ["", "communication per step on the bottleneck stage (s)"]
    lines += [f"  {k:<24} {v:>10.4f}" for k, v in d["comm_s"].items()]
    tables = ", ".join(d["used_measured_tables"]) or "none (analytic defaults)"
    extras = "".join(
        f", {label} {d[key]:.4f} s"
        for key, label in (
            ("unpaired_s", "unpaired warm-up"),
            ("fsdp_first_gather_s", "first FSDP gather"),
        )
        if d[key]
    )
    lines += [
        "",
        f"tokens/s         {d['tokens_per_s']:,.0f}  ({d['tokens_per_s_per_gpu']:,.1f} per GPU)",
        f"step time        {d['step_time_s']:.4f} s  (bubble {d['bubble_fraction']:.1%}, "
        f"exposed comm {d['exposed_comm_s']:.4f} s{extras})",
        f"TFLOPS per GPU   {number(d['tflops_per_gpu'], 3)}  (MFU {percent(d['mfu'])}; "
        f"{number(d['flops_per_token'] / 1e9)} GFLOP/token, {d['flops_convention']} convention)",
        f"memory limit     {d['usable_memory_gib']:.1f} GiB per GPU (stage totals include "
        f"the framework overhead)",
        f"fits             {_verdict(d, interval_note)}",
        f"headroom         {_headroom(d)}",
        f"target           {d['target']} (conventions and what it runs: planner/EXPORT.md)",
        f"measured tables  {tables}",
    ]
    return "\n".join(wrapped(lines))


def _verdict(d: dict, interval_note: str = "") -> str:
    """yes / only inside the margin / NO, with the reason; at the estimate only when
    `interval_note` (error_bars.may_not_fit_note) says a stage's memory interval reaches past
    the device memory."""
    margin = f"with the {d['memory_margin_gib']:.1f} GiB memory margin kept free"
    if d["fits"]:
        return f"at the estimate, {margin}; {interval_note}" if interval_note else f"yes, {margin}"
    if d["fits_without_margin"]:
        tail = f"; {interval_note}" if interval_note else ""
        return f"ONLY INSIDE THE MARGIN: {d['reason']}{tail}"
    return "NO: " + d["reason"]


def _headroom(d: dict) -> str:
    """Free device memory per stage (GiB)."""
    return ", ".join(f"stage {st['stage']} {st['headroom_gib']:.1f} GiB" for st in d["stages"])


STAGE_COLUMNS = 7  # stages side by side: 22 + 7 x 11 columns fit LINE_WIDTH


def _grid(
    title: str,
    names: Sequence[str],
    values: Sequence[Sequence[float]],
    stages: Sequence[dict],
    form: str = "",
) -> list[str]:
    """A table with one row per name and one column per stage, STAGE_COLUMNS stages at a
    time (the next stages in a block below); numbers by planner.numbers.number (3
    significant digits) or the format `form`."""
    lines = [title]
    for first in range(0, len(stages), STAGE_COLUMNS):
        cols = range(first, min(first + STAGE_COLUMNS, len(stages)))
        lines.append(f"{'stage':<22}" + "".join(f"{stages[i]['stage']:>11}" for i in cols))
        for name, row in zip(names, values, strict=True):
            cells = (format(row[i], form) if form else number(row[i], 3) for i in cols)
            lines.append(f"  {name[:20]:<20}" + "".join(f"{c:>11}" for c in cells))
    return lines


def _dedup_note(ratio: float | None) -> str:
    return "" if ratio is None else f", {ratio:.2f}x HALO's network bytes"


def beside_plan(d: dict, plan: dict, changed: Sequence[str]) -> list[str]:
    """The plan's own prediction (plan.json's `predicted`) beside the new estimate `d`, for
    the flags in `changed`: tokens/s (and their ratio), step time, TFLOPS/GPU, MFU, the
    largest stage's memory."""
    rows = [
        ("tokens/s", plan["tokens_per_s"], d["tokens_per_s"], number),
        ("step time (s)", plan["step_time_s"], d["step_time_s"], lambda x: number(x, 4)),
        ("TFLOPS/GPU", plan["tflops_per_gpu"], d["tflops_per_gpu"], lambda x: number(x, 3)),
        ("MFU", plan["mfu"], d["mfu"], percent),
        ("max stage GiB", max(plan["memory_gib_per_stage"]),
         max(st["total_gib"] for st in d["stages"]), lambda x: number(x, 3)),
    ]  # fmt: skip
    lines = ["", *wrapped([f"re-priced with {' '.join(changed)}: the plan's prediction beside it"])]
    lines.append(f"  {'':<16}{'plan':>12}{'now':>12}")
    for name, was, now, show in rows:
        ratio = f"  ({now / was:.2f}x)" if name == "tokens/s" and was > 0 else ""
        lines.append(f"  {name:<16}{show(was):>12}{show(now):>12}{ratio}")
    return lines
