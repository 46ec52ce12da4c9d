"""The contract between the resource model and the stage integer program.

The resource model (`planner.resources.cost.stage_cost_inputs`) turns a model, cluster,
training setup and layout into one UnitCost per transformer layer plus the fixed extras of
the first and last pipeline stage. The stage IP (`planner.ip.stage_ip`) only reads these
numbers, so it can be tested against brute force on made-up instances.

Per-stage quantities, stage i of pp (0 = first), each rank holding vp interleaved chunks:
    memory_i = sum(state_bytes) + in_flight(i) * sum(act_bytes of kept layers) + extras
    time_i   = sum(time_s or time_recompute_s)  (one micro-batch through every chunk, fwd + bwd)
    step     = pipeline_slots * max_i time_i  (+ p2p, optimizer, exposed dp comm)
in_flight(i) counts live chunk-micro-batches (planner.resources.interleave.live_chunks), so a
unit's act_bytes are its layer's activations per micro-batch divided by vp: a layer sits in
one of its rank's vp chunks and the live chunks spread over them (exact for even chunks;
Megatron-Core's averaged interleaving penalty otherwise). With vp = 1 this is plain 1F1B:
in_flight(i) = min(pp - i, m), act_bytes per micro-batch, pipeline_slots = m + pp - 1.
With the all-to-all overlap, time_s is the steady-phase (paired) time of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.resources.interleave import live_chunks, pipeline_slots


@dataclass(frozen=True)
class UnitCost:
    """One transformer layer as the stage IP sees it (per rank, per micro-batch)."""

    layer: int
    kind: str  # "dense" | "moe"
    time_s: float  # forward + backward of one micro-batch incl. exposed communication
    time_recompute_s: float  # same when the layer's activations are recomputed
    state_bytes: float  # weights + grads + optimizer state held by one rank for this layer
    act_bytes: float  # activation bytes kept per live chunk-micro-batch (per micro-batch / vp)
    act_recompute_bytes: float  # the same when recomputed


@dataclass(frozen=True)
class StageExtras:
    """Fixed costs of a stage boundary role (embedding on the first stage, head/MTP on the last)."""

    time_s: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0  # per live chunk-micro-batch, like UnitCost.act_bytes


@dataclass(frozen=True)
class StageCostInputs:
    units: tuple[UnitCost, ...]
    first: StageExtras  # embedding (and anything only stage 0 holds)
    last: StageExtras  # final norm, output head, loss, MTP modules
    usable_memory_bytes: float  # device memory minus framework overhead and workspaces
    pp: int
    num_microbatches: int
    recompute_allowed: bool  # False when training.recompute == "none"
    vp: int = 1  # interleaved model chunks per pipeline rank
    a2a_overlap: bool = False  # one more warm-up chunk (Megatron's all-to-all overlap)

    def in_flight(self, stage: int) -> int:
        """Chunk-micro-batches whose activations stage `stage` holds at peak."""
        return live_chunks(stage, self.pp, self.vp, self.num_microbatches, self.a2a_overlap)

    @property
    def pipeline_slots(self) -> float:
        """The step in units of the bottleneck stage's time: m + (pp - 1) / vp."""
        return pipeline_slots(self.pp, self.vp, self.num_microbatches)
