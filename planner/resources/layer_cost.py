"""Per-layer and per-boundary costs on one rank: the building blocks of estimate() and of the
StageCostInputs the stage IP reads. Memory from memory.py, compute from compute.py,
communication from comm.py, deepep.py and traffic.py, overlap from overlap.py; this module
adds them up per layer.

All values are per rank and per micro-batch (forward + backward) unless named otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from planner.parallel import ParallelConfig
from planner.parallel import check_layout as check_model_layout
from planner.resources import comm, overlap, recompute, traffic
from planner.resources.compute import ELEMENTWISE_PASSES, TRAIN_FACTOR, Work, head_work, layer_work
from planner.resources.deepep import deepep_all_to_all_s
from planner.resources.knobs import knob_conflict
from planner.resources.memory import (
    WEIGHT_BYTES_PER_PARAM,
    Accounting,
    ActBytes,
    StateBytes,
    embedding_held,
    fsdp_gathered_bytes,
    grad_bytes_per_param,
    head_held,
    layer_activations,
    layer_param_split,
    state_bytes,
)
from planner.specs import ClusterSpec, LayerSpec, ModelSpec, Recompute, SpecError, TrainingSpec

Dispatcher = Literal["flat", "halo", "deepep"]
DISPATCHERS: tuple[str, ...] = ("flat", "halo", "deepep")
MLP_SIDE = ("experts", "shared")  # the all-to-all overlap's "mlp" node; the rest is pre-dispatch


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
            f"{cluster.total_gpus}; lower pp, dp, tp or cp"
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


def _a2a_s(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: str,
) -> tuple[float, str, tuple[str, ...]]:
    """One of the layer's four all-to-alls (dispatch or combine, forward or backward) over the
    ep ranks etp apart: (seconds, level, measured tables)."""
    nbytes = traffic.a2a_bytes(model, layer, training, parallel)
    if nbytes <= 0:
        return 0.0, "", ()
    if dispatcher != "deepep":
        return comm.a2a_time_s(cluster, parallel.ep, nbytes, dispatcher, parallel.etp)
    moe = layer.moe
    assert moe is not None  # a2a_bytes is 0 without experts
    span = comm.group_span(cluster, parallel.ep, parallel.etp)
    t = deepep_all_to_all_s(
        cluster, parallel.ep, nbytes / moe.top_k, moe.top_k, moe.num_experts, parallel.etp
    )
    return t, span.name if span else "", ()


def _sides(work: tuple[Work, ...]) -> tuple[float, float, float, float]:
    """(pre-dispatch forward, backward, mlp forward, backward) compute seconds."""
    af = sum(w.forward_s for w in work if w.name not in MLP_SIDE)
    ab = sum(w.time_s - w.forward_s for w in work if w.name not in MLP_SIDE)
    mf = sum(w.forward_s for w in work if w.name in MLP_SIDE)
    mb = sum(w.time_s - w.forward_s for w in work if w.name in MLP_SIDE)
    return af, ab, mf, mb


@dataclass(frozen=True)
class _Comm:
    exposed: list[tuple[str, float]]
    hidden: list[tuple[str, float]]
    repeat_full_s: float  # forward collectives "full" recompute repeats
    repeat_moe_s: float  # forward collectives "moe" recompute repeats
    cp_fwd_s: float  # exposed forward ring: repeated with core attention
    tables: tuple[str, ...]


def _layer_comm(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: str,
    work: tuple[Work, ...],
) -> _Comm:
    """Four all-to-alls per MoE layer (dispatch + combine, forward + backward), TP collectives
    over tp, expert-TP all-gather/reduce-scatter over etp, the cp ring of K/V and FSDP's
    gathers; volumes from planner.resources.traffic, overlap from planner.resources.overlap."""
    exposed: list[tuple[str, float]] = []
    hidden: list[tuple[str, float]] = []
    t, level, tables = _a2a_s(model, layer, cluster, training, parallel, dispatcher)
    a2a_full = 4 * t
    if level:
        shown = a2a_full
        if training.a2a_overlap:
            shown = overlap.paired_a2a_exposed_s(*_sides(work), t)
            hidden.append((f"a2a_{level}", a2a_full - shown))
        exposed.append((f"a2a_{level}", shown))
    repeat = [a2a_full]
    if parallel.tp > 1:
        buf = traffic.tp_buffer_bytes(model, training, parallel)
        t, level = comm.ring_allreduce_s(cluster, parallel.tp, 1, buf)
        exposed.append((f"tp_{level}", traffic.tp_allreduces(layer) * t))
        repeat.append(traffic.tp_allreduces(layer) * t)
    etp_buf = traffic.etp_buffer_bytes(model, layer, training, parallel)
    etp_s = 0.0
    if etp_buf > 0:
        t, level = comm.ring_allreduce_s(cluster, parallel.etp, 1, etp_buf, passes=1)
        etp_s = 4 * t
        exposed.append((f"etp_{level}", etp_s))
        repeat.append(etp_s)
    cp_fwd = _cp_ring(model, layer, cluster, training, parallel, work, exposed, hidden)
    _fsdp(
        cluster,
        training,
        parallel,
        work,
        layer_param_split(model, layer, parallel),
        exposed,
        hidden,
    )
    return _Comm(exposed, hidden, sum(repeat) / 2, (a2a_full + etp_s) / 2, cp_fwd, tables)


def _cp_ring(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    work: tuple[Work, ...],
    exposed: list[tuple[str, float]],
    hidden: list[tuple[str, float]],
) -> float:
    """Append the cp ring's exposed and hidden seconds; return its exposed forward part."""
    kv = traffic.cp_kv_bytes(model, layer, training, parallel)
    if kv <= 0:
        return 0.0
    cp = parallel.cp
    step_s, level, _ = comm.p2p_time_s(cluster, (0, (cp - 1) * parallel.tp), kv)
    core = next(w for w in work if w.name == "attn_core")
    shown, fwd = overlap.ring_attention_exposed_s(
        cp, step_s, core.forward_s, core.time_s - core.forward_s
    )
    exposed.append((f"cp_{level}", shown))
    hidden.append((f"cp_{level}", 3 * (cp - 1) * step_s - shown))
    return fwd


