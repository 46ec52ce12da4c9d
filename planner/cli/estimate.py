"""`piper estimate`: the resource model's breakdown for one layout (table, JSON, CSVs)."""

from __future__ import annotations

import argparse
import json

from planner.calibrate.runs import accounted_split
from planner.cli.optimizer_args import add_optimizer_state_arguments, optimizer_state
from planner.cli.target_args import add_target_arguments, resolve
from planner.parallel import RECOMPUTE_MODULES, ParallelConfig
from planner.resources.layer_comm import DISPATCHERS
from planner.search.target_space import check_layout_for, with_target_modules
from planner.specs import CUDA_GRAPHS, ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target, check_model, with_conventions

RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16", "fp16", "fp8", "mxfp8", "fp32")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="predict tokens/s, memory and time of one parallel layout",
        description="Tokens/s (total and per GPU), step time, per-stage memory by component, "
        "time by component, communication by level, TFLOPS per GPU and MFU (model FLOPs in "
        "Megatron-Core's convention) for one layout (even layer split). "
        "See planner/RESOURCE_MODEL.md.",
    )
    p.add_argument("--model", required=True, help="model preset name or config path")
    p.add_argument("--cluster", required=True, help="cluster preset name or YAML path")
    _layout_arguments(p)
    _training_arguments(p)
    p.add_argument("--dispatcher", choices=DISPATCHERS, default="flat")
    p.add_argument("--accounting", choices=("piper", "paper"), default="piper")
    p.add_argument("--split", choices=("even", "accounted"), default="even",
                   help="layers per pipeline stage: even (earlier stages take the extra "
                   "layer), or accounted: the embedding and the loss count as one layer each, "
                   "Megatron's --account-for-embedding/loss-in-pipeline-split")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, help="write estimate.json, memory/time/comm.csv here")
    p.set_defaults(func=run)


def _layout_arguments(p: argparse.ArgumentParser) -> None:
    sizes = (
        ("--pp", "pipeline stages"),
        ("--dp", "data-parallel degree"),
        ("--tp", "tensor-parallel degree"),
        ("--ep", "expert-parallel degree (etp*ep divides tp*cp*dp)"),
        ("--vp", "interleaved model chunks per pipeline rank"),
        ("--cp", "context-parallel degree"),
        ("--etp", "expert tensor-parallel degree"),
    )
    for flag, text in sizes:
        p.add_argument(flag, type=int, default=1, help=text)
    p.add_argument("--gpus", type=int, default=None, help="check that pp*dp*tp*cp equals this")
    p.add_argument("--nodes", type=int, default=None,
                   help="resize the cluster to N nodes (as piper plan --nodes)")  # fmt: skip
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--num-microbatches", type=int, default=None, help="per data-parallel rank")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="default none; selective when --recompute-modules is given")  # fmt: skip
    p.add_argument("--recompute-modules", default=None, metavar="LIST",
                   help="selective recompute modules, comma-separated: "
                   + ",".join(RECOMPUTE_MODULES))  # fmt: skip


def _training_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--zero", action=argparse.BooleanOptionalAction, default=None,
                   help="distributed optimizer (shard Adam); default: the target's "
                   "(megatron on, piper and torchtitan off)")  # fmt: skip
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="shard weights, gradients and optimizer; default: the target's "
                   "(torchtitan on, megatron and piper off)")  # fmt: skip
    p.add_argument("--optimizer-dtype", choices=("fp32", "bf16"), default="fp32",
                   help="Adam moments dtype")  # fmt: skip
    add_optimizer_state_arguments(p)
    p.add_argument("--mtp-layers", type=int, default=None, help="MTP layers (default: model's)")
    p.add_argument("--a2a-overlap", action="store_true",
                   help="1F1B all-to-all overlap behind another micro-batch")  # fmt: skip
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=None,
                   help="CUDA graphs: the per-layer host time paid (default: the cluster's "
                   "cuda_graphs)")  # fmt: skip
    add_target_arguments(p)
    p.add_argument("--routing-skew", type=float, default=1.0, help="hot rank load / mean")
    p.add_argument("--no-flash", action="store_true", help="attention without flash kernels")
    p.add_argument("--dtype", default="bf16", choices=DTYPES,
                   help="fp8/mxfp8: the linear GEMMs in low precision")  # fmt: skip


