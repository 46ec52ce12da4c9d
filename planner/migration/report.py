"""Text outputs of `piper migrate`: placements.csv, migrations.csv, summary.md and JSON.

Everything here is deterministic (no wall-clock): solver times go to timings.json and the
printed table only. Shape letters: I intervals, L trace layers, R ranks, S slots.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from planner.migration.inputs import MigrateSetup
from planner.migration.run import PolicyRun
from planner.migration.trace import Trace
from planner.numbers import number

LABELS = {
    "none": "no migration",
    "swap": "greedy swap (paper)",
    "repack": "re-pack (EPLB)",
    "piper": "Piper",
}


def placements_csv(run: PolicyRun, trace: Trace) -> str:
    """`interval,layer,expert,rank`: every replica of every expert, every interval."""
    out = io.StringIO()
    out.write("interval,layer,expert,rank\n")
    for t in range(run.slots_ILRS.shape[0]):
        for lj, layer in enumerate(trace.layer_ids):
            slots_RS = run.slots_ILRS[t, lj]
            r_idx, s_idx = np.nonzero(slots_RS >= 0)
            rows = sorted(zip(slots_RS[r_idx, s_idx].tolist(), r_idx.tolist(), strict=True))
            out.writelines(f"{t},{layer},{e},{r}\n" for e, r in rows)
    return out.getvalue()


def migrations_csv(run: PolicyRun) -> str:
    """`interval,layer,expert,src_rank,dst_rank,bytes,seconds`, one row per expert copy."""
    out = io.StringIO()
    out.write("interval,layer,expert,src_rank,dst_rank,bytes,seconds\n")
    for t, m in run.moves:
        out.write(f"{t},{m.layer},{m.expert},{m.src_rank},{m.dst_rank},{m.bytes},{m.seconds:.9g}\n")
    return out.getvalue()


def policy_metrics(run: PolicyRun, setup: MigrateSetup) -> dict[str, Any]:
    """Deterministic metrics of one policy (no timings)."""
    level_names = setup.costs.level_names
    index = {layer: lj for lj, layer in enumerate(setup.layer_ids)}
    by_level: dict[str, int] = {}
    for _, m in run.moves:
        idx = int(setup.costs.level_LRR[index[m.layer], m.src_rank, m.dst_rank])
        name = level_names[idx] if 0 <= idx < len(level_names) else str(idx)
        by_level[name] = by_level.get(name, 0) + 1
    return {
        "policy": run.name,
        "mean_imbalance": round(run.mean_imbalance, 6),
        "p95_imbalance": round(run.p95_imbalance, 6),
        "experts_moved": run.experts_moved,
        "bytes_moved": run.bytes_moved,
        "transfer_s": round(run.transfer_s, 6),
        "total_cost_s": round(run.total_cost_s, 6),
        "moves_by_level": dict(sorted(by_level.items())),
    }


def _setup_lines(trace: Trace, setup: MigrateSetup, ranks: int) -> list[str]:
    costs = setup.costs
    slots = int(setup.initial_LRS.shape[2])
    return [
        f"- trace: `{trace.source}`: {trace.num_intervals} intervals, {trace.num_layers} MoE "
        f"layers (ids {', '.join(map(str, trace.layer_ids))}), {trace.num_experts} experts",
        f"- expert parallelism: {ranks} ranks x {slots} slots "
        f"({slots - trace.num_experts // ranks} redundant per rank)",
        f"- model `{setup.model.name}`: {int(costs.expert_bytes_L[0]):,} bytes per expert move "
        f"(16 B/param); cluster `{setup.cluster.name}`",
        f"- interval: {setup.steps_per_interval} steps x {setup.tokens_per_rank_step} tokens per "
        f"EP rank; balanced expert compute {float(costs.balanced_s_L[0]):.4g} s per rank "
        f"per interval and layer",
        "- imbalance = max rank load / mean rank load, realized on the interval the placement "
        "was in force (intervals 1..I-1); total cost = hottest-rank expert seconds + transfer "
        "seconds (moves serialized)",
    ]


def summary_md(runs: Mapping[str, PolicyRun], trace: Trace, setup: MigrateSetup, ranks: int) -> str:
    """summary.md: the setup and the policies side by side."""
    lines = ["# Expert migration: policies side by side", "", *_setup_lines(trace, setup, ranks)]
    lines += [
        "",
        "| policy | mean imbalance | p95 imbalance | experts moved | GB moved | transfer s "
        "| total cost s | moves by level |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        m = policy_metrics(run, setup)
        levels = ", ".join(f"{k}: {v}" for k, v in m["moves_by_level"].items()) or "-"
        lines.append(
            f"| {LABELS.get(name, name)} | {m['mean_imbalance']:.4f} | {m['p95_imbalance']:.4f} "
            f"| {m['experts_moved']} | {number(m['bytes_moved'] / 1e9)} | "
            f"{number(m['transfer_s'])} | {number(m['total_cost_s'])} | {levels} |"
        )
    lines += [
        "",
        "Solver milliseconds per layer and interval are wall-clock, so they are in "
        "timings.json and the printed table, not here (this file is byte-identical across runs).",
        "",
    ]
    return "\n".join(lines)


def summary_json(runs: Mapping[str, PolicyRun], setup: MigrateSetup) -> str:
    return json.dumps([policy_metrics(r, setup) for r in runs.values()], indent=2) + "\n"


def timings_json(runs: Mapping[str, PolicyRun], total_s: float) -> str:
    data = {
        "solver_ms_per_layer_median": {n: round(r.solve_ms_per_layer, 3) for n, r in runs.items()},
        "total_wall_s": round(total_s, 3),
    }
    return json.dumps(data, indent=2, sort_keys=True) + "\n"
