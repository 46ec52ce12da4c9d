"""The trainer loop of one rank: optimizer steps through the pipeline, the router-bias
update, expert migration when due, and per-step metrics and expert-load trace rows.

`runtime.launch` builds the parts (groups, stage, dispatcher, byte counter) and hands them to
`Trainer`; `train` runs the steps and returns losses and (rank 0) the files' contents.

Shape letters: L = MoE layers of this stage, E = experts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from planner.migration import MigrationOptions
from planner.migration.policies import HISTORY_INTERVALS
from planner.run.spec import EMPTY, RunSpec
from runtime.checkpoint import Checkpointer, CheckpointOptions
from runtime.data import sample_batch
from runtime.dispatch.local import LocalDispatcher
from runtime.metrics import (
    ByteCounter,
    MetricsLog,
    jsonl_line,
    loss_plot_png,
    peak_memory_bytes,
    rank_record,
    step_line,
    trace_csv,
)
from runtime.migrate import MigrationPolicy, migrate_stage, pack_views, slot_state_views
from runtime.model.hf_weights import load_hf_weights
from runtime.model.transformer import StageModule
from runtime.parallel.expert_tp import apply_expert_tp
from runtime.parallel.fsdp import shard_chunk
from runtime.parallel.mesh import Mesh
from runtime.parallel.pipeline import PipelineRunner, chunks_of, sync_gradients
from runtime.parallel.replicas import install_slots
from runtime.stop_signal import StopSignal

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a rank returns from `train` (rank 0 also holds the files' contents)."""

    losses: list[float | None] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    expert_state: dict = field(default_factory=dict)  # (layer, expert) -> packed tensors
    placements: dict = field(default_factory=dict)  # run layer -> ep_idx per expert
    slots: dict = field(default_factory=dict)  # run layer -> experts of each ep_idx's slots
    checkpoint: Path | None = None  # the newest checkpoint saved (rank 0)


def _source_layer(spec: RunSpec, layer: int) -> int:
    """The plan-model layer of run layer `layer`; an MTP module's (past the run's layers) is
    numbered after the plan's last layer, as in the checkpoint's names."""
    n = len(spec.source_layers)
    return spec.source_layers[layer] if layer < n else spec.source_layers[-1] + 1 + layer - n


def _stage_tokens(module: StageModule, mesh: Mesh) -> torch.Tensor:
    """Tokens per expert of this step [L, E], summed over the stage's ranks; resets."""
    moes = list(module.moe_layers().values())
    if not moes:
        return torch.zeros(0, 0, dtype=torch.long)
    tokens = torch.stack([m.tokens_E.clone() for m in moes])  # on the device (NCCL)
    for m in moes:
        m.tokens_E.zero_()
    if len(mesh.stage_ranks) > 1:
        dist.all_reduce(tokens, group=mesh.stage_group)
    return tokens.cpu()


