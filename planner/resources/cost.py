"""The resource model's two entry points: the stage IP's inputs and the full estimate.

- `stage_cost_inputs(...) -> StageCostInputs`: one UnitCost per layer plus first/last stage
  extras and usable memory (the contract in planner/resources/units.py).
- `estimate(...) -> Estimate`: memory and time per stage by component, communication by
  level and kind, step time under 1F1B, tokens/s, TFLOPS per GPU and MFU for one split.
- `memory_lower_bound_gib(...)`: a cheap lower bound on the peak stage memory of any split.

Step time (RESOURCE_MODEL.md, "Step time"):
    slot = max_i stage_time_i + p2p (forward activation + backward gradient per micro-batch)
    step = (m + pp - 1) * slot + exposed gradient reduction + optimizer step
    bubble = (pp - 1) / (m + pp - 1);  MFU = model FLOPs / (step * world * peak)
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.resources import comm
from planner.resources.compute import TRAIN_FACTOR, model_flops_per_sequence
from planner.resources.layer_cost import (
    Dispatcher,
    ExtrasCost,
    LayerCost,
    check_layout,
    effective_recompute,
    first_extras,
    last_extras,
    layer_costs,
)
from planner.resources.memory import Accounting, StateBytes, act_bytes_per_element
from planner.resources.units import StageCostInputs, StageExtras, UnitCost
from planner.specs import GIB, ClusterSpec, ModelSpec, SpecError, TrainingSpec


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage on one rank. memory_gib: (component, GiB) incl. framework overhead;
    time_s: (component, s) for one micro-batch, forward + backward."""

    stage: int
    layers: tuple[int, ...]
    recompute_layers: tuple[int, ...]
    in_flight: int
    memory_gib: tuple[tuple[str, float], ...]
    total_gib: float
    time_s: tuple[tuple[str, float], ...]
    total_s: float


@dataclass(frozen=True)
class Estimate:
    """Prediction for one layout and split (per rank; times in s, memory in GiB)."""

    step_time_s: float
    mfu: float
    tflops_per_gpu: float
    tokens_per_s: float
    bubble_fraction: float
    stages: tuple[StageEstimate, ...]
    comm_s: tuple[tuple[str, float], ...]  # per step, on the bottleneck stage, by kind_level
    exposed_comm_s: float
    usable_memory_gib: float
    fits: bool
    reason: str
    model_flops_per_step: float
    slot_s: float  # max stage time + p2p: one 1F1B slot
    optimizer_s: float
    dp_exposed_s: float
    used_measured_tables: tuple[str, ...]

    @property
    def memory_gib_per_stage(self) -> tuple[float, ...]:
        return tuple(s.total_gib for s in self.stages)


