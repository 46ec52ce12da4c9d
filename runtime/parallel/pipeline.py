"""Pipeline stages and schedule (torch.distributed.pipelining) and the gradient sync.

Each pipeline rank runs vp model chunks (StageModules); chunk c is virtual stage c * pp + s
of pp * vp (planner/run/layout.py). With vp = 1 the schedule is `Schedule1F1B` from
torch.distributed.pipelining (GPipe when micro-batches < pp, which 1F1B refuses); with vp > 1
it is `ScheduleInterleaved1F1B` (Narayanan et al. 2021, "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", section 2.2), both with the library's
runtime shape inference. The interleaved schedule assumes process-group rank g runs virtual
stages g, g + pp, ...; when the plan's pipeline order is not the group's sorted order
(a permuted rank table), `PlanOrderInterleaved1F1B` gives group rank g the actions of its
plan position, and the library derives the stage -> rank map from those actions. These
library pieces live in runtime/parallel/pp_schedule.py, imported only when pp > 1.
(Declaring static shapes with input/output args and grads, in torch 2.13 on gloo, left the
first stage with zero gradients, which the single-device oracle test caught; without grads
the static path refuses to run backward.) pp = 1 runs the same micro-batch loop by hand
(forward, backward of loss / num_microbatches), which is what the schedule does.
The activations sent and received are in the compute dtype (bf16 under the trainer's
autocast, runtime/RUNTIME.md "Precision"): the library's shape inference, on the first
step, takes each receive buffer's dtype from the sending stage's output, so the compute
dtype must not change after it.

Gradient sync after the schedule: dense parameters are averaged over the stage's
data-parallel group; expert parameters are summed over the expert-DP group and divided by
dp (each expert already received the gradients of the whole EP group's tokens through the
all-to-all backward), which makes the update equal to a single-device step on the global
batch. With MTP modules and pp > 1, the last stage's copy of the embedding and the first
stage's embedding exchange their gradients and both take the sum (Megatron-Core's
embedding-group all-reduce, megatron/core/distributed/finalize_model_grads.py:190-235 at
NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553), so the copies stay equal.
Shape letters: B = sequences, S = sequence length, D = hidden, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.metrics import ByteCounter
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh
from runtime.parallel.replicas import sum_replica_gradients


class RankChunks(nn.Module):
    """The vp model chunks of one pipeline rank, seen as one module by the trainer: its
    MoE layers, parameters and their kinds are those of all chunks (layers ascending)."""

    def __init__(self, chunks: list[StageModule]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.first, self.last = chunks[0].first, chunks[-1].last

    def moe_layers(self) -> dict:
        return {i: m for c in self.chunks for i, m in c.moe_layers().items()}

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks for p in c.expert_parameters()]

    def dense_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks for p in c.dense_parameters()]

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        return [p for c in self.chunks for p in c.tp_partial_parameters()]


def chunks_of(module: StageModule | RankChunks) -> list[StageModule]:
    """The model chunks of a rank's module, in chunk order."""
    return list(module.chunks) if isinstance(module, RankChunks) else [module]


