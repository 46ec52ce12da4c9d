"""Inputs of `piper migrate`: the model and cluster that price moves, rank devices, start.

Defaults: without --plan or --model, the model is the first preset of `PREFERRED_MODELS`
(then any preset, alphabetically) whose routed-expert count equals the trace's; the cluster
is frontier; EP rank r sits on device r (a contiguous group starting at device 0); expert e
starts on rank e // (E / R). With --plan, the plan's model, cluster, training, ranks table
(the device of EP rank r for the stage holding the layer) and experts table are used; a
--model or --cluster that names another, or a trace layer that is not one of the plan's MoE
layers, is a SpecError.

Shape letters: L trace layers, R EP ranks, S slots per rank, E experts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from planner.migration.placement import (
    ABSENT,
    default_rank_of_expert,
    initial_slots,
    slots_of_ranks,
)
from planner.migration.pricing import MoveCosts, build_move_costs
from planner.migration.recorded import plan_tokens_per_rank_step
from planner.migration.trace import Trace, check_divisible
from planner.plan import Plan, load_plan
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec

log = logging.getLogger(__name__)

PREFERRED_MODELS = ("mixtral-8x7b", "deepseek-v2-lite", "qwen3-30b-a3b", "deepseek-v3")
DEFAULT_CLUSTER = "frontier"
# What Piper's runtime sends per parameter when it moves an expert: its fp32 weights, fp32
# gradients and the two fp32 Adam moments (runtime/migrate.py slot_views). The piper target's
# 18 B also count the bf16 copies a bf16 step computes with, which a move does not carry.
RUNTIME_MOVE_BYTES_PER_PARAM = 16
DEFAULT_MICROBATCHES = 8  # without a plan: 8 sequences of seq_len tokens per EP rank and step


@dataclass(frozen=True, eq=False)
class MigrateSetup:
    """Everything the replay needs besides the trace and the policy options."""

    model: ModelSpec
    cluster: ClusterSpec
    costs: MoveCosts
    initial_LRS: np.ndarray  # placement in force during interval 0
    devices_LR: tuple[tuple[int, ...], ...]
    steps_per_interval: int
    tokens_per_rank_step: int
    layer_ids: tuple[int, ...]


def pick_model(num_experts: int, name: str | None) -> ModelSpec:
    """--model, or the first preset with the trace's expert count."""
    from planner.inputs.models import list_model_presets, load_model

    if name:
        model = load_model(name)
        if model.num_experts != num_experts:
            raise SpecError(
                f"--model {name} has {model.num_experts} routed experts but the trace has "
                f"{num_experts}; pick a model with {num_experts} experts"
            )
        return model
    presets = list_model_presets()
    order = [p for p in PREFERRED_MODELS if p in presets] + sorted(presets)
    for preset in order:
        model = load_model(preset)
        if model.num_experts == num_experts:
            log.info("pricing moves with model %s (%d experts)", preset, num_experts)
            return model
    raise SpecError(
        f"no model preset has {num_experts} routed experts; pass --model with a config.json"
    )


def _training(plan: Plan) -> TrainingSpec:
    names = {f.name for f in fields(TrainingSpec)} - {"extra"}
    kwargs = {k: v for k, v in plan.training.items() if k in names}
    try:
        return TrainingSpec(**kwargs)
    except TypeError as exc:
        raise SpecError(f"plan training: {exc}; regenerate the plan with 'piper plan'") from None


def _move_training(plan: Plan) -> TrainingSpec:
    """The plan's training as a move prices it: a plan made for Piper's runtime moves what the
    runtime sends (RUNTIME_MOVE_BYTES_PER_PARAM per parameter)."""
    training = _training(plan)
    if plan.extra.get("target", "piper") == "piper":
        training = replace(training, bytes_per_param=RUNTIME_MOVE_BYTES_PER_PARAM)
    return training