def even_split(num_layers: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous split of layers over pp stages; the first stages get the extra layer."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def usable_memory_bytes(cluster: ClusterSpec) -> float:
    """Device memory minus the framework overhead (context, allocator slack, workspaces)."""
    return (cluster.device.memory_gib - cluster.framework_overhead_gib) * GIB


def stage_cost_inputs(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> StageCostInputs:
    """Per-layer UnitCosts, first/last stage extras and usable memory for the stage IP.

    When recompute is allowed, usable memory also reserves the recompute workspace: what
    recomputing the largest layer re-materializes during its backward pass (its activations
    minus those it keeps).
    """
    check_layout(model, cluster, parallel)
    costs = layer_costs(model, cluster, training, parallel, dispatcher, accounting)
    units = tuple(
        UnitCost(
            layer=c.layer,
            kind=c.kind,
            time_s=c.time_s,
            time_recompute_s=c.time_recompute_s,
            state_bytes=c.state.total,
            act_bytes=c.act.total,
            act_recompute_bytes=c.act_recompute.total,
        )
        for c in costs
    )
    first = first_extras(model, training, parallel, accounting)
    last = last_extras(model, cluster, training, parallel, accounting)
    allowed = effective_recompute(training, parallel) != "none"
    usable = usable_memory_bytes(cluster)
    if allowed:
        usable -= max(c.act.total - c.act_recompute.total for c in costs)
    return StageCostInputs(
        units=units,
        first=StageExtras(first.time_s, first.state.total, first.act_bytes),
        last=StageExtras(last.time_s, last.state.total, last.act_bytes),
        usable_memory_bytes=usable,
        pp=parallel.pp,
        num_microbatches=parallel.num_microbatches,
        recompute_allowed=allowed,
    )


def _check_split(split: Sequence[Sequence[int]], num_layers: int, pp: int) -> None:
    flat = [i for stage in split for i in stage]
    if len(split) != pp or flat != list(range(num_layers)) or any(not s for s in split):
        raise SpecError(
            f"stage_layers: need {pp} non-empty contiguous stages covering layers "
            f"0..{num_layers - 1} in order, got {[list(s) for s in split]}"
        )


def _flatten(recompute_layers: Iterable[int] | Iterable[Iterable[int]]) -> set[int]:
    out: set[int] = set()
    for item in recompute_layers:
        if isinstance(item, numbers.Integral):
            out.add(int(item))
        else:
            out.update(int(i) for i in item)
    return out


def _stage_estimate(
    stage: int,
    layers: tuple[int, ...],
    recomputed: set[int],
    costs: tuple[LayerCost, ...],
    extras: list[ExtrasCost],
    in_flight: int,
    cluster: ClusterSpec,
) -> StageEstimate:
    """Memory by component (GiB) and time by component (s) of one stage."""
    state = sum((costs[i].state for i in layers), StateBytes())
    state = sum((e.state for e in extras), state)
    act = sum((costs[i].act_recompute if i in recomputed else costs[i].act).total for i in layers)
    act += sum(e.act_bytes for e in extras)
    rc = [costs[i].act.total - costs[i].act_recompute.total for i in layers if i in recomputed]
    memory = (
        ("weights", state.weights / GIB),
        ("grads", state.grads / GIB),
        ("optimizer", state.optimizer / GIB),
        ("activations", in_flight * act / GIB),
        ("recompute_workspace", max(rc, default=0.0) / GIB),
        ("framework", cluster.framework_overhead_gib),
    )
    time: dict[str, float] = {}
    for i in layers:
        for w in costs[i].work:
            time[w.name] = time.get(w.name, 0.0) + w.time_s
        for name, s in costs[i].comm_s:
            time[name] = time.get(name, 0.0) + s
        if i in recomputed:
            time["recompute"] = time.get("recompute", 0.0) + costs[i].recompute_extra_s
    for e in extras:
        for w in e.work:
            time[w.name] = time.get(w.name, 0.0) + w.time_s
    time_s = tuple(sorted(time.items()))
    return StageEstimate(
        stage=stage,
        layers=layers,
        recompute_layers=tuple(sorted(recomputed & set(layers))),
        in_flight=in_flight,
        memory_gib=memory,
        total_gib=sum(v for _, v in memory),
        time_s=time_s,
        total_s=sum(v for _, v in time_s),
    )


def _grad_sync_s(
    layers: tuple[int, ...],
    costs: tuple[LayerCost, ...],
    extras: list[ExtrasCost],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> list[tuple[str, float]]:
    """Gradient reduction of one stage at the end of the step: dense gradients over dp (ranks
    tp apart), expert gradients over edp (ranks ep apart). All-reduce, or with ZeRO a
    reduce-scatter of gradients + all-gather of updated weights: the same bytes (2 passes)."""
    grad_b = training.bytes_per_param - 14  # 2 (paper's 16 B/param) or 4 (Megatron's 18)
    dense = sum(costs[i].params_dense for i in layers) + sum(e.params_dense for e in extras)
    expert = sum(costs[i].params_expert for i in layers) + sum(e.params_expert for e in extras)
    out = []
    t, level = comm.ring_allreduce_s(cluster, parallel.dp, parallel.tp, grad_b * dense)
    if level:
        out.append((f"dp_{level}", t))
    t, level = comm.ring_allreduce_s(cluster, parallel.edp, parallel.ep, grad_b * expert)
    if level:
        out.append((f"edp_{level}", t))
    return out


def _p2p_s(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig
) -> tuple[float, str, tuple[str, ...]]:
    """Per micro-batch and stage boundary: the activation forward and its gradient backward,
    a (b s / tp) d bytes each, between ranks dp*tp apart (the next stage's block)."""
    if parallel.pp == 1:
        return 0.0, "", ()
    a = act_bytes_per_element(training)
    nbytes = a * parallel.micro_batch * training.seq_len / parallel.tp * model.hidden_size
    t, level, tables = comm.p2p_time_s(cluster, (0, parallel.dp * parallel.tp), nbytes)
    return 2 * t, level, tables


def _optimizer_s(stages: Sequence[StageEstimate], cluster: ClusterSpec) -> float:
    """Adam step, memory-bound: each rank reads and writes its weights, gradients and
    optimizer shard once (2 x state bytes through HBM); the slowest stage sets it."""
    worst = 0.0
    for st in stages:
        state_gib = sum(v for n, v in st.memory_gib if n in ("weights", "grads", "optimizer"))
        worst = max(worst, 2 * state_gib * GIB / (cluster.device.hbm_gbps * 1e9))
    return worst


def estimate(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    stage_layers: Sequence[Sequence[int]] | None = None,
    recompute_layers: Iterable[int] | Iterable[Iterable[int]] | None = None,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> Estimate:
    """Predict memory, time and throughput of one layout and layer split.

    Args:
        stage_layers: layer indices per stage (contiguous); None = even split, first stages
            get the extra layer.
        recompute_layers: layers whose activations are recomputed (flat, or one tuple per
            stage); None = every layer when the recompute policy is not "none".
        dispatcher: "flat" or "halo" all-to-all for the MoE dispatch/combine.
        accounting: "piper" (full model) or "paper" (the paper's equations, for checks).
    """
    check_layout(model, cluster, parallel)
    pp, m = parallel.pp, parallel.num_microbatches
    split = tuple(tuple(s) for s in (stage_layers or even_split(model.num_layers, pp)))
    _check_split(split, model.num_layers, pp)
    policy = effective_recompute(training, parallel)
    if recompute_layers is None:
        recomputed = set(range(model.num_layers)) if policy != "none" else set()
    else:
        recomputed = _flatten(recompute_layers)
    costs = layer_costs(model, cluster, training, parallel, dispatcher, accounting)
    first = first_extras(model, training, parallel, accounting)
    last = last_extras(model, cluster, training, parallel, accounting)
    stages = []
    for i, layers in enumerate(split):
        extras = ([first] if i == 0 else []) + ([last] if i == pp - 1 else [])
        stages.append(
            _stage_estimate(i, layers, recomputed, costs, extras, min(pp - i, m), cluster)
        )
    return _assemble(model, cluster, training, parallel, stages, costs, [first, last])


def _assemble(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    stages: list[StageEstimate],
    costs: tuple[LayerCost, ...],
    ends: list[ExtrasCost],
) -> Estimate:
    """Step time, throughput, communication summary and the fit verdict from the stages."""
    pp, m = parallel.pp, parallel.num_microbatches
    p2p_s, p2p_level, p2p_tables = _p2p_s(model, cluster, training, parallel)
    bottleneck = max(stages, key=lambda st: (st.total_s, -st.stage))
    slot = bottleneck.total_s + p2p_s
    # Stage i finishes its last backward about i slots before stage 0 does, so its gradient
    # reduction overlaps that much backward work (2/3 of a slot each).
    dp_exposed, dp_comm = 0.0, {}
    for st in stages:
        extras = ([ends[0]] if st.stage == 0 else []) + ([ends[1]] if st.stage == pp - 1 else [])
        sync = _grad_sync_s(st.layers, costs, extras, cluster, training, parallel)
        total = sum(s for _, s in sync)
        dp_exposed = max(dp_exposed, total - st.stage * slot * 2 / TRAIN_FACTOR)
        for name, s in sync:
            dp_comm[name] = max(dp_comm.get(name, 0.0), s)
    optimizer_s = _optimizer_s(stages, cluster)
    step = (m + pp - 1) * slot + dp_exposed + optimizer_s
    layer_comm = {n: m * s for n, s in bottleneck.time_s if n.startswith(("a2a_", "tp_"))}
    if p2p_level:
        layer_comm[f"p2p_{p2p_level}"] = m * p2p_s
    comm_s = tuple(sorted({**layer_comm, **dp_comm}.items()))
    per_slot_comm = sum(s for n, s in bottleneck.time_s if n.startswith(("a2a_", "tp_")))
    exposed = (m + pp - 1) * (per_slot_comm + p2p_s) + dp_exposed
    flops = model_flops_per_sequence(model, cluster, training) * parallel.global_batch
    tflops = flops / (step * parallel.world) / 1e12
    usable = usable_memory_bytes(cluster) / GIB
    over = [st for st in stages if st.total_gib > cluster.device.memory_gib]
    reason = ""
    if over:
        st = max(over, key=lambda s: s.total_gib)
        reason = (
            f"stage {st.stage} needs {st.total_gib:.1f} GiB > {cluster.device.memory_gib:.1f} "
            f"GiB on {cluster.device.name} ({usable:.1f} usable after "
            f"{cluster.framework_overhead_gib:.1f} GiB framework overhead)"
        )
    tables = {t for c in costs for t in c.tables} | set(p2p_tables)
    tables |= {t for e in ends for w in e.work for t in w.tables}
    return Estimate(
        step_time_s=step,
        mfu=tflops / cluster.device.peak(training.dtype),
        tflops_per_gpu=tflops,
        tokens_per_s=parallel.global_batch * training.seq_len / step,
        bubble_fraction=(pp - 1) / (m + pp - 1),
        stages=tuple(stages),
        comm_s=comm_s,
        exposed_comm_s=exposed,
        usable_memory_gib=usable,
        fits=not over,
        reason=reason,
        model_flops_per_step=flops,
        slot_s=slot,
        optimizer_s=optimizer_s,
        dp_exposed_s=dp_exposed,
        used_measured_tables=tuple(sorted(tables)),
    )


def memory_lower_bound_gib(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> float:
    """A lower bound (GiB, incl. framework overhead) on the memory of the most loaded stage
    under ANY split of the layers and any per-layer recompute choice. It is the largest of:
    - stage 0 holds the embedding and at least layer 0 (stages are non-empty) with
      min(pp, m) micro-batches in flight, each layer at its smallest activation;
    - the last stage holds the head (and MTP) and at least the last layer, 1 in flight;
    - some stage holds at least the average training state (total state / pp).
    Infeasible when it exceeds device memory; no split can do better."""
    check_layout(model, cluster, parallel)
    pp, m = parallel.pp, parallel.num_microbatches
    costs = layer_costs(model, cluster, training, parallel)
    first = first_extras(model, training, parallel)
    last = last_extras(model, cluster, training, parallel)
    recompute = effective_recompute(training, parallel) != "none"

    def act(c: LayerCost) -> float:
        return min(c.act.total, c.act_recompute.total) if recompute else c.act.total

    c0, cl = costs[0], costs[-1]
    s0 = first.state.total + c0.state.total + min(pp, m) * (first.act_bytes + act(c0))
    if pp == 1:
        s0 += last.state.total + last.act_bytes
    s_last = last.state.total + cl.state.total + last.act_bytes + act(cl)
    total_state = sum(c.state.total for c in costs) + first.state.total + last.state.total
    bound = max(s0, s_last, total_state / pp)
    return bound / GIB + cluster.framework_overhead_gib


def estimate_to_dict(est: Estimate) -> dict:
    """A JSON-ready dict of `est` (components as mappings, stage lists in stage order)."""
    return {
        "step_time_s": est.step_time_s,
        "tokens_per_s": est.tokens_per_s,
        "tflops_per_gpu": est.tflops_per_gpu,
        "mfu": est.mfu,
        "bubble_fraction": est.bubble_fraction,
        "slot_s": est.slot_s,
        "exposed_comm_s": est.exposed_comm_s,
        "dp_exposed_s": est.dp_exposed_s,
        "optimizer_s": est.optimizer_s,
        "model_flops_per_step": est.model_flops_per_step,
        "usable_memory_gib": est.usable_memory_gib,
        "fits": est.fits,
        "reason": est.reason,
        "comm_s": dict(est.comm_s),
        "used_measured_tables": list(est.used_measured_tables),
        "stages": [
            {
                "stage": st.stage,
                "layers": list(st.layers),
                "recompute_layers": list(st.recompute_layers),
                "in_flight": st.in_flight,
                "memory_gib": dict(st.memory_gib),
                "total_gib": st.total_gib,
                "time_s": dict(st.time_s),
                "total_s": st.total_s,
            }
            for st in est.stages
        ],
    }
