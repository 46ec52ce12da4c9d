"""Entry point of one training process: `python -m runtime.launch --plan plan.json ...`.

Started by `piper run` through torchrun (or by torchrun / srun directly on many nodes): reads
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT from the environment, uses NCCL when CUDA is
available and gloo otherwise, builds the groups, this rank's pipeline stage and dispatcher,
hands them to the trainer loop (`runtime.train`) for `--steps` steps on byte-level stdlib
text and (rank 0) writes metrics.jsonl, trace.csv and run.json into --out (default: the
plan's directory/run, as for `piper run`). Under torchrun the process dies with torchrun.
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

from planner.outputs.files import write_files
from planner.plan import load_plan
from planner.run.options import LAUNCH_MODULE, RunOptions, add_run_arguments, die_with_torchrun
from planner.run.spec import RunSpec, spec_from_options
from planner.run.token_data import open_token_file, spec_for_data
from runtime.checkpoint import CheckpointOptions
from runtime.data import TokenSampler
from runtime.dispatch.factory import make_dispatcher
from runtime.metrics import ByteCounter
from runtime.migrate import MigrationPolicy, plan_migration
from runtime.model.arch import ModelArch
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh, build_mesh
from runtime.parallel.pipeline import RankChunks
from runtime.parallel.tensor_parallel import TPGroup
from runtime.train import Trainer, rows_per_interval, train


def build_stage(
    spec: RunSpec, mesh: Mesh, device: torch.device, counter=None, arch: ModelArch | None = None
) -> StageModule | RankChunks:
    """This rank's StageModule (RankChunks of vp of them with vp > 1) with placements
    translated to EP group ranks; with tp > 1 its attention and dense MLPs are sharded over
    the TP group (TP bytes go to `counter`). arch: the model's numerics (runtime/model/arch.py;
    None: the spec's, RunSpec.arch)."""
    tp = None
    if spec.tp > 1:
        tokens = spec.micro_batch * spec.seq_len
        tp = TPGroup(mesh.tp_group, mesh.tp_ranks, mesh.me.tp_idx, tokens, spec.seq_len, counter)
    tables = {
        layer: tuple(mesh.ep_group_rank(r) for r in table) for layer, table in spec.placements
    }
    chunks = [
        StageModule(
            spec.model,
            layers,
            first=(k == 0),
            last=(k == spec.pp * spec.vp - 1),
            placements=tables,
            ep_rank=mesh.ep_group_rank(mesh.me.ep_idx),
            seed=spec.seed,
            tp=tp,
            recompute={i: spec.recompute for i in spec.recompute_layers},
            arch=arch or spec.arch,
        )
        for k, layers in spec.chunks(mesh.me.stage)
    ]
    module = chunks[0] if len(chunks) == 1 else RankChunks(chunks)
    dispatcher = make_dispatcher(spec, mesh.ep_group)
    for moe in module.moe_layers().values():
        moe.dispatcher = dispatcher
    return module.to(device)


def build_trainer(
    spec: RunSpec,
    rank: int,
    device: torch.device | None = None,
    migration: MigrationPolicy | None = None,
    hf_weights: str | None = None,
    compute_dtype: str = "fp32",
) -> Trainer:
    """This rank's groups, byte counter and stage (with its dispatcher), ready to train;
    `migration` decides the placements (default: the planner's policy at uniform prices). The
    model computes with spec.arch; `hf_weights` loads a checkpoint's weights (build the spec
    with the same directory, run_spec_from_plan(..., hf_weights=DIR), for its numerics);
    `compute_dtype` (fp32, bf16, fp16): the autocast dtype of the steps and, with FSDP, the
    dtype its units all-gather in.

    Every process calls it in the same order (it creates the process groups)."""
    device = device or torch.device("cpu")
    mesh = build_mesh(spec, rank)
    counter = ByteCounter([c.node for c in mesh.coords], rank)
    module = build_stage(spec, mesh, device, counter, spec.arch)
    return Trainer(spec, mesh, module, counter, device, migration, hf_weights, compute_dtype)


