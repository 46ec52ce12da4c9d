"""One training step under (interleaved) 1F1B: per-stage memory and time, then the step time.

`stage_estimate` adds up a stage's layers and roles (memory by component in GiB, time by
component in s per micro-batch); `step_time` turns the stages into the step:
    slot = max_i stage_time_i + p2p (forward activation + backward gradient per micro-batch,
           through each of the rank's vp chunks)
    step = (m + (pp - 1) / vp) * slot + warm-up left unpaired by the all-to-all overlap
           + FSDP's first gather + exposed gradient reduction + optimizer step
Schedule counts: planner.resources.interleave. Formulas: planner/RESOURCE_MODEL.md,
"Step time and MFU".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.resources import comm, interleave, offload, overlap, traffic
from planner.resources.compute import TRAIN_FACTOR
from planner.resources.layer_comm import fsdp_gather_s
from planner.resources.layer_cost import ExtrasCost, LayerCost
from planner.resources.memory import StateBytes, grad_bytes_per_param, weight_bytes_per_param
from planner.specs import GIB, ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline stage on one rank. memory_gib: (component, GiB) incl. framework overhead;
    time_s: (component, s) for one micro-batch, forward + backward (steady phase); in_flight:
    live chunk-micro-batches at peak (micro-batches when vp = 1); hidden_s: communication
    hidden behind compute per micro-batch."""

    stage: int
    layers: tuple[int, ...]
    recompute_layers: tuple[int, ...]
    in_flight: int
    memory_gib: tuple[tuple[str, float], ...]
    total_gib: float
    time_s: tuple[tuple[str, float], ...]
    total_s: float
    hidden_s: tuple[tuple[str, float], ...] = ()


def _workspace_gib(
    layers: tuple[int, ...], costs: tuple[LayerCost, ...], extras: list[ExtrasCost]
) -> list[tuple[str, float]]:
    """Per workspace kind, the largest of the stage's layers and roles (one runs at a time)."""
    out: dict[str, float] = {}
    for ws in [costs[i].workspace for i in layers] + [e.workspace for e in extras]:
        for name, nbytes in ws:
            out[name] = max(out.get(name, 0.0), nbytes / GIB)
    return sorted(out.items())


def stage_estimate(
    stage: int,
    layers: tuple[int, ...],
    recomputed: set[int],
    costs: tuple[LayerCost, ...],
    extras: list[ExtrasCost],
    in_flight: int,
    cluster: ClusterSpec,
    vp: int = 1,
) -> StageEstimate:
    """Memory by component (GiB) and time by component (s) of one stage; `in_flight` live
    chunk-micro-batches, each holding 1/vp of the stage's activations per micro-batch."""
    state = sum((costs[i].state for i in layers), StateBytes())
    state = sum((e.state for e in extras), state)
    act = sum((costs[i].act_recompute if i in recomputed else costs[i].act).total for i in layers)
    act += sum(e.act_bytes for e in extras)
    rc = [costs[i].act.total - costs[i].act_recompute.total for i in layers if i in recomputed]
    memory = (
        ("weights", state.weights / GIB),
        ("grads", state.grads / GIB),
        ("optimizer", state.optimizer / GIB),
        ("activations", in_flight * act / vp / GIB),
        ("recompute_workspace", max(rc, default=0.0) / GIB),
        *_workspace_gib(layers, costs, extras),
        ("framework", cluster.framework_overhead_gib),
    )
    time: dict[str, float] = {}
    hidden: dict[str, float] = {}
    for i in layers:
        for w in costs[i].work:
            time[w.name] = time.get(w.name, 0.0) + w.time_s
        for name, s in costs[i].comm_s:
            time[name] = time.get(name, 0.0) + s
        for name, s in costs[i].hidden_s:
            hidden[name] = hidden.get(name, 0.0) + s
        if i in recomputed:
            time["recompute"] = time.get("recompute", 0.0) + costs[i].recompute_extra_s
    for e in extras:
        for w in e.work:
            time[w.name] = time.get(w.name, 0.0) + w.time_s
        for name, s in e.comm_s:
            time[name] = time.get(name, 0.0) + s
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
        hidden_s=tuple(sorted(hidden.items())),
    )


def stage_extras(stage: int, pp: int, ends: Sequence[ExtrasCost]) -> list[ExtrasCost]:
    """The role work a stage carries: ends[0] (embedding) on the first, ends[1] (head) on
    the last."""
    return ([ends[0]] if stage == 0 else []) + ([ends[1]] if stage == pp - 1 else [])