def _microbatches(args: argparse.Namespace) -> tuple[int, int]:
    """(num_microbatches, global_batch) from the flags; a mismatch is one error line."""
    for flag in ("pp", "dp", "tp", "ep", "micro_batch", "vp", "cp", "etp"):
        if getattr(args, flag) < 1:
            name = flag.replace("_", "-")
            raise SpecError(f"--{name} must be >= 1, got {getattr(args, flag)}")
    if args.global_batch is not None and args.global_batch < 1:
        raise SpecError(f"--global-batch must be >= 1, got {args.global_batch}")
    per_step = args.dp * args.micro_batch
    if args.num_microbatches is not None:
        m = args.num_microbatches
        if args.global_batch is not None and args.global_batch != m * per_step:
            raise SpecError(
                f"--global-batch {args.global_batch} != dp*micro-batch*num-microbatches = "
                f"{m * per_step}; give only one of --global-batch and --num-microbatches"
            )
        return m, m * per_step
    gb = args.global_batch if args.global_batch is not None else 1024
    if gb % per_step:
        raise SpecError(
            f"--global-batch {gb} is not a multiple of dp*micro-batch = {per_step}; "
            "change --global-batch, --dp or --micro-batch"
        )
    return gb // per_step, gb


def _inputs(
    args: argparse.Namespace,
) -> tuple[ModelSpec, ClusterSpec, TrainingSpec, ParallelConfig, Target]:
    """Load the model and cluster and build the training setup and layout from the flags."""
    from planner.inputs.clusters import check_dtype, load_cluster_nodes
    from planner.inputs.models import load_model

    model, cluster = load_model(args.model), load_cluster_nodes(args.cluster, args.nodes)
    check_dtype(cluster, args.dtype, args.cluster)
    m, gb = _microbatches(args)
    recompute, modules = _recompute(args)
    parallel = ParallelConfig(
        pp=args.pp, dp=args.dp, tp=args.tp, ep=args.ep, micro_batch=args.micro_batch,
        num_microbatches=m, recompute=recompute, vp=args.vp, cp=args.cp, etp=args.etp,
        recompute_modules=modules,
    )  # fmt: skip
    if args.gpus is not None and parallel.world != args.gpus:
        raise SpecError(
            f"layout: pp*dp*tp*cp = {parallel.world} but --gpus {args.gpus}; make them multiply "
            "to the GPU count"
        )
    target, margin = resolve(args, cluster)
    parallel = with_target_modules(target, parallel)
    zero, fsdp = _sharding(args, target)
    training = TrainingSpec(
        seq_len=args.seq_len, global_batch=gb, dtype=args.dtype, zero=zero,
        recompute=recompute, flash_attention=not args.no_flash,
        routing_skew=args.routing_skew, fsdp=fsdp, optimizer_dtype=args.optimizer_dtype,
        mtp_layers=args.mtp_layers, a2a_overlap=args.a2a_overlap,
        cuda_graphs=args.cuda_graphs, memory_margin_gib=margin, **optimizer_state(args),
    )  # fmt: skip
    training = with_conventions(training, target)
    check_layout_for(target, training, parallel, args.dispatcher)
    check_model(model, target)
    return model, cluster, training, parallel, target


def _sharding(args: argparse.Namespace, target: Target) -> tuple[bool, bool]:
    """(zero, fsdp): the flags given, else the target's default sharding."""
    if args.zero is None and args.fsdp is None:
        return target.default_sharding == "zero", target.default_sharding == "fsdp"
    return bool(args.zero), bool(args.fsdp)


