"""Communication of one layer on one rank per micro-batch: what is exposed and what hides.

The layer's four all-to-alls (flat, HALO or HALO-dedup from comm.py, DeepEP from deepep.py), its TP
collectives, the expert-TP all-gather / reduce-scatter, the context-parallel K/V ring and
FSDP's gathers; volumes from traffic.py, overlap with the layer's compute from overlap.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.resources import comm, overlap, traffic
from planner.resources.compute import Work
from planner.resources.deepep import deepep_all_to_all_s
from planner.resources.memory import (
    fsdp_holds_unsharded,
    fsdp_reduce_bytes_per_param,
    layer_param_split,
    weight_bytes_per_param,
)
from planner.specs import ClusterSpec, LayerSpec, ModelSpec, TrainingSpec

DISPATCHERS: tuple[str, ...] = ("flat", "halo", "halo-dedup", "deepep")
RUNTIME_DISPATCHERS: tuple[str, ...] = ("flat", "halo", "halo-dedup")  # what `piper run` runs


def runtime_dispatcher(priced: str) -> str:
    """The dispatcher `piper run` runs for a plan priced with `priced`: the same one, or
    flat for another engine's (DeepEP's plans rehearse with the exchange it also makes)."""
    return priced if priced in RUNTIME_DISPATCHERS else "flat"


MLP_SIDE = ("experts", "shared")  # the all-to-all overlap's "mlp" node; the rest is pre-dispatch
# SMs the dispatch/combine kernels hold while they run beside compute: DeepEP's normal
# (training) kernels use 24 SMs (DeepEP README: "for V3-like legacy training, SM usage
# reduced from 24 to 4-6" in V2); NCCL's all-to-all one SM per channel, 16 channels
# (ASSUMPTION).
COMM_SMS = {"deepep": 24, "flat": 16, "halo": 16, "halo-dedup": 16}


def sm_contention_s(cluster: ClusterSpec, dispatcher: str, hidden_s: float) -> float:
    """Compute time lost while `hidden_s` of communication runs beside it: the compute gets
    the device's SMs minus the communication kernels' sigma = COMM_SMS / sms, so each hidden
    second stretches it by sigma / (1 - sigma). 0 when the profile gives no SM count."""
    sms = cluster.device.sms
    if sms <= 0 or hidden_s <= 0:
        return 0.0
    sigma = min(COMM_SMS.get(dispatcher, 0) / sms, 0.5)
    return hidden_s * sigma / (1.0 - sigma)


def _a2a_s(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: str,
) -> tuple[float, float, str, tuple[str, ...]]:
    """The layer's all-to-alls over the ep ranks etp apart: (seconds of the forward pair,
    dispatch + combine; seconds of the backward pair; level; measured tables). HALO-dedup
    sends one row per (token, remote node) in the dispatch, the gate-weighted combine and the
    combine's backward; the dispatch's backward returns a row per (token, choice)
    (runtime/HALO.md), priced as HALO."""
    nbytes = traffic.a2a_bytes(model, layer, training, parallel)
    if nbytes <= 0:
        return 0.0, 0.0, "", ()
    moe = layer.moe
    assert moe is not None  # a2a_bytes is 0 without experts
    ep, etp = parallel.ep, parallel.etp
    if dispatcher == "halo-dedup":
        ratio = comm.dedup_ratio(cluster, ep, moe.num_experts, moe.top_k, etp)
        dedup, level, tables = comm.a2a_time_s(cluster, ep, nbytes, dispatcher, etp, ratio)
        plain, _, _ = comm.a2a_time_s(cluster, ep, nbytes, "halo", etp)
        return 2 * dedup, dedup + plain, level, tables
    if dispatcher != "deepep":
        t, level, tables = comm.a2a_time_s(cluster, ep, nbytes, dispatcher, etp)
        return 2 * t, 2 * t, level, tables
    span = comm.group_span(cluster, ep, etp)
    t = deepep_all_to_all_s(cluster, ep, nbytes / moe.top_k, moe.top_k, moe.num_experts, etp)
    return 2 * t, 2 * t, span.name if span else "", ()


def _sides(work: tuple[Work, ...]) -> tuple[float, float, float, float]:
    """(pre-dispatch forward, backward, mlp forward, backward) compute seconds; the host
    overhead is GPU idle time and hides nothing."""
    gpu = [w for w in work if w.name != "host"]
    af = sum(w.forward_s for w in gpu if w.name not in MLP_SIDE)
    ab = sum(w.time_s - w.forward_s for w in gpu if w.name not in MLP_SIDE)
    mf = sum(w.forward_s for w in work if w.name in MLP_SIDE)
    mb = sum(w.time_s - w.forward_s for w in work if w.name in MLP_SIDE)
    return af, ab, mf, mb


@dataclass(frozen=True)
class LayerComm:
    """A layer's communication per micro-batch (s): exposed and hidden by name, and the
    forward collectives that recompute repeats."""

    exposed: tuple[tuple[str, float], ...]
    hidden: tuple[tuple[str, float], ...]
    repeat_full_s: float  # forward collectives "full" recompute repeats
    repeat_moe_s: float  # forward collectives "moe" recompute repeats
    cp_fwd_s: float  # exposed forward ring: repeated with core attention
    tables: tuple[str, ...]


def layer_comm(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: str,
    work: tuple[Work, ...],
) -> LayerComm:
    """Four all-to-alls per MoE layer (dispatch + combine, forward + backward), TP collectives
    over tp, expert-TP all-gather/reduce-scatter over etp, the cp ring of K/V and FSDP's
    gathers; volumes from planner.resources.traffic, overlap from planner.resources.overlap."""
    exposed: list[tuple[str, float]] = []
    hidden: list[tuple[str, float]] = []
    a2a_fwd, a2a_bwd, level, tables = _a2a_s(model, layer, cluster, training, parallel, dispatcher)
    a2a_full = a2a_fwd + a2a_bwd
    if level:
        shown = a2a_full
        if training.a2a_overlap:
            shown = overlap.paired_a2a_exposed_s(*_sides(work), a2a_full / 4)
            shown = overlap.imperfect_s(shown, a2a_full, cluster.overlap_efficiency)
            hidden.append((f"a2a_{level}", a2a_full - shown))
            shown += sm_contention_s(cluster, dispatcher, a2a_full - shown)
        exposed.append((f"a2a_{level}", shown))
    repeat = [a2a_fwd]  # the forward collectives, which recompute repeats
    if parallel.tp > 1:
        buf = traffic.tp_buffer_bytes(model, training, parallel)
        t, level = comm.ring_allreduce_s(cluster, parallel.tp, 1, buf)
        exposed.append((f"tp_{level}", traffic.tp_allreduces(layer) * t))
        repeat.append(traffic.tp_allreduces(layer) * t / 2)
    etp_buf = traffic.etp_buffer_bytes(model, layer, training, parallel)
    etp_s = 0.0
    if etp_buf > 0:
        t, level = comm.ring_allreduce_s(cluster, parallel.etp, 1, etp_buf, passes=1)
        etp_s = 4 * t
        exposed.append((f"etp_{level}", etp_s))
        repeat.append(etp_s / 2)
    cp_fwd = _cp_ring(model, layer, cluster, training, parallel, work, exposed, hidden)
    params = layer_param_split(model, layer, parallel)
    _fsdp(cluster, training, parallel, work, params, exposed, hidden)
    moe_s = a2a_fwd + etp_s / 2
    return LayerComm(tuple(exposed), tuple(hidden), sum(repeat), moe_s, cp_fwd, tables)


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
    total = 3 * (cp - 1) * step_s
    eta = cluster.overlap_efficiency
    fwd = overlap.imperfect_s(fwd, (cp - 1) * step_s, eta)
    shown = overlap.imperfect_s(shown, total, eta)
    exposed.append((f"cp_{level}", shown))
    hidden.append((f"cp_{level}", total - shown))
    return fwd


def fsdp_gather_s(
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    params: tuple[float, float],
) -> tuple[float, float, str]:
    """(all-gather s, reduce-scatter s, level) of one FSDP unit holding `params` = (dense,
    expert) parameters before sharding: the weights gathered in the compute dtype and the
    gradients reduce-scattered in the FSDP reduce dtype (memory.fsdp_reduce_bytes_per_param),
    over dp x cp ranks tp apart (dense) and edp ranks etp x ep apart (experts)."""
    groups = (
        (parallel.dp * parallel.cp, parallel.tp, params[0]),
        (parallel.edp, parallel.ep * parallel.etp, params[1]),
    )
    gather = reduce = 0.0
    level, worst = "", -1.0
    weight_b = weight_bytes_per_param(training)
    reduce_b = fsdp_reduce_bytes_per_param(training)
    for size, stride, n in groups:
        g, lv = comm.ring_allreduce_s(cluster, size, stride, weight_b * n, 1)
        r, _ = comm.ring_allreduce_s(cluster, size, stride, reduce_b * n, 1)
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
    """Append FSDP's exposed and hidden seconds for one unit (fsdp_exposed_s)."""
    if not training.fsdp:
        return
    level, shown, total = fsdp_exposed_s(cluster, training, parallel, work, params)
    if level:
        exposed.append((f"fsdp_{level}", shown))
        hidden.append((f"fsdp_{level}", total - shown))