def held_params(
    layers: Sequence[int], costs: tuple[LayerCost, ...], extras: Sequence[ExtrasCost]
) -> tuple[float, float]:
    """(dense, expert) parameters one rank of a stage holds, and reduces the gradients of."""
    dense = sum(costs[i].params_dense for i in layers) + sum(e.params_dense for e in extras)
    expert = sum(costs[i].params_expert for i in layers) + sum(e.params_expert for e in extras)
    return dense, expert


def _grad_sync_s(
    layers: tuple[int, ...],
    costs: tuple[LayerCost, ...],
    extras: list[ExtrasCost],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    passes: float = 2.0,
    bytes_per_param: float | None = None,
) -> list[tuple[str, float]]:
    """Gradient reduction of one stage's parameters: dense gradients over dp x cp (ranks tp
    apart), expert gradients over edp (ranks etp x ep apart), `passes` ring passes (2: an
    all-reduce; 1: the distributed optimizer's reduce-scatter, or its all-gather of updated
    weights). `bytes_per_param`: the gradient buffer's by default; the all-gather moves the
    weights in the compute dtype (weight_bytes_per_param). FSDP reduce-scatters every
    micro-batch instead (in the layers' fsdp time)."""
    if training.fsdp:
        return []
    grad_b = grad_bytes_per_param(training) if bytes_per_param is None else bytes_per_param
    dense, expert = held_params(layers, costs, extras)
    out = []
    dense_dp = parallel.dp * parallel.cp
    t, level = comm.ring_allreduce_s(cluster, dense_dp, parallel.tp, grad_b * dense, passes)
    if level:
        out.append((f"dp_{level}", t))
    stride = parallel.ep * parallel.etp
    t, level = comm.ring_allreduce_s(cluster, parallel.edp, stride, grad_b * expert, passes)
    if level:
        out.append((f"edp_{level}", t))
    return out


# Megatron-Core's default DDP bucket: max(40M, 1M x dp) parameters
# (megatron/core/distributed/distributed_data_parallel.py, `ddp_config.bucket_size`).
BUCKET_MIN_PARAMS = 40_000_000
BUCKET_PARAMS_PER_DP_RANK = 1_000_000


def bucket_params(parallel: ParallelConfig) -> float:
    """Parameters per DDP bucket: max(40M, 1M x data-parallel size)."""
    return max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * parallel.dp * parallel.cp)


def reduce_units(
    reduce_s: float,
    params: float,
    parallel: ParallelConfig,
    chunk_bwd_s: float,
    bucketed: bool,
) -> list[tuple[float, float]]:
    """(seconds, ready time) of a stage's gradient reductions, relative to the end of its last
    backward (Megatron-Core DDP with --overlap-grad-reduce, as the interleaved schedule runs
    it, megatron/core/pipeline_parallel/schedules.py `backward_step_helper_postprocess`):
    each of the vp model chunks is reduced once its last micro-batch's backward is done; the
    schedule runs the last group of pp micro-batches chunk by chunk (vp - 1 down to 0; m is a
    multiple of pp with vp > 1), so chunk c is ready c pp chunk-backwards before the end.
    Only chunk 0 on pipeline rank 0 is split into buckets (`training.py`: bucketing off for
    chunks > 0 and pp ranks > 0): k = ceil(its parameters / bucket_params) buckets, ready
    evenly through its last backward, the last at the end."""
    vp = parallel.vp
    chunk_s = reduce_s / vp
    units = [(chunk_s, -c * parallel.pp * chunk_bwd_s) for c in range(vp - 1, 0, -1)]
    k = max(1, math.ceil(params / vp / bucket_params(parallel))) if bucketed else 1
    units += [(chunk_s / k, -chunk_bwd_s * (k - 1 - j) / k) for j in range(k)]
    return units


def _p2p_s(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, parallel: ParallelConfig
) -> tuple[float, str, tuple[str, ...]]:
    """Per micro-batch: the activation forward and its gradient backward, a T d bytes each,
    across every chunk boundary a rank sends over. Plain 1F1B: one send each way to the next
    stage's block (ranks B = dp tp cp apart). Interleaved: rank 0 sends vp times to rank 1,
    the last rank vp - 1 times back to rank 0 ((pp - 1) B apart), so a slot carries
    max(vp t_next, (vp - 1) t_wrap) each way."""
    if parallel.pp == 1:
        return 0.0, "", ()
    nbytes = traffic.p2p_bytes(model, training, parallel)
    block = parallel.dp * parallel.tp * parallel.cp
    t, level, tables = comm.p2p_time_s(cluster, (0, block), nbytes)
    if parallel.vp == 1:
        return 2 * t, level, tables
    wrap, wrap_level, wrap_tables = comm.p2p_time_s(cluster, (0, (parallel.pp - 1) * block), nbytes)
    if (parallel.vp - 1) * wrap > parallel.vp * t:
        return 2 * (parallel.vp - 1) * wrap, wrap_level, tuple(sorted({*tables, *wrap_tables}))
    return 2 * parallel.vp * t, level, tuple(sorted({*tables, *wrap_tables}))


