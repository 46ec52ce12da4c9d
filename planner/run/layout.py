"""Which parallel layouts the runtime executes, and how a plan's stages become model chunks.

Pure Python: `planner.run.spec` calls these while it builds a RunSpec, so a plan the runtime
cannot execute is one SpecError line before any process starts.

- Interleaved 1F1B (vp > 1): pipeline rank s runs vp model chunks; chunk c is virtual stage
  k = c * pp + s (the order torch.distributed.pipelining's interleaved schedules and
  Megatron-Core use), and the virtual stages in order k = 0 .. pp*vp - 1 cover the model's
  layers in order. plan.json's `stages[s].layers` is one run of consecutive layers per
  pipeline rank (the plan's memory and time are per rank: its layer count and kinds); the
  runtime interleaves them by their chunk sizes: virtual stage c * pp + s takes as many
  layers as chunk c of stage s (`planner.parallel.virtual_chunks`), so rank s runs as many
  layers as the plan gives it. With even stages this is Megatron-Core's
  `--num-layers-per-virtual-pipeline-stage` layout: pp = 2, vp = 2, 8 layers -> rank 0 runs
  layers 0-1 and 4-5, rank 1 layers 2-3 and 6-7.
- Context parallel (cp > 1) is refused: its ring attention cannot be checked on gloo.
- Expert tensor parallel (etp > 1) splits every routed expert's FFN width over etp ranks, so
  etp must divide the run model's widths (after `--scale`).

Shape letters: none.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.parallel import virtual_chunks
from planner.specs import ModelSpec, SpecError

EXPORT_HINT = "train it with Megatron-LM: 'piper export PLAN --to megatron'"


def refuse_context_parallel(cp: int) -> None:
    """cp > 1 is one SpecError line naming the Megatron export."""
    if cp > 1:
        raise SpecError(
            f"plan: cp={cp} (context parallel) does not run on this runtime (gloo cannot "
            f"check its ring attention); {EXPORT_HINT}"
        )


def virtual_stages(
    stages: Sequence[Sequence[int]], vp: int, num_layers: int
) -> list[tuple[int, ...]]:
    """The plan's stage layers as pp * vp virtual stages, in virtual order (k = c * pp + s),
    sized by `virtual_chunks` of each stage (module docstring). Raises SpecError unless the
    stages cover the layers in order."""
    if [i for s in stages for i in s] != list(range(num_layers)):
        raise SpecError(f"plan: stages must cover layers 0..{num_layers - 1} in order")
    pp = len(stages)
    for s, layers in enumerate(stages):
        if len(layers) < vp:  # planner.parallel.check_layout lets a chunk hold no layer
            raise SpecError(
                f"plan: stage {s} holds {len(layers)} layers for vp={vp} chunks; this runtime "
                f"gives every chunk a layer (no chunk of only the embedding or the loss); "
                f"{EXPORT_HINT}"
            )
    chunks = [virtual_chunks(tuple(s), vp) for s in stages]
    out, start = [], 0
    for size in (len(chunks[s][c]) for c in range(vp) for s in range(pp)):
        out.append(tuple(range(start, start + size)))
        start += size
    return out


def rank_layers(virtual: Sequence[Sequence[int]], pp: int) -> tuple[tuple[int, ...], ...]:
    """The layers each pipeline rank runs (its chunks' layers, ascending)."""
    return tuple(
        tuple(i for k in range(s, len(virtual), pp) for i in virtual[k]) for s in range(pp)
    )


def check_expert_tp(model: ModelSpec, etp: int) -> None:
    """etp must divide every routed expert's FFN width of the model the run executes."""
    for i, layer in enumerate(model.layers):
        if layer.moe is not None and layer.moe.expert_ffn % etp:
            raise SpecError(
                f"plan: parallel.etp={etp} does not divide run layer {i}'s expert FFN width "
                f"{layer.moe.expert_ffn}; re-plan with an etp that divides it, or run "
                "without --scale"
            )


def check_fsdp(fsdp: bool, migrate_every: int, replicas: bool) -> None:
    """FSDP shards each expert's weights over its expert-DP group; live migration and the
    replicas' gradient sum (runtime/parallel/replicas.py) work on whole experts."""
    if fsdp and migrate_every > 0:
        raise SpecError(
            "--migrate-every with training.fsdp: live migration moves whole experts, FSDP "
            "shards them; leave out --migrate-every or re-plan without --fsdp"
        )
    if fsdp and replicas:
        raise SpecError(
            "plan: training.fsdp with redundant expert slots (experts[].slots): the copies' "
            "gradients are summed as whole experts, FSDP shards them; re-plan without --fsdp "
            "or without replicas"
        )