def fsdp_exposed_s(
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    work: tuple[Work, ...],
    params: tuple[float, float],
    backward_extra_s: float = 0.0,
) -> tuple[str, float, float]:
    """(level, exposed s, total s) of one FSDP unit per micro-batch: the forward gather behind
    the forward, the backward gather and the reduce-scatter behind the backward (with
    `backward_extra_s` more compute in it: the layer's recompute); held unsharded through the
    step (memory.fsdp_holds_unsharded), one gather and one reduce-scatter per step, divided
    over its micro-batches. Level "" when nothing crosses a link."""
    gather, reduce, level = fsdp_gather_s(cluster, training, parallel, params)
    if not level:
        return "", 0.0, 0.0
    fwd = sum(w.forward_s for w in work)
    bwd = sum(w.time_s for w in work) - fwd + backward_extra_s
    if fsdp_holds_unsharded(training, parallel):
        # one gather and one reduce-scatter per step, spread over its micro-batches: the
        # gather behind the forward, the reduce-scatter behind the backward; no backward gather
        m = parallel.num_microbatches
        total = (gather + reduce) / m
        shown = max(0.0, gather / m - fwd) + max(0.0, reduce / m - bwd)
        return level, overlap.imperfect_s(shown, total, cluster.overlap_efficiency), total
    total = 2 * gather + reduce
    shown = overlap.prefetch_exposed_s(gather, reduce, fwd, bwd)
    return level, overlap.imperfect_s(shown, total, cluster.overlap_efficiency), total
