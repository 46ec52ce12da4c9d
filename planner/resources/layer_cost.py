"""Per-layer and per-boundary costs on one rank: the building blocks of estimate() and of the
StageCostInputs the stage IP reads. Memory from memory.py, compute from compute.py,
communication from layer_comm.py (comm.py, deepep.py, traffic.py, overlap.py); this module
adds them up per layer and prices recompute.

All values are per rank and per micro-batch (forward + backward) unless named otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from planner.parallel import ParallelConfig
from planner.parallel import check_layout as check_model_layout
from planner.resources import interleave, recompute, traffic
from planner.resources.compute import ELEMENTWISE_PASSES, TRAIN_FACTOR, Work, head_work, layer_work
from planner.resources.deepep import deepep_buffer_bytes
from planner.resources.knobs import knob_conflict
from planner.resources.layer_comm import (
    DISPATCHERS,
    LayerComm,
    fsdp_exposed_s,
    layer_comm,
)
from planner.resources.memory import (
    Accounting,
    ActBytes,
    StateBytes,
    act_bytes_per_element,
    embedding_held,
    fsdp_gathered_bytes,
    fsdp_holds_unsharded,
    head_held,
    layer_activations,
    layer_param_split,
    offloaded_layer_bytes,
    state_bytes,
)
from planner.resources.precision import layer_training
from planner.specs import ClusterSpec, LayerSpec, ModelSpec, Recompute, SpecError, TrainingSpec

Dispatcher = Literal["flat", "halo", "halo-dedup", "deepep"]


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer on one rank, per micro-batch."""

    layer: int
    kind: str
    params_dense: float  # non-expert parameters held (already / tp)
    params_expert: float  # routed-expert parameters held (already / (ep etp))
    state: StateBytes
    act: ActBytes  # kept without recompute
    act_recompute: ActBytes  # kept under the recompute policy (full: the layer input)
    work: tuple[Work, ...]
    comm_s: tuple[tuple[str, float], ...]  # exposed: ("a2a_<level>", s), ("tp_<level>", s), ...
    recompute_extra_s: float  # what recomputing adds in the backward pass
    tables: tuple[str, ...]
    hidden_s: tuple[tuple[str, float], ...] = ()  # communication hidden behind compute
    workspace: tuple[tuple[str, float], ...] = ()  # transient bytes while the layer runs

    @property
    def compute_s(self) -> float:
        return sum(w.time_s for w in self.work)

    @property
    def time_s(self) -> float:
        return self.compute_s + sum(s for _, s in self.comm_s)

    @property
    def time_recompute_s(self) -> float:
        return self.time_s + self.recompute_extra_s


@dataclass(frozen=True)
class ExtrasCost:
    """Embedding (first stage) or head + loss + MTP (last stage) on one rank."""

    params_dense: float
    params_expert: float
    state: StateBytes
    act_bytes: float
    work: tuple[Work, ...]
    comm_s: tuple[tuple[str, float], ...] = ()  # exposed FSDP gathers of the role's weights
    workspace: tuple[tuple[str, float], ...] = ()

    @property
    def time_s(self) -> float:
        return sum(w.time_s for w in self.work) + sum(s for _, s in self.comm_s)


def effective_recompute(training: TrainingSpec, parallel: ParallelConfig) -> Recompute:
    """The layout's recompute choice wins; TrainingSpec.recompute is the default."""
    return parallel.recompute if parallel.recompute != "none" else training.recompute


def with_mtp(model: ModelSpec, training: TrainingSpec) -> ModelSpec:
    """The model with TrainingSpec.mtp_layers multi-token-prediction layers (None: its own)."""
    if training.mtp_layers is None or training.mtp_layers == model.num_mtp_layers:
        return model
    return dataclasses.replace(model, num_mtp_layers=training.mtp_layers)