def update_router_bias(module: StageModule, tokens_LE: torch.Tensor, rate: float) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): raise the selection bias of experts below the
    mean load by `rate`, lower it above. tokens_LE is summed over the stage, so every rank of
    the stage applies the same update."""
    for moe, load_E in zip(module.moe_layers().values(), tokens_LE.float(), strict=True):
        moe.router.bias_E += rate * torch.sign(load_E.mean() - load_E).to(moe.router.bias_E)


MAX_INTERVALS = HISTORY_INTERVALS  # past intervals the migration policy sees (its window)
MAX_ROWS_PER_INTERVAL = 20  # rows of one interval in the policy's history


def rows_per_interval(migrate_every: int) -> int:
    """Rows the policy's history gives one interval of K steps: the largest divisor of K up
    to MAX_ROWS_PER_INTERVAL (K <= 20: one row per step; 100: rows of 5 steps)."""
    k = max(1, migrate_every)
    return max(d for d in range(1, min(k, MAX_ROWS_PER_INTERVAL) + 1) if k % d == 0)


def close_interval(history: list, rows: list, k: int) -> list:
    """Sum the last k steps' tokens [L][E] into rows_per_interval(k) rows of consecutive
    steps, append them to `rows` (kept to the newest MAX_INTERVALS intervals) and return
    them: the history the policy reads (MigrationOptions.rows_per_interval rows per
    interval, oldest first), as `piper migrate --rows-per-interval` replays a run's
    per-step trace."""
    n = rows_per_interval(k)
    window = torch.tensor(history[-k:], dtype=torch.int64)
    rows.extend(window.reshape(n, k // n, *window.shape[1:]).sum(dim=1).numpy())
    del rows[: -MAX_INTERVALS * n]
    return rows


def with_rows(migration: MigrationPolicy, migrate_every: int) -> MigrationPolicy:
    """The policy told how many rows of its history make one interval."""
    if migrate_every <= 0:
        return migration
    rows = rows_per_interval(migrate_every)
    opts = replace(migration.options or MigrationOptions(), rows_per_interval=rows)
    return replace(migration, options=opts)


def _maybe_migrate(
    spec, module, mesh, optimizer, counter, history, rows, step, fail_at, migration
) -> int:
    """Every migrate_every steps: close the interval, ask the policy from the past intervals'
    rows and move; returns expert copies made. `rows` is None on the ranks that do not ask
    the policy (all but the stage leader): they keep no history."""
    moes = module.moe_layers()
    k = spec.migrate_every
    if not moes or k <= 0 or (step + 1) % k or step + 1 >= spec.steps:
        return 0
    fail = step + 1 == fail_at
    past = close_interval(history, rows, k) if rows is not None else []
    return migrate_stage(moes, mesh, migration, past, optimizer, counter, fail)


COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # else fp32


def autocast(device: torch.device, compute_dtype: str):
    """Forward (and the backward it records) in bf16 / fp16 (runtime/RUNTIME.md,
    "Precision"): GEMMs and attention take operands rounded from the fp32 weights, which stay
    the master copy Adam updates (autocast caches the dense layers' casts for the region, the
    experts keep their own, Experts.operands); the residual stream, and so every activation
    sent between ranks, is in the compute dtype from the embedding on
    (runtime.precision.to_compute_dtype); the router, the norms' statistics, softmax
    and the loss compute in fp32; gradients and their reductions stay fp32."""
    dtype = COMPUTE_DTYPES.get(compute_dtype)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _gather(obj, rank: int) -> list | None:
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class Trainer:
    """One rank's training state: the parts `runtime.launch` built, the pipeline, the
    optimizer and the routing history; `hf_weights`: a Hugging Face checkpoint directory whose
    weights the stage starts from (runtime/model/hf_weights.py); `compute_dtype`: fp32, bf16
    or fp16 (RUNTIME.md "Precision")."""

    def __init__(
        self,
        spec: RunSpec,
        mesh: Mesh,
        module: StageModule,
        counter: ByteCounter,
        device: torch.device,
        migration: MigrationPolicy | None = None,
        hf_weights: str | None = None,
        compute_dtype: str = "fp32",
    ) -> None:
        if compute_dtype not in ("fp32", *COMPUTE_DTYPES):
            raise ValueError(f"compute_dtype {compute_dtype!r}: use fp32, bf16 or fp16")
        self.spec, self.mesh, self.module = spec, mesh, module
        self.counter, self.device = counter, device
        self.migration = with_rows(migration or MigrationPolicy(), spec.migrate_every)
        self.rank = mesh.me.physical
        install_slots(module, spec, mesh)  # replicas and free slots, before the optimizer
        if hf_weights:  # into the final slots, before expert TP and FSDP reshape them
            for chunk in chunks_of(module):
                load_hf_weights(chunk, hf_weights, spec.model.family)
        if spec.etp > 1:  # slices of the final slots' experts
            apply_expert_tp(module, mesh, counter)
        if spec.fsdp:  # sharded parameters, before the optimizer holds them
            for chunk in chunks_of(module):
                shard_chunk(chunk, mesh, spec.dp, counter, COMPUTE_DTYPES.get(compute_dtype))
        virtual = [k for k, _ in spec.chunks(mesh.me.stage)]
        self.runner = PipelineRunner(module, mesh, virtual, spec.num_microbatches, counter, device)
        self.optimizer = torch.optim.Adam(module.parameters(), lr=spec.lr)
        moes = list(module.moe_layers().values())
        self.dispatcher = moes[0].dispatcher if moes else LocalDispatcher()
        self.leader = mesh.me.physical == mesh.stage_ranks[0]  # of its stage
        self.history: list = []  # per step of the interval: tokens [L][E] of the MoE layers
        self.rows: list = []  # the leader's past interval rows (close_interval): (L, E) arrays
        self.sample = sample_batch  # batches of a step: a function of (seed, step, dp rank)
        # fp32, or bf16 / fp16: autocast over forward and backward (`autocast`); with FSDP the
        # units all-gather in it, fixed when they were built
        self.compute_dtype = compute_dtype

    def step(self, step: int, fail_migration_at: int = -1) -> tuple[float | None, dict, list]:
        """One optimizer step (+ migration when due); returns (loss, record, trace rows)."""
        spec, mesh = self.spec, self.mesh
        start = time.perf_counter()
        self.dispatcher.stats.reset()
        self.counter.reset()
        self.optimizer.zero_grad(set_to_none=False)
        batch = spec.micro_batch * spec.num_microbatches
        x, y = self.sample(step, mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
        with autocast(self.device, self.compute_dtype):
            loss = self.runner.step(x.to(self.device), y.to(self.device))
        for moe in self.module.moe_layers().values():
            moe.experts.drop_operands()  # the step's bf16 expert weights (Experts.operands)
        sync_gradients(self.module, mesh, spec.dp, self.counter)
        self.optimizer.step()
        tokens_LE = _stage_tokens(self.module, mesh)
        self.history.append(tokens_LE.tolist())
        del self.history[: -max(1, spec.migrate_every)]  # only the migration window is read
        if spec.router_bias_rate > 0:
            update_router_bias(self.module, tokens_LE, spec.router_bias_rate)
        moved = _maybe_migrate(
            spec,
            self.module,
            mesh,
            self.optimizer,
            self.counter,
            self.history,
            self.rows if self.leader else None,
            step,
            fail_migration_at,
            self.migration,
        )
        record = rank_record(
            step,
            self.rank,
            mesh.me.stage,
            loss,
            time.perf_counter() - start,
            peak_memory_bytes(self.device),
            self.dispatcher.stats,
            self.counter,
        )
        # a stage's decision is applied by all its ranks; count its moves once (leader)
        record["migrated_experts"] = moved if self.leader else 0
        if loss is not None and self.runner.mtp_losses is not None:
            record["mtp_losses"] = self.runner.mtp_losses  # CE_k per depth; loss: the main CE
        rows = []
        if self.leader:
            src = [_source_layer(spec, i) for i in self.module.moe_layers()]
            interval = step // spec.trace_every
            rows = [
                (interval, src[li], e, int(t))
                for li, row in enumerate(tokens_LE.tolist())
                for e, t in enumerate(row)
            ]
        return loss, record, rows


def train(
    trainer: Trainer,
    fail_migration_at: int = -1,
    plot: bool = False,
    checkpoints: CheckpointOptions | None = None,
    metrics_path: str | Path | None = None,
) -> RunResult:
    """Run spec.steps optimizer steps on this rank (process group already initialized).

    Rank 0 gathers every rank's record each step and logs the step's loss; its result holds
    metrics.jsonl, trace.csv and (with `plot`) loss.png.
    fail_migration_at: inject a failed migration after that step (tests).
    checkpoints: save them (runtime/checkpoint.py) and, with `resume`, start from the newest
    intact one: its steps are not run again, its metrics lines and trace rows are kept.
    metrics_path: rank 0 appends each step's metrics.jsonl line there as it goes.
    A SIGTERM stops every rank after the same step (runtime/stop_signal.py): the save in
    flight is finished and the result holds the steps done.
    """
    spec, rank = trainer.spec, trainer.rank
    saver = Checkpointer(checkpoints, trainer) if checkpoints else None
    start, lines, trace = saver.restore() if saver else (0, [], {})
    stream = MetricsLog(metrics_path, lines) if metrics_path and rank == 0 else None
    stop = StopSignal()
    result = RunResult()
    try:
        for step in range(start, spec.steps):
            loss, record, rows = trainer.step(step, fail_migration_at)
            for interval, layer, expert, tokens in rows:  # summed over trace_every steps
                key = (interval, layer, expert)
                trace[key] = trace.get(key, 0) + tokens
            result.losses.append(loss)
            _record(trainer, record, lines)
            if stream is not None:
                stream.append(lines[-1])
            if saver:
                saver.after_step(step, lines, trace)
            if stop.agreed():
                if rank == 0:
                    log.warning("stopped by SIGTERM after step %d", step)
                break
        if saver:
            result.checkpoint = saver.close()
    finally:
        stop.close()
        if stream is not None:
            stream.close()
    _finish(trainer, result, lines, trace, plot)
    return result


def _record(trainer: Trainer, record: dict, lines: list) -> None:
    """Gather every rank's record of the step; rank 0 appends the metrics line and logs it."""
    records = _gather(record, trainer.rank)
    if trainer.rank != 0:
        return
    moved_total = sum(r.pop("migrated_experts") for r in records)
    lines.append(step_line(records, trainer.spec.tokens_per_step, moved_total))
    mtp = [r["mtp_losses"] for r in records if "mtp_losses" in r]
    if mtp:  # beside the main loss: each depth's mean over the last stage's ranks
        lines[-1]["mtp_losses"] = [sum(d) / len(d) for d in zip(*mtp, strict=True)]
    log.warning(
        "step %d loss %.4f step_time %.3fs", lines[-1]["step"], lines[-1]["loss"],
        lines[-1]["step_time_s"],
    )  # fmt: skip


