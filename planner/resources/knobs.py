"""Which training knobs combine: Megatron-Core's rules, as one line naming the knob and the fix.

The all-to-all overlap (`--overlap-moe-expert-parallel-comm`) is checked by Megatron-LM
`megatron/core/transformer/transformer_config.py` (`__post_init__`): it needs expert
parallelism, no full recompute and no `moe` recompute module (the recomputed dispatch would
run outside the pairing), at most one MTP layer and a pipeline (pp > 1) when MTP trains,
interleaving (vp > 1) when pipelined, and the alltoall or flex dispatcher (Piper's flat or
deepep).
Multi-token prediction does not run with context parallelism (Megatron-LM
`docs/user-guide/features/multi_token_prediction.md`, "Unsupported Combinations").
"""

from __future__ import annotations

from planner.parallel import ParallelConfig
from planner.specs import ModelSpec, TrainingSpec


def knob_conflict(
    model: ModelSpec, training: TrainingSpec, parallel: ParallelConfig, dispatcher: str = "flat"
) -> str:
    """The first rule these knobs break, as one line with the fix; "" when they combine."""
    recompute = parallel.recompute if parallel.recompute != "none" else training.recompute
    mtp = model.num_mtp_layers if training.mtp_layers is None else training.mtp_layers
    if training.a2a_overlap:
        if parallel.ep < 2:
            return "a2a_overlap hides expert-parallel all-to-alls; it needs ep > 1"
        if dispatcher in ("halo", "halo-dedup"):
            return (
                "a2a_overlap runs with the flat (alltoall) or deepep (flex) dispatcher, "
                f"not {dispatcher}"
            )
        if recompute == "full":
            return "a2a_overlap does not run with full recompute; use selective recompute"
        if "moe" in parallel.recompute_modules:
            return "a2a_overlap does not run with the 'moe' recompute module; drop it"
        if mtp > 1:
            return f"a2a_overlap allows at most 1 MTP layer, not {mtp}; set mtp_layers <= 1"
        if mtp and parallel.pp == 1:
            return "a2a_overlap with an MTP layer needs pp > 1; set pp > 1 or mtp_layers 0"
        if parallel.pp > 1 and parallel.vp == 1:
            return "a2a_overlap with pp > 1 needs interleaving; set vp > 1"
        if training.dtype == "fp32":
            return "a2a_overlap needs bf16/fp16 (or fp8) training, not fp32"
    if parallel.cp > 1 and mtp > 0:
        return f"MTP ({mtp} layers) does not run with context parallelism; set mtp_layers 0 or cp 1"
    return ""
