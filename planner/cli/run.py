"""`piper run PLAN`: train a plan with the PyTorch runtime, launched through torchrun.

This module never imports torch or the runtime: it validates the plan (the plan's model and
cluster files must be unchanged since planning unless --force; the runtime's own check runs
as `python -m runtime.scale`), then starts `python -m torch.distributed.run --standalone
--nproc-per-node N -m runtime.launch ...` and summarizes metrics.jsonl when it is done.
On many nodes, start `python -m runtime.launch` with torchrun or srun directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from planner.plan import Plan, load_plan
from planner.specs import SpecError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a plan on this machine (torchrun; gloo on CPU, NCCL on GPUs)",
        description="Train PLAN (plan.json) with the PyTorch runtime. On a CPU machine each "
        "process emulates one device; --ranks-per-node declares the emulated node size.",
    )
    p.add_argument("plan", help="plan.json written by 'piper plan'")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: pp*dp*tp)")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="emulated node size (default: the plan cluster's gpus_per_node)",
    )
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="shrink widths, depth and sequence by F in (0, 1] (see RUNTIME.md)",
    )
    p.add_argument("--dispatcher", choices=("halo", "halo-dedup", "flat"), default="halo")
    p.add_argument(
        "--migrate-every",
        type=int,
        default=0,
        metavar="K",
        help="migrate experts every K steps (0 = never)",
    )
    p.add_argument("--out", default=None, help="output directory (default: PLAN's dir/run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument(
        "--trace-every",
        type=int,
        default=1,
        metavar="S",
        help="sum S steps into one trace.csv interval (default 1)",
    )
    p.add_argument(
        "--halo-direct-below-bytes",
        type=int,
        default=-1,
        metavar="B",
        help="HALO sends directly when node-to-node messages are below B bytes "
        "(0 = always hierarchical; default: the dispatcher's own threshold)",
    )
    p.add_argument(
        "--router-bias-rate",
        type=float,
        default=0.0,
        metavar="R",
        help="aux-loss-free balancing: router bias step per update (0 = off)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="run even if the model or cluster changed since planning, or the processes may "
        "not fit in this machine's memory",
    )
    p.set_defaults(func=run)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def changed_inputs(plan: Plan) -> list[str]:
    """Inputs whose current file no longer matches what the plan recorded (inputs_sha256)."""
    from planner.inputs.clusters import cluster_to_dict, list_cluster_presets, load_cluster
    from planner.inputs.models import load_model, model_config

    changed = []
    source = plan.model.source
    name = source.removeprefix("preset:") if source.startswith("preset:") else source
    if name and plan.model.config:
        try:
            fresh = model_config(load_model(name))
        except SpecError:
            fresh = None
        if fresh is not None and _canonical(fresh) != _canonical(plan.model.config):
            changed.append(f"model '{name}'")
    csrc = plan.cluster.source
    cname = csrc if Path(csrc).is_file() else plan.cluster.name
    if cname and (Path(cname).is_file() or cname in list_cluster_presets()):
        fresh_c = cluster_to_dict(load_cluster(cname))
        recorded = plan.cluster.to_dict()
        diff = [
            k
            for k in fresh_c
            if k in recorded and _canonical(recorded[k]) != _canonical(fresh_c[k]) and k != "source"
        ]
        if diff:
            changed.append(f"cluster '{cname}' ({', '.join(diff)})")
    return changed


def _check(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    """The runtime's validation, run without importing it here; returns the run's shape."""
    cmd = [sys.executable, "-m", "runtime.scale", args.plan, "--scale", str(args.scale)]
    if args.ranks_per_node:
        cmd += ["--ranks-per-node", str(args.ranks_per_node)]
    if args.nproc:
        cmd += ["--nproc", str(args.nproc)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["runtime check failed"])[-1]
        raise SpecError(f"{args.plan}: {last}")
    return json.loads(proc.stdout)


# Host memory of one runtime process with a small (scaled) model: the torch import, gloo
# buffers and the model; measured 0.33 GiB peak RSS per rank for tiny-moe on CPU.
PROCESS_GIB = 0.35


def _available_gib() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_memory(world: int) -> None:
    """Refuse to start more processes on this machine than its memory holds."""
    available = _available_gib()
    need = world * PROCESS_GIB
    if available is not None and need > available:
        raise SpecError(
            f"{world} processes need about {need:.1f} GiB on this machine ({PROCESS_GIB} GiB "
            f"each, mostly torch) but {available:.1f} GiB is available; run them on several "
            "machines (torchrun or srun with python -m runtime.launch, see RUNTIME.md), plan "
            "for fewer GPUs, or pass --force to try anyway"
        )


def _summary(out: Path) -> str:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    if not lines:
        return f"no steps recorded in {out}"
    first, last = lines[0], lines[-1]
    tps = sorted(x["tokens_per_s"] for x in lines)[len(lines) // 2]
    return (
        f"{len(lines)} steps: loss {first['loss']:.3f} -> {last['loss']:.3f}; median "
        f"{tps:,.0f} tokens/s; last step sent {last['bytes_intra_node']:,} B intra-node, "
        f"{last['bytes_inter_node']:,} B inter-node; wrote {out}/metrics.jsonl, trace.csv"
    )


def _launch_cmd(args: argparse.Namespace, world: int, ranks_per_node: int, out: Path) -> list:
    """torchrun (standalone, one machine) running runtime.launch with the run's options."""
    options = {
        "plan": args.plan,
        "out": out,
        "steps": args.steps,
        "scale": args.scale,
        "ranks-per-node": ranks_per_node,
        "dispatcher": args.dispatcher,
        "migrate-every": args.migrate_every,
        "seed": args.seed,
        "lr": args.lr,
        "trace-every": args.trace_every,
        "router-bias-rate": args.router_bias_rate,
        "halo-direct-below-bytes": args.halo_direct_below_bytes,
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(world),
        "-m",
        "runtime.launch",
    ]
    for name, value in options.items():
        cmd += [f"--{name}", str(value)]
    return cmd