def _finish(trainer: Trainer, result: RunResult, lines: list, trace: dict, plot: bool) -> None:
    """Rank 0's files; every rank's expert state, placements and slot tables."""
    spec, rank = trainer.spec, trainer.rank
    all_rows = _gather([(*k, v) for k, v in trace.items()], rank)
    if rank == 0:
        summed: dict = {}  # a resumed run's restored rows may share an interval with new ones
        for *key, tokens in (r for rows in all_rows for r in rows):
            summed[tuple(key)] = summed.get(tuple(key), 0) + tokens
        result.files = {
            "metrics.jsonl": "".join(jsonl_line(d) for d in lines),
            "trace.csv": trace_csv([(*k, v) for k, v in summed.items()]),
        }
        png = loss_plot_png(lines) if plot and lines else None
        if png is not None:
            result.files["loss.png"] = png
    mesh, module = trainer.mesh, trainer.module
    if not spec.fsdp:  # FSDP holds shards of the experts, not whole ones
        result.expert_state = _expert_state(module, trainer.optimizer, mesh)
    result.placements = {
        layer: [mesh.ep_idx_of_group_rank(r) for r in m.rank_of_expert_E]
        for layer, m in module.moe_layers().items()
    }
    to_plan = [mesh.ep_group_rank(i) for i in range(len(mesh.ep_ranks))]
    result.slots = {
        layer: [list(row) for row in m.slots.reorder(to_plan).slots_RS]
        for layer, m in module.moe_layers().items()
    }


def _expert_state(module: StageModule, optimizer, mesh: Mesh) -> dict:
    """(run layer, expert) -> flat weights + Adam moments of the experts this rank holds."""
    out = {}
    for layer, moe in module.moe_layers().items():
        for slot, e in enumerate(moe.experts.expert_ids):
            if e == EMPTY:
                continue
            pieces = slot_state_views(moe, optimizer, slot)
            out[(layer, e, mesh.me.edp_idx)] = pack_views(pieces).clone()
    return out