def _recompute(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """(policy, modules) from --recompute and --recompute-modules; modules alone mean
    selective recompute."""
    if args.recompute_modules is None:
        return args.recompute or "none", ()
    modules = tuple(m.strip() for m in args.recompute_modules.split(",") if m.strip())
    if not modules:
        raise SpecError("--recompute-modules is empty; list modules, e.g. core_attn,moe_act")
    if args.recompute not in (None, "selective"):
        raise SpecError(
            f"--recompute-modules needs --recompute selective, not {args.recompute}; drop one"
        )
    return "selective", modules


def run(args: argparse.Namespace) -> int:
    from planner.calibrate.error_bars import (
        interval_lines,
        intervals_csv,
        may_not_fit,
        may_not_fit_note,
    )
    from planner.calibrate.uncertainty import intervals
    from planner.outputs.files import write_files
    from planner.resources.cost import estimate, estimate_to_dict
    from planner.resources.flops import FLOPS_CONVENTION

    model, cluster, training, parallel, target = _inputs(args)
    m, gb = parallel.num_microbatches, training.global_batch
    split = accounted_split(model.num_layers, parallel.pp) if args.split == "accounted" else None

    def price(c: ClusterSpec):
        return estimate(
            model, c, training, parallel, stage_layers=split, dispatcher=args.dispatcher,
            accounting=args.accounting,
        )  # fmt: skip

    est = price(cluster)
    bars = intervals(cluster, est, reprice=lambda c: price(c).tokens_per_s)
    bars = may_not_fit(bars, cluster.device.memory_gib)
    data = {
        "model": model.name,
        "cluster": cluster.name,
        "parallel": {
            "pp": parallel.pp,
            "dp": parallel.dp,
            "tp": parallel.tp,
            "ep": parallel.ep,
            "edp": parallel.edp,
            "vp": parallel.vp,
            "cp": parallel.cp,
            "etp": parallel.etp,
            "micro_batch": parallel.micro_batch,
            "num_microbatches": m,
            "recompute": parallel.recompute,
            "recompute_modules": list(parallel.selective_modules),
            "world": parallel.world,
        },  # fmt: skip
        "training": {
            "seq_len": training.seq_len,
            "global_batch": gb,
            "zero": training.zero,
            "fsdp": training.fsdp,
            "dtype": training.dtype,
            "optimizer_dtype": training.optimizer_dtype,
            "mtp_layers": model.num_mtp_layers if args.mtp_layers is None else args.mtp_layers,
            "a2a_overlap": training.a2a_overlap,
            "gate_in_activation": training.gate_in_activation,
        },  # fmt: skip
        "dispatcher": args.dispatcher,
        "dedup_ratio": (
            _dedup_ratio(model, cluster, parallel) if args.dispatcher == "halo-dedup" else None
        ),
        "accounting": args.accounting,
        "target": target.name,
        **estimate_to_dict(est),
        "tokens_per_s_per_gpu": est.tokens_per_s / parallel.world,
        "flops_per_token": est.model_flops_per_step / (gb * training.seq_len),
        "flops_convention": FLOPS_CONVENTION,
        "intervals": bars.to_dict(),
    }
    if args.out:
        write_files(args.out, {**_files(data), "intervals.csv": intervals_csv(bars)})
    if args.json:
        print(json.dumps(_rounded(data), indent=2, sort_keys=True))
    else:
        print(_table(data, may_not_fit_note(bars, cluster.device.memory_gib)))
        print("\n".join(interval_lines(bars, parallel.world, indent="")))
        if args.out:
            print(
                f"wrote estimate.json, memory.csv, time.csv, comm.csv, intervals.csv to {args.out}"
            )
    return 0


def _rounded(obj: object) -> object:
    if isinstance(obj, float):
        return float(f"{obj:.9g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rounded(v) for v in obj]
    return obj


def _files(data: dict) -> dict[str, str]:
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
        "estimate.json": json.dumps(_rounded(data), indent=2, sort_keys=True) + "\n",
        "memory.csv": "\n".join(mem) + "\n",
        "time.csv": "\n".join(time) + "\n",
        "comm.csv": "\n".join(comm) + "\n",
    }


def _table(d: dict, interval_note: str = "") -> str:
    from planner.numbers import number, percent

    par, tr = d["parallel"], d["training"]
    rc = par["recompute"]
    if par["recompute_modules"]:
        rc += f"({','.join(par['recompute_modules'])})"
    sharding = "fsdp" if tr["fsdp"] else "distributed optimizer" if tr["zero"] else "replicated"
    lines = [
        f"{d['tokens_per_s']:,.0f} tokens/s ({d['tokens_per_s_per_gpu']:,.0f} per GPU), "
        f"step {number(d['step_time_s'])} s, {number(d['tflops_per_gpu'], 3)} TFLOPS/GPU, "
        f"MFU {percent(d['mfu'])} ({d['flops_convention']} FLOP convention)",
        f"{d['model']} on {d['cluster']}: pp={par['pp']} vp={par['vp']} dp={par['dp']} "
        f"tp={par['tp']} cp={par['cp']} ep={par['ep']} etp={par['etp']} edp={par['edp']} "
        f"micro-batch={par['micro_batch']} micro-batches={par['num_microbatches']} "
        f"recompute={rc} ({par['world']} GPUs, {d['dispatcher']} all-to-all"
        f"{_dedup_note(d.get('dedup_ratio'))}{', overlapped' if tr['a2a_overlap'] else ''})",
        f"  {tr['dtype']}, {sharding}, Adam moments {tr['optimizer_dtype']}, "
        f"MTP layers {tr['mtp_layers']}",
        "",
    ]
    mem_keys = list(d["stages"][0]["memory_gib"])
    lines.append("memory per rank (GiB)")
    lines.append(f"{'stage':>5} {'layers':>7} " + " ".join(f"{k[:11]:>11}" for k in mem_keys)
                 + f" {'total':>8}")  # fmt: skip
    for st in d["stages"]:
        row = " ".join(f"{number(st['memory_gib'][k], 3):>11}" for k in mem_keys)
        lines.append(
            f"{st['stage']:>5} {len(st['layers']):>7} {row} {number(st['total_gib'], 3):>8}"
        )
    time_keys = sorted({k for st in d["stages"] for k in st["time_s"]})
    lines += ["", "time per micro-batch, forward + backward (ms)"]
    lines.append(f"{'stage':>5} " + " ".join(f"{k[:11]:>11}" for k in time_keys) + f" {'total':>9}")
    for st in d["stages"]:
        row = " ".join(f"{st['time_s'].get(k, 0.0) * 1e3:>11.2f}" for k in time_keys)
        lines.append(f"{st['stage']:>5} {row} {st['total_s'] * 1e3:>9.2f}")
    hidden_keys = sorted({k for st in d["stages"] for k in st["hidden_s"]})
    if hidden_keys:
        lines += ["", "communication hidden behind compute, per micro-batch (ms)"]
        lines.append(f"{'stage':>5} " + " ".join(f"{k[:11]:>11}" for k in hidden_keys))
        for st in d["stages"]:
            row = " ".join(f"{st['hidden_s'].get(k, 0.0) * 1e3:>11.2f}" for k in hidden_keys)
            lines.append(f"{st['stage']:>5} {row}")
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
    return "\n".join(lines)


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


def _dedup_ratio(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelConfig) -> float:
    """HALO-dedup's network bytes over plain HALO's for the first MoE layer's routing."""
    from planner.resources.comm import dedup_ratio

    moe = model.first_moe
    if moe is None:
        return 1.0
    return dedup_ratio(cluster, parallel.ep, moe.num_experts, moe.top_k, parallel.etp)


def _dedup_note(ratio: float | None) -> str:
    return "" if ratio is None else f", {ratio:.2f}x HALO's network bytes"