def fsdp_gather_s(
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    params: tuple[float, float],
) -> tuple[float, float, str]:
    """(all-gather s, reduce-scatter s, level) of one FSDP unit holding `params` = (dense,
    expert) parameters before sharding: bf16 weights gathered and gradients reduce-scattered
    over dp x cp ranks tp apart (dense) and edp ranks etp x ep apart (experts)."""
    groups = (
        (parallel.dp * parallel.cp, parallel.tp, params[0]),
        (parallel.edp, parallel.ep * parallel.etp, params[1]),
    )
    gather = reduce = 0.0
    level, worst = "", -1.0
    for size, stride, n in groups:
        g, lv = comm.ring_allreduce_s(cluster, size, stride, WEIGHT_BYTES_PER_PARAM * n, 1)
        r, _ = comm.ring_allreduce_s(cluster, size, stride, grad_bytes_per_param(training) * n, 1)
        gather, reduce = gather + g, reduce + r
        if lv and g > worst:
            level, worst = lv, g
    return gather, reduce, level


def _fsdp(
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    work: tuple[Work, ...],
    params: tuple[float, float],
    exposed: list[tuple[str, float]],
    hidden: list[tuple[str, float]],
) -> None:
    """Append FSDP's exposed and hidden seconds for one unit: forward gather, backward
    gather and reduce-scatter, each behind that pass's compute."""
    if not training.fsdp:
        return
    gather, reduce, level = fsdp_gather_s(cluster, training, parallel, params)
    if not level:
        return
    fwd = sum(w.forward_s for w in work)
    bwd = sum(w.time_s for w in work) - fwd
    shown = overlap.prefetch_exposed_s(gather, reduce, fwd, bwd)
    exposed.append((f"fsdp_{level}", shown))
    hidden.append((f"fsdp_{level}", 2 * gather + reduce - shown))


