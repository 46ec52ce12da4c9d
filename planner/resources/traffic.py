"""Bytes the resource model moves, by kind: the volumes behind its communication times.

The cost code (layer_cost.py, schedule.py) turns these volumes into seconds; `step_traffic`
adds them up into the bytes all ranks send in one optimizer step, by kind, so they can be
set beside what a real run counts (`piper run`'s metrics.jsonl, benchmarks/runtime_bytes.py).
Conventions are the runtime's: a rank's all-to-all sends the share of its rows that goes to
other ranks, (n - 1) / n; a ring collective over n ranks sends passes x (n - 1) / n of its
buffer per rank (all-reduce 2 passes).
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.parallel import ParallelConfig
from planner.resources.memory import act_bytes_per_element
from planner.specs import LayerSpec, ModelSpec, TrainingSpec

KINDS = ("dispatch", "p2p", "tp", "grad_dense", "grad_expert")


def a2a_bytes(
    model: ModelSpec, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> float:
    """One of an MoE layer's four all-to-alls, per rank and micro-batch: its T k d routed
    copies (T = b s / tp with sequence parallelism), x routing skew (the hot rank)."""
    if layer.moe is None or parallel.ep <= 1:
        return 0.0
    a = act_bytes_per_element(training)
    rows = parallel.micro_batch * training.seq_len / parallel.tp
    return a * rows * layer.moe.top_k * model.hidden_size * training.routing_skew


def tp_buffer_bytes(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> float:
    """The b s d activation a TP all-reduce equivalent moves (per micro-batch)."""
    a = act_bytes_per_element(training)
    return a * parallel.micro_batch * training.seq_len * model.hidden_size


def tp_allreduces(layer: LayerSpec) -> int:
    """All-reduce equivalents of tp_buffer_bytes per layer and micro-batch: two (forward and
    backward; sequence parallelism's all-gather + reduce-scatter pair moves the same bytes)
    for attention and for each TP-sharded MLP: a dense MLP, and the shared experts. Routed
    experts are not split by TP, so an MoE block without shared experts adds none."""
    moe = layer.moe
    shared = bool(moe and moe.num_shared_experts and moe.shared_ffn)
    return 2 * (1 + bool(layer.dense_ffn) + shared)


def p2p_bytes(model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig) -> float:
    """One pipeline send (an activation forward or its gradient backward): a (b s / tp) d."""
    a = act_bytes_per_element(training)
    return a * parallel.micro_batch * training.seq_len / parallel.tp * model.hidden_size


def grad_bytes_per_param(training: TrainingSpec) -> int:
    """2 (the paper's 16 B/param: bf16 gradients) or 4 (Megatron's 18: fp32 gradients)."""
    return training.bytes_per_param - 14


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
    model's stage counts), whose gradients it reduces.
    """
    pp, dp, tp, ep = parallel.pp, parallel.dp, parallel.tp, parallel.ep
    m, block = parallel.num_microbatches, dp * tp  # micro-batches; ranks per stage
    out = dict.fromkeys(KINDS, 0.0)
    tp_buf = tp_buffer_bytes(model, training, parallel)
    for layers in stage_layers:
        for i in layers:
            layer = model.layers[i]
            a2a = a2a_bytes(model, layer, training, parallel)
            out["dispatch"] += block * m * 4 * _ring(ep, a2a, passes=1)
            out["tp"] += block * m * tp_allreduces(layer) * _ring(tp, tp_buf)
    out["p2p"] = 2 * m * (pp - 1) * block * p2p_bytes(model, training, parallel)
    g = grad_bytes_per_param(training)
    edp = parallel.edp
    for dense, expert in zip(params_dense, params_expert, strict=True):
        out["grad_dense"] += block * _ring(dp, g * dense)
        out["grad_expert"] += block * _ring(edp, g * expert)
    return out
