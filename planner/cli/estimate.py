"""`piper estimate`: the resource model's breakdown for one layout (table, JSON, CSVs)."""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from planner.calibrate.runs import accounted_split
from planner.cli.estimate_plan import Setup, microbatches, plan_setup, recompute_choice
from planner.cli.optimizer_args import add_optimizer_state_arguments, optimizer_state
from planner.cli.target_args import add_target_arguments, resolve
from planner.outputs.estimate_report import estimate_files, estimate_table, rounded
from planner.outputs.lines import wrapped
from planner.parallel import RECOMPUTE_MODULES, ParallelConfig
from planner.resources.layer_comm import DISPATCHERS
from planner.search.target_space import check_layout_for, with_target_modules
from planner.specs import CUDA_GRAPHS, ClusterSpec, Dtype, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target, check_model, with_conventions

RECOMPUTE = ("none", "selective", "full")
DTYPES = get_args(Dtype)  # bf16, fp16, fp8, mxfp8, fp8_blockwise, nvfp4, mxfp4, fp32


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="predict tokens/s, memory and time of one parallel layout",
        description="Tokens/s (total and per GPU), step time, per-stage memory by component, "
        "time by component, communication by level, TFLOPS per GPU and MFU (model FLOPs in "
        "Megatron-Core's convention) for one layout (even layer split). With PLAN.json: "
        "re-price that plan (its model, cluster, training, layout, layer split and "
        "dispatcher), the flags given changing it, beside its own prediction. "
        "See planner/RESOURCE_MODEL.md.",
    )
    p.add_argument("plan", nargs="?", default=None, metavar="PLAN.json",
                   help="a plan to re-price: its settings are every flag's default")  # fmt: skip
    p.add_argument("--model", default=None, help="model preset name or config path")
    p.add_argument("--cluster", default=None, help="cluster preset name or YAML path")
    _layout_arguments(p)
    _training_arguments(p)
    p.add_argument("--dispatcher", choices=DISPATCHERS, default=None, help="default flat")
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
        p.add_argument(flag, type=int, default=None, help=f"{text} (default 1)")
    p.add_argument("--gpus", type=int, default=None, help="check that pp*dp*tp*cp equals this")
    p.add_argument("--nodes", type=int, default=None,
                   help="resize the cluster to N nodes (as piper plan --nodes)")  # fmt: skip
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch "
                   "(default 1)")  # fmt: skip
    p.add_argument("--num-microbatches", type=int, default=None, help="per data-parallel rank")
    p.add_argument("--recompute", choices=RECOMPUTE, default=None,
                   help="default none; selective when --recompute-modules is given")  # fmt: skip
    p.add_argument("--recompute-modules", default=None, metavar="LIST",
                   help="selective recompute modules, comma-separated: "
                   + ",".join(RECOMPUTE_MODULES))  # fmt: skip
    p.add_argument("--memory-budget", type=float, default=None, metavar="B",
                   help="torchtitan's memory-budget AC at budget B in [0, 1] (steps of 0.05; "
                   "--target torchtitan)")  # fmt: skip


def _training_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=None, help="default 4096")
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--zero", action=argparse.BooleanOptionalAction, default=None,
                   help="distributed optimizer (shard Adam); default: the target's "
                   "(megatron on, piper and torchtitan off)")  # fmt: skip
    p.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                   help="shard weights, gradients and optimizer; default: the target's "
                   "(torchtitan on, megatron and piper off)")  # fmt: skip
    p.add_argument("--optimizer-dtype", choices=("fp32", "bf16"), default=None,
                   help="Adam moments dtype (default fp32)")  # fmt: skip
    add_optimizer_state_arguments(p)
    p.add_argument("--mtp-layers", type=int, default=None, help="MTP layers (default: model's)")
    p.add_argument("--a2a-overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="1F1B all-to-all overlap behind another micro-batch (default "
                   "off)")  # fmt: skip
    p.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, default=None,
                   help="CUDA graphs: the per-layer host time paid (default: the cluster's "
                   "cuda_graphs)")  # fmt: skip
    add_target_arguments(p)
    p.add_argument("--routing-skew", type=float, default=None,
                   help="hot rank load / mean (default 1)")  # fmt: skip
    p.add_argument("--no-flash", action="store_true", help="attention without flash kernels")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="fp8/mxfp8: the linear GEMMs in low precision (default bf16)")  # fmt: skip