def check_layout(
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelConfig,
    training: TrainingSpec | None = None,
    dispatcher: str = "flat",
) -> None:
    """Raise SpecError (one line, with the fix) when the layout cannot run this model here."""
    if parallel.world > cluster.total_gpus:
        raise SpecError(
            f"layout: pp*dp*tp*cp = {parallel.world} GPUs but cluster {cluster.name} has "
            f"{cluster.total_gpus}; lower pp, dp, tp or cp, or resize it with --nodes "
            f"{-(-parallel.world // cluster.gpus_per_node)}"
        )
    if parallel.pp > model.num_layers:
        raise SpecError(
            f"layout: pp={parallel.pp} exceeds the {model.num_layers} layers of {model.name}; "
            "use pp <= layers"
        )
    experts = model.num_experts
    if experts and experts % parallel.ep:
        options = ", ".join(str(e) for e in range(1, experts + 1) if experts % e == 0)
        raise SpecError(
            f"layout: ep={parallel.ep} must divide the {experts} experts of {model.name}; "
            f"pick ep from {options}"
        )
    if not experts and parallel.ep != 1:
        raise SpecError(f"layout: {model.name} has no experts; use ep=1")
    heads = model.layers[0].attention.num_heads
    if heads % parallel.tp:
        raise SpecError(
            f"layout: tp={parallel.tp} must divide the {heads} attention heads of {model.name}"
        )
    if dispatcher not in DISPATCHERS:
        raise SpecError(f"dispatcher '{dispatcher}' is unknown; use {', '.join(DISPATCHERS)}")
    if training is not None:
        check_model_layout(_chunk_rule_relaxed(parallel, model), model, training)
        conflict = knob_conflict(model, training, parallel, dispatcher)
        if conflict:
            raise SpecError(conflict)


def _chunk_rule_relaxed(parallel: ParallelConfig, model: ModelSpec) -> ParallelConfig:
    """planner.parallel.check_layout's rules, with Megatron-Core's accounting of the embedding
    and the loss as one pipeline layer each (`--account-for-embedding-in-pipeline-split`,
    `--account-for-loss-in-pipeline-split`): pp x vp chunks need L + 2 units, so a chunk may
    hold only the embedding or only the head. The resource model needs no non-empty chunk."""
    if parallel.vp == 1 or model.num_layers >= parallel.pp * parallel.vp:
        return parallel
    if model.num_layers + 2 < parallel.pp * parallel.vp:
        raise SpecError(
            f"parallel: pp={parallel.pp} x vp={parallel.vp} model chunks need at least "
            f"{parallel.pp * parallel.vp} layers with the embedding and the loss counted as one "
            f"each; the model has {model.num_layers} + 2"
        )
    return dataclasses.replace(parallel, vp=1)


def _recompute_extra_s(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    policy: Recompute,
    work: tuple[Work, ...],
    lc: LayerComm,
    act: ActBytes,
    kept: ActBytes,
) -> float:
    """What recomputing the layer adds to its backward. "full" repeats every forward GEMM,
    elementwise pass and the forward halves of the all-to-alls and TP/ETP collectives;
    "selective" the forward of the GEMMs its modules hold, the elementwise passes over the
    bytes they dropped, and the forward all-to-alls for `moe` (planner.resources.recompute)."""
    if policy == "full":
        return sum(w.forward_s for w in work) + lc.repeat_full_s + lc.cp_fwd_s
    modules = parallel.recompute_modules or ("core_attn",)
    forward = {w.name: w.flops / TRAIN_FACTOR for w in work}
    rerun = recompute.budget_rerun(layer, act.components, training, parallel,
                                   model.hidden_size, forward)  # fmt: skip
    if rerun is None:
        share = recompute.work_share(layer, modules, model.hidden_size)
    else:
        share = dict(rerun.share)
    extra = sum(w.forward_s * share.get(w.name, 0.0) for w in work)
    dropped = sum(v - dict(kept.components)[n] for n, v in act.components if n != "scores")
    extra += ELEMENTWISE_PASSES * dropped / cluster.hbm_bytes_per_s / TRAIN_FACTOR
    if rerun is not None and rerun.repeats_dispatch or recompute.repeats_dispatch(layer, modules):
        extra += lc.repeat_moe_s
    if "core_attn" in modules:
        extra += lc.cp_fwd_s
    return extra


