"""`piper estimate PLAN.json [flags]`: re-price a plan, the flags given changing it.

The plan's model, cluster, training, layout, layer split, recompute layers, dispatcher and
target are the defaults of every flag; a flag given replaces its setting. While the layout
and the model are the plan's, its layer split and recompute layers are kept (no flag: the
plan's own prediction again); a changed layout or model is split evenly (or as --split
says). With a change, the plan's own prediction is printed beside the new one.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from planner.parallel import ParallelConfig, budget_module
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target

LAYOUT_FLAGS = ("pp", "dp", "tp", "ep", "vp", "cp", "etp", "micro_batch")
# flag -> the TrainingSpec field it sets
TRAINING_FLAGS = {"seq_len": "seq_len", "dtype": "dtype", "optimizer_dtype": "optimizer_dtype",
                  "mtp_layers": "mtp_layers", "a2a_overlap": "a2a_overlap",
                  "cuda_graphs": "cuda_graphs", "routing_skew": "routing_skew"}  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What `piper estimate` prices: the inputs, the layer split and recompute layers (None:
    an even split, recompute as the policy says), and for a re-priced plan its own
    prediction (plan.json's `predicted`) with the flags that changed it."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    parallel: ParallelConfig
    target: Target
    dispatcher: str
    stage_layers: tuple[tuple[int, ...], ...] | None = None
    recompute_layers: tuple[tuple[int, ...], ...] | None = None
    plan_predicted: dict[str, Any] | None = None
    changed: tuple[str, ...] = ()


def plan_setup(args: argparse.Namespace) -> Setup:
    """The Setup of `piper estimate PLAN.json` with the flags in `args` (None: not given)."""
    from planner.calibrate.compare import plan_inputs
    from planner.inputs.clusters import check_dtype, load_cluster_nodes, with_nodes
    from planner.inputs.models import load_model
    from planner.plan import load_plan
    from planner.search.target_space import check_layout_for, with_target_modules
    from planner.targets import check_model, default_target, get_target, with_conventions

    plan = load_plan(args.plan)
    model, cluster, training, parallel = plan_inputs(plan, None)
    changed = _given(args)
    if args.model is not None:
        model = load_model(args.model)
    if args.cluster is not None:
        cluster = load_cluster_nodes(args.cluster, args.nodes)
    elif args.nodes is not None:
        cluster = with_nodes(cluster, args.nodes)
    extra = plan.extra if isinstance(plan.extra, dict) else {}
    target = get_target(args.target or extra.get("target") or default_target(cluster))
    training = _training(args, training, cluster)
    check_dtype(cluster, training.dtype, args.cluster or args.plan)
    new_layout = _layout(args, parallel, training)
    relaid = new_layout != parallel or args.model is not None
    if relaid:
        new_layout = with_target_modules(target, new_layout)
    training = with_conventions(replace(training, recompute=new_layout.recompute), target)
    training = replace(training, global_batch=new_layout.dp * new_layout.micro_batch
                       * new_layout.num_microbatches)  # fmt: skip
    dispatcher = args.dispatcher or extra.get("dispatcher", "flat")
    check_layout_for(target, training, new_layout, dispatcher)
    check_model(model, target)
    if args.gpus is not None and new_layout.world != args.gpus:
        raise SpecError(
            f"layout: pp*dp*tp*cp = {new_layout.world} but --gpus {args.gpus}; make them "
            "multiply to the GPU count"
        )
    split, recompute_layers = _split(args, plan, model, new_layout, relaid)
    predicted = plan.predicted.to_dict() if changed else None
    if predicted is not None:
        predicted.pop("intervals", None)
    return Setup(model, cluster, training, new_layout, target, dispatcher, split,
                 recompute_layers, predicted, changed)  # fmt: skip


def _given(args: argparse.Namespace) -> tuple[str, ...]:
    """The flags given that change a plan's setting, as typed: ("--tp 4", "--no-flash")."""
    names = ("model", "cluster", "nodes", "target", "memory_margin", "dispatcher",
             "global_batch", "num_microbatches", "recompute", "recompute_modules", "zero",
             "fsdp", *LAYOUT_FLAGS, *TRAINING_FLAGS)  # fmt: skip
    out = []
    for name in names:
        value = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            out.append(f"{flag} {value}")
    if args.no_flash:
        out.append("--no-flash")
    return tuple(out)


def _training(args: argparse.Namespace, training: TrainingSpec, cluster: ClusterSpec):
    """The plan's training with the training flags given."""
    from planner.targets import memory_margin_gib

    fields = {field: getattr(args, flag) for flag, field in TRAINING_FLAGS.items()
              if getattr(args, flag) is not None}  # fmt: skip
    if args.no_flash:
        fields["flash_attention"] = False
    if args.zero is not None or args.fsdp is not None:
        fields.update(zero=bool(args.zero), fsdp=bool(args.fsdp))
    if args.memory_margin is not None:
        fields["memory_margin_gib"] = memory_margin_gib(
            args.memory_margin, cluster.device.memory_gib, cluster.framework_overhead_gib
        )
    return replace(training, **fields)


def _layout(args: argparse.Namespace, parallel: ParallelConfig, training: TrainingSpec):
    """The plan's layout with the layout flags given: the sizes given replace the plan's; the
    micro-batches follow --num-microbatches, else --global-batch (or the plan's global batch
    when dp or the micro-batch changed); recompute follows --recompute / --recompute-modules."""
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else getattr(parallel, k)
             for k in LAYOUT_FLAGS}  # fmt: skip
    batch = args.global_batch
    if batch is None and args.num_microbatches is None:
        batch = training.global_batch
    ns = argparse.Namespace(**sizes, global_batch=batch, num_microbatches=args.num_microbatches)
    m, _ = microbatches(ns)
    if args.recompute is None and args.recompute_modules is None:
        recompute, modules = parallel.recompute, parallel.recompute_modules
    else:
        recompute, modules = recompute_choice(args)
    return ParallelConfig(**sizes, num_microbatches=m, recompute=recompute,  # type: ignore[arg-type]
                          recompute_modules=modules)  # type: ignore[arg-type]  # fmt: skip


def _split(args: argparse.Namespace, plan: Any, model: ModelSpec, par: ParallelConfig,
           relaid: bool) -> tuple[Any, Any]:  # fmt: skip
    """(stage layers, recompute layers): the plan's while its layout and model are kept,
    else an even split (or the accounted one with --split accounted) and the policy's."""
    from planner.calibrate.runs import accounted_split

    if not relaid:
        return (tuple(tuple(s.layers) for s in plan.stages),
                tuple(tuple(s.recompute_layers) for s in plan.stages))  # fmt: skip
    if args.split == "accounted":
        return accounted_split(model.num_layers, par.pp), None
    return None, None


def microbatches(args: argparse.Namespace) -> tuple[int, int]:
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


def recompute_choice(args: argparse.Namespace) -> tuple[str, tuple[str, ...]]:
    """(policy, modules) from --recompute and --recompute-modules; modules alone mean
    selective recompute; --memory-budget B is the module budget:B."""
    budget = getattr(args, "memory_budget", None)
    if budget is not None:
        if args.recompute_modules is not None or args.recompute not in (None, "selective"):
            raise SpecError("--memory-budget: drop --recompute / --recompute-modules beside it")
        return "selective", (budget_module(budget),)
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