def _recompute_extra_s(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    policy: Recompute,
    work: tuple[Work, ...],
    layer_comm: _Comm,
    act: ActBytes,
    kept: ActBytes,
) -> float:
    """What recomputing the layer adds to its backward. "full" repeats every forward GEMM,
    elementwise pass and the forward halves of the all-to-alls and TP/ETP collectives;
    "selective" the forward of the GEMMs its modules hold, the elementwise passes over the
    bytes they dropped, and the forward all-to-alls for `moe` (planner.resources.recompute)."""
    if policy == "full":
        return sum(w.forward_s for w in work) + layer_comm.repeat_full_s + layer_comm.cp_fwd_s
    modules = parallel.recompute_modules or ("core_attn",)
    share = recompute.work_share(layer, modules, model.hidden_size)
    extra = sum(w.forward_s * share.get(w.name, 0.0) for w in work)
    dropped = sum(v - dict(kept.components)[n] for n, v in act.components if n != "scores")
    extra += ELEMENTWISE_PASSES * dropped / (cluster.device.hbm_gbps * 1e9) / TRAIN_FACTOR
    if recompute.repeats_dispatch(layer, modules):
        extra += layer_comm.repeat_moe_s
    if "core_attn" in modules:
        extra += layer_comm.cp_fwd_s
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
    policy = effective_recompute(training, parallel)
    kept_policy: Recompute = policy if policy != "none" else "full"
    work = tuple(layer_work(model, layer, cluster, training, parallel))
    lc = _layer_comm(model, layer, cluster, training, parallel, dispatcher, work)
    act = layer_activations(model, layer, training, parallel, "none", accounting)
    kept = layer_activations(model, layer, training, parallel, kept_policy, accounting)
    extra = _recompute_extra_s(
        model, layer, cluster, training, parallel, kept_policy, work, lc, act, kept
    )
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
        comm_s=tuple(lc.exposed),
        recompute_extra_s=extra,
        tables=tables,
        hidden_s=tuple(lc.hidden),
        workspace=_workspace(model, layer, training, parallel, dense + expert),
    )


def _workspace(
    model: ModelSpec,
    layer: LayerSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    params_unit: float,
) -> tuple[tuple[str, float], ...]:
    """Transient bytes while the layer runs: FSDP's gathered units; the cp ring's K/V buffers
    (a send and a receive buffer of K/V and, in backward, of their gradients: 4 x one step)."""
    out = []
    if training.fsdp:
        out.append(("fsdp_gathered", fsdp_gathered_bytes(params_unit, training)))
    if parallel.cp > 1:
        out.append(("cp_kv_buffers", 4 * traffic.cp_kv_bytes(model, layer, training, parallel)))
    return tuple(out)


def layer_costs(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> tuple[LayerCost, ...]:
    """layer_cost for every layer; identical LayerSpecs are computed once."""
    cache: dict[LayerSpec, LayerCost] = {}
    out = []
    for i, layer in enumerate(model.layers):
        if layer not in cache:
            cache[layer] = layer_cost(model, i, cluster, training, parallel, dispatcher, accounting)
        c = cache[layer]
        out.append(c if c.layer == i else dataclasses.replace(c, layer=i))
    return tuple(out)


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
        gather, reduce, level = fsdp_gather_s(
            cluster, training, parallel, (held_dense, held_expert)
        )
        fwd = sum(w.forward_s for w in work)
        bwd = sum(w.time_s for w in work) - fwd
        if level:
            comm_s = ((f"fsdp_{level}", overlap.prefetch_exposed_s(gather, reduce, fwd, bwd)),)
        workspace = (("fsdp_gathered", fsdp_gathered_bytes(held_dense + held_expert, training)),)
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
        held.params_dense, held.params_expert, held.act_bytes, work, cluster, training, parallel
    )