def _plan_devices(plan: Plan, cluster: ClusterSpec, layer: int, ranks: int) -> tuple[int, ...]:
    """Device of each EP rank for the stage that holds `layer` (lowest global rank wins)."""
    stage = next((s.stage for s in plan.stages if layer in s.layers), 0)
    devices: dict[int, int] = {}
    for row in sorted(plan.ranks, key=lambda r: r.rank):
        if row.stage == stage and row.ep not in devices:  # ep folds over dp*tp
            devices[row.ep] = row.node * cluster.gpus_per_node + row.local_rank
    if sorted(devices) != list(range(ranks)):
        raise SpecError(
            f"plan ranks table: stage {stage} does not list EP ranks 0..{ranks - 1}; "
            f"regenerate the plan with 'piper plan'"
        )
    return tuple(devices[r] for r in range(ranks))


def plan_move_costs(
    plan: Plan,
    model: ModelSpec,
    layer_ids: Sequence[int],
    plan_layer_ids: Sequence[int],
    steps_per_interval: int,
    tokens_per_rank_step: int,
    where: str = "plan.json",
) -> MoveCosts:
    """The prices `piper migrate --plan` uses, for the given layers of `model`.

    Links and rank devices come from the plan's cluster and ranks table, bytes per parameter
    (for a plan made for Piper's runtime, what the runtime sends:
    RUNTIME_MOVE_BYTES_PER_PARAM) and dtype from its training section; expert sizes and
    compute from `model`, which may be the plan's model or a scaled copy of it (`piper run
    --scale`).

    Args:
        layer_ids: layer index in `model` of each priced row (length L, MoE layers).
        plan_layer_ids: the plan's layer index of each row; its stage gives the EP devices.
        steps_per_interval: training steps between two placement decisions.
        tokens_per_rank_step: tokens each EP rank feeds its MoE layers per step.
    """
    cluster = plan.cluster_spec(where)
    ranks = plan.parallel.ep
    devices = tuple(_plan_devices(plan, cluster, layer, ranks) for layer in plan_layer_ids)
    training = _move_training(plan)
    return build_move_costs(
        model, cluster, layer_ids, devices, steps_per_interval, tokens_per_rank_step, training
    )


def _plan_start(plan: Plan, trace: Trace, ranks: int, redundant_slots: int) -> list[np.ndarray]:
    """slots_RS per trace layer from the plan's experts table (with its `slots`, if any);
    a layer the table lacks starts from the default placement."""
    table = {p.layer: p for p in plan.experts}
    out = []
    for layer in trace.layer_ids:
        entry = table.get(layer)
        if entry is not None and entry.slots:
            held = [e for row in entry.slots for e in row]
            if len(entry.rank_of_expert) != trace.num_experts or len(entry.slots) != ranks:
                raise SpecError(
                    f"plan experts table, layer {layer}: slots for {len(entry.rank_of_expert)} "
                    f"experts on {len(entry.slots)} ranks, the trace has {trace.num_experts} "
                    f"experts on --ep {ranks}; use the trace recorded for this plan"
                )
            if redundant_slots not in (-1, len(held) - trace.num_experts):
                raise SpecError(
                    f"--redundant-slots {redundant_slots}: the plan gives layer {layer} "
                    f"{len(held) - trace.num_experts} redundant slots; drop the flag to use them"
                )
            out.append(slots_of_ranks(entry.slots))
            continue
        row = np.asarray(entry.rank_of_expert if entry else (), dtype=np.int64)
        if row.size == 0:
            row = default_rank_of_expert(trace.num_experts, ranks)
        counts = np.bincount(row, minlength=ranks)
        if len(row) != trace.num_experts or row.max() >= ranks or (counts != counts[0]).any():
            raise SpecError(
                f"plan experts table, layer {layer}: needs {trace.num_experts} ranks in "
                f"0..{ranks - 1}, E/R per rank; regenerate the plan with 'piper plan'"
            )
        out.append(initial_slots(row, ranks, max(redundant_slots, 0)))
    return out


def _stack(slots_L: list[np.ndarray]) -> np.ndarray:
    """(L, R, S) from per-layer slots, narrower layers padded with ABSENT."""
    width = max(s.shape[1] for s in slots_L)
    out = np.full((len(slots_L), slots_L[0].shape[0], width), ABSENT, dtype=np.int64)
    for lj, slots_RS in enumerate(slots_L):
        out[lj, :, : slots_RS.shape[1]] = slots_RS
    return out