# What a flag left out means without a PLAN.json (with one, the plan's setting).
FLAG_DEFAULTS = {"pp": 1, "dp": 1, "tp": 1, "ep": 1, "vp": 1, "cp": 1, "etp": 1,
                 "micro_batch": 1, "seq_len": 4096, "optimizer_dtype": "fp32",
                 "a2a_overlap": False, "routing_skew": 1.0, "dtype": "bf16",
                 "dispatcher": "flat"}  # fmt: skip


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The flags with FLAG_DEFAULTS for those left out; --model and --cluster required."""
    missing = [f"--{k}" for k in ("model", "cluster") if getattr(args, k) is None]
    if missing:
        raise SpecError(
            f"estimate: {' and '.join(missing)} missing; name the model and the cluster, or "
            "give a PLAN.json to re-price"
        )
    left_out = {k: v for k, v in FLAG_DEFAULTS.items() if getattr(args, k, None) is None}
    return argparse.Namespace(**{**vars(args), **left_out})


def _inputs(
    args: argparse.Namespace,
) -> tuple[ModelSpec, ClusterSpec, TrainingSpec, ParallelConfig, Target]:
    """Load the model and cluster and build the training setup and layout from the flags."""
    from planner.inputs.clusters import check_dtype, load_cluster_nodes
    from planner.inputs.models import load_model

    model, cluster = load_model(args.model), load_cluster_nodes(args.cluster, args.nodes)
    check_dtype(cluster, args.dtype, args.cluster)
    m, gb = microbatches(args)
    recompute, modules = recompute_choice(args)
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


def run(args: argparse.Namespace) -> int:
    from planner.calibrate.error_bars import (
        interval_lines,
        intervals_csv,
        may_not_fit,
        may_not_fit_note,
    )
    from planner.calibrate.uncertainty import intervals
    from planner.outputs.estimate_report import beside_plan
    from planner.outputs.files import write_files
    from planner.resources.cost import estimate

    if args.plan:
        setup = plan_setup(args)
    else:
        model, cluster, training, parallel, target = _inputs(_with_defaults(args))
        split = (
            accounted_split(model.num_layers, parallel.pp) if args.split == "accounted" else None
        )
        dispatcher = args.dispatcher or FLAG_DEFAULTS["dispatcher"]
        setup = Setup(model, cluster, training, parallel, target, dispatcher, split)

    def price(c: ClusterSpec):
        return estimate(
            setup.model, c, setup.training, setup.parallel, stage_layers=setup.stage_layers,
            recompute_layers=setup.recompute_layers, dispatcher=setup.dispatcher,  # type: ignore[arg-type]
            accounting=args.accounting,
        )  # fmt: skip

    cluster = setup.cluster
    est = price(cluster)
    bars = intervals(cluster, est, reprice=lambda c: price(c).tokens_per_s)
    bars = may_not_fit(bars, cluster.device.memory_gib)
    data = _data(setup, est, bars, args.accounting)
    if setup.plan_predicted is not None:
        data["plan_predicted"] = setup.plan_predicted
    if args.out:
        write_files(args.out, {**estimate_files(data), "intervals.csv": intervals_csv(bars)})
    if args.json:
        print(json.dumps(rounded(data), indent=2, sort_keys=True))
    else:
        print(estimate_table(data, may_not_fit_note(bars, cluster.device.memory_gib)))
        print("\n".join(wrapped(interval_lines(bars, setup.parallel.world, indent=""))))
        if setup.plan_predicted is not None:
            print("\n".join(beside_plan(data, setup.plan_predicted, setup.changed)))
        if args.out:
            print(
                f"wrote estimate.json, memory.csv, time.csv, comm.csv, intervals.csv to {args.out}"
            )
    return 0


def _data(setup: Any, est: Any, bars: Any, accounting: str) -> dict[str, Any]:
    """estimate.json: the inputs as priced, the estimate, the intervals."""
    from planner.resources.cost import estimate_to_dict
    from planner.resources.flops import FLOPS_CONVENTION

    model, cluster, training, parallel = setup.model, setup.cluster, setup.training, setup.parallel
    gb = training.global_batch
    return {
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
            "num_microbatches": parallel.num_microbatches,
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
            "mtp_layers": model.num_mtp_layers
            if training.mtp_layers is None
            else training.mtp_layers,
            "a2a_overlap": training.a2a_overlap,
            "gate_in_activation": training.gate_in_activation,
        },  # fmt: skip
        "dispatcher": setup.dispatcher,
        "dedup_ratio": (
            _dedup_ratio(model, cluster, parallel) if setup.dispatcher == "halo-dedup" else None
        ),
        "accounting": accounting,
        "target": setup.target.name,
        **estimate_to_dict(est),
        "tokens_per_s_per_gpu": est.tokens_per_s / parallel.world,
        "flops_per_token": est.model_flops_per_step / (gb * training.seq_len),
        "flops_convention": FLOPS_CONVENTION,
        "peak_tflops": dict(cluster.device.peak_tflops),
        "intervals": bars.to_dict(),
    }


def _dedup_ratio(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelConfig) -> float:
    """HALO-dedup's network bytes over plain HALO's for the first MoE layer's routing."""
    from planner.resources.comm import dedup_ratio

    moe = model.first_moe
    if moe is None:
        return 1.0
    return dedup_ratio(cluster, parallel.ep, moe.num_experts, moe.top_k, parallel.etp)
