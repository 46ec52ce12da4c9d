"""Entry point of one training process: `python -m runtime.launch --plan plan.json ...`.

Started by `piper run` through torchrun (or by torchrun / srun directly on many nodes): reads
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the environment, uses NCCL when CUDA is
available and gloo otherwise, builds the groups, this rank's pipeline stage and dispatcher,
trains `--steps` steps on byte-level stdlib text and (rank 0) writes metrics.jsonl,
trace.csv and run.json into --out.

Shape letters: L = MoE layers of this stage, E = experts, B = sequences, S = sequence length.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime.data import sample_batch
from runtime.dispatch.flat import FlatAllToAll
from runtime.dispatch.halo import Halo
from runtime.dispatch.halo_plan import HaloCost
from runtime.metrics import (
    ByteCounter,
    loss_plot_png,
    peak_memory_bytes,
    rank_record,
    step_line,
    trace_csv,
)
from runtime.migrate import (
    apply_migration,
    decide,
    pack_views,
    resolve_policy,
    slot_state_views,
)
from runtime.model.moe import LocalDispatcher
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh, build_mesh
from runtime.parallel.pipeline import PipelineRunner, sync_gradients
from runtime.parallel.tensor_parallel import TPGroup
from runtime.scale import RunSpec

log = logging.getLogger("runtime.launch")


@dataclass
class RunResult:
    """What a rank returns from `train` (rank 0 also holds the files' contents)."""

    losses: list[float | None] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    expert_state: dict = field(default_factory=dict)  # (layer, expert) -> packed tensors
    placements: dict = field(default_factory=dict)  # run layer -> ep_idx per expert


def make_dispatcher(spec: RunSpec, mesh: Mesh, kind: str | None = None):
    """The EP all-to-all for this rank's stage: HALO, HALO-dedup or flat."""
    kind = kind or spec.dispatcher
    if spec.ep == 1:
        return LocalDispatcher()
    if kind == "flat":
        return FlatAllToAll(mesh.ep_group, spec.ranks_per_node)
    options = {"dedup": kind == "halo-dedup"}
    if spec.halo_direct_below_bytes >= 0:
        options["direct_below_bytes"] = spec.halo_direct_below_bytes
    if spec.halo_cost:  # the plan's cluster: three phases only where they should pay
        options["cost"] = HaloCost(*spec.halo_cost)
    return Halo(mesh.ep_group, spec.ranks_per_node, **options)


def build_stage(spec: RunSpec, mesh: Mesh, device: torch.device, counter=None) -> StageModule:
    """This rank's StageModule with placements translated to EP group ranks; with tp > 1 its
    attention and dense MLPs are sharded over the TP group (TP bytes go to `counter`)."""
    s = mesh.me.stage
    tp = None
    if spec.tp > 1:
        tokens = spec.micro_batch * spec.seq_len
        tp = TPGroup(mesh.tp_group, mesh.tp_ranks, mesh.me.tp_idx, tokens, spec.seq_len, counter)
    tables = {
        layer: tuple(mesh.ep_group_rank(r) for r in table) for layer, table in spec.placements
    }
    module = StageModule(
        spec.model,
        spec.stage_layers[s],
        first=(s == 0),
        last=(s == spec.pp - 1),
        placements=tables,
        ep_rank=mesh.ep_group_rank(mesh.me.ep_idx),
        seed=spec.seed,
        tp=tp,
        recompute={i: spec.recompute for i in spec.recompute_layers},
    )
    dispatcher = make_dispatcher(spec, mesh)
    for moe in module.moe_layers().values():
        moe.dispatcher = dispatcher
    return module.to(device)


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


def _maybe_migrate(spec, module, mesh, optimizer, counter, history, step, fail_at) -> int:
    """Every migrate_every steps: decide from the history and move; returns experts moved."""
    moes = module.moe_layers()
    k = spec.migrate_every
    if not moes or k <= 0 or (step + 1) % k or step + 1 >= spec.steps:
        return 0
    current = [
        tuple(mesh.ep_idx_of_group_rank(r) for r in m.rank_of_expert_E.tolist())
        for m in moes.values()
    ]
    policy = resolve_policy(spec.migrate_policy)
    decision = decide(mesh, policy, current, history[-k:])
    tables = {
        layer: tuple(mesh.ep_group_rank(r) for r in row)
        for layer, row in zip(moes, decision.placement_LE, strict=True)
    }
    if all(tables[layer] == tuple(moes[layer].rank_of_expert_E.tolist()) for layer in moes):
        return 0
    ok = apply_migration(moes, tables, mesh, optimizer, counter, fail=(step + 1 == fail_at))
    return len(decision.moves) if ok else 0


def _gather(obj, rank: int) -> list | None:
    out = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


class Trainer:
    """One rank's training state: groups, stage module, pipeline, optimizer, counters."""

    def __init__(self, spec: RunSpec, rank: int, device: torch.device) -> None:
        self.spec, self.rank, self.device = spec, rank, device
        self.mesh = build_mesh(spec, rank)
        self.counter = ByteCounter([c.node for c in self.mesh.coords], rank)
        self.module = build_stage(spec, self.mesh, device, self.counter)
        self.runner = PipelineRunner(
            self.module,
            self.mesh,
            spec.micro_batch,
            spec.num_microbatches,
            spec.seq_len,
            self.counter,
            device,
        )
        self.optimizer = torch.optim.Adam(self.module.parameters(), lr=spec.lr)
        moes = list(self.module.moe_layers().values())
        self.dispatcher = moes[0].dispatcher if moes else LocalDispatcher()
        self.leader = self.mesh.me.physical == self.mesh.stage_ranks[0]  # of its stage
        self.history: list = []  # per step: tokens [L][E] of this stage's MoE layers

    def step(self, step: int, fail_migration_at: int = -1) -> tuple[float | None, dict, list]:
        """One optimizer step (+ migration when due); returns (loss, record, trace rows)."""
        spec, mesh = self.spec, self.mesh
        start = time.perf_counter()
        self.dispatcher.stats.reset()
        self.counter.reset()
        self.optimizer.zero_grad(set_to_none=False)
        batch = spec.micro_batch * spec.num_microbatches
        x, y = sample_batch(step, mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
        loss = self.runner.step(x.to(self.device), y.to(self.device))
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
            step,
            fail_migration_at,
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
        rows = []
        if self.leader:
            src = [spec.source_layers[i] for i in self.module.moe_layers()]
            interval = step // spec.trace_every
            rows = [
                (interval, src[li], e, int(t))
                for li, row in enumerate(tokens_LE.tolist())
                for e, t in enumerate(row)
            ]
        return loss, record, rows


def train(
    spec: RunSpec,
    rank: int,
    device: torch.device | None = None,
    fail_migration_at: int = -1,
    plot: bool = False,
) -> RunResult:
    """Run spec.steps optimizer steps on this rank (process group already initialized).

    Rank 0 gathers every rank's record each step and prints the step's loss.
    fail_migration_at: inject a failed migration after that step (tests).
    """
    trainer = Trainer(spec, rank, device or torch.device("cpu"))
    result, lines, trace = RunResult(), [], {}
    for step in range(spec.steps):
        loss, record, rows = trainer.step(step, fail_migration_at)
        for interval, layer, expert, tokens in rows:  # summed over trace_every steps
            key = (interval, layer, expert)
            trace[key] = trace.get(key, 0) + tokens
        result.losses.append(loss)
        records = _gather(record, rank)
        if rank == 0:
            moved_total = sum(r.pop("migrated_experts") for r in records)
            lines.append(step_line(records, spec.tokens_per_step, moved_total))
            log.warning(
                "step %d loss %.4f step_time %.3fs",
                step,
                lines[-1]["loss"],
                lines[-1]["step_time_s"],
            )
    all_rows = _gather([(*k, v) for k, v in trace.items()], rank)
    if rank == 0:
        result.files = {
            "metrics.jsonl": "".join(json.dumps(d, sort_keys=True) + "\n" for d in lines),
            "trace.csv": trace_csv([r for rows in all_rows for r in rows]),
        }
        png = loss_plot_png(lines) if plot else None
        if png is not None:
            result.files["loss.png"] = png
    mesh, module = trainer.mesh, trainer.module
    result.expert_state = _expert_state(module, trainer.optimizer, mesh)
    result.placements = {
        layer: [mesh.ep_idx_of_group_rank(r) for r in m.rank_of_expert_E]
        for layer, m in module.moe_layers().items()
    }
    return result


def _expert_state(module: StageModule, optimizer, mesh: Mesh) -> dict:
    """(run layer, expert) -> flat weights + Adam moments of the experts this rank holds."""
    out = {}
    for layer, moe in module.moe_layers().items():
        for slot, e in enumerate(moe.experts.expert_ids):
            pieces = slot_state_views(moe, optimizer, slot)
            out[(layer, e, mesh.me.edp_idx)] = pack_views(pieces).clone()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.launch")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--dispatcher", choices=("halo", "halo-dedup", "flat"), default="halo")
    p.add_argument("--migrate-every", type=int, default=0)
    p.add_argument("--migrate-policy", choices=("planner", "greedy", "rotate"), default="planner")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--trace-every", type=int, default=1)
    p.add_argument("--router-bias-rate", type=float, default=0.0)
    p.add_argument("--halo-direct-below-bytes", type=int, default=-1)
    return p.parse_args(argv)


def spec_from_args(args: argparse.Namespace) -> RunSpec:
    """Load the plan and its model and build the (scaled) RunSpec."""
    from planner.plan import load_plan
    from runtime.scale import run_spec_from_plan

    plan = load_plan(args.plan)
    model = plan.model_spec(args.plan)
    return run_spec_from_plan(
        plan,
        model,
        args.scale,
        args.ranks_per_node,
        steps=args.steps,
        seed=args.seed,
        lr=args.lr,
        dispatcher=args.dispatcher,
        migrate_every=args.migrate_every,
        migrate_policy=args.migrate_policy,
        trace_every=args.trace_every,
        router_bias_rate=args.router_bias_rate,
        halo_direct_below_bytes=args.halo_direct_below_bytes,
    )


def _env_from_slurm() -> None:
    """Under srun without torchrun: take RANK / WORLD_SIZE / LOCAL_RANK from Slurm's env
    (MASTER_ADDR and MASTER_PORT must still be exported by the job script)."""
    for ours, slurm in (
        ("RANK", "SLURM_PROCID"),
        ("WORLD_SIZE", "SLURM_NTASKS"),
        ("LOCAL_RANK", "SLURM_LOCALID"),
    ):
        if ours not in os.environ and slurm in os.environ:
            os.environ[ours] = os.environ[slurm]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _env_from_slurm()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if int(os.environ.get("RANK", "0")) != 0:
        logging.getLogger("runtime.launch").setLevel(logging.ERROR)
    spec = spec_from_args(args)
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    if dist.get_world_size() != spec.world:
        raise SystemExit(f"world size {dist.get_world_size()} != plan's pp*dp*tp = {spec.world}")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    result = train(spec, rank, device, plot=True)
    if rank == 0:
        from planner.outputs.files import write_files

        run_info = {
            "world": spec.world,
            "pp": spec.pp,
            "dp": spec.dp,
            "tp": spec.tp,
            "ep": spec.ep,
            "edp": spec.edp,
            "steps": spec.steps,
            "seq_len": spec.seq_len,
            "micro_batch": spec.micro_batch,
            "num_microbatches": spec.num_microbatches,
            "hidden_size": spec.model.hidden_size,
            "layers": spec.model.num_layers,
            "source_layers": list(spec.source_layers),
            "dispatcher": spec.dispatcher,
            "ranks_per_node": spec.ranks_per_node,
            "backend": dist.get_backend(),
            "seed": spec.seed,
            "migrate_every": spec.migrate_every,
            "trace_every": spec.trace_every,
            "router_bias_rate": spec.router_bias_rate,
            "recompute": spec.recompute,
            "recompute_layers": list(spec.recompute_layers),
        }
        files = dict(result.files)
        files["run.json"] = json.dumps(run_info, indent=2, sort_keys=True) + "\n"
        files["timings.json"] = json.dumps({"wall_s": time.perf_counter() - t0}) + "\n"
        write_files(args.out, files)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