def _model_and_cluster(
    trace: Trace,
    plan: Plan | None,
    plan_path: str | None,
    model_name: str | None,
    cluster_name: str | None,
) -> tuple[ModelSpec, ClusterSpec]:
    """--model / --cluster, else the plan's, else the defaults (module docstring)."""
    from planner.inputs.clusters import load_cluster

    if plan is None:
        return pick_model(trace.num_experts, model_name), load_cluster(
            cluster_name or DEFAULT_CLUSTER
        )
    model = plan.model_spec(str(plan_path))
    if (
        model_name
        and model_name != plan.model.name
        and pick_model(model.num_experts, model_name) != model
    ):
        raise SpecError(
            f"--model {model_name} contradicts {plan_path}'s model {plan.model.name}; drop --model"
        )
    if model.num_experts != trace.num_experts:
        raise SpecError(
            f"{plan_path}: its model has {model.num_experts} experts, the trace "
            f"{trace.num_experts}; use the trace recorded for this plan's model"
        )
    not_moe = [i for i in trace.layer_ids if i >= model.num_layers or not model.layers[i].moe]
    if not_moe:
        raise SpecError(
            f"{trace.source or 'trace'}: layer {not_moe[0]} is not an MoE layer of {plan_path}'s "
            f"model {model.name}; use the trace recorded for this plan"
        )
    # moves are priced on the very cluster the plan was made for
    cluster = plan.cluster_spec(str(plan_path))
    if cluster_name and load_cluster(cluster_name).name != cluster.name:
        raise SpecError(
            f"--cluster {cluster_name} contradicts {plan_path}'s cluster {cluster.name}; "
            f"drop --cluster"
        )
    return model, cluster


def migrate_setup(
    trace: Trace,
    ranks: int,
    plan_path: str | None = None,
    model_name: str | None = None,
    cluster_name: str | None = None,
    steps_per_interval: int = 100,
    tokens_per_rank_step: int | None = None,
    redundant_slots: int | None = None,
    plan: Plan | None = None,
) -> MigrateSetup:
    """Resolve model, cluster, rank devices, start placement and prices for a replay.

    redundant_slots: spare slots over the whole EP group (placement.slot_counts spreads
    them), empty at interval 0; None = the plan's (its experts' `slots`), else none.
    plan: the plan at plan_path when the caller has read it already.
    """
    check_divisible(trace, ranks)
    if redundant_slots is not None and redundant_slots < 0:
        raise SpecError(f"--redundant-slots must be >= 0, got {redundant_slots}")
    most = (ranks - 1) * trace.num_experts  # beyond, some rank has a slot for every expert
    if redundant_slots is not None and redundant_slots > most:
        raise SpecError(
            f"--redundant-slots {redundant_slots}: at most {most} for {trace.num_experts} "
            f"experts on {ranks} ranks (then every rank holds a copy of every expert)"
        )
    wanted = -1 if redundant_slots is None else redundant_slots
    if plan is None and plan_path:
        plan = load_plan(plan_path)
    if plan is not None and plan.parallel.ep != ranks:
        raise SpecError(
            f"{plan_path}: the plan has ep={plan.parallel.ep}; pass --ep {plan.parallel.ep}"
        )
    model, cluster = _model_and_cluster(trace, plan, plan_path, model_name, cluster_name)
    if ranks > cluster.total_gpus:
        raise SpecError(f"--ep {ranks} exceeds the {cluster.total_gpus} devices of {cluster.name}")
    training = _move_training(plan) if plan is not None else TrainingSpec()
    if plan is not None:
        devices = tuple(_plan_devices(plan, cluster, layer, ranks) for layer in trace.layer_ids)
        start_L = _plan_start(plan, trace, ranks, wanted)
        per_step = plan_tokens_per_rank_step(plan)
    else:
        devices = tuple(tuple(range(ranks)) for _ in trace.layer_ids)
        start = default_rank_of_expert(trace.num_experts, ranks)
        start_L = [initial_slots(start, ranks, max(wanted, 0))] * trace.num_layers
        per_step = training.seq_len * DEFAULT_MICROBATCHES
    tokens = tokens_per_rank_step or per_step
    costs = build_move_costs(
        model, cluster, trace.layer_ids, devices, steps_per_interval, tokens, training
    )
    return MigrateSetup(
        model, cluster, costs, _stack(start_L), devices, steps_per_interval, tokens, trace.layer_ids
    )