def _optimizer_s(stages: Sequence[StageEstimate], cluster: ClusterSpec) -> float:
    """Adam step, memory-bound: each rank reads and writes its weights, gradients and
    optimizer shard once (2 x state bytes through HBM); the slowest stage sets it."""
    worst = 0.0
    for st in stages:
        state_gib = sum(v for n, v in st.memory_gib if n in ("weights", "grads", "optimizer"))
        worst = max(worst, 2 * state_gib * GIB / cluster.hbm_bytes_per_s)
    return worst


@dataclass(frozen=True)
class StepTime:
    """The step assembled from the stages (seconds; comm_s per step on the bottleneck stage,
    exposed and hidden together)."""

    step_s: float
    slot_s: float
    dp_exposed_s: float
    optimizer_s: float
    comm_s: tuple[tuple[str, float], ...]
    exposed_comm_s: float
    tables: tuple[str, ...]
    unpaired_s: float = 0.0  # warm-up and cool-down the all-to-all overlap cannot pair
    fsdp_first_gather_s: float = 0.0  # the step's first FSDP gather, before any compute


def _grad_sync_all(
    stages: Sequence[StageEstimate],
    costs: tuple[LayerCost, ...],
    ends: Sequence[ExtrasCost],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    slot: float,
) -> tuple[float, dict[str, float]]:
    """(exposed seconds, per-name max over stages) of the data-parallel gradient reduction.

    With `zero` (Megatron-Core's distributed optimizer, which its recipes run with
    --overlap-grad-reduce and --overlap-param-gather): each chunk's reduce-scatter starts
    when its last backward is done (reduce_units), queued on one stream
    (overlap.queued_reduce_exposed_s); the all-gather of the updated weights mirrors it at
    the start of the next step (_gather_exposed_s). Without: one all-reduce of the stage
    after its backward (Piper's runtime, runtime/parallel/pipeline.py `sync_gradients`).
    Stage i ends its backward about i / vp chunk-slots before stage 0, so that much more
    hides. A chunk-backward is 2/3 of a chunk-slot. Without `grad_overlap` the distributed
    optimizer's reduce-scatter is one collective after the backward too."""
    pp, vp = parallel.pp, parallel.vp
    passes = 1.0 if training.zero else 2.0
    chunk_bwd = slot / vp * 2 / TRAIN_FACTOR
    exposed, by_name = 0.0, {}
    for st in stages:
        extras = stage_extras(st.stage, pp, ends)
        sync = _grad_sync_s(st.layers, costs, extras, cluster, training, parallel, passes)
        total = sum(s for _, s in sync)
        params = sum(held_params(st.layers, costs, extras))
        if training.zero and training.grad_overlap:
            units = reduce_units(total, params, parallel, chunk_bwd, bucketed=st.stage == 0)
        else:  # one reduction after the backward (Piper's runtime `sync_gradients`, no overlap)
            units = [(total, 0.0)]
        queued = overlap.queued_reduce_exposed_s(units)
        behind = st.stage / vp * slot * 2 / TRAIN_FACTOR
        shown = overlap.imperfect_s(max(queued - behind, 0.0), total, cluster.overlap_efficiency)
        exposed = max(exposed, shown)
        for name, s in sync:  # reported as the step's whole traffic: 2 passes either way
            by_name[name] = max(by_name.get(name, 0.0), s * 2.0 / passes)
    gather = _gather_exposed_s(stages, costs, ends, cluster, training, parallel, slot)
    return exposed + gather, by_name