def layer_cost(
    model: ModelSpec,
    index: int,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> LayerCost:
    """Memory, compute and communication of layer `index` on one rank per micro-batch (the
    steady-phase time when the all-to-all overlap pairs micro-batches)."""
    layer = model.layers[index]
    training = layer_training(training, index, model.num_layers)  # BF16 first / last layers
    policy = effective_recompute(training, parallel)
    kept_policy: Recompute = policy if policy != "none" else "full"
    work = tuple(layer_work(model, layer, cluster, training, parallel))
    lc = layer_comm(model, layer, cluster, training, parallel, dispatcher, work)
    act = layer_activations(model, layer, training, parallel, "none", accounting)
    kept = layer_activations(model, layer, training, parallel, kept_policy, accounting)
    extra = _recompute_extra_s(
        model, layer, cluster, training, parallel, kept_policy, work, lc, act, kept
    )
    if training.fsdp and policy != "none":
        # recomputed, the layer's FSDP backward gather and reduce-scatter also hide behind
        # its recompute: the recomputed time is max(recompute, exposed) where it was exposed
        params = layer_param_split(model, layer, parallel)
        _, plain, _ = fsdp_exposed_s(cluster, training, parallel, work, params)
        _, behind, _ = fsdp_exposed_s(cluster, training, parallel, work, params, extra)
        extra = max(extra + behind - plain, 0.0)
    tables = tuple(sorted({t for w in work for t in w.tables} | set(lc.tables)))
    dense, expert = layer_param_split(model, layer, parallel, accounting)
    return LayerCost(
        layer=index,
        kind=layer.kind,
        params_dense=dense,
        params_expert=expert,
        state=state_bytes(dense, expert, training, parallel),
        act=act,
        act_recompute=kept,
        work=work,
        comm_s=lc.exposed,
        recompute_extra_s=extra,
        tables=tables,
        hidden_s=lc.hidden,
        workspace=_workspace(model, layer, training, parallel, dense + expert)
        + _overlap_layer(training, policy, act, kept)
        + _dispatcher_buffers(model, layer, training, parallel, dispatcher),
    )


def _dispatcher_buffers(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: str,
) -> tuple[tuple[str, float], ...]:
    """DeepEP's NVLink / RDMA buffers, held for the whole run by every rank of an MoE layer's
    EP group (planner.resources.deepep.deepep_buffer_bytes); NCCL's own buffers are in the
    profile's framework overhead."""
    if dispatcher != "deepep" or layer.moe is None or parallel.ep < 2:
        return ()
    hidden = model.hidden_size * act_bytes_per_element(training)
    return (("deepep_buffers", deepep_buffer_bytes(hidden, parallel.ep)),)


def _overlap_layer(
    training: TrainingSpec, policy: Recompute, act: ActBytes, kept: ActBytes
) -> tuple[tuple[str, float], ...]:
    """With the all-to-all overlap, the one layer of activations a paired forward holds
    before the backward beside it frees one (planner.resources.interleave.live_chunks)."""
    if not training.a2a_overlap:
        return ()
    return (("a2a_overlap_layer", (kept if policy != "none" else act).total),)


def _workspace(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    params_unit: float,
) -> tuple[tuple[str, float], ...]:
    """Transient bytes while the layer runs: FSDP's gathered units; the cp ring's K/V buffers
    (a send and a receive buffer of K/V and, in backward, of their gradients: 4 x one step);
    with vp > 1 the receive buffers Megatron's interleaved schedule posts ahead for the next
    chunk's input and gradient (`--overlap-p2p-communication`, on with vp): 2 x a T d."""
    out = []
    if training.fsdp and not fsdp_holds_unsharded(training, parallel):  # else in its state
        out.append(("fsdp_gathered", fsdp_gathered_bytes(params_unit, training)))
    if parallel.cp > 1:
        out.append(("cp_kv_buffers", 4 * traffic.cp_kv_bytes(model, layer, training, parallel)))
    if parallel.vp > 1 and parallel.pp > 1:
        out.append(("p2p_buffers", 2 * traffic.p2p_bytes(model, training, parallel)))
    if training.activation_offload_modules:  # one layer's inputs in transit (act_offload)
        policy = effective_recompute(training, parallel)
        moved = offloaded_layer_bytes(model, layer, training, parallel, policy)
        out.append(("activation_offload", moved))
    return tuple(out)


def layer_alone(
    model: ModelSpec,
    index: int,
    cluster: ClusterSpec,
    seq_len: int,
    micro_batch: int,
    dtype: str = "bf16",
) -> LayerCost:
    """layer_cost of layer `index` alone on one rank: pp = dp = tp = ep = 1, one micro-batch
    of `micro_batch` sequences, no recompute (what a one-layer benchmark measures)."""
    training = TrainingSpec(seq_len=seq_len, global_batch=micro_batch, dtype=dtype)
    parallel = ParallelConfig(pp=1, dp=1, ep=1, micro_batch=micro_batch)
    return layer_cost(model, index, cluster, training, parallel)


def layer_costs(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> tuple[LayerCost, ...]:
    """layer_cost for every layer; identical LayerSpecs in the same precision are computed
    once."""
    cache: dict[tuple[LayerSpec, str], LayerCost] = {}
    out = []
    for i, layer in enumerate(model.layers):
        key = (layer, layer_training(training, i, model.num_layers).dtype)
        if key not in cache:
            cache[key] = layer_cost(model, i, cluster, training, parallel, dispatcher, accounting)
        c = cache[key]
        out.append(c if c.layer == i else with_index(c, i))
    return tuple(out)


def with_index(obj, index: int, name: str = "layer"):
    """A copy of frozen dataclass `obj` with field `name` = `index` (dataclasses.replace
    without re-running __init__: the planner copies costs per layer thousands of times)."""
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__[name] = index
    return new


def _role(
    held_dense: float,
    held_expert: float,
    act_bytes: float,
    work: tuple[Work, ...],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> ExtrasCost:
    """A stage role's cost; with FSDP its weights are one more gathered unit."""
    state = state_bytes(held_dense, held_expert, training, parallel)
    comm_s: tuple[tuple[str, float], ...] = ()
    workspace: tuple[tuple[str, float], ...] = ()
    if training.fsdp:
        held = (held_dense, held_expert)
        level, shown, _ = fsdp_exposed_s(cluster, training, parallel, work, held)
        if level:
            comm_s = ((f"fsdp_{level}", shown),)
        if not fsdp_holds_unsharded(training, parallel):  # else in its state
            gathered = fsdp_gathered_bytes(held_dense + held_expert, training)
            workspace = (("fsdp_gathered", gathered),)
    return ExtrasCost(held_dense, held_expert, state, act_bytes, work, comm_s, workspace)


def first_extras(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> ExtrasCost:
    """Embedding on the first stage (the paper's accounting leaves it out)."""
    if accounting == "paper":
        return ExtrasCost(0.0, 0.0, StateBytes(), 0.0, ())
    held = embedding_held(model, training, parallel)
    return _role(
        held.params_dense, held.params_expert, held.act_bytes, (), cluster, training, parallel
    )


def last_extras(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> ExtrasCost:
    """Final norm, head, loss and MTP modules on the last stage (left out by the paper)."""
    if accounting == "paper":
        return ExtrasCost(0.0, 0.0, StateBytes(), 0.0, ())
    held = head_held(model, training, parallel)
    work = tuple(head_work(model, cluster, training, parallel))
    return _role(
        held.params_dense, held.params_expert, _head_live(held.act_bytes, training, parallel),
        work, cluster, training, parallel,
    )  # fmt: skip


def _head_live(act_bytes: float, training: TrainingSpec, parallel: ParallelConfig) -> float:
    """The head, loss and MTP activations sit in the last rank's last model chunk, whose
    backward runs right after its forward: Megatron-Core's interleaved schedule warms the last
    rank up with (vp - 1) pp forwards of its other chunks and starts the backwards with the
    last chunk (`schedules.py` get_model_chunk_id), so one micro-batch of them is live, not
    the live_chunks / vp the stage's layers hold. Scaled so that live / vp x act is one."""
    if parallel.vp == 1 or parallel.pp == 1:
        return act_bytes  # 1F1B's last stage holds one micro-batch already
    pp, vp, m = parallel.pp, parallel.vp, parallel.num_microbatches
    return act_bytes * vp / interleave.live_chunks(pp - 1, pp, vp, m, training.a2a_overlap)
