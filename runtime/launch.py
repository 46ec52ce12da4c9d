"""Entry point of one training process: `python -m runtime.launch --plan plan.json ...`.

Started by `piper run` through torchrun (or by torchrun / srun directly on many nodes): reads
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the environment, uses NCCL when CUDA is
available and gloo otherwise, builds the groups, this rank's pipeline stage and dispatcher,
hands them to the trainer loop (`runtime.train`) for `--steps` steps on byte-level stdlib
text and (rank 0) writes metrics.jsonl, trace.csv and run.json into --out.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
import torch.distributed as dist

from runtime.dispatch.factory import make_dispatcher
from runtime.metrics import ByteCounter
from runtime.migrate import MigrationPolicy, plan_migration
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh, build_mesh
from runtime.parallel.tensor_parallel import TPGroup
from runtime.scale import RunSpec
from runtime.train import Trainer, train


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
    dispatcher = make_dispatcher(spec, mesh.ep_group)
    for moe in module.moe_layers().values():
        moe.dispatcher = dispatcher
    return module.to(device)


def build_trainer(
    spec: RunSpec,
    rank: int,
    device: torch.device | None = None,
    migration: MigrationPolicy | None = None,
) -> Trainer:
    """This rank's groups, byte counter and stage (with its dispatcher), ready to train;
    `migration` decides the placements (default: the planner's policy at uniform prices).

    Every process calls it in the same order (it creates the process groups)."""
    device = device or torch.device("cpu")
    mesh = build_mesh(spec, rank)
    counter = ByteCounter([c.node for c in mesh.coords], rank)
    module = build_stage(spec, mesh, device, counter)
    return Trainer(spec, mesh, module, counter, device, migration)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.launch")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--dispatcher", choices=("halo", "halo-dedup", "flat"), default="halo")
    p.add_argument("--migrate-every", type=int, default=0)
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
    spec = spec_from_args(args)
    migration = plan_migration(args.plan, spec)  # priced from the plan's cluster, once
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
    result = train(build_trainer(spec, rank, device, migration), plot=True)
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