class PipelineRunner:
    """Runs one optimizer step's forward/backward over the micro-batches of one replica.

    Args:
        module: this rank's StageModule, or RankChunks with vp > 1. mesh: its groups.
        virtual: the virtual stage index of each chunk (RunSpec.chunks). num_microbatches:
        per step. counter: where p2p bytes are recorded. device: torch device.
    """

    def __init__(
        self,
        module: StageModule | RankChunks,
        mesh: Mesh,
        virtual: list[int],
        num_microbatches: int,
        counter: ByteCounter,
        device: torch.device,
    ) -> None:
        self.module, self.mesh, self.m = module, mesh, num_microbatches
        self.mtp_losses: list[float] | None = None  # last step's mean CE_k per MTP depth
        pp = len(mesh.pp_ranks)
        self.schedule = None
        if pp == 1:
            return
        # torch.distributed.pipelining (and the torch._dynamo it imports) only when pp > 1
        from runtime.parallel.pp_schedule import CountingStage, make_schedule

        order = sorted(mesh.pp_ranks)
        group_rank = [order.index(r) for r in mesh.pp_ranks]  # by plan position
        n = pp * len(virtual)
        stages = []
        for k, chunk in zip(virtual, chunks_of(module), strict=True):
            stage = CountingStage(chunk, k, n, device, group=mesh.pp_group)
            stage.stage_index_to_group_rank = {v: group_rank[v % pp] for v in range(n)}
            stage.counter = counter
            stages.append(stage)
        loss_fn = chunks_of(module)[-1].loss  # with TP: the vocab-parallel cross entropy
        position = {g: s for s, g in enumerate(group_rank)}
        self.schedule = make_schedule(stages, num_microbatches, loss_fn, position)

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float | None:
        """Forward + backward of every micro-batch; returns the mean loss on the last stage.
        With MTP that is the main next-token loss (the objective adds the MTP losses) and
        `mtp_losses` holds the mean CE_k of each depth."""
        loss = self._run(inputs_BS, targets_BS)
        last = chunks_of(self.module)[-1]
        if last.mtp is None or loss is None:
            return loss
        main, depth = zip(*last.loss_parts, strict=True)
        last.loss_parts.clear()
        self.mtp_losses = [float(x) for x in torch.stack(depth).mean(dim=0)]
        return float(torch.stack(main).mean())

    def _run(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float | None:
        if self.schedule is None:
            return self._step_by_hand(inputs_BS, targets_BS)
        losses: list[torch.Tensor] = []
        if self.module.first:
            self.schedule.step(inputs_BS)
        elif self.module.last:
            self.schedule.step(target=targets_BS, losses=losses)
        else:
            self.schedule.step()
        if self.module.last:
            return float(torch.stack([x.detach() for x in losses]).mean())
        return None

    def _step_by_hand(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> float:
        """pp = 1: forward, backward of loss / m per micro-batch."""
        total, loss_fn = 0.0, chunks_of(self.module)[-1].loss
        for x, y in zip(inputs_BS.chunk(self.m), targets_BS.chunk(self.m), strict=True):
            loss = loss_fn(self.module(x), y) / self.m
            loss.backward()
            total += float(loss.detach())
        return total


def _allreduce_mean(
    params, group, members: list[int], divisor: int, counter: ByteCounter, kind: str
) -> None:
    """Sum the grads of `params` over `group` in one flat buffer and divide by `divisor`;
    FSDP's sharded parameters (DTensors) are skipped: their reduce-scatter did it."""
    params = [p for p in params if not isinstance(p, DTensor)]  # FSDP reduced its own
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if len(members) > 1:
        dist.all_reduce(flat, group=group)
        counter.add_allreduce(kind, flat.numel() * flat.element_size(), members)
    flat /= divisor
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def sync_mtp_embedding(module: StageModule | RankChunks, mesh: Mesh, counter: ByteCounter) -> None:
    """First and last pipeline rank of a model with MTP and an untied embedding copy
    (StageModule.syncs_mtp_embedding): each sends its embedding gradient (this TP rank's
    vocabulary rows, or its FSDP shard of them) to the other and both keep the same sum
    (module docstring). Other ranks: nothing."""
    chunks = chunks_of(module)
    chunk = chunks[0] if chunks[0].first else chunks[-1]
    if len(mesh.pp_ranks) == 1 or not chunk.syncs_mtp_embedding:
        return
    weight = chunk.embed.weight if chunk.first else chunk.mtp_embed.weight
    peer = mesh.pp_ranks[-1] if chunk.first else mesh.pp_ranks[0]
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    mine = (grad.to_local() if isinstance(grad, DTensor) else grad).contiguous()
    theirs = torch.empty_like(mine)
    ops = [
        dist.P2POp(dist.isend, mine, peer, mesh.pp_group),
        dist.P2POp(dist.irecv, theirs, peer, mesh.pp_group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    counter.add("grad_embedding", mine.numel() * mine.element_size(), peer)
    total = mine + theirs if chunk.first else theirs + mine  # first + last on both
    if isinstance(grad, DTensor):
        grad.to_local().copy_(total)
        weight.grad = grad
    else:
        weight.grad = total


def sync_gradients(module: StageModule, mesh: Mesh, dp: int, counter: ByteCounter) -> None:
    """Dense grads: mean over the dp ranks (same stage and tp_idx). Expert grads: sum over
    edp, / dp, then over the copies of each replicated expert (runtime/parallel/replicas.py).
    With tp > 1, the replicated weights that saw only this rank's tokens or heads
    (StageModule.tp_partial_parameters: norms, routers, row-parallel biases, gates) are
    first summed over the TP group. With MTP and pp > 1, the embedding copies' gradients
    are summed first (sync_mtp_embedding)."""
    sync_mtp_embedding(module, mesh, counter)
    if len(mesh.tp_ranks) > 1:
        partial = module.tp_partial_parameters()
        _allreduce_mean(partial, mesh.tp_group, mesh.tp_ranks, 1, counter, "grad_tp")
    _allreduce_mean(
        module.dense_parameters(), mesh.dp_group, mesh.dp_ranks, dp, counter, "grad_dense"
    )
    _allreduce_mean(
        module.expert_parameters(), mesh.edp_group, mesh.edp_ranks, dp, counter, "grad_expert"
    )
    sum_replica_gradients(module, mesh, counter)