def _gather_exposed_s(
    stages: Sequence[StageEstimate],
    costs: tuple[LayerCost, ...],
    ends: Sequence[ExtrasCost],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    slot: float,
) -> float:
    """With the distributed optimizer (--overlap-param-gather): the updated bf16 weights
    (2 B per parameter) are all-gathered one bucket ahead of the first micro-batch's forward
    (Megatron-Core's forward pre-hook waits for its bucket and dispatches the next,
    `distributed_data_parallel.py`; the interleaved schedule gathers chunk c + 1 during chunk
    c's first forwards, `schedules.py` `param_sync_func`). The mirror of the reduction: chunk
    c is needed c pp chunk-forwards after the step starts, chunk 0's buckets (pipeline rank
    0) evenly through its first forward, the first at once; the forward waits for what the
    stream has not delivered (reduce_units with the times mirrored). Stage i starts i
    chunk-forwards after stage 0. A chunk-forward is 1/3 of a chunk-slot. 0 without `zero`.
    Without `grad_overlap` the stage's whole all-gather precedes its first forward."""
    if not training.zero or training.fsdp:
        return 0.0
    pp, vp = parallel.pp, parallel.vp
    chunk_fwd = slot / vp / TRAIN_FACTOR
    weight_b = weight_bytes_per_param(training)
    worst = 0.0
    for st in stages:
        extras = stage_extras(st.stage, pp, ends)
        sync = _grad_sync_s(st.layers, costs, extras, cluster, training, parallel, 1.0, weight_b)
        total = sum(s for _, s in sync)
        params = sum(held_params(st.layers, costs, extras))
        if training.grad_overlap:
            units = reduce_units(total, params, parallel, chunk_fwd, bucketed=st.stage == 0)
        else:  # the whole stage gathered before its first forward
            units = [(total, 0.0)]
        stall = overlap.queued_reduce_exposed_s(units) - st.stage * chunk_fwd
        worst = max(worst, overlap.imperfect_s(max(stall, 0.0), total, cluster.overlap_efficiency))
    return worst


def _unpaired_s(
    stages: Sequence[StageEstimate], training: TrainingSpec, par: ParallelConfig
) -> float:
    """With the all-to-all overlap the stage times are steady-phase (paired) times; each rank's
    W_r warm-up forwards and as many cool-down backwards run alone, exposing the all-to-all
    time the pairing hides: max_r W_r / vp x hidden_r."""
    if not training.a2a_overlap:
        return 0.0
    worst = 0.0
    for st in stages:
        hidden = sum(s for n, s in st.hidden_s if n.startswith("a2a_"))
        chunks = interleave.unpaired_chunks(st.stage, par.pp, par.vp, par.num_microbatches)
        worst = max(worst, chunks / par.vp * hidden)
    return worst


def _fsdp_first_s(
    stages: Sequence[StageEstimate],
    costs: tuple[LayerCost, ...],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> float:
    """FSDP: the first unit's all-gather of the step has no compute to hide behind."""
    if not training.fsdp:
        return 0.0
    worst = 0.0
    for st in stages:
        c = costs[st.layers[0]]
        gather, _, _ = fsdp_gather_s(cluster, training, parallel, (c.params_dense, c.params_expert))
        worst = max(worst, gather)
    return worst


COMM_PREFIXES = ("a2a_", "tp_", "etp_", "cp_", "fsdp_")


def step_time(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    stages: Sequence[StageEstimate],
    costs: tuple[LayerCost, ...],
    ends: Sequence[ExtrasCost],
) -> StepTime:
    """(Interleaved) 1F1B step time from the stages; `ends` = (first-stage role, last-stage
    role)."""
    m = parallel.num_microbatches
    slots = interleave.pipeline_slots(parallel.pp, parallel.vp, m)
    p2p_s, p2p_level, p2p_tables = _p2p_s(model, cluster, training, parallel)
    bottleneck = max(stages, key=lambda st: (st.total_s, -st.stage))
    slot = bottleneck.total_s + p2p_s
    dp_exposed, dp_comm = _grad_sync_all(stages, costs, ends, cluster, training, parallel, slot)
    optimizer_s = _optimizer_s(stages, cluster)
    held = [held_params(s.layers, costs, stage_extras(s.stage, parallel.pp, ends)) for s in stages]
    optimizer_s += offload.host_optimizer_s(held, cluster, training, parallel)
    unpaired = _unpaired_s(stages, training, parallel)
    first_gather = _fsdp_first_s(stages, costs, cluster, training, parallel)
    layer_comm = {n: m * s for n, s in bottleneck.time_s if n.startswith(COMM_PREFIXES)}
    for n, s in bottleneck.hidden_s:
        layer_comm[n] = layer_comm.get(n, 0.0) + m * s
    per_slot_comm = sum(s for n, s in bottleneck.time_s if n.startswith(COMM_PREFIXES))
    if p2p_level:
        layer_comm[f"p2p_{p2p_level}"] = m * p2p_s
    extra = unpaired + first_gather
    return StepTime(
        step_s=slots * slot + dp_exposed + optimizer_s + extra,
        slot_s=slot,
        dp_exposed_s=dp_exposed,
        optimizer_s=optimizer_s,
        comm_s=tuple(sorted({**layer_comm, **dp_comm}.items())),
        exposed_comm_s=slots * (per_slot_comm + p2p_s) + dp_exposed + extra,
        tables=p2p_tables,
        unpaired_s=unpaired,
        fsdp_first_gather_s=first_gather,
    )
