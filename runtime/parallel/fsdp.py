"""FSDP: weights, gradients and optimizer state sharded with torch's `fully_shard` (FSDP2).

With the plan's `training.fsdp`, every model chunk of this rank is wrapped bottom-up, one
FSDP unit per group of parameters that is replicated alike:
- each MoE layer's routed experts over the expert-DP group (the replicas of those experts),
  their reduce-scatter dividing by dp (summed over edp and divided by dp, as the replicated
  sync does: each expert already holds its EP group's gradient);
- each transformer block (attention, norms, dense MLP, router, shared experts) and then the
  chunk itself (embedding, final norm, head) over the data-parallel group, averaged over dp.
Parameters stay sharded on dim 0 between steps (DTensor shards), and the Adam state built on
them is sharded alike. A unit all-gathers its parameters before its forward and again
before its backward (reshard after forward; the chunk's root unit keeps its parameters
between the two, FSDP2's default), and reduce-scatters its gradients after every
micro-batch's backward, accumulating into its gradient shards, so gradients stay sharded
too (ZeRO-3; with pp > 1 pp_schedule.CountingStage keeps that, where torch's pipelining would
hold whole gradients until the step's last backward).
With tp > 1, the weights whose gradients are partial over the TP group (norms, routers,
row-parallel biases, gates: StageModule.tp_partial_parameters) stay replicated (FSDP's
ignored parameters) and are reduced by pipeline.sync_gradients as without FSDP; they are a
few vectors per layer.

Mixed precision (`mp_policy`, with bf16 / fp16 compute): FSDP2's
MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=fp32): the fp32 shards stay the
master weights Adam updates; each all-gather casts the shards to the compute dtype first, so
it sends half the bytes and the gathered (transient) weights are bf16; the gradients of
those weights come out in bf16 and are cast to fp32 before the reduce-scatter, which sums
and accumulates into the fp32 gradient shards (torch/distributed/fsdp/_fully_shard/
_fsdp_api.py:14-54 in torch 2.13). This is Megatron-Core's distributed optimizer's
arrangement: bf16 parameters all-gathered in bf16 (param_and_grad_buffer.py:1184-1187, the
buffer in the parameters' dtype) and fp32 gradients reduce-scattered (arguments.py:1209-1217
sets accumulate_allreduce_grads_in_fp32 for bf16; NVIDIA/Megatron-LM
d98e8a64ddf34856e74b24714e3bedb2f5a39553).

Bytes are counted by the collectives FSDP calls (set_custom_all_gather /
set_custom_reduce_scatter), ring model: each all-gather sends (n - 1)/n of the gathered
buffer (kind param_gather, planner.resources.traffic's name), each reduce-scatter
(n - 1)/n of the whole gradient buffer (kind grad_dense or grad_expert).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from runtime.metrics import ByteCounter
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh


class _CountingComm:
    """An FSDP collective (all-gather or reduce-scatter) that records its bytes."""

    def __init__(self, counter: ByteCounter, kind: str, members: list[int]) -> None:
        self.counter, self.kind, self.members = counter, kind, members

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _count(self, whole: torch.Tensor) -> None:
        self.counter.add_ring(self.kind, whole.numel() * whole.element_size(), self.members, 1)


class _AllGather(_CountingComm):
    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self._count(output_tensor)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReduceScatter(_CountingComm):
    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self._count(input_tensor)
        return dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


def mp_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """The module docstring's policy: parameters gathered in `param_dtype` (None: in their
    fp32), gradients reduced in fp32."""
    reduce = torch.float32 if param_dtype is not None else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)


def _shard(module, mesh: DeviceMesh, members, counter, grad_kind, ignored, policy) -> FSDPModule:
    unit = fully_shard(module, mesh=mesh, ignored_params=ignored or None, mp_policy=policy)
    unit.set_custom_all_gather(_AllGather(counter, "param_gather", members))
    unit.set_custom_reduce_scatter(_ReduceScatter(counter, grad_kind, members))
    return unit


def shard_chunk(
    chunk: StageModule,
    mesh: Mesh,
    dp: int,
    counter: ByteCounter,
    param_dtype: torch.dtype | None = None,
) -> None:
    """Wrap one model chunk in FSDP units (module docstring), in place; before the optimizer
    is built, since its parameters become DTensor shards. `param_dtype`: the compute dtype the
    units all-gather in (None: fp32)."""
    policy = mp_policy(param_dtype)
    device = next(chunk.parameters()).device.type
    dp_mesh = DeviceMesh.from_group(mesh.dp_group, device)
    edp_mesh = DeviceMesh.from_group(mesh.edp_group, device)
    ignored = set(chunk.tp_partial_parameters())
    marks = {n: _tp_marks(p) for n, p in chunk.named_parameters()}
    for _, block in chunk.indexed_blocks():  # the MTP modules' blocks too
        if block.moe is not None:
            experts = _shard(
                block.moe.experts, edp_mesh, mesh.edp_ranks, counter, "grad_expert", set(), policy
            )
            experts.set_gradient_divide_factor(float(dp))
            wide = mesh.edp_group.size() not in (1, dp)  # 1: FSDP reduces nothing
            if wide and dist.get_backend(mesh.edp_group) == "gloo":
                # a divide factor other than the group's size is NCCL's PreMulSum, which gloo
                # lacks: sum, then divide by dp after the reduce-scatter (the same gradients)
                experts.set_force_sum_reduction_for_comms(True)
        _shard(block, dp_mesh, mesh.dp_ranks, counter, "grad_dense", ignored, policy)
    _shard(chunk, dp_mesh, mesh.dp_ranks, counter, "grad_dense", ignored, policy)
    for name, p in chunk.named_parameters():  # fully_shard made new parameters
        vars(p).update(marks[name])


def _tp_marks(p: torch.Tensor) -> dict:
    """The TP marks of a parameter (tensor_parallel.tp_layout reads them, checkpoints too)."""
    return {k: v for k, v in vars(p).items() if k.startswith("tp_")}