def parse_options(argv: list[str] | None = None) -> RunOptions:
    """The run's options from this process's command line (RunOptions' launcher flags)."""
    parser = argparse.ArgumentParser(prog=f"python -m {LAUNCH_MODULE}")
    add_run_arguments(parser, launcher=True)
    return RunOptions.from_args(parser.parse_args(argv))


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


def _device() -> torch.device:
    """This process's device: the GPU of its LOCAL_RANK (made current) under CUDA, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def _run_info(spec: RunSpec) -> dict:
    """run.json: the shape of the run as executed (after --scale) and its options."""
    return {
        "world": spec.world,
        "pp": spec.pp,
        "dp": spec.dp,
        "tp": spec.tp,
        "ep": spec.ep,
        "edp": spec.edp,
        "vp": spec.vp,
        "etp": spec.etp,
        "fsdp": spec.fsdp,
        "chunk_layers": [list(c) for c in spec.chunk_layers],
        "steps": spec.steps,
        "seq_len": spec.seq_len,
        "micro_batch": spec.micro_batch,
        "num_microbatches": spec.num_microbatches,
        "hidden_size": spec.model.hidden_size,
        "layers": spec.model.num_layers,
        "source_layers": list(spec.source_layers),
        "dispatcher": spec.dispatcher,
        "arch_source": spec.arch_source,
        "ranks_per_node": spec.ranks_per_node,
        "backend": dist.get_backend(),
        "seed": spec.seed,
        "migrate_every": spec.migrate_every,
        # rows of one interval in the policy's history (piper migrate replays the same rows)
        "migrate_rows_per_interval": rows_per_interval(spec.migrate_every),
        "trace_every": spec.trace_every,
        "router_bias_rate": spec.router_bias_rate,
        "recompute": spec.recompute,
        "recompute_layers": list(spec.recompute_layers),
    }


def _init_process_group(backend: str) -> None:
    """The default group; after a torchrun restart, on the agent's store under a prefix of
    its own: the store outlives the killed attempt and still holds that attempt's peer
    addresses under the default keys, which the new processes would read and fail to reach."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend)
        return
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(host, port, world, is_master=False)
    prefixed = dist.PrefixStore(f"piper/restart{restart}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world)


def main(argv: list[str] | None = None) -> int:
    """One training process: options, process group, the trainer loop, rank 0's files. Under
    torchrun it dies with torchrun, kill -9 included (planner.run.options.die_with_torchrun)."""
    die_with_torchrun()
    options = parse_options(argv)
    _env_from_slurm()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    spec = spec_from_options(options)
    data = open_token_file(options.data) if options.data else None
    if data is not None:
        spec = spec_for_data(spec, data, options.scale)
    migration = plan_migration(options.plan, spec)  # priced from the plan's cluster, once
    device = _device()
    _init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.get_world_size() != spec.world:
        raise SystemExit(f"world size {dist.get_world_size()} != plan's pp*dp*tp = {spec.world}")
    rank = dist.get_rank()
    t0 = time.perf_counter()
    checkpoints = None
    if options.checkpoint_dir:
        # torchrun sets TORCHELASTIC_RESTART_COUNT: a restarted process resumes
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        every, resume = options.checkpoint_every, options.resume or restarted
        checkpoints = CheckpointOptions(options.checkpoint_dir, every, resume, data=options.data)
    dtype = options.compute_dtype(load_plan(options.plan).training)
    trainer = build_trainer(spec, rank, device, migration, options.hf_weights, dtype)
    if data is not None:
        trainer.sample = TokenSampler(data.array())
    for moe in trainer.module.moe_layers().values():
        moe.experts.gemm = options.expert_gemm
    metrics = options.out_dir / "metrics.jsonl"  # appended as the run goes
    result = train(trainer, plot=True, checkpoints=checkpoints, metrics_path=metrics)
    if rank == 0:
        files = dict(result.files)
        files["run.json"] = json.dumps(_run_info(spec), indent=2, sort_keys=True) + "\n"
        files["timings.json"] = json.dumps({"wall_s": time.perf_counter() - t0}) + "\n"
        write_files(options.out_dir, files)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
