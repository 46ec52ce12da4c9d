"""Run metrics: bytes sent by kind and node locality, per-step records, metrics.jsonl, trace.csv.

Every byte a rank sends is counted where it is sent (dispatch/combine by the dispatcher's
stats, pipeline p2p by the counting PipelineStage, gradient reduction and migration here),
split by whether the peer sits on the same (emulated) node.

metrics.jsonl (one object per step, written by rank 0 as the run goes, `MetricsLog`): step,
loss (mean over the last stage's ranks), step_time_s (slowest rank), tokens_per_s (tokens of
the whole step / step_time_s), peak_memory_bytes (largest rank), dispatch_s, combine_s
(slowest rank), bytes_intra_node, bytes_inter_node (summed over all ranks), bytes_by_kind,
migrated_experts, and per_rank: the same quantities for every rank.
trace.csv: `interval,layer,expert,tokens`, interval = step // trace_every, layer = the plan's
layer index, tokens routed to that expert in that interval summed over all data-parallel
ranks of its stage.
Both are read back, and validated, by the planner's readers:
`planner.calibrate.metrics.load_metrics` and `planner.migration.trace.load_trace`.
"""

from __future__ import annotations

import io
import json
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch

from planner.migration.trace import COLUMNS as TRACE_COLUMNS

TRACE_HEADER = ",".join(TRACE_COLUMNS)  # the planner's trace format, read by piper migrate


@dataclass
class ByteCounter:
    """Bytes this rank sent since the last reset, by kind and by peer locality."""

    node_of: list[int]  # physical rank -> node
    me: int
    intra: dict[str, int] = field(default_factory=dict)
    inter: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float, peer: int) -> None:
        """Record nbytes sent to physical rank `peer` under `kind` (p2p, grad, migrate...)."""
        bucket = self.intra if self.node_of[peer] == self.node_of[self.me] else self.inter
        bucket[kind] = bucket.get(kind, 0) + int(nbytes)

    def add_allreduce(self, kind: str, nbytes: int, members: list[int]) -> None:
        """Ring all-reduce model: each rank sends 2 (n - 1) / n * nbytes to its successor."""
        self.add_ring(kind, nbytes, members, passes=2)

    def add_ring(self, kind: str, nbytes: int, members: list[int], passes: int) -> None:
        """Ring model of a collective over an nbytes buffer: each rank sends
        passes * (n - 1) / n * nbytes to its successor (all-reduce 2; reduce-scatter and
        all-gather 1, nbytes being the whole gathered buffer)."""
        n = len(members)
        if n <= 1:
            return
        ring = sorted(members)
        succ = ring[(ring.index(self.me) + 1) % n]
        self.add(kind, passes * (n - 1) * nbytes / n, succ)

    def reset(self) -> None:
        self.intra.clear()
        self.inter.clear()


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated bytes; CPU: the process's peak resident set size (Linux)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def rank_record(
    step: int,
    rank: int,
    stage: int,
    loss: float | None,
    step_time_s: float,
    peak_bytes: int,
    stats,
    counter: ByteCounter,
) -> dict:
    """One rank's numbers for one step (dispatcher stats added to the counter's bytes)."""
    by_kind = {
        "dispatch_intra": int(stats.bytes_intra_node),
        "dispatch_inter": int(stats.bytes_inter_node),
    }
    for k, v in counter.intra.items():
        by_kind[f"{k}_intra"] = v
    for k, v in counter.inter.items():
        by_kind[f"{k}_inter"] = v
    return {
        "step": step,
        "rank": rank,
        "stage": stage,
        "loss": loss,
        "step_time_s": step_time_s,
        "peak_memory_bytes": peak_bytes,
        "dispatch_s": float(stats.dispatch_s),
        "combine_s": float(stats.combine_s),
        "bytes_intra_node": int(stats.bytes_intra_node) + sum(counter.intra.values()),
        "bytes_inter_node": int(stats.bytes_inter_node) + sum(counter.inter.values()),
        "bytes_by_kind": by_kind,
    }


def step_line(records: list[dict], tokens_per_step: int, migrated: int = 0) -> dict:
    """Aggregate every rank's record of one step into a metrics.jsonl object."""
    losses = [r["loss"] for r in records if r["loss"] is not None]
    step_time_s = max(r["step_time_s"] for r in records)
    by_kind: dict[str, int] = {}
    for r in records:
        for k, v in r["bytes_by_kind"].items():
            by_kind[k] = by_kind.get(k, 0) + v
    return {
        "step": records[0]["step"],
        "loss": sum(losses) / len(losses) if losses else None,
        "step_time_s": step_time_s,
        "tokens_per_s": tokens_per_step / step_time_s if step_time_s > 0 else 0.0,
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in records),
        "dispatch_s": max(r["dispatch_s"] for r in records),
        "combine_s": max(r["combine_s"] for r in records),
        "bytes_intra_node": sum(r["bytes_intra_node"] for r in records),
        "bytes_inter_node": sum(r["bytes_inter_node"] for r in records),
        "bytes_by_kind": dict(sorted(by_kind.items())),
        "migrated_experts": migrated,
        "per_rank": [{k: v for k, v in r.items() if k != "step"} for r in records],
    }


def jsonl_line(line: dict) -> str:
    """One metrics.jsonl line (keys sorted, so equal runs give equal bytes)."""
    return json.dumps(line, sort_keys=True) + "\n"


class MetricsLog:
    """metrics.jsonl written as the run goes: the lines a resume carried over first, then
    each step's line appended and flushed, so a run stopped or killed keeps the steps it
    did. The file is replaced at the end by the run's output set (the same lines)."""

    def __init__(self, path: str | Path, lines: list[dict]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - held for the run
        for line in lines:
            self.file.write(jsonl_line(line))
        self.file.flush()

    def append(self, line: dict) -> None:
        self.file.write(jsonl_line(line))
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def trace_csv(rows: list[tuple[int, int, int, int]]) -> str:
    """Render (interval, layer, expert, tokens) rows, sorted, with the trace header."""
    lines = [TRACE_HEADER] + [f"{i},{layer},{e},{t}" for i, layer, e, t in sorted(rows)]
    return "\n".join(lines) + "\n"


def loss_plot_png(lines: list[dict]) -> bytes:
    """loss.png: loss per step and bytes sent per step (intra/inter node). No timestamps in
    the file, so equal runs give equal bytes."""
    import matplotlib  # imported here: only rank 0 draws, once, at the end of the run

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [d["step"] for d in lines]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.2))
    ax1.plot(steps, [d["loss"] for d in lines], marker=".")
    ax1.set(xlabel="step", ylabel="loss (nats per byte)", title="training loss")
    ax2.plot(steps, [d["bytes_intra_node"] / 1e6 for d in lines], label="intra-node")
    ax2.plot(steps, [d["bytes_inter_node"] / 1e6 for d in lines], label="inter-node")
    ax2.set(xlabel="step", ylabel="MB sent (all ranks)", title="bytes per step")
    ax2.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()