def _check_args(args: argparse.Namespace) -> None:
    for name in ("steps", "trace_every"):
        if getattr(args, name) < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.migrate_every < 0 or args.router_bias_rate < 0:
        raise SpecError("--migrate-every and --router-bias-rate must be >= 0")
    for name in ("nproc", "ranks_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = name.replace("_", "-")
            raise SpecError(f"--{flag} must be >= 1, got {value}; leave it out for the default")
    if not args.lr > 0:
        raise SpecError(f"--lr must be a positive learning rate, got {args.lr}")


def run(args: argparse.Namespace) -> int:
    """Validate the plan, launch torchrun, print a summary; returns the exit code."""
    plan = load_plan(args.plan)
    _check_args(args)
    changed = changed_inputs(plan)
    if changed and not args.force:
        raise SpecError(
            f"{args.plan}: {' and '.join(changed)} changed since planning "
            "(inputs_sha256); re-run 'piper plan' or pass --force"
        )
    shape = _check(args, plan)
    if not args.force:
        _check_memory(shape["world"])
    out = Path(args.out) if args.out else Path(args.plan).resolve().parent / "run"
    cmd = _launch_cmd(args, shape["world"], shape["ranks_per_node"], out)
    print(
        f"piper run: {shape['world']} processes (pp={shape['pp']} dp={shape['dp']} "
        f"tp={shape['tp']} ep={shape['ep']} edp={shape['edp']}, "
        f"{shape['ranks_per_node']} per node), "
        f"{shape['layers']} layers d={shape['hidden_size']} seq={shape['seq_len']}",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        print(f"piper run: training failed (torchrun exit {proc.returncode})", file=sys.stderr)
        return 1
    print(f"piper run: {_summary(out)}")
    return 0
