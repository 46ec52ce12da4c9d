"""Counts of Megatron-Core's (interleaved) 1F1B schedule: warm-up, live chunks, bubble.

A pipeline rank with vp model chunks runs m x vp chunk-micro-batches per step (one chunk,
one micro-batch). Source: Megatron-LM `megatron/core/pipeline_parallel/schedules.py`,
`get_pp_rank_microbatches` (warm-up count) and `get_schedule_table` (order); the bubble is
Narayanan et al. 2021 (arXiv 2104.04473) section 2.2.2. With vp = 1 every count is plain
1F1B's: rank r holds min(pp - r, m) micro-batches, the bubble is (pp - 1) / (m + pp - 1).
"""

from __future__ import annotations


def warmup_chunks(stage: int, pp: int, vp: int, m: int, a2a_overlap: bool) -> int:
    """Forward chunk-micro-batches rank `stage` runs before its first backward.

    Plain 1F1B: pp - r - 1. Interleaved (microbatch group size pp, Megatron's default):
    2 (pp - r - 1) + (vp - 1) pp. The all-to-all overlap (`--overlap-moe-expert-parallel-comm`)
    adds one, so that a forward has a backward to pair with. Capped at all m x vp chunks."""
    warmup = pp - stage - 1 if vp == 1 else 2 * (pp - stage - 1) + (vp - 1) * pp
    return min(warmup + int(a2a_overlap), m * vp)


def live_chunks(stage: int, pp: int, vp: int, m: int, a2a_overlap: bool) -> int:
    """Chunk-micro-batches whose activations rank `stage` holds at peak: the warm-up
    forwards plus the steady phase's one forward before each backward, min(W_r + 1, m vp).

    On rank 0 with m vp >= W_0 + 1 this is pp vp + pp - 1 chunks, i.e. pp stage-micro-batches
    times Megatron-Core's interleaving penalty 1 + (pp - 1) / (pp vp)
    (`megatron/training/theoretical_memory_usage.py`, `compute_activation_memory`).

    The all-to-all overlap's extra warm-up forward does not add a chunk: a paired step runs
    the forward chunk's layers first to last beside the backward chunk's last to first
    (`model_chunk_schedule_plan.py`, `schedule_chunk_1f1b`: `get_layer(i)` with
    `pop_layer()`), so each forward layer's activations arrive as a backward layer's are
    freed; the one layer of overlap is a workspace (`a2a_overlap_layer`)."""
    del a2a_overlap  # the same count with and without the overlap (docstring)
    return min(warmup_chunks(stage, pp, vp, m, False) + 1, m * vp)


def pipeline_slots(pp: int, vp: int, m: int) -> float:
    """Step length in units of one stage-micro-batch (forward + backward of every chunk of
    the rank): m + (pp - 1) / vp; the bubble over the ideal is (pp - 1) / (vp m)."""
    return m + (pp - 1) / vp


def bubble_fraction(pp: int, vp: int, m: int) -> float:
    """Idle share of the step: ((pp - 1) / vp) / (m + (pp - 1) / vp)."""
    return (pp - 1) / vp / pipeline_slots(pp, vp, m)


def unpaired_chunks(stage: int, pp: int, vp: int, m: int) -> int:
    """With the all-to-all overlap, the forwards (and as many backwards) of rank `stage` that
    run alone, outside the steady phase: its warm-up. Megatron pairs one micro-batch's
    forward with another's backward only in steady 1F1B (`combined_1f1b_schedule_for_no_
    pipelining`: the first forward and the last backward run alone)."""
    return warmup_chunks(stage, pp, vp, m, True)
