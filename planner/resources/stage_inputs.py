"""The contract between the resource model and the stage integer program.

The resource model (`planner.resources.cost.stage_cost_inputs`) turns a model, cluster,
training setup and layout into one UnitCost per transformer layer plus the fixed extras of
the first and last pipeline stage. The stage IP (`planner.ip.stage_ip`) only reads these
numbers, so it can be tested against brute force on made-up instances.

Per-stage quantities under 1F1B, stage i of pp (0 = first):
    memory_i = sum(state_bytes) + (pp - i) * sum(act_bytes of kept layers) + extras
    time_i   = sum(time_s or time_recompute_s)  (one micro-batch, forward + backward)
    step     = (num_microbatches + pp - 1) * max_i time_i  (+ p2p, optimizer, exposed dp comm)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitCost:
    """One transformer layer as the stage IP sees it (per rank, per micro-batch)."""

    layer: int
    kind: str  # "dense" | "moe"
    time_s: float  # forward + backward of one micro-batch incl. exposed all-to-all
    time_recompute_s: float  # same when the layer's activations are recomputed
    state_bytes: float  # weights + grads + optimizer state held by one rank for this layer
    act_bytes: float  # activation bytes kept per in-flight micro-batch
    act_recompute_bytes: float  # kept per in-flight micro-batch when recomputed (layer input)


@dataclass(frozen=True)
class StageExtras:
    """Fixed costs of a stage boundary role (embedding on the first stage, head/MTP on the last)."""

    time_s: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0  # per in-flight micro-batch


@dataclass(frozen=True)
class StageCostInputs:
    units: tuple[UnitCost, ...]
    first: StageExtras  # embedding (and anything only stage 0 holds)
    last: StageExtras  # final norm, output head, loss, MTP modules
    usable_memory_bytes: float  # device memory minus framework overhead
    pp: int
    num_microbatches: int
    recompute_allowed: bool  # False when training.recompute == "none"

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations stage `stage` holds at peak under 1F1B."""
        return min(self.pp - stage, self.num_microbatches)
