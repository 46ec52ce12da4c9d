"""The resource model's two entry points: the stage IP's inputs and the full estimate.

- `stage_cost_inputs(...) -> StageCostInputs`: one UnitCost per layer plus first/last stage
  extras and usable memory (the contract in planner/resources/stage_inputs.py).
- `estimate(...) -> Estimate`: memory and time per stage by component, communication by
  level and kind, step time under 1F1B, tokens/s, TFLOPS per GPU and MFU for one split.
- `memory_lower_bound_gib(...)`: a cheap lower bound on the peak stage memory of any split.

Step time (RESOURCE_MODEL.md, "Step time"):
    slot = max_i stage_time_i + p2p (forward activation + backward gradient per micro-batch)
    step = (m + (pp - 1) / vp) * slot + unpaired warm-up + first FSDP gather
           + exposed gradient reduction + optimizer step
    bubble = ((pp - 1) / vp) / (m + (pp - 1) / vp);  MFU = model FLOPs / (step * world * peak)
The model's MTP layers are TrainingSpec.mtp_layers when set (layer_cost.with_mtp).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from planner.parallel import ParallelConfig
from planner.resources import interleave, traffic
from planner.resources.flops import flops_per_token
from planner.resources.layer_cost import (
    Dispatcher,
    ExtrasCost,
    LayerCost,
    check_layout,
    effective_recompute,
    first_extras,
    last_extras,
    layer_costs,
    with_index,
    with_mtp,
)
from planner.resources.memory import Accounting
from planner.resources.schedule import (
    StageEstimate,
    held_params,
    stage_estimate,
    stage_extras,
    step_time,
)
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost
from planner.specs import GIB, ClusterSpec, LayerSpec, ModelSpec, SpecError, TrainingSpec


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
    # What the per-stage totals are held against. The totals include the framework overhead
    # as a component, so this is the whole device memory (the stage IP's contract instead
    # subtracts the overhead: StageCostInputs.usable_memory_bytes).
    usable_memory_gib: float
    fits: bool
    reason: str
    model_flops_per_step: float
    slot_s: float  # max stage time + p2p: one 1F1B slot
    optimizer_s: float
    dp_exposed_s: float
    used_measured_tables: tuple[str, ...]
    unpaired_s: float = 0.0  # all-to-all overlap: warm-up/cool-down that runs unpaired
    fsdp_first_gather_s: float = 0.0  # FSDP: the step's first all-gather, not hidden
    memory_margin_gib: float = 0.0  # kept free on every stage: fits means total <= mem - this

    @property
    def memory_gib_per_stage(self) -> tuple[float, ...]:
        return tuple(s.total_gib for s in self.stages)

    @property
    def headroom_gib_per_stage(self) -> tuple[float, ...]:
        """Device memory left free on each stage (GiB; negative = over)."""
        return tuple(self.usable_memory_gib - s.total_gib for s in self.stages)

    @property
    def fits_without_margin(self) -> bool:
        return all(h >= 0 for h in self.headroom_gib_per_stage)


def even_split(num_layers: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous split of layers over pp stages; the first stages get the extra layer."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for i in range(pp):
        n = base + (1 if i < extra else 0)
        out.append(tuple(range(start, start + n)))
        start += n
    return tuple(out)


def usable_memory_bytes(cluster: ClusterSpec, margin_gib: float = 0.0) -> float:
    """Device memory minus the framework overhead (context, allocator slack, workspaces) and
    the memory margin kept free (TrainingSpec.memory_margin_gib)."""
    return (cluster.device.memory_gib - cluster.framework_overhead_gib - margin_gib) * GIB


def _uniform(unit: UnitCost) -> UnitCost:
    """The unit as recomputed: the engine recomputes every layer, so there is no choice."""
    return replace(unit, time_s=unit.time_recompute_s, act_bytes=unit.act_recompute_bytes)


def _workspace_reserve(costs: tuple[LayerCost, ...], ends: Sequence[ExtrasCost]) -> float:
    """Per workspace kind, the largest over all layers and roles, summed (bytes)."""
    worst: dict[str, float] = {}
    for ws in [c.workspace for c in costs] + [e.workspace for e in ends]:
        for name, nbytes in ws:
            worst[name] = max(worst.get(name, 0.0), nbytes)
    return sum(worst.values())


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
    minus those it keeps); it always reserves the largest transient workspace of each kind
    (FSDP's gathered units, the cp ring's K/V buffers). Activations are per live
    chunk-micro-batch (per micro-batch / vp), the unit StageCostInputs.in_flight counts in.
    """
    model = with_mtp(model, training)
    check_layout(model, cluster, parallel, training, dispatcher)
    costs = layer_costs(model, cluster, training, parallel, dispatcher, accounting)
    vp = parallel.vp
    allowed = effective_recompute(training, parallel) != "none"
    uniform = allowed and training.uniform_recompute
    templates: dict[LayerSpec, UnitCost] = {}
    distinct: dict[LayerSpec, LayerCost] = {}  # equal specs have equal costs: price each once
    units = []
    for c, spec in zip(costs, model.layers, strict=True):
        unit = templates.get(spec)
        if unit is None:
            distinct[spec] = c
            unit = templates[spec] = UnitCost(
                layer=c.layer,
                kind=c.kind,
                time_s=c.time_s,
                time_recompute_s=c.time_recompute_s,
                state_bytes=c.state.total,
                act_bytes=c.act.total / vp,
                act_recompute_bytes=c.act_recompute.total / vp,
            )
            if uniform:
                unit = templates[spec] = _uniform(unit)
        units.append(unit if unit.layer == c.layer else with_index(unit, c.layer))
    first = first_extras(model, cluster, training, parallel, accounting)
    last = last_extras(model, cluster, training, parallel, accounting)
    usable = usable_memory_bytes(cluster, training.memory_margin_gib)
    if allowed:
        usable -= max(c.act.total - c.act_recompute.total for c in distinct.values())
    usable -= _workspace_reserve(costs, (first, last))
    if uniform:
        allowed = False
    return StageCostInputs(
        units=tuple(units),
        first=StageExtras(first.time_s, first.state.total, first.act_bytes / vp),
        last=StageExtras(last.time_s, last.state.total, last.act_bytes / vp),
        usable_memory_bytes=usable,
        pp=parallel.pp,
        num_microbatches=parallel.num_microbatches,
        recompute_allowed=allowed,
        vp=vp,
        a2a_overlap=training.a2a_overlap,
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
        dispatcher: "flat", "halo", "halo-dedup" or "deepep" all-to-all for the MoE
            dispatch/combine.
        accounting: "piper" (full model) or "paper" (the paper's equations, for checks).
    """
    model = with_mtp(model, training)
    check_layout(model, cluster, parallel, training, dispatcher)
    pp, m, vp = parallel.pp, parallel.num_microbatches, parallel.vp
    split = tuple(tuple(s) for s in (stage_layers or even_split(model.num_layers, pp)))
    _check_split(split, model.num_layers, pp)
    policy = effective_recompute(training, parallel)
    if recompute_layers is None or (training.uniform_recompute and policy != "none"):
        recomputed = set(range(model.num_layers)) if policy != "none" else set()
    else:
        recomputed = _flatten(recompute_layers)
    costs = layer_costs(model, cluster, training, parallel, dispatcher, accounting)
    first = first_extras(model, cluster, training, parallel, accounting)
    last = last_extras(model, cluster, training, parallel, accounting)
    stages = []
    for i, layers in enumerate(split):
        extras = stage_extras(i, pp, (first, last))
        live = interleave.live_chunks(i, pp, vp, m, training.a2a_overlap)
        stages.append(stage_estimate(i, layers, recomputed, costs, extras, live, cluster, vp))
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
    step = step_time(model, cluster, training, parallel, stages, costs, ends)
    # model FLOPs in Megatron-Core's convention (flops.py), not the time model's Work.flops
    tokens = parallel.global_batch * training.seq_len
    flops = flops_per_token(model, training.seq_len).total * tokens
    tflops = flops / (step.step_s * parallel.world) / 1e12
    usable = usable_memory_bytes(cluster) / GIB
    margin = training.memory_margin_gib
    limit = cluster.device.memory_gib - margin
    over = [st for st in stages if st.total_gib > limit]
    reason = ""
    if over:
        st = max(over, key=lambda s: s.total_gib)
        inside = st.total_gib <= cluster.device.memory_gib
        reason = (
            f"stage {st.stage} needs {st.total_gib:.1f} GiB"
            + (
                f", inside the {margin:.1f} GiB memory margin ({limit:.1f} GiB of "
                f"{cluster.device.memory_gib:.1f} GiB may be used)"
                if inside
                else f" > {cluster.device.memory_gib:.1f} GiB"
            )
            + f" on {cluster.device.name} ({usable:.1f} usable after "
            f"{cluster.framework_overhead_gib:.1f} GiB framework overhead)"
        )
    tables = {t for c in costs for t in c.tables} | set(step.tables)
    tables |= {t for e in ends for w in e.work for t in w.tables}
    return Estimate(
        step_time_s=step.step_s,
        mfu=tflops / cluster.device.peak(training.dtype),
        tflops_per_gpu=tflops,
        tokens_per_s=parallel.global_batch * training.seq_len / step.step_s,
        bubble_fraction=interleave.bubble_fraction(pp, parallel.vp, m),
        stages=tuple(stages),
        comm_s=step.comm_s,
        exposed_comm_s=step.exposed_comm_s,
        usable_memory_gib=cluster.device.memory_gib,
        fits=not over,
        memory_margin_gib=margin,
        reason=reason,
        model_flops_per_step=flops,
        slot_s=step.slot_s,
        optimizer_s=step.optimizer_s,
        dp_exposed_s=step.dp_exposed_s,
        used_measured_tables=tuple(sorted(tables)),
        unpaired_s=step.unpaired_s,
        fsdp_first_gather_s=step.fsdp_first_gather_s,
    )


def memory_lower_bound_gib(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> float:
    """A lower bound (GiB, incl. framework overhead) on the memory of the most loaded stage
    under ANY split of the layers and any per-layer recompute choice. It is the largest of:
    - stage 0 holds the embedding and at least layer 0 (stages are non-empty) with its live
      chunk-micro-batches in flight (min(pp, m) micro-batches under plain 1F1B), each layer
      at its smallest activation;
    - the last stage holds the head (and MTP) and at least the last layer, with its own;
    - some stage holds at least the average training state (total state / pp).
    Infeasible when it exceeds device memory; no split can do better."""
    model = with_mtp(model, training)
    check_layout(model, cluster, parallel, training)
    pp, m, vp = parallel.pp, parallel.num_microbatches, parallel.vp
    costs = layer_costs(model, cluster, training, parallel)
    first = first_extras(model, cluster, training, parallel)
    last = last_extras(model, cluster, training, parallel)
    recompute = effective_recompute(training, parallel) != "none"

    def act(c: LayerCost) -> float:
        return min(c.act.total, c.act_recompute.total) if recompute else c.act.total

    c0, cl = costs[0], costs[-1]
    live_0 = interleave.live_chunks(0, pp, vp, m, training.a2a_overlap) / vp
    live_last = interleave.live_chunks(pp - 1, pp, vp, m, training.a2a_overlap) / vp
    s0 = first.state.total + c0.state.total + live_0 * (first.act_bytes + act(c0))
    if pp == 1:
        s0 += last.state.total + live_0 * last.act_bytes
    s_last = last.state.total + cl.state.total + live_last * last.act_bytes + live_last * act(cl)
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
        "unpaired_s": est.unpaired_s,
        "fsdp_first_gather_s": est.fsdp_first_gather_s,
        "optimizer_s": est.optimizer_s,
        "model_flops_per_step": est.model_flops_per_step,
        "usable_memory_gib": est.usable_memory_gib,
        "fits": est.fits,
        "fits_without_margin": est.fits_without_margin,
        "memory_margin_gib": est.memory_margin_gib,
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
                "headroom_gib": est.usable_memory_gib - st.total_gib,
                "time_s": dict(st.time_s),
                "total_s": st.total_s,
                "hidden_s": dict(st.hidden_s),
            }
            for st in est.stages
        ],
    }


def predicted_traffic(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    stage_layers: Sequence[Sequence[int]],
    accounting: Accounting = "piper",
) -> dict[str, float]:
    """Bytes all ranks send in one optimizer step, by kind (planner.resources.traffic), for
    this layout and layer split; the parameters each stage reduces come from the same layer
    costs as `estimate` (so does the gradient time)."""
    model = with_mtp(model, training)
    costs = layer_costs(model, cluster, training, parallel, "flat", accounting)
    ends = (first_extras(model, cluster, training, parallel, accounting),
            last_extras(model, cluster, training, parallel, accounting))  # fmt: skip
    held = [
        held_params(layers, costs, stage_extras(i, parallel.pp, ends))
        for i, layers in enumerate(stage_layers)
    ]
    dense, expert = [d for d, _ in held], [e for _, e in held]
    return traffic.step_traffic(model, training, parallel, stage_layers, dense, expert)
