"""Bytes the resource model moves, by kind: the volumes behind its communication times.

The cost code (layer_cost.py, schedule.py) turns these volumes into seconds; `step_traffic`
adds them up into the bytes all ranks send in one optimizer step, by kind, so they can be
set beside what a real run counts (`piper run`'s metrics.jsonl, benchmarks/runtime_bytes.py).
Conventions are the runtime's: a rank's all-to-all sends the share of its rows that goes to
other ranks, (n - 1) / n; a ring collective over n ranks sends passes x (n - 1) / n of its
buffer per rank (all-reduce 2 passes). T = b s / (tp cp) tokens per rank.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.parallel import ParallelConfig
from planner.resources.memory import (
    act_bytes_per_element,
    fsdp_reduce_bytes_per_param,
    grad_bytes_per_param,
    rank_tokens,
    weight_bytes_per_param,
)
from planner.specs import LayerSpec, ModelSpec, TrainingSpec

KINDS = ("dispatch", "p2p", "tp", "grad_dense", "grad_expert", "cp", "etp", "param_gather")


def a2a_bytes(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> float:
    """One of an MoE layer's four all-to-alls, per rank and micro-batch: its T k d routed
    copies (T = b s / (tp cp) with sequence parallelism), x routing skew (the hot rank)."""
    if layer.moe is None or parallel.ep <= 1:
        return 0.0
    a = act_bytes_per_element(training)
    rows = rank_tokens(training, parallel)
    return a * rows * layer.moe.top_k * model.hidden_size * training.routing_skew


def etp_buffer_bytes(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> float:
    """The buffer of one expert-TP all-gather (and reduce-scatter): the etp T k skew routed
    copies of width d a rank of the etp group holds after the gather (Megatron-Core's
    alltoall dispatcher gathers over the expert-TP group after the EP all-to-all,
    `token_dispatcher.py`, `gather_from_sequence_parallel_region(group=expt_tp)`)."""
    if layer.moe is None or parallel.etp <= 1:
        return 0.0
    a = act_bytes_per_element(training)
    copies = rank_tokens(training, parallel) * layer.moe.top_k * training.routing_skew
    return a * parallel.etp * copies * model.hidden_size


def cp_kv_bytes(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> float:
    """One step of the context-parallel ring: the K and V of the rank's s / cp tokens for its
    heads (Transformer Engine `AttnFuncWithCPAndKVP2P`, Megatron's `--cp-comm-type p2p`):
    a b (s / cp) (n_kv / tp) (d_k + d_v). MLA exchanges the up-projected per-head K and V."""
    if parallel.cp <= 1:
        return 0.0
    att = layer.attention
    if att.kind == "mla":
        width = att.num_heads * (att.qk_nope_head_dim + att.qk_rope_head_dim + att.v_head_dim)
    else:
        width = att.num_kv_heads * 2 * att.head_dim
    a = act_bytes_per_element(training)
    return a * rank_tokens(training, parallel) * width


def tp_buffer_bytes(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> float:
    """The b (s / cp) d activation a TP all-reduce equivalent moves (per micro-batch)."""
    a = act_bytes_per_element(training)
    return a * parallel.micro_batch * training.seq_len * model.hidden_size / parallel.cp


def tp_allreduces(layer: LayerSpec) -> int:
    """All-reduce equivalents of tp_buffer_bytes per layer and micro-batch: two (forward and
    backward; sequence parallelism's all-gather + reduce-scatter pair moves the same bytes)
    for attention and for each TP-sharded MLP: a dense MLP, and the shared experts. Routed
    experts are not split by TP (etp splits them), so an MoE block without shared experts
    adds none."""
    moe = layer.moe
    shared = bool(moe and moe.num_shared_experts and moe.shared_ffn)
    return 2 * (1 + bool(layer.dense_ffn) + shared)


def p2p_bytes(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> float:
    """One pipeline send (an activation forward or its gradient backward): a T d."""
    a = act_bytes_per_element(training)
    return (
        a
        * parallel.micro_batch
        * training.seq_len
        / (parallel.tp * parallel.cp)
        * model.hidden_size
    )


def _ring(n: int, nbytes: float, passes: int = 2) -> float:
    return passes * (n - 1) / n * nbytes if n > 1 else 0.0


def step_traffic(
    model: ModelSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    stage_layers: Sequence[Sequence[int]],
    params_dense: Sequence[float],
    params_expert: Sequence[float],
) -> dict[str, float]:
    """Bytes all ranks send in one optimizer step, by kind (KINDS).

    params_dense / params_expert: parameters one rank of each stage holds (the resource
    model's stage counts), whose gradients it reduces: once per step over dp x cp (dense) and
    edp (experts), or with FSDP a reduce-scatter per micro-batch in the FSDP reduce dtype plus
    two all-gathers of the weights in the compute dtype (forward and backward,
    `param_gather`).
    """
    pp, tp, ep, etp, cp = parallel.pp, parallel.tp, parallel.ep, parallel.etp, parallel.cp
    m, block = parallel.num_microbatches, parallel.dp * tp * cp  # micro-batches; ranks per stage
    out = dict.fromkeys(KINDS, 0.0)
    tp_buf = tp_buffer_bytes(model, training, parallel)
    for layers in stage_layers:
        for i in layers:
            layer = model.layers[i]
            a2a = a2a_bytes(model, layer, training, parallel)
            out["dispatch"] += block * m * 4 * _ring(ep, a2a, passes=1)
            out["tp"] += block * m * tp_allreduces(layer) * _ring(tp, tp_buf)
            out["etp"] += (
                block
                * m
                * 4
                * _ring(etp, etp_buffer_bytes(model, layer, training, parallel), passes=1)
            )
            # forward: cp - 1 K/V sends; backward: cp - 1 sends of K/V with their gradients
            out["cp"] += block * m * 3 * (cp - 1) * cp_kv_bytes(model, layer, training, parallel)
    out["p2p"] = 2 * m * (pp * parallel.vp - 1) * block * p2p_bytes(model, training, parallel)
    g, fsdp_g = grad_bytes_per_param(training), fsdp_reduce_bytes_per_param(training)
    groups = (
        (parallel.dp * cp, params_dense, "grad_dense"),
        (parallel.edp, params_expert, "grad_expert"),
    )
    for size, params, kind in groups:
        for held in params:
            if training.fsdp:
                out[kind] += block * m * _ring(size, fsdp_g * held, passes=1)
                out["param_gather"] += (
                    block * m * 2 * _ring(size, weight_bytes_per_param(training) * held, passes=1)
                )
            else:
                out[kind] += block * _ring(size, g * held)
    return out
